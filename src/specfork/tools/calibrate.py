"""Calibration of DSpark's confidence thresholds on a user's own prompts.

Runs a fixed draft length K (DSpark with min_k = max_k = K, so every round drafts the same and
the confidence C is still computed), records the acceptance distribution, and pairs each
round's C with what the next round did. The suggested `low` is the median C before rounds
whose first draft token failed (where K should be min_k), `high` the median C before rounds
that accepted their whole draft (where K should be max_k). When either group is empty, or the
two medians are not in order, the 25th and 75th percentiles of C are used instead.
"""

from __future__ import annotations

import dataclasses
import itertools
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from specfork.config import GenerationConfig, SpecConfig
from specfork.engine.generator import Generator
from specfork.engine.stats import RoundRecord
from specfork.errors import ConfigError


@dataclass(frozen=True, slots=True)
class Calibration:
    """What a fixed-K run showed and the thresholds it suggests."""

    k: int
    prompts: int
    rounds: int  # drafting rounds
    accepted_counts: list[int]  # rounds that accepted j draft tokens, j = 0..K
    acceptance_percentiles: dict[str, float]  # p25/p50/p75 of accepted / drafted per round
    confidence_percentiles: dict[str, float]  # p25/p50/p75 of C
    low: float
    high: float
    method: str  # "outcomes" (medians before failures / full accepts) or "percentiles"

    def flags(self) -> str:
        return f"--low {self.low:.2f} --high {self.high:.2f}"


def calibrate(
    generator: Generator,
    prompts: Sequence[str | list[dict[str, str]]],
    spec: SpecConfig,
    k: int = 4,
    max_new_tokens: int = 128,
    progress: Callable[[int], None] | None = None,
) -> Calibration:
    """Run `prompts` (texts or chat messages) with a fixed K under `spec`'s drafter and
    suggest low/high."""
    if not prompts:
        raise ConfigError("calibration needs at least one prompt")
    # no goodput gate: it would trim or skip drafts by timed costs, and calibration measures
    # how much of a full K-token draft the target accepts
    fixed = dataclasses.replace(spec, strategy="dspark", k=k, min_k=k, max_k=k, goodput=False)
    config = GenerationConfig(max_new_tokens=max_new_tokens)
    pairs: list[tuple[float, RoundRecord]] = []  # (C after round t, round t + 1)
    ratios: list[float] = []
    counts = [0] * (k + 1)
    for i, prompt in enumerate(prompts):
        rounds = generator.generate(prompt, config=config, spec=fixed).stats.rounds
        for prev, cur in itertools.pairwise(rounds):
            if cur.drafted:
                pairs.append((float(prev.extra["confidence"]), cur))
        for r in rounds:
            if r.drafted:
                ratios.append(r.accepted / r.drafted)
                counts[min(r.accepted, k)] += 1
        if progress:
            progress(i + 1)
    if not ratios:
        raise ConfigError(
            "the drafter proposed nothing on these prompts, so there is nothing to calibrate; "
            "try other prompts or another drafter"
        )
    return _suggest(k, len(prompts), counts, ratios, pairs)


def _suggest(
    k: int,
    n_prompts: int,
    counts: list[int],
    ratios: list[float],
    pairs: list[tuple[float, RoundRecord]],
) -> Calibration:
    conf = [c for c, _ in pairs] or [0.5]
    before_fail = [c for c, r in pairs if r.first_rejected]
    before_full = [c for c, r in pairs if r.accepted == r.drafted]
    method = "outcomes"
    if before_fail and before_full:
        low, high = statistics.median(before_fail), statistics.median(before_full)
    else:
        low = high = 0.0
    if not low < high:
        method = "percentiles"
        low, high = _percentile(conf, 25), _percentile(conf, 75)
        if not low < high:  # every C equal: centre a narrow band on it
            low, high = low - 0.05, high + 0.05
    low = round(low, 2)
    high = max(round(high, 2), low + 0.01)  # SpecConfig needs low < high
    return Calibration(
        k=k,
        prompts=n_prompts,
        rounds=len(ratios),
        accepted_counts=counts,
        acceptance_percentiles=_percentiles(ratios),
        confidence_percentiles=_percentiles(conf),
        low=low,
        high=high,
        method=method,
    )


def _percentiles(values: list[float]) -> dict[str, float]:
    return {f"p{q}": round(_percentile(values, q), 3) for q in (25, 50, 75)}


def _percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile q (0-100) of a non-empty list."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)
