"""Continuous batching: several requests advance in one target forward per step.

A step is nano-vllm's schedule → run → postprocess. Every decoding request plans its round
(its drafter proposes, its own goodput gate trims), then the batch's goodput allocation trims
the drafts together against the measured cost of the whole forward (`goodput.allocate`):
alone a request drafts as it would in `Generator.stream`, in a full batch only the nodes that
are nearly sure survive. Requests still reading their prompt get chunks of it in the rows the
step has left (chunked prefill mixed with decoding). One `forward_batch` runs every row —
each request's rows attend to its own cache — and each request then accepts, commits and
learns exactly as it would alone. On batch-invariant models (specfork's kernels) a request's
logits are bitwise those it gets alone, so greedy output does not depend on the batch.

New requests join between steps (`add`), finished and cancelled ones leave at once and give
their cache back. With a prefix cache (`prefix_cache_bytes`), a request starts from the KV of
its longest prefix that an earlier request computed (a shared system prompt, the earlier turns
of a chat) and prefills only the rest — unless its drafter learns from the target's outputs
over the prompt (Token Recycling, trained heads): such a request prefills its whole prompt, so
that it drafts as it does alone. The scheduler does no queueing of its own: callers
(the server's worker, `generate_batch`) keep the waiting line and add while `has_room`.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from specfork.checks import is_int
from specfork.config import GenerationConfig, SamplingParams, SpecConfig
from specfork.drafters.base import EMPTY_DRAFT, Draft, DraftShape, Feedback, newest_rows
from specfork.engine.forced import is_forced, with_forced
from specfork.engine.lifecycle import GenerationResult, first_tokens, result, stopped, take
from specfork.engine.logprobs import TokenLogprob
from specfork.engine.overhead import host_seconds
from specfork.engine.payback import Payback, PlainClock
from specfork.engine.prefix import PrefixCache
from specfork.engine.request import Request
from specfork.engine.round import (
    NO_SHAPE,
    Planned,
    finish_round,
    node_order,
    plan_round,
    propose,
    round_segment,
)
from specfork.errors import ConfigError, ConstraintError
from specfork.models.base import Segment
from specfork.models.cost import CostCurve
from specfork.models.cost_calibration import CostCalibration
from specfork.models.target import TargetModel
from specfork.strategies.goodput import (
    EXPLORE_EVERY,
    PRIOR,
    allocate,
    least_paying_value,
)
from specfork.tree import depths

log = logging.getLogger(__name__)

STEP_HISTORY = 256  # step records kept for tracing
LONE_DRAFT_ROWS = 64  # the most draft rows a lone request's θ looks at
DEFAULT_STEP_ROWS = 128  # rows a step's forward may hold, unless told (at least max_running)


@dataclass(frozen=True, slots=True)
class BatchConfig:
    """How the scheduler fills a step (validated on construction)."""

    max_running: int = 8  # requests decoding at once
    step_rows: int = DEFAULT_STEP_ROWS  # rows a forward may hold (prompt chunks fill the rest)
    kv_budget_bytes: int | None = None  # KV cache all running requests may hold (None: any)
    goodput: bool = True  # trim drafts together to the batch's best expected tokens/cost
    prefix_cache_bytes: int = 0  # KV of shared prefixes kept for later requests (0: none)

    @classmethod
    def rows_for(cls, max_running: int, step_rows: int | None = None) -> BatchConfig:
        """max_running with step_rows rows a step (None: the default, at least max_running)."""
        rows = max(DEFAULT_STEP_ROWS, max_running) if step_rows is None else step_rows
        return cls(max_running=max_running, step_rows=rows)

    def __post_init__(self) -> None:
        for name in ("max_running", "step_rows"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
        if self.step_rows < self.max_running:
            raise ConfigError(
                f"step_rows ({self.step_rows}) must hold at least one row per running request "
                f"(max_running {self.max_running}); raise step_rows or lower max_running"
            )
        b = self.kv_budget_bytes
        if b is not None and (not is_int(b) or b < 1):
            raise ConfigError(f"kv_budget_bytes must be an integer >= 1 or None, got {b!r}")
        p = self.prefix_cache_bytes
        if not is_int(p) or p < 0:
            raise ConfigError(f"prefix_cache_bytes must be an integer >= 0, got {p!r}")


@runtime_checkable
class Engine(Protocol):
    """What the scheduler needs of the engine whose requests it runs (`Generator`)."""

    model: TargetModel
    prefill_chunk: int  # prompt rows per forward, at most
    context: int  # tokens a request's cache may hold

    def open_request(
        self,
        prompt: object,
        *,
        chat: bool | None = None,
        config: GenerationConfig | None = None,
        sampling: SamplingParams | None = None,
        spec: SpecConfig | None = None,
    ) -> Request: ...

    def release(self, req: Request, keep: int | None = None) -> None: ...

    def cost_curve(self) -> CostCurve: ...

    def pricing(self) -> CostCurve | CostCalibration: ...

    def observe_forward(self, rows: int, tokens: int, seconds: float) -> None: ...

    def plain_clock(self) -> PlainClock | None: ...


@dataclass(eq=False)
class Running:
    """A request in the scheduler: its state and where it stands."""

    req: Request
    admitted: float  # perf_counter time it joined
    prefilled: int = 0  # prompt tokens already in its cache
    decode_started: float | None = None  # time of its first token
    finished: bool = False
    idle: int = 0  # steps in a row it did not propose (its drafts could not pay)
    payback: Payback | None = None  # whether its drafting rounds pay by the clock (lone)

    @property
    def prefilling(self) -> bool:
        return self.prefilled < len(self.req.prompt_ids)

    @property
    def logprobs(self) -> list[TokenLogprob] | None:
        """The output tokens' log-probabilities so far (when the request asks for them)."""
        return self.req.logprobs


