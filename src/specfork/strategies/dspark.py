"""DSpark: the draft length K re-chosen every round from the target's own confidence.

After each verification the target's logits over the verified block (the positions whose
predictions were checked: the accepted drafts and the one that produced the target's token)
give three signals:

- top1: the mean top-1 probability,
- margin: the mean top-1 − top-2 probability gap, scaled by `margin_scale` and capped at 1,
- EMA: an exponential moving average (rate `ema_rate`) of the round's acceptance ratio
  accepted / drafted (rounds with an empty draft leave it unchanged).

C = (w_top1·top1 + w_margin·min(margin_scale·margin, 1) + w_ema·EMA) / Σw, and the next K is
min_k + (max_k − min_k)·(C − low)/(high − low), rounded and clamped to [min_k, max_k]. Two rules
keep the risk down: K rises only after a round that accepted at least one draft token, and a
first-token rejection (a draft whose very first token failed) drops K to min_k at once. The
first-token rejection rate is tracked apart from the mean acceptance, which can look healthy
while first tokens keep failing.

The policy changes only how much is drafted; verification stays lossless.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from specfork.config import SpecConfig
from specfork.drafters.base import DraftShape, StepConfidence
from specfork.kernels.logit_rows import top2_probabilities
from specfork.strategies.policies import RoundInfo

log = logging.getLogger(__name__)

EMA_START = 0.5  # the acceptance EMA before any round has drafted (a neutral prior)


@dataclass(frozen=True, slots=True)
class Confidence:
    """The signals of one round and the confidence C they combine into."""

    top1: float
    margin: float  # raw top-1 − top-2 probability gap (before scaling and capping)
    ema: float
    value: float  # C


def block_signals(logits: torch.Tensor) -> tuple[float, float]:
    """Mean top-1 probability and mean top-1 − top-2 margin over logits [n, V].

    p = exp(logit − logsumexp) at the two best logits only (one kernel call: ~30 µs right after
    a forward, where a softmax over the vocabulary and a top-2 of it took ~0.3 ms for three
    rows), averaged as Python floats."""
    p = top2_probabilities(logits.float()).tolist()  # [n, 2]
    n = max(len(p), 1)
    return sum(a for a, _ in p) / n, sum(a - b for a, b in p) / n


class DSparkPolicy:
    """Confidence-scheduled draft length (a `DraftPolicy`)."""

    name = "dspark"

    def __init__(self, spec: SpecConfig) -> None:
        self.spec = spec  # validated on construction: min_k ≥ 1, max_k ≥ min_k, low < high, ...
        self.reset()

    def begin(self) -> DSparkPolicy:
        return DSparkPolicy(self.spec)

    def reset(self) -> None:
        """Back to the state of a new request."""
        self.k = self.spec.min_k
        self.ema: float | None = None
        self.drafted_rounds = 0
        self.first_rejections = 0
        self.last: dict[str, float | int | bool] = {}

    def next_shape(self, generated: int) -> DraftShape:
        """K from the last round's confidence; a drafter with its own distribution also stops
        early by the same rule applied to its own top-1 and margin, step by step."""
        s = self.spec
        ema = EMA_START if self.ema is None else self.ema
        return DraftShape(self.k, confidence=StepConfidence(s.weights, s.margin_scale, ema, s.low))

    @property
    def first_rejection_rate(self) -> float:
        """Share of drafting rounds whose first draft token was rejected."""
        return self.first_rejections / self.drafted_rounds if self.drafted_rounds else 0.0

    def update(self, info: RoundInfo) -> None:
        first_rejected = info.drafted > 0 and info.accepted == 0
        if info.drafted > 0:
            self.drafted_rounds += 1
            self.first_rejections += int(first_rejected)
            ratio = info.accepted / info.drafted
            old = ratio if self.ema is None else self.ema
            self.ema = old + self.spec.ema_rate * (ratio - old)
        conf = self.confidence(info)
        k = self.schedule(conf.value)
        if first_rejected:
            k = self.spec.min_k  # the risk switch
        elif info.accepted == 0:
            k = min(k, self.k)  # nothing accepted (empty draft): K may not rise
        self.last = {
            "top1": round(conf.top1, 4),
            "margin": round(conf.margin, 4),
            "ema": round(conf.ema, 4),
            "confidence": round(conf.value, 4),
            "next_k": k,
            "first_rejection_rate": round(self.first_rejection_rate, 4),
            "low": self.spec.low,  # the thresholds C is mapped from (for plots)
            "high": self.spec.high,
            "min_k": self.spec.min_k,
        }
        note = " (first token rejected)" if first_rejected else ""
        log.info(
            "dspark: K=%d drafted %d accepted %d%s | top1 %.2f margin %.2f EMA %.2f C %.2f -> K %d",
            self.k,
            info.drafted,
            info.accepted,
            note,
            conf.top1,
            conf.margin,
            conf.ema,
            conf.value,
            k,
        )
        self.k = k

    def confidence(self, info: RoundInfo) -> Confidence:
        """C from the target's logits over the verified block and the acceptance EMA."""
        top1 = margin = 0.0
        if info.target_logits is not None:
            top1, margin = block_signals(info.target_logits[: info.accepted + 1])
        ema = EMA_START if self.ema is None else self.ema
        rule = StepConfidence(self.spec.weights, self.spec.margin_scale, ema, self.spec.low)
        return Confidence(top1, margin, ema, rule.value(top1, margin))

    def schedule(self, c: float) -> int:
        """K for confidence c: linear from [low, high] onto [min_k, max_k], clamped."""
        s = self.spec
        frac = min(1.0, max(0.0, (c - s.low) / (s.high - s.low)))  # a NaN (0/0) counts as 0
        k = s.min_k + (s.max_k - s.min_k) * frac
        return max(s.min_k, min(s.max_k, math.floor(k + 0.5)))  # halves round up

    def trace(self) -> dict[str, float | int | bool]:
        """What the last update computed (for the per-round trace)."""
        return dict(self.last)
