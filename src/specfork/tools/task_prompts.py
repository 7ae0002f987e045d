"""User turns of many kinds of task, for a draft head's training data (`train-head --tasks`).

Self-written user turns (Magpie) are what a small target thinks users ask: mostly advice and
plans, a few lines long. Real traffic also pastes long texts to summarise or mine, asks about
passages, code and arithmetic, and wants translations — answers that copy from the context or
follow a strict format, which a head must learn to draft. These prompts cover such tasks with
templates filled from text every Python installation ships: the standard library's own
docstrings and function sources, read with `ast` (nothing is imported or run). Prompt i depends
only on (seed, i) and the library's text, so a data set made from them resumes and extends
reproducibly on the same Python version.
"""

from __future__ import annotations

import ast
import hashlib
import random
import re
import sysconfig
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from specfork.errors import ConfigError

SKIPPED = {"idlelib", "lib2to3", "site-packages", "dist-packages", "ensurepip", "turtledemo"}
CONTEXT_CHARS = 2400  # most characters of pasted text (~600 tokens)


@dataclass(frozen=True, slots=True)
class Doc:
    """A documented definition of the library."""

    name: str  # qualified, e.g. "json.dumps"
    kind: str  # "module", "class" or "function"
    text: str  # the docstring, dedented
    source: str = ""  # a function's source ("" for modules and classes)
    signature: str = ""  # a function's "name(args)"


@dataclass(frozen=True, slots=True)
class Corpus:
    """The library's documented modules, classes and functions, in a fixed order."""

    modules: tuple[Doc, ...]
    functions: tuple[Doc, ...]  # with a docstring of a sentence at least
    coded: tuple[Doc, ...]  # functions short enough to paste (5-40 lines)

    @property
    def fingerprint(self) -> str:
        """A digest of the text the prompts are made from (differs between Python versions)."""
        h = hashlib.sha256()
        for doc in (*self.modules, *self.functions):
            h.update(f"{doc.name}\0{doc.text}\0{doc.source}\0".encode())
        return h.hexdigest()[:16]


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def load_corpus(root: Path | None = None) -> Corpus:
    """Parse the `.py` files under `root` (default: this Python's standard library)."""
    root = stdlib_root() if root is None else Path(root)
    modules: list[Doc] = []
    functions: list[Doc] = []
    for path in sorted(root.rglob("*.py")):
        module = _module_name(path.relative_to(root))
        if module is None:
            continue
        try:
            text = path.read_text(encoding="utf-8")
            tree = ast.parse(text)
        except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
            continue
        _collect(module, tree, text, modules, functions)
    coded = [f for f in functions if 5 <= f.source.count("\n") + 1 <= 40]
    if len(modules) < 3 or len(coded) < 3:
        raise ConfigError(
            f"{root} holds too little documented Python source for task prompts (found "
            f"{len(modules)} modules, {len(coded)} short functions); give --prompts FILE instead"
        )
    return Corpus(tuple(modules), tuple(functions), tuple(coded))


def _module_name(rel: Path) -> str | None:
    """The dotted name of a library file's module; None for tests, tools, private modules."""
    parts = list(rel.with_suffix("").parts)
    if parts and parts[-1] == "__init__":
        parts.pop()
    skip = (not p.isidentifier() or p.startswith(("_", "test")) or p in SKIPPED for p in parts)
    return None if not parts or any(skip) else ".".join(parts)


def _collect(
    module: str, tree: ast.Module, text: str, modules: list[Doc], functions: list[Doc]
) -> None:
    doc = ast.get_docstring(tree)
    if doc and len(doc) >= 200:
        modules.append(Doc(module, "module", doc))
    for node in tree.body:
        nodes = [node] + (node.body if isinstance(node, ast.ClassDef) else [])
        owner = f"{module}.{node.name}." if isinstance(node, ast.ClassDef) else f"{module}."
        for fn in nodes:
            if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            doc = ast.get_docstring(fn)
            if fn.name.startswith("_") or not doc or len(doc) < 60:
                continue
            name = owner + fn.name if fn is not node else f"{module}.{fn.name}"
            source = textwrap.dedent(ast.get_source_segment(text, fn, padded=True) or "")
            signature = f"{fn.name}({_arguments(fn.args)})"
            functions.append(Doc(name, "function", doc, source, signature))


def _arguments(args: ast.arguments) -> str:
    """A signature's arguments without the `self` or `cls` of a method."""
    shown = ast.unparse(args)
    return re.sub(r"^(self|cls)(, |$)", "", shown)


# -- the tasks ----------------------------------------------------------------------------------
Task = Callable[[random.Random, Corpus], str]


