"""`specfork generate`: text from a prompt (stdout: the text only; stderr: progress, stats)."""

from __future__ import annotations

import argparse
import functools
import json
import sys
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from specfork.bench.prompt_file import FORMATS_HELP
from specfork.cli.batch_file import read_batch, run_batch
from specfork.cli.common import (
    add_constraint_flags,
    add_model_flags,
    add_sampling_flags,
    add_spec_flags,
    add_suffix_flags,
    check_writable,
    constraint_from_args,
    kept_suffix_index,
    model_options,
    read_prompt,
    sampling_from_args,
    spec_from_args,
    unescape,
)
from specfork.config import GenerationConfig
from specfork.engine.stats import GenerationStats
from specfork.errors import SpecforkError
from specfork.strategies.policies import make_policy

#: prompts of a --batch file decoded together unless --max-running says otherwise
MAX_RUNNING = 8

if TYPE_CHECKING:
    from specfork.config import SamplingParams
    from specfork.engine.generator import Generator
    from specfork.engine.lifecycle import GenerationResult
    from specfork.engine.logprobs import TokenLogprob
    from specfork.loading.facts import ModelFacts
    from specfork.loading.loader import LoadedModel
    from specfork.loading.tokenizer import Tokenizer


def add_parser(sub: Any) -> None:
    gen = sub.add_parser("generate", help="generate text from a prompt (stdout: the text only)")
    gen.add_argument("prompt", nargs="?", help="the prompt; read from stdin when omitted or '-'")
    add_model_flags(gen)
    add_suffix_flags(gen)
    gen.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="apply the chat template (default: on when the model has one)",
    )
    gen.add_argument("--system", default=None, help="system message (chat mode)")
    gen.add_argument(
        "--max-new-tokens", "-n", type=int, default=256, help="tokens to generate at most"
    )
    gen.add_argument(
        "--stop",
        action="append",
        default=[],
        help="stop string (repeatable); escapes such as \\n and \\t are decoded",
    )
    gen.add_argument(
        "--escape",
        "-e",
        action="store_true",
        help="decode escapes (\\n, \\t, \\uXXXX) in the prompt and --system too",
    )
    gen.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-sequence")
    gen.add_argument(
        "--max-seconds",
        type=float,
        default=None,
        metavar="S",
        help="stop decoding after S seconds (finish reason: time)",
    )
    gen.add_argument("--quiet", "-q", action="store_true", help="no progress or stats on stderr")
    b = gen.add_argument_group("many prompts (continuous batching)")
    b.add_argument(
        "--batch",
        type=Path,
        default=None,
        metavar="FILE",
        help=f"prompt file ({FORMATS_HELP}; a conversation's first turn); results as JSON "
        "lines, in file order",
    )
    b.add_argument(
        "--max-running",
        type=int,
        default=None,
        metavar="N",
        help=f"prompts decoded together ({MAX_RUNNING})",
    )
    b.add_argument(
        "--step-rows",
        type=int,
        default=None,
        metavar="N",
        help="rows one forward may hold (default max(128, --max-running))",
    )
    b.add_argument("--output", "-o", type=Path, default=None, help="--batch results file")
    add_sampling_flags(gen)
    add_constraint_flags(gen)
    add_spec_flags(gen)
    g = gen.add_argument_group("reports")
    g.add_argument("--stats", action="store_true", help="print all request stats to stderr")
    g.add_argument(
        "--logprobs",
        type=int,
        default=None,
        metavar="N",
        help="print each output token's log-probability and the N most likely tokens (stderr)",
    )
    g.add_argument(
        "--trace",
        type=Path,
        default=None,
        help="write one JSON line per decoding round to this file",
    )
    gen.set_defaults(run=run)


def run(args: argparse.Namespace, err: Console) -> int:
    from specfork.engine.generator import Generator
    from specfork.engine.preflight import open_model

    sampling = sampling_from_args(args)
    stops = tuple(unescape(s, "the stop string") for s in args.stop)
    config = GenerationConfig(
        max_new_tokens=args.max_new_tokens,
        stop=stops,
        ignore_eos=args.ignore_eos,
        exact=args.exact,
        max_seconds=args.max_seconds,
        logprobs=args.logprobs,
        constraint=constraint_from_args(args),
    )
    spec = spec_from_args(args, expected_length=args.max_new_tokens)
    make_policy(spec.k_policy, spec.k, spec.expected_length)  # validate before loading
    if args.system is not None and args.chat is False:
        raise SpecforkError("--system is a chat message; drop --no-chat or drop --system")
    if args.batch is not None:
        _check_batch_flags(args)
    else:
        _check_single_flags(args)
        prompt = _prompt(args)
        check_writable(args.trace, "trace file")
    status = err.status(f"loading {escape(args.model)}…", spinner="dots")
    options = model_options(args)
    with status if not args.quiet else nullcontext():
        loaded = open_model(
            args.model,
            spec,
            check=functools.partial(_check_chat, args),
            progress=not args.quiet,
            **options,
        )
    generator = Generator(loaded, spec=spec)
    with kept_suffix_index(args, generator.stores.suffix, loaded.path):
        if args.batch is not None:
            return run_batch(args, loaded, generator, config, sampling, err)
        return _generate_one(args, loaded, generator, prompt, config, sampling, err)


