"""What a drafter that runs a network costs, measured while it drafts.

The goodput gate weighs a costly drafter's tokens by `draft_cost`: target forwards per drafted
token. A static estimate (weights multiplied, `HeadDrafter.weights_cost`) misses everything but
the products — the drafter's norms, attention and Python per step — and on a small target those
dominate: a head step estimated at 0.08 target forwards measured about 0.2 on the dev prompts.
`CostMeter` keeps an exponential moving average of the seconds a proposal takes per drafted
token and divides it by the seconds of one target decoding step (`one_row_seconds`, measured
when the drafter is built), never going below the static estimate.

A head's teacher-forced catch-up over the committed positions it has not run yet is not
counted: every position is caught up once, whenever the head drafts next, so it is a cost per
emitted token of having the head at all, not of drafting this round. Counting it made the
gate's price of a token after idle rounds several times the price of a token in steady
drafting, so a head the gate had turned off stayed off.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class CostMeter:
    """A drafter's cost in target forwards per drafted token, from its timed proposals."""

    target_seconds: float  # one target decoding step
    floor: float  # the static estimate: the cost before any measurement, and the least
    rate: float = 0.2  # weight of a new proposal in the average
    clock: Callable[[], float] = time.perf_counter
    per_token: float | None = field(default=None, init=False)  # seconds per drafted token

    def __post_init__(self) -> None:
        if not self.target_seconds > 0:
            raise ValueError(f"target_seconds must be > 0, got {self.target_seconds}")
        if not self.floor >= 0:
            raise ValueError(f"floor must be >= 0, got {self.floor}")
        if not 0 < self.rate <= 1:
            raise ValueError(f"rate must be in (0, 1], got {self.rate}")

    def observe(self, seconds: float, tokens: int) -> None:
        """A proposal of `tokens` drafted tokens took `seconds` (nothing drafted: ignored)."""
        if tokens <= 0:
            return
        each = seconds / tokens
        self.per_token = each if self.per_token is None else (
            (1 - self.rate) * self.per_token + self.rate * each
        )  # fmt: skip

    @property
    def cost(self) -> float:
        """Target forwards per drafted token."""
        if self.per_token is None:
            return self.floor
        return max(self.floor, self.per_token / self.target_seconds)