def _clip(text: str, limit: int = CONTEXT_CHARS) -> str:
    """`text` cut at a paragraph (or line) boundary within `limit` characters."""
    if len(text) <= limit:
        return text
    cut = text.rfind("\n\n", 0, limit)
    if cut < limit // 3:
        cut = text.rfind("\n", 0, limit)
    return text[: cut if cut > 0 else limit].rstrip()


def _sentence(text: str) -> str:
    """The first sentence of a docstring, as a clause (lower-case start, no final period)."""
    first = re.split(r"(?<=[.!?])\s", " ".join(text.split()), maxsplit=1)[0].rstrip(".")
    return first[:1].lower() + first[1:]


def _pasted(rng: random.Random, corpus: Corpus) -> tuple[str, str]:
    """(name, text): a module's documentation, or a few functions' of one module."""
    if rng.random() < 0.5:
        doc = rng.choice(corpus.modules)
        return doc.name, _clip(doc.text)
    doc = rng.choice(corpus.functions)
    module = doc.name.rsplit(".", 1)[0]
    same = [f for f in corpus.functions if f.name.startswith(module + ".")][:12]
    picked = rng.sample(same, min(len(same), rng.randint(2, 4)))
    text = "\n\n".join(f"{f.signature}\n{f.text}" for f in picked)
    return module, _clip(text)


def summarize(rng: random.Random, corpus: Corpus) -> str:
    name, text = _pasted(rng, corpus)
    ask = rng.choice(
        [
            f"Summarize the following documentation in {rng.randint(2, 5)} sentences.",
            f"Write a summary of this text in at most {rng.randint(3, 6)} bullet points.",
            "Give a one-paragraph overview of what the following describes.",
            "TL;DR the text below for a busy developer.",
            f"Summarize the documentation of `{name}` below for a beginner.",
        ]
    )
    return f"{ask}\n\n{text}" if rng.random() < 0.7 else f"{text}\n\n{ask}"


def extract(rng: random.Random, corpus: Corpus) -> str:
    name, text = _pasted(rng, corpus)
    ask = rng.choice(
        [
            "List every function or parameter name that appears in the text below, one per line.",
            f"Extract the key facts about `{name}` from the text below as a bulleted list.",
            "Extract all the names written in the text below (functions, classes, arguments) and "
            "return them as a JSON list.",
            'Read the documentation below and fill in this JSON object: {"name": ..., "purpose": '
            '..., "arguments": [...], "returns": ...}',
            "Make a Markdown table of the functions described below with columns Name and Purpose.",
            "Which exceptions, warnings or error conditions does the text below mention? "
            "List them.",
        ]
    )
    return f"{ask}\n\n{text}"


def passages(rng: random.Random, corpus: Corpus) -> str:
    """Retrieval-augmented: a question about one of several pasted passages."""
    docs = rng.sample(corpus.functions, rng.randint(2, 4))
    answer = rng.choice(docs)
    name = answer.name.rsplit(".", 1)[-1]
    question = rng.choice(
        [
            f"What does `{name}` do?",
            f"What does `{name}` return?",
            f"Which arguments does `{name}` take, and what are they for?",
            f"When would I use `{name}`?",
            f"Explain `{name}` with a short example.",
        ]
    )
    width = CONTEXT_CHARS // len(docs)
    shown = "\n\n".join(
        f"[{i}] {d.signature}\n{_clip(d.text, width)}" for i, d in enumerate(docs, 1)
    )
    return (
        "Answer the question using only the passages below, and say which passage you used."
        f"\n\n{shown}\n\nQuestion: {question}"
    )


def closed_book(rng: random.Random, corpus: Corpus) -> str:
    """A question about the library without the documentation."""
    if rng.random() < 0.4:
        module = rng.choice(corpus.modules).name
        return rng.choice(
            [
                f"What is the Python `{module}` module used for?",
                f"Give me three practical examples of using Python's `{module}` module.",
                f"What are common mistakes when using the `{module}` module in Python?",
            ]
        )
    a, b = rng.sample(corpus.functions, 2)
    return rng.choice(
        [
            f"How do I use `{a.name}` in Python? Show an example.",
            f"What is the difference between `{a.name}` and `{b.name}`?",
            f"Explain what `{a.signature}` does and what each argument means.",
        ]
    )


def write_code(rng: random.Random, corpus: Corpus) -> str:
    doc = rng.choice(corpus.functions)
    what = _sentence(doc.text)
    language = rng.choice(["Python"] * 4 + ["JavaScript", "C++", "Rust", "Go", "Java"])
    return rng.choice(
        [
            f"Write a {language} function `{doc.signature}` that does this: {what}.",
            f"Implement `{doc.signature}` in {language}. It should {what}. Include comments.",
            f"Write pytest unit tests for a function `{doc.signature}` that does this: {what}.",
            f"Write a small {language} program that uses a function to {what}.",
        ]
    )


