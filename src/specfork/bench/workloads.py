"""The workloads shipped with specfork's bench (`specfork bench --workload NAME`): where text
repeats, which is where speculative decoding pays most, beside Spec-Bench's first-turn chat.

- ``multi-turn``: chats of 3–4 user turns; every turn runs, each later turn after the model's
  own earlier answers in that run;
- ``agent``: a system prompt listing tools as JSON schemas, a task answered by a JSON tool
  call, then tool results (as user messages: not every chat template has a tool role) and
  follow-ups;
- ``code-edit``: a source file of 50–150 lines and a small change, answered with the whole
  edited file;
- ``rag``: a document of 1–2k tokens and a question whose answer quotes it.

Each is a prompt file in the package (``workload_data/NAME.jsonl``, the formats of
`specfork.bench.prompt_file`), so an installed specfork has them; every item's category is its
workload's name, so the bench's per-category tables are per-workload tables. They were
written for specfork (not taken from any benchmark data set); benchmarks/prompts/README.md
states their source and license.
"""

from __future__ import annotations

from importlib import resources

from specfork.bench.prompt_file import BenchPrompt, load_prompts
from specfork.errors import ConfigError, PromptError

WORKLOADS = ("multi-turn", "agent", "code-edit", "rag")
ALL = "all"
DATA = "workload_data"


def workload_names(name: str) -> tuple[str, ...]:
    """The workloads `name` stands for (``all``: every one, in order)."""
    if name == ALL:
        return WORKLOADS
    if name not in WORKLOADS:
        raise ConfigError(
            f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS)} or {ALL}"
        )
    return (name,)


def workload_prompts(name: str) -> list[BenchPrompt]:
    """Every item of workload `name` (or of every workload for ``all``), in file order."""
    prompts: list[BenchPrompt] = []
    for workload in workload_names(name):
        prompts += _read(workload)
    return prompts


def _read(workload: str) -> list[BenchPrompt]:
    resource = resources.files("specfork.bench").joinpath(DATA, f"{workload}.jsonl")
    with resources.as_file(resource) as path:
        if not path.is_file():
            raise PromptError(
                f"the {workload} workload's file {path} is missing from this installation; "
                "reinstall specfork"
            )
        items = load_prompts(path)
    wrong = [str(p.question_id) for p in items if p.category != workload]
    if wrong:
        raise PromptError(f"{path}: items {', '.join(wrong)} are not of category {workload!r}")
    return items
