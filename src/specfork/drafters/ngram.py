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

#: tokens of the indexed history checked against a new history's same positions: a history
#: that does not continue the indexed one (another conversation) is indexed afresh
_CHECKED_TAIL = 16


class NgramDrafter:
    """n-gram lookup over the request's own tokens; no model.

    Each request's drafter (`begin`) keeps an index per n: every n-gram of the history that
    has a successor, with the start of its latest occurrence. It grows with the history, so a
    round's lookup costs a dictionary probe per n (scanning a 4,000-token history with tensor
    ops cost ~25 µs per n and grew with the history)."""

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
        self._latest: dict[int, dict[tuple[int, ...], int]] = {}  # n -> n-gram -> latest start
        self._seen: list[int] = []  # the history indexed so far

    def begin(self, prompt_ids: list[int]) -> NgramDrafter:
        return NgramDrafter(self.max_ngram, self.min_ngram)  # a request's own index

    def propose(
        self, history: list[int], shape: DraftShape, sampling: SamplingParams, rng: torch.Generator
    ) -> Draft:
        """A chain of up to `shape.depth` tokens (prior score 1 each: a certain guess)."""
        self._catch_up(history)
        return self._lookup(history, history, shape.depth)

    def follow(self, history: list[int], tail: list[int], depth: int) -> Draft:
        """The chain after the latest earlier occurrence of the longest suffix of history +
        `tail` (`base.follow`); `tail` is not indexed."""
        self._catch_up(history)
        return self._lookup(history + tail, history, depth)

    def _lookup(self, context: list[int], history: list[int], depth: int) -> Draft:
        """Up to `depth` tokens of the indexed `history` after the latest occurrence of the
        longest suffix of `context` (n from max_ngram down to min_ngram)."""
        end = len(context)
        for n in range(min(self.max_ngram, end - 1), self.min_ngram - 1, -1):
            start = self._latest[n].get(tuple(context[end - n :]))
            if start is not None:
                tokens = torch.tensor(history[start + n : start + n + depth], dtype=torch.long)
                scores = torch.ones(len(tokens), dtype=torch.float64)  # [K]
                return chain_draft(tokens, scores=scores, source=f"ngram-{n}")
        return chain_draft(torch.empty(0, dtype=torch.long))

    def _catch_up(self, history: list[int]) -> None:
        """Index the n-grams of `history` that gained a successor since the last call: those
        starting at s with s + n < len(history), the latest start winning."""
        old = len(self._seen)
        tail = self._seen[max(0, old - _CHECKED_TAIL) :]
        if len(history) < old or history[old - len(tail) : old] != tail:
            self._seen, old = [], 0
        if old == 0:
            self._latest = {n: {} for n in range(self.min_ngram, self.max_ngram + 1)}
        for n, latest in self._latest.items():
            for s in range(max(0, old - n), len(history) - n):
                latest[tuple(history[s : s + n])] = s
        self._seen.extend(history[old:])

    def observe(self, feedback: Feedback) -> None:
        return None
