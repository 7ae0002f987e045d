"""The drafter protocol: what the engine asks of a drafter, and what it tells it back.

Every round the policy chooses a `DraftShape`; the drafter proposes a scored tree below the
last emitted token (a chain is a tree with one path) as a `Draft`; the target verifies every
node in one forward; the drafter then receives `Feedback`: how much of the history is final
(rollback point), the accepted path and, when it asks for them, the target's logits and chosen
blocks' hidden states at every row of that forward (and at the prompt rows during prefill: every
row's hidden states, the logits of each distinct token's newest row).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from specfork.checks import is_int
from specfork.config import SamplingParams
from specfork.errors import ConfigError
from specfork.tree import Tree, chain, prune

SHAPE_KINDS = ("chain", "forks", "dynamic")


@dataclass(frozen=True, slots=True)
class StepConfidence:
    """DSpark's confidence rule for a drafter that sees its own distribution (a trained head):
    a chain stops before the token whose confidence

        C = (w_top1·top1 + w_margin·min(margin_scale·margin, 1) + w_ema·ema) / Σw

    is below `low`, with top1 and margin the drafter's own top-1 probability and top-1 − top-2
    gap at that step and `ema` the request's acceptance EMA. The first token is drafted only if
    it passes too (a risky round drafts nothing)."""

    weights: tuple[float, float, float]
    margin_scale: float
    ema: float
    low: float

    def value(self, top1: float, margin: float) -> float:
        w_top1, w_margin, w_ema = self.weights
        scaled = min(self.margin_scale * margin, 1.0)
        return (w_top1 * top1 + w_margin * scaled + w_ema * self.ema) / sum(self.weights)

    def keeps(self, top1: float, margin: float) -> bool:
        return self.value(top1, margin) >= self.low

    def coefficients(self) -> tuple[float, float, float, float, float]:
        """The rule as (w_top1 / Σw, w_margin / Σw, w_ema · ema / Σw, margin_scale, low): C is
        the first times top1 plus the second times min(scale · margin, 1) plus the third."""
        w_top1, w_margin, w_ema = self.weights
        total = sum(self.weights)
        scaled = (w_top1 / total, w_margin / total, w_ema * self.ema / total)
        return (*scaled, self.margin_scale, self.low)

    def allows(self, probs: torch.Tensor) -> bool:
        """Whether the next token may be drafted from the drafter's distribution `probs` [V]."""
        top = probs.topk(2).values.tolist() if probs.numel() > 1 else [float(probs[0]), 0.0]
        return self.keeps(top[0], top[0] - top[1])


@dataclass(frozen=True, slots=True)
class DraftShape:
    """What a drafter is asked to grow this round (chosen by the draft policy).

    `depth` bounds every path (a chain's length K); a chain drafter reads nothing else. Tree
    drafters read `kind` ("forks": `forks` first tokens, each continued; "dynamic": the
    `budget` best nodes, branching by `forks`), `budget` (most nodes), `tau` (prior-score
    threshold) and `model_depth` (deepest level a model source drafts; None = depth). A chain
    drafter that sees its own distribution may stop early by `confidence` (DSpark's rule).
    """

    depth: int
    kind: str = "chain"
    forks: int = 1
    budget: int | None = None
    tau: float = 0.0
    model_depth: int | None = None
    confidence: StepConfidence | None = None

    def __post_init__(self) -> None:
        if self.kind not in SHAPE_KINDS:
            raise ValueError(f"draft shape kind must be one of {SHAPE_KINDS}, got {self.kind!r}")
        for name in ("depth", "forks", "budget", "model_depth"):
            value = getattr(self, name)
            if value is not None and (not is_int(value)):
                raise ValueError(f"draft shape {name} must be an integer, got {value!r}")
            if value is not None and value < 0:
                raise ValueError(f"draft shape {name} must be >= 0, got {value}")
        if not self.tau >= 0:
            raise ValueError(f"draft shape tau must be >= 0, got {self.tau}")

    @property
    def max_nodes(self) -> int:
        """Most nodes the shape allows."""
        if self.budget is not None:
            return self.budget
        return self.depth if self.kind == "chain" else self.forks * self.depth


