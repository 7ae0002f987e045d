"""Generator: prefill, the decoding loop, stops, streaming, per-request stats.

Plain autoregressive decoding is the loop with an empty draft: every round runs the target
once on the last token and emits the token it chooses.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from specfork.cache import KVCache
from specfork.config import GenerationConfig, SamplingParams
from specfork.errors import ConfigError, PromptError
from specfork.loading.loader import LoadedModel
from specfork.metrics import GenerationStats
from specfork.output import OutputBuilder
from specfork.sampling import make_generator, next_token

log = logging.getLogger(__name__)

Prompt = str | Sequence[dict[str, str]]


@dataclass
class GenerationResult:
    """What one request produced."""

    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS, stop id or stop string) or "length"
    prompt_ids: list[int]
    stats: GenerationStats


class TextStream:
    """Iterates over text deltas; `result` is set once the iteration is exhausted."""

    def __init__(self, events: Iterator[str | GenerationResult]) -> None:
        self._events = events
        self.result: GenerationResult | None = None

    def __iter__(self) -> Iterator[str]:
        for event in self._events:
            if isinstance(event, GenerationResult):
                self.result = event
            elif event:
                yield event


class Generator:
    """Runs requests on one loaded model (one at a time: the model and cache are shared)."""

    def __init__(
        self, loaded: LoadedModel, *, max_context: int | None = None, prefill_chunk: int = 512
    ) -> None:
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        limit = loaded.config.max_position
        self.context = min(limit, max_context) if max_context else limit
        self.prefill_chunk = prefill_chunk
        self._cache: KVCache | None = None

    # -- prompts ------------------------------------------------------------------------------
    def encode_prompt(self, prompt: Prompt, chat: bool | None = None) -> list[int]:
        """Token ids of a prompt; chat messages (or chat=True) go through the chat template."""
        tok = self.tokenizer
        if chat is None:
            chat = not isinstance(prompt, str) or tok.chat_template is not None
        if isinstance(prompt, str):
            if not prompt.strip():
                raise PromptError("the prompt is empty; give some text to continue")
            messages = [{"role": "user", "content": prompt}]
        else:
            messages = list(prompt)
            if not messages:
                raise PromptError("the message list is empty; give at least one message")
        if chat:
            text = tok.apply_chat_template(messages, add_generation_prompt=True)
            return tok.encode(text)  # a BOS the template already wrote is not doubled
        if not isinstance(prompt, str):
            raise ConfigError("chat messages need chat mode; pass a plain string with chat=False")
        return tok.encode(prompt)

    # -- public API ---------------------------------------------------------------------------
    def generate(
        self,
        prompt: Prompt | list[int],
        *,
        chat: bool | None = None,
        config: GenerationConfig | None = None,
        sampling: SamplingParams | None = None,
    ) -> GenerationResult:
        """Generate a whole completion."""
        stream = self.stream(prompt, chat=chat, config=config, sampling=sampling)
        for _ in stream:
            pass
        assert stream.result is not None
        return stream.result

    def stream(
        self,
        prompt: Prompt | list[int],
        *,
        chat: bool | None = None,
        config: GenerationConfig | None = None,
        sampling: SamplingParams | None = None,
    ) -> TextStream:
        """Generate, yielding text deltas that never split a character or a stop string.

        A list of ints is taken as already-tokenized prompt ids.
        """
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt) and prompt:
            ids = list(prompt)
        else:
            ids = self.encode_prompt(prompt, chat)
        config = config or GenerationConfig()
        sampling = sampling or SamplingParams()
        self._check_prompt(ids)
        return TextStream(self._events(ids, config, sampling))

    # -- the loop -----------------------------------------------------------------------------
    def _events(
        self, ids: list[int], config: GenerationConfig, sampling: SamplingParams
    ) -> Iterator[str | GenerationResult]:
        stats = GenerationStats(prompt_tokens=len(ids))
        room = self.context - len(ids)
        out = OutputBuilder(self.tokenizer, config, max_tokens=room, prompt_ids=ids)
        rng = make_generator(sampling.seed, self.model.device)
        cache = self._cache_for(len(ids) + out.max_tokens)
        t0 = time.perf_counter()
        with torch.inference_mode():
            logits = self._prefill(ids, cache)  # [V]
            stats.prefill_seconds = time.perf_counter() - t0
            token = next_token(logits, sampling, rng)
            stats.time_to_first_token = time.perf_counter() - t0
            t1 = time.perf_counter()
            while True:
                stats.new_tokens += out.add([token])
                yield out.new_text()
                if out.done:
                    break
                if cache.length >= cache.max_len:
                    out.finish("length")
                    break
                logits = self._step(token, cache)
                stats.record_round(drafted=0, accepted=0)
                token = next_token(logits, sampling, rng)
        stats.decode_seconds = time.perf_counter() - t1
        yield out.new_text()
        yield GenerationResult(out.text, out.token_ids, out.finish_reason or "length", ids, stats)

    def _prefill(self, ids: list[int], cache: KVCache) -> torch.Tensor:
        """Run the prompt through the model in chunks; logits [V] of its last position."""
        dev = self.model.device
        prompt = torch.tensor(ids, device=dev)  # [P]
        for start in range(0, len(ids), self.prefill_chunk):
            chunk = prompt[start : start + self.prefill_chunk]  # [C]
            positions = torch.arange(start, start + len(chunk), device=dev)  # [C]
            hidden = self.model(chunk[None], positions, cache)  # [1, C, D]
        return self.model.logits(hidden[0, -1])

    def _step(self, token: int, cache: KVCache) -> torch.Tensor:
        dev = self.model.device
        tokens = torch.tensor([[token]], device=dev)  # [1, 1]
        positions = torch.tensor([cache.length], device=dev)  # [1]
        return self.model.logits(self.model(tokens, positions, cache)[0, -1])  # [V]

    def _cache_for(self, length: int) -> KVCache:
        """A cache of at least `length` slots, reused across requests when big enough."""
        if self._cache is None or self._cache.max_len < length:
            self._cache = self.model.new_cache(max(length, 256))
        self._cache.reset()
        return self._cache

    def _check_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise PromptError("the prompt is empty after tokenization")
        if len(ids) >= self.context:
            raise PromptError(
                f"the prompt has {len(ids)} tokens but the context holds {self.context}; "
                "shorten the prompt"
            )
        vocab = self.model.config.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise PromptError(f"prompt token ids must be in [0, {vocab})")
