"""Generator: the public API — prompts, strategies, requests, streaming.

Each request's state lives in a `Request`. A lone request runs as a one-request run of the
scheduler (`engine.batch`, nano-vllm's shape: `generate()` is the step loop), so a request
decodes in the same loop whether it runs alone or batched: prefill in chunks, then rounds
(propose → verify → accept → commit → learn, `engine.round`). Plain autoregressive decoding is
that loop with an empty draft: every round runs the target once on the last token.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence

import llguidance

from specfork.config import GenerationConfig, SamplingParams, SpecConfig
from specfork.drafters.base import Drafter, check_drafter, start
from specfork.drafters.stores import DraftStores
from specfork.engine.arguments import as_token_ids, check_arguments, check_kind, check_text
from specfork.engine.batch import Scheduler
from specfork.engine.grammar import GrammarState, grammar_tokenizer
from specfork.engine.lifecycle import GenerationResult
from specfork.engine.logprobs import TokenLogprob
from specfork.engine.output import OutputBuilder
from specfork.engine.overhead import VerifyOverhead
from specfork.engine.payback import PlainClock
from specfork.engine.request import Request
from specfork.engine.stats import GenerationStats
from specfork.errors import ConfigError, PromptError
from specfork.host import cache_dir
from specfork.kv_cache import KVCache
from specfork.loading.loader import LoadedModel
from specfork.models.cost import CostCurve
from specfork.models.cost_calibration import CostCalibration
from specfork.sampling import make_generator
from specfork.strategies.build import build_strategy
from specfork.strategies.goodput import Gate, NoGate, new_gate
from specfork.strategies.policies import DraftPolicy, check_policy
from specfork.strategies.rate_memory import RateBook

log = logging.getLogger(__name__)

Prompt = str | Sequence[dict[str, str]]
MAX_KEPT_STRATEGIES = 8  # default: built strategies (drafters with their caches) kept for reuse
FREE_CACHES = 2  # KV caches of finished requests kept for the next ones
MAX_OVERHEADS = 32  # strategies whose verification overhead is kept (the oldest dropped)


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
    kept: the `max_strategies` most recently used, the default strategy always. `stores` are
    what drafters share across requests (the suffix index; default: new ones for this
    Generator): every strategy it builds draws on them. `rates`: each strategy's acceptance
    counts, which its requests' goodput gates start from and add to (default: a new book;
    `RateBook(shared=False)`: every request learns alone).
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
        stores: DraftStores | None = None,
        rates: RateBook | None = None,
    ) -> None:
        check_arguments(loaded, spec, max_context, prefill_chunk, max_strategies)
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        limit = loaded.config.max_position
        self.context = min(limit, max_context) if max_context is not None else limit
        if max_context is not None and max_context > limit:
            log.warning(
                "max_context %d is beyond what %s was trained for; using its %d positions",
                max_context,
                loaded.label,
                limit,
            )
        self.prefill_chunk = prefill_chunk
        self.max_strategies = max_strategies
        self.spec = spec or SpecConfig()
        self._check_k(self.spec)
        if stores is not None and not isinstance(stores, DraftStores):
            raise ConfigError(f"stores must be a DraftStores, got {type(stores).__name__}")
        self.stores = stores or DraftStores()
        if rates is not None and not isinstance(rates, RateBook):
            raise ConfigError(f"rates must be a RateBook, got {type(rates).__name__}")
        self.rates = rates or RateBook()
        if drafter is not None:
            check_drafter(drafter, loaded.model.config.num_layers)
        if policy is not None:
            check_policy(policy)
        if drafter is not None and not self.spec.drafts:
            self.spec = SpecConfig("speculative", k=self.spec.k)
        built_drafter, built_policy = (None, None)
        if drafter is None or policy is None:
            built_drafter, built_policy = build_strategy(
                self.spec, loaded, drafter is None, self.stores
            )
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
        self._calibration: CostCalibration | None = None  # the model's own curve, corrected
        self._clock: PlainClock | None = None  # recent plain rounds' seconds, with it
        self._overheads: dict[SpecConfig, VerifyOverhead] = {}  # per strategy, with it
        self._overheads_lock = threading.Lock()
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
        if chat and len(messages) >= self.context:  # refused before the template renders them
            raise PromptError(
                f"{len(messages)} messages cannot fit a context of {self.context} tokens (each "
                "message adds at least its role's tokens); send fewer messages"
            )
        contents = [m.get("content", "") if isinstance(m, dict) else "" for m in messages]
        self._check_prompt_chars(sum(len(str(c)) for c in contents))
        for content in contents:
            if isinstance(content, str):
                check_text(content)
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
        req = self.open_request(prompt, chat=chat, config=config, sampling=sampling, spec=spec)
        return TextStream(self._events(req), req.logprobs)

    def open_request(
        self,
        prompt: Prompt | list[int],
        *,
        chat: bool | None = None,
        config: GenerationConfig | None = None,
        sampling: SamplingParams | None = None,
        spec: SpecConfig | None = None,
    ) -> Request:
        """A validated request with its own state (cache, drafter, policy, rng), not yet run:
        `stream` runs it alone, `specfork.engine.batch.Scheduler` with others. Its cache goes
        back with `release(req)`."""
        ids = self.prompt_ids(prompt, chat=chat, config=config)  # config's kind checked there
        check_kind("sampling", sampling, SamplingParams)
        check_kind("spec", spec, SpecConfig)
        vocab = self.model.config.vocab_size
        outside = [t for t, _ in (sampling.logit_bias if sampling else ()) if t >= vocab]
        if outside:
            raise ConfigError(
                f"logit_bias names token id {outside[0]}, outside the vocabulary of {vocab} ids"
            )
        config = config or GenerationConfig()
        self._check_thread()
        self.use_strategy(spec or self.default_spec)
        return self._new_request(ids, config, sampling or SamplingParams())

    def prompt_ids(
        self,
        prompt: Prompt | list[int],
        *,
        chat: bool | None = None,
        config: GenerationConfig | None = None,
    ) -> list[int]:
        """The prompt's token ids, checked (PromptError/ConfigError name what is wrong): a
        list or tuple of integers (Python, NumPy, 0-d tensors) is taken as token ids, text and
        chat messages are encoded."""
        check_kind("config", config, GenerationConfig)
        if not isinstance(prompt, (str, list, tuple)):
            raise PromptError(
                f"a prompt is a string, a list of chat messages or a list of token ids, not "
                f"{type(prompt).__name__}"
            )
        ids = None if isinstance(prompt, str) else as_token_ids(prompt)
        if ids is None:
            ids = self.encode_prompt(prompt, chat)
        self._check_prompt(ids)
        self._check_exact(config or GenerationConfig())
        return ids

    def release(self, req: Request, keep: int | None = None) -> None:
        """A finished or cancelled request's cache, kept (the `keep` largest free caches;
        None: FREE_CACHES) for the next requests."""
        if not isinstance(req, Request):
            kind = type(req).__name__
            raise ConfigError(f"release takes a Request (from open_request), got {kind}")
        self._release_cache(req.cache, FREE_CACHES if keep is None else keep)

    def warm_up(self, new_tokens: int = 4) -> None:
        """Run a short generation so that the first request does not pay for first-use costs."""
        prompt = self.tokenizer.encode("Hello")[-4:] or [0]
        self.generate(prompt, config=GenerationConfig(max_new_tokens=new_tokens, ignore_eos=True))

    def use_strategy(self, spec: SpecConfig) -> None:
        """Make `spec` the strategy of the next requests (drafters are built once, then kept)."""
        if not isinstance(spec, SpecConfig):
            raise ConfigError(f"use_strategy takes a SpecConfig, got {type(spec).__name__}")
        if spec not in self._strategies:
            self._check_k(spec)
            self._strategies[spec] = build_strategy(spec, self._loaded, stores=self.stores)
            others = [s for s in self._strategies if s not in (self.default_spec, spec)]
            if len(self._strategies) > self.max_strategies and others:
                del self._strategies[others[0]]  # the least recently used
        self._strategies.move_to_end(spec)
        self.spec = spec
        self.drafter, self.policy = self._strategies[spec]

    # -- the loop -----------------------------------------------------------------------------
    def _events(self, req: Request) -> Iterator[str | GenerationResult]:
        """The request alone: a run of the scheduler with it as its only request (the loop
        that batches run too), each step's text, then the result. A stream closed early (or
        a failure) cancels the request and gives its cache back."""
        scheduler = Scheduler.alone(self)
        running = scheduler.admit(req)
        try:
            while not running.finished:
                for update in scheduler.step():
                    yield update.text
                    if update.result is not None:
                        yield update.result
        finally:
            scheduler.cancel(running)

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
            threads_at_start=self.model.thread_use(),
        )

    def _grammar(self, config: GenerationConfig) -> GrammarState | None:
        """The grammar state of a constrained request (the model's grammar tokenizer is built
        at the first one and kept)."""
        if config.constraint is None:
            return None
        vocab = self.model.config.vocab_size
        if self._grammar_tokenizer is None:
            self._grammar_tokenizer = grammar_tokenizer(self.tokenizer, vocab)
        budget = None if config.max_mask_ms is None else config.max_mask_ms / 1000
        return GrammarState(config.constraint, self._grammar_tokenizer, vocab, budget)

    def _new_gate(self) -> Gate:
        """A fresh goodput gate for a strategy that asks for one (goodput.py), starting from
        what the strategy's earlier requests learned (`rates`)."""
        if not (self.spec.goodput and self.drafter is not None):
            return NoGate()
        memory = self.rates.memory(self.spec)
        return new_gate(self.spec.strategy_kind.tree, self.pricing(), memory)

    def cost_curve(self) -> CostCurve:
        """What a forward of R rows costs: the curve given to the constructor, or the model's
        own (measured once per model and machine: stored in the cache folder between
        processes, `models.cost_cache`)."""
        if self._cost_curve is None:
            stored_at = cache_dir() / "cost"
            self._cost_curve = self.model.cost_curve(self._loaded.path, stored_at)
            self._calibration = CostCalibration(self._cost_curve)
            self._clock = PlainClock(self._cost_curve.step_at)
        return self._cost_curve

    def pricing(self) -> CostCurve | CostCalibration:
        """What the goodput gates and the batch allocation price rows by: the model's own
        curve corrected by the forwards this Generator ran (`models.cost_calibration`), or a
        curve given to the constructor, as given (reproducible draft lengths)."""
        curve = self.cost_curve()
        return self._calibration or curve

    def observe_forward(self, rows: int, tokens: int, seconds: float) -> None:
        """A decoding forward of `rows` rows after `tokens` cached tokens (their mean) took
        `seconds`: the pricing learns from it (once the model's own curve is in use)."""
        if self._calibration is not None:
            self._calibration.observe(rows, tokens, seconds)

    def plain_clock(self) -> PlainClock | None:
        """Recent plain rounds' seconds, which `Payback` checks drafting rounds against: kept
        once the model's own curve is in use (None with a curve given to the constructor,
        whose draft lengths stay reproducible, or before any request drafted)."""
        return self._clock

    def verify_overhead(self, spec: SpecConfig) -> VerifyOverhead | None:
        """What verifying a draft costs `spec`'s lone requests in host work
        (`engine.overhead`): kept, like the plain clock, once the model's own curve is in use
        (None with a curve given to the constructor: reproducible draft lengths)."""
        if self._clock is None:
            return None
        with self._overheads_lock:
            tracker = self._overheads.get(spec)
            if tracker is None:
                tracker = self._overheads[spec] = VerifyOverhead(self._clock.step_at)
                while len(self._overheads) > MAX_OVERHEADS:
                    self._overheads.pop(next(iter(self._overheads)))
            return tracker

    def _take_cache(self, length: int) -> KVCache:
        """A cache of at least `length` slots: a free one when one is big enough, else new."""
        fits = [c for c in self._free_caches if c.max_len >= length]
        if not fits:
            return self.model.new_cache(max(length, 256))
        cache = min(fits, key=lambda c: c.max_len)
        self._free_caches.remove(cache)
        cache.reset()
        return cache

    def _release_cache(self, cache: KVCache, keep: int) -> None:
        """A finished request's cache, kept for the next ones (the `keep` largest)."""
        self._free_caches.append(cache)
        self._free_caches.sort(key=lambda c: -c.max_len)
        del self._free_caches[keep:]

    def _check_exact(self, config: GenerationConfig) -> None:
        if config.exact and not self.model.batch_invariant:
            raise ConfigError(
                f"exact output needs batch-invariant steps, and this model runs on the "
                f"{self.model.describe()} path, whose multi-row steps round differently from "
                "one-row steps; load it on specfork's CPU kernels (kernels=True / --exact)"
            )

    def _check_thread(self) -> None:
        """Warn once when decoding on the CPU from a thread other than the loading one, where
        that matters (PyTorch's eager path; the kernels run on their own threads)."""
        here = threading.get_ident()
        bound = self.model.device.type == "cpu" and self.model.bound_to_loading_thread
        if self._warned_thread or not bound or here == self._loaded.thread_id:
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
