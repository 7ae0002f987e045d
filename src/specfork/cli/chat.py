"""`specfork chat`: an interactive multi-turn chat (stdout: the replies; stderr: the rest).

Each line typed is a user message (a line ending in a backslash continues on the next); the
reply streams as it is decoded, with any strategy. Lines starting with "/" are commands
(`/help`). From a pipe or a file, every line is a turn and nothing but the replies goes to
stdout, so `specfork chat < questions.txt` writes a transcript.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, TextIO

from rich.console import Console
from rich.markup import escape

from specfork.cli.common import (
    add_model_flags,
    add_sampling_flags,
    add_spec_flags,
    model_options,
    sampling_from_args,
    spec_from_args,
)
from specfork.config import GenerationConfig
from specfork.engine.chat import ChatSession
from specfork.errors import PromptError, SpecforkError
from specfork.strategies.policies import make_policy

HELP = """commands:
  /reset          forget the conversation (the system message stays)
  /system TEXT    a new system message, and a new conversation
  /stats          per-turn speed and speculation figures on or off
  /history        the conversation so far
  /help           this list
  /exit, /quit    leave (so does Ctrl-D); Ctrl-C stops a reply"""


@dataclass
class _Options:
    """What the commands can change during a chat."""

    stats: bool


def add_parser(sub: Any) -> None:
    chat = sub.add_parser("chat", help="an interactive multi-turn chat (any strategy)")
    add_model_flags(chat)
    chat.add_argument("--system", default=None, help="the system message")
    chat.add_argument("--max-new-tokens", "-n", type=int, default=512, help="per reply (512)")
    chat.add_argument(
        "--stats", action="store_true", help="print each turn's speed and speculation figures"
    )
    chat.add_argument("--quiet", "-q", action="store_true", help="no banner or loading status")
    add_sampling_flags(chat)
    add_spec_flags(chat)
    chat.set_defaults(run=run)


def run(args: argparse.Namespace, err: Console) -> int:
    from specfork.engine.generator import Generator
    from specfork.loading.loader import load_model

    sampling = sampling_from_args(args)
    config = GenerationConfig(max_new_tokens=args.max_new_tokens)
    spec = spec_from_args(args, expected_length=args.max_new_tokens)
    make_policy(spec.k_policy, spec.k, spec.expected_length)  # validate before loading
    if args.system is not None and not args.system.strip():
        raise SpecforkError("--system is empty; give the system message's text or drop it")
    status = err.status(f"loading {escape(args.model)}…", spinner="dots")
    with status if not args.quiet else nullcontext():
        loaded = load_model(args.model, progress=not args.quiet, **model_options(args))
    session = ChatSession(
        Generator(loaded, spec=spec), system=args.system, config=config, sampling=sampling
    )
    interactive = sys.stdin.isatty()
    if interactive and not args.quiet:
        strategy = spec.strategy + (f" {spec.drafter}" if spec.drafts else "")
        err.print(f"{loaded.label} ({loaded.model.describe()}), {strategy}", style="dim")
        err.print("type a message; /help for commands, /exit or Ctrl-D to leave", style="dim")
    options = _Options(stats=args.stats)
    for line in _messages(sys.stdin, interactive):
        if line.startswith("/"):
            if not _command(line, session, options, err):
                break
            continue
        _turn(session, line, options, err)
    return 0


def _messages(stream: TextIO, interactive: bool) -> Iterator[str]:
    """The user's messages: lines, a trailing backslash joining a line to the next; blank
    lines skipped. On a terminal, with a prompt and line editing (`input`)."""
    parts: list[str] = []
    while (line := _read_line(stream, interactive, bool(parts))) is not None:
        if line.endswith("\\"):
            parts.append(line[:-1])
            continue
        text = "\n".join([*parts, line]).strip()
        parts = []
        if text:
            yield text
    if text := "\n".join(parts).strip():
        yield text


def _read_line(stream: TextIO, interactive: bool, continued: bool) -> str | None:
    """The next line (None at the end of the input). On a terminal Ctrl-C drops the line
    being typed, as in a shell."""
    if not interactive:
        line = stream.readline()
        return None if line == "" else line.rstrip("\n")
    try:
        return input("… " if continued else "> ")
    except EOFError:
        return None
    except KeyboardInterrupt:
        sys.stdout.write("\n")
        return ""


def _turn(session: ChatSession, text: str, options: _Options, err: Console) -> None:
    """One exchange: the reply streamed to stdout; Ctrl-C stops it (and drops the turn)."""
    try:
        stream = session.send(text)
    except PromptError as exc:
        err.print(f"specfork: {escape(str(exc))}", style="red")
        return
    try:
        for delta in stream:
            sys.stdout.write(delta)
            sys.stdout.flush()
    except KeyboardInterrupt:
        sys.stdout.write("\n")
        err.print("(reply stopped; this turn is not kept)", style="dim")
        return
    sys.stdout.write("\n")
    sys.stdout.flush()
    result = stream.result
    if options.stats and result is not None:
        summary = f"{result.stats.summary()} | finish: {result.finish_reason}"
        cached = result.stats.cached_prompt_tokens
        err.print(
            f"{summary} | prompt tokens reused: {cached}", style="dim", markup=False, soft_wrap=True
        )


def _command(line: str, session: ChatSession, options: _Options, err: Console) -> bool:
    """Run a /command; False when it ends the chat."""
    name, _, rest = line.partition(" ")
    rest = rest.strip()
    if name in ("/exit", "/quit"):
        return False
    if name == "/reset":
        session.reset()
        err.print("(a new conversation)", style="dim")
    elif name == "/system":
        if not rest:
            err.print("specfork: /system needs the message's text: /system TEXT", style="red")
            return True
        session.system = rest
        session.reset()
        err.print("(a new conversation with this system message)", style="dim")
    elif name == "/stats":
        options.stats = not options.stats
        err.print(f"(per-turn figures {'on' if options.stats else 'off'})", style="dim")
    elif name == "/history":
        for message in session.messages():
            err.print(f"[bold]{message['role']}:[/] {escape(message['content'])}")
    elif name == "/help":
        err.print(HELP, markup=False, highlight=False)
    else:
        err.print(f"specfork: unknown command {escape(name)}; /help lists them", style="red")
    return True
