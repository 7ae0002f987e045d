"""Write `benchmarks/prompts/long-context.jsonl`: long prompts made of the dev split's documents.

Each prompt is the first turns of some summarization and RAG prompts of
`benchmarks/prompts/specbench-dev.jsonl` (documents, each with its own question or
"Summarize:" line), joined by blank lines in the order `LONG` gives, and one instruction about
them all. Nothing else of Spec-Bench is read. The first three are the prompts the long-context
figures of docs/benchmarks.md used before 2026-12-07, unchanged.

    python benchmarks/long_prompts.py [--check]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent / "prompts"
DEV = HERE / "specbench-dev.jsonl"
OUT = HERE / "long-context.jsonl"

SUMMARIZE = "Summarize the documents above in a few sentences."
FACTS = "Using only the documents above, list the three most important facts they contain."
TITLES = "Write a short title for each document above, one per line."
# (question_id, dev prompts in order, the instruction)
LONG = (
    ("long-1", (241, 244, 247, 482), SUMMARIZE),
    ("long-2", (242, 245, 248, 483), FACTS),
    ("long-3", (243, 246, 481, 484, 487), TITLES),
    ("long-4", (485, 241, 486, 246), "Which document above gives the most numbers? Quote two."),
    ("long-5", (488, 247, 243, 485, 244), SUMMARIZE),
    (
        "long-6",
        (486, 242, 488, 481),
        "List every person the documents above name, with their role.",
    ),
    (
        "long-7",
        (248, 484, 245, 487),
        "Write one question each document above answers, one per line.",
    ),
    ("long-8", (244, 488, 246, 486, 241), FACTS),
)


def build() -> list[dict]:
    dev = {}
    for line in DEV.read_text().splitlines():
        item = json.loads(line)
        dev[item["question_id"]] = item["turns"][0]
    out = []
    for qid, sources, instruction in LONG:
        text = "\n\n".join([*(dev[s] for s in sources), instruction])
        out.append(
            {
                "question_id": qid,
                "category": "long-context",
                "turns": [text],
                "source_ids": list(sources),
            }
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="fail unless the file is up to date")
    args = ap.parse_args()
    text = "".join(json.dumps(item) + "\n" for item in build())
    if args.check:
        if OUT.read_text() != text:
            raise SystemExit(f"{OUT} is not what {Path(__file__).name} writes")
        return
    OUT.write_text(text)


if __name__ == "__main__":
    main()
