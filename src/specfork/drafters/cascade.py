"""A draft cascade (`--drafter ngram+head --cascade`): a free source proposes a chain, a trained
head checks it and extends it before the target verifies anything.

The free source (n-gram or suffix lookup, several asked in order) copies long spans cheaply
but runs on past where the text stops repeating; the head, which sees the target's features,
reads a short proposed chain token by token, keeps each token it gives at least `keep` times
the probability of its own favourite, cuts the chain before the first it does not, and drafts
on with its own tokens up to the round's depth. With no proposal the head drafts alone. A
proposal longer than CHECKED tokens is a long match, which the target accepts most often
(SuffixDecoding's observation; on the agent workload checking such chains token by token cost
more head steps than a target forward and cut correct copies): it goes to the target
unchecked, priced as the free source's. Lossless like every draft: a kept token was chosen by
a deterministic rule (one-hot q), an extension token's q is the head's.

The drafts carry the cascade's name and the head's cost, so the goodput gate prices them as
the head's; when the gate finds the head does not pay (`shape.model_depth` 0) the free
source's chain goes unchecked under its own name and is trimmed by its own rates.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from specfork.config import SamplingParams
from specfork.drafters.base import (
    Draft,
    Drafter,
    DraftShape,
    Feedback,
    follow,
    own_feedback,
    start,
)

if TYPE_CHECKING:
    from specfork.drafters.head import HeadDrafter

KEEP = 0.1  # the head keeps a token it gives >= KEEP x the probability of its own top token
CHECKED = 3  # longer proposals go unchecked (long matches)


class CascadeDrafter:
    """`proposer`'s chains checked and extended by `checker` (see the module docstring)."""

    def __init__(self, proposer: Drafter, checker: HeadDrafter, keep: float = KEEP) -> None:
        if proposer.cost > 0:
            raise ValueError(f"a cascade's first stage runs no network, got {proposer.name}")
        self.proposer, self.checker, self.keep = proposer, checker, keep
        self.name = f"{proposer.name}>{checker.name}"
        self.wants_logits = proposer.wants_logits or checker.wants_logits
        wanted = (*proposer.hidden_layers, *checker.hidden_layers)
        self.hidden_layers: tuple[int, ...] = tuple(dict.fromkeys(wanted))

    @property
    def cost(self) -> float:
        """Target forwards one drafted token costs: the head's (it reads every token)."""
        return self.checker.cost

    def begin(self, prompt_ids: list[int]) -> CascadeDrafter:
        """A cascade over each stage's own drafter for one request."""
        checker = start(self.checker, prompt_ids)
        return CascadeDrafter(start(self.proposer, prompt_ids), checker, self.keep)  # type: ignore[arg-type]

    def propose(
        self, history: list[int], shape: DraftShape, sampling: SamplingParams, rng: torch.Generator
    ) -> Draft:
        free = dataclasses.replace(shape, model_depth=None, confidence=None)
        proposal = self.proposer.propose(history, free, sampling, rng)
        if shape.model_depth == 0 or len(proposal) > CHECKED:  # the free chain, priced as free
            return proposal
        if not len(proposal):
            draft = self.checker.propose(history, shape, sampling, rng)
        else:
            tokens = proposal.tokens.tolist()
            checked = self.checker.check(history, tokens, shape, sampling, rng, self.keep)
            if checked is None:  # the head cannot read this history yet
                return proposal
            draft = checked
        return dataclasses.replace(draft, source=self.name) if len(draft) else draft

    def follow(self, history: list[int], tail: list[int], depth: int) -> Draft:
        """The free stage's chain after history + `tail` (`base.follow`), unchecked: the head
        would have to read the tail first."""
        return follow(self.proposer, history, tail, depth)

    def observe(self, feedback: Feedback) -> None:
        """Both stages hear the forward (each with the hidden states of its own layers)."""
        for stage in (self.proposer, self.checker):
            stage.observe(own_feedback(feedback, self.hidden_layers, stage.hidden_layers))
