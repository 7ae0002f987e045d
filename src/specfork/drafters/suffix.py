"""SuffixDecoding (Oliaro et al. 2025; vLLM's `suffix` method): draft from a suffix index over
this request's prompt and output and every earlier request's.

Each request's drafter (`begin`) opens a sequence in the shared `SuffixIndex` with its prompt
and appends what the target commits (the accepted tokens of every round, and anything of the
history it has not seen when it drafts), so later requests draft from it too. A round matches
the history's longest suffix that occurred followed by something and proposes what followed,
scored by frequency: a chain along the most frequent continuation (speculative, dspark), or a
tree of the most probable continuations where earlier text went on differently (a SPORK
source). A longer match drafts deeper: at most ⌈`spec_factor` · match⌉ tokens, within the
policy's shape. Drafts prefer the request's own text, SuffixDecoding's per-request tree
(`suffix_local`): when the longest match occurs in this request's history at least as long as
anywhere, a chain is what followed its latest occurrence there, as deep as the shape allows,
and a tree has that chain as its first path, the index's nodes around it.
Proposals are deterministic (q = None), verified as one-hot q like n-gram's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specfork.config import SamplingParams
from specfork.drafters.base import EMPTY_DRAFT, Draft, DraftShape, Feedback
from specfork.drafters.suffix_index import Proposal, SuffixIndex
from specfork.drafters.suffix_local import LocalMatch, LocalMatches
from specfork.errors import ConfigError
from specfork.tree import Tree

#: history tokens checked against the indexed ones before appending: a history that does not
#: continue the request's sequence (another conversation) opens a new one
_CHECKED_TAIL = 16
#: match lengths that share acceptance statistics in the goodput gate (suffix-1 … suffix-8)
_MATCH_BUCKETS = (8, 4, 3, 2, 1)


@dataclass(frozen=True, slots=True)
class SuffixSettings:
    """How a suffix drafter drafts: suffixes up to `max_match` tokens are matched; a match of
    m tokens drafts at most ⌈`spec_factor` · m⌉ tokens deep; nodes whose path probability is
    below `min_prob` are not proposed (SuffixDecoding's defaults: factor 1, probability 0.1);
    `own`: drafts prefer the request's own text (see the module docstring; False: the shared
    index alone, as before 2026-12-07)."""

    max_match: int = 12
    spec_factor: float = 1.0
    min_prob: float = 0.1
    own: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.max_match, int) or self.max_match < 1:
            raise ConfigError(f"suffix max_match must be an integer >= 1, got {self.max_match}")
        if not self.spec_factor > 0:
            raise ConfigError(f"suffix spec_factor must be > 0, got {self.spec_factor}")
        if not 0 <= self.min_prob <= 1:
            raise ConfigError(f"suffix min_prob must be in [0, 1], got {self.min_prob}")
        if not isinstance(self.own, bool):
            raise ConfigError(f"suffix own must be True or False, got {self.own!r}")


class SuffixDrafter:
    """Drafts from a shared `SuffixIndex` (see the module docstring); no model, no cost."""

    name = "suffix"
    cost = 0.0
    wants_logits = False
    hidden_layers: tuple[int, ...] = ()

    def __init__(self, index: SuffixIndex, settings: SuffixSettings | None = None) -> None:
        self.index = index
        self.settings = settings or SuffixSettings()
        self._sequence: int | None = None  # this request's sequence in the index
        self._indexed: list[int] = []  # the history indexed so far (its last tokens checked)
        self._length = 0  # tokens of the history indexed
        self._local = LocalMatches()  # the same history, for matches within it

    def begin(self, prompt_ids: list[int]) -> SuffixDrafter:
        """A request's drafter: its prompt opens a sequence in the shared index."""
        drafter = SuffixDrafter(self.index, self.settings)
        drafter._open(list(prompt_ids))
        return drafter

    def propose(
        self, history: list[int], shape: DraftShape, sampling: SamplingParams, rng: torch.Generator
    ) -> Draft:
        """The index's continuations of `history`: a chain for a chain shape, else a tree of
        at most `shape.max_nodes` nodes (prior score: the path's probability)."""
        self._sync(history)
        if shape.depth < 1 or shape.max_nodes < 1:
            return EMPTY_DRAFT
        s, chain = self.settings, shape.kind == "chain"
        depth = min(shape.depth, shape.max_nodes)
        local = self._local.longest() if s.own else None
        reach = min(s.max_match, self.index.limits.depth - 1)  # the index's longest match
        if chain and local is not None and local.length >= reach:
            found = self._own(local, depth)  # no match in the index can be longer
        else:
            found = self._from_index(history, shape.max_nodes, shape.depth, chain)
            if local is not None and local.length >= found.match:
                own = self._own(local, depth)
                found = own if chain else _merged(own, found, shape.max_nodes)
        return _draft(found)

    def follow(self, history: list[int], tail: list[int], depth: int) -> Draft:
        """The index's chain after history + `tail` (`base.follow`): the index only read, so
        `tail` is neither indexed nor matched within the request's own text beyond the index."""
        self._sync(history)
        return _draft(self._from_index(history + tail, depth, depth, True))

    def _from_index(self, context: list[int], max_nodes: int, depth: int, chain: bool) -> Proposal:
        """The shared index's continuations of `context` by this drafter's settings."""
        s = self.settings
        return self.index.propose(
            context,
            max_match=s.max_match,
            max_nodes=max_nodes,
            max_depth=depth,
            spec_factor=s.spec_factor,
            min_prob=s.min_prob,
            chain=chain,
        )

    def _own(self, local: LocalMatch, depth: int) -> Proposal:
        """The chain after the latest occurrence of the history's longest suffix in the
        history itself (`local`), up to `depth` tokens: what a match at least as long as the
        index's drafts. Its tokens score 1 each, like n-gram's (a copy, not a frequency)."""
        tokens = self._local.following(local, depth)
        return Proposal(tokens, list(range(-1, len(tokens) - 1)), [1.0] * len(tokens), local.length)

    def observe(self, feedback: Feedback) -> None:
        """Index a round's root and accepted tokens (history positions committed − a − 1 …
        committed − 1), so the request's output is indexed up to its last round."""
        if feedback.prompt or self._sequence is None:
            return
        tokens = feedback.tokens.tolist()  # a round's few rows: lists, not a tensor gather
        rows = [tokens[i] for i in feedback.kept_rows]  # root, accepted tokens
        start = feedback.committed - len(rows)
        if start <= self._length < feedback.committed:
            self._append(rows[self._length - start :])

    def _open(self, tokens: list[int]) -> None:
        self._sequence = self.index.open(tokens)
        self._local = LocalMatches()
        self._local.extend(tokens)
        self._length = len(tokens)
        self._indexed = tokens[-_CHECKED_TAIL:]

    def _append(self, tokens: list[int]) -> None:
        assert self._sequence is not None
        self.index.extend(self._sequence, tokens)
        self._local.extend(tokens)
        self._length += len(tokens)
        self._indexed = (self._indexed + tokens)[-_CHECKED_TAIL:]

    def _sync(self, history: list[int]) -> None:
        """Append what `history` adds to the indexed tokens; a history that does not continue
        them opens a new sequence."""
        n = len(self._indexed)
        continues = len(history) >= self._length and (
            history[self._length - n : self._length] == self._indexed
        )
        if self._sequence is None or not continues:
            self._open(list(history))
        elif len(history) > self._length:
            self._append(history[self._length :])