@dataclass(frozen=True, slots=True)
class Draft:
    """A proposed tree (a chain: one path), with q where the drafter sampled its tokens.

    `q[i]` is the distribution node i's token was drawn from (after the request's sampling
    transforms); None for deterministic proposals (n-gram lookup, top-K forks, greedy
    drafting), which verification treats as one-hot q. `scores[i]` is node i's prior score
    (how likely the target is to accept it: a cumulative draft probability or a rank prior),
    non-increasing along every path; None when the drafter has none. `forwards` counts the
    drafter's model forwards spent on it; `source` names what produced it (e.g. "ngram-3"),
    for acceptance statistics. `origins` names each node's own source where a draft merges
    several (SPORK's trees: the source whose proposal of the node scored best); empty when
    every node is `source`'s.
    """

    tree: Tree
    q: torch.Tensor | None = None  # [N, V] float32
    scores: torch.Tensor | None = None  # [N] float64
    forwards: int = 0
    source: str = ""
    origins: tuple[str, ...] = ()  # [N] or ()

    def __len__(self) -> int:
        return len(self.tree)

    @property
    def tokens(self) -> torch.Tensor:
        """The nodes' tokens [N] int64."""
        return self.tree.tokens

    @property
    def is_chain(self) -> bool:
        """Whether every node is the child of the one before (no branching)."""
        return self.tree.is_chain

    def head(self, k: int) -> Draft:
        """The first k tokens (their q and scores) of a chain draft."""
        if k >= len(self):
            return self
        q = None if self.q is None else self.q[:k]
        scores = None if self.scores is None else self.scores[:k]
        origins = self.origins[:k]
        return Draft(chain(self.tokens[:k]), q, scores, self.forwards, self.source, origins)

    def subset(self, keep: torch.Tensor) -> Draft:
        """The nodes where `keep` [N] is True, with their q and scores (a kept node's parent
        must be kept)."""
        tree, index = prune(self.tree, keep)
        kept = index >= 0  # [N]
        q = None if self.q is None else self.q[kept]
        scores = None if self.scores is None else self.scores[kept]
        return Draft(tree, q, scores, self.forwards, self.source, kept_origins(self, kept))

    def origin(self, node: int) -> str:
        """The source that proposed `node`."""
        return self.origins[node] if self.origins else self.source


def kept_origins(draft: Draft, kept: torch.Tensor) -> tuple[str, ...]:
    """`draft.origins` of the nodes where `kept` [N] is True (() when it has none)."""
    if not draft.origins:
        return ()
    return tuple(o for o, k in zip(draft.origins, kept.tolist(), strict=True) if k)


def chain_draft(
    tokens: torch.Tensor | list[int],
    q: torch.Tensor | None = None,
    *,
    scores: torch.Tensor | None = None,
    forwards: int = 0,
    source: str = "",
) -> Draft:
    """A chain draft of `tokens` [K]."""
    return Draft(chain(tokens), q, scores, forwards, source)


EMPTY_DRAFT = chain_draft(torch.empty(0, dtype=torch.long))


@dataclass(frozen=True, slots=True)
class Feedback:
    """What one target forward taught: sent to the drafter after prefill chunks and rounds.

    `committed`: the first `committed` history tokens are final — anything a drafter cached
    beyond them was rejected. `tokens` [T] are the forward's input rows (a prefill chunk —
    `prompt` true: every row is history — or the round's root followed by the draft's nodes)
    and `path` the accepted nodes (empty for prefill). `logits` [T, V] are the target's
    logits at those rows, present when the drafter `wants_logits` — of a prompt chunk only at
    `logit_rows` ([U, V]: each distinct token's newest row, `newest_rows`; full-vocabulary
    logits at every prompt row would cost up to a second prefill on a large vocabulary, and
    what followed a token's latest occurrence is all a recycle table keeps); `hidden` [C, T, D]
    (float32) the outputs of the target's blocks named by the drafter's `hidden_layers`, in
    that order, present when it names any. `own` is False when a round verified another
    source's draft instead of the drafter's (the tokens a grammar forces): a drafter that
    cached its own proposal must then drop it from the round's root on.
    """

    committed: int
    tokens: torch.Tensor  # [T] int64
    path: list[int] = field(default_factory=list)
    logits: torch.Tensor | None = None  # [T, V]
    hidden: torch.Tensor | None = None  # [C, T, D]
    prompt: bool = False  # the rows are a prompt chunk
    logit_rows: torch.Tensor | None = None  # [U] int64: the rows `logits` are of (None: all)
    own: bool = True  # the round verified this drafter's proposal (or a part of it)

    @property
    def logit_tokens(self) -> torch.Tensor:
        """[U] the input tokens whose next-token logits `logits` holds, row for row."""
        return self.tokens if self.logit_rows is None else self.tokens[self.logit_rows]

    @property
    def kept_rows(self) -> list[int]:
        """The rows that became history: every prompt row; a round's root and accepted
        nodes (row 0 is the root, node n is row n + 1)."""
        return list(range(len(self.tokens))) if self.prompt else [0, *(1 + n for n in self.path)]


