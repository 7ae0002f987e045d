"""The cost curve corrected by the forwards a Generator actually ran.

`CostCurve` is measured once, in a few seconds, before the first request, and priced at other
contexts by extrapolating a second measurement. On a busy or frequency-scaling machine it can
be far off: on a 2-core Xeon VM, forwards of 4 rows cost 1.63 one-row steps in decoding (after
~200 cached tokens) where the curve said 1.18, and an extra row at 3,000 cached tokens 1.33
where it said 1.18; the gates kept drafting rows that could not pay.

`CostCalibration` keeps, per band of `BAND` context tokens, the last `WINDOW` forwards of each
row count of requests that draft (rounds with and without a draft; the scheduler does not
report plain decoding's back-to-back steps, which run faster than a drafting round's), as
seconds over the curve's one-row time at their context, so that a forward late in the band
compares with one early in it. A band's curve: a row count seen at least `MIN_SEEN` times
costs the median of its forwards over the median one-row forward; one not seen costs the
measured curve's extra-row cost times the median correction g of the counts seen (1 when none
is). A band with no one-row forward yet takes the nearest built band's g; before any, the
measured curve stands. Forwards beside prompt chunks are not observed; medians make one slow
spell of the machine count for little.
"""

from __future__ import annotations

import functools
import statistics
import threading
from collections import deque

from specfork.models.cost import CostCurve

BAND = 512  # context tokens per band
WINDOW = 32  # forwards kept per band and row count
MIN_SEEN = 8  # forwards of a row count (one row included) before its own median is used
REBUILD_EVERY = 8  # a band's curve is rebuilt after this many new forwards


class CostCalibration:
    """A `CostCurve` that learns from observed forwards (see the module doc). `__call__`,
    `table` and `at` give what the goodput gates and the batch allocation ask a curve for."""

    def __init__(self, curve: CostCurve) -> None:
        self.curve = curve
        self._seen: dict[tuple[int, int], deque[float]] = {}  # (band, rows) -> normalized s
        self._built: dict[int, tuple[int, CostCurve | None]] = {}  # band -> (forwards, curve)
        self._g: dict[int, float] = {}  # band -> its correction of extra rows, once built
        self._count: dict[int, int] = {}  # band -> forwards observed
        self._lock = threading.Lock()

    def __call__(self, rows: int) -> float:
        return self.at(self.curve.context)(rows)

    def table(self, most: int) -> tuple[float, ...]:
        """c(0..most) at the curve's own context (`CostCurve.table`): a gate prices with it
        until its first `at_context` (a round can trim the grammar's forced tokens first)."""
        return self.at(self.curve.context).table(most)

    def at(self, tokens: int) -> CostCurve:
        """The curve after `tokens` cached tokens, rows priced as observed in its band."""
        band = tokens // BAND
        with self._lock:
            count = self._count.get(band, 0)
            built = self._built.get(band)
            if built is None or count - built[0] >= REBUILD_EVERY:
                built = (count, self._build(band, tokens))
                self._built[band] = built
        return built[1] if built[1] is not None else self._borrowed(band, tokens)

    def _borrowed(self, band: int, tokens: int) -> CostCurve:
        """The measured curve at `tokens` with the nearest built band's g (itself without)."""
        base = self.curve.at(tokens)
        with self._lock:
            if not self._g:
                return base
            g = self._g[min(self._g, key=lambda b: (abs(b - band), b))]
        return _scaled(base, round(g, 2))

    def observe(self, rows: int, tokens: int, seconds: float) -> None:
        """A decoding forward of `rows` rows after `tokens` cached tokens took `seconds`."""
        if rows < 1 or not seconds > 0 or seconds == float("inf"):
            return
        band = tokens // BAND
        with self._lock:
            seen = self._seen.setdefault((band, rows), deque(maxlen=WINDOW))
            seen.append(seconds / self.curve.step_at(tokens))
            self._count[band] = self._count.get(band, 0) + 1

    def _build(self, band: int, tokens: int) -> CostCurve | None:
        """The band's curve from its forwards (None: no one-row forwards yet)."""
        one = self._seen.get((band, 1))
        if one is None or len(one) < MIN_SEEN:
            return None
        t1 = statistics.median(one)
        base = self.curve.at(tokens)
        observed = {
            rows: statistics.median(s) / t1
            for (b, rows), s in self._seen.items()
            if b == band and rows > 1 and len(s) >= MIN_SEEN
        }
        ratios = [
            (cost - 1.0) / (base(rows) - 1.0)
            for rows, cost in observed.items()
            if base(rows) - 1.0 > 0.02
        ]
        g = statistics.median(ratios) if ratios else 1.0
        self._g[band] = g
        sizes = sorted(set(base.rows) | set(observed))
        cost = [observed.get(r, 1.0 + (base(r) - 1.0) * g) for r in sizes]
        cost[0] = 1.0
        for i in range(1, len(cost)):  # never below one row, never falling with more rows
            cost[i] = max(cost[i], cost[i - 1], 1.0)
        return CostCurve(tuple(sizes), tuple(cost), base.context)


@functools.lru_cache(maxsize=256)
def _scaled(curve: CostCurve, g: float) -> CostCurve:
    """`curve` with every size's cost above one row times g."""
    return CostCurve(curve.rows, tuple(1.0 + (c - 1.0) * g for c in curve.cost), curve.context)