def _draft(found: Proposal) -> Draft:
    """A proposal as a draft labelled by its match length's bucket (prior score: the path's
    probability)."""
    if not found.tokens:
        return EMPTY_DRAFT
    scores = torch.tensor(found.scores, dtype=torch.float64)  # [N]
    source = f"suffix-{next(b for b in _MATCH_BUCKETS if found.match >= b)}"
    return Draft(Tree(found.tokens, found.parents), None, scores, 0, source)


def _merged(own: Proposal, found: Proposal, max_nodes: int) -> Proposal:
    """A tree: the own chain first, then the index's nodes (`found`, topological) not already
    on it, in their order, while fewer than `max_nodes`; a node left out leaves out its
    subtree. The match is the own chain's (at least the index's)."""
    tokens, parents, scores = list(own.tokens), list(own.parents), list(own.scores)
    at = {(parent, token): i for i, (parent, token) in enumerate(zip(parents, tokens, strict=True))}
    where: list[int | None] = []  # found's node -> its merged node (None: left out)
    for token, parent, score in zip(found.tokens, found.parents, found.scores, strict=True):
        mapped = -1 if parent < 0 else where[parent]
        node = None if mapped is None else at.get((mapped, token))
        if node is None and mapped is not None and len(tokens) < max_nodes:
            node = at[(mapped, token)] = len(tokens)
            tokens.append(token)
            parents.append(mapped)
            scores.append(score)
        where.append(node)
    return Proposal(tokens, parents, scores, own.match)