def newest_rows(tokens: torch.Tensor) -> torch.Tensor:
    """[U] int64, ascending: the index of the last occurrence of each distinct token of
    `tokens` [T] (the last row always among them). A dict over the ids: a round's few rows
    cost ~2 µs this way, ~90 µs through `unique` and a scatter."""
    newest = {t: r for r, t in enumerate(tokens.tolist())}  # a token's later row wins
    return torch.tensor(sorted(newest.values()), dtype=torch.long, device=tokens.device)


def own_feedback(feedback: Feedback, layers: tuple[int, ...], wanted: tuple[int, ...]) -> Feedback:
    """`feedback`, whose hidden states are those of `layers`, with only those of `wanted` (in
    its order): what one source of a composite drafter hears."""
    if feedback.hidden is None or wanted == layers:
        return feedback
    rows = [layers.index(i) for i in wanted]
    return dataclasses.replace(feedback, hidden=feedback.hidden[rows] if rows else None)


class Drafter(Protocol):
    """Anything that proposes scored trees continuing the committed history.

    `begin` gives each request its own drafter, so that several requests can be in flight
    (`start`); the engine then calls `propose` and `observe` on that one.

    `cost`: target forwards one drafting step costs (0 for sources that run no model: their
    drafts are trimmed after drafting; a costly drafter should draft at most
    `shape.model_depth` tokens when it is set: the goodput gate sets it to what pays).
    `wants_logits`: the engine passes the target's logits at every row of every forward,
    prompt included, in `Feedback` (Token Recycling learns from them). `hidden_layers`: the
    target's blocks (0-based; their outputs before the final norm) whose hidden states every
    `Feedback` carries, prompt included (EAGLE-style heads read low, middle and high blocks);
    empty for none.
    """

    name: str
    cost: float
    wants_logits: bool
    hidden_layers: tuple[int, ...]

    def begin(self, prompt_ids: list[int]) -> Drafter | None:
        """The drafter of a new request: one with state of its own (a draft model's KV cache,
        a recycle table) sharing this one's weights, or None to use this one (no state)."""

    def propose(
        self, history: list[int], shape: DraftShape, sampling: SamplingParams, rng: torch.Generator
    ) -> Draft:
        """A tree within `shape` continuing `history` (prompt + output so far)."""

    def observe(self, feedback: Feedback) -> None:
        """Learn what the target's forward decided; forget anything past `committed`."""


def follow(drafter: Drafter, history: list[int], tail: list[int], depth: int) -> Draft:
    """A chain of at most `depth` tokens that `drafter` expects after `history` + `tail`,
    where `tail` is not history yet (tokens a grammar forces, about to be verified): read from
    what the drafter has learned without learning `tail`. Optional: a drafter without a
    `follow` method (one that would have to run a model) gives the empty draft."""
    method = getattr(drafter, "follow", None)
    if method is None or depth < 1:
        return EMPTY_DRAFT
    return method(history, tail, depth)


def follow_first(
    sources: Iterable[Drafter], history: list[int], tail: list[int], depth: int
) -> Draft:
    """The first non-empty `follow` chain of `sources`, asked in order (a composite's)."""
    for source in sources:
        draft = follow(source, history, tail, depth)
        if len(draft):
            return draft
    return EMPTY_DRAFT


def start(drafter: Drafter, prompt_ids: list[int]) -> Drafter:
    """The drafter of a request that begins with `prompt_ids` (`Drafter.begin`)."""
    session = drafter.begin(prompt_ids)
    return drafter if session is None else session


def check_drafter(drafter: object, num_layers: int) -> None:
    """Raise ConfigError naming what a custom drafter lacks of the `Drafter` protocol, or
    hidden layers a target of `num_layers` blocks does not have."""
    missing = [
        name
        for name in ("name", "cost", "wants_logits", "hidden_layers", "begin", "propose", "observe")
        if not hasattr(drafter, name)
    ]
    if missing:
        raise ConfigError(
            f"the drafter {type(drafter).__name__} lacks {', '.join(missing)} of the Drafter "
            "protocol (specfork.drafters.base.Drafter): give it name, cost (0.0 for a drafter "
            "that runs no model), wants_logits, hidden_layers (() for none), begin(), propose() "
            "and observe()"
        )
    layers = drafter.hidden_layers  # type: ignore[attr-defined]
    valid = isinstance(layers, tuple | list) and all(
        is_int(i) and 0 <= i < num_layers for i in layers
    )
    if not valid or len(set(layers)) != len(layers):
        raise ConfigError(
            f"the drafter {type(drafter).__name__} asks for hidden_layers {layers!r}: give a "
            f"tuple of distinct block indices in [0, {num_layers}) of the target, or () for none"
        )
