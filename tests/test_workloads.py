"""`specfork bench --workload NAME`: the shipped workloads (multi-turn, agent, code-edit, rag)
— their data as the package ships it, the command's defaults, and a whole run on a tiny model
with per-workload and later-turn figures."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest
from rich.console import Console

from cli_run import run_cli
from specfork.bench.report import load_results
from specfork.bench.workloads import WORKLOADS, workload_names, workload_prompts
from specfork.cli import bench as bench_command
from specfork.errors import ConfigError
from tiny_models import tiny_chat_llama


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="specfork")
    bench_command.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["bench", *argv])


@pytest.mark.parametrize("name", WORKLOADS)
def test_every_workload_ships_at_least_twelve_items_of_its_category(name: str) -> None:
    items = workload_prompts(name)
    assert len(items) >= 12
    assert {p.category for p in items} == {name}
    assert len({p.question_id for p in items}) == len(items)
    assert len({p.text for p in items}) == len(items)  # varied, no duplicates


def test_multi_turn_chats_have_three_or_four_user_turns() -> None:
    assert {len(p.turns) for p in workload_prompts("multi-turn")} == {3, 4}


def test_agent_tasks_list_tools_as_json_schemas_and_run_several_turns() -> None:
    for p in workload_prompts("agent"):
        assert p.chat and p.context[0]["role"] == "system" and len(p.turns) >= 3
        lines = p.context[0]["content"].splitlines()
        tools = [json.loads(line) for line in lines if line.startswith("{")]
        assert len(tools) >= 4
        assert all(
            t["parameters"]["type"] == "object" and t["parameters"]["required"] for t in tools
        )
        results = [t for t in p.later_turns if t.startswith("Tool result: ")]
        assert results and all(json.loads(t.removeprefix("Tool result: ")) for t in results)


def test_code_edits_hold_a_whole_file_of_50_to_150_lines_in_varied_languages() -> None:
    languages = set()
    for p in workload_prompts("code-edit"):
        match = re.search(
            r"```(\w+)\n(.*)```\n\nChange requested: .+whole edited file", p.text, re.S
        )
        assert match, p.question_id
        languages.add(match.group(1))
        assert 50 <= match.group(2).count("\n") <= 150, p.question_id
    assert len(languages) >= 10


def test_rag_documents_are_long_and_answers_quote_them() -> None:
    for p in workload_prompts("rag"):
        document, question = p.text.rsplit("\nQuestion: ", 1)
        assert len(document.split()) >= 700 and "quote" in question.lower() + document.lower()


def test_workload_names() -> None:
    assert workload_names("all") == WORKLOADS
    assert workload_names("rag") == ("rag",)
    with pytest.raises(ConfigError, match="unknown workload 'chat'; choose one of multi-turn"):
        workload_names("chat")
    assert [p.category for p in workload_prompts("all")][:1] == ["multi-turn"]


def test_bench_flags_pick_the_workload_and_every_turn() -> None:
    settings = bench_command.settings_from_args(_args("--workload", "agent", "--limit", "2"))
    assert settings.turns == "all" and [p.category for p in settings.prompts] == ["agent"] * 2
    assert "specfork's workloads (agent)" in settings.prompts_source
    settings = bench_command.settings_from_args(_args("--workload", "all", "--per-category", "1"))
    assert [p.category for p in settings.prompts] == list(WORKLOADS)
    first = bench_command.settings_from_args(_args("--workload", "rag", "--turns", "first"))
    assert first.turns == "first"
    assert bench_command.settings_from_args(_args()).turns == "first"  # prompt files: first


def test_workload_and_prompts_exclude_each_other(tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit) as done:
        run_cli(capsys, ["bench", "--workload", "rag", "--prompts", str(tmp_path / "p.jsonl")])
    assert done.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


@pytest.mark.usefixtures("one_thread")
def test_all_workloads_end_to_end(tmp_path: Path, capsys) -> None:
    """One item of each workload on a tiny random chat model (byte tokens, so a long context):
    every turn runs, categories are the workloads, later turns have their own figures."""
    folder = tiny_chat_llama(tmp_path / "tiny", seed=4, context=8192)
    out = tmp_path / "out"
    argv = ["--model", str(folder), "--dtype", "float32", "--device", "cpu", "--workload", "all"]
    argv += ["--per-category", "1", "-n", "4", "--ignore-eos", "--repeats", "1", "--warmup", "0"]
    argv += ["--out", str(out), "--quiet", "--no-plots", "--strategies", "ar,speculative:ngram?k=2"]
    assert bench_command.run(_args(*argv), Console(stderr=True, width=200)) == 0
    stdout = " ".join(capsys.readouterr().out.split())
    assert "later turns, 2 and on" in stdout
    doc = load_results(out)
    assert doc["categories"] == list(WORKLOADS) and doc["settings"]["turns"] == "all"
    by_category: dict[str, list[int]] = {}
    for p in doc["prompts"]:
        by_category.setdefault(p["category"], []).append(p["turn"])
    items = {w: workload_prompts(w)[0] for w in WORKLOADS}
    for name, item in items.items():
        assert by_category[name] == list(range(1, len(item.turns) + 1)), name
    agent = [p for p in doc["prompts"] if p["category"] == "agent"]
    assert all(p["context"][0]["role"] == "system" for p in agent)
    assert agent[-1]["prompt_tokens"] > agent[0]["prompt_tokens"] + 3 * 4  # answers kept
    ms = doc["measurements"]
    assert all(m["ok"] for m in ms) and len(ms) == 2 * len(doc["prompts"])
    for row in doc["per_prompt"]:  # lossless on every turn of every workload
        assert row["greedy_match"] in ("exact", "near-tie"), row
    later = doc["summary_later_turns"]["speculative:ngram?k=2"]
    assert later["multi-turn"]["prompts"] == len(items["multi-turn"].turns) - 1
    assert later["agent"]["prompts"] == len(items["agent"].turns) - 1
    assert later["code-edit"]["prompts"] == later["rag"]["prompts"] == 0
    report = (out / "report.md").read_text()
    for heading in ("## Later turns (2 and on, together)", "### later turns: tokens/forward by"):
        assert heading in report, heading
    assert "| strategy | multi-turn | agent | code-edit | rag | overall |" in report