def read_code(rng: random.Random, corpus: Corpus) -> str:
    doc = rng.choice(corpus.coded)
    code = f"```python\n{_without_docstring(doc.source)}\n```"
    return rng.choice(
        [
            f"Explain what this Python function does, step by step:\n\n{code}",
            f"Find bugs, edge cases or possible improvements in this code:\n\n{code}",
            f"Add type hints and comments to this function:\n\n{code}",
            f"Rewrite this function in {rng.choice(['JavaScript', 'Java', 'C#', 'Go'])}:\n\n{code}",
            f"Write a docstring for this function:\n\n{code}",
        ]
    )


def _without_docstring(source: str) -> str:
    """A function's source without its docstring (so the task is not answered in the input)."""
    lines = source.splitlines()
    body = "\n".join(lines)
    match = re.search(r'^(\s*)("""|\'\'\')(.*?)\2\s*\n', body, flags=re.S | re.M)
    if match and match.start() > 0:
        body = body[: match.start()] + body[match.end() :]
    return body


def translate(rng: random.Random, corpus: Corpus) -> str:
    doc = rng.choice(corpus.functions)
    sentences = re.split(r"(?<=[.!?])\s+", " ".join(doc.text.split()))
    text = " ".join(sentences[: rng.randint(1, 3)])
    language = rng.choice(
        [
            "French",
            "German",
            "Spanish",
            "Italian",
            "Portuguese",
            "Dutch",
            "Chinese",
            "Japanese",
            "Russian",
            "Korean",
        ]
    )
    return f"Translate the following text into {language}:\n\n{text}"


NAMES = [
    "Ada",
    "Ben",
    "Chloe",
    "Diego",
    "Emma",
    "Farid",
    "Grace",
    "Hiro",
    "Ines",
    "Jonas",
    "Kemi",
    "Liam",
    "Maya",
    "Noah",
    "Olga",
    "Priya",
    "Quinn",
    "Rosa",
    "Sam",
    "Tariq",
]
ITEMS = [
    "notebooks",
    "apples",
    "concert tickets",
    "bags of rice",
    "pencils",
    "coffee mugs",
    "plants",
    "books",
    "T-shirts",
    "bus passes",
]


def arithmetic(rng: random.Random, corpus: Corpus) -> str:
    """A word problem or calculation with fresh numbers."""
    r = rng.randint
    name, other, item = rng.choice(NAMES), rng.choice(NAMES), rng.choice(ITEMS)
    problem = rng.choice(
        [
            f"What is {r(12, 999)} × {r(3, 99)} + {r(10, 9999)}?",
            f"Solve for x: {r(2, 19)}x + {r(1, 99)} = {r(100, 999)}.",
            f"{name} buys {r(2, 12)} {item} at ${r(2, 40)}.{r(0, 99):02d} each and pays with a "
            f"${rng.choice([50, 100, 200])} bill. How much change does {name} get?",
            f"{name} reads {r(8, 60)} pages a day. How many days does it take to finish a "
            f"{r(150, 900)}-page book?",
            f"A rectangle is {r(3, 90)} cm long and {r(2, 60)} cm wide. What are its area and "
            "perimeter?",
            f"What is {r(3, 95)}% of {r(40, 5000)}?",
            f"A train travels at {r(40, 120)} km/h for {r(1, 5)} hours, then at {r(40, 120)} km/h "
            f"for {r(1, 5)} hours. How far does it go, and what is its average speed?",
            f"If {r(2, 9)} workers build a wall in {r(3, 20)} days, how many days would "
            f"{r(2, 15)} workers take at the same rate?",
            f"{name} has {r(20, 200)} {item}. {name} gives {other} a third of them, rounded down, "
            f"then buys {r(3, 30)} more. How many does {name} have now?",
            f"Simplify the fraction {r(2, 40) * 6}/{r(2, 40) * 6}.",
            f"What is the sum of the integers from {r(1, 50)} to {r(60, 500)}?",
            f"A price rises by {r(5, 40)}% and then falls by {r(5, 40)}%. What is the overall "
            "percentage change?",
            f"Find the next two numbers of the sequence {_sequence(rng)}.",
        ]
    )
    return problem + rng.choice(["", " Explain your reasoning step by step.", " Show your work."])


def _sequence(rng: random.Random) -> str:
    a, d = rng.randint(1, 20), rng.randint(2, 9)
    arithmetic = rng.random() < 0.5
    terms = [a + d * i for i in range(5)] if arithmetic else [a * d**i for i in range(4)]
    return ", ".join(map(str, terms))


