"""One decoding round: propose → verify (one target forward) → accept → commit → learn.

A chain is a tree with one path, so one round serves every strategy: plain decoding (the empty
draft: the target runs on the last emitted token alone), chains (speculative, DSpark) and trees
(SPORK). A round is split where the scheduler (`engine.batch`) puts the target's forward of one
or many requests: `propose`/`plan_round` before it, `round_segment` the rows it runs,
`finish_round` after it. Chains keep two fast paths: the target runs them without a tree mask,
and the vectorised chain check accepts them. `history[-1]` of the request is the last emitted
token, not yet in the target's cache: it is the root the draft hangs below.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch

from specfork.drafters.base import EMPTY_DRAFT, Draft, Drafter, DraftShape, Feedback
from specfork.engine.forced import is_forced, with_forced
from specfork.engine.request import Request
from specfork.engine.stats import RoundRecord
from specfork.kernels.sample_rows import fast_probabilities, fast_sample, fast_sample_at
from specfork.models.base import Segment
from specfork.sampling import probabilities
from specfork.strategies.policies import RoundInfo
from specfork.tree import cache_indices, children, depths, tree_mask, tree_positions
from specfork.verify import Verdict, verify_greedy, verify_sampling
from specfork.verify.keyed import verify_keyed
from specfork.verify.tree import verify_tree_greedy, verify_tree_sampling, verify_tree_typical

NO_SHAPE = DraftShape(0)


@dataclass(frozen=True, eq=False)
class Planned:
    """A round before the target's forward: the policy's shape, the drafter's proposal, the
    draft to verify, the grammar's masks per row and the cache slot of the root."""

    shape: DraftShape
    proposed: Draft
    draft: Draft
    allowed: torch.Tensor | None  # [N + 1, V] bool, when the request has a grammar
    start: int


def plan_round(
    req: Request,
    proposal: tuple[DraftShape, Draft, Draft] | None = None,
    trim: int | None = None,
) -> Planned:
    """Propose (or take `propose`'s result), keep at most `trim` nodes when a batch's budget
    says so, and let the grammar cut what it forbids."""
    shape, proposed, draft = proposal or propose(req)
    t0 = time.perf_counter()
    if trim is not None and len(draft) > trim:
        draft = trimmed(draft, trim)
    allowed = None
    if req.grammar is not None:  # drafts the grammar rules out are cut; masks per row
        draft, allowed = req.grammar.constrain(draft)  # [N + 1, V] bool
    req.stats.spend("prepare", t0)
    return Planned(shape, proposed, draft, allowed, req.cache.length)


def finish_round(
    req: Request, planned: Planned, logits: torch.Tensor, hidden: torch.Tensor | None
) -> list[int]:
    """Accept, commit and learn from the target's logits [N + 1, V] (and captured hidden
    states [C, N + 1, D]) at the planned draft's rows; the tokens to emit."""
    draft, allowed, stats = planned.draft, planned.allowed, req.stats
    t0 = time.perf_counter()
    p_logits = target_logits(req, draft, logits)  # the penalised target, when it asks
    verdict = accept(req, draft, p_logits if allowed is None else constrained(p_logits, allowed))
    tokens = verdict.tokens if req.grammar is None else req.grammar.advance(verdict.tokens)
    req.note_logprobs(logits, [0, *(1 + n for n in verdict.path)], verdict.tokens)
    t0 = stats.spend("accept", t0)
    commit(req, draft, verdict, planned.start, logits, hidden)
    t0 = stats.spend("commit", t0)
    learn(req, planned.shape, planned.proposed, draft, verdict, logits)
    stats.spend("learn", t0)
    return tokens


def target_logits(req: Request, draft: Draft, logits: torch.Tensor) -> torch.Tensor:
    """The target's logits [N + 1, V] with the request's penalties and logit biases at every
    row (each row counts the drafted tokens on its own path), or `logits` without them."""
    if not req.sampling.penalized:
        return logits
    parents = None if draft.is_chain else draft.tree.parents.tolist()
    return req.target_logits(logits, draft.tokens.tolist(), parents)


def round_segment(req: Request, draft: Draft, device: torch.device) -> Segment:
    """The rows of a round (the root, then the drafted nodes) as a segment of a batched
    forward: their tokens, positions and mask (None for a chain: causal)."""
    start = req.cache.length
    rows = torch.tensor([req.history[-1], *draft.tokens.tolist()], device=device)  # [N + 1]
    if draft.is_chain:
        return Segment(rows, torch.arange(start, start + len(rows), device=device), req.cache)
    mask = tree_mask(draft.tree).to(device)  # [N + 1, N + 1]
    return Segment(rows, tree_positions(draft.tree, start).to(device), req.cache, mask)


