"""`specfork generate --batch FILE`: many prompts through continuous batching, JSON lines out.

FILE is a prompt file as every command reads it (`specfork.bench.prompt_file`): plain text,
JSON strings, `{"prompt": ...}`, Spec-Bench's `{"turns": [...]}` (the first turn is generated)
or `{"messages": [...]}`; settings on a line are refused (they are flags and hold for every
line). Every prompt is checked before anything runs (an error names its line). Results go to
stdout (or `--output`), one JSON object per prompt in file order: index, text, finish_reason,
prompt_tokens, completion_tokens (and every statistic with `--stats`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from specfork.bench.prompt_file import BenchPrompt, Prompt, load_prompts
from specfork.errors import SpecforkError


def read_batch(path: Path) -> list[BenchPrompt]:
    """The prompts of a batch file (see the module doc)."""
    return load_prompts(path)


def later_turns_note(prompts: list[BenchPrompt], path: Path) -> str | None:
    """What generate leaves out of a file with conversations: their later turns."""
    multi = sum(bool(p.later_turns) for p in prompts)
    if not multi:
        return None
    return (
        f"{multi} prompt(s) of {path} are conversations of several turns: generate answers "
        "each one's first turn (`specfork bench --turns all` runs every turn)"
    )


def run_batch(
    args: argparse.Namespace, loaded: Any, generator: Any, config: Any, sampling: Any, err: Console
) -> int:
    """Generate for every prompt of `args.batch` together; JSON lines to stdout or --output."""
    from specfork.engine.batch import BatchConfig, generate_batch

    records = read_batch(args.batch)
    prompts = [r.first_prompt() for r in records]
    note = later_turns_note(records, args.batch)
    if note is not None and not args.quiet:
        err.print(f"note: {note}", style="dim", markup=False, highlight=False)
    chat = args.chat if args.chat is not None else loaded.tokenizer.chat_template is not None
    items = [_as_chat(p, args.system) if chat else _plain(p, i) for i, p in enumerate(prompts)]
    for number, item in enumerate(items, start=1):
        try:
            generator.prompt_ids(item, chat=chat, config=config)
        except SpecforkError as exc:
            raise SpecforkError(f"prompt {number} of {args.batch}: {exc}") from None
    batch = BatchConfig.rows_for(args.max_running, args.step_rows)
    t0, use = time.perf_counter(), loaded.model.thread_use()
    results = generate_batch(
        generator, items, chat=chat, config=config, sampling=sampling, batch=batch
    )
    wall, threads = time.perf_counter() - t0, loaded.model.thread_use().since(use)
    out = _open_output(args.output)
    try:
        for i, result in enumerate(results):
            record = {
                "index": i,
                "text": result.text,
                "finish_reason": result.finish_reason,
                "prompt_tokens": result.stats.prompt_tokens,
                "completion_tokens": len(result.token_ids),
            }
            if args.stats:
                record["stats"] = result.stats.to_dict()
            out.write(json.dumps(record, ensure_ascii=False) + "\n")
    finally:
        if out is not sys.stdout:
            out.close()
    if not args.quiet:
        tokens = sum(len(r.token_ids) for r in results)
        line = (
            f"{loaded.label} ({loaded.model.describe()}) | {len(results)} prompts, {tokens} "
            f"tokens in {wall:.2f} s ({tokens / wall:.1f} tok/s), up to {args.max_running} at once"
            f" | {threads.describe()}"
        )
        err.print(line, style="dim", markup=False, highlight=False)
        if threads.warning() is not None:
            err.print(
                f"warning: {threads.warning()}", style="yellow", markup=False, highlight=False
            )
    return 0


def _as_chat(prompt: Prompt, system: str | None) -> list[dict[str, str]]:
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    if system and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system}, *messages]
    return messages


def _plain(prompt: Prompt, index: int) -> str:
    if not isinstance(prompt, str):
        raise SpecforkError(f"prompt {index + 1} has chat messages; they need chat mode (--chat)")
    return prompt


def _open_output(path: Path | None) -> Any:
    if path is None:
        return sys.stdout
    try:
        return open(path, "w", encoding="utf-8")
    except OSError as exc:
        raise SpecforkError(f"cannot write the output file {path}: {exc}") from exc
