"""Prometheus metrics of one server (its own registry: two apps in a process never collide).

Speculative decoding is also counted under vLLM's names and labels (`spec_decode_num_drafts`,
`spec_decode_num_draft_tokens`, `spec_decode_num_accepted_tokens`,
`spec_decode_num_accepted_tokens_per_pos`; labels `model_name`, `engine`, and `position`),
under a prefix the server sets (`specfork:` by default; `vllm:` lets dashboards built for
vLLM work unchanged). A draft is one round's proposal (a chain or a tree); positions count
accepted tokens by their depth in it, 0 first.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from specfork.engine.batch import StepRecord
from specfork.engine.prefix import PrefixCache
from specfork.engine.stats import GenerationStats

TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
QUEUE_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServerMetrics:
    """Counters, gauges and histograms of a server; safe to update from any thread."""

    def __init__(self, prefix: str = "specfork:", model_name: str = "") -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.spec = _SpecDecodeCounters(r, prefix, model_name)
        self.requests = Counter(
            "specfork_requests",
            "Completion requests by endpoint and HTTP status (499: the client went away)",
            ["endpoint", "status"],
            registry=r,
        )
        self.cancelled = Counter(
            "specfork_generations_cancelled",
            "Generations stopped before their end because the client went away",
            registry=r,
        )
        self.prompt_tokens = Counter("specfork_prompt_tokens", "Prompt tokens", registry=r)
        self.completion_tokens = Counter(
            "specfork_completion_tokens", "Generated tokens", registry=r
        )
        self.drafted = Counter("specfork_drafted_tokens", "Tokens proposed by drafters", registry=r)
        self.accepted = Counter(
            "specfork_accepted_tokens", "Drafted tokens the target accepted", registry=r
        )
        self.forwards = Counter(
            "specfork_target_forwards", "Target forwards after prefill", registry=r
        )
        self.mean_accepted = Gauge(
            "specfork_mean_accepted_length",
            "Tokens emitted per target forward over all requests (1 = plain decoding)",
            registry=r,
        )
        self.ttft = Histogram(
            "specfork_time_to_first_token_seconds",
            "Arrival to first token (queue included)",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.latency = Histogram(
            "specfork_request_latency_seconds",
            "Arrival to last token (queue included)",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_depth = Gauge("specfork_queue_depth", "Requests waiting", registry=r)
        self.running = Gauge("specfork_requests_running", "Requests in the batch", registry=r)
        self.queue_time = Histogram(
            "specfork_queue_time_seconds",
            "Arrival to joining the batch",
            buckets=QUEUE_BUCKETS,
            registry=r,
        )
        self._steps = _StepMetrics(r)
        self.speculation = Gauge(
            "specfork_speculation_enabled",
            "1 while new requests get the server's speculative strategy; 0 when it is plain "
            "decoding or load shedding forces plain decoding",
            registry=r,
        )
        self._lock = threading.Lock()
        self._decoded = 0
        self._forwards = 0
        self.mean_accepted.set_function(self._mean_accepted_length)

    def track_queue(self, depth: Callable[[], int], running: Callable[[], int]) -> None:
        """Read the queue depth and the running requests at scrape time."""
        self.queue_depth.set_function(depth)
        self.running.set_function(running)

    def track_prefix_cache(self, cache: PrefixCache) -> None:
        """Read the prefix cache's figures at scrape time."""
        r, stats = self.registry, cache.stats
        figures = {
            "hit_rate": ("Share of prompt tokens the prefix cache served", lambda: stats.hit_rate),
            "lookups": ("Requests that looked up the prefix cache", lambda: stats.lookups),
            "hits": ("Requests that found a cached prefix", lambda: stats.hits),
            "hit_tokens": ("Prompt tokens served by the prefix cache", lambda: stats.hit_tokens),
            "bytes": ("Bytes of keys and values the prefix cache holds", lambda: cache.nbytes),
            "evictions": ("Prefix-cache nodes evicted", lambda: stats.evicted),
        }
        for name, (doc, read) in figures.items():
            Gauge(f"specfork_prefix_cache_{name}", doc, registry=r).set_function(read)

    def observe_step(self, step: StepRecord | None) -> None:
        """Record one step of the batch (None: the engine does not trace steps)."""
        if step is not None:
            self._steps.observe(step)

    def count_request(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()

    def observe_generation(
        self, stats: GenerationStats, completion_tokens: int, ttft: float, latency: float
    ) -> None:
        """Record one finished generation."""
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.completion_tokens.inc(completion_tokens)
        self.drafted.inc(stats.drafted)
        self.accepted.inc(stats.accepted)
        self.forwards.inc(stats.target_forwards)
        self.spec.observe(stats)
        self.ttft.observe(ttft)
        self.latency.observe(latency)
        with self._lock:
            self._decoded += max(stats.new_tokens - 1, 0)
            self._forwards += stats.target_forwards

    def _mean_accepted_length(self) -> float:
        with self._lock:
            return self._decoded / self._forwards if self._forwards else 0.0

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _SpecDecodeCounters:
    """vLLM's speculative-decoding counters, named under `prefix`."""

    def __init__(self, registry: CollectorRegistry, prefix: str, model_name: str) -> None:
        labels = ["model_name", "engine"]
        self.labels = {"model_name": model_name, "engine": "0"}

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(f"{prefix}{name}", doc, [*labels, *extra], registry=registry)

        self.drafts = counter("spec_decode_num_drafts", "Rounds that verified a draft")
        self.draft_tokens = counter("spec_decode_num_draft_tokens", "Drafted tokens verified")
        self.accepted = counter("spec_decode_num_accepted_tokens", "Drafted tokens accepted")
        self.per_pos = counter(
            "spec_decode_num_accepted_tokens_per_pos",
            "Accepted drafted tokens by position in their draft (0 = first)",
            ("position",),
        )

    def observe(self, stats: GenerationStats) -> None:
        """Count one finished generation's rounds."""
        drafts = [r for r in stats.rounds if r.drafted > 0]
        if not drafts:
            return
        self.drafts.labels(**self.labels).inc(len(drafts))
        self.draft_tokens.labels(**self.labels).inc(sum(r.drafted for r in drafts))
        self.accepted.labels(**self.labels).inc(sum(r.accepted for r in drafts))
        deepest = max(r.accepted for r in drafts)
        for position in range(deepest):
            n = sum(r.accepted > position for r in drafts)
            self.per_pos.labels(**self.labels, position=str(position)).inc(n)


class _StepMetrics:
    """What each step of the batch did: its size, its rows, its drafts and their acceptance,
    predicted (by the goodput allocation) and actual."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.batch = Histogram(
            "specfork_batch_size", "Requests per step", buckets=BATCH_BUCKETS, registry=r
        )
        self.rows = Histogram(
            "specfork_step_rows", "Rows of a step's forward", buckets=ROW_BUCKETS, registry=r
        )
        self.draft_rows = Histogram(
            "specfork_step_draft_rows",
            "Drafted tokens verified per step",
            buckets=(0, *ROW_BUCKETS),
            registry=r,
        )
        self.predicted = Counter(
            "specfork_draft_predicted_accepted",
            "Drafted tokens the goodput allocation expected to be accepted",
            registry=r,
        )
        self.accepted = Counter(
            "specfork_draft_accepted", "Drafted tokens accepted (per step, summed)", registry=r
        )
        self.steps = Counter("specfork_steps", "Steps of the batch", registry=r)

    def observe(self, step: StepRecord) -> None:
        self.steps.inc()
        self.batch.observe(step.requests)
        self.rows.observe(step.rows)
        self.draft_rows.observe(step.draft_rows)
        self.predicted.inc(step.predicted)
        self.accepted.inc(step.accepted)
