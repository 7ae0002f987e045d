"""SPORK's tree drafter: branches from one or more sources merged into one trie.

Sources (joined by "+" in `--drafter`):
- recycle: Token Recycling's table of the target's own past top-k predictions
  (`RecycleTable`), updated from every verification and seeded from the prompt's prefill
  logits — no extra forward pass at all. It grows the requested shape (forks or dynamic).
  By default every request starts with an empty table (so a seeded sampled run is
  reproducible on its own); `persist=True` keeps it across requests as Token Recycling does
  (greedy output does not depend on it; on the dev prompts it did not measurably help).
- ngram, self, model:PATH: a chain drafter; its greedy chain (up to the depth) becomes one
  more branch.

Chains are added first, so a chain that agrees with the recycled forks shares their nodes, and
every proposal is deterministic: verification treats it as one-hot q, which is lossless for any
proposal (accept x with probability p(x), else sample from p with x removed).
"""

from __future__ import annotations

import torch

from specfork.config import SamplingParams
from specfork.drafters.base import Draft, Drafter
from specfork.drafters.recycle import RecycleTable
from specfork.spork import TreeShape, node_scores
from specfork.tree import Tree, TreeBuilder, prune

GREEDY = SamplingParams()
RECYCLE_WIDTH = 8  # successors kept per token: enough for the widest adapted tree


class ForkDrafter:
    """Grows a draft tree for every SPORK round (see the module docstring)."""

    def __init__(
        self,
        vocab_size: int,
        *,
        recycle: bool,
        chains: dict[str, Drafter],
        width: int = RECYCLE_WIDTH,
        persist: bool = False,
    ) -> None:
        self.table = RecycleTable(vocab_size, width) if recycle else None
        self.persist = persist
        self.chains = chains
        self.name = "+".join([*(["recycle"] if recycle else []), *chains])
        self.wants_prefill_logits = recycle
        self.forwards = 0

    def begin(self, prompt_ids: list[int]) -> None:
        if self.table is not None and not self.persist:
            self.table.reset()
        for chain in self.chains.values():
            chain.begin(prompt_ids)

    def observe(self, tokens: torch.Tensor, logits: torch.Tensor) -> None:
        """The target's logits [T, V] at input rows `tokens` [T] (prefill or verification)."""
        if self.table is not None:
            self.table.update(tokens, logits)

    def propose_tree(
        self, history: list[int], shape: TreeShape, max_depth: int, max_nodes: int
    ) -> tuple[Draft, Tree]:
        """A tree below history[-1], at most `max_depth` deep and `max_nodes` nodes."""
        depth = min(shape.depth, max_depth)
        builder = TreeBuilder()
        forwards = 0
        if depth >= 1:
            rng = torch.Generator()  # unused: chains draft greedily (deterministic)
            for chain in self.chains.values():
                draft = chain.propose(history, depth, GREEDY, rng)
                forwards += draft.forwards
                builder.add_path(draft.tokens.tolist())
            if self.table is not None:
                self._add_tree(builder, self._recycled(history[-1], shape, depth))
        tree = _cap(builder.build(), shape.tau, min(shape.budget, max_nodes))
        return Draft(tokens=tree.tokens, parents=tree.parents, forwards=forwards), tree

    def _recycled(self, root: int, shape: TreeShape, depth: int) -> Tree:
        assert self.table is not None
        if shape.kind == "dynamic":
            return self.table.build_dynamic(root, shape.budget, depth, branch=shape.forks)
        return self.table.build_forks(root, shape.forks, depth)

    @staticmethod
    def _add_tree(builder: TreeBuilder, tree: Tree) -> None:
        index: list[int] = []  # tree node -> builder node
        for token, parent in zip(tree.tokens.tolist(), tree.parents.tolist(), strict=True):
            index.append(builder.add(-1 if parent < 0 else index[parent], token))

    def rollback(self, length: int) -> None:
        for chain in self.chains.values():
            chain.rollback(length)


def _cap(tree: Tree, tau: float, max_nodes: int) -> Tree:
    """Drop nodes scoring below τ, then keep the `max_nodes` best (ancestors always kept)."""
    if len(tree) == 0:
        return tree
    scores = node_scores(tree)  # [N]
    keep = scores >= tau
    if int(keep.sum()) > max_nodes:
        # a node scores at most its parent, so the best max_nodes (ties: earlier) are closed
        order = sorted(range(len(tree)), key=lambda i: (-float(scores[i]), i))[:max_nodes]
        keep = torch.zeros(len(tree), dtype=torch.bool)
        keep[order] = True
    return prune(tree, keep)[0]
