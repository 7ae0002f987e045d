"""`specfork bench`: compare decoding strategies side by side on one machine, in one run.

`add_parser(subparsers)` adds the command; `run(args, err_console)` runs it.
User mistakes (an unknown strategy or option, a malformed prompt file, an output folder that
cannot be written) raise ConfigError / PromptError before any model is loaded.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

from specfork.bench.prompt_file import FORMATS_HELP
from specfork.bench.prompts import builtin_prompts, load_prompts, select_prompts
from specfork.bench.quality import NEAR_TIE
from specfork.bench.report import check_output_dir, print_tables, write_all
from specfork.bench.runner import TURNS, BenchSettings, run_benchmark
from specfork.bench.specs import HF_METHODS, ensure_plain, parse_strategies, valid_options
from specfork.bench.workloads import ALL, WORKLOADS, workload_names, workload_prompts
from specfork.cli.common import (
    add_constraint_flags,
    add_model_flags,
    constraint_from_args,
    model_options,
)
from specfork.errors import ConfigError, PromptError

DEFAULT_STRATEGIES = (
    "ar,speculative:ngram?k=4,speculative:ngram?k=4&k_policy=heuristic,hf:ar,hf:prompt-lookup"
)


def _epilog() -> str:
    hf = ", ".join(f"hf:{m}" for m in HF_METHODS)
    return f"""\
strategy specs (--strategies, comma-separated, repeatable; the label of each is the spec):
  strategy[:drafter][?key=value&key=value]
  strategy   ar (plain decoding, the reference; added when missing), speculative, the other
             specfork strategies (dspark, spork, ... where installed), or hf (transformers)
  drafter    ngram, self, head:DIR, model:NAME-or-PATH, or a strategy's own (e.g. recycle+ngram)
  options    any SpecConfig field: {", ".join(valid_options())}
             (values converted to the field's type; tuples as comma lists)
  baselines  {hf} (need transformers; skipped with a note without it);
             hf:prompt-lookup?k=N&max_ngram=N, hf:assisted?draft=NAME-or-PATH&k=N;
             llamacpp:ar, llamacpp:lookup?k=N&max_ngram=N (need llama-cpp-python);
             openai:URL[#model]: a running OpenAI-compatible server (vLLM, SGLang,
             llama-server, specfork serve) streamed through its API, e.g.
             openai:http://127.0.0.1:8000/v1#Qwen/Qwen3-0.6B (default: its first model;
             OPENAI_API_KEY is sent when set); text match only, information only

examples:
  specfork bench --strategies ar,speculative:ngram,speculative:self?skip_layers=10-19
  specfork bench --prompts specbench.jsonl --per-category 2 --repeats 3 --out bench-out \\
      --strategies 'ar,speculative:ngram?k=4&k_policy=heuristic,hf:prompt-lookup?k=10'
  specfork bench --prompts specbench.jsonl --turns all --strategies ar,dspark:ngram
  specfork bench --workload all --per-category 4 -n 128 \\
      --strategies 'ar,speculative:ngram?k=4,dspark:ngram,spork:recycle+ngram'

