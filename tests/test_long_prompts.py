"""The long-context benchmark prompts: what `benchmarks/long_prompts.py` writes from the dev
split's documents, readable by every command that reads a prompt file."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from specfork.bench.prompt_file import load_prompts

ROOT = Path(__file__).resolve().parent.parent


def test_the_long_prompts_are_what_their_script_writes() -> None:
    script = ROOT / "benchmarks" / "long_prompts.py"
    done = subprocess.run(
        [sys.executable, str(script), "--check"], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr


def test_the_long_prompts_read_as_a_prompt_file() -> None:
    prompts = load_prompts(ROOT / "benchmarks" / "prompts" / "long-context.jsonl")
    assert len(prompts) == 8
    assert {p.category for p in prompts} == {"long-context"}
    assert len({p.text for p in prompts}) == 8 and min(len(p.text) for p in prompts) > 10_000
