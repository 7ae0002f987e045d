"""SPORK: self-speculative fork trees — the tree shape of each round and how it adapts.

Every round the drafter grows a tree below the last emitted token (the root): `forks` first
tokens, each continued up to `depth` tokens ("forks" shape), or the `budget` best nodes up to
`depth` deep ("dynamic" shape, EAGLE-2 style). The target verifies every node in one forward
with a tree attention mask and keeps the longest root-to-leaf path it agrees with, plus one
token of its own — so a round never yields less than plain decoding.

Each node carries a prior score: the product over its path of 1 / (rank + 1), rank being the
node's place among its siblings (0 = the best candidate). Nodes scoring below τ are not sent to
the verifier (lossless: it only saves verification work).

Adaptation (`SporkPolicy`, all bounded, all in the trace):
- forks and depth: one fewer fork and one level shallower after two rounds in a row that fell
  back to the target's own token (nothing drafted was right: the tree is wasted work);
- forks: one more when the last (widest) fork won — breadth is paying;
- depth: one deeper when a whole fork was accepted — a long run may continue;
- τ: moved toward the target acceptance A (accepted / tree depth per round): τ += η·(A − a),
  so rounds accepting less than A prune harder and rounds accepting more send more nodes;
- model depth (only when a model drafter — self or a draft model — is among the sources):
  every level it drafts costs one drafter forward, c target forwards (`draft_cost`, the share
  of the target's weights the drafter runs). With r_d the running rate of rounds whose
  accepted path reaches level d, the rounds' return is R = (1 + Σ r_d) / (1 + m·c) tokens per
  target-forward of work; the deepest model level m pays when r_m ≥ c·R (its marginal return
  beats the average). It is dropped when it does not. After a round that accepted all m
  levels, the estimate of level m + 1 moves up a little (it is stale: not drafted lately) and
  the level is added once it would pay, so a dropped level is retried now and then. Free
  sources (recycle, ngram) keep the full depth.
"""

from __future__ import annotations

import logging

from specfork.config import SpecConfig
from specfork.drafters.base import DraftShape
from specfork.strategies.policies import RoundInfo

log = logging.getLogger(__name__)

TAU_RATE = 0.05  # η of the τ controller
FALLBACKS_BEFORE_NARROWING = 2
REACH_RATE = 0.2  # EMA rate of the per-level reach rates r_d
REACH_START = 0.5  # r_d before any round reached level d
PROBE_RATE = 0.05  # how fast an undrafted level's r_d recovers after runs through all levels


class SporkPolicy:
    """Chooses each round's tree shape and adapts forks, depth and τ (a draft policy)."""

    name = "spork"

    def __init__(self, spec: SpecConfig, draft_cost: float = 0.0) -> None:
        """`draft_cost`: target forwards one model-drafted level costs (0: free sources only)."""
        if not draft_cost >= 0:
            raise ValueError(f"draft_cost must be >= 0, got {draft_cost}")
        self.spec = spec
        self.draft_cost = draft_cost
        self.max_forks = 2 * spec.forks
        self.max_depth = 2 * spec.depth
        self.reset()

    def begin(self) -> SporkPolicy:
        return SporkPolicy(self.spec, self.draft_cost)

    def reset(self) -> None:
        """Back to the configured shape (what `begin` gives a new request)."""
        self.forks = self.spec.forks
        self.depth = self.spec.depth
        self.model_depth = self.spec.depth
        self.reach = [REACH_START] * self.max_depth  # r_d of levels 1..max_depth
        self.tau = self.spec.tau
        self.fallbacks = 0
        self.last: dict[str, float | int | bool | None] = {}

    def next_shape(self, generated: int) -> DraftShape:
        model_depth = min(self.depth, self.model_depth) if self.draft_cost else None
        return DraftShape(
            self.depth, self.spec.tree, self.forks, self.spec.budget, self.tau, model_depth
        )

    def update(self, info: RoundInfo) -> None:
        shape = (self.forks, self.depth, self.tau, min(self.depth, self.model_depth))
        if self.spec.adapt and info.drafted > 0:
            self._adapt(info)
            if self.draft_cost:
                self._adapt_model_depth(info.accepted, shape[3])
        self.last = {
            "fork": info.fork,
            "nodes": info.drafted,
            "tree_depth": info.tree_depth,
            "forks": shape[0],
            "depth": shape[1],
            "tau": round(shape[2], 4),
            "next_forks": self.forks,
            "next_depth": self.depth,
            "next_tau": round(self.tau, 4),
        }
        if self.draft_cost:
            self.last["model_depth"] = shape[3]
            self.last["next_model_depth"] = min(self.depth, self.model_depth)
        log.info(
            "spork: %d nodes (forks %d, depth %d, tau %.2f), accepted %d, fork %s",
            info.drafted,
            shape[0],
            shape[1],
            shape[2],
            info.accepted,
            info.fork,
        )

    def _adapt(self, info: RoundInfo) -> None:
        if info.accepted == 0:
            self.fallbacks += 1
            if self.fallbacks >= FALLBACKS_BEFORE_NARROWING:
                self.forks = max(1, self.forks - 1)
                self.depth = max(1, self.depth - 1)
                self.fallbacks = 0
        else:
            self.fallbacks = 0
            if info.fork is not None and info.fork >= self.forks - 1:
                self.forks = min(self.max_forks, self.forks + 1)
            if info.accepted >= self.depth:
                self.depth = min(self.max_depth, self.depth + 1)
        rate = info.accepted / max(info.tree_depth, 1)
        step = TAU_RATE * (self.spec.target_acceptance - rate)
        ceiling = max(self.spec.tau, self.spec.tau_max)
        self.tau = min(ceiling, max(0.0, self.tau + step))

    def _adapt_model_depth(self, accepted: int, drafted_depth: int) -> None:
        """Keep model drafting only as deep as its levels pay for their forwards."""
        for d in range(drafted_depth):  # level d + 1 was drafted this round
            self.reach[d] += REACH_RATE * (float(accepted > d) - self.reach[d])
        m = drafted_depth
        c = self.draft_cost
        ret = (1 + sum(self.reach[:m])) / (1 + m * c)  # R: tokens per target-forward of work
        if self.reach[m - 1] < c * ret:
            self.model_depth = max(1, m - 1)
        elif accepted >= m and m < self.max_depth:
            # a run through every level: the next one may be reached too. Its estimate (stale
            # since it was last drafted) creeps up, so a dropped level is retried now and then
            self.reach[m] += PROBE_RATE * (1.0 - self.reach[m])
            if self.reach[m] >= c * ret:
                self.model_depth = m + 1

    def trace(self) -> dict[str, float | int | bool | None]:
        return dict(self.last)
