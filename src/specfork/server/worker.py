"""The one thread that owns the Generator, fed by a bounded queue of jobs.

The Generator is not thread-safe, so exactly one worker thread runs it; that thread is the one
that loaded the model (see `specfork.engine.thread`: PyTorch's CPU thread pool runs at full speed
only for the thread that created it). HTTP handlers put jobs in a bounded queue (full: HTTP 429)
and read the job's events (start, text deltas, done or error) from an asyncio queue the worker
fills through the event loop. The worker runs the scheduler loop of continuous batching
(`specfork.engine.batch`): waiting jobs join the batch in arrival order while it has room
(`max_running`), every step advances all running jobs by one target forward, and a finished
job leaves at once. A cancelled job (its client went away) is skipped if it is still waiting,
or leaves the batch before the next step, its cache freed. An engine that cannot batch (any
object with `stream`) runs one job at a time.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent import futures
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

from specfork.checks import is_int, is_number
from specfork.config import GenerationConfig, SamplingParams, SpecConfig
from specfork.engine.batch import BatchConfig, Scheduler, StepRecord, Update
from specfork.engine.thread import model_thread
from specfork.errors import ConstraintError, PromptError, SpecforkError
from specfork.server.metrics import ServerMetrics
from specfork.server.schemas import APIError, RequestLimits
from specfork.server.security import LOOPBACK_HOSTS, host_name
from specfork.threads import ThreadReport

if TYPE_CHECKING:
    from specfork.engine.lifecycle import GenerationResult
    from specfork.engine.logprobs import TokenLogprob

log = logging.getLogger(__name__)

PLAIN = SpecConfig()
DEFAULT_PREFIX_CACHE_MB = 256
SHARED_CORES_WARNING_EVERY = 60.0  # seconds


class Stream(Protocol):
    """What the worker needs of a `specfork.engine.TextStream`."""

    result: GenerationResult | None  # set when the generation ends
    logprobs: list[TokenLogprob] | None  # grows with the output, when asked for

    def rounds(self) -> Iterable[str]:
        """Each round's new text ("" when none)."""
        ...


class Engine(Protocol):
    """What the worker needs of a `specfork.engine.Generator`."""

    default_spec: SpecConfig
    context: int
    tokenizer: Any  # decode([id]) names tokens in log-probabilities

    def encode_prompt(self, prompt: object, chat: bool | None = None) -> list[int]: ...

    def stream(
        self,
        prompt: list[int],
        *,
        config: GenerationConfig,
        sampling: SamplingParams,
        spec: SpecConfig | None,
    ) -> Stream: ...