@dataclass(frozen=True, slots=True)
class Update:
    """What a step did for one request: new text, and its result when it ended — or the error
    that ended it (the request left the batch; the others went on)."""

    running: Running
    text: str
    result: GenerationResult | None = None
    error: Exception | None = None


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One step, for tracing and metrics."""

    requests: int  # requests in the forward
    rows: int  # rows of the forward
    prefill_rows: int
    draft_rows: int  # drafted nodes verified
    predicted: float  # expected accepted draft tokens (the allocation's estimate)
    accepted: int  # draft tokens the target accepted
    seconds: float  # the whole step


@dataclass
class _Work:
    """A step's plan: decoding requests with their rounds, prompt chunks, segments."""

    rounds: list[tuple[Running, Planned]] = field(default_factory=list)
    phases: dict[int, dict[str, float]] = field(default_factory=dict)  # id(running): at start
    chunks: list[tuple[Running, int]] = field(default_factory=list)  # (request, rows)
    segments: list[Segment] = field(default_factory=list)
    predicted: float = 0.0
    forward_seconds: float = 0.0  # the forward's and the LM head's time


class Scheduler:
    """Runs many requests of one `Generator` together (see the module doc)."""

    def __init__(self, generator: Engine, config: BatchConfig | None = None) -> None:
        if not isinstance(generator, Engine):
            raise ConfigError(
                f"the scheduler runs the requests of a specfork Generator, not of a "
                f"{type(generator).__name__}; write Scheduler(Generator(load_model(name)))"
            )
        if config is not None and not isinstance(config, BatchConfig):
            raise ConfigError(f"config must be a BatchConfig, got {type(config).__name__}")
        self.generator = generator
        self.model = generator.model
        self.config = config or BatchConfig()
        self._isolate = True  # a request's own failure ends it alone; the others go on
        self._keep: int | None = self.config.max_running  # free caches kept (None: default)
        self.running: list[Running] = []
        self.steps: deque[StepRecord] = deque(maxlen=STEP_HISTORY)
        self._failed: list[Update] = []  # requests a step ended with an error of their own
        size = self.config.prefix_cache_bytes
        self.prefix = PrefixCache(size) if size else None

    @classmethod
    def alone(cls, generator: Engine, prefix_cache_bytes: int = 0) -> Scheduler:
        """The scheduler of one lone request at a time (`Generator.stream`, a chat's turns):
        no batch allocation (the request's own gate trims its drafts), rows for any draft and
        whole prefill chunks, and a failure raised to the caller. With `prefix_cache_bytes`,
        a request reuses the KV of what earlier ones computed (a chat's earlier turns)."""
        rows = max(DEFAULT_STEP_ROWS, generator.prefill_chunk, generator.context)
        config = BatchConfig(
            max_running=1, step_rows=rows, goodput=False, prefix_cache_bytes=prefix_cache_bytes
        )
        scheduler = cls(generator, config)
        scheduler._isolate, scheduler._keep = False, None
        return scheduler

    # -- admission ------------------------------------------------------------------------------
    def has_room(self, prompt_tokens: int = 0, max_new_tokens: int = 0) -> bool:
        """Whether a request of this size may join now (a slot, and KV memory for it)."""
        if len(self.running) >= self.config.max_running:
            return False
        budget = self.config.kv_budget_bytes
        if budget is None or not self.running:
            return True  # a lone request always runs (its own limits refuse what cannot fit)
        need = self._kv_bytes(prompt_tokens + max_new_tokens)
        return self.kv_bytes() + need <= budget

    def kv_bytes(self) -> int:
        """KV cache bytes the running requests hold."""
        return sum(r.req.cache.k.nbytes + r.req.cache.v.nbytes for r in self.running)

    def _kv_bytes(self, slots: int) -> int:
        c = self.model.config
        per_slot = 2 * c.num_layers * c.num_kv_heads * c.head_dim * self.model.dtype.itemsize
        return per_slot * slots

    def add(
        self,
        prompt: object,
        *,
        chat: bool | None = None,
        config: GenerationConfig | None = None,
        sampling: SamplingParams | None = None,
        spec: SpecConfig | None = None,
    ) -> Running:
        """Admit a request (validated as `Generator.stream` validates; errors raise here and
        leave the scheduler as it was). It prefills from the next step on."""
        req = self.generator.open_request(
            prompt, chat=chat, config=config, sampling=sampling, spec=spec
        )
        return self.admit(req)

    def admit(self, req: Request) -> Running:
        """Admit a request opened with `Generator.open_request` (its cache is the scheduler's
        to give back from now on). It prefills from the next step on."""
        running = Running(req, time.perf_counter())
        drafter = req.drafter
        learns = drafter is not None and (drafter.wants_logits or bool(drafter.hidden_layers))
        if self.prefix is not None and not learns:  # such drafters must see the whole prompt
            running.prefilled = self.prefix.load(req.prompt_ids, req.cache)
            req.stats.cached_prompt_tokens = running.prefilled
        self.running.append(running)
        return running

    def cancel(self, running: Running) -> None:
        """Stop a request now: it leaves the batch and its cache is freed."""
        if running in self.running:
            self.running.remove(running)
            running.req.out.finish("cancelled")
            running.finished = True
            self.generator.release(running.req, keep=self._keep)

    def _fail(self, running: Running, exc: Exception) -> None:
        """A request whose own work raised (its grammar, its drafter, its sampler) leaves the
        batch with the error, its cache freed; the step goes on for the others. A lone
        request's scheduler (`alone`) raises the error to its caller instead."""
        if not self._isolate:
            running.req.out.finish("error")
            self.cancel(running)
            raise exc
        if isinstance(exc, ConstraintError):  # the request's own constraint, not a fault here
            log.warning("a request left the batch: %s", exc)
        else:
            log.error("a request failed and left the batch: %s", exc, exc_info=exc)
        if running in self.running:  # (not when it failed after leaving: its cache went back)
            self.running.remove(running)
            self.generator.release(running.req, keep=self._keep)
        running.req.out.finish("error")
        running.finished = True
        self._failed.append(Update(running, "", error=exc))

    def last_step(self) -> StepRecord | None:
        """The record of the latest step (None before the first)."""
        return self.steps[-1] if self.steps else None

    # -- one step -------------------------------------------------------------------------------
    def step(self) -> list[Update]:
        """Advance every running request by one forward; what each of them produced."""
        if not self.running:
            return []
        t0 = time.perf_counter()
        self._failed = []
        with torch.inference_mode():
            work = self._schedule()
            hidden, captured, capture = self._run(work)
            tokens = self._postprocess(work, hidden, captured, capture)
        updates = []
        for running, toks in tokens:
            try:
                updates.append(self._emit(running, toks))
            except Exception as exc:  # this request's own failure
                self._fail(running, exc)
        seconds = time.perf_counter() - t0
        self._record(work, seconds)
        self._observe(work)
        self._clock_round(work, tokens, seconds)
        return updates + self._failed

    def _observe(self, work: _Work) -> None:
        """Tell the pricing what a forward of drafting requests' rounds cost: rounds with and
        without drafts, as the gates weigh them (plain decoding's steps, back to back with
        little host work between, run faster than a drafting round's; a step with prompt
        chunks says little about decoding rows)."""
        if not work.rounds or work.chunks:
            return
        if any(r.req.gate.first_rate() is None for r, _ in work.rounds):
            return
        rows = sum(len(planned.draft) + 1 for _, planned in work.rounds)
        tokens = sum(r.req.cache.length for r, _ in work.rounds) // len(work.rounds)
        self.generator.observe_forward(rows, tokens, work.forward_seconds)

    def _clock_round(
        self, work: _Work, tokens: list[tuple[Running, list[int]]], seconds: float
    ) -> None:
        """A lone request's round (no other request, no prompt chunk in its forward) and its
        whole time: its `Payback` judges it, or the Generator's plain clock keeps it when it
        drafted nothing (plain decoding's steps included)."""
        clock = self.generator.plain_clock()
        if clock is None or len(work.rounds) != 1 or work.chunks or len(tokens) != 1:
            return
        (running, planned), (_, emitted) = work.rounds[0], tokens[0]
        if is_forced(planned.draft):  # neither a plain step nor the drafter's round
            return
        spec = running.req.spec
        if running.payback is None and spec.drafts and spec.goodput and spec.payback:
            running.payback = Payback(clock)
        drafted = len(planned.draft) > 0
        overhead = self.generator.verify_overhead(spec) if spec.drafts and spec.goodput else None
        if overhead is not None:
            host = host_seconds(work.phases[id(running)], running.req.stats.phase_seconds)
            overhead.add(drafted, host, work.forward_seconds, planned.start)
        if running.payback is not None:
            running.payback.observe(drafted, len(emitted), planned.start, seconds)
        elif not drafted:
            clock.add(seconds, planned.start)

    def _schedule(self) -> _Work:
        """Plan every decoding request's round, trim the drafts together, and give the rows
        left to prompt chunks (in arrival order)."""
        work = _Work()
        decoding = [r for r in self.running if not r.prefilling]
        budget = self.config.step_rows - len(decoding)
        prefill = self._prompt_rows(budget)  # sunk: the chunks run whatever is drafted
        floor = self._least_value(decoding, budget, prefill)
        proposals = {}
        price = self._price(decoding, prefill)
        for running in decoding:
            work.phases[id(running)] = dict(running.req.stats.phase_seconds)
            try:
                proposals[id(running)] = self._propose(running, floor, price)
            except Exception as exc:  # this request's own failure
                self._fail(running, exc)
        decoding = self._decoding()
        plans = [proposals[id(r)] for r in decoding]
        trims = self._trims([d for _, _, d in plans], budget, len(decoding), prefill)
        for running, n, (shape, proposed, draft) in zip(decoding, trims, plans, strict=True):
            try:
                planned = plan_round(running.req, (shape, proposed, draft), n)
            except Exception as exc:  # this request's own failure
                self._fail(running, exc)
                continue
            work.rounds.append((running, planned))
            if self.config.goodput:  # the allocation's estimate (none without one)
                work.predicted += sum(self._values(running.req, planned.draft))
            t0 = time.perf_counter()
            work.segments.append(round_segment(running.req, planned.draft, self.model.device))
            running.req.stats.spend("prepare", t0)
            budget -= len(planned.draft)
        for running in self.running:
            if running.prefilling and budget > 0:
                rows = self._chunk(running, budget)
                work.chunks.append((running, rows))
                work.segments.append(self._prompt_segment(running, rows))
                budget -= rows
        return work

    def _least_value(self, decoding: list[Running], budget: int, prefill: int) -> float:
        """θ of this step's allocation (`least_paying_value`; 0 when no request drafts
        through a goodput gate, so that plain decoding never measures the model's cost curve):
        what a request's best draft node must be worth to be worth proposing, beside `prefill`
        sunk prompt rows. Without a batch allocation (a lone request) each request's own gate
        trims its drafts: θ is then the price of a row beside its root alone."""
        if budget < 1 or all(r.req.gate.first_rate() is None for r in decoding):
            return 0.0
        curve = self._curve(decoding)
        if not self.config.goodput:  # (a lone request's budget is its context: no draft nears it)
            return least_paying_value(1, 1, curve, min(budget, LONE_DRAFT_ROWS))
        fixed = len(decoding) + prefill
        return least_paying_value(len(decoding), fixed, curve, max(0, budget - prefill), prefill)

    def _curve(self, decoding: list[Running]) -> CostCurve:
        """The cost curve at the decoding requests' mean context (each row attends to its own
        request's cache; the mean prices the step's extra rows)."""
        mean = sum(r.req.cache.length for r in decoding) // max(1, len(decoding))
        return self.generator.pricing().at(mean)

    def _price(self, decoding: list[Running], prefill: int) -> float:
        """What a lone request's round adds in host work when it verifies a draft, in one-row
        forwards at its context (`engine.overhead`); 0 in a batch, whose allocation prices
        the rows of all requests together."""
        if len(decoding) != 1 or prefill:
            return 0.0
        req = decoding[0].req
        overhead = self.generator.verify_overhead(req.spec) if req.spec.drafts else None
        return overhead.price(req.cache.length) if overhead is not None else 0.0

    @staticmethod
    def _propose(running: Running, floor: float, price: float) -> tuple[DraftShape, Draft, Draft]:
        """`propose`, unless the request's chains are all worth less than `floor` (its gate's
        best first-position rate): then it does not draft (n-gram lookups and chains for
        sixteen requests cost ~5% of a step), except one step in EXPLORE_EVERY, so that its
        rates keep learning. A grammar's forced tokens are drafted either way."""
        payback = running.payback
        if payback is not None and not payback.allows(running.req.cache.length):
            running.req.stats.paused_rounds += 1  # its drafting lost to plain steps lately
            return with_forced(running.req, (NO_SHAPE, EMPTY_DRAFT, EMPTY_DRAFT))
        best = running.req.gate.first_rate()
        if best is not None and floor > 0 and best <= floor:
            running.idle += 1
            if running.idle < EXPLORE_EVERY:
                return with_forced(running.req, (NO_SHAPE, EMPTY_DRAFT, EMPTY_DRAFT))
        running.idle = 0
        return propose(running.req, price)

    def _trims(self, drafts: list[Draft], budget: int, roots: int, prefill: int) -> list[int]:
        """How many nodes each draft keeps: the batch's goodput allocation among the requests
        that ask for it (`spec.goodput`; the others verify their drafts whole, their rows and
        expected tokens counted as fixed), within the rows the step has (`budget` after the
        roots), beside `prefill` sunk prompt rows."""
        decoding = self._decoding()
        kept = [len(d) for d in drafts]
        gated = [i for i, r in enumerate(decoding) if r.req.spec.goodput and len(drafts[i])]
        if self.config.goodput and gated:
            whole = sorted(set(range(len(drafts))) - set(gated))
            values = [self._values(decoding[i].req, drafts[i]) for i in gated]
            rows = roots + prefill + sum(len(drafts[i]) for i in whole)
            tokens = sum(sum(self._values(decoding[i].req, drafts[i])) for i in whole)
            curve = self._curve(decoding)
            trimmed = allocate(values, rows, curve, tokens + len(whole), sunk_rows=prefill)
            for i, k in zip(gated, trimmed, strict=True):
                kept[i] = k
        out = []
        for k in kept:  # the best nodes first when the rows run out
            out.append(max(0, min(k, budget)))
            budget -= out[-1]
        return out

    def _decoding(self) -> list[Running]:
        return [r for r in self.running if not r.prefilling]

    def _prompt_rows(self, budget: int) -> int:
        """The prompt rows this step's chunks hold when `budget` rows are left for them: what
        `_schedule` gives the prefilling requests in arrival order (each within its prefill
        chunk), the rows the allocation counts as sunk."""
        rows = 0
        for running in self.running:
            if running.prefilling and budget > 0:
                chunk = self._chunk(running, budget)
                rows, budget = rows + chunk, budget - chunk
        return rows

    @staticmethod
    def _prompt_left(running: Running) -> int:
        return len(running.req.prompt_ids) - running.prefilled

    def _values(self, req: Request, draft: Draft) -> list[float]:
        """P(accepted) of each drafted node in `node_order`: learned by the request's gate
        when it has one, else the drafter's scores or a prior."""
        if not len(draft):
            return []
        order = node_order(draft)
        learned = req.gate.values(draft, order)
        if learned is not None:
            return learned
        if draft.scores is not None:
            s = draft.scores.tolist()
            return [min(1.0, s[i]) for i in order]
        d = depths(draft.tree).tolist()
        return [PRIOR ** d[i] for i in order]

    def _chunk(self, running: Running, budget: int) -> int:
        """Prompt rows for this step: what is left, within the budget and the prefill chunk.
        A model whose rows are not batch-invariant keeps the chunking of `stream` (whole
        prefill chunks), so its outputs stay those of a lone request."""
        left = self._prompt_left(running)
        chunk = self.generator.prefill_chunk
        if self.model.batch_invariant:
            return min(left, chunk, budget)
        done = running.prefilled
        return min(left, chunk - done % chunk)

    def _prompt_segment(self, running: Running, rows: int) -> Segment:
        req, dev = running.req, self.model.device
        part = req.prompt_ids[running.prefilled : running.prefilled + rows]
        start = req.cache.length
        positions = torch.arange(start, start + rows, device=dev)  # [rows]
        return Segment(torch.tensor(part, device=dev), positions, req.cache)

    def _run(self, work: _Work) -> tuple[torch.Tensor, torch.Tensor | None, tuple[int, ...]]:
        """The forward of every segment: hidden [T, D], the captured blocks [C, T, D] (the
        union of what the drafters ask for) and which blocks they are."""
        layers: set[int] = set()
        for running in self.running:
            if running.req.drafter is not None:
                layers.update(running.req.drafter.hidden_layers)
        capture = tuple(sorted(layers))
        t0 = time.perf_counter()
        hidden, captured = self.model.forward_batch(work.segments, capture)  # [T, D]
        _charge_forward(work, t0)
        return hidden, captured, capture

    def _postprocess(
        self,
        work: _Work,
        hidden: torch.Tensor,
        captured: torch.Tensor | None,
        capture: tuple[int, ...],
    ) -> list[tuple[Running, list[int]]]:
        """Each request accepts, commits and learns from its rows; prompt chunks feed their
        drafters, and a finished prompt yields its first token."""
        spans, row = [], 0
        for seg in work.segments:
            spans.append((row, row + len(seg.tokens)))
            row += len(seg.tokens)
        t0 = time.perf_counter()
        logits = self._logits(work, hidden, spans)
        _charge_forward(work, t0)  # the LM head is the forward's last layer
        out = []
        for i, (running, planned) in enumerate(work.rounds):
            a, b = spans[i]
            mine = self._captured(running.req, captured, capture, a, b)
            try:
                out.append((running, finish_round(running.req, planned, logits[i], mine)))
            except Exception as exc:  # this request's own failure
                self._fail(running, exc)
                continue
            _trace_phases(running.req, work.phases.get(id(running), {}))
        for j, (running, rows) in enumerate(work.chunks):
            a, b = spans[len(work.rounds) + j]
            mine = self._captured(running.req, captured, capture, a, b)
            try:
                tokens = self._prompt_done(running, rows, logits[len(work.rounds) + j], mine)
            except Exception as exc:  # this request's own failure
                self._fail(running, exc)
                continue
            if tokens:
                out.append((running, tokens))
        return out

    def _logits(
        self, work: _Work, hidden: torch.Tensor, spans: list[tuple[int, int]]
    ) -> list[torch.Tensor]:
        """Logits of the rows each segment needs: every row of a round; a prompt chunk's last
        row (each distinct token's newest row for a drafter that learns from logits: the rows
        `_prompt_done` tells it of). One LM-head call on batch-invariant models, one per segment
        otherwise (as alone)."""
        wanted = []
        for i, (a, b) in enumerate(spans):
            if i < len(work.rounds):
                wanted.append(list(range(a, b)))
                continue
            drafter = work.chunks[i - len(work.rounds)][0].req.drafter
            if drafter is not None and drafter.wants_logits:
                newest = newest_rows(torch.as_tensor(work.segments[i].tokens))  # [U]
                wanted.append([a + r for r in newest.tolist()])
            else:
                wanted.append([b - 1])
        if self.model.batch_invariant:
            flat = [r for rows in wanted for r in rows]
            logits = self.model.logits(_rows(hidden, flat))  # [R, V]
            if len(wanted) == 1:
                return [logits]
            return list(logits.split([len(rows) for rows in wanted]))
        return [self.model.logits(_rows(hidden, rows)) for rows in wanted]

    @staticmethod
    def _captured(
        req: Request, captured: torch.Tensor | None, capture: tuple[int, ...], a: int, b: int
    ) -> torch.Tensor | None:
        """The blocks `req`'s drafter asked for, at its rows [a, b): [C_req, b - a, D]."""
        if captured is None or req.drafter is None or not req.drafter.hidden_layers:
            return None
        index = [capture.index(layer) for layer in req.drafter.hidden_layers]
        return captured[index, a:b]

    def _prompt_done(
        self, running: Running, rows: int, logits: torch.Tensor, hidden: torch.Tensor | None
    ) -> list[int]:
        """A prompt chunk ran: its drafter learns; after the last chunk, the first token."""
        req = running.req
        part = req.prompt_ids[running.prefilled : running.prefilled + rows]
        running.prefilled += rows
        drafter = req.drafter
        if drafter is not None and (drafter.wants_logits or drafter.hidden_layers):
            tokens = torch.tensor(part, device=logits.device)  # [T]
            rows = newest_rows(tokens) if drafter.wants_logits else None  # [U], as in _logits
            wanted = logits if drafter.wants_logits else None  # [U, V]
            feedback = Feedback(
                running.prefilled, tokens, [], wanted, hidden, prompt=True, logit_rows=rows
            )
            drafter.observe(feedback)
        if running.prefilling:
            return []
        if self.prefix is not None:
            self.prefix.store(req.prompt_ids, req.cache)
        now = time.perf_counter()
        req.stats.prefill_seconds = now - running.admitted
        tokens = first_tokens(req, logits[-1])
        req.stats.time_to_first_token = time.perf_counter() - running.admitted
        running.decode_started = time.perf_counter()
        return tokens

    def _emit(self, running: Running, tokens: list[int]) -> Update:
        """Take a request's tokens; when it ends, its result (and its cache goes back)."""
        req = running.req
        take(req, tokens)
        if not stopped(req, running.admitted):
            return Update(running, req.out.new_text())
        assert running.decode_started is not None
        req.stats.decode_seconds = time.perf_counter() - running.decode_started
        text = req.out.new_text()
        if self.prefix is not None and req.grammar is None:  # the next turn starts with it
            self.prefix.store(req.history[: min(len(req.history), req.cache.length)], req.cache)
        self.running.remove(running)
        running.finished = True
        self.generator.release(req, keep=self._keep)
        return Update(running, text, result(req, self.model))

    def _record(self, work: _Work, seconds: float) -> None:
        draft_rows = sum(len(p.draft) for _, p in work.rounds)
        accepted = sum(
            r.req.stats.rounds[-1].accepted for r, _ in work.rounds if r.req.stats.rounds
        )
        prefill = sum(rows for _, rows in work.chunks)
        rows = len(work.rounds) + draft_rows + prefill
        self.steps.append(
            StepRecord(
                len(work.segments), rows, prefill, draft_rows, work.predicted, accepted, seconds
            )
        )


