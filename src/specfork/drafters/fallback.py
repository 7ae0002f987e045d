"""A chain drafter that asks its sources in order and takes the first draft: `--drafter
ngram+head` drafts by prompt lookup where the output repeats the context, and with the trained
head everywhere else.

The sources keep their own state and hear every target forward (the head needs the target's
features at every position, whichever source drafted). Drafts of a source that runs a network
are labelled with the fallback's name: the goodput gate prices those by their own acceptance
(`name`, `cost`), while a free source's drafts keep their own labels and are trimmed by theirs.
A source that runs a network is asked for at most `shape.model_depth` tokens, the depth the
gate found to pay for it (free sources draft to `shape.depth`).
"""

from __future__ import annotations

import dataclasses

import torch

from specfork.config import SamplingParams
from specfork.drafters.base import (
    EMPTY_DRAFT,
    Draft,
    Drafter,
    DraftShape,
    Feedback,
    follow_first,
    own_feedback,
    start,
)


class FallbackDrafter:
    """The first non-empty chain of `sources`, asked in order (see the module docstring)."""

    def __init__(self, sources: list[Drafter]) -> None:
        if len(sources) < 2:
            raise ValueError(f"a fallback needs at least two sources, got {len(sources)}")
        self.sources = sources
        self.name = "+".join(s.name for s in sources)
        self.cost = max(s.cost for s in sources)  # the costly source's: the one the gate prices
        self.wants_logits = any(s.wants_logits for s in sources)
        wanted = (i for s in sources for i in s.hidden_layers)
        self.hidden_layers: tuple[int, ...] = tuple(dict.fromkeys(wanted))

    def begin(self, prompt_ids: list[int]) -> FallbackDrafter:
        """A fallback over each source's own drafter for one request."""
        return FallbackDrafter([start(s, prompt_ids) for s in self.sources])

    def propose(
        self, history: list[int], shape: DraftShape, sampling: SamplingParams, rng: torch.Generator
    ) -> Draft:
        for source in self.sources:
            draft = source.propose(history, shape, sampling, rng)
            if len(draft):
                return dataclasses.replace(draft, source=self.name) if source.cost > 0 else draft
        return EMPTY_DRAFT

    def follow(self, history: list[int], tail: list[int], depth: int) -> Draft:
        """The first source's non-empty chain after history + `tail` (`base.follow`)."""
        return follow_first(self.sources, history, tail, depth)

    def observe(self, feedback: Feedback) -> None:
        """Every source hears the forward (with the hidden states of its own layers)."""
        for source in self.sources:
            source.observe(own_feedback(feedback, self.hidden_layers, source.hidden_layers))
