"""Benchmark prompts: prompt files and a small built-in set.

Three formats, one prompt a line (blank lines skipped):
- Spec-Bench JSONL: ``{"question_id": ..., "category": ..., "turns": [first user message, ...]}``
  (through the model's chat template; the first turn, or every turn with ``--turns all``);
- JSONL with a ``prompt`` string instead of ``turns`` (``category`` and ``question_id``
  optional);
- plain text: each line is a prompt (category "text"). ``.jsonl``/``.json`` files are JSONL,
  ``.txt`` files plain text, and a file of another name is JSONL when its first line starts
  with ``{`` or ``[``.
A malformed JSON line is a PromptError that names the file and line number.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from specfork.errors import PromptError


@dataclass(frozen=True, slots=True)
class BenchPrompt:
    """One benchmark prompt: its id, task category, first-turn text and the user messages of
    any later turns (Spec-Bench's multi-turn conversations)."""

    question_id: str | int
    category: str
    text: str
    later_turns: tuple[str, ...] = ()

    @property
    def turns(self) -> tuple[str, ...]:
        """Every user message of the conversation, the first turn first."""
        return (self.text, *self.later_turns)

    def to_dict(self) -> dict:
        out: dict = {"question_id": self.question_id, "category": self.category, "text": self.text}
        if self.later_turns:
            out["later_turns"] = list(self.later_turns)
        return out


def load_prompts(path: str | Path) -> list[BenchPrompt]:
    """Every prompt of a Spec-Bench JSONL file, in file order."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise PromptError(f"cannot read the prompt file {path}: {exc}") from exc
    filled = [(number, line) for number, line in enumerate(lines, 1) if line.strip()]
    if not filled:
        raise PromptError(f"the prompt file {path} has no prompts (one prompt a line)")
    suffix = path.suffix.lower()
    json_lines = suffix in (".jsonl", ".json") or (
        suffix != ".txt" and filled[0][1].lstrip().startswith(("{", "["))
    )
    if not json_lines:
        return [BenchPrompt(number, "text", line.strip()) for number, line in filled]
    return [parse_line(line, f"{path}:{number}", default_id=number) for number, line in filled]


def parse_line(line: str, where: str, default_id: int = 0) -> BenchPrompt:
    """One Spec-Bench line; errors start with `where` (``file:line``)."""
    try:
        row = json.loads(line)
    except ValueError as exc:
        raise PromptError(f"{where}: not valid JSON ({exc})") from exc
    if not isinstance(row, dict):
        raise PromptError(
            f"{where}: expected a JSON object with 'turns' or 'prompt', got {type(row).__name__}"
        )
    turns = [row["prompt"]] if "prompt" in row and "turns" not in row else row.get("turns")
    if not isinstance(turns, list) or not turns:
        raise PromptError(
            f"{where}: 'turns' must be a non-empty list of user messages "
            "(or give 'prompt': a string)"
        )
    if not isinstance(turns[0], str) or not turns[0].strip():
        raise PromptError(f"{where}: the prompt (first turn) must be a non-empty string")
    for number, turn in enumerate(turns[1:], 2):
        if not isinstance(turn, str) or not turn.strip():
            raise PromptError(f"{where}: turn {number} must be a non-empty string")
    category = row.get("category", "uncategorized")
    if not isinstance(category, str) or not category.strip():
        raise PromptError(f"{where}: 'category' must be a non-empty string")
    qid = row.get("question_id", default_id)
    if not isinstance(qid, (str, int)) or isinstance(qid, bool):
        raise PromptError(f"{where}: 'question_id' must be a string or an integer")
    return BenchPrompt(qid, category.strip(), turns[0], tuple(turns[1:]))


def select_prompts(
    prompts: Sequence[BenchPrompt], per_category: int | None = None, limit: int | None = None
) -> list[BenchPrompt]:
    """The first `per_category` prompts of each category, then the first `limit` of those;
    file order is kept (it is the order the benchmark visits them in)."""
    counts: dict[str, int] = {}
    picked = []
    for p in prompts:
        if per_category is not None and counts.get(p.category, 0) >= per_category:
            continue
        counts[p.category] = counts.get(p.category, 0) + 1
        picked.append(p)
    return picked[:limit] if limit is not None else picked


def builtin_prompts() -> list[BenchPrompt]:
    """Twelve short prompts, two for each of Spec-Bench's six task kinds."""
    return [BenchPrompt(f"builtin-{i + 1}", cat, text) for i, (cat, text) in enumerate(_BUILTIN)]


_ARTICLE = (
    "The town of Millbrook opened its first public library in 1921 with 300 donated books. "
    "A fire in 1958 destroyed most of the collection, and volunteers rebuilt it over the next "
    "ten years. Today the library lends 40,000 books a year, runs a weekly reading club for "
    "children and offers free computer classes for older residents."
)
_DOC_A = (
    "Document 1: The Harbor Bridge is 1,240 meters long and opened to traffic in 1987. "
    "Document 2: Tolls on the Harbor Bridge were removed in 2005 after the construction "
    "loan was repaid. Document 3: About 65,000 vehicles cross the bridge on an average weekday."
)
_DOC_B = (
    "Document 1: Green tea contains caffeine, though usually less than coffee. Document 2: A "
    "cup of brewed coffee has about 95 mg of caffeine; a cup of green tea has 20 to 45 mg. "
    "Document 3: Both drinks contain antioxidants called polyphenols."
)

_BUILTIN: tuple[tuple[str, str], ...] = (
    ("writing", "Write a short, friendly email inviting your team to a picnic next Saturday."),
    ("writing", "Write a four-line poem about autumn leaves."),
    (
        "translation",
        "Translate the following sentence into German: The train to the airport leaves every "
        "twenty minutes from platform three.",
    ),
    (
        "translation",
        "Translate into French: I would like to book a table for two people at seven o'clock.",
    ),
    ("summarization", f"Summarize the following text in two sentences:\n\n{_ARTICLE}"),
    (
        "summarization",
        "Summarize this conversation in one sentence:\nAnna: Can you pick up the cake at 5?\n"
        "Ben: I finish work at 5:30, so 6 is the earliest.\nAnna: Fine, the shop closes at 7.",
    ),
    ("qa", "Why do we see lightning before we hear thunder?"),
    ("qa", "What is the difference between a virus and a bacterium?"),
    (
        "math_reasoning",
        "A shop sells pencils at 3 for $1. How much do 24 pencils cost? Explain step by step.",
    ),
    (
        "math_reasoning",
        "Tom is twice as old as his sister. In 5 years their ages will add up to 40. How old is "
        "Tom now? Show your reasoning.",
    ),
    (
        "rag",
        f"{_DOC_A}\n\nUsing only the documents above, answer: how long is the Harbor Bridge "
        "and when were its tolls removed?",
    ),
    (
        "rag",
        f"{_DOC_B}\n\nUsing only the documents above, answer: which drink has more caffeine, "
        "and by how much?",
    ),
)
