"""One request in flight: everything it owns while the engine decodes it.

The engine's rounds read and write only this object (and the model), so that the state of
several requests can live side by side: its token history, its KV cache, its strategy (spec,
drafter and policy state), its goodput gate, its sampling parameters and random generator, its
output and its statistics.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specfork.config import SamplingParams, SpecConfig
from specfork.drafters.base import Drafter
from specfork.engine.grammar import GrammarState
from specfork.engine.logprobs import TokenLogprob, token_logprobs
from specfork.engine.output import OutputBuilder
from specfork.engine.stats import GenerationStats
from specfork.kv_cache import KVCache
from specfork.penalties import penalized, row_paths
from specfork.strategies.goodput import Gate, NoGate
from specfork.strategies.policies import DraftPolicy
from specfork.threads import ThreadUse


@dataclass(eq=False)
class Request:
    """A request's state; `history` is the prompt plus every token emitted so far."""

    prompt_ids: list[int]
    sampling: SamplingParams
    rng: torch.Generator
    cache: KVCache
    out: OutputBuilder
    stats: GenerationStats
    spec: SpecConfig
    drafter: Drafter | None = None
    policy: DraftPolicy | None = None
    gate: Gate = field(default_factory=NoGate)  # what of each draft to verify
    grammar: GrammarState | None = None  # the output constraint's state, when there is one
    history: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None  # of the output tokens, when asked for
    round_logprobs: list[TokenLogprob] = field(default_factory=list)  # the last round's tokens
    threads_at_start: ThreadUse | None = None  # the model's thread counters when it opened

    def __post_init__(self) -> None:
        if not self.history:
            self.history = list(self.prompt_ids)
        if self.logprobs is None and self.out.config.logprobs is not None:
            self.logprobs = []

    @property
    def generated(self) -> int:
        """Output tokens emitted so far."""
        return len(self.history) - len(self.prompt_ids)

    def target_logits(
        self,
        logits: torch.Tensor,
        draft_tokens: list[int] | None = None,
        parents: list[int] | None = None,
    ) -> torch.Tensor:
        """The target's logits [R, V] at a round's rows (the root, then the drafted nodes:
        `draft_tokens`, a tree's `parents` or None for a chain) with the request's penalties
        and biases applied, as plain decoding would apply them at each row."""
        if not self.sampling.penalized:
            return logits
        paths = row_paths(draft_tokens or [], parents)
        output = self.history[len(self.prompt_ids) :]
        return penalized(logits, self.sampling, output, paths)

    def note_logprobs(self, logits: torch.Tensor, rows: list[int], tokens: list[int]) -> None:
        """Keep the log-probabilities of a round's emitted `tokens`, predicted by `rows` of
        its forward's logits [R, V] (when the request asks for them)."""
        n = self.out.config.logprobs
        if n is not None:
            self.round_logprobs = token_logprobs(logits[rows], tokens, n)

    @property
    def room(self) -> int:
        """Output tokens this request may still emit (its budget and its cache both allow)."""
        left = self.out.max_tokens - len(self.out.token_ids)
        return min(left, self.cache.max_len - self.cache.length)