def trimmed(draft: Draft, n: int) -> Draft:
    """The first `n` nodes of a draft in `node_order`: a chain's head, a tree's best-scored
    nodes (every kept node's parent is kept)."""
    if draft.is_chain:
        return draft.head(n)
    keep = torch.zeros(len(draft), dtype=torch.bool)  # [N]
    keep[node_order(draft)[:n]] = True
    return draft.subset(keep)


def node_order(draft: Draft) -> list[int]:
    """The order in which a draft's nodes are worth verifying: a chain's positions; a tree's
    nodes by prior score, ties by index (scores never grow down a path and children come
    after their parents, so every node comes after its parent); by index without scores."""
    if draft.is_chain or draft.scores is None:
        return list(range(len(draft)))
    scores = draft.scores.tolist()
    return sorted(range(len(scores)), key=lambda i: (-scores[i], i))


def constrained(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Logits [..., V] with the tokens a grammar forbids (allowed [..., V] False) at −inf."""
    return logits.masked_fill(~allowed.to(logits.device), float("-inf"))


def propose(req: Request, overhead: float = 0.0) -> tuple[DraftShape, Draft, Draft]:
    """The policy's shape fitted to the request, the drafter's proposal, and what the goodput
    gate keeps of it (shape, proposed, draft); the tokens a grammar forces instead, when the
    draft does not cover them (`engine.forced`). `overhead`: what verifying a draft adds to the
    round in host work, in one-row forwards (`engine.overhead`)."""
    return with_forced(req, drafted(req, overhead))


def drafted(req: Request, overhead: float = 0.0) -> tuple[DraftShape, Draft, Draft]:
    """`propose` without the grammar's forced tokens."""
    if req.drafter is None or req.policy is None:
        return NO_SHAPE, EMPTY_DRAFT, EMPTY_DRAFT
    t0 = time.perf_counter()
    req.gate.at_context(req.cache.length, overhead)  # rows cost more at a longer context
    shape = fit_shape(req, req.policy.next_shape(req.generated))
    if shape.depth < 1 or shape.max_nodes < 1:
        req.stats.spend("draft", t0)
        return shape, EMPTY_DRAFT, EMPTY_DRAFT
    proposed = req.drafter.propose(req.history, shape, req.sampling, req.rng)
    draft = gated(req, proposed)
    req.stats.spend("draft", t0)
    return shape, proposed, draft


def fit_shape(req: Request, shape: DraftShape) -> DraftShape:
    """`shape` within the request's room: every path leaves a slot for the target's token,
    every node needs a cache slot, and a costly drafter's network drafts only what pays
    (`model_depth`; the free sources of a fallback still draft to `depth`)."""
    assert req.drafter is not None
    depth = min(shape.depth, req.room - 1)
    budget = shape.budget
    if shape.kind != "chain":
        budget = min(shape.max_nodes, req.cache.max_len - req.cache.length - 1)
    model_depth = shape.model_depth
    paying = None
    if req.drafter.cost > 0:
        paying = req.gate.depth_for(req.drafter.name, depth, req.drafter.cost)
    if paying is not None:
        model_depth = paying if model_depth is None else min(model_depth, paying)
    return dataclasses.replace(shape, depth=max(depth, 0), budget=budget, model_depth=model_depth)


def gated(req: Request, proposed: Draft) -> Draft:
    """What the request's gate keeps of a draft (strategies/goodput.py)."""
    if not len(proposed) or req.drafter is None:
        return proposed
    return req.gate.trim(proposed, by_network(req.drafter, proposed))


def by_network(drafter: Drafter, draft: Draft) -> bool:
    """Whether a costly drafter's network drafted `draft` (its scores are then that network's
    probabilities): a plain costly drafter's drafts, a fallback's drafts it labelled with its
    own name — not those of a fallback's free source, which keep their own labels."""
    return drafter.cost > 0 and draft.source == drafter.name


def accept(req: Request, draft: Draft, logits: torch.Tensor) -> Verdict:
    """Which drafted nodes the target accepts, and its own next token (lossless unless the
    request asked for Medusa's typical acceptance)."""
    sampling, spec = req.sampling, req.spec
    if spec.lossy_typical:
        p = logits.softmax(-1) if sampling.greedy else probabilities(logits, sampling)
        return verify_tree_typical(draft.tree, p, spec.typical_epsilon, spec.typical_delta)
    if not sampling.greedy and sampling.seed is not None:  # the seed's own draws decide
        p = fast_probabilities(logits, sampling)  # [N + 1, V]
        return verify_keyed(draft.tree, p, sampling.seed, len(req.history), fast_sample_at)
    if draft.is_chain:  # the vectorised chain check
        drafted = draft.tokens.to(logits.device)  # [K]
        if sampling.greedy:
            return verify_greedy(drafted, logits)
        p = fast_probabilities(logits, sampling)  # [K + 1, V]
        # q None: deterministic drafts
        return verify_sampling(drafted, p, draft.q, req.rng, fast_sample)
    if sampling.greedy:
        return verify_tree_greedy(draft.tree, logits)
    p = fast_probabilities(logits, sampling)  # [N + 1, V]
    return verify_tree_sampling(draft.tree, p, draft.q, req.rng, fast_sample)


def commit(
    req: Request,
    draft: Draft,
    verdict: Verdict,
    start: int,
    logits: torch.Tensor,
    hidden: torch.Tensor | None,
) -> None:
    """Keep the accepted path in the cache (slot `start` holds the root) and tell the drafter
    (the target's logits and hidden states [C, N + 1, D] at every row, when it asks)."""
    if draft.is_chain:
        req.cache.truncate(start + 1 + verdict.accepted)  # drop the rejected drafts' entries
    else:
        req.cache.keep(cache_indices(verdict.path, start), start)  # the path, compacted
    if req.drafter is None:
        return
    rows = torch.tensor([req.history[-1], *draft.tokens.tolist()], device=logits.device)
    wanted = logits if req.drafter.wants_logits else None
    committed = len(req.history) + verdict.accepted
    own = not is_forced(draft)
    req.drafter.observe(Feedback(committed, rows, verdict.path, wanted, hidden, own=own))


def learn(
    req: Request,
    shape: DraftShape,
    proposed: Draft,
    draft: Draft,
    verdict: Verdict,
    logits: torch.Tensor,
) -> None:
    """The gate, the policy and the statistics learn from the round."""
    node_depths = list(range(1, len(draft) + 1)) if draft.is_chain else depths(draft.tree).tolist()
    depth = max(node_depths, default=0)
    req.stats.record_round(len(draft), verdict.accepted, depth)
    if len(draft):
        req.stats.record_sources([draft.origin(i) for i in range(len(draft))], set(verdict.path))
    extra: dict = {}
    if req.drafter is not None and req.policy is not None:
        observe_gate(req, proposed, draft, verdict)
        req.stats.draft_forwards += draft.forwards
        emitted = req.generated + len(verdict.tokens)
        req.policy.update(_policy_info(draft, verdict, emitted, logits, depth))
        extra = {**req.policy.trace(), "proposed": len(proposed)}  # before the gate
        if req.spec.lossy_typical:
            extra["lossy"] = True
    first_rejected = len(draft) > 0 and verdict.accepted == 0
    req.stats.rounds.append(
        RoundRecord(
            len(req.stats.rounds),
            req.generated,
            shape.depth,
            len(draft),
            verdict.accepted,
            len(verdict.tokens),
            first_rejected,
            extra,
        )
    )


def _policy_info(
    draft: Draft, verdict: Verdict, emitted: int, logits: torch.Tensor, depth: int
) -> RoundInfo:
    """What the policy learns from a round: its drafter's draft and what of it was accepted;
    a round that verified the grammar's forced tokens instead counts as one without a draft
    (the policy's drafter proposed nothing that was verified)."""
    if is_forced(draft):
        return RoundInfo(0, 0, emitted, logits)
    return RoundInfo(len(draft), verdict.accepted, emitted, logits, _fork(draft, verdict), depth)


def _fork(draft: Draft, verdict: Verdict) -> int | None:
    """The sibling rank of the accepted path's first node (None: nothing accepted)."""
    if not verdict.path:
        return None
    return 0 if draft.is_chain else children(draft.tree)[0].index(verdict.path[0])


def observe_gate(req: Request, proposed: Draft, draft: Draft, verdict: Verdict) -> None:
    """The request's gate learns from the round (a chain gate per source and position, a tree
    gate per node kind)."""
    costly = req.drafter is not None and by_network(req.drafter, proposed)
    req.gate.learn(proposed, draft, verdict, costly)
