"""`specfork calibrate` and `specfork trace-plot` (DSpark's tuning and inspection commands) and
`specfork compile` (build the CPU kernels ahead of time)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from specfork.errors import ConfigError, SpecforkError


def add_tool_parsers(sub: Any) -> None:
    """Add the `calibrate`, `trace-plot` and `compile` subcommands."""
    from specfork.cli import _add_model_flags, _add_strategy_flags

    comp = sub.add_parser(
        "compile",
        help="build specfork's CPU kernels now (otherwise the first run does, ~30 s)",
        description="Compiles the CPU kernels once for this machine, PyTorch and compiler and "
        "caches them in specfork's cache folder; with --model, also loads that model on them "
        "and runs a few tokens. Every later run starts in seconds.",
    )
    comp.add_argument("--model", "-m", default=None, help="also load and warm up this model")

    cal = sub.add_parser(
        "calibrate",
        help="suggest DSpark's --low/--high from a fixed-K run over prompts",
        description="Runs a fixed draft length over the prompts, prints the acceptance "
        "distribution and suggests the confidence thresholds --low and --high for "
        "--strategy dspark (the drafter flags choose the drafter).",
    )
    _add_model_flags(cal)
    cal.add_argument(
        "--prompts", type=Path, default=None,
        help="prompt file: Spec-Bench JSONL, JSONL of {\"prompt\": ...} or plain text "
        "(one prompt a line); default: built-in prompts",
    )  # fmt: skip
    cal.add_argument("--limit", type=int, default=None, help="use only the first N prompts")
    cal.add_argument("--fixed-k", type=int, default=4, help="the fixed draft length (default 4)")
    cal.add_argument("--max-new-tokens", "-n", type=int, default=128)
    cal.add_argument("--json", action="store_true", help="print the result as JSON")
    _add_strategy_flags(cal)

    plot = sub.add_parser(
        "trace-plot", help="plot K and confidence C against output position from a trace file"
    )
    plot.add_argument("trace", type=Path, help="a --trace FILE.jsonl written by generate")
    plot.add_argument("--out", type=Path, default=None, help="PNG path (default: TRACE.png)")


def run_compile(args: argparse.Namespace, err: Console) -> int:
    """Build (or find) the kernels; optionally load a model on them and generate a few tokens."""
    import time

    from specfork.engine import Generator
    from specfork.kernels import kernel_status
    from specfork.kernels.build import artifact_key, compiler
    from specfork.loading.loader import load_model
    from specfork.loading.registry import cache_dir

    t0 = time.perf_counter()
    with err.status("compiling specfork's CPU kernels (once per machine)…", spinner="dots"):
        module, why = kernel_status()
    if module is None:
        raise SpecforkError(f"the kernels cannot be built here: {why}")
    cxx = compiler()
    folder = cache_dir() / "kernels" / artifact_key(cxx) if cxx else cache_dir() / "kernels"
    err.print(f"kernels ready in {time.perf_counter() - t0:.1f} s: {module.isa()} code, "
              f"cached in {folder}", markup=False)  # fmt: skip
    if args.model:
        with err.status(f"loading {escape(args.model)}…", spinner="dots"):
            loaded = load_model(args.model, kernels=True, progress=False)
            Generator(loaded).warm_up()
        err.print(f"{loaded.path.name}: {loaded.model.describe()}", markup=False)
    return 0


def run_calibrate(args: argparse.Namespace, err: Console) -> int:
    from specfork.bench.prompts import builtin_prompts, load_prompts, select_prompts
    from specfork.cli import model_options, spec_from_args
    from specfork.engine import Generator
    from specfork.loading.loader import load_model
    from specfork.tools.calibrate import calibrate

    if args.limit is not None and args.limit < 1:
        raise ConfigError(f"--limit must be >= 1, got {args.limit}")
    spec = spec_from_args(args, expected_length=args.max_new_tokens)
    prompts = load_prompts(args.prompts) if args.prompts else builtin_prompts()
    texts = [p.text for p in select_prompts(prompts, limit=args.limit)]
    with err.status(f"loading {escape(args.model)}…", spinner="dots"):
        loaded = load_model(args.model, **model_options(args))
    generator = Generator(loaded)
    with err.status("", spinner="dots") as status:
        result = calibrate(
            generator, texts, spec, k=args.fixed_k, max_new_tokens=args.max_new_tokens,
            progress=lambda i: status.update(f"calibrating: prompt {i}/{len(texts)}"),
        )  # fmt: skip
    if args.json:
        print(json.dumps(_as_dict(result), indent=2))
        return 0
    _print_calibration(result, spec.drafter)
    return 0


def _as_dict(result: Any) -> dict:
    from dataclasses import asdict

    return {**asdict(result), "flags": result.flags()}


def _print_calibration(result: Any, drafter: str) -> None:
    out = Console()
    table = Table(title=f"accepted draft tokens per round (K = {result.k}, drafter {drafter})")
    table.add_column("accepted")
    table.add_column("rounds", justify="right")
    table.add_column("share", justify="right")
    for j, n in enumerate(result.accepted_counts):
        table.add_row(str(j), str(n), f"{n / result.rounds:.1%}")
    out.print(table)
    acc, conf = result.acceptance_percentiles, result.confidence_percentiles
    out.print(
        f"{result.prompts} prompts, {result.rounds} drafting rounds | acceptance p25/p50/p75: "
        f"{acc['p25']:.2f}/{acc['p50']:.2f}/{acc['p75']:.2f} | confidence C p25/p50/p75: "
        f"{conf['p25']:.2f}/{conf['p50']:.2f}/{conf['p75']:.2f}",
        highlight=False,
    )
    how = (
        "median C before first-token rejections / before fully accepted rounds"
        if result.method == "outcomes"
        else "25th/75th percentiles of C (too few failures or full accepts to use outcomes)"
    )
    out.print(f"suggested ({how}):", highlight=False)
    out.print(f"  --strategy dspark --drafter {drafter} {result.flags()}", highlight=False)


def run_trace_plot(args: argparse.Namespace, err: Console) -> int:
    from specfork.tools.traceplot import plot_k_trace

    records = read_trace(args.trace)
    missing = [key for key in ("k", "confidence") if key not in records[0]]
    if missing:
        raise ConfigError(
            f"{args.trace} has no {' or '.join(missing)} fields: plot a trace written with "
            "--strategy dspark"
        )
    out = args.out or args.trace.with_suffix(".png")
    plot_k_trace({args.trace.stem: records}, out, title=f"DSpark trace: {args.trace.name}")
    err.print(f"wrote {out}", highlight=False, markup=False)
    return 0


def read_trace(path: Path) -> list[dict]:
    """The records of a --trace JSONL file (errors name the line)."""
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise SpecforkError(f"cannot read the trace file {path}: {exc}") from exc
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as exc:
            raise SpecforkError(f"{path}:{number}: not a JSON line ({exc})") from exc
        if not isinstance(record, dict):
            raise SpecforkError(f"{path}:{number}: expected a JSON object per line")
        records.append(record)
    if not records:
        raise SpecforkError(f"the trace file {path} is empty")
    return records
