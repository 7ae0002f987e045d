"""Prompt lookup decoding: propose what followed the latest earlier occurrence of the suffix.

The last n tokens (n from `max_ngram` down to `min_ngram`; the longest match wins) are searched
for in prompt + output so far; the tokens that followed the most recent earlier occurrence are
proposed. No match gives an empty draft, and the round costs one plain step. Proposals are
deterministic, so verification treats their q as one-hot.
"""

from __future__ import annotations

import torch

from specfork.config import SamplingParams
from specfork.drafters.base import Draft, DraftShape, Feedback, chain_draft
from specfork.errors import ConfigError


class NgramDrafter:
    """n-gram lookup over the request's own tokens; no model, no state beyond the history."""

    name = "ngram"
    cost = 0.0
    wants_logits = False
    hidden_layers: tuple[int, ...] = ()

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not (isinstance(min_ngram, int) and isinstance(max_ngram, int)):
            raise ConfigError("n-gram sizes must be integers")
        if not 1 <= min_ngram <= max_ngram:
            raise ConfigError(
                f"need 1 <= min_ngram <= max_ngram, got min {min_ngram}, max {max_ngram}"
            )
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def begin(self, prompt_ids: list[int]) -> NgramDrafter:
        return self  # no state: every request shares it

    def propose(
        self, history: list[int], shape: DraftShape, sampling: SamplingParams, rng: torch.Generator
    ) -> Draft:
        """A chain of up to `shape.depth` tokens (prior score 1 each: a certain guess)."""
        h = torch.tensor(history, dtype=torch.long)  # [L]
        for n in range(min(self.max_ngram, len(h) - 1), self.min_ngram - 1, -1):
            start = self._latest_match(h, n)
            if start is not None:
                tokens = h[start + n : start + n + shape.depth].clone()  # [K]
                scores = torch.ones(len(tokens), dtype=torch.float64)  # [K]
                return chain_draft(tokens, scores=scores, source=f"ngram-{n}")
        return chain_draft(torch.empty(0, dtype=torch.long))

    @staticmethod
    def _latest_match(h: torch.Tensor, n: int) -> int | None:
        """Start of the latest occurrence of the last n tokens before the suffix itself."""
        windows = h[:-1].unfold(0, n, 1)  # [L - n, n]: every n-gram that has a successor
        hits = (windows == h[-n:]).all(dim=1).nonzero()  # [M, 1]
        return int(hits[-1]) if hits.numel() else None

    def observe(self, feedback: Feedback) -> None:
        return None
