"""Cost-aware draft length: verify only as much of a draft as is expected to pay for itself.

A target forward over R rows costs c(R) one-row forwards (`CostCurve`, measured on the model
itself). If the i-th drafted token is accepted, given the ones before it were, with
probability a_i, a draft of k tokens emits E(k) = 1 + Σ_{i≤k} Π_{j≤i} a_j tokens per forward,
so the gate keeps the k ≤ len(draft) that maximises E(k) / c(k + 1); k = 0 is a plain step.
The a_i are learned during the request, per draft source (an n-gram match of n tokens is one
source, a draft model another) and per position, starting from a prior.

The gate only shortens drafts: which tokens are emitted never changes, so every strategy stays
lossless. It is what keeps speculation from costing more than it earns on a machine where
extra verification rows are not free (see docs/benchmarks.md).
"""

from __future__ import annotations

import functools
import heapq
import itertools
import math
from dataclasses import dataclass, field
from typing import Protocol

import torch

from specfork.drafters.base import Draft
from specfork.models.cost import CostCurve
from specfork.strategies.rate_memory import RateMemory
from specfork.tree import depth_list
from specfork.verify import Verdict

PRIOR = 0.5  # acceptance assumed at a position not yet observed
PRIOR_WEIGHT = 2.0  # the prior counts as this many observations
EXPLORE_EVERY = 16  # a costly drafter the gate has turned off still drafts one token this often
MIN_COST = 1e-6  # one-row forwards: what rows above sunk ones cost at least


@dataclass
class AcceptanceStats:
    """Per draft source and position: how often a drafted token was accepted. With a
    `memory`, it starts from the counts of the strategy's earlier requests and adds its own
    to them (`rate_memory`)."""

    hits: dict[str, list[float]] = field(default_factory=dict)
    trials: dict[str, list[float]] = field(default_factory=dict)
    memory: RateMemory | None = None

    def __post_init__(self) -> None:
        if self.memory is None:
            return
        for key, (h, t) in self.memory.seed().items():
            if key[0] != "chain":
                continue
            _, source, i = key
            hits = self.hits.setdefault(source, [])
            trials = self.trials.setdefault(source, [])
            while len(trials) <= i:
                hits.append(0.0)
                trials.append(0.0)
            hits[i] += h
            trials[i] += t

    def rates(self, source: str, k: int) -> list[float]:
        """a_1..a_k: the acceptance rate at each position (given the earlier ones accepted).
        A position starts from the rate of the one before it (the first from the prior 0.5):
        positions are observed only as far as a round's emitted tokens reach, so a gate that
        verifies three tokens learns the fourth from the bonus token and never the fifth; a
        copied span accepted whole at 1–4 is likely accepted at 5 too, and the gate then
        drafts one position deeper each round only while it keeps paying."""
        hits, trials = self.hits.get(source, []), self.trials.get(source, [])
        out: list[float] = []
        prior = PRIOR
        for i in range(k):
            h = hits[i] if i < len(hits) else 0.0
            t = trials[i] if i < len(trials) else 0.0
            out.append((h + prior * PRIOR_WEIGHT) / (t + PRIOR_WEIGHT))
            prior = out[-1]
        return out

    def best_first_rate(self) -> float:
        """The highest first-position rate of any source, a source not seen yet included (the
        prior): no chain this request drafts is worth more than that at its first node."""
        return max([PRIOR, *(self.rates(source, 1)[0] for source in self.trials)])

    def observe(self, source: str, drafted: list[int], emitted: list[int]) -> None:
        """Learn from a draft (before any trimming) and the tokens the round emitted: the
        drafted token at position i would have been accepted iff the ones before it were and
        it equals the i-th emitted token (exactly so for greedy decoding; for sampling, an
        estimate). Positions past the emitted tokens are not observed."""
        matched = 0
        while matched < min(len(drafted), len(emitted)) and drafted[matched] == emitted[matched]:
            matched += 1
        self._count(source, min(len(drafted), len(emitted)), matched)

    def _count(self, source: str, observed: int, accepted: int) -> None:
        seen = min(observed, accepted + 1)
        hits = self.hits.setdefault(source, [])
        trials = self.trials.setdefault(source, [])
        while len(trials) < seen:
            hits.append(0.0)
            trials.append(0.0)
        for i in range(seen):
            trials[i] += 1
            hits[i] += 1 if i < accepted else 0
            if self.memory is not None:
                self.memory.add(("chain", source, i), i < accepted)


