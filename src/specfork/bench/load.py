"""Load runs against `specfork serve`: streamed requests from concurrent clients.

`sweep` runs every configuration (a strategy, as `specfork serve --strategy` sets it, and a
`max_running`) at every concurrency level C, the configurations interleaved within each repeat.
Each (configuration, level) gets a fresh server — an empty prefix cache, so that no level reads
prompts an earlier level left in it — which answers a warm-up request of its own, then takes the
same max(requests, 2 × the largest level) streamed chat requests (greedy, EOS ignored, so each
yields max_tokens tokens) from C client threads; request i asks prompt i mod len(prompts). Every
request's figures and text are kept (`LevelRun`); `specfork.bench.load_report` turns them into
medians, tables, ratios and a plot.

With a workload (`LoadSettings.workload`) a level replays conversations instead
(`specfork.bench.load_replay`): max(requests, the largest level) of them, each client sending a
conversation's turns in order with the server's earlier answers in the history; every sample
carries its turn number.

`InProcessServers` serves the configurations from one loaded model on the thread that loaded it
(as `specfork serve` does) and measures the library's own decode speed on the same prompts.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

from specfork.bench.openai_api import OpenAIServer, ServerAnswerError
from specfork.bench.prompt_file import Prompt
from specfork.bench.specs import StrategySpec, ensure_plain, parse_strategies
from specfork.bench.workloads import workload_names
from specfork.checks import is_int
from specfork.config import GenerationConfig, SpecConfig
from specfork.errors import ConfigError

DEFAULT_CONCURRENCY = (1, 2, 4, 8, 16, 32)
WARM_UP_TOKENS = 4
WARM_UP_PROMPT = "Say hello."  # a server's first request, not one of the measured prompts
LIBRARY_PROMPTS = 4  # prompts of the library's decode-speed check
#: --strategies names: name -> (display label, strategy spec as `specfork bench` writes it)
NAMED_STRATEGIES = {
    "ar": ("ar (plain)", "ar"),
    "ngram": ("speculative ngram k=4", "speculative:ngram?k=4"),
    "dspark": ("dspark ngram", "dspark:ngram"),
    "spork": ("spork recycle+ngram", "spork:recycle+ngram"),
}
DEFAULT_STRATEGIES = "ar,ngram"


@dataclass(frozen=True)
class LoadConfig:
    """One server configuration: a strategy (the server's default) and its max_running."""

    strategy: str  # display label
    spec: SpecConfig
    max_running: int

    @property
    def label(self) -> str:
        return f"{self.strategy}, max-running {self.max_running}"

    @property
    def speculative(self) -> bool:
        return self.spec.drafts


@dataclass(frozen=True)
class LoadSettings:
    """What the sweep sends (validated on construction; errors are ConfigError)."""

    concurrency: tuple[int, ...] = DEFAULT_CONCURRENCY
    requests: int = 16  # per level at least; every level sends 2 per client of the largest
    max_tokens: int = 64
    repeats: int = 1
    prompts: str | None = None  # --prompts: a prompt file's first turns (None: built-in)
    workload: str | None = None  # --workload: replay this workload's conversations

    def __post_init__(self) -> None:
        if self.workload is not None and self.prompts is not None:
            raise ConfigError(
                f"--workload {self.workload} and --prompts {self.prompts} cannot be given "
                "together: --workload replays the shipped workload's conversations, --prompts "
                "sends a prompt file's first turns; give one"
            )
        if self.workload is not None:
            workload_names(self.workload)  # ConfigError naming the workloads
        levels = self.concurrency
        if not levels or any(not _positive_int(c) for c in levels):
            raise ConfigError(f"--concurrency must list integers >= 1, got {levels!r}")
        if len(set(levels)) != len(levels):
            raise ConfigError(f"--concurrency lists a level twice: {levels!r}")
        for name in ("requests", "max_tokens", "repeats"):
            value = getattr(self, name)
            if not _positive_int(value):
                flag = name.replace("_", "-")
                raise ConfigError(f"--{flag} must be an integer >= 1, got {value!r}")

    @property
    def replay(self) -> bool:
        """Whether levels replay a workload's conversations (turn after turn)."""
        return self.workload is not None

    def requests_at(self, concurrency: int) -> int:
        """Requests sent at a concurrency level: the same at every level (so every level asks
        the same prompts, request i prompt i mod their number), and at least 2 per client of
        the largest level. In a replay, conversations (of several requests each): at least one
        per client of the largest level."""
        if self.replay:
            return max(self.requests, max(self.concurrency))
        return max(self.requests, 2 * max(self.concurrency))


def _positive_int(value: object) -> bool:
    return is_int(value) and value >= 1


@dataclass(frozen=True)
class RequestSample:
    """One request as its client saw it, with the server's figures for it."""

    prompt: int  # index into the prompts
    text: str
    tokens: int  # completion tokens (the usage chunk)
    latency: float  # seconds, request sent -> stream ended
    ttft: float  # seconds, request sent -> first content (queueing included)
    decode_tps: float  # the server's decode tokens/s for this request (prefill excluded)
    mean_accepted: float  # tokens per target forward, bonus included
    target_forwards: int
    turn: int = 1  # a replayed conversation's turn (1: the first; single-turn requests: 1)


@dataclass
class LevelRun:
    """One concurrency level of one server (one configuration, one repeat)."""

    config: str  # LoadConfig.label
    repeat: int
    concurrency: int
    wall: float  # seconds from the first request sent to the last stream ended
    samples: list[RequestSample] = field(default_factory=list)

    def of_turns(self, keep: Callable[[int], bool]) -> LevelRun:
        """The requests whose turn `keep` accepts, over the level's whole wall time (so their
        requests/s and tokens/s are their share of the level's)."""
        mine = [s for s in self.samples if keep(s.turn)]
        return LevelRun(self.config, self.repeat, self.concurrency, self.wall, mine)

    @property
    def requests_per_s(self) -> float:
        return len(self.samples) / self.wall

    @property
    def tokens_per_s(self) -> float:
        return sum(s.tokens for s in self.samples) / self.wall

    def latency(self, q: float) -> float:
        return percentile([s.latency for s in self.samples], q)

    @property
    def ttft_p50(self) -> float:
        return percentile([s.ttft for s in self.samples], 0.5)

    @property
    def mean_accepted(self) -> float:
        """Tokens per target forward over the level's requests."""
        forwards = sum(s.target_forwards for s in self.samples)
        if not forwards:
            return 0.0
        return sum(s.mean_accepted * s.target_forwards for s in self.samples) / forwards

    @property
    def decode_tps(self) -> float:
        """Median over requests of the server's per-request decode tokens/s."""
        return statistics.median(s.decode_tps for s in self.samples)


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank `q` quantile (0 <= q <= 1) of a non-empty sequence: the smallest value
    with at least a fraction q of the values at or below it."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile must be in [0, 1], got {q}")
    ordered = sorted(values)
    rank = math.ceil(q * len(ordered) - 1e-9)  # 1-based; the epsilon absorbs 0.95 * 20 = 19.0…01
    return ordered[max(rank, 1) - 1]


