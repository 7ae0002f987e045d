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
  so rounds accepting less than A prune harder and rounds accepting more send more nodes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from specfork.config import SpecConfig
from specfork.policies import RoundInfo
from specfork.tree import Tree, children

log = logging.getLogger(__name__)

TAU_RATE = 0.05  # η of the τ controller
TAU_MAX = 0.5  # τ never prunes more than the third-ranked first fork (score 1/3 < 0.5)
FALLBACKS_BEFORE_NARROWING = 2


@dataclass(frozen=True, slots=True)
class TreeShape:
    """What the drafter is asked to grow this round."""

    kind: str  # "forks" or "dynamic"
    forks: int  # first-level branches (the branching factor of the dynamic shape)
    depth: int  # deepest node
    budget: int  # most nodes
    tau: float  # prior-score threshold


def node_scores(tree: Tree) -> torch.Tensor:
    """Prior score [N] of every node: the product of 1/(sibling rank + 1) along its path."""
    scores = torch.ones(len(tree), dtype=torch.float64)  # [N]
    for parent, kids in enumerate(children(tree)):
        base = 1.0 if parent == 0 else float(scores[parent - 1])
        for rank, node in enumerate(kids):
            scores[node] = base / (rank + 1)
    return scores


class SporkPolicy:
    """Chooses each round's tree shape and adapts forks, depth and τ (a draft policy)."""

    name = "spork"

    def __init__(self, spec: SpecConfig) -> None:
        self.spec = spec
        self.max_forks = 2 * spec.forks
        self.max_depth = 2 * spec.depth
        self.reset()

    def reset(self) -> None:
        self.forks = self.spec.forks
        self.depth = self.spec.depth
        self.tau = self.spec.tau
        self.fallbacks = 0
        self.last: dict[str, float | int | bool | None] = {}

    def next_k(self, generated: int) -> int:
        return self.depth

    def next_shape(self, generated: int) -> TreeShape:
        return TreeShape(self.spec.tree, self.forks, self.depth, self.spec.budget, self.tau)

    def update(self, info: RoundInfo) -> None:
        shape = (self.forks, self.depth, self.tau)
        if self.spec.adapt and info.drafted > 0:
            self._adapt(info)
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
        log.info(
            "spork: %d nodes (forks %d, depth %d, tau %.2f), accepted %d, fork %s",
            info.drafted, shape[0], shape[1], shape[2], info.accepted, info.fork,
        )  # fmt: skip

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
        self.tau = min(TAU_MAX, max(0.0, self.tau + step))

    def trace(self) -> dict[str, float | int | bool | None]:
        return dict(self.last)