def best_length(
    rates: list[float], cost: CostCurve, draft_cost: float = 0.0, overhead: float = 0.0
) -> int:
    """The k in [0, len(rates)] that maximises expected tokens per unit of cost: the target
    forward over k + 1 rows plus `draft_cost` (in target forwards) per drafted token, plus
    `overhead` (the host work of verifying any draft, `engine.overhead`) for k ≥ 1."""
    c = cost.table(len(rates) + 1)  # c(0..k+1), memoised per curve
    best, best_value = 0, 1.0 / c[1]
    expected, survive = 1.0, 1.0
    for k, a in enumerate(rates, start=1):
        survive *= a
        expected += survive
        value = expected / (c[k + 1] + draft_cost * k + overhead)
        if value > best_value:
            best, best_value = k, value
    return best


def _cost_above(cost: CostCurve, rows: int, sunk_rows: int) -> float:
    """What a forward of `rows` rows costs beyond the `sunk_rows` of them (prompt chunks) that
    run in it whatever is drafted: c(rows) − c(sunk_rows), or c(rows) when none are sunk (a
    flat stretch of a measured curve costs a tiny amount, never nothing)."""
    return max(cost(rows) - (cost(sunk_rows) if sunk_rows > 0 else 0.0), MIN_COST)


@functools.lru_cache(maxsize=4096)
def least_paying_value(
    roots: int, fixed_rows: int, cost: CostCurve, most: int, sunk_rows: int = 0
) -> float:
    """θ = min over n ≤ `most` of roots · (c(F + n) − c(F)) / ((c(F) − s) · n), F the
    `fixed_rows`, s the cost of the `sunk_rows` among them (see `allocate`): `allocate` keeps
    n draft nodes only if they are worth at least n·θ together (E / cost must beat a step of
    the roots alone), so a request whose nodes are all worth at most θ can only join a kept
    prefix through nodes of other requests worth more. In a full batch θ is high (16 roots on
    two cores: ~0.6), alone it is the price of one verification row; beside prompt chunks the
    roots' own share of the step is small and θ is high again.

    Memoised: a batch asks it every step with `most` up to its row budget (~130 evaluations of
    the curve, 0.6 ms in Python: 13% of a lone request's step), and the same few arguments
    come back step after step (a `CostCurve` is frozen, so it is a key like the counts)."""
    base = _cost_above(cost, fixed_rows, sunk_rows)
    step = cost(fixed_rows)
    return min(
        roots * (cost(fixed_rows + n) - step) / (base * n) for n in range(1, max(most, 1) + 1)
    )


def allocate(
    values: list[list[float]],
    fixed_rows: int,
    cost: CostCurve,
    fixed_tokens: float = 0.0,
    sunk_rows: int = 0,
) -> list[int]:
    """How many draft nodes each request of a batch verifies, to maximise expected tokens per
    unit of cost for the whole batch.

    `values[r]` are request r's drafted nodes in the order it would keep them, each the
    probability that the node is accepted. The forward already holds `fixed_rows` rows (each
    request's root, prompt chunks); every request emits at least one token. The requests'
    sequences are merged, always taking the best next node of any request (so each request's
    nodes stay in order), and the prefix with the best E / cost wins: one request alone
    keeps what its own gate would, and a full batch, whose extra rows cost nearly as much as
    whole tokens, keeps only the nodes that are nearly sure. `fixed_tokens` are the tokens
    expected from rows outside the allocation (requests that verify their drafts whole).

    `sunk_rows` of the fixed rows (prompt chunks) run in the forward whatever is drafted, and
    earn no tokens now: the decoding rows are charged only what they add to the forward,
    c(rows) − c(sunk_rows). Beside a long prompt chunk that is a row's marginal cost (the
    weights are read for the prompt anyway), so a draft node pays only if it is about as
    likely to be accepted as a root row is to emit — charged the whole c(rows), drafts looked
    nearly free there and displaced prompt rows (n-gram drafts took the batch to 0.90× plain
    decoding's throughput in a load run whose long prompts kept steps full of prefill).
    """
    heads = [(-vs[0], r, 0) for r, vs in enumerate(values) if vs]
    heapq.heapify(heads)
    merged: list[tuple[float, int]] = []
    while heads:
        v, r, i = heapq.heappop(heads)
        merged.append((-v, r))
        if i + 1 < len(values[r]):
            heapq.heappush(heads, (-values[r][i + 1], r, i + 1))
    expected, rows = len(values) + fixed_tokens, fixed_rows
    best, best_value = 0, expected / _cost_above(cost, rows, sunk_rows)
    for n, (v, _) in enumerate(merged, start=1):
        expected += v
        value = expected / _cost_above(cost, rows + n, sunk_rows)
        if value > best_value:
            best, best_value = n, value
    kept = [0] * len(values)
    for _, r in merged[:best]:
        kept[r] += 1
    return kept


