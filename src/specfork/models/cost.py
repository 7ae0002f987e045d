"""What a forward of R rows costs a model, relative to one row: measured, interpolated.

The goodput gate (`specfork.strategies.goodput`) weighs extra verification rows with it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from specfork.models.target import TargetModel

ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)


@dataclass(frozen=True)
class CostCurve:
    """Cost of a forward by number of rows, relative to one row (linear between points)."""

    rows: tuple[int, ...]
    cost: tuple[float, ...]

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

    @classmethod
    def measure(cls, model: TargetModel, repeats: int = 7, context: int = 192) -> CostCurve:
        """Time forwards (with the LM head) of 1-32 rows after `context` cached tokens, as a
        decoding step sees them; the sizes interleaved in every repeat (so that a slow spell
        of the machine or a warming cache hits all sizes alike), medians after a warm-up."""
        vocab = int(model.config.vocab_size)
        device = model.device
        limit = model.config.max_position
        context = max(0, min(context, limit - ROWS[-1] - 1))
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
        times = [statistics.median(runs[r][1:]) for r in ROWS]
        cost = [max(1.0, t / times[0]) for t in times]
        for i in range(1, len(cost)):  # more rows never cost less (noise)
            cost[i] = max(cost[i], cost[i - 1])
        return cls(ROWS, tuple(cost))


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