def _rows(hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """hidden[rows] [R, D]: a view when the rows are consecutive (a round's rows, a chunk's
    last row), else a copy."""
    if rows and rows == list(range(rows[0], rows[0] + len(rows))):
        return hidden[rows[0] : rows[0] + len(rows)]
    return hidden[rows]


def _charge_forward(work: _Work, since: float) -> None:
    """Count the time since `since` (a perf_counter reading) as every round's "forward":
    each request waited for the whole of it."""
    spent = time.perf_counter() - since
    work.forward_seconds += spent
    for running, _ in work.rounds:
        running.req.stats.verify_seconds += spent
        phases = running.req.stats.phase_seconds
        phases["forward"] = phases.get("forward", 0.0) + spent


def _trace_phases(req: Request, before: dict[str, float]) -> None:
    """The milliseconds of each phase the request spent on its latest round (`ms` of its
    trace record), from its phase clock `before` the round."""
    after = req.stats.phase_seconds
    req.stats.rounds[-1].extra["ms"] = {
        p: round(1000 * (t - before.get(p, 0.0)), 3) for p, t in after.items()
    }


def generate_batch(
    generator: object,
    prompts: list,
    *,
    chat: bool | None = None,
    config: GenerationConfig | None = None,
    sampling: SamplingParams | Sequence[SamplingParams] | None = None,
    spec: SpecConfig | None = None,
    batch: BatchConfig | None = None,
) -> list[GenerationResult]:
    """Generate for every prompt, up to `batch.max_running` at a time; results in prompt
    order. `sampling` is one for all or one per prompt (each request has its own random
    generator). A prompt the engine refuses raises before anything runs."""
    if not isinstance(prompts, list):  # a string would be a list of one-letter prompts
        raise ConfigError(f"prompts must be a list of prompts, got {type(prompts).__name__}")
    if batch is not None and not isinstance(batch, BatchConfig):
        raise ConfigError(f"batch must be a BatchConfig, got {type(batch).__name__}")
    scheduler = Scheduler(generator, batch)
    ids = [scheduler.generator.prompt_ids(p, chat=chat, config=config) for p in prompts]
    if sampling is None or isinstance(sampling, SamplingParams):
        sampling = [sampling or SamplingParams()] * len(prompts)
    if not isinstance(sampling, Sequence) or not all(
        isinstance(s, SamplingParams) for s in sampling
    ):
        raise ConfigError("sampling must be a SamplingParams or a list of them, one per prompt")
    if len(sampling) != len(prompts):
        raise ConfigError(f"{len(sampling)} sampling settings for {len(prompts)} prompts")
    waiting = deque(enumerate(ids))
    results: dict[int, GenerationResult] = {}
    index: dict[int, int] = {}
    while waiting or scheduler.running:
        while waiting and scheduler.has_room():
            i, prompt = waiting.popleft()
            running = scheduler.add(prompt, config=config, sampling=sampling[i], spec=spec)
            index[id(running)] = i
        for update in scheduler.step():
            if update.error is not None:
                raise update.error
            if update.result is not None:
                results[index.pop(id(update.running))] = update.result
    return [results[i] for i in range(len(prompts))]