class Gate(Protocol):
    """What the engine asks of a request's gate; it never looks inside one. `costly`: a costly
    drafter's network drafted the draft (its scores are that network's probabilities)."""

    def depth_for(self, source: str, depth: int, draft_cost: float) -> int | None:
        """How deep a costly drafter (`draft_cost` target forwards a token) should draft, at
        most `depth`; None: no opinion (the policy's shape stands)."""
        ...

    def trim(self, proposed: Draft, costly: bool) -> Draft:
        """What of a proposed draft to verify."""
        ...

    def values(self, draft: Draft, order: list[int]) -> list[float] | None:
        """P(accepted) of the draft's nodes in `order`, as learned; None: no estimate."""
        ...

    def learn(self, proposed: Draft, draft: Draft, verdict: Verdict, costly: bool) -> None:
        """Learn from a round: the proposal, the verified draft and the verdict."""
        ...

    def first_rate(self) -> float | None:
        """The best first-node acceptance any chain of this request may have (None: this gate
        does not rate chains), which a batch compares with what a node must be worth."""
        ...

    def at_context(self, tokens: int, overhead: float = 0.0) -> None:
        """The request's cache holds `tokens` tokens: price verification rows there, and a
        round that verifies a draft `overhead` one-row forwards more (its host work)."""
        ...


class NoGate:
    """Verify whatever is drafted (plain decoding, `goodput=false`)."""

    def depth_for(self, source: str, depth: int, draft_cost: float) -> int | None:
        return None

    def trim(self, proposed: Draft, costly: bool) -> Draft:
        return proposed

    def values(self, draft: Draft, order: list[int]) -> list[float] | None:
        return None

    def learn(self, proposed: Draft, draft: Draft, verdict: Verdict, costly: bool) -> None:
        return None

    def first_rate(self) -> float | None:
        return None

    def at_context(self, tokens: int, overhead: float = 0.0) -> None:
        return None