outputs in --out: results.json.gz (gzip JSON: every measurement, the machine, the command),
report.md, speedup.png, acceptance_by_position.png (and dspark_trace.png / fork_wins.png when the
strategies record K/confidence or forks). Exit status 1 when a strategy or run failed.
"""


def add_parser(subparsers: Any) -> None:
    """Add the `bench` command to an argparse subparsers object."""
    p = subparsers.add_parser(
        "bench",
        help="compare decoding strategies side by side (speed, acceptance, greedy match)",
        description=(
            "Run decoding strategies prompt by prompt, interleaved, after a warm-up; report "
            "medians per category and overall: decode tokens/s, speedup over plain decoding in "
            "the same run, tokens per target forward, acceptance, time to first token, target "
            "forwards and wasted drafts per output token, greedy match, peak memory."
        ),
        epilog=_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_flags(p)
    source = p.add_mutually_exclusive_group()
    source.add_argument(
        "--prompts",
        type=Path,
        default=None,
        help=f"prompt file ({FORMATS_HELP}); default: 12 built-in prompts",
    )
    source.add_argument(
        "--workload",
        choices=(*WORKLOADS, ALL),
        default=None,
        help="a workload shipped with specfork instead of a prompt file: multi-turn chats, "
        "agent tool calls, code edits, RAG over long documents, or all of them (each its own "
        "category); every turn runs unless --turns first",
    )
    p.add_argument(
        "--turns",
        choices=TURNS,
        default=None,
        help="first: each prompt's first turn (the default for --prompts); all: every turn of "
        "a conversation (the default for --workload), each later turn after the model's own "
        "earlier answers (plain decoding's, ar's: under greedy decoding every lossless "
        "strategy's), the same context for every strategy; figures per turn and for the "
        "later turns together",
    )
    p.add_argument("--per-category", type=int, default=None, help="first N prompts per category")
    p.add_argument("--limit", type=int, default=None, help="at most N prompts in all")
    p.add_argument(
        "--strategies",
        "-s",
        action="append",
        default=None,
        help=f"comma-separated strategy specs (default: {DEFAULT_STRATEGIES})",
    )
    p.add_argument("--max-new-tokens", "-n", type=int, default=128)
    p.add_argument("--ignore-eos", action="store_true", help="always decode --max-new-tokens")
    p.add_argument("--temperature", "-t", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--seed", type=int, default=None, help="seed for sampled runs")
    p.add_argument("--repeats", type=int, default=3, help="runs of each strategy per prompt")
    p.add_argument("--warmup", type=int, default=1, help="warm-up runs of each strategy")
    p.add_argument(
        "--near-tie",
        type=float,
        default=NEAR_TIE,
        help="top-2 logit gap under which a greedy difference is a rounding near-tie",
    )
    add_constraint_flags(p)
    p.add_argument(
        "--prompt-suffix",
        default="",
        metavar="TEXT",
        help="append TEXT to every prompt (e.g. ' Answer with a JSON object.' with --json)",
    )
    p.add_argument("--out", "-o", type=Path, default=Path("bench-out"), help="output folder")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    p.set_defaults(run=run)


def settings_from_args(args: argparse.Namespace) -> BenchSettings:
    """Validated settings (every user mistake is raised here, before loading anything)."""
    specs = parse_strategies(args.strategies or [DEFAULT_STRATEGIES])
    specs, added = ensure_plain(specs)
    notes = ["`ar` (plain decoding) was added: speedups and matches are against it"] * added
    for name in ("per_category", "limit"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.workload is not None:
        names = ", ".join(workload_names(args.workload))
        prompts, source = workload_prompts(args.workload), f"specfork's workloads ({names})"
    elif args.prompts is None:
        prompts, source = builtin_prompts(), "the built-in set"
    else:
        prompts, source = load_prompts(args.prompts), str(args.prompts)
    turns = args.turns or ("all" if args.workload is not None else "first")
    picked = select_prompts(prompts, args.per_category, args.limit)
    if not picked:
        raise PromptError(f"no prompts selected from {source}")
    options = model_options(args)
    return BenchSettings(
        strategies=specs,
        prompts=picked,
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        kernels=options["kernels"],
        threads=options["threads"],
        exact=args.exact,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
        repeats=args.repeats,
        warmup=args.warmup,
        near_tie=args.near_tie,
        constraint=constraint_from_args(args),
        prompt_suffix=args.prompt_suffix,
        prompts_source=source,
        notes=notes,
        turns=turns,
    )


def run(args: argparse.Namespace, err_console: Console) -> int:
    """Run `specfork bench`; returns the exit status (1 when a strategy or a run failed)."""
    settings = settings_from_args(args)
    out = check_output_dir(args.out)
    for note in settings.notes:
        err_console.print(f"note: {escape(note)}")
    results = run_benchmark(settings, console=err_console, show_progress=not args.quiet)
    doc = results.to_dict()
    written = write_all(doc, out, plots=not args.no_plots)
    print_tables({**doc, "notes": []}, Console())
    for note in [n for n in doc["notes"] if n not in settings.notes]:
        err_console.print(f"note: {escape(note)}", soft_wrap=True)
    files = [written["results"], written["report"], *written["plots"]]
    err_console.print("wrote " + ", ".join(escape(str(f)) for f in files), soft_wrap=True)
    failed = any(s.status == "failed" for s in results.strategies) or any(
        not m.ok for m in results.measurements
    )
    return 1 if failed else 0
