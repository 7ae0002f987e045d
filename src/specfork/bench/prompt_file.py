"""Prompt files: the one reader behind `generate --batch`, `bench`, `calibrate` (and
`scan-self`, `train-head`), so a file one command takes, every command takes.

A file is JSON lines or plain text. ``.jsonl``/``.json`` files are JSON lines, ``.txt`` files
plain text; a file of another name is JSON lines when its first prompt line starts with ``{``
or ``[``, or is a JSON string. Blank lines and a leading byte-order mark are skipped.

- plain text: each line is a prompt (category "text", id = its line number);
- a JSON string: ``"Write a haiku."``;
- ``{"prompt": "..."}``;
- Spec-Bench's ``{"question_id": ..., "category": ..., "turns": ["first", "second", ...]}``:
  the user messages of a conversation (commands that run one turn run the first; ``bench
  --turns all`` runs every turn on the model's own earlier answers);
- ``{"messages": [{"role": ..., "content": ...}, ...]}``: chat messages with the server's roles
  (system, developer, user, assistant), the prompt ending with the last one;
- ``"system": "..."`` beside ``prompt`` or ``turns``: a system message before the first turn.

``category`` and ``question_id`` are optional on every object; other keys (Spec-Bench's
``reference``, a file's own metadata) are kept out of the prompt and ignored — except names of
generation settings (``max_tokens``, ``temperature``, ...), which are refused: settings are
flags and hold for the whole file, and a line's setting would be silently ignored. Every error
is a PromptError that names the file, the line and the fix.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specfork.errors import PromptError
from specfork.loading.chat_template import CHAT_ROLES

Message = dict[str, str]

#: what a generation command takes as one prompt: text, or chat messages
Prompt = str | list[Message]

PROMPT_KEYS = ("prompt", "turns", "messages")

#: keys that set how to generate: a line cannot carry them (they are flags for the whole file)
SETTING_KEYS = frozenset(
    {
        "max_tokens",
        "max_new_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "stop",
        "n",
        "stream",
        "logprobs",
        "top_logprobs",
        "ignore_eos",
        "response_format",
        "speculative",
        "strategy",
        "model",
        "frequency_penalty",
        "presence_penalty",
        "repetition_penalty",
    }
)

#: the formats in a flag's help
FORMATS_HELP = (
    'one prompt a line: plain text (.txt), a JSON string, {"prompt": ...}, Spec-Bench\'s '
    '{"turns": [...]} or {"messages": [...]}'
)

EXPECTED = (
    'a JSON string, {"prompt": "..."}, {"turns": ["...", ...]} or '
    '{"messages": [{"role": ..., "content": ...}]}'
)


@dataclass(frozen=True, slots=True)
class BenchPrompt:
    """One prompt of a file: its id, category, first-turn message and the user messages of any
    later turns. `context` holds the messages before the first turn's (a system prompt, a
    conversation given in the file), `role` the first turn's role (a ``messages`` line may end
    with any), and `chat` says the line gave chat messages (it needs the chat template)."""

    question_id: str | int
    category: str
    text: str
    later_turns: tuple[str, ...] = ()
    context: tuple[Message, ...] = ()
    role: str = "user"
    chat: bool = False

    @property
    def turns(self) -> tuple[str, ...]:
        """Every user message of the conversation, the first turn first."""
        return (self.text, *self.later_turns)

    def first_messages(self, suffix: str = "") -> list[Message]:
        """The first turn as chat messages (`suffix` appended to its message)."""
        return [*map(dict, self.context), {"role": self.role, "content": self.text + suffix}]

    def first_prompt(self) -> Prompt:
        """The first turn as a generation command takes it: the text, or chat messages for a
        prompt that has them."""
        return self.first_messages() if self.chat else self.text

    def to_dict(self) -> dict:
        out: dict = {"question_id": self.question_id, "category": self.category, "text": self.text}
        if self.later_turns:
            out["later_turns"] = list(self.later_turns)
        if self.context:
            out["context"] = [dict(m) for m in self.context]
        if self.role != "user":
            out["role"] = self.role
        return out


def load_prompts(path: str | Path) -> list[BenchPrompt]:
    """Every prompt of a prompt file, in file order (see the module doc)."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8-sig").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise PromptError(f"cannot read the prompt file {path}: {exc}") from exc
    filled = [(number, line) for number, line in enumerate(lines, 1) if line.strip()]
    if not filled:
        raise PromptError(
            f"the prompt file {path} holds no prompts; write one prompt a line ({EXPECTED}, "
            "or plain text in a .txt file)"
        )
    if not _json_lines(path, filled[0][1]):
        return [BenchPrompt(number, "text", line.strip()) for number, line in filled]
    return [parse_line(line, f"{path}:{number}", default_id=number) for number, line in filled]


def _json_lines(path: Path, first: str) -> bool:
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        return True
    if suffix == ".txt":
        return False
    first = first.strip()
    if first.startswith(("{", "[")):
        return True
    try:
        return first.startswith('"') and isinstance(json.loads(first), str)
    except ValueError:
        return False


