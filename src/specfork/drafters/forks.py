"""SPORK's tree drafter: branches from one or more sources merged into one trie.

Sources (joined by "+" in `--drafter`):
- recycle: Token Recycling's table of the target's own past top-k predictions
  (`RecycleTable`), updated from every verification and seeded from the prompt's prefill
  logits — no extra forward pass at all. It grows the requested shape (forks or dynamic).
  By default every request starts with an empty table (so a seeded sampled run is
  reproducible on its own); `persist=True` keeps it across requests as Token Recycling does
  (greedy output does not depend on it; on the dev prompts it did not measurably help).
- ngram: its chain (up to the depth) becomes one more branch (prior score 1).
- self, model:PATH: a model drafter proposes a tree of its own, drafted one depth at a time
  as a batch over its shared prefix cache; a node's score is its cumulative draft
  probability. "forks" shape: its top-K first tokens, each continued greedily; "dynamic"
  shape: EAGLE-2 — each depth expands the K most probable nodes of the last level by their
  top-K children, and the node budget keeps the most probable nodes overall.

Chains are added first, so a chain that agrees with the recycled forks shares their nodes, and
every proposal is deterministic: verification treats it as one-hot q, which is lossless for any
proposal (accept x with probability p(x), else sample from p with x removed).
"""

from __future__ import annotations

import torch

from specfork.config import SamplingParams
from specfork.drafters.base import Draft, Drafter
from specfork.drafters.model import ModelDrafter
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
        prior: torch.Tensor | None = None,
    ) -> None:
        """`prior` [V, width]: the recycle table every request starts from (`recycle_prior`)."""
        self.table = RecycleTable(vocab_size, width, prior=prior) if recycle else None
        self.persist = persist
        self.chains = chains
        self.name = "+".join([*(["recycle"] if recycle else []), *chains])
        self.wants_prefill_logits = recycle
        # target forwards one level of model drafting costs (SporkPolicy's model depth)
        self.draft_cost = sum(c.cost for c in chains.values() if isinstance(c, ModelDrafter))
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
        model_depth = depth if shape.model_depth is None else min(depth, shape.model_depth)
        builder = TreeBuilder()
        scores: dict[int, float] = {}  # node -> best prior score over the sources proposing it
        forwards = 0
        if depth >= 1:
            rng = torch.Generator()  # unused: chains draft greedily (deterministic)
            for chain in self.chains.values():
                if isinstance(chain, ModelDrafter) and shape.kind == "dynamic":
                    tree, prior, n = chain.propose_dynamic(history, shape.forks, model_depth)
                    forwards += n
                    _add_tree(builder, scores, tree, prior)
                elif isinstance(chain, ModelDrafter):
                    paths, probs, n = chain.propose_forks(history, shape.forks, model_depth)
                    forwards += n
                    for path, prob in zip(paths, probs, strict=True):
                        _add_path(builder, scores, path, prob)
                else:
                    draft = chain.propose(history, depth, GREEDY, rng)
                    forwards += draft.forwards
                    _add_path(builder, scores, draft.tokens.tolist(), [1.0] * len(draft))
            if self.table is not None:
                recycled = self._recycled(history[-1], shape, depth)
                _add_tree(builder, scores, recycled, node_scores(recycled).tolist())
        built = builder.build()
        prior = torch.tensor([scores[i] for i in range(len(built))], dtype=torch.float64)  # [N]
        tree, kept = _cap(built, prior, shape.tau, min(shape.budget, max_nodes))
        draft = Draft(tree.tokens, None, forwards, tree.parents, self.name, prior[kept])
        return draft, tree

    def _recycled(self, root: int, shape: TreeShape, depth: int) -> Tree:
        assert self.table is not None
        if shape.kind == "dynamic":
            return self.table.build_dynamic(root, shape.budget, depth, branch=shape.forks)
        return self.table.build_forks(root, shape.forks, depth)

    def rollback(self, length: int) -> None:
        for chain in self.chains.values():
            chain.rollback(length)


def _add_tree(
    builder: TreeBuilder, scores: dict[int, float], tree: Tree, prior: list[float]
) -> None:
    """Merge `tree` (a source's proposal, prior score per node) into the builder's trie."""
    index: list[int] = []  # tree node -> builder node
    rows = zip(tree.tokens.tolist(), tree.parents.tolist(), prior, strict=True)
    for token, parent, score in rows:
        index.append(builder.add(-1 if parent < 0 else index[parent], token))
        scores[index[-1]] = max(scores.get(index[-1], 0.0), score)


def _add_path(
    builder: TreeBuilder, scores: dict[int, float], tokens: list[int], prior: list[float]
) -> None:
    for node, score in zip(builder.add_path(tokens), prior, strict=True):
        scores[node] = max(scores.get(node, 0.0), score)


def _cap(tree: Tree, scores: torch.Tensor, tau: float, max_nodes: int) -> tuple[Tree, torch.Tensor]:
    """Drop nodes scoring below τ, then keep the `max_nodes` best (ancestors always kept).

    τ never drops the best first-level node: a round always verifies at least one guess (a
    model drafter has paid for it already, and one more row costs the verifier little).
    scores [N] never exceed a node's parent's score within one source, and a merged node
    keeps its best source's score, so the kept set is closed under ancestors. Returns the
    smaller tree and the kept nodes' mask [N].
    """
    if len(tree) == 0 or max_nodes < 1:
        pruned, index = prune(tree, torch.zeros(len(tree), dtype=torch.bool))
        return pruned, index >= 0
    keep = scores >= tau
    first = (tree.parents < 0).nonzero().flatten()  # [F] the root's children
    keep[first[int(scores[first].argmax())]] = True  # ties: the earliest
    if int(keep.sum()) > max_nodes:
        # a node scores at most its parent, so the best max_nodes (ties: earlier) are closed
        order = sorted(range(len(tree)), key=lambda i: (-float(scores[i]), i))[:max_nodes]
        keep = torch.zeros(len(tree), dtype=torch.bool)
        keep[order] = True
    pruned, index = prune(tree, keep)
    return pruned, index >= 0