class GoodputGate:
    """Trims chains to their best expected length for one request (see the module doc)."""

    def __init__(self, cost: CostCurve, memory: RateMemory | None = None) -> None:
        """`memory`: the strategy's earlier requests' counts, which this one starts from and
        adds to (None: learn from this request alone)."""
        self.curve = cost  # measured; `cost` is it at the request's context (`at_context`)
        self.cost = cost
        self.overhead = 0.0  # a verifying round's host work, in one-row forwards
        self.stats = AcceptanceStats(memory=memory)
        # P(accepted) by prior score, for drafts that carry one
        self.scored = TreeGate(cost, memory, kind="scored")
        self._idle: dict[str, int] = {}  # rounds since a costly source last drafted

    def length(self, source: str, drafted: int, draft_cost: float = 0.0) -> int:
        """How many of `drafted` tokens from `source` to verify (draft_cost: per token).

        A costly source (draft_cost > 0: a draft model) that does not pay still drafts one
        token every EXPLORE_EVERY rounds, so that a change in its acceptance is noticed.
        """
        k = best_length(self.stats.rates(source, drafted), self.cost, draft_cost, self.overhead)
        if draft_cost > 0:
            idle = self._idle.get(source, 0)
            if k == 0 and idle + 1 >= EXPLORE_EVERY:
                k = 1
            self._idle[source] = 0 if k else idle + 1
        return k

    def observe(self, source: str, drafted: list[int], emitted: list[int]) -> None:
        if drafted:
            self.stats.observe(source, drafted, emitted)

    # -- the Gate protocol ------------------------------------------------------------------
    def depth_for(self, source: str, depth: int, draft_cost: float) -> int | None:
        return self.length(source, depth, draft_cost) if depth > 0 else None

    def trim(self, proposed: Draft, costly: bool) -> Draft:
        """A costly network's chain by its calibrated scores (the drafting is paid), any other
        draft by its source's per-position rates."""
        if not len(proposed):
            return proposed
        if costly and not proposed.is_chain:
            return proposed
        if costly and proposed.scores is not None:
            return proposed.head(self.trim_scored(proposed.scores.tolist()))
        return proposed.head(self.length(proposed.source, len(proposed)))

    def values(self, draft: Draft, order: list[int]) -> list[float] | None:
        """A chain's nodes: the product of the rates up to each, every run of nodes from one
        source (a chain joined from several, `origins`) by that source's own rates from its
        first position."""
        if not draft.is_chain:
            return None
        out, p = [], 1.0
        for source, length in _runs(draft):
            for a in self.stats.rates(source, length):
                p *= a
                out.append(p)
        return out

    def learn(self, proposed: Draft, draft: Draft, verdict: Verdict, costly: bool) -> None:
        """The source's rates from the whole proposal; a network's score calibration from its
        scored chains."""
        if not len(proposed):
            return
        drafted = proposed.tokens.tolist()
        self.observe(proposed.source, drafted, verdict.tokens)
        if proposed.is_chain and proposed.scores is not None and costly:
            self.observe_scored(proposed.scores.tolist(), drafted, verdict.tokens)

    def first_rate(self) -> float | None:
        return self.stats.best_first_rate()

    def at_context(self, tokens: int, overhead: float = 0.0) -> None:
        self.cost = self.curve.at(tokens)
        self.overhead = overhead
        self.scored.at_context(tokens, overhead)

    def trim_scored(self, scores: list[float]) -> int:
        """How many leading tokens of an already drafted chain to verify, judged by the
        drafter's own prior scores (non-increasing: a trained head's cumulative q) as
        calibrated in this request: the drafting is paid, only verification rows remain."""
        return sum(self.scored.keep(scores, list(range(-1, len(scores) - 1))))

    def observe_scored(self, scores: list[float], drafted: list[int], emitted: list[int]) -> None:
        """Learn the calibration from a scored chain (before trimming) and the emitted tokens:
        node i was on the accepted path iff it and the ones before it equal the emitted ones.
        Nodes past the emitted tokens are known only when the path broke before them."""
        matched = 0
        while matched < min(len(drafted), len(emitted)) and drafted[matched] == emitted[matched]:
            matched += 1
        seen = min(len(drafted), len(emitted))
        known = len(drafted) if matched < seen else seen  # a mismatch: every later node missed
        self.scored.observe(scores[:known], list(range(-1, known - 1)), list(range(matched)))


@functools.lru_cache(maxsize=4096)  # a handful of sources, depths and score values recur
def _node_key(origin: str, score: float, depth: int) -> tuple[str, int, int]:
    """Statistics bucket of a tree node: the source that proposed it, its depth (capped) and
    its prior score's octave."""
    octave = 0 if score >= 1.0 else min(8, int(-math.log2(max(score, 1e-9))) + 1)
    return origin, min(depth, 8), octave


