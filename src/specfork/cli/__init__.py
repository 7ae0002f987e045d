"""The `specfork` command: parses flags, builds configs, calls the library.

Each command is a module with `add_parser(subparsers)`, which sets its `run(args, err)` as the
parser's default; `main` parses and dispatches. Generated text, and only that, goes to stdout;
progress, stats and errors go to stderr. A user mistake prints one line naming the problem and
exits with status 2 (never a traceback).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from rich.console import Console
from rich.markup import escape

from specfork import __version__
from specfork.cli import bench, chat, export, generate, serve, tools, train_head
from specfork.cli.common import EXIT_USER_ERROR, resolve_strategy
from specfork.cli.step_display import show_long_steps
from specfork.errors import SpecforkError

COMMANDS = (generate, chat, tools, train_head, export, bench, serve)


class DefaultsHelp(argparse.HelpFormatter):
    """Help that shows each option's default, unless it is off (None, False, empty) or the
    help text already says it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if not action.option_strings or default in (None, False, argparse.SUPPRESS, "", []):
            return action.help
        if "default" in text or f"({default})" in text or "%(default)" in text:
            return action.help
        return f"{text} (default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specfork", description="Lossless speculative decoding for LLMs in PyTorch."
    )
    parser.add_argument("--version", action="version", version=f"specfork {__version__}")
    parser.add_argument("--verbose", "-v", action="store_true", help="log what happens")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(sub)
    for command_parser in sub.choices.values():  # `specfork generate -v` and `specfork -v ...`
        command_parser.formatter_class = DefaultsHelp
        command_parser.add_argument(
            "--verbose",
            "-v",
            action="store_true",
            default=argparse.SUPPRESS,
            help="log what happens",
        )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    err = Console(stderr=True, highlight=False)
    if err.is_terminal and not getattr(args, "quiet", False):
        show_long_steps(err)
    try:
        if hasattr(args, "strategy"):
            resolve_strategy(args)
        return args.run(args, err)
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