def _generate_one(
    args: argparse.Namespace,
    loaded: LoadedModel,
    generator: Generator,
    prompt: str,
    config: GenerationConfig,
    sampling: SamplingParams,
    err: Console,
) -> int:
    """One prompt, streamed to stdout; the summary and statistics to stderr."""
    chat = args.chat if args.chat is not None else loaded.tokenizer.chat_template is not None
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
    if stream.result is not None:
        if not args.quiet:
            model = f"{loaded.label} ({loaded.model.describe()})"
            summary = f"{stream.result.stats.summary()} | finish: {stream.result.finish_reason}"
            err.print(f"{model} | {summary}", style="dim", markup=False, highlight=False)
            _warn_shared_cores(stream.result.stats, err)
        _warn_cut_structure(args, config, stream.result, err)
        _report(args, stream.result.stats, err)
        if stream.result.logprobs is not None:
            _logprob_table(stream.result.logprobs, loaded.tokenizer, err)
    return 0


def _warn_shared_cores(stats: GenerationStats, err: Console) -> None:
    """One line when other jobs kept the cores busy during the run."""
    warning = stats.threads.warning() if stats.threads is not None else None
    if warning is not None:
        err.print(f"warning: {warning}", style="yellow", markup=False, highlight=False)


def _warn_cut_structure(
    args: argparse.Namespace, config: GenerationConfig, result: GenerationResult, err: Console
) -> None:
    """One line when structured output stopped before its structure was complete (even with
    --quiet: the output is not what the flag promised)."""
    constraint, reason = config.constraint, result.finish_reason
    if constraint is None or reason not in ("length", "time") or constraint.matches(result.text):
        return
    limit = (
        f"-n {args.max_new_tokens}" if reason == "length" else f"--max-seconds {args.max_seconds}"
    )
    err.print(
        f"warning: the output stopped at {limit} before its {constraint.describe()} structure "
        "was complete, so it is not valid; give a larger limit",
        soft_wrap=True,
        style="yellow",
        markup=False,
        highlight=False,
    )


def _check_chat(args: argparse.Namespace, model: ModelFacts) -> None:
    """--chat and --system need a chat template (checked before the model loads)."""
    if model.has_chat_template or args.batch is not None:
        return
    if args.chat:
        raise SpecforkError(
            f"{model.path.name} has no chat template (a base model continues text); drop "
            "--chat, or give --no-chat"
        )
    if args.system:
        raise SpecforkError(
            f"--system needs chat mode, and {model.path.name} has no chat template; drop "
            "--system and give the prompt as text to continue (--no-chat)"
        )


def _check_single_flags(args: argparse.Namespace) -> None:
    """A flag of --batch is refused without it rather than ignored."""
    for flag, value in (
        ("--output/-o", args.output),
        ("--max-running", args.max_running),
        ("--step-rows", args.step_rows),
    ):
        if value is not None:
            raise SpecforkError(f"{flag} is a flag of --batch; give --batch FILE")


def _check_batch_flags(args: argparse.Namespace) -> None:
    """--batch takes its prompts from the file, and reports as JSON lines."""
    from specfork.engine.batch import BatchConfig

    if args.prompt is not None:
        raise SpecforkError("give either a prompt or --batch FILE, not both")
    for flag, value in (("--trace", args.trace), ("--logprobs", args.logprobs)):
        if value is not None:
            raise SpecforkError(f"{flag} reports one request; run it without --batch")
    if args.max_running is None:
        args.max_running = MAX_RUNNING
    BatchConfig.rows_for(args.max_running, args.step_rows)
    read_batch(args.batch)  # a bad file fails before the model loads
    if args.output is not None and _same_file(args.output, args.batch):
        raise SpecforkError(
            f"--output {args.output} is the --batch file: the results would replace the "
            "prompts; write them to another file"
        )
    check_writable(args.output, "output file")


def _same_file(a: Path, b: Path) -> bool:
    """Whether two paths name one file (links and relative spellings included)."""
    try:
        return a.exists() and b.exists() and a.samefile(b)
    except OSError:
        return False


def _prompt(args: argparse.Namespace) -> str:
    """The prompt (and --system) as given, escapes decoded with -e; never empty."""
    prompt = read_prompt(args.prompt)
    if args.escape:
        prompt = unescape(prompt, "the prompt")
        args.system = None if args.system is None else unescape(args.system, "--system")
    if not prompt.strip():
        raise SpecforkError("the prompt is empty; give some text to continue")
    return prompt


def _report(args: argparse.Namespace, stats: GenerationStats, err: Console) -> None:
    """--stats: every figure of the request; --trace FILE: one JSON line per round."""
    if args.stats:
        for key, value in stats.to_dict().items():
            shown = f"{value:.4g}" if isinstance(value, float) else value
            if isinstance(value, dict) and all(isinstance(v, float) for v in value.values()):
                shown = ", ".join(f"{k} {v:.3g}" for k, v in value.items())
            err.print(f"  {key}: {shown}", markup=False, highlight=False)
    if args.trace is not None:
        try:
            with open(args.trace, "w") as f:
                for record in stats.rounds:
                    f.write(json.dumps(record.to_dict()) + "\n")
        except OSError as exc:
            raise SpecforkError(f"cannot write the trace file {args.trace}: {exc}") from exc


def _logprob_table(entries: list[TokenLogprob], tokenizer: Tokenizer, err: Console) -> None:
    """--logprobs N: each output token, its log-probability and the N most likely tokens."""
    table = Table(title="log-probabilities (raw: before temperature, top-k, top-p)")
    for column in ("#", "token", "logprob", "most likely"):
        table.add_column(column, justify="right" if column in ("#", "logprob") else "left")

    def shown(token: int) -> str:
        return repr(tokenizer.decode([token]))

    for i, entry in enumerate(entries):
        top = "  ".join(f"{shown(t)} {lp:.3f}" for t, lp in entry.top)
        table.add_row(str(i), shown(entry.token), f"{entry.logprob:.4f}", top)
    err.print(table, markup=False, highlight=False)