def parse_load_strategies(text: str) -> list[tuple[str, SpecConfig]]:
    """(label, spec) of each --strategies entry: a `NAMED_STRATEGIES` name or a `specfork bench`
    strategy spec (labelled by itself); plain decoding is added first when missing."""
    named = {spec: label for label, spec in NAMED_STRATEGIES.values()}
    pieces = [NAMED_STRATEGIES.get(p.strip(), (None, p))[1] for p in text.split(",")]
    specs, _ = ensure_plain(parse_strategies(",".join(pieces)))
    out = []
    for s in specs:
        if s.family != "specfork" or s.spec is None:
            raise ConfigError(_not_served(s))
        out.append((named.get(s.label, s.label), s.spec))
    return out


def _not_served(spec: StrategySpec) -> str:
    names = ", ".join(NAMED_STRATEGIES)
    return (
        f"--strategies: {spec.label!r} is not a strategy specfork serves; give one of {names} "
        "or a specfork strategy spec such as speculative:ngram?k=6"
    )


def configurations(
    strategies: Sequence[tuple[str, SpecConfig]], max_running: int
) -> list[LoadConfig]:
    """Each strategy at `max_running` and at the baseline 1 (once when max_running is 1)."""
    if not _positive_int(max_running):
        raise ConfigError(f"--max-running must be an integer >= 1, got {max_running!r}")
    runnings = dict.fromkeys((max_running, 1))
    return [LoadConfig(label, spec, n) for label, spec in strategies for n in runnings]


