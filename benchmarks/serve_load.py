"""Load run of `specfork serve`: throughput and latency against concurrency, speculation on/off.

For every configuration (each --strategies entry at --max-running N, and again at max-running 1,
the one-request-at-a-time baseline) the server starts in-process on a loopback port once per
repeat, answers a warm-up request, then at every --concurrency level C takes the same
max(--requests, 2 × the largest level) streamed chat requests (greedy, EOS ignored: exactly
--max-tokens tokens each) from C client threads. Configurations alternate within each repeat;
medians over repeats are shown.

Prints (and with --out writes table.md) a table of requests/s, generated tokens/s, p50/p95
latency and p50 time to first token (client side, queueing included) per configuration and
concurrency, the tokens/s ratios speculation on / off and max-running N / max-running 1, and one
request's decode speed and latency through the server against the library's
`Generator.generate` on the same prompts. --out also writes results.json (every request) and
load.png (tokens/s against concurrency). Every configuration must return the same greedy text
for the same prompt at every concurrency: a difference is listed with its prompt and the run
exits with status 1.

    python benchmarks/serve_load.py --prompts benchmarks/prompts/specbench-dev.jsonl \
        --concurrency 1,2,4,8,16,32 --requests 16 --max-tokens 64 --repeats 2 --out load-out

--workload NAME (agent, multi-turn, code-edit, rag or all; not with --prompts) replays the
workload's conversations instead (specfork.bench.load_replay): at each level the C clients
take max(--requests, the largest level) whole conversations and send each one's turns in
order, every later turn after the server's own earlier answers (the agent loop); a second
table shows the later turns (2 and on) beside turn 1, and the text check is per conversation
and turn.

    python benchmarks/serve_load.py --workload agent --concurrency 1,4 --strategies ar,dspark
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

from specfork.bench.load import (
    DEFAULT_CONCURRENCY,
    DEFAULT_STRATEGIES,
    NAMED_STRATEGIES,
    InProcessServers,
    LoadConfig,
    LoadSettings,
    configurations,
    parse_load_strategies,
    sweep,
)
from specfork.bench.load_replay import replay_runner, workload_conversations
from specfork.bench.load_report import LoadReport, write_outputs
from specfork.bench.machine import machine_info
from specfork.bench.openai_api import ServerAnswerError
from specfork.bench.report import check_output_dir
from specfork.cli.common import read_first_turns
from specfork.engine.batch import BatchConfig
from specfork.engine.thread import model_thread, run_in
from specfork.errors import SpecforkError
from specfork.loading.loader import LoadedModel, load_model
from specfork.loading.registry import DEFAULT_MODEL

log = logging.getLogger("serve_load")

BUILT_IN_PROMPTS = (
    "Summarize in two sentences: the quick brown fox jumps over the lazy dog again and again.",
    "Write a Python function that returns the n-th Fibonacci number, with a docstring.",
    "Translate to French: The weather is nice today and we are going to the beach.",
    "Explain what a hash table is to a beginner.",
)


def levels(text: str) -> tuple[int, ...]:
    """--concurrency: a comma-separated list of integers."""
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of integers: {text!r} (e.g. 1,2,4)") from None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--max-context", type=int, default=2048)
    p.add_argument("--prompts", type=Path, default=None, help="prompt file (first turns)")
    p.add_argument(
        "--workload",
        default=None,
        metavar="NAME",
        help="replay a shipped workload's conversations turn by turn, each later turn after "
        "the server's own answers (agent, multi-turn, code-edit, rag or all; not with "
        "--prompts); --requests then counts conversations, at least one per client",
    )
    names = ", ".join(f"{k} = {label}" for k, (label, _) in NAMED_STRATEGIES.items())
    p.add_argument(
        "--strategies",
        default=DEFAULT_STRATEGIES,
        help=f"comma list of names ({names}) or `specfork bench` strategy specs; "
        "ar is added when missing (default %(default)s)",
    )
    p.add_argument(
        "--max-running",
        type=int,
        default=8,
        help="requests decoding at once in the measured configurations; every strategy also "
        "runs at max-running 1, the baseline (default %(default)s)",
    )
    p.add_argument(
        "--concurrency",
        type=levels,
        default=DEFAULT_CONCURRENCY,
        help="concurrent clients, a comma list (default 1,2,4,8,16,32)",
    )
    p.add_argument(
        "--requests", type=int, default=16,
        help="per level, the same at every level: at least 2 per client of the largest",
    )  # fmt: skip
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument(
        "--step-rows", type=int, default=None, metavar="N",
        help="rows one batched forward may hold, as `specfork serve --step-rows` "
        "(default: the server's, max(128, --max-running))",
    )  # fmt: skip
    p.add_argument("--repeats", type=int, default=1, help="interleaved runs, medians shown")
    p.add_argument(
        "--out", type=Path, default=None, help="folder for results.json, table.md, load.png"
    )
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> int:
    """The load run; its exit status (1 when texts differ)."""
    settings = LoadSettings(
        args.concurrency,
        args.requests,
        args.max_tokens,
        args.repeats,
        prompts=str(args.prompts) if args.prompts else None,
        workload=args.workload,
    )
    configs = configurations(parse_load_strategies(args.strategies), args.max_running)
    BatchConfig.rows_for(args.max_running, args.step_rows)  # refused before the model loads
    out = check_output_dir(args.out) if args.out else None
    most = max(settings.requests_at(c) for c in settings.concurrency)
    if settings.workload:
        return replay(args, settings, configs, out, most)
    prompts = read_first_turns(args.prompts) if args.prompts else list(BUILT_IN_PROMPTS)
    with model_thread() as thread:  # loads and runs the model, as `specfork serve` does
        loaded = run_in(thread, load_model, args.model, dtype=args.dtype, device=args.device)
        servers = InProcessServers(loaded, thread, args.max_context, step_rows=args.step_rows)
        result = sweep(configs, prompts, settings, servers, progress=log.info)
    report = LoadReport(configs, settings, prompts[:most], result, about(loaded, args.step_rows))
    title = (
        f"{report.about['title']}: {args.max_tokens} tokens per request, "
        f"{args.repeats} repeat(s), medians"
    )
    return finish(report, out, title)


def replay(
    args: argparse.Namespace,
    settings: LoadSettings,
    configs: list[LoadConfig],
    out: Path | None,
    most: int,
) -> int:
    """The load run replaying --workload's conversations; its exit status."""
    conversations = workload_conversations(args.workload)
    first_turns = [c.first_messages() for c in conversations]  # the library's check
    with model_thread() as thread:
        loaded = run_in(thread, load_model, args.model, dtype=args.dtype, device=args.device)
        servers = InProcessServers(loaded, thread, args.max_context, step_rows=args.step_rows)
        runner = replay_runner(conversations)
        result = sweep(configs, first_turns, settings, servers, log.info, runner)
    used = conversations[:most]  # request i replays conversation i mod their number
    report = LoadReport(
        configs,
        settings,
        [c.turns[0] for c in used],
        result,
        {**about(loaded, args.step_rows), "workload": args.workload},
        conversations=used,
    )
    turns = sum(len(used[i % len(used)].turns) for i in range(most))  # requests a level
    title = (
        f"{report.about['title']}: workload {args.workload} replayed, {most} conversations "
        f"({turns} requests) a level, {args.max_tokens} tokens per request, "
        f"{args.repeats} repeat(s), medians"
    )
    return finish(report, out, title)


