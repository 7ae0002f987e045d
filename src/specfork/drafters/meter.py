"""What a drafter that runs a network costs, measured while it drafts.

The goodput gate weighs a costly drafter's tokens by `draft_cost`: target forwards per drafted
token. A static estimate (weights multiplied, `HeadDrafter.weights_cost`) misses everything but
the products — the drafter's norms, attention and Python per step — and on a small target those
dominate: a head step estimated at 0.08 target forwards measured about 0.2 on the dev prompts.
`CostMeter` keeps the seconds per drafted token of the last `window` proposals and takes their
lower quartile (the least of them while there are fewer than five), divided by the seconds of
one target decoding step (`one_row_seconds`, measured when the drafter is built), never going
below the static estimate. Timing noise only ever adds time, and a process's first proposals
run on cold caches: a moving average took a first proposal 4-5 times the usual as the price of
a token, the gate turned the head off, and with only its exploration rounds (one in 16) left to
correct the average, a whole first request (the CLI's only one) drafted little.

A head's teacher-forced catch-up over the committed positions it has not run yet is not
counted: every position is caught up once, whenever the head drafts next, so it is a cost per
emitted token of having the head at all, not of drafting this round. Counting it made the
gate's price of a token after idle rounds several times the price of a token in steady
drafting, so a head the gate had turned off stayed off.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from specfork.checks import is_int


@dataclass
class CostMeter:
    """A drafter's cost in target forwards per drafted token, from its timed proposals."""

    target_seconds: float  # one target decoding step
    floor: float  # the static estimate: the cost before any measurement, and the least
    window: int = 16  # proposals remembered
    clock: Callable[[], float] = time.perf_counter
    recent: deque[float] = field(init=False, repr=False)  # seconds per drafted token, latest last

    def __post_init__(self) -> None:
        if not self.target_seconds > 0:
            raise ValueError(f"target_seconds must be > 0, got {self.target_seconds}")
        if not self.floor >= 0:
            raise ValueError(f"floor must be >= 0, got {self.floor}")
        if not is_int(self.window) or self.window < 1:
            raise ValueError(f"window must be an integer >= 1, got {self.window!r}")
        self.recent = deque(maxlen=self.window)

    def observe(self, seconds: float, tokens: int) -> None:
        """A proposal of `tokens` drafted tokens took `seconds` (nothing drafted: ignored)."""
        if tokens > 0:
            self.recent.append(seconds / tokens)

    @property
    def per_token(self) -> float | None:
        """Seconds per drafted token: the lower quartile of the recent proposals (None before
        the first)."""
        if not self.recent:
            return None
        return sorted(self.recent)[(len(self.recent) - 1) // 4]

    @property
    def cost(self) -> float:
        """Target forwards per drafted token."""
        each = self.per_token
        return self.floor if each is None else max(self.floor, each / self.target_seconds)