# -------------------------------------------------------------------------------- the client


class LoadClient:
    """Streams greedy chat requests (EOS ignored) to one server and measures each."""

    def __init__(self, url: str, max_tokens: int) -> None:
        self.server = OpenAIServer(f"{url}/v1")
        self.max_tokens = max_tokens

    def close(self) -> None:
        self.server.close()

    def request(
        self, prompt_index: int, prompt: Prompt, max_tokens: int | None = None, turn: int = 1
    ) -> RequestSample:
        """One streamed request (`prompt`: a user message, or chat messages); ServerAnswerError
        if the server fails it."""
        body = {
            "messages": _messages(prompt),
            "max_tokens": max_tokens or self.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        t0 = time.perf_counter()
        ttft, pieces, usage, stats = None, [], {}, {}
        for event in self.server.stream("/chat/completions", body):
            for choice in event.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content") or ""
                if piece and ttft is None:
                    ttft = time.perf_counter() - t0
                pieces.append(piece)
            usage = event.get("usage") or usage
            stats = event.get("speculative") or stats
        latency = time.perf_counter() - t0
        if "completion_tokens" not in usage:
            raise ServerAnswerError("the server sent no usage chunk (completion_tokens)")
        return RequestSample(
            prompt=prompt_index,
            text="".join(pieces),
            tokens=usage["completion_tokens"],
            latency=latency,
            ttft=latency if ttft is None else ttft,
            decode_tps=float(stats.get("decode_tokens_per_second", 0.0)),
            mean_accepted=float(stats.get("mean_accepted_length", 0.0)),
            target_forwards=int(stats.get("target_forwards", 0)),
            turn=turn,
        )


def _messages(prompt: Prompt) -> list[dict[str, str]]:
    """Chat messages of a prompt: a text is one user message."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return [dict(m) for m in prompt]


#: one level's requests: (client, requests or conversations to send, client threads) -> (wall
#: seconds, samples in request order)
LevelRunner = Callable[[LoadClient, int, int], tuple[float, list[RequestSample]]]


def run_level(
    client: LoadClient, prompts: Sequence[Prompt], n: int, concurrency: int
) -> tuple[float, list[RequestSample]]:
    """`n` requests from `concurrency` client threads; (wall seconds, samples in request order)."""
    jobs = [(i % len(prompts), prompts[i % len(prompts)]) for i in range(n)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency, thread_name_prefix="load-client") as pool:
        samples = list(pool.map(lambda job: client.request(*job), jobs))
    return time.perf_counter() - t0, samples


# -------------------------------------------------------------------------------- the sweep


class Servers(Protocol):
    """What the sweep needs: a server per configuration, and the library's own speed."""

    def serve(self, config: LoadConfig, queue_size: int) -> AbstractContextManager[str]:
        """A running server of `config`; yields its base URL (http://host:port)."""
        ...

    def library_check(
        self, spec: SpecConfig, prompts: Sequence[Prompt], max_tokens: int
    ) -> LibraryCheck:
        """The library's own figures on `prompts`, one request at a time."""
        ...


@dataclass(frozen=True)
class LibraryCheck:
    """`Generator.generate` on the first prompts, one at a time: medians over the prompts."""

    decode_tps: float  # decode tokens/s (prefill excluded)
    latency: float  # seconds a whole call takes (templating and prefill included)


@dataclass
class SweepResult:
    runs: list[LevelRun]
    library: dict[str, list[LibraryCheck]]  # strategy label -> one check per repeat


def sweep(
    configs: Sequence[LoadConfig],
    prompts: Sequence[Prompt],
    settings: LoadSettings,
    servers: Servers,
    progress: Callable[[str], None] = lambda _: None,
    runner: LevelRunner | None = None,
) -> SweepResult:
    """Every configuration at every concurrency level, `settings.repeats` times, interleaved.
    Each level gets a server of its own: a server's prefix cache keeps the KV of the prompts
    it has seen, and every level asks the same prompts, so a level run after another on one
    server would read its prompts from that cache and measure no prefill.

    `runner` sends a level's requests (default: `run_level` on `prompts`; a replay passes
    `load_replay.replay_runner`); the library's check runs the first of `prompts`."""
    if runner is None:
        runner = partial(_single_turns, prompts)
    result = SweepResult([], {})
    most = max(settings.requests_at(c) for c in settings.concurrency)
    first = prompts[:LIBRARY_PROMPTS]
    for repeat in range(settings.repeats):
        measured: set[str] = set()  # strategies whose library speed this repeat has
        for config in configs:
            if config.strategy not in measured:
                measured.add(config.strategy)
                check = servers.library_check(config.spec, first, settings.max_tokens)
                result.library.setdefault(config.strategy, []).append(check)
            for c in settings.concurrency:
                progress(f"repeat {repeat + 1}: {config.label}, concurrency {c}")
                with servers.serve(config, queue_size=most) as url:
                    wall, samples = _level(url, runner, settings.requests_at(c), c, settings)
                result.runs.append(LevelRun(config.label, repeat, c, wall, samples))
    return result


def _single_turns(
    prompts: Sequence[Prompt], client: LoadClient, n: int, concurrency: int
) -> tuple[float, list[RequestSample]]:
    return run_level(client, prompts, n, concurrency)


def _level(
    url: str, runner: LevelRunner, n: int, concurrency: int, settings: LoadSettings
) -> tuple[float, list[RequestSample]]:
    """A fresh server's warm-up (a prompt of its own, so no measured prompt is cached by it),
    then one concurrency level."""
    client = LoadClient(url, settings.max_tokens)
    try:
        client.request(-1, WARM_UP_PROMPT, WARM_UP_TOKENS)
        return runner(client, n, concurrency)
    finally:
        client.close()


class InProcessServers:
    """Servers of one loaded model, on the thread that loaded it (`model_thread()`)."""

    def __init__(
        self,
        loaded: Any,
        thread: Executor,
        max_context: int | None = None,
        step_rows: int | None = None,
    ) -> None:
        self.loaded = loaded
        self.thread = thread
        self.max_context = max_context
        self.step_rows = step_rows  # rows a step's forward may hold (None: the server's default)
        self._generators: dict[SpecConfig, Any] = {}

    def generator(self, spec: SpecConfig) -> Any:
        """The Generator whose default strategy is `spec` (built and warmed once)."""
        if spec not in self._generators:
            self._generators[spec] = self.thread.submit(self._build, spec).result()
        return self._generators[spec]

    def _build(self, spec: SpecConfig) -> Any:
        from specfork.engine.generator import Generator

        generator = Generator(self.loaded, spec=spec, max_context=self.max_context)
        generator.warm_up()
        return generator

    @contextmanager
    def serve(self, config: LoadConfig, queue_size: int) -> Iterator[str]:
        from specfork.server.app import create_app
        from specfork.server.run import serve_in_background

        app = create_app(
            self.generator(config.spec),
            model_name="load",
            queue_size=max(64, queue_size),
            thread=self.thread,
            max_running=config.max_running,
            step_rows=self.step_rows,
        )
        with serve_in_background(app) as url:
            yield url

    def library_check(
        self, spec: SpecConfig, prompts: Sequence[Prompt], max_tokens: int
    ) -> LibraryCheck:
        generator = self.generator(spec)
        return self.thread.submit(_library_check, generator, prompts, max_tokens).result()


def _library_check(generator: Any, prompts: Sequence[Prompt], max_tokens: int) -> LibraryCheck:
    config = GenerationConfig(max_new_tokens=max_tokens, ignore_eos=True)
    speeds, latencies = [], []
    for prompt in prompts:
        start = time.perf_counter()
        result = generator.generate(_messages(prompt), config=config)
        latencies.append(time.perf_counter() - start)
        speeds.append(result.stats.decode_tokens_per_second)
    return LibraryCheck(statistics.median(speeds), statistics.median(latencies))
