"""Benchmark prompts: selecting from a prompt file, and a small built-in set.

Prompt files are read by `specfork.bench.prompt_file` (the one reader of every command: plain
text, JSON strings, ``{"prompt": ...}``, Spec-Bench's ``{"turns": [...]}`` and
``{"messages": [...]}``); the workloads shipped with specfork by `specfork.bench.workloads`.
"""

from __future__ import annotations

from collections.abc import Sequence

from specfork.bench.prompt_file import BenchPrompt, load_prompts, parse_line

__all__ = ["BenchPrompt", "builtin_prompts", "load_prompts", "parse_line", "select_prompts"]


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