@dataclass(frozen=True, slots=True)
class ServerSettings:
    """How the server queues and schedules requests (validated on construction)."""

    model_name: str
    queue_size: int = 64  # requests that may wait beside the running ones
    plain_above_queue: int | None = None  # waiting requests above which decoding goes plain
    retry_after: int = 1  # seconds, sent with HTTP 429
    default_max_tokens: int = 256
    max_body_bytes: int = 8 * 1024 * 1024
    api_key: str | None = None  # None: no authentication
    allowed_hosts: tuple[str, ...] = LOOPBACK_HOSTS  # Host header names served ("*": any)
    max_draft_nodes: int = 256  # tokens a request's strategy may draft per round
    request_timeout: float | None = 300.0  # seconds of decoding per request (None: no limit)
    max_mask_ms: float | None = 25.0  # a constraint's mean masking time per token (None: any)
    fixed_strategy: bool = False  # refuse per-request `speculative` objects
    allow_lossy: bool = False  # let requests opt into lossy typical acceptance
    metrics_prefix: str = "specfork:"  # of the vLLM-named speculative-decoding counters
    max_running: int = 8  # the most requests decoding at once (1: one request at a time)
    prefix_cache_mb: int | None = None  # None: 256 on batch-invariant models, else off
    stream_interval: float = 0.02  # seconds between a stream's chunks (0: one per step)
    kv_budget_mb: float | None = None  # MiB of KV cache the running requests may hold together
    step_rows: int | None = None  # rows a step's forward may hold (None: max(128, max_running))

    def __post_init__(self) -> None:
        if not isinstance(self.model_name, str) or not self.model_name:
            raise SpecforkError("the served model name must be a non-empty string")
        for name in (
            "queue_size",
            "retry_after",
            "default_max_tokens",
            "max_body_bytes",
            "max_draft_nodes",
            "max_running",
        ):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise SpecforkError(f"{name} must be an integer >= 1, got {value!r}")
        b = self.kv_budget_mb
        if b is not None and not (is_number(b) and math.isfinite(b) and b > 0):
            raise SpecforkError(f"kv_budget_mb must be a number of MiB > 0, got {b!r}")
        rows = self.step_rows
        if rows is not None:
            BatchConfig.rows_for(self.max_running, rows)  # the batch's own check and message
        for name in ("plain_above_queue", "prefix_cache_mb"):
            n = getattr(self, name)
            if n is not None and (not is_int(n) or n < 0):
                raise SpecforkError(f"{name} must be an integer >= 0, got {n!r}")
        self._check_security()

    def _check_security(self) -> None:
        key, hosts, t = self.api_key, self.allowed_hosts, self.request_timeout
        if key is not None and (not isinstance(key, str) or not key.strip() or key != key.strip()):
            raise SpecforkError("the API key must be a non-empty string without outer spaces")
        if key is not None and not key.isprintable():
            raise SpecforkError("the API key must be printable text (it travels in a header)")
        names = tuple(h if h == "*" else host_name(h) for h in hosts)  # "[::1]:80" → "::1"
        object.__setattr__(self, "allowed_hosts", names)
        if not self.allowed_hosts or any(not h for h in self.allowed_hosts):
            raise SpecforkError("allowed hosts must be non-empty names (or '*' for any host)")
        number = is_number(t)
        if t is not None and not (number and math.isfinite(t) and t > 0):
            raise SpecforkError(f"request_timeout must be a number of seconds > 0, got {t!r}")
        m = self.max_mask_ms
        if m is not None and not (is_number(m) and math.isfinite(m) and m > 0):
            raise SpecforkError(f"max_mask_ms must be a number of milliseconds > 0, got {m!r}")
        i = self.stream_interval
        if not (is_number(i) and 0 <= i <= 10):
            raise SpecforkError(f"stream_interval must be in [0, 10] seconds, got {i!r}")
        for name in ("fixed_strategy", "allow_lossy"):
            if not isinstance(getattr(self, name), bool):
                raise SpecforkError(f"{name} must be true or false")
        if not re.fullmatch(r"[A-Za-z_:][A-Za-z0-9_:]*|", self.metrics_prefix):
            raise SpecforkError(
                f"the metrics prefix {self.metrics_prefix!r} must be letters, digits, _ and :, "
                "not starting with a digit (e.g. 'specfork:' or 'vllm:')"
            )

    @property
    def limits(self) -> RequestLimits:
        """What one request may ask for."""
        return RequestLimits(
            self.max_draft_nodes,
            self.fixed_strategy,
            self.allow_lossy,
            self.request_timeout,
            self.max_mask_ms,
        )


def request_failure(exc: Exception) -> APIError:
    """The error a request that failed mid-decode gets: its constraint's own fault (it grew too
    dear to enforce) is a 400 naming response_format; anything else a 500."""
    if isinstance(exc, ConstraintError):
        return APIError(str(exc), param="response_format", code="invalid_response_format")
    return APIError("internal server error while generating this request", status=500)


@dataclass(frozen=True, slots=True)
class Event:
    """What a job reports: "start", "delta" (text), "done" (result) or "error"."""

    kind: Literal["start", "delta", "done", "error"]
    text: str = ""
    logprobs: list[TokenLogprob] | None = None  # of the tokens emitted since the last delta
    result: GenerationResult | None = None
    spec: SpecConfig | None = None
    plain_under_load: bool = False
    error: APIError | None = None


