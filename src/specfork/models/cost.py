"""What a forward of R rows costs a model, relative to one row: measured, interpolated.

The goodput gate (`specfork.strategies.goodput`) weighs extra verification rows with it.
"""

from __future__ import annotations

import functools
import itertools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from specfork.models.target import TargetModel

ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)


NEAR_CONTEXT = 192  # cached tokens a curve is measured after (a short chat's context)
FAR_CONTEXT = 1024  # ... and again after so many, where the model allows: rows' attention
FAR_REPEATS = 3


@dataclass(frozen=True)
class CostCurve:
    """Cost of a forward by number of rows, relative to one row (linear between points),
    measured after `context` cached tokens.

    `far` is the same curve measured after more cached tokens (`far.context`) and `far_step`
    the one-row forward there over the one-row forward here. Attention makes a forward's time
    grow linearly with the context, by more for more rows, so `at(tokens)` prices rows at a
    request's own context (a forward's time interpolated between the two measurements, or
    extrapolated past the far one); without `far` the curve is the same at every context."""

    rows: tuple[int, ...]
    cost: tuple[float, ...]
    context: int = 0
    far: CostCurve | None = None
    far_step: float = 1.0

    def __call__(self, r: int) -> float:
        if r <= self.rows[0]:
            return self.cost[0]
        for (r0, c0), (r1, c1) in zip(
            zip(self.rows, self.cost, strict=True),
            zip(self.rows[1:], self.cost[1:], strict=True),
            strict=False,
        ):
            if r <= r1:
                return c0 + (c1 - c0) * (r - r0) / (r1 - r0)
        slope = (self.cost[-1] - self.cost[-2]) / (self.rows[-1] - self.rows[-2])
        return self.cost[-1] + slope * (r - self.rows[-1])

    def table(self, most: int) -> tuple[float, ...]:
        """c(0..most): the cost of 0 to `most` rows (index 0 unused, c(1)), memoised."""
        return _table(self, most)

    def at(self, tokens: int) -> CostCurve:
        """The curve for forwards after `tokens` cached tokens (itself without `far` or up to
        its own context); contexts are taken in steps of 64 tokens."""
        if self.far is None or tokens <= self.context:
            return self
        return _curve_at(self, tokens // 64 * 64)

    def step_at(self, tokens: int) -> float:
        """A one-row forward's time after `tokens` cached tokens over its time at `context`
        (linear in the context between, and past, the two measurements; 1 without `far`)."""
        far = self.far
        if far is None or tokens <= self.context:
            return 1.0
        w = (tokens - self.context) / (far.context - self.context)
        return max(1e-3, 1.0 + (self.far_step - 1.0) * w)

    @classmethod
    def measure(
        cls,
        model: TargetModel,
        repeats: int = 7,
        context: int = NEAR_CONTEXT,
        far_context: int = FAR_CONTEXT,
    ) -> CostCurve:
        """Time forwards (with the LM head) of 1-32 rows after `context` cached tokens, as a
        decoding step sees them, and again after `far_context` (fewer repeats) where the model
        is long enough; the sizes interleaved in every repeat (so that a slow spell of the
        machine or a warming cache hits all sizes alike), medians after a warm-up."""
        limit = model.config.max_position - ROWS[-1] - 1
        context = max(0, min(context, limit))
        near = _forward_seconds(model, context, repeats)
        curve = cls(ROWS, lower_hull(ROWS, _relative(near)), context)
        if far_context > 2 * max(context, 1) and far_context <= limit:
            far = _forward_seconds(model, far_context, FAR_REPEATS)
            step = far[0] / near[0]
            far_curve = cls(ROWS, lower_hull(ROWS, _relative(far)), far_context)
            curve = cls(ROWS, curve.cost, context, far_curve, step)
        return curve


@functools.lru_cache(maxsize=1024)
def _table(curve: CostCurve, most: int) -> tuple[float, ...]:
    return tuple(curve(max(r, 1)) for r in range(most + 1))


@functools.lru_cache(maxsize=256)
def _curve_at(curve: CostCurve, tokens: int) -> CostCurve:
    """`curve` at `tokens` cached tokens: each size's time (in one-row forwards of the near
    measurement) moves linearly from the near to the far measurement with the context."""
    far = curve.far
    assert far is not None
    w = (tokens - curve.context) / (far.context - curve.context)
    pairs = zip(curve.rows, curve.cost, strict=True)
    times = [c + (curve.far_step * far(r) - c) * w for r, c in pairs]
    return CostCurve(curve.rows, _relative([max(t, 1e-9) for t in times]), tokens)


def _relative(times: list[float]) -> tuple[float, ...]:
    """Times by size as multiples of the first, at least 1 and never falling with more rows."""
    cost = [max(1.0, t / times[0]) for t in times]
    for i in range(1, len(cost)):  # more rows never cost less (noise)
        cost[i] = max(cost[i], cost[i - 1])
    return tuple(cost)


def lower_hull(rows: tuple[int, ...], cost: tuple[float, ...]) -> tuple[float, ...]:
    """`cost` by `rows` lowered to its lower convex hull: each size's cost at most the line
    between any smaller and any larger size's. A measured curve's extra rows cost more the
    more rows there are (on the CPU they are computed, and attention grows with them), so a
    size above that line was a slow spell of the machine. Such a spike outlives the
    measurement in the cost cache: the gates never verify that many rows, the calibration
    (`models.cost_calibration`) never sees them and never corrects it (a stored curve priced
    3-6 rows at 1.54 one-row forwards where a fresh one said 1.07-1.25). A size measured too
    cheap stays: the gates then verify that many rows, and the calibration corrects it."""
    hull: list[int] = []  # indices of the hull's vertices
    for i in range(len(rows)):
        while len(hull) >= 2 and _above(rows, cost, hull[-2], hull[-1], i):
            hull.pop()
        hull.append(i)
    out = list(cost)
    for a, b in itertools.pairwise(hull):
        for i in range(a + 1, b):
            w = (rows[i] - rows[a]) / (rows[b] - rows[a])
            line = cost[a] + (cost[b] - cost[a]) * w
            if line < cost[i] * (1 - 1e-9):  # above it, not on it up to rounding
                out[i] = line
    return tuple(out)


def _above(rows: tuple[int, ...], cost: tuple[float, ...], a: int, b: int, c: int) -> bool:
    """Whether point b lies on or above the line from point a to point c."""
    cross = (rows[b] - rows[a]) * (cost[c] - cost[a]) - (cost[b] - cost[a]) * (rows[c] - rows[a])
    return cross <= 0


def _forward_seconds(model: TargetModel, context: int, repeats: int) -> list[float]:
    """Median seconds of a forward (and its logits) of each size in ROWS after `context`
    cached tokens of random ids."""
    vocab = int(model.config.vocab_size)
    device = model.device
    cache = model.new_cache(context + ROWS[-1] + 1)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (1, context + ROWS[-1]), generator=gen).to(device)
    runs: dict[int, list[float]] = {r: [] for r in ROWS}
    with torch.inference_mode():
        if context:
            model(tokens[:, :context], torch.arange(context, device=device), cache)
        for _ in range(repeats + 1):
            for r in ROWS:
                cache.truncate(context)
                rows = tokens[:, context : context + r]  # [1, R]
                positions = torch.arange(context, context + r, device=device)  # [R]
                t0 = time.perf_counter()
                hidden = model(rows, positions, cache)
                model.logits(hidden[0])
                if torch.device(device).type == "cuda":
                    torch.cuda.synchronize(device)
                runs[r].append(time.perf_counter() - t0)
    return [statistics.median(runs[r][1:]) for r in ROWS]


