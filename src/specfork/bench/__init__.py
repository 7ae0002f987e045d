"""Side-by-side benchmarks of decoding strategies (`specfork bench`).

- `specs`: the strategy-spec syntax (``strategy[:drafter][?key=value&...]``) → SpecConfig;
- `prompt_file`: the one prompt-file reader of every command (text, JSON strings, prompt,
  Spec-Bench turns, chat messages);
- `prompts`: selecting prompts, and a built-in prompt set;
- `workloads`: the workloads shipped with specfork (multi-turn, agent, code-edit, rag);
- `runner`: building the strategies, the warm-up and the interleaved measurements;
- `records`: what one run produced, one measurement, the figures' names;
- `quality`: greedy matches (near-tie rule), the target's log-probability of an output;
- `summary`: medians per prompt, per category and overall; speedups, match rates;
- `machine`, `progress`: what results.json says about the machine; the live progress bar;
- `hf`: transformers baselines (``generate``, prompt lookup, assisted), imported lazily;
- `report`: terminal tables, results.json, report.md, PNG plots;
The `bench` command itself is `specfork.cli.bench`.

Library use::

    from specfork.bench import BenchSettings, builtin_prompts, parse_strategies, run_benchmark
    settings = BenchSettings(parse_strategies("ar,speculative:ngram?k=4"), builtin_prompts())
    results = run_benchmark(settings)
    doc = results.to_dict()  # the results.json document
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "BenchPrompt": "specfork.bench.prompt_file",
    "builtin_prompts": "specfork.bench.prompts",
    "load_prompts": "specfork.bench.prompt_file",
    "select_prompts": "specfork.bench.prompts",
    "BenchResults": "specfork.bench.runner",
    "BenchSettings": "specfork.bench.runner",
    "run_benchmark": "specfork.bench.runner",
    "StrategySpec": "specfork.bench.specs",
    "parse_strategies": "specfork.bench.specs",
    "parse_strategy": "specfork.bench.specs",
    "WORKLOADS": "specfork.bench.workloads",
    "workload_prompts": "specfork.bench.workloads",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'specfork.bench' has no attribute {name!r}")