def about(loaded: LoadedModel, step_rows: int | None = None) -> dict[str, Any]:
    """The model, the rows a step may hold (None: the server's default) and the machine, for
    results.json."""
    dtype, device = str(loaded.model.dtype).removeprefix("torch."), str(loaded.model.device)
    return {
        "title": f"{loaded.path.name} ({dtype}, {device})",
        "model": loaded.path.name,
        "batch_invariant": bool(getattr(loaded.model, "batch_invariant", False)),
        "step_rows": step_rows,
        "machine": machine_info(dtype, device),
    }


def finish(report: LoadReport, out: Path | None, title: str) -> int:
    """Print the tables, write the files, name every differing text; the exit status."""
    print(f"{title}\n\n{report.markdown()}")
    if out is not None:
        for path in write_outputs(report, out, title).values():
            log.info("wrote %s", path)
    for line in report.mismatch_lines():
        log.error("text differs: %s", line)
    if report.mismatches and not report.about["batch_invariant"]:
        log.error(
            "(the model runs on the eager PyTorch path, not batch-invariant: in low precision "
            "a batched forward may round differently; float32 should agree)"
        )
    return 1 if report.mismatches else 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    logging.getLogger("specfork.strategies.dspark").setLevel(logging.WARNING)  # its round trace
    try:
        return run(args)
    except (SpecforkError, ServerAnswerError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, SpecforkError) else 1


if __name__ == "__main__":
    sys.exit(main())
