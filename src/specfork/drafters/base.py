"""The Drafter protocol and the Draft it returns.

A drafter proposes tokens that continue the committed history (prompt + accepted output). The
engine verifies them with one target forward and then tells the drafter how much of the history
is final (`rollback`), so a drafter with its own KV cache can drop what was rejected.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from specfork.config import SamplingParams


@dataclass(frozen=True, slots=True)
class Draft:
    """K proposed tokens, with q where the drafter has a distribution.

    `q[i]` is the distribution tokens[i] was drawn from (after the request's sampling
    transforms); None for deterministic proposals (n-gram lookup), which are treated as
    one-hot q. `forwards` counts the drafter's model forwards spent on this draft. A tree
    draft (SPORK) also has `parents`; a chain has None.
    """

    tokens: torch.Tensor  # [K] int64
    q: torch.Tensor | None = None  # [K, V] float32
    forwards: int = 0
    parents: torch.Tensor | None = None  # [K] int64 for a tree: parent node, -1 = the root
    source: str = ""  # what produced it, for acceptance statistics (e.g. "ngram-3")
    scores: torch.Tensor | None = None  # [K] float64: a tree node's prior score (SPORK)

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def head(self, k: int) -> Draft:
        """The first k tokens (and their q) of a chain draft."""
        if k >= len(self):
            return self
        q = None if self.q is None else self.q[:k]
        return Draft(self.tokens[:k], q, self.forwards, None, self.source)


EMPTY_DRAFT = Draft(tokens=torch.empty(0, dtype=torch.long))


class Drafter(Protocol):
    """Anything that can propose continuations of the committed history."""

    name: str

    def begin(self, prompt_ids: list[int]) -> None:
        """Start a new request (prefill a draft model, index the prompt, ...)."""

    def propose(
        self, history: list[int], budget: int, sampling: SamplingParams, rng: torch.Generator
    ) -> Draft:
        """Up to `budget` tokens continuing `history` (prompt + output so far)."""

    def rollback(self, length: int) -> None:
        """Only the first `length` tokens of the history are final; forget anything later."""
