"""Load test of `specfork serve`: N requests from C concurrent clients, plain vs speculative.

Starts the server in-process on a loopback port once per strategy (the strategy is the server's
default, as `specfork serve --strategy ...` sets it), sends the same streamed chat requests
(greedy, EOS ignored, so every request yields exactly --max-tokens tokens) and prints a markdown
table: requests/s, p50/p95 latency, p50 time to first token, generated tokens/s, and the mean
accepted length the server's /metrics reports. Strategies alternate per repeat; medians are shown.

The last columns compare one request's decode speed through the server (the `speculative`
object's decode_tokens_per_second, median over requests) with the library's `Generator.generate`
on the same prompts in the same process, run on the thread that loaded the model as the server
does: a server slower than the library per request (0.5x when the model ran on a second OpenMP
pool, see specfork.engine.thread) shows up there.

    python benchmarks/serve_load.py --prompts benchmarks/prompts/specbench-dev.jsonl \
        --requests 16 --concurrency 4 --max-tokens 64
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import statistics
import time
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx

from specfork.cli.common import read_first_turns
from specfork.config import GenerationConfig, SpecConfig
from specfork.engine import Generator
from specfork.engine.thread import model_thread, run_in
from specfork.loading.loader import load_model
from specfork.loading.registry import DEFAULT_MODEL
from specfork.server.app import create_app
from specfork.server.run import serve_in_background

log = logging.getLogger("serve_load")

STRATEGIES = {
    "ar (plain)": SpecConfig(),
    "speculative ngram k=4": SpecConfig("speculative", "ngram", k=4),
}
BUILT_IN_PROMPTS = (
    "Summarize in two sentences: the quick brown fox jumps over the lazy dog again and again.",
    "Write a Python function that returns the n-th Fibonacci number, with a docstring.",
    "Translate to French: The weather is nice today and we are going to the beach.",
    "Explain what a hash table is to a beginner.",
)


@dataclass
class Sample:
    latency: float
    ttft: float
    tokens: int
    decode_tps: float  # the server's decode tokens/s for this request


@dataclass
class Run:
    requests_per_s: float
    p50: float
    p95: float
    ttft_p50: float
    tokens_per_s: float
    mean_accepted: float
    server_decode_tps: float  # median over requests
    library_decode_tps: float  # Generator.generate on the same prompts, median


def one_request(url: str, prompt: str, max_tokens: int) -> Sample:
    body = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    ttft, tokens, decode_tps = None, 0, 0.0
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if ttft is None and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                ttft = time.perf_counter() - t0
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("speculative"):
                decode_tps = chunk["speculative"]["decode_tokens_per_second"]
    latency = time.perf_counter() - t0
    return Sample(latency, ttft if ttft is not None else latency, tokens, decode_tps)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def mean_accepted(url: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    match = re.search(r"^specfork_mean_accepted_length (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def library_decode_tps(generator: Generator, prompts: list[str], max_tokens: int) -> float:
    """Median decode tokens/s of `Generator.generate` on the prompts (call on the model thread)."""
    config = GenerationConfig(max_new_tokens=max_tokens, ignore_eos=True)
    speeds = []
    for prompt in prompts:
        messages = [{"role": "user", "content": prompt}]
        speeds.append(generator.generate(messages, config=config).stats.decode_tokens_per_second)
    return statistics.median(speeds)


def load_run(
    generator: Generator, thread: Executor, prompts: list[str], args: argparse.Namespace
) -> Run:
    """The library on the prompts, then one server of `generator` (warm-up, measured load)."""
    library = run_in(thread, library_decode_tps, generator, prompts[:4], args.max_tokens)
    queue = max(64, args.requests)
    app = create_app(generator, model_name="bench", queue_size=queue, thread=thread)
    with serve_in_background(app) as url:
        one_request(url, prompts[0], 4)  # warm-up (not measured)
        jobs = [prompts[i % len(prompts)] for i in range(args.requests)]
        t0 = time.perf_counter()
        with ThreadPoolExecutor(args.concurrency) as pool:
            samples = list(pool.map(lambda p: one_request(url, p, args.max_tokens), jobs))
        wall = time.perf_counter() - t0
        accepted = mean_accepted(url)
    latencies = [s.latency for s in samples]
    return Run(
        requests_per_s=len(samples) / wall,
        p50=percentile(latencies, 0.5),
        p95=percentile(latencies, 0.95),
        ttft_p50=percentile([s.ttft for s in samples], 0.5),
        tokens_per_s=sum(s.tokens for s in samples) / wall,
        mean_accepted=accepted,
        server_decode_tps=statistics.median(s.decode_tps for s in samples),
        library_decode_tps=library,
    )


def median_run(runs: list[Run]) -> Run:
    fields = Run.__dataclass_fields__
    return Run(**{f: statistics.median(getattr(r, f) for r in runs) for f in fields})


def table(results: dict[str, Run]) -> str:
    lines = [
        "| strategy | requests/s | p50 latency (s) | p95 latency (s) | p50 TTFT (s) "
        "| tokens/s | mean accepted length | decode tok/s per request: server | library "
        "| server / library |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        ratio = r.server_decode_tps / r.library_decode_tps if r.library_decode_tps else 0.0
        lines.append(
            f"| {name} | {r.requests_per_s:.2f} | {r.p50:.2f} | {r.p95:.2f} | {r.ttft_p50:.2f} "
            f"| {r.tokens_per_s:.1f} | {r.mean_accepted:.2f} | {r.server_decode_tps:.1f} "
            f"| {r.library_decode_tps:.1f} | {ratio:.2f} |"
        )
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--prompts", type=Path, default=None, help="Spec-Bench JSONL (first turns)")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-context", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=1, help="alternating runs per strategy")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    prompts = read_first_turns(args.prompts) if args.prompts else list(BUILT_IN_PROMPTS)
    thread = model_thread()  # loads and runs the model, as `specfork serve` does
    loaded = run_in(thread, load_model, args.model, dtype=args.dtype, device=args.device)
    generators = {
        name: Generator(loaded, spec=spec, max_context=args.max_context)
        for name, spec in STRATEGIES.items()
    }
    runs: dict[str, list[Run]] = {name: [] for name in STRATEGIES}
    for repeat in range(args.repeats):
        for name, generator in generators.items():
            log.info("repeat %d: %s", repeat + 1, name)
            runs[name].append(load_run(generator, thread, prompts, args))
    model = f"{loaded.path.name} ({loaded.model.dtype}, {loaded.model.device})"
    print(
        f"{model}: {args.requests} requests, concurrency {args.concurrency}, "
        f"{args.max_tokens} tokens each, {args.repeats} repeat(s)\n"
    )
    print(table({name: median_run(r) for name, r in runs.items()}))


if __name__ == "__main__":
    main()