class TreeGate:
    """Cost-aware node budget of a SPORK round.

    A node's bucket is its source, its depth and the octave of its step score (its prior
    score over its parent's: the source's own estimate of it once the parent is accepted).
    Each bucket learns a rate a: how often its nodes were accepted when their parent was —
    from every proposed node, the trimmed ones too (`would_accept`: its path against the
    emitted tokens), counting only nodes whose parent was (or would have been) accepted, so
    that what is not known (below the emitted tokens) does not bias a deep bucket. A node is
    on the accepted path with P(node) = a(node) · P(parent); the nodes ranked by P (ties: the
    earlier; every node then comes after its parent), keeping the first n emits
    E(n) = 1 + Σ P(node) tokens for c(n + 1), and the gate keeps the n that maximises the
    ratio. Sources are told apart because their nodes of one score are not alike: a suffix
    match's chain and the recycled top-1 fork both score 1, and on repetitive text the first
    is accepted several times as often. A bucket not seen yet starts from the pooled rate of
    its source's nodes at that depth (itself from the prior 0.5), capped by its step score: a
    source whose first-level nodes are rarely accepted is not trusted in octaves it has not
    tried yet.
    """

    def __init__(
        self, cost: CostCurve, memory: RateMemory | None = None, kind: str = "tree"
    ) -> None:
        """`memory`: the strategy's earlier requests' counts under `kind` (a chain gate's
        calibration of scored chains keeps its own), which this gate starts from and adds to."""
        self.curve = cost  # measured; `cost` is it at the request's context (`at_context`)
        self.cost = cost
        self.overhead = 0.0  # a verifying round's host work, in one-row forwards
        self.hits: dict[tuple[str, int, int], float] = {}
        self.trials: dict[tuple[str, int, int], float] = {}
        self._pool: dict[tuple[str, int], tuple[float, float]] = {}  # (source, depth) -> counts
        self.memory, self.kind = memory, kind
        self.paid = True  # whether the last tree this gate trimmed kept a node
        self._first: float | None = None  # first_rate's scan, until the counts change
        for key, (h, t) in (memory.seed() if memory is not None else {}).items():
            if key[0] == kind:
                self._add(key[1:], h, t)

    def probability(self, score: float, depth: int, origin: str = "") -> float:
        """The learned rate a of a node of this source, step score and depth: P(it is
        accepted | its parent is)."""
        return self._p(_node_key(origin, score, depth), score)

    def _p(self, key: tuple[str, int, int], score: float) -> float:
        prior = min(self._pooled(key[0], key[1]), score)
        h, t = self.hits.get(key, 0.0), self.trials.get(key, 0.0)
        return (h + prior * PRIOR_WEIGHT) / (t + PRIOR_WEIGHT)

    def _pooled(self, origin: str, depth: int) -> float:
        """The rate of every bucket of `origin` at `depth` together, from the prior 0.5."""
        h, t = self._pool.get((origin, depth), (0.0, 0.0))
        return (h + PRIOR * PRIOR_WEIGHT) / (t + PRIOR_WEIGHT)

    def _add(self, key: tuple[str, int, int], hits: float, trials: float) -> None:
        self._first = None
        self.hits[key] = self.hits.get(key, 0.0) + hits
        self.trials[key] = self.trials.get(key, 0.0) + trials
        h, t = self._pool.get(key[:2], (0.0, 0.0))
        self._pool[key[:2]] = (h + hits, t + trials)

    def node_values(
        self, scores: list[float], parents: list[int], origins: list[str] | None = None
    ) -> list[float]:
        """P(each node is on the accepted path): its parent's times the rate at which nodes
        of its bucket were accepted below an accepted parent (nodes in topological order;
        `origins` None: one unnamed source). Never more than the parent's."""
        out: list[float] = []
        for i, (key, step) in enumerate(_buckets(scores, parents, origins)):
            rate = self._p(key, step)
            out.append(rate if parents[i] < 0 else rate * out[parents[i]])
        return out

    def keep(
        self, scores: list[float], parents: list[int], origins: list[str] | None = None
    ) -> list[bool]:
        """Which nodes to verify: the best by `node_values` (ties: the earlier), as many as
        pay; every kept node's parent is kept."""
        values = self.node_values(scores, parents, origins)
        order = sorted(range(len(scores)), key=lambda i: (-values[i], i))
        cost = self.cost.table(len(scores) + 1)
        best, best_value, expected = 0, 1.0 / cost[1], 1.0
        for n, node in enumerate(order, start=1):
            expected += values[node]
            value = expected / (cost[n + 1] + self.overhead)
            if value > best_value:
                best, best_value = n, value
        keep = [False] * len(scores)
        for node in order[:best]:
            keep[node] = True
        return keep

    def observe(
        self,
        scores: list[float],
        parents: list[int],
        path: list[int],
        origins: list[str] | None = None,
    ) -> None:
        """Learn from a verified tree: which nodes were on the accepted path."""
        on_path = set(path)
        hits: list[bool | None] = [i in on_path for i in range(len(scores))]
        self.observe_outcomes(scores, parents, hits, origins)

    def observe_outcomes(
        self,
        scores: list[float],
        parents: list[int],
        hits: list[bool | None],
        origins: list[str] | None = None,
    ) -> None:
        """Learn whether each node whose parent was (or would have been) on the accepted path
        was on it too; None: not known. A node below a miss says nothing of its bucket's rate
        below an accepted parent, and is not counted."""
        seen = []
        for i, (key, _) in enumerate(_buckets(scores, parents, origins)):
            hit = hits[i]
            if hit is None or (parents[i] >= 0 and hits[parents[i]] is not True):
                continue
            self._add(key, float(hit), 1.0)
            seen.append(((self.kind, *key), hit))
        if self.memory is not None:
            self.memory.add_many(seen)

    # -- the Gate protocol ------------------------------------------------------------------
    def depth_for(self, source: str, depth: int, draft_cost: float) -> int | None:
        return None

    def trim(self, proposed: Draft, costly: bool) -> Draft:
        """A scored draft's best nodes (unscored drafts are verified whole)."""
        if not len(proposed) or proposed.scores is None:
            return proposed
        keep = self.keep(
            proposed.scores.tolist(), proposed.tree.parents.tolist(), _origins(proposed)
        )
        self.paid = any(keep)
        if all(keep):
            return proposed
        return proposed.subset(torch.tensor(keep, dtype=torch.bool))

    def values(self, draft: Draft, order: list[int]) -> list[float] | None:
        if draft.scores is None:
            return None
        values = self.node_values(
            draft.scores.tolist(), draft.tree.parents.tolist(), _origins(draft)
        )
        return [values[i] for i in order]

    def learn(self, proposed: Draft, draft: Draft, verdict: Verdict, costly: bool) -> None:
        """Which of the proposed nodes, verified or trimmed, were or would have been on the
        accepted path, by source, score and depth (`would_accept`): a bucket the gate trims
        away goes on learning, so it is kept again when its nodes start to pay."""
        if proposed.scores is None or not len(proposed):
            return
        parents = proposed.tree.parents.tolist()
        hits = would_accept(proposed.tree.tokens.tolist(), parents, verdict)
        self.observe_outcomes(proposed.scores.tolist(), parents, hits, _origins(proposed))

    def first_rate(self) -> float | None:
        """The best rate of a first-level node seen so far (the prior before any): no node
        of a tree is worth more than its best first-level node, so when that one cannot pay
        for a row, no tree can (the scheduler then skips drafting). 0 when the last tree
        trimmed kept nothing: no tree paid at this context and these rates (the scheduler
        still drafts one round in EXPLORE_EVERY, which asks again)."""
        if not self.paid:
            return 0.0
        if self._first is None:  # asked several times a round; the counts change in learn
            seen = [self._p(key, 1.0) for key, t in self.trials.items() if key[1] == 1 and t > 0]
            self._first = max(seen, default=PRIOR)
        return self._first

    def at_context(self, tokens: int, overhead: float = 0.0) -> None:
        self.cost = self.curve.at(tokens)
        self.overhead = overhead