def one_row_seconds(model: TargetModel, context: int = 64, repeats: int = 5) -> float:
    """Seconds of one decoding step of `model` (a one-row forward and its logits after
    `context` cached tokens), the median of `repeats` runs after a warm-up: the unit in which
    a drafter's measured cost is expressed."""
    cache = model.new_cache(context + 2)
    device = model.device
    with torch.inference_mode():
        prompt = torch.zeros(1, context, dtype=torch.long, device=device)  # [1, C]
        model(prompt, torch.arange(context, device=device), cache)
        token = torch.zeros(1, 1, dtype=torch.long, device=device)  # [1, 1]
        position = torch.tensor([context], device=device)  # [1]

        def step() -> None:
            hidden = model(token, position, cache)
            model.logits(hidden[0])
            if torch.device(device).type == "cuda":
                torch.cuda.synchronize(device)

        return _median_seconds(step, lambda: cache.truncate(context), repeats)


def _median_seconds(step: Callable[[], None], rewind: Callable[[], None], repeats: int) -> float:
    """Median seconds of `step` over `repeats` runs after a warm-up run, `rewind` (not timed)
    before each."""
    runs = []
    for _ in range(repeats + 1):
        rewind()
        t0 = time.perf_counter()
        step()
        runs.append(time.perf_counter() - t0)
    return statistics.median(runs[1:])
