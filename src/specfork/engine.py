"""Generator: prefill, the decoding loop, stops, streaming, per-request stats.

Plain autoregressive decoding is the loop with an empty draft: every round runs the target
once on the last token and emits the token it chooses.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from specfork.cache import KVCache
from specfork.config import GenerationConfig, SamplingParams, SpecConfig
from specfork.drafters.base import EMPTY_DRAFT, Draft, Drafter
from specfork.errors import ConfigError, PromptError
from specfork.goodput import CostCurve, GoodputGate, TreeGate
from specfork.loading.loader import LoadedModel
from specfork.metrics import GenerationStats, RoundRecord
from specfork.output import OutputBuilder
from specfork.policies import DraftPolicy, RoundInfo
from specfork.sampling import make_generator, next_token, probabilities
from specfork.strategies import build_strategy
from specfork.tree import (
    Tree,
    cache_indices,
    children,
    depths,
    prune,
    tree_mask,
    tree_positions,
)
from specfork.verify import one_hot_q, verify_greedy, verify_sampling
from specfork.verify_tree import (
    TreeVerdict,
    verify_tree_greedy,
    verify_tree_sampling,
    verify_tree_typical,
)

log = logging.getLogger(__name__)

Prompt = str | Sequence[dict[str, str]]
MAX_KEPT_STRATEGIES = 8  # built strategies (drafters with their caches) kept for reuse


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
    """Runs requests on one loaded model (one at a time: the model and cache are shared).

    The strategy comes from `spec`; a custom `drafter` (any object following the Drafter
    protocol) and/or `policy` replace the ones `spec` would build. `cost_curve` is what the
    goodput gate assumes a forward of R rows costs (default: `model.cost_curve()`, measured
    once per model at the first request that needs it); a fixed curve makes draft lengths
    reproducible across processes.
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
    ) -> None:
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self._prompt_len = 0
        limit = loaded.config.max_position
        self.context = min(limit, max_context) if max_context else limit
        self.prefill_chunk = prefill_chunk
        self.spec = spec or SpecConfig()
        self._check_k(self.spec)
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
        self._cache: KVCache | None = None
        self._warned_thread = False
        self._cost_curve = cost_curve  # None: the model's own, measured once (goodput.py)
        self._gate: GoodputGate | TreeGate | None = None  # the running request's, if it has one

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
        with another strategy (built once and kept for later requests that ask for it).
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
        return TextStream(self._events(ids, config, sampling))

    def warm_up(self, new_tokens: int = 4) -> None:
        """Run a short generation so that the first request does not pay for first-use costs."""
        prompt = self.tokenizer.encode("Hello")[-4:] or [0]
        self.generate(prompt, config=GenerationConfig(max_new_tokens=new_tokens, ignore_eos=True))

    def use_strategy(self, spec: SpecConfig) -> None:
        """Make `spec` the strategy of the next requests (drafters are built once, then kept)."""
        if spec not in self._strategies:
            self._check_k(spec)
            self._strategies[spec] = build_strategy(spec, self._loaded)
            if len(self._strategies) > MAX_KEPT_STRATEGIES:  # forget the least recently used
                oldest = next(s for s in self._strategies if s != self.default_spec)
                del self._strategies[oldest]
        self._strategies.move_to_end(spec)
        self.spec = spec
        self.drafter, self.policy = self._strategies[spec]

    # -- the loop -----------------------------------------------------------------------------
    def _events(
        self, ids: list[int], config: GenerationConfig, sampling: SamplingParams
    ) -> Iterator[str | GenerationResult]:
        stats = GenerationStats(prompt_tokens=len(ids), lossy=self.spec.lossy_typical)
        out = OutputBuilder(
            self.tokenizer, config, max_tokens=self.context - len(ids), prompt_ids=ids
        )
        rng = make_generator(sampling.seed, self.model.device)
        cache = self._cache_for(len(ids) + out.max_tokens)
        t0 = time.perf_counter()
        with torch.inference_mode():
            if self.drafter is not None:
                self.drafter.begin(ids)
                self.policy.reset()
            self._gate = self._new_gate()
            logits = self._prefill(ids, cache)  # [V]
            stats.prefill_seconds = time.perf_counter() - t0
            tokens = [next_token(logits, sampling, rng)]
            stats.time_to_first_token = time.perf_counter() - t0
            history = list(ids)
            self._prompt_len = len(ids)
            t1 = time.perf_counter()
            while True:
                used = out.add(tokens)
                stats.new_tokens += used
                history += tokens[:used]
                yield out.new_text()
                if out.done:
                    break
                if cache.length >= cache.max_len:
                    out.finish("length")
                    break
                left = min(out.max_tokens - len(out.token_ids), cache.max_len - cache.length)
                tokens = self._round(history, left - 1, cache, sampling, rng, stats)
        stats.decode_seconds = time.perf_counter() - t1
        yield out.new_text()
        yield GenerationResult(out.text, out.token_ids, out.finish_reason or "length", ids, stats)

    def _prefill(self, ids: list[int], cache: KVCache) -> torch.Tensor:
        """Run the prompt; a drafter that learns from the target's logits sees every row."""
        if not getattr(self.drafter, "wants_prefill_logits", False):
            return self.model.extend(ids, cache, chunk=self.prefill_chunk)  # [V]
        for i in range(0, len(ids), self.prefill_chunk):
            part = ids[i : i + self.prefill_chunk]
            logits = self.model.extend(part, cache, last_only=False)  # [T, V]
            self.drafter.observe(torch.tensor(part), logits)
        return logits[-1]

    def _round(
        self,
        history: list[int],
        max_draft: int,
        cache: KVCache,
        sampling: SamplingParams,
        rng: torch.Generator,
        stats: GenerationStats,
    ) -> list[int]:
        """Draft → verify in one target forward → accept → commit; returns tokens to emit.

        `history[-1]` is the last emitted token, not yet in the target's cache. Plain
        decoding is the empty draft: the target runs on that one token.
        """
        if self.spec.strategy == "spork":
            return self._tree_round(history, max_draft, cache, sampling, rng, stats)
        proposed, k = self._draft(history, max_draft, sampling, rng)
        draft = proposed
        free = getattr(self.drafter, "cost", 0.0) == 0  # a model drafter's tokens were capped
        if isinstance(self._gate, GoodputGate) and free and len(proposed):  # before drafting
            draft = proposed.head(self._gate.length(proposed.source, len(proposed)))
        start = cache.length
        t0 = time.perf_counter()
        chain = [history[-1], *draft.tokens.tolist()]
        logits = self.model.extend(chain, cache, last_only=False)  # [K + 1, V]
        stats.verify_seconds += time.perf_counter() - t0
        drafted = draft.tokens.to(logits.device)  # [K]
        if sampling.greedy:
            verdict = verify_greedy(drafted, logits)
        else:
            p = probabilities(logits, sampling)  # [K + 1, V]
            q = draft.q if draft.q is not None else one_hot_q(drafted, p.shape[-1])  # [K, V]
            verdict = verify_sampling(drafted, p, q, rng)
        cache.truncate(start + 1 + verdict.accepted)  # drop the rejected drafts' entries
        stats.record_round(len(draft), verdict.accepted)
        if isinstance(self._gate, GoodputGate):
            self._gate.observe(proposed.source, proposed.tokens.tolist(), verdict.tokens)
        generated = len(history) - self._prompt_len
        extra = {}
        if self.drafter is not None:
            stats.draft_forwards += draft.forwards
            self.drafter.rollback(len(history) + verdict.accepted)
            info = RoundInfo(len(draft), verdict.accepted, generated + len(verdict.tokens), logits)
            self.policy.update(info)
            extra = {**self.policy.trace(), "proposed": len(proposed)}  # before the gate
        first_rejected = len(draft) > 0 and verdict.accepted == 0
        stats.rounds.append(
            RoundRecord(len(stats.rounds), generated, k, len(draft), verdict.accepted,
                        len(verdict.tokens), first_rejected, extra)
        )  # fmt: skip
        return verdict.tokens

    def _tree_round(
        self,
        history: list[int],
        max_depth: int,
        cache: KVCache,
        sampling: SamplingParams,
        rng: torch.Generator,
        stats: GenerationStats,
    ) -> list[int]:
        """SPORK: grow a tree, verify all its nodes in one forward, keep the best path."""
        generated = len(history) - self._prompt_len
        shape = self.policy.next_shape(generated)
        room = cache.max_len - cache.length - 1  # nodes that fit after the root
        draft, tree = self.drafter.propose_tree(history, shape, max_depth, max(room, 0))
        scores, node_depths = self._gated_tree_scores(draft, tree)
        if scores is not None:
            tree, index = prune(tree, torch.tensor(self._gate.keep(scores, node_depths)))
            scores = [s for s, i in zip(scores, index.tolist(), strict=True) if i >= 0]
            node_depths = [d for d, i in zip(node_depths, index.tolist(), strict=True) if i >= 0]
        start = cache.length
        t0 = time.perf_counter()
        inputs = torch.tensor([history[-1], *tree.tokens.tolist()], device=self.model.device)
        mask = tree_mask(tree).to(inputs.device) if len(tree) else None  # [N + 1, N + 1]
        positions = tree_positions(tree, start).to(inputs.device)  # [N + 1]
        hidden = self.model(inputs[None], positions, cache, mask=mask)  # [1, N + 1, D]
        logits = self.model.logits(hidden[0])  # [N + 1, V]
        stats.verify_seconds += time.perf_counter() - t0
        verdict = self._verify_tree(tree, logits, sampling, rng)
        if scores is not None:
            self._gate.observe(scores, node_depths, verdict.path)
        cache.keep(cache_indices(verdict.path, start), start)  # the accepted path, compacted
        self.drafter.observe(inputs, logits)
        self.drafter.rollback(len(history) + verdict.accepted)
        depth = int(depths(tree).max()) if len(tree) else 0
        stats.record_round(len(tree), verdict.accepted, depth)
        stats.draft_forwards += draft.forwards
        fork = children(tree)[0].index(verdict.path[0]) if verdict.path else None
        info = RoundInfo(len(tree), verdict.accepted, generated + len(verdict.tokens), logits,
                         fork=fork, tree_depth=depth)  # fmt: skip
        self.policy.update(info)
        extra = {**self.policy.trace(), **({"lossy": True} if self.spec.lossy_typical else {})}
        stats.rounds.append(
            RoundRecord(len(stats.rounds), generated, shape.depth, len(tree), verdict.accepted,
                        len(verdict.tokens), len(tree) > 0 and not verdict.path, extra)
        )  # fmt: skip
        return verdict.tokens

    def _verify_tree(
        self, tree: Tree, logits: torch.Tensor, sampling: SamplingParams, rng: torch.Generator
    ) -> TreeVerdict:
        if self.spec.lossy_typical:  # LOSSY: Medusa's typical acceptance
            p = probabilities(logits, sampling) if not sampling.greedy else logits.softmax(-1)
            return verify_tree_typical(tree, p, self.spec.typical_epsilon, self.spec.typical_delta)
        if sampling.greedy:
            return verify_tree_greedy(tree, logits)
        return verify_tree_sampling(tree, probabilities(logits, sampling), None, rng)

    def _draft(
        self, history: list[int], max_draft: int, sampling: SamplingParams, rng: torch.Generator
    ) -> tuple[Draft, int]:
        """The drafter's proposal and the draft length it was asked for."""
        if self.drafter is None or max_draft < 1:
            return EMPTY_DRAFT, 0
        generated = len(history) - self._prompt_len
        k = min(self.policy.next_k(generated), max_draft)
        draft_cost = getattr(self.drafter, "cost", 0.0)
        if isinstance(self._gate, GoodputGate) and draft_cost > 0:  # a model drafter: tokens cost
            k = min(k, self._gate.length(self.drafter.name, k, draft_cost))
        if k < 1:
            return EMPTY_DRAFT, 0
        return self.drafter.propose(history, k, sampling, rng), k

    def _gated_tree_scores(self, draft: Draft, tree: Tree) -> tuple[list | None, list]:
        """The tree's node scores and depths when a tree gate will cut it, else (None, [])."""
        if not isinstance(self._gate, TreeGate) or draft.scores is None or not len(tree):
            return None, []
        return draft.scores.tolist(), depths(tree).tolist()

    def _new_gate(self) -> GoodputGate | TreeGate | None:
        """A fresh goodput gate for a strategy that asks for one (goodput.py)."""
        if not (self.spec.goodput and self.drafter is not None):
            return None
        cost = self._cost_curve or self.model.cost_curve()  # measured once per model
        return TreeGate(cost) if self.spec.strategy == "spork" else GoodputGate(cost)

    def _cache_for(self, length: int) -> KVCache:
        """A cache of at least `length` slots, reused across requests when big enough."""
        if self._cache is None or self._cache.max_len < length:
            self._cache = self.model.new_cache(max(length, 256))
        self._cache.reset()
        return self._cache

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
            "in one thread (specfork.model_thread)"
        )

    def _check_k(self, spec: SpecConfig) -> None:
        if spec.draft_k >= self.context:
            raise ConfigError(
                f"k={spec.draft_k} drafts more tokens than the context holds ({self.context}); "
                "use a k below it (2-8 is typical)"
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
