"""What several commands share: model, sampling and strategy flags, and their conversions.

The strategy flags are generated from `specfork.spec_schema` (one schema with the bench's
spec strings and the server's `speculative` objects); every one defaults to None, so that a
flag the user gave is told apart from a default.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specfork.catalog.kinds import STRATEGY_KINDS
from specfork.config import STRATEGIES, SamplingParams, SpecConfig
from specfork.constraint import Constraint
from specfork.errors import ConfigError, SpecforkError
from specfork.loading.registry import DEFAULT_MODEL
from specfork.spec_schema import (
    SPEC_OPTIONS,
    SpecOption,
    Wording,
    check_used,
    implied_strategy,
)
from specfork.threads import AUTO, parse_threads

if TYPE_CHECKING:
    from specfork.drafters.suffix_index import SuffixIndex

EXIT_USER_ERROR = 2
GROUPS = {
    "drafting": "decoding strategy",
    "speculative": "fixed draft-length schedules (--strategy speculative)",
    "dspark": "DSpark (--strategy dspark)",
    "spork": "SPORK (--strategy spork)",
}


def add_model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        "-m",
        default=DEFAULT_MODEL,
        help=f"packaged model name ({DEFAULT_MODEL}), .gguf file, checkpoint folder, or "
        f"Hugging Face Hub id org/name[@revision][:QUANT] (a local path wins)",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "float32", "bfloat16", "float16", "gguf"),
        help="precision: gguf = a GGUF file's own quantized weights; auto = fastest",
    )
    p.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    p.add_argument(
        "--kernels",
        default="auto",
        choices=("auto", "on", "off"),
        help="specfork's compiled CPU kernels (batch-invariant, fast): auto = where "
        "they help, on = required, off = eager PyTorch",
    )
    p.add_argument(
        "--threads",
        default=AUTO,
        metavar="N|auto",
        help="threads that compute: auto (default) = the usable cores (affinity, physical "
        "cores, a container's CPU quota), fewer while other jobs keep them busy; N = exactly N",
    )
    p.add_argument(
        "--exact",
        action="store_true",
        help="guarantee output bitwise equal to plain decoding: fail unless the steps "
        "are batch-invariant (the kernels)",
    )


def model_options(args: argparse.Namespace) -> dict[str, Any]:
    """load_model keyword arguments from the model flags (--exact requires the kernels)."""
    kernels = getattr(args, "kernels", "auto")
    if getattr(args, "exact", False):
        if kernels == "off":
            raise ConfigError("--exact needs the kernels' batch-invariant steps, not --kernels off")
        kernels = "on"
    wanted = {"auto": None, "on": True, "off": False}[kernels]
    threads = getattr(args, "threads", AUTO)
    parse_threads(threads)  # a bad value fails before anything loads
    from specfork.loading.loader import resolve_device

    resolve_device(args.device)  # so does a device that is not here
    return {"dtype": args.dtype, "device": args.device, "kernels": wanted, "threads": threads}


def add_suffix_flags(p: argparse.ArgumentParser) -> None:
    """--suffix-persist (generate, serve; never the bench, whose runs must not learn from
    earlier processes)."""
    p.add_argument(
        "--suffix-persist",
        action="store_true",
        help="keep the suffix drafter's index (every request's prompt and output) between "
        "runs: start from the one kept for this model in the cache folder (suffix/), save it "
        "there at the end",
    )


@contextmanager
def kept_suffix_index(args: argparse.Namespace, index: SuffixIndex, source: Path) -> Iterator[None]:
    """With --suffix-persist: `index` starts from the file kept for the model at `source`,
    and is saved there when the block ends (however it ends); without it, nothing."""
    if not args.suffix_persist:
        yield
        return
    from specfork.drafters.suffix_file import index_file, load_index, save_index
    from specfork.host import cache_dir

    path = index_file(cache_dir() / "suffix", source)
    load_index(index, path)
    try:
        yield
    finally:
        save_index(index, path)


def add_sampling_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--temperature", "-t", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1]")
    g.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p * max p")
    g.add_argument("--seed", type=int, default=None, help="seed that reproduces a sampled run")
    g.add_argument(
        "--presence-penalty",
        type=float,
        default=0.0,
        help="in [-2, 2]: subtract it from the logit of every token the output already holds",
    )
    g.add_argument(
        "--frequency-penalty",
        type=float,
        default=0.0,
        help="in [-2, 2]: subtract it times the count of each token in the output so far",
    )
    g.add_argument(
        "--logit-bias",
        action="append",
        default=[],
        metavar="ID=BIAS",
        help="add BIAS in [-100, 100] to token ID's logit (repeatable; -100 bans the token)",
    )


def sampling_from_args(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        seed=args.seed,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        logit_bias=tuple(_logit_bias(text) for text in args.logit_bias),
    )


def _logit_bias(text: str) -> tuple[int, float]:
    """`--logit-bias ID=BIAS` as (id, bias)."""
    token, sep, bias = text.partition("=")
    try:
        if not sep:
            raise ValueError(text)
        return int(token), float(bias)
    except ValueError:
        raise ConfigError(
            f"--logit-bias takes TOKEN_ID=BIAS (e.g. 42=-100), got {text!r}"
        ) from None


def add_spec_flags(p: argparse.ArgumentParser) -> None:
    """--strategy and one flag per CLI option of the schema, grouped by the strategy reading it."""
    groups = {owner: p.add_argument_group(title) for owner, title in GROUPS.items()}
    groups["drafting"].add_argument(
        "--strategy",
        default=None,
        choices=STRATEGIES,
        help="; ".join(f"{s.name} = {s.help}" for s in STRATEGY_KINDS)
        + " (a drafter or strategy flag without --strategy implies the strategy it belongs to)",
    )
    for opt in SPEC_OPTIONS:
        if opt.cli:
            _add_option(groups[opt.owner], opt)


def _add_option(group: argparse._ArgumentGroup, opt: SpecOption) -> None:
    default = opt.default
    shown = "" if opt.name == "drafter" or default in (None, False) else f" (default {default})"
    if opt.kind is bool:
        group.add_argument(
            opt.flag,
            dest=opt.name,
            action=argparse.BooleanOptionalAction,
            default=None,
            help=opt.help + shown,
        )
        return
    if opt.kind == "floats":
        shown = f" (default {','.join(str(x) for x in default)})"
    group.add_argument(
        opt.flag,
        dest=opt.name,
        type=_converter(opt),
        default=None,
        choices=opt.choices,
        metavar=opt.metavar,
        help=opt.help + shown,
    )


def _converter(opt: SpecOption) -> Any:
    def convert(text: str) -> Any:
        try:
            return opt.from_text(text)
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from exc

    convert.__name__ = opt.name  # argparse names the type in its message
    return convert


def given_options(args: argparse.Namespace) -> list[str]:
    """The strategy options the user gave on the command line."""
    return [o.name for o in SPEC_OPTIONS if o.cli and getattr(args, o.name, None) is not None]


def resolve_strategy(args: argparse.Namespace) -> None:
    """Make the strategy flags mean what they say: drafter or strategy flags without
    --strategy turn speculation on (the strategy the flags belong to), and a flag the chosen
    strategy does not read is an error naming the strategy that reads it."""
    given = given_options(args)
    fixed = getattr(args, "only_strategy", None)  # (strategy, why) of a command that runs one
    if fixed is not None:
        strategy, why = fixed
        if args.strategy not in (None, strategy):
            raise ConfigError(
                f"{why}, so it runs --strategy {strategy}; leave out --strategy {args.strategy}"
            )
        args.strategy = strategy
    elif args.strategy is None:
        args.strategy = implied_strategy(given, FLAGS) or "ar"
    check_used(args.strategy, given, FLAGS)


def _spell(opt: SpecOption) -> str:
    if opt.kind is bool and opt.default is True:
        return f"--no-{opt.flag[2:]}"
    return opt.flag


FLAGS = Wording("flag", _spell, lambda name: f"--strategy {name}", "this run")


def spec_from_args(args: argparse.Namespace, expected_length: int) -> SpecConfig:
    """The SpecConfig the strategy flags describe (validated)."""
    values = {name: getattr(args, name) for name in given_options(args)}
    strategy = args.strategy or "ar"
    return SpecConfig(strategy=strategy, expected_length=expected_length, **values)


def unescape(text: str, what: str) -> str:
    """Decode backslash escapes (\\n, \\t, \\\\, \\uXXXX, ...) the way Python strings do."""
    try:
        return text.encode("latin-1", "backslashreplace").decode("unicode_escape")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{what} {text!r} has a broken escape sequence ({exc.reason})") from exc


def check_writable(path: Path | None, what: str) -> None:
    """Fail before any work when an output file cannot be written."""
    if path is None:
        return
    try:
        with open(path, "a"):
            pass
    except OSError as exc:
        raise SpecforkError(f"cannot write the {what} {path}: {exc.strerror or exc}") from exc


def read_prompt(arg: str | None) -> str:
    """The prompt argument, or stdin without the one trailing newline `echo` adds."""
    if arg is not None and arg != "-":
        return arg
    if sys.stdin is None or sys.stdin.isatty():
        raise SpecforkError(
            "no prompt given; pass it as an argument or pipe it on stdin (for a conversation: "
            "specfork chat)"
        )
    text = sys.stdin.read()
    return text[:-2] if text.endswith("\r\n") else text.removesuffix("\n")


def read_first_turns(path: Path) -> list[str]:
    """The prompts of a prompt file (bench.prompts: three formats; errors name the line)."""
    from specfork.bench.prompts import load_prompts

    return [p.text for p in load_prompts(path)]


def add_constraint_flags(p: argparse.ArgumentParser) -> None:
    """--json-schema / --json / --regex: what the output must match (one at most)."""
    group = p.add_argument_group("structured output (the whole output must match)")
    one = group.add_mutually_exclusive_group()
    one.add_argument(
        "--json-schema",
        default=None,
        metavar="FILE_OR_JSON",
        help="output JSON that follows this JSON schema (a file, or the schema itself)",
    )
    one.add_argument("--json", action="store_true", help="output any valid JSON object")
    one.add_argument(
        "--regex", default=None, metavar="PATTERN", help="output text matching this regex"
    )


def path_is(path: Path, test: Callable[[Path], bool]) -> bool:
    """`test(path)` (`Path.exists`, `Path.is_dir`, ...); False where the name cannot be a path
    (too long, say): whatever reads or writes it then fails with its own message."""
    try:
        return test(path)
    except OSError:
        return False


def _is_json(text: str) -> bool:
    """Whether `text` is a JSON value (inline JSON that is not an object, e.g. '[1, 2]', goes to
    the schema's own check, which names what a schema must be)."""
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def constraint_from_args(args: argparse.Namespace) -> Constraint | None:
    """The constraint the flags describe (validated: a bad schema or regex fails here)."""
    if args.json:
        return Constraint.json_object()
    if args.regex is not None:
        return Constraint.regex(args.regex)
    if args.json_schema is None:
        return None
    text = args.json_schema.strip()
    if not text.startswith("{") and (path_is(Path(text), Path.exists) or not _is_json(text)):
        path = Path(text)
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            reason = getattr(exc, "strerror", None) or exc
            raise ConfigError(
                f"--json-schema {args.json_schema!r}: cannot read the schema file ({reason}); "
                "give a file holding a JSON schema, or the schema itself ('{...}')"
            ) from None
    return Constraint.json_schema(text)