def parse_line(line: str, where: str, default_id: int | str = 0) -> BenchPrompt:
    """One JSON line; errors start with `where` (``file:line``)."""
    try:
        item = json.loads(line)
    except ValueError as exc:
        raise PromptError(f"{where}: not valid JSON ({exc}); expected {EXPECTED}") from None
    if isinstance(item, str):
        return BenchPrompt(default_id, "uncategorized", _text(item, where, "the prompt"))
    if not isinstance(item, dict):
        raise PromptError(f"{where}: expected {EXPECTED}, got a JSON {type(item).__name__}")
    return _object(item, where, default_id)


def _object(item: Mapping[str, Any], where: str, default_id: int | str) -> BenchPrompt:
    settings = sorted(SETTING_KEYS & set(item))
    if settings:
        raise PromptError(
            f"{where}: key(s) {', '.join(map(repr, settings))} set how to generate; a line "
            "holds a prompt only (settings such as -n or --temperature are flags for the "
            "whole file)"
        )
    given = [key for key in PROMPT_KEYS if key in item]
    if not given:
        raise PromptError(f"{where}: no prompt; expected {EXPECTED} ('turns' or 'prompt')")
    if len(given) > 1:
        raise PromptError(f"{where}: give one of 'prompt', 'turns' and 'messages', not both")
    meta = _category(item, where), _question_id(item, where, default_id)
    if given[0] == "messages":
        if "system" in item:
            raise PromptError(
                f"{where}: 'system' goes beside 'prompt' or 'turns'; with 'messages' give the "
                "system message as the first message"
            )
        return _from_messages(item["messages"], where, *meta)
    turns = [item["prompt"]] if given[0] == "prompt" else item["turns"]
    if given[0] == "turns" and (not isinstance(turns, list) or not turns):
        raise PromptError(
            f"{where}: 'turns' must be a non-empty list of user messages (or give 'prompt': "
            "a string)"
        )
    texts = [_text(t, where, _turn_name(i)) for i, t in enumerate(turns)]
    context: tuple[Message, ...] = ()
    if "system" in item:
        context = ({"role": "system", "content": _text(item["system"], where, "'system'")},)
    return BenchPrompt(meta[1], meta[0], texts[0], tuple(texts[1:]), context, chat=bool(context))


def _turn_name(index: int) -> str:
    return "the prompt (first turn)" if index == 0 else f"turn {index + 1}"


def _text(value: Any, where: str, what: str) -> str:
    if not isinstance(value, str):
        raise PromptError(f"{where}: {what} must be a string, got {type(value).__name__}")
    if not value.strip():
        raise PromptError(f"{where}: {what} must be a non-empty string")
    return value


def _category(item: Mapping[str, Any], where: str) -> str:
    category = item.get("category", "uncategorized")
    if not isinstance(category, str) or not category.strip():
        raise PromptError(f"{where}: 'category' must be a non-empty string")
    return category.strip()


def _question_id(item: Mapping[str, Any], where: str, default: int | str) -> int | str:
    qid = item.get("question_id", default)
    if not isinstance(qid, (str, int)) or isinstance(qid, bool):
        raise PromptError(f"{where}: 'question_id' must be a string or an integer")
    return qid


def _from_messages(messages: Any, where: str, category: str, question_id: int | str) -> BenchPrompt:
    """Chat messages checked as the server checks them: known roles, text content."""
    if not isinstance(messages, list) or not messages:
        raise PromptError(f"{where}: 'messages' must be a non-empty list of role/content objects")
    checked = [_message(m, i, where) for i, m in enumerate(messages)]
    if not any(m["content"].strip() for m in checked):
        raise PromptError(f"{where}: every message is empty; give some text")
    last = checked[-1]
    return BenchPrompt(
        question_id, category, last["content"], (), tuple(checked[:-1]), last["role"], chat=True
    )


def _message(m: Any, i: int, where: str) -> Message:
    if not isinstance(m, dict) or not isinstance(m.get("content"), str):
        raise PromptError(f"{where}: messages[{i}] must be an object with role and content")
    extra = sorted(set(m) - {"role", "content"})
    if extra:
        raise PromptError(
            f"{where}: messages[{i}] has unknown key(s) {', '.join(map(repr, extra))}; "
            "give role and content only"
        )
    role = m.get("role")
    if not isinstance(role, str) or role not in CHAT_ROLES:
        raise PromptError(
            f"{where}: messages[{i}].role {role!r} is not supported; use one of "
            f"{', '.join(CHAT_ROLES)}"
        )
    return {"role": CHAT_ROLES[role], "content": m["content"]}


def first_prompts(prompts: Sequence[BenchPrompt]) -> list[Prompt]:
    """The first turn of every prompt, as generation commands take them."""
    return [p.first_prompt() for p in prompts]