def _runs(draft: Draft) -> list[tuple[str, int]]:
    """A chain's runs of consecutive nodes from one source: (source, length), in order."""
    return [(source, len(list(run))) for source, run in itertools.groupby(_origins(draft))]


def _origins(draft: Draft) -> list[str]:
    """The source of each node of `draft`."""
    return list(draft.origins) if draft.origins else [draft.source] * len(draft)


def _buckets(
    scores: list[float], parents: list[int], origins: list[str] | None
) -> list[tuple[tuple[str, int, int], float]]:
    """Each node's statistics bucket and its step score: its prior score over its parent's
    (the source's own estimate of it below an accepted parent, at most 1; the score itself at
    the first level), which keys the bucket and caps its prior."""
    out: list[tuple[tuple[str, int, int], float]] = []
    for i, (score, parent, depth) in enumerate(
        zip(scores, parents, depth_list(parents), strict=True)
    ):
        above = 1.0 if parent < 0 else scores[parent]
        step = min(1.0, score / above) if above > 0 else score
        out.append((_node_key(origins[i] if origins else "", step, depth), step))
    return out


def would_accept(tokens: list[int], parents: list[int], verdict: Verdict) -> list[bool | None]:
    """Whether each node would have been on the accepted path had it been verified: its path
    spells the round's first emitted tokens (exactly so for greedy decoding, whose emitted
    tokens are the target's own; an estimate for sampling). None where the emitted tokens stop
    above it: nothing says what the target would have done. Verified nodes get what the
    verifier decided."""
    emitted, on_path = verdict.tokens, set(verdict.path)
    hits: list[bool | None] = []
    for node, (token, parent, depth) in enumerate(
        zip(tokens, parents, depth_list(parents), strict=True)
    ):
        above = True if parent < 0 else hits[parent]
        if node in on_path:
            hit: bool | None = True
        elif above is False:
            hit = False  # below a miss
        elif above is None or depth > len(emitted):
            hit = None
        else:
            hit = token == emitted[depth - 1]
        hits.append(hit)
    return hits


def new_gate(tree: bool, cost: CostCurve, memory: RateMemory | None = None) -> Gate:
    """A fresh gate for a request that drafts: a tree gate for tree strategies (SPORK), else a
    chain gate; it starts from `memory`, its strategy's earlier requests, and adds to it."""
    return TreeGate(cost, memory) if tree else GoodputGate(cost, memory)
