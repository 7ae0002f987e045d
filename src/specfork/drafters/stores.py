"""What the drafters of one `Generator` share across its requests (the process-wide stores a
drafter builder receives): today the suffix index that `--drafter suffix` drafts from.

A Generator makes one (or is given one) and hands it to every strategy it builds, so all its
requests — alone, batched, in the server — learn from each other; two Generators share nothing
unless given the same stores.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specfork.drafters.suffix_index import SuffixIndex


@dataclass(frozen=True, slots=True)
class DraftStores:
    """The stores shared by a Generator's drafters: `suffix`, the suffix index of every
    request's prompt and output (bounded, thread-safe)."""

    suffix: SuffixIndex = field(default_factory=SuffixIndex)