FORMS = [
    "short story",
    "poem",
    "haiku",
    "blog post",
    "persuasive essay",
    "product description",
    "cover letter",
    "email to a colleague",
    "speech",
    "limerick",
    "news article",
    "diary entry",
]
TOPICS = [
    "a lighthouse keeper's last night",
    "learning to cook",
    "a city without cars",
    "the first day at a new job",
    "a robot that collects stamps",
    "winter in the mountains",
    "a lost library book",
    "remote work",
    "the ocean at night",
    "an old bicycle",
    "a village festival",
    "saving money",
    "a friendship across borders",
    "the smell of rain",
    "a chess tournament",
    "moving to a new country",
    "an unexpected letter",
    "a garden on a rooftop",
    "the history of tea",
    "a marathon runner",
    "a power outage",
    "a museum after closing time",
]
ROLES = [
    "a pirate captain",
    "a detective in 1920s London",
    "a medieval knight",
    "a travel agent",
    "a chef at a busy restaurant",
    "a customer-support agent",
    "a wise old wizard",
    "a sports commentator",
    "a tour guide in Rome",
    "an astronaut on the space station",
    "a grumpy librarian",
    "a museum curator",
]
REQUESTS = [
    "introduce yourself and describe your day",
    "give me advice about my career",
    "tell me about the strangest thing that ever happened to you",
    "convince me to visit your home town",
    "explain your job to a child",
    "answer my complaint about a late delivery",
]
CONCEPTS = [
    "photosynthesis",
    "entropy",
    "supply and demand",
    "the French Revolution",
    "plate tectonics",
    "compound interest",
    "natural selection",
    "the water cycle",
    "black holes",
    "the Renaissance",
    "vaccines",
    "inflation",
    "the Pythagorean theorem",
    "climate change",
    "the printing press",
    "electric circuits",
    "DNA replication",
    "the Cold War",
    "machine learning",
    "the immune system",
    "Newton's laws of motion",
    "democracy in ancient Athens",
    "the stock market",
    "ocean tides",
]
AUDIENCES = [
    "a ten-year-old",
    "a high-school student",
    "a busy manager",
    "an expert",
    "someone who has never heard of it",
]


def writing(rng: random.Random, corpus: Corpus) -> str:
    ask = f"Write a {rng.choice(FORMS)} about {rng.choice(TOPICS)}"
    return ask + rng.choice(
        [".", f" in under {rng.randint(8, 30) * 10} words.", f" for {rng.choice(AUDIENCES)}."]
    )


def roleplay(rng: random.Random, corpus: Corpus) -> str:
    return f"Pretend you are {rng.choice(ROLES)}. Stay in character and {rng.choice(REQUESTS)}."


def explain(rng: random.Random, corpus: Corpus) -> str:
    a, b = rng.sample(CONCEPTS, 2)
    return rng.choice(
        [
            f"Explain {a} to {rng.choice(AUDIENCES)}.",
            f"What are the main causes and consequences of {a}?",
            f"Compare {a} and {b}: what do they have in common?",
            f"Write five quiz questions with answers about {a}.",
        ]
    )


def reasoning(rng: random.Random, corpus: Corpus) -> str:
    a, b, c = rng.sample(NAMES, 3)
    n = rng.randint(3, 9)
    return rng.choice(
        [
            f"{a} is taller than {b}, and {b} is taller than {c}. Who is the shortest? Explain.",
            f"If it takes {n} machines {n} minutes to make {n} widgets, how long would "
            f"{n * 20} machines take to make {n * 20} widgets?",
            f"{a} is older than {b}. {c} is younger than {b}. Is {a} older than {c}? Why?",
            f"A bat and a ball cost ${n}.10 in total. The bat costs ${n} more than the ball. "
            "How much does the ball cost?",
            f"{a} says: 'I always lie.' Can this statement be true? Reason it through.",
            f"There are {n} people in a room and each shakes hands with every other person once. "
            "How many handshakes are there?",
        ]
    )


TASKS: dict[str, Task] = {
    "summarize": summarize,
    "extract": extract,
    "passages": passages,
    "closed_book": closed_book,
    "write_code": write_code,
    "read_code": read_code,
    "translate": translate,
    "arithmetic": arithmetic,
    "writing": writing,
    "roleplay": roleplay,
    "explain": explain,
    "reasoning": reasoning,
}


def task_prompt(corpus: Corpus, index: int, seed: int = 0) -> str:
    """Prompt `index`: the task kinds in turn, each filled from its own random stream."""
    kinds = list(TASKS)
    rng = random.Random(f"specfork-tasks:{seed}:{index}")
    return TASKS[kinds[index % len(kinds)]](rng, corpus)


def task_prompts(corpus: Corpus, count: int, seed: int = 0, first: int = 0) -> list[str]:
    """Prompts first .. first + count - 1."""
    return [task_prompt(corpus, i, seed) for i in range(first, first + count)]
