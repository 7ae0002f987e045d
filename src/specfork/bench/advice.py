"""Advice a bench run ends with: where speculation pays when the prompts gave it little.

First-turn chat prompts (the built-in ones, Spec-Bench's) give drafters little to copy, so a
first bench can show speculation near plain decoding's speed; the workloads shipped with the
bench (agents, code edits, later chat turns, RAG) are where it pays. A run whose best specfork
strategy stays below `PAYS` on prompts that are not those workloads gets a note naming them.
"""

from __future__ import annotations

import statistics
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from specfork.bench.workloads import WORKLOADS

PAYS = 1.3  # below this best median speedup, the run is told where speculation pays


def where_speculation_pays(
    rows: Sequence[Mapping[str, Any]], speculative: Collection[str]
) -> str | None:
    """A note when the best of the `speculative` strategies' median speedups over the rows of
    non-workload prompts is below `PAYS`; None when it is not, or nothing was measured."""
    best: tuple[float, str] | None = None
    for label in speculative:
        speedups = [
            r["speedup"]
            for r in rows
            if r["strategy"] == label and r["category"] not in WORKLOADS and r["speedup"]
        ]
        if speedups and (best is None or statistics.median(speedups) > best[0]):
            best = (statistics.median(speedups), label)
    if best is None or best[0] >= PAYS:
        return None
    return (
        f"the best strategy here, {best[1]}, ran at {best[0]:.2f}× plain decoding: these prompts "
        "give drafters little to copy. Speculation pays where text repeats — agents' tool calls, "
        "code edits, later chat turns, answers quoting a document: `specfork bench --workload "
        "all` measures those (docs/benchmarks.md, 'Workloads')"
    )
