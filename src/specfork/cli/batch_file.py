"""`specfork generate --batch FILE`: many prompts through continuous batching, JSON lines out.

FILE holds one prompt per line as JSON: a string, `{"prompt": "..."}` or `{"messages": [...]}`
(chat messages with the server's roles); empty lines and a leading BOM are skipped; any other
key is refused (settings are flags and hold for every line). Every prompt is checked before
anything runs (an error names its line). Results go to stdout (or `--output`), one JSON object
per prompt in file order: index, text, finish_reason, prompt_tokens, completion_tokens (and every
statistic with `--stats`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from specfork.errors import SpecforkError
from specfork.loading.chat_template import CHAT_ROLES

Prompt = str | list[dict[str, str]]


def read_batch(path: Path) -> list[Prompt]:
    """The prompts of a batch file (see the module doc)."""
    try:
        lines = path.read_text(encoding="utf-8-sig").splitlines()  # a BOM is not JSON
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecforkError(f"cannot read the batch file {path}: {exc}") from exc
    prompts = []
    for number, line in enumerate(lines, start=1):
        if line.strip():
            prompts.append(_prompt(line, f"line {number} of {path}"))
    if not prompts:
        raise SpecforkError(f"the batch file {path} holds no prompts; write one JSON per line")
    return prompts


def _prompt(line: str, where: str) -> Prompt:
    expected = 'a JSON string, {"prompt": "..."} or {"messages": [{"role": ..., "content": ...}]}'
    try:
        item = json.loads(line)
    except json.JSONDecodeError as exc:
        raise SpecforkError(f"{where} is not JSON ({exc.msg}); expected {expected}") from None
    if isinstance(item, dict):
        item = _object_prompt(item, where, expected)
        if isinstance(item, list):
            return item
    if not isinstance(item, str):
        raise SpecforkError(f"{where}: expected {expected}")
    if not item.strip():
        raise SpecforkError(f"{where}: the prompt is empty")
    return item


def _object_prompt(item: dict[str, Any], where: str, expected: str) -> Prompt:
    """The prompt of a line's object: exactly one of "prompt" and "messages", nothing else (a
    setting on a line would be silently ignored: settings are flags and hold for every line)."""
    unknown = sorted(set(item) - {"prompt", "messages"})
    if unknown:
        raise SpecforkError(
            f"{where}: unknown key(s) {', '.join(map(repr, unknown))}; a line holds a prompt or "
            "messages only (settings such as -n or --temperature are flags for the whole file)"
        )
    if "prompt" in item and "messages" in item:
        raise SpecforkError(f'{where}: give "prompt" or "messages", not both')
    if "messages" in item:
        return _messages(item["messages"], where)
    if not isinstance(item.get("prompt"), str):
        raise SpecforkError(f"{where}: expected {expected}")
    return item["prompt"]


def _messages(messages: Any, where: str) -> list[dict[str, str]]:
    """Chat messages checked as the server checks them: known roles, text content."""
    if not isinstance(messages, list) or not messages:
        raise SpecforkError(f"{where}: messages must be a non-empty list of role/content")
    checked = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str):
            raise SpecforkError(f"{where}: messages[{i}] must be an object with role and content")
        extra = sorted(set(m) - {"role", "content"})
        if extra:
            raise SpecforkError(
                f"{where}: messages[{i}] has unknown key(s) {', '.join(map(repr, extra))}; "
                "give role and content only"
            )
        role = m.get("role")
        if not isinstance(role, str) or role not in CHAT_ROLES:
            raise SpecforkError(
                f"{where}: messages[{i}].role {role!r} is not supported; use one of "
                f"{', '.join(CHAT_ROLES)}"
            )
        checked.append({"role": CHAT_ROLES[role], "content": m["content"]})
    if not any(m["content"].strip() for m in checked):
        raise SpecforkError(f"{where}: every message is empty; give some text")
    return checked


def run_batch(
    args: argparse.Namespace, loaded: Any, generator: Any, config: Any, sampling: Any, err: Console
) -> int:
    """Generate for every prompt of `args.batch` together; JSON lines to stdout or --output."""
    from specfork.engine.batch import BatchConfig, generate_batch

    prompts = read_batch(args.batch)
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
