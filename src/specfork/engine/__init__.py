"""Generator: the public API — prompts, strategies, prefill, the decoding loop, streaming.

Each request's state lives in a `Request`; each round is `round.run_round` (propose → verify →
accept → commit → learn). Plain autoregressive decoding is the loop with an empty draft: every
round runs the target once on the last token and emits the token it chooses.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

import llguidance
import torch

from specfork.cache import KVCache
from specfork.config import GenerationConfig, SamplingParams, SpecConfig
from specfork.drafters.base import Drafter, Feedback, check_drafter, start
from specfork.engine.grammar import GrammarState, grammar_tokenizer
from specfork.engine.logprobs import TokenLogprob
from specfork.engine.output import OutputBuilder
from specfork.engine.request import Request
from specfork.engine.round import constrained, run_round
from specfork.engine.stats import GenerationStats
from specfork.errors import ConfigError, PromptError
from specfork.loading.loader import LoadedModel
from specfork.models.cost import CostCurve
from specfork.sampling import make_generator, next_token
from specfork.strategies import build_strategy
from specfork.strategies.goodput import GoodputGate, TreeGate
from specfork.strategies.policies import DraftPolicy, check_policy

log = logging.getLogger(__name__)

Prompt = str | Sequence[dict[str, str]]
MAX_KEPT_STRATEGIES = 8  # default: built strategies (drafters with their caches) kept for reuse
FREE_CACHES = 2  # KV caches of finished requests kept for the next ones


@dataclass
class GenerationResult:
    """What one request produced."""

    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS, stop id or stop string), "length" or "time"
    prompt_ids: list[int]
    stats: GenerationStats
    logprobs: list[TokenLogprob] | None = None  # one per token id, when the config asks


class TextStream:
    """Iterates over text deltas; `result` is set once the iteration is exhausted.

    `logprobs` (when the config asks for them) grows as tokens are emitted: one entry per
    output token so far, ahead of the text when a stop string holds text back.
    """

    def __init__(
        self, events: Iterator[str | GenerationResult], logprobs: list[TokenLogprob] | None = None
    ) -> None:
        self._events = events
        self.result: GenerationResult | None = None
        self.logprobs = logprobs

    def __iter__(self) -> Iterator[str]:
        return (text for text in self.rounds() if text)

    def rounds(self) -> Iterator[str]:
        """Each round's new text, "" when a round shows nothing new (text held back for a
        stop string): a caller regains control after every round, to cancel or time out."""
        for event in self._events:
            if isinstance(event, GenerationResult):
                self.result = event
            else:
                yield event


class Generator:
    """Runs requests on one loaded model.

    Each request owns its state (`Request`: KV cache, drafter and policy state, gate, rng), so
    several streams may be in flight, advanced in any order from one thread at a time. The
    strategy comes from `spec`; a custom `drafter` (any object following the Drafter
    protocol) and/or `policy` replace the ones `spec` would build. `cost_curve` is what the
    goodput gate assumes a forward of R rows costs (default: `model.cost_curve()`, measured
    once per model at the first request that needs it); a fixed curve makes draft lengths
    reproducible across processes. Strategies a request asks for (`spec=`) are built once and
    kept: the `max_strategies` most recently used, the default strategy always.
    """

    def __init__(
        self,
        loaded: LoadedModel,
        *,
        spec: SpecConfig | None = None,
        drafter: Drafter | None = None,
        policy: DraftPolicy | None = None,
        max_context: int | None = None,
        prefill_chunk: int = 512,
        cost_curve: CostCurve | None = None,
        max_strategies: int = MAX_KEPT_STRATEGIES,
    ) -> None:
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        limit = loaded.config.max_position
        self.context = min(limit, max_context) if max_context else limit
        self.prefill_chunk = prefill_chunk
        if isinstance(max_strategies, bool) or not isinstance(max_strategies, int):
            raise ConfigError(f"max_strategies must be an integer >= 1, got {max_strategies!r}")
        if max_strategies < 1:
            raise ConfigError(f"max_strategies must be an integer >= 1, got {max_strategies}")
        self.max_strategies = max_strategies
        self.spec = spec or SpecConfig()
        self._check_k(self.spec)
        if drafter is not None:
            check_drafter(drafter, loaded.model.config.num_layers)
        if policy is not None:
            check_policy(policy)
        if drafter is not None and self.spec.strategy == "ar":
            self.spec = SpecConfig("speculative", k=self.spec.k)
        built_drafter, built_policy = (None, None)
        if drafter is None or policy is None:
            built_drafter, built_policy = build_strategy(self.spec, loaded, drafter is None)
        self.drafter = drafter or built_drafter
        self.policy = policy or built_policy
        self._loaded = loaded
        self.default_spec = self.spec
        self._strategies: OrderedDict[SpecConfig, tuple[Drafter | None, DraftPolicy | None]] = (
            OrderedDict({self.spec: (self.drafter, self.policy)})
        )
        self._free_caches: list[KVCache] = []  # caches of finished requests, for reuse
        self._warned_thread = False
        self._cost_curve = cost_curve  # None: the model's own, measured once (goodput.py)
        self._grammar_tokenizer: llguidance.LLTokenizer | None = None  # built at first use

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
        contents = (m.get("content", "") if isinstance(m, dict) else "" for m in messages)
        self._check_prompt_chars(sum(len(str(c)) for c in contents))
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
        spec: SpecConfig | None = None,
    ) -> GenerationResult:
        """Generate a whole completion (`spec` overrides the strategy for this request)."""
        stream = self.stream(prompt, chat=chat, config=config, sampling=sampling, spec=spec)
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
        spec: SpecConfig | None = None,
    ) -> TextStream:
        """Generate, yielding text deltas that never split a character or a stop string.

        A list of ints is taken as already-tokenized prompt ids. `spec` runs this request
        with another strategy (built once and kept for later requests that ask for it). The
        request gets its own state (KV cache, drafter and policy state) here, so several
        streams may be in flight and advanced in any order.
        """
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt) and prompt:
            ids = list(prompt)
        else:
            ids = self.encode_prompt(prompt, chat)
        config = config or GenerationConfig()
        sampling = sampling or SamplingParams()
        self._check_prompt(ids)
        self._check_exact(config)
        self._check_thread()
        self.use_strategy(spec or self.default_spec)
        req = self._new_request(ids, config, sampling)
        return TextStream(self._events(req), req.logprobs)

    def warm_up(self, new_tokens: int = 4) -> None:
        """Run a short generation so that the first request does not pay for first-use costs."""
        prompt = self.tokenizer.encode("Hello")[-4:] or [0]
        self.generate(prompt, config=GenerationConfig(max_new_tokens=new_tokens, ignore_eos=True))

    def use_strategy(self, spec: SpecConfig) -> None:
        """Make `spec` the strategy of the next requests (drafters are built once, then kept)."""
        if spec not in self._strategies:
            self._check_k(spec)
            self._strategies[spec] = build_strategy(spec, self._loaded)
            others = [s for s in self._strategies if s not in (self.default_spec, spec)]
            if len(self._strategies) > self.max_strategies and others:
                del self._strategies[others[0]]  # the least recently used
        self._strategies.move_to_end(spec)
        self.spec = spec
        self.drafter, self.policy = self._strategies[spec]

    # -- the loop -----------------------------------------------------------------------------
    def _events(self, req: Request) -> Iterator[str | GenerationResult]:
        try:
            yield from self._decode(req)
        finally:
            self._release_cache(req.cache)

    def _decode(self, req: Request) -> Iterator[str | GenerationResult]:
        """Prefill, then rounds until a stop. Only the computing runs in inference mode: the
        mode is thread-local, and a caller between two deltas must not find it switched on."""
        stats, out, sampling = req.stats, req.out, req.sampling
        t0 = time.perf_counter()
        with torch.inference_mode():
            logits = self._prefill(req)  # [V]
            stats.prefill_seconds = time.perf_counter() - t0
            grammar = req.grammar
            allowed = None if grammar is None else grammar.mask()  # [V]
            chosen = logits if allowed is None else constrained(logits, allowed)
            tokens = [next_token(chosen, sampling, req.rng)]
            if grammar is not None:
                tokens = grammar.advance(tokens)
            req.note_logprobs(logits[None], [0], tokens)
        stats.time_to_first_token = time.perf_counter() - t0
        t1 = time.perf_counter()
        limit = out.config.max_seconds
        while True:
            self._take(req, tokens)
            if req.grammar is not None and req.grammar.finished:
                out.finish("stop")  # the constraint is complete: only an end could follow
            yield out.new_text()
            if out.done:
                break
            if req.cache.length >= req.cache.max_len:
                out.finish("length")
                break
            if limit is not None and time.perf_counter() - t0 > limit:
                out.finish("time")
                break
            with torch.inference_mode():
                tokens = run_round(self.model, req)
        stats.decode_seconds = time.perf_counter() - t1
        if req.grammar is not None:
            stats.grammar_seconds = req.grammar.mask_seconds
        yield out.new_text()
        ids = req.prompt_ids
        reason = out.finish_reason or "length"
        yield GenerationResult(out.text, out.token_ids, reason, ids, stats, req.logprobs)

    @staticmethod
    def _take(req: Request, tokens: list[int]) -> None:
        """A round's tokens into the output (up to a stop), the history and the
        log-probabilities (of the tokens the output kept: not a stop id)."""
        out, kept = req.out, len(req.out.token_ids)
        used = out.add(tokens)
        req.stats.new_tokens += used
        req.history += tokens[:used]
        if req.logprobs is not None:
            fresh = req.round_logprobs[: len(out.token_ids) - kept]
            pieces = out.pieces[kept:]
            req.logprobs += [replace(e, text=t) for e, t in zip(fresh, pieces, strict=True)]

    def _new_request(
        self, ids: list[int], config: GenerationConfig, sampling: SamplingParams
    ) -> Request:
        """A request on the current strategy: its own cache, drafter and policy state, gate."""
        out = OutputBuilder(
            self.tokenizer, config, max_tokens=self.context - len(ids), prompt_ids=ids
        )
        drafting = self.drafter is not None and self.policy is not None
        return Request(
            prompt_ids=ids,
            sampling=sampling,
            rng=make_generator(sampling.seed, self.model.device),
            cache=self._take_cache(len(ids) + out.max_tokens),
            out=out,
            stats=GenerationStats(prompt_tokens=len(ids), lossy=self.spec.lossy_typical),
            spec=self.spec,
            drafter=start(self.drafter, ids) if drafting else None,
            policy=self.policy.begin() if drafting else None,
            gate=self._new_gate(),
            grammar=self._grammar(config),
        )

    def _grammar(self, config: GenerationConfig) -> GrammarState | None:
        """The grammar state of a constrained request (the model's grammar tokenizer is built
        at the first one and kept)."""
        if config.constraint is None:
            return None
        vocab = self.model.config.vocab_size
        if self._grammar_tokenizer is None:
            self._grammar_tokenizer = grammar_tokenizer(self.tokenizer, vocab)
        return GrammarState(config.constraint, self._grammar_tokenizer, vocab)

    def _prefill(self, req: Request) -> torch.Tensor:
        """Run the prompt; a drafter that learns from the target's logits or hidden states
        sees every row."""
        ids, cache, chunk, drafter = req.prompt_ids, req.cache, self.prefill_chunk, req.drafter
        if drafter is None or not (drafter.wants_logits or drafter.hidden_layers):
            return self.model.extend(ids, cache, chunk=chunk)  # [V]
        for i in range(0, len(ids), chunk):
            part = ids[i : i + chunk]
            last_only = not drafter.wants_logits  # hidden states alone: no [T, V] logits
            logits, hidden = self.model.extend_capturing(
                part, cache, drafter.hidden_layers, last_only=last_only
            )  # [T or 1, V], [C, T, D]
            rows = torch.tensor(part, device=logits.device)  # [T]
            wanted = None if last_only else logits  # [T, V]
            drafter.observe(Feedback(i + len(part), rows, [], wanted, hidden, prompt=True))
        return logits[-1]

    def _new_gate(self) -> GoodputGate | TreeGate | None:
        """A fresh goodput gate for a strategy that asks for one (goodput.py)."""
        if not (self.spec.goodput and self.drafter is not None):
            return None
        cost = self._cost_curve or self.model.cost_curve()  # measured once per model
        return TreeGate(cost) if self.spec.strategy == "spork" else GoodputGate(cost)

    def _take_cache(self, length: int) -> KVCache:
        """A cache of at least `length` slots: a free one when one is big enough, else new."""
        fits = [c for c in self._free_caches if c.max_len >= length]
        if not fits:
            return self.model.new_cache(max(length, 256))
        cache = min(fits, key=lambda c: c.max_len)
        self._free_caches.remove(cache)
        cache.reset()
        return cache

    def _release_cache(self, cache: KVCache) -> None:
        """A finished request's cache, kept for the next ones (the largest few)."""
        self._free_caches.append(cache)
        self._free_caches.sort(key=lambda c: -c.max_len)
        del self._free_caches[FREE_CACHES:]

    def _check_exact(self, config: GenerationConfig) -> None:
        if config.exact and not getattr(self.model, "batch_invariant", False):
            raise ConfigError(
                f"exact output needs batch-invariant steps, and this model runs on the "
                f"{self.model.describe()} path, whose multi-row steps round differently from "
                "one-row steps; load it on specfork's CPU kernels (kernels=True / --exact)"
            )

    def _check_thread(self) -> None:
        """Warn once when decoding on the CPU from a thread other than the loading one."""
        here = threading.get_ident()
        if self._warned_thread or self.model.device.type != "cpu" or here == self._loaded.thread_id:
            return
        self._warned_thread = True
        log.warning(
            "this model was loaded in another thread: PyTorch's CPU thread pool belongs to that "
            "thread, and decoding from this one can run at half speed; load and run the model "
            "in one thread (specfork.engine.thread)"
        )

    def _check_k(self, spec: SpecConfig) -> None:
        if spec.draft_k >= self.context:
            raise ConfigError(
                f"k={spec.draft_k} drafts more tokens than the context holds ({self.context}); "
                "use a k below it (2-8 is typical)"
            )

    def _check_prompt_chars(self, chars: int) -> None:
        """Refuse, before tokenizing, a text far too long for the context: no token stands
        for more than `max_token_chars` characters (4× margin for normalization)."""
        limit = 4 * self.context * self.tokenizer.max_token_chars
        if chars > limit:
            raise PromptError(
                f"the prompt has {chars} characters, more than a context of {self.context} "
                "tokens can hold; shorten it"
            )

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