class Job:
    """One request for the worker; events go to the event loop that created it."""

    def __init__(
        self,
        ids: list[int],
        config: GenerationConfig,
        sampling: SamplingParams,
        spec: SpecConfig | None,
        *,
        deltas: bool,
        prompt_param: str = "prompt",
    ) -> None:
        self.ids = ids
        self.config = config
        self.sampling = sampling
        self.spec = spec
        self.deltas = deltas  # send text deltas (streaming) or only the final result
        self.prompt_param = prompt_param
        self.created = time.perf_counter()
        self._loop = asyncio.get_running_loop()
        self._events: asyncio.Queue[Event] = asyncio.Queue()
        self._cancelled = threading.Event()
        self.on_cancel: Callable[[Job], None] | None = None  # the worker's: leave the queue

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def cancel(self) -> None:
        """Stop the job: out of the queue at once if it waits, at the next round if it runs."""
        if self._cancelled.is_set():
            return
        self._cancelled.set()
        if self.on_cancel is not None:
            self.on_cancel(self)

    def emit(self, event: Event) -> None:
        """Hand an event to the job's event loop (from any thread)."""
        try:
            self._loop.call_soon_threadsafe(self._events.put_nowait, event)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            self.cancel()

    @staticmethod
    def emit_all(events: list[tuple[Job, Event]]) -> None:
        """Hand many jobs' events over with one wake-up per event loop: each wake-up lets the
        loop's thread take the GIL, and a step's worth of them one by one stalls the engine
        thread for milliseconds each."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Job, Event]]] = {}
        for job, event in events:
            by_loop.setdefault(job._loop, []).append((job, event))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                for job, _ in items:
                    job.cancel()

    async def next_event(self) -> Event:
        return await self._events.get()


def _put_all(items: list[tuple[Job, Event]]) -> None:
    for job, event in items:
        job._events.put_nowait(event)


class Full(Exception):
    """The job queue holds as many jobs as it may."""


class JobQueue:
    """A bounded FIFO of waiting jobs from which a cancelled job is removed at once."""

    def __init__(self, maxsize: int) -> None:
        self.maxsize = maxsize
        self._items: deque[Job | None] = deque()
        self._ready = threading.Condition()

    def qsize(self) -> int:
        with self._ready:
            return sum(item is not None for item in self._items)

    def put_nowait(self, job: Job | None) -> None:
        """Add a job (None: the worker's stop signal, never refused); Full when full."""
        with self._ready:
            if job is not None and sum(i is not None for i in self._items) >= self.maxsize:
                raise Full
            self._items.append(job)
            self._ready.notify()

    def get(self) -> Job | None:
        with self._ready:
            while not self._items:
                self._ready.wait()
            return self._items.popleft()

    def get_if(self, fits: Callable[[Job], bool]) -> tuple[bool, Job | None]:
        """Take the head if it is the stop signal or `fits` it: (taken, item)."""
        with self._ready:
            if not self._items:
                return False, None
            head = self._items[0]
            if head is not None and not fits(head):
                return False, None
            return True, self._items.popleft()

    def get_nowait(self) -> Job | None:
        with self._ready:
            if not self._items:
                raise IndexError("the queue is empty")
            return self._items.popleft()

    def discard(self, job: Job) -> bool:
        """Take `job` out if it is still waiting; whether it was."""
        with self._ready:
            try:
                self._items.remove(job)
            except ValueError:
                return False
            return True


class EngineWorker:
    """Owns the engine; runs queued jobs in a continuous batch on the engine's model thread.

    `thread` is the single-thread executor that loaded (and warmed) the engine's model; without
    one the worker starts its own, which is right only if the model has not run anywhere yet.
    """

    def __init__(
        self,
        engine: Engine,
        metrics: ServerMetrics,
        settings: ServerSettings,
        thread: Executor | None = None,
    ) -> None:
        self.engine = engine
        self.metrics = metrics
        self.settings = settings
        self._queue = JobQueue(settings.queue_size)
        self._lock = threading.Lock()
        self._stopping = False
        self._draining = False
        self._batch = make_batch(engine, settings)
        self._jobs: dict[int, _Running] = {}  # the running jobs, by id of their batch handle
        self._executor = thread or model_thread()
        self._owns_executor = thread is None
        self._running: Future[None] | None = None
        self._warned_cores = -math.inf  # when other jobs' use of the cores was last logged
        metrics.track_queue(lambda: self.depth, lambda: len(self._jobs))
        prefix = getattr(self._batch, "prefix", None)
        if prefix is not None:
            metrics.track_prefix_cache(prefix)
        metrics.speculation.set(int(engine.default_spec.drafts))

    @property
    def depth(self) -> int:
        """Jobs waiting (the running ones excluded)."""
        return self._queue.qsize()

    @property
    def alive(self) -> bool:
        running = self._running is not None and not self._running.done()
        return running and not self._stopping

    @property
    def busy(self) -> bool:
        """Whether jobs are running or waiting."""
        return bool(self._jobs) or self.depth > 0

    def start(self) -> None:
        self._running = self._executor.submit(self._run)

    def drain(self) -> None:
        """The start of a shutdown: new jobs get 503, so do the waiting ones; the running ones
        go on (`stop` ends them)."""
        with self._lock:
            self._draining = True
        self._fail_waiting()

    def stop(self, timeout: float = 10.0) -> None:
        """Refuse new jobs, fail the waiting ones, end the running ones with 503 after the
        step in progress (streams get an error event), end the thread."""
        with self._lock:
            self._stopping = True
        self._fail_waiting()
        self._queue.put_nowait(None)  # wakes an idle thread; a busy one sees _stopping
        if self._running is not None:
            try:
                self._running.result(timeout)
            except futures.TimeoutError:
                log.warning("the engine thread did not stop within %.0f s", timeout)
        if self._owns_executor:
            self._executor.shutdown(wait=False)

    def _fail_waiting(self) -> None:
        while True:
            try:
                job = self._queue.get_nowait()
            except IndexError:
                break
            if job is not None:
                job.emit(Event("error", error=APIError("the server is shutting down", status=503)))

    def submit(self, job: Job) -> None:
        """Queue a job; APIError 429 when the queue is full (503 when shutting down)."""
        with self._lock:
            if self._stopping or self._draining:
                raise APIError("the server is shutting down", status=503)
            job.on_cancel = self._left
            try:
                self._queue.put_nowait(job)
            except Full:
                raise APIError(
                    f"the server is busy ({self.settings.queue_size} requests waiting); "
                    f"retry in {self.settings.retry_after} s",
                    status=429,
                    code="queue_full",
                    retry_after=self.settings.retry_after,
                ) from None

    def _left(self, job: Job) -> None:
        """A job cancelled while it waited leaves the queue at once (its place freed)."""
        if self._queue.discard(job):
            self.metrics.cancelled.inc()

    def _run(self) -> None:
        batch = self._batch
        while self._admit():
            if not batch.running:
                job = self._queue.get()  # idle: wait for work
                if job is None:
                    break
                self._start(job)
                continue
            self._drop_cancelled()
            if not batch.running:
                continue
            try:
                updates = batch.step()
            except Exception:  # never let one step end the worker: its jobs fail, others go on
                log.exception("unexpected error while serving a request")
                self._fail_running(APIError("internal server error", status=500))
                continue
            self.metrics.observe_step(batch.last_step())
            Job.emit_all([e for update in updates for e in self._deliver(update)])
        self._fail_running(APIError("the server is shutting down", status=503))

    def _admit(self) -> bool:
        """Waiting jobs join the batch while it has room; False once the stop signal came."""
        if self._stopping:
            return False
        batch = self._batch
        while batch.has_room():  # a slot; then KV memory for the next job in line
            taken, job = self._queue.get_if(
                lambda j: batch.has_room(len(j.ids), j.config.max_new_tokens)
            )
            if not taken:
                return True  # nothing waits, or the next job waits for memory (in order)
            if job is None:
                return False
            self._start(job)
        return True

    def _choose_spec(self, requested: SpecConfig | None) -> tuple[SpecConfig, bool]:
        """The strategy a job runs with, and whether load shedding made it plain."""
        spec = requested or self.engine.default_spec
        limit = self.settings.plain_above_queue
        shed = limit is not None and self.depth > limit
        self.metrics.speculation.set(int(not shed and self.engine.default_spec.drafts))
        if shed and spec.drafts:
            return PLAIN, True
        return spec, False

    def _start(self, job: Job) -> None:
        """A job joins the batch (or fails with its error, 400 for a bad request)."""
        if job.cancelled:  # its client left as it was taken from the queue
            self.metrics.cancelled.inc()
            return
        self.metrics.queue_time.observe(time.perf_counter() - job.created)
        spec, plain = self._choose_spec(job.spec)
        try:
            handle = self._batch.add(job.ids, config=job.config, sampling=job.sampling, spec=spec)
        except ConstraintError as exc:
            error = APIError(str(exc), param="response_format", code="invalid_response_format")
            job.emit(Event("error", error=error))
            return
        except SpecforkError as exc:
            param = job.prompt_param if isinstance(exc, PromptError) else None
            job.emit(Event("error", error=APIError(str(exc), param=param)))
            return
        except Exception:
            log.exception("unexpected error while starting a request")
            job.emit(Event("error", error=APIError("internal server error", status=500)))
            return
        self._jobs[id(handle)] = _Running(job, handle, spec, plain, time.perf_counter())
        job.emit(Event("start", spec=spec, plain_under_load=plain))

    def _warn_shared_cores(self, threads: ThreadReport | None) -> None:
        """A warning when requests ran while other jobs kept the cores busy (at most one a
        minute)."""
        warning = threads.warning("a request") if threads is not None else None
        now = time.monotonic()
        if warning is None or now - self._warned_cores < SHARED_CORES_WARNING_EVERY:
            return
        self._warned_cores = now
        log.warning("%s (at most one such warning a minute)", warning)

    def _drop_cancelled(self) -> None:
        """Jobs whose clients went away leave the batch now (their caches freed)."""
        for key, state in list(self._jobs.items()):
            if state.job.cancelled:
                self._batch.cancel(state.handle)
                del self._jobs[key]
                self.metrics.cancelled.inc()

    def _fail_running(self, error: APIError) -> None:
        """Every running job ends with `error` and leaves the batch."""
        for state in list(self._jobs.values()):
            self._batch.cancel(state.handle)
            state.job.emit(Event("error", error=error))
        self._jobs.clear()

    def _deliver(self, update: Update) -> list[tuple[Job, Event]]:
        """A step's events for a job: its text (a delta when it streams), and its end."""
        state = self._jobs.get(id(update.running))
        if state is None:
            return []
        job, events, result = state.job, [], update.result
        if update.error is not None:  # this request's own failure: it alone ends (logged)
            del self._jobs[id(update.running)]
            return [(job, Event("error", error=request_failure(update.error)))]
        if job.deltas:
            state.pending += update.text
            now = time.perf_counter()
            interval = self.settings.stream_interval
            due = result is not None or state.flushed is None or now - state.flushed >= interval
            if state.pending and due:  # the first text at once, then at most every interval
                logprobs = update.running.logprobs
                fresh = None if logprobs is None else logprobs[state.sent :]
                state.sent += len(fresh or ())
                events.append((job, Event("delta", text=state.pending, logprobs=fresh)))
                state.pending, state.flushed = "", now
        if result is None:
            return events
        del self._jobs[id(update.running)]
        self._warn_shared_cores(result.stats.threads)
        ttft = state.started - job.created + result.stats.time_to_first_token
        latency = time.perf_counter() - job.created
        self.metrics.observe_generation(result.stats, len(result.token_ids), ttft, latency)
        done = Event("done", result=result, spec=state.spec, plain_under_load=state.plain)
        return [*events, (job, done)]


@dataclass(eq=False)
class _Running:
    """A job in the batch: its handle there and what its events need."""

    job: Job
    handle: Any
    spec: SpecConfig
    plain: bool
    started: float  # when it joined the batch
    sent: int = 0  # log-probability entries already sent
    pending: str = ""  # text not sent yet (streams send at most every stream_interval)
    flushed: float | None = None  # when text was last sent


class Batch(Protocol):
    """What the worker needs of `specfork.engine.batch.Scheduler`."""

    running: list

    def has_room(self, prompt_tokens: int = 0, max_new_tokens: int = 0) -> bool: ...

    def add(
        self,
        prompt: list[int],
        *,
        config: GenerationConfig,
        sampling: SamplingParams,
        spec: SpecConfig | None,
    ) -> Any: ...

    def step(self) -> list[Update]: ...

    def cancel(self, handle: Any) -> None: ...

    def last_step(self) -> StepRecord | None: ...


def make_batch(engine: Engine, settings: ServerSettings) -> Batch:
    """The scheduler of a `Generator`; one job at a time for other engines."""
    from specfork.engine.generator import Generator

    if isinstance(engine, Generator):
        rows = BatchConfig.rows_for(settings.max_running, settings.step_rows).step_rows
        mb = settings.prefix_cache_mb
        if mb is None:  # only where a cache hit cannot change an output's rounding
            mb = DEFAULT_PREFIX_CACHE_MB if getattr(engine.model, "batch_invariant", False) else 0
        mib = settings.kv_budget_mb
        budget = None if mib is None else max(1, int(mib * 2**20))
        config = BatchConfig(settings.max_running, rows, budget, prefix_cache_bytes=mb * 2**20)
        return Scheduler(engine, config)
    return SerialBatch(engine)


class _Serial:
    """One job of a `SerialBatch`: its stream and the stream's rounds."""

    def __init__(self, stream: Stream) -> None:
        self.stream = stream
        self.rounds = iter(stream.rounds())

    @property
    def logprobs(self) -> list[TokenLogprob] | None:
        return self.stream.logprobs


class SerialBatch:
    """Runs jobs one at a time through an engine's `stream`, a round per step."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.running: list[_Serial] = []

    def has_room(self, prompt_tokens: int = 0, max_new_tokens: int = 0) -> bool:
        return not self.running

    def add(
        self,
        prompt: list[int],
        *,
        config: GenerationConfig,
        sampling: SamplingParams,
        spec: SpecConfig | None,
    ) -> _Serial:
        handle = _Serial(self.engine.stream(prompt, config=config, sampling=sampling, spec=spec))
        self.running.append(handle)
        return handle

    def step(self) -> list[Update]:
        handle = self.running[0]
        try:
            text = next(handle.rounds)
        except StopIteration:
            self.running.remove(handle)
            if handle.stream.result is None:
                raise RuntimeError("the generation ended without a result") from None
            return [Update(handle, "", handle.stream.result)]
        except BaseException:
            self.running.remove(handle)
            raise
        return [Update(handle, text)]

    def last_step(self) -> None:
        """No step records: a round of a stream is not traced here."""
        return None

    def cancel(self, handle: _Serial) -> None:
        if handle in self.running:
            self.running.remove(handle)
            close = getattr(handle.rounds, "close", None)
            if close is not None:
                close()  # the generator's cleanup runs now (its cache goes back)
