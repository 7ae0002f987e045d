"""What verifying a draft costs the host, priced in one-row forwards for the goodput gates.

A gate keeps the draft length k that maximises expected tokens over the forward's cost c(k + 1)
(`strategies.goodput`). A round that verifies a draft also costs host work a plain step does
not: the verification rule over k + 1 rows, the cache's rollback, the drafter's and the gate's
bookkeeping (0.15-0.3 ms a round on two cores). Beside a 2 ms forward that is a tenth of a
step, and where a draft barely pays by the curve — sampled text at a 4k-token context, one
drafted token accepted a fifth of the time, c(2) = 1.17 — it is what turns a small gain into a
loss (every strategy measured 0.92-0.98× plain decoding there).

`VerifyOverhead` keeps, per strategy, the host seconds (prepare, accept, commit and learn) of a
lone request's recent rounds that verified a draft and of those that did not, and the forward
seconds of the latter scaled to one context by the cost curve's one-row growth. `price(context)`
is the difference of the two medians over a one-row forward's time at `context`: what a gate
adds to the cost of any k ≥ 1. Until both kinds of round have been seen `MIN_ROUNDS` times the
price is 0 (the curve alone decides, as before). The drafting itself is not counted: it is
spent before the gate decides, whatever it decides.
"""

from __future__ import annotations

import statistics
import threading
from collections import deque
from collections.abc import Callable

WINDOW = 64  # rounds of each kind kept
MIN_ROUNDS = 8  # rounds of each kind before there is a price
HOST_PHASES = ("prepare", "accept", "commit", "learn")  # a round's host work after drafting


class VerifyOverhead:
    """Recent rounds' host seconds of one strategy (see the module doc); thread-safe.
    `step_at(tokens)`: a one-row forward's time after `tokens` cached tokens relative to the
    cost curve's own context."""

    def __init__(self, step_at: Callable[[int], float]) -> None:
        self.step_at = step_at
        self._verified: deque[float] = deque(maxlen=WINDOW)  # host seconds
        self._plain: deque[float] = deque(maxlen=WINDOW)  # host seconds
        self._forward: deque[float] = deque(maxlen=WINDOW)  # plain forwards, scaled seconds
        self._lock = threading.Lock()

    def add(self, verified: bool, host: float, forward: float, context: int) -> None:
        """A lone request's round after `context` cached tokens: whether it verified a draft,
        its host seconds (HOST_PHASES) and its forward's seconds."""
        with self._lock:
            if verified:
                self._verified.append(host)
            else:
                self._plain.append(host)
                self._forward.append(forward / max(self.step_at(context), 1e-9))

    def price(self, context: int) -> float:
        """Extra host time of a round that verifies a draft, in one-row forwards at `context`
        (0 until both kinds of round have been seen MIN_ROUNDS times)."""
        with self._lock:
            if len(self._verified) < MIN_ROUNDS or len(self._plain) < MIN_ROUNDS:
                return 0.0
            extra = statistics.median(self._verified) - statistics.median(self._plain)
            forward = statistics.median(self._forward) * self.step_at(context)
        return max(extra, 0.0) / max(forward, 1e-9)


def host_seconds(before: dict[str, float], after: dict[str, float]) -> float:
    """A round's host seconds after drafting, from a request's phase clock before and after."""
    return sum(after.get(p, 0.0) - before.get(p, 0.0) for p in HOST_PHASES)
