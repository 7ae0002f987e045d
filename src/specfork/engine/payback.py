"""Does drafting pay, by the clock? A check of a lone request's rounds against plain steps.

The goodput gates choose rows from predictions: acceptance rates learned so far and a cost
curve measured at another context. Both can be wrong for a while — a prior carried over from
other requests, rows at a 3k-token context that cost half again what the curve says, host work
the curve never sees — and a wrong gate makes a lossless strategy slower than plain decoding.
`Payback` judges what a request's rounds actually did: over its last `WINDOW` drafting rounds,
tokens emitted per second, against the seconds of rounds that drafted nothing (one row: plain
decoding's price), each scaled to one context by the cost curve's one-row growth. The plain
rounds are any lone request's, kept by the Generator's `PlainClock`: only those of the last
`FRESH_SECONDS` count (a machine's speed drifts), and those within `NEAR` tokens of the
request's context when there are any (the curve's growth is itself an estimate). When
drafting emitted fewer tokens per second than plain steps would have (by more than `MARGIN`),
the request stops drafting for a pause that doubles while drafting keeps losing (`PAUSE` to
`MAX_PAUSE` rounds) and is back to `PAUSE` once it pays. With no fresh plain round to compare
with, a request that has drafted a window of rounds runs one plain round.

It never changes which tokens are emitted, only whether a round drafts; the scheduler asks it
for lone requests (in a batch a forward's time is shared, and the allocation prices rows).
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

WINDOW = 8  # drafting rounds judged together
PLAIN_KEPT = 16  # plain rounds whose median is the reference
FRESH_SECONDS = 30.0  # plain rounds older than this no longer count
NEAR = 512  # plain rounds within this many context tokens are preferred
MARGIN = 0.05  # drafting must lose by more than this share to pause
PAUSE = 8  # rounds without drafting after a first loss
MAX_PAUSE = 128  # the longest pause


class PlainClock:
    """Seconds of recent plain rounds (one row, no draft) of a Generator's lone requests, in
    one-row forwards' time at a fixed context: `step_at(tokens)` is a one-row forward's time
    after `tokens` cached tokens relative to that context (the cost curve's growth); `now`
    reads the time in seconds."""

    def __init__(
        self, step_at: Callable[[int], float], now: Callable[[], float] = time.monotonic
    ) -> None:
        self.step_at = step_at
        self.now = now
        self._kept: deque[tuple[float, int, float]] = deque(maxlen=PLAIN_KEPT)  # when, context, s
        self._lock = threading.Lock()

    def scaled(self, seconds: float, context: int) -> float:
        """`seconds` after `context` cached tokens, as seconds at the fixed context."""
        return seconds / max(self.step_at(context), 1e-9)

    def add(self, seconds: float, context: int) -> None:
        with self._lock:
            self._kept.append((self.now(), context, self.scaled(seconds, context)))

    def reference(self, context: int) -> float | None:
        """The median plain round (scaled) of the last FRESH_SECONDS, of those within NEAR
        tokens of `context` when there are any; None without one."""
        since = self.now() - FRESH_SECONDS
        with self._lock:
            fresh = [(c, s) for when, c, s in self._kept if when >= since]
        near = [s for c, s in fresh if abs(c - context) <= NEAR] or [s for _, s in fresh]
        return statistics.median(near) if near else None


@dataclass
class Payback:
    """One request's check (see the module doc)."""

    clock: PlainClock
    pause: int = PAUSE  # the next pause's length
    waiting: int = 0  # rounds left in the current pause
    pauses: int = 0  # pauses so far (statistics)
    _drafting: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=WINDOW))

    def allows(self, context: int) -> bool:
        """Whether this round, after `context` cached tokens, may draft (False: a plain one)."""
        if self.waiting > 0:
            self.waiting -= 1
            return False
        return len(self._drafting) < WINDOW or self.clock.reference(context) is not None

    def observe(self, drafted: bool, tokens: int, context: int, seconds: float) -> None:
        """A round after `context` cached tokens emitted `tokens` in `seconds`."""
        if not seconds > 0 or tokens < 1:
            return
        if not drafted:
            self.clock.add(seconds, context)
            return
        self._drafting.append((self.clock.scaled(seconds, context), tokens))
        if len(self._drafting) < WINDOW:
            return
        plain = self.clock.reference(context)  # (only once a window is there to judge)
        if plain is not None:
            self._judge(plain)

    def _judge(self, plain: float) -> None:
        seconds = sum(s for s, _ in self._drafting)
        tokens = sum(t for _, t in self._drafting)
        if tokens / seconds < (1.0 - MARGIN) / plain:
            self.waiting, self.pause = self.pause, min(2 * self.pause, MAX_PAUSE)
            self.pauses += 1
            self._drafting.clear()
        else:
            self.pause = PAUSE
