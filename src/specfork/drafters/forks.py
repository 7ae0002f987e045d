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
from specfork.drafters.base import (
    Draft,
    Drafter,
    DraftShape,
    Feedback,
    follow_first,
    own_feedback,
    start,
)
from specfork.drafters.recycle import RecycleTable
from specfork.tree import Tree, TreeBuilder, node_scores, prune_lists

GREEDY = SamplingParams()
RECYCLE = "recycle"  # the source name of the recycled top-k forks
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
        table: RecycleTable | None = None,
    ) -> None:
        """`chains`: the other sources (any drafters), by name. `prior` [V, width]: the recycle
        table every request starts from (`recycle_prior`); `table`: one to share (persist)."""
        if recycle and table is None:
            table = RecycleTable(vocab_size, width, prior=prior)
        self.table = table if recycle else None
        self.vocab_size, self.width, self.prior = vocab_size, width, prior
        self.persist = persist
        self.chains = chains
        self.name = "+".join([*([RECYCLE] if recycle else []), *chains])
        self.wants_logits = recycle or any(c.wants_logits for c in chains.values())
        # the union of what the sources ask for; each hears its own layers (observe)
        wanted = (i for c in chains.values() for i in c.hidden_layers)
        self.hidden_layers: tuple[int, ...] = tuple(dict.fromkeys(wanted))
        # target forwards one level of drafting costs (SporkPolicy's model depth)
        self.cost = sum(c.cost for c in chains.values())

    def begin(self, prompt_ids: list[int]) -> ForkDrafter:
        """A drafter for one request: its own recycle table (the shared one with `persist`) and
        its sources' own request drafters."""
        return ForkDrafter(
            self.vocab_size,
            recycle=self.table is not None,
            chains={name: start(source, prompt_ids) for name, source in self.chains.items()},
            width=self.width,
            persist=self.persist,
            prior=self.prior,
            table=self.table if self.persist else None,
        )

    def follow(self, history: list[int], tail: list[int], depth: int) -> Draft:
        """The first chain source's non-empty chain after history + `tail` (`base.follow`;
        the recycle table's guesses are one token's, too weak for a chain)."""
        return follow_first(self.chains.values(), history, tail, depth)

    def observe(self, feedback: Feedback) -> None:
        """The recycle table learns the target's logits; every source hears the feedback."""
        if self.table is not None and feedback.logits is not None:
            self.table.update(feedback.logit_tokens, feedback.logits)
        for source in self.chains.values():
            source.observe(own_feedback(feedback, self.hidden_layers, source.hidden_layers))

    def propose(
        self, history: list[int], shape: DraftShape, sampling: SamplingParams, rng: torch.Generator
    ) -> Draft:
        """A tree below history[-1] within `shape`: every source's tree merged into one trie.

        Sources draft greedily (deterministic proposals, one-hot q in verification); a node
        proposed by several sources keeps its best prior score.
        """
        builder = TreeBuilder()
        best: dict[int, tuple[float, str]] = {}  # node -> best prior score, the source of it
        forwards = 0
        if shape.depth >= 1:
            for source in self.chains.values():
                draft = source.propose(history, shape, GREEDY, rng)
                forwards += draft.forwards
                prior = draft.scores if draft.scores is not None else node_scores(draft.tree)
                _add_tree(builder, best, draft, prior.tolist())
            if self.table is not None:
                recycled = self._recycled(history[-1], shape)
                recycled_draft = Draft(recycled, source=RECYCLE)
                _add_tree(builder, best, recycled_draft, node_scores(recycled).tolist())
        prior = [best[i][0] for i in range(len(builder))]
        tree, kept = _cap(builder.tokens, builder.parents, prior, shape.tau, shape.max_nodes)
        scores = torch.tensor([prior[i] for i in kept], dtype=torch.float64)  # [N]
        return Draft(tree, None, scores, forwards, self.name, tuple(best[i][1] for i in kept))

    def _recycled(self, root: int, shape: DraftShape) -> Tree:
        assert self.table is not None
        if shape.kind == "dynamic":
            return self.table.build_dynamic(root, shape.max_nodes, shape.depth, branch=shape.forks)
        return self.table.build_forks(root, shape.forks, shape.depth)


def _add_tree(
    builder: TreeBuilder, best: dict[int, tuple[float, str]], draft: Draft, prior: list[float]
) -> None:
    """Merge a source's proposal (prior score per node) into the builder's trie; a node keeps
    its best score and the source that gave it (ties: the earlier source)."""
    index: list[int] = []  # draft node -> builder node
    tree = draft.tree
    rows = zip(tree.tokens.tolist(), tree.parents.tolist(), prior, strict=True)
    for i, (token, parent, score) in enumerate(rows):
        index.append(builder.add(-1 if parent < 0 else index[parent], token))
        if index[-1] not in best or score > best[index[-1]][0]:
            best[index[-1]] = (score, draft.origin(i))


def _cap(
    tokens: list[int], parents: list[int], scores: list[float], tau: float, max_nodes: int
) -> tuple[Tree, list[int]]:
    """Drop nodes scoring below τ, then keep the `max_nodes` best (ancestors always kept).

    τ never drops the best first-level node: a round always verifies at least one guess (a
    model drafter has paid for it already, and one more row costs the verifier little).
    scores [N] never exceed a node's parent's score within one source, and a merged node
    keeps its best source's score, so the kept set is closed under ancestors. Returns the
    smaller tree and the kept nodes' indices, on lists (a round's few nodes cost less so
    than as tensors).
    """
    keep = [False] * len(tokens)
    if tokens and max_nodes >= 1:
        keep = [score >= tau for score in scores]
        first = [i for i, parent in enumerate(parents) if parent < 0]
        keep[max(first, key=lambda i: (scores[i], -i))] = True  # ties: the earliest
        if sum(keep) > max_nodes:
            # a node scores at most its parent, so the best max_nodes (ties: earlier) are closed
            order = sorted(range(len(tokens)), key=lambda i: (-scores[i], i))[:max_nodes]
            keep = [False] * len(tokens)
            for i in order:
                keep[i] = True
    tree, index_map = prune_lists(tokens, parents, keep)
    return tree, [i for i, j in enumerate(index_map) if j >= 0]
