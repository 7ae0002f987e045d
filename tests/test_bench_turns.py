"""`specfork bench --turns all`: every turn of a conversation, later turns on ar's answers.

Unit tests drive the interleaved runner with fake strategies; the end-to-end tests run the
whole benchmark on a tiny random-weight Llama with a chat template (seconds, no download).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from rich.console import Console

from specfork.bench.prompts import BenchPrompt, load_prompts
from specfork.bench.records import BenchStrategy, Measurement, PreparedPrompt, RunOutput
from specfork.bench.report import load_results
from specfork.bench.runner import BenchSettings, run_benchmark, run_interleaved
from specfork.bench.specs import parse_strategies
from specfork.bench.summary import per_prompt_figures, summarize
from specfork.cli import bench as bench_command
from specfork.errors import ConfigError, PromptError
from tiny_models import tiny_chat_llama


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_chat_llama(tmp_path_factory.mktemp("tiny-turns"))


# ----------------------------------------------------------------------------- prompts


def test_later_turns_are_loaded_and_checked(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text(
        '{"question_id": 1, "category": "writing", "turns": ["Write.", "Shorter."]}\n'
        '{"question_id": 2, "category": "qa", "turns": ["Why?"]}\n'
    )
    two, one = load_prompts(path)
    assert two.turns == ("Write.", "Shorter.") and two.later_turns == ("Shorter.",)
    assert one.turns == ("Why?",) and "later_turns" not in one.to_dict()
    assert two.to_dict()["later_turns"] == ["Shorter."]
    path.write_text('{"turns": ["Write.", ""]}\n')
    with pytest.raises(PromptError, match=r"p\.jsonl:1: turn 2 must be a non-empty string"):
        load_prompts(path)


def test_turns_setting_is_validated() -> None:
    with pytest.raises(ConfigError, match="turns must be one of first, all"):
        BenchSettings(parse_strategies("ar"), [BenchPrompt(1, "qa", "hi")], turns="both")


# ----------------------------------------------------------------------------- run order


def _fake(label: str, calls: list, fail_turn: int | None = None) -> BenchStrategy:
    """Answers with tokens that name the strategy and the turn it ran."""

    def run(p: PreparedPrompt) -> RunOutput:
        calls.append((label, p.index, p.turn, tuple(p.ids)))
        if fail_turn == p.turn:
            raise RuntimeError("boom")
        answer = [ord(label[0]), p.turn]
        return RunOutput(
            token_ids=answer, new_tokens=2, decode_tokens_per_second=10.0, time_to_first_token=0.01
        )

    return BenchStrategy(label, "specfork", run, takes_prompt=True)


def _conversations() -> list[PreparedPrompt]:
    two = BenchPrompt(0, "writing", "first", ("second",))
    one = BenchPrompt(1, "qa", "only")
    return [PreparedPrompt(0, two, [100]), PreparedPrompt(1, one, [200])]


def _next_turn(p: PreparedPrompt, answer: RunOutput) -> PreparedPrompt:
    """The next turn's ids: this turn's, the answer, a marker for the next user message."""
    return PreparedPrompt(p.index, p.prompt, [*p.ids, *answer.token_ids, 999], p.turn + 1)


def test_later_turns_run_on_the_references_answer() -> None:
    calls: list = []
    strategies = [_fake("ar", calls), _fake("spec", calls), _fake("tree", calls)]
    ms = run_interleaved(
        strategies,
        _conversations(),
        repeats=2,
        warmup=0,
        measure_memory=False,
        next_turn=_next_turn,
    )
    turn2 = (100, ord("a"), 1, 999)  # ar's turn-1 answer: the context of everybody's turn 2
    order = ["ar", "spec", "tree", "spec", "tree", "ar"]  # the rotation, per turn
    assert calls == (
        [(label, 0, 1, (100,)) for label in order]
        + [(label, 0, 2, turn2) for label in order]
        + [(label, 1, 1, (200,)) for label in order]
    )
    assert [(m.prompt_index, m.turn) for m in ms] == [(0, 1)] * 6 + [(0, 2)] * 6 + [(1, 1)] * 6
    assert all(m.ok for m in ms)
    assert [m.sequence for m in ms] == list(range(18))


def test_without_next_turn_only_first_turns_run() -> None:
    calls: list = []
    run_interleaved(
        [_fake("ar", calls)], _conversations(), repeats=1, warmup=0, measure_memory=False
    )
    assert [(c[1], c[2]) for c in calls] == [(0, 1), (1, 1)]


def test_reference_failure_fails_the_later_turns_of_that_prompt_only() -> None:
    calls: list = []
    ar = _fake("ar", calls, fail_turn=1)
    strategies = [ar, _fake("spec", calls)]
    two = BenchPrompt(0, "writing", "a", ("b", "c"))
    prompts = [PreparedPrompt(0, two, [100]), PreparedPrompt(1, BenchPrompt(1, "qa", "d"), [1])]
    ms = run_interleaved(
        strategies, prompts, repeats=1, warmup=0, measure_memory=False, next_turn=_next_turn
    )
    later = [m for m in ms if m.turn > 1]
    assert {(m.strategy, m.turn) for m in later} == {(s, t) for s in ("ar", "spec") for t in (2, 3)}
    assert all(not m.ok and "ar has no answer to turn 1" in (m.error or "") for m in later)
    assert [c for c in calls if c[2] > 1] == []  # nothing ran without a context
    assert [m.ok for m in ms if m.prompt_index == 1] == [False, True]  # ar fails turn 1 there too


def test_figures_per_turn_against_the_same_turn_of_the_reference() -> None:
    two = BenchPrompt(0, "writing", "a", ("b",))
    prompts = [PreparedPrompt(0, two, [1]), PreparedPrompt(0, two, [1, 5, 6, 2], turn=2)]

    def m(seq: int, label: str, turn: int, ids: list[int], tps: float) -> Measurement:
        out = RunOutput(
            token_ids=ids,
            new_tokens=len(ids),
            decode_tokens_per_second=tps,
            time_to_first_token=0.1,
        )
        return Measurement(seq, label, 0, 0, "writing", 0, True, output=out, turn=turn)

    ms = [
        m(0, "ar", 1, [5, 6], 10.0),
        m(1, "spec", 1, [5, 6], 30.0),
        m(2, "ar", 2, [7, 8], 20.0),
        m(3, "spec", 2, [7, 9], 10.0),
    ]
    contexts: list = []
    rows = per_prompt_figures(
        ms, ["ar", "spec"], prompts, gap_fn=lambda ctx: contexts.append(ctx) or 9.0
    )
    spec = {r["turn"]: r for r in rows if r["strategy"] == "spec"}
    assert spec[1]["speedup"] == 3.0 and spec[1]["greedy_match"] == "exact"
    assert spec[2]["speedup"] == 0.5 and spec[2]["greedy_match"] == "differs"
    assert contexts == [[1, 5, 6, 2, 7]]  # turn 2's prompt + ar's turn-2 tokens before the split
    assert summarize(rows, ["spec"], ["writing"], turn=2)["spec"]["overall"]["speedup"] == 0.5
    assert summarize(rows, ["spec"], ["writing"], turn=1)["spec"]["writing"]["speedup"] == 3.0
    both = summarize(rows, ["spec"], ["writing"])["spec"]["overall"]
    assert both["prompts"] == 2 and both["greedy_match_rate"] == 0.5


# ----------------------------------------------------------------------------- end to end


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="specfork")
    bench_command.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["bench", *argv])


def _prompt_file(tmp_path: Path) -> Path:
    rows = [
        {
            "question_id": 7,
            "category": "writing",
            "turns": ["Say: the cat sat on the mat.", "Again, shorter."],
        },
        {"question_id": 8, "category": "qa", "turns": ["Why is the sky blue?"]},
    ]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.usefixtures("one_thread")
def test_multi_turn_bench_end_to_end(tiny_folder: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    argv = [
        "--model",
        str(tiny_folder),
        "--dtype",
        "float32",
        "--device",
        "cpu",
        "--prompts",
        str(_prompt_file(tmp_path)),
        "-n",
        "6",
        "--ignore-eos",
        "--repeats",
        "2",
        "--turns",
        "all",
        "--out",
        str(out),
        "--quiet",
        "--strategies",
        "ar,speculative:ngram?k=3,spork:recycle+ngram,hf:ar",
    ]
    assert bench_command.run(_args(*argv), Console(stderr=True, width=200)) == 0
    stdout = capsys.readouterr().out
    assert "turn 1 (medians" in stdout and "turn 2 (medians" in stdout
    doc = load_results(out)
    assert doc["settings"]["turns"] == "all"
    assert [(p["index"], p["turn"]) for p in doc["prompts"]] == [(0, 1), (0, 2), (1, 1)]
    first, second = doc["prompts"][0], doc["prompts"][1]
    assert second["prompt_tokens"] > first["prompt_tokens"] + 6  # turn 1 + ar's answer + turn 2
    ms = doc["measurements"]
    assert all(m["ok"] for m in ms) and len(ms) == 4 * 2 * 3
    assert [(m["prompt_index"], m["turn"]) for m in ms] == [(0, 1)] * 8 + [(0, 2)] * 8 + [
        (1, 1)
    ] * 8
    rows = doc["per_prompt"]
    assert {(r["prompt_index"], r["turn"]) for r in rows} == {(0, 1), (0, 2), (1, 1)}
    for r in rows:  # lossless strategies match ar on each turn, transformers too (fp32)
        assert r["greedy_match"] in ("exact", "near-tie"), r
    assert set(doc["summary_by_turn"]) == {"1", "2"}
    turn2 = doc["summary_by_turn"]["2"]
    assert turn2["ar"]["overall"]["prompts"] == 1 and turn2["ar"]["overall"]["speedup"] == 1.0
    assert turn2["speculative:ngram?k=3"]["writing"]["prompts"] == 1
    assert turn2["speculative:ngram?k=3"]["qa"]["prompts"] == 0  # the one-turn prompt
    assert doc["summary"]["ar"]["overall"]["prompts"] == 3  # every turn together
    report = (out / "report.md").read_text()
    for heading in (
        "## Overall (every turn)",
        "## Turn 1",
        "## Turn 2",
        "### turn 2: speedup by category",
        "2 prompts from",
    ):
        assert heading in report, heading


@pytest.mark.usefixtures("one_thread")
def test_turn_two_context_is_ars_turn_one_answer(tiny_folder: Path) -> None:
    from specfork.loading.loader import load_model

    loaded = load_model(str(tiny_folder), dtype="float32", device="cpu", progress=False)
    prompt = BenchPrompt(1, "writing", "Say: the cat sat.", ("Again.",))
    settings = BenchSettings(
        parse_strategies("ar,speculative:ngram?k=2"),
        [prompt],
        max_new_tokens=5,
        ignore_eos=True,
        repeats=1,
        warmup=0,
        turns="all",
    )
    results = run_benchmark(settings, loaded=loaded, show_progress=False)
    t1, t2 = results.prompts
    ar1 = next(m for m in results.measurements if m.strategy == "ar" and m.turn == 1)
    answer = loaded.tokenizer.decode(ar1.output.token_ids, skip_special_tokens=True)
    assert t2.messages == [
        {"role": "user", "content": "Say: the cat sat."},
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "Again."},
    ]
    rendered = loaded.tokenizer.apply_chat_template(t2.messages, add_generation_prompt=True)
    assert t2.ids == loaded.tokenizer.encode(rendered)
    assert (t1.turn, t2.turn) == (1, 2)
    assert results.summary_by_turn is not None and set(results.summary_by_turn) == {"1", "2"}
    # --turns first (the default): the same prompt has only its first turn measured
    first_only = BenchSettings(
        parse_strategies("ar"), [prompt], max_new_tokens=5, repeats=1, warmup=0
    )
    results = run_benchmark(first_only, loaded=loaded, show_progress=False)
    assert [m.turn for m in results.measurements] == [1]
    assert results.summary_by_turn is None and "summary_by_turn" not in results.to_dict()


@pytest.mark.usefixtures("one_thread")
def test_all_turns_need_a_chat_template(tmp_path: Path) -> None:
    from specfork.loading.loader import load_model

    folder = tiny_chat_llama(tmp_path, chat=False)
    loaded = load_model(str(folder), dtype="float32", device="cpu", progress=False)
    settings = BenchSettings(
        parse_strategies("ar"),
        [BenchPrompt(1, "w", "Hi", ("More",))],
        max_new_tokens=3,
        repeats=1,
        warmup=0,
        turns="all",
    )
    with pytest.raises(ConfigError, match="no chat template; use --turns first"):
        run_benchmark(settings, loaded=loaded, show_progress=False)


@pytest.mark.usefixtures("one_thread")
def test_a_turn_that_cannot_be_built_is_a_note(tiny_folder: Path) -> None:
    """A turn 2 far longer than the model's context is refused when it is built: turn 2 fails
    with the reason in the notes, the run goes on."""
    from specfork.loading.loader import load_model

    loaded = load_model(str(tiny_folder), dtype="float32", device="cpu", progress=False)
    prompts = [BenchPrompt(5, "w", "Hi", ("x" * 30_000,)), BenchPrompt(6, "qa", "Why?")]
    settings = BenchSettings(
        parse_strategies("ar,speculative:ngram?k=2"),
        prompts,
        max_new_tokens=3,
        repeats=1,
        warmup=0,
        turns="all",
    )
    results = run_benchmark(settings, loaded=loaded, show_progress=False)
    failed = [m for m in results.measurements if not m.ok]
    assert [(m.strategy, m.turn) for m in failed] == [("ar", 2), ("speculative:ngram?k=2", 2)]
    assert [(p.index, p.turn) for p in results.prompts] == [(0, 1), (1, 1)]
    note = next(n for n in results.notes if n.startswith("question 5 turn 2 was not run"))
    assert "could not be built" in note and "characters" in note
    assert results.summary_by_turn is not None and set(results.summary_by_turn) == {"1"}
