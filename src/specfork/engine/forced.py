"""Tokens a grammar forces, drafted for free (jump-forward decoding as a draft source).

Under a constraint, the grammar often leaves one way on: a JSON object's next key, the rest of
a tool's name once its first letters are out, the `": "` between a key and its value.
llguidance's fast-forward tokens (`GrammarState.forced`) are those bytes tokenized as the
model's tokenizer would. Drafting them costs no model and the target nearly always accepts
them (its masked distribution has one way on; it can only refuse where the same bytes have
another tokenization), so a constrained request of a speculative strategy verifies them as a
chain under the source label `grammar`, learned and trimmed by the goodput gate like any other
source. Lossless as any draft: greedy keeps the target's argmax; sampling accepts a
deterministic draft token x with probability p(x) and otherwise draws from the residual.

The drafter's own proposal stays when it is a chain that already starts with the forced tokens
and goes on past them. Otherwise the forced chain is verified instead, continued by what the
drafter expects after them (`drafters.base.follow`: n-gram and suffix lookups read without
learning the forced tokens; a drafter that would have to run a model gives nothing), trimmed by
the gate by that source's own rates; the drafter is told that the round was not its proposal
(`Feedback.own`). Plain decoding (`ar`, no drafter) never drafts them: it is the baseline;
`SpecConfig(grammar_drafts=False)` (`--no-grammar-drafts`) turns them off.
"""

from __future__ import annotations

import time

import torch

from specfork.drafters.base import Draft, DraftShape, chain_draft, follow
from specfork.engine.request import Request
from specfork.tree import chain

SOURCE = "grammar"
MOST = 16  # forced tokens verified in one round at most


def with_forced(
    req: Request, proposal: tuple[DraftShape, Draft, Draft]
) -> tuple[DraftShape, Draft, Draft]:
    """The round's (shape, proposed, draft), or (shape, forced, what the gate keeps of them)
    when the grammar forces tokens, the draft does not already cover them and the gate keeps
    some."""
    if req.grammar is None or req.drafter is None or not req.spec.grammar_drafts:
        return proposal
    t0 = time.perf_counter()
    shape, _, draft = proposal
    most = min(MOST, req.room - 1)
    tokens = req.grammar.forced(most)
    if not tokens or _covers(draft, tokens):
        req.stats.spend("draft", t0)
        return proposal
    forced = chain_draft(torch.tensor(tokens, dtype=torch.long), source=SOURCE)
    kept = req.gate.trim(forced, False)
    if len(kept) == len(forced):  # the drafter goes on past them, as far as its gate says
        after = follow(req.drafter, req.history, tokens, most - len(tokens))
        kept = joined(kept, req.gate.trim(after, False) if len(after) else after)
    req.stats.spend("draft", t0)
    return (shape, forced, kept) if len(kept) else proposal


def joined(forced: Draft, after: Draft) -> Draft:
    """The chain `forced` then `after`, each node labelled with its own source."""
    if not len(after):
        return forced
    tokens = torch.cat([forced.tokens, after.tokens.to(forced.tokens.device)])  # [F + A]
    origins = tuple(forced.origin(i) for i in range(len(forced)))
    origins += tuple(after.origin(i) for i in range(len(after)))
    return Draft(chain(tokens), source=SOURCE, origins=origins)


def _covers(draft: Draft, tokens: list[int]) -> bool:
    """Whether `draft` is a chain that starts with `tokens` and goes past them."""
    if not draft.is_chain or len(draft) <= len(tokens):
        return False
    return draft.tokens[: len(tokens)].tolist() == tokens


def is_forced(draft: Draft) -> bool:
    """Whether a round's draft is the grammar's forced chain rather than the drafter's."""
    return draft.source == SOURCE
