"""`specfork bench`: strategy specs, prompt files, run order, near-ties, outputs.

Most tests need no model. The end-to-end tests run the whole benchmark (specfork strategies and
the transformers baselines) on a tiny random-weight Llama checkpoint folder made here, with a
byte-level tokenizer and a chat template, so they take seconds and need no download.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import pytest
from rich.console import Console

from specfork.bench.prompts import BenchPrompt, builtin_prompts, load_prompts, select_prompts
from specfork.bench.quality import compare_greedy, first_divergence, target_logprob, top2_gap
from specfork.bench.records import BenchStrategy, Measurement, PreparedPrompt, RunOutput
from specfork.bench.report import PLOT_FILES, load_results, write_all
from specfork.bench.runner import BenchSettings, run_benchmark, run_interleaved, run_order
from specfork.bench.specs import ensure_plain, parse_strategies, parse_strategy
from specfork.bench.summary import per_prompt_figures, summarize
from specfork.cli import bench as bench_command
from specfork.cli.bench import settings_from_args
from specfork.errors import ConfigError, PromptError
from tiny_models import tiny_chat_llama

HAVE_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None

# ----------------------------------------------------------------------------- specs


def test_spec_parsing() -> None:
    s = parse_strategy("speculative:ngram?k=4&k_policy=heuristic")
    assert s.label == "speculative:ngram?k=4&k_policy=heuristic" and s.family == "specfork"
    assert (s.spec.strategy, s.spec.drafter, s.spec.k, s.spec.k_policy) == (
        "speculative",
        "ngram",
        4,
        "heuristic",
    )
    assert parse_strategy("ar").is_plain
    assert parse_strategy("speculative").spec.drafter == "ngram"  # the SpecConfig default
    m = parse_strategy("speculative:model:/some/draft.gguf?k=3")
    assert m.spec.drafter == "model:/some/draft.gguf" and m.spec.k == 3
    # '-' for '_', optional fields take "none"
    o = parse_strategy("speculative:self?skip-layers=10-19&self_layers=none&max_ngram=4")
    assert (o.spec.skip_layers, o.spec.self_layers, o.spec.max_ngram) == ("10-19", None, 4)
    hf = parse_strategy("hf:prompt-lookup?k=10")
    assert (hf.family, hf.method, hf.options) == ("hf", "prompt-lookup", {"k": 10})
    assert parse_strategy("hf:assisted?draft=smollm2-135m-instruct").options["draft"]


def test_spec_list_and_plain_added() -> None:
    specs = parse_strategies(["speculative:ngram?k=2,hf:ar", "speculative:self"])
    assert [s.label for s in specs] == ["speculative:ngram?k=2", "hf:ar", "speculative:self"]
    with_ar, added = ensure_plain(specs)
    assert added and with_ar[0].label == "ar" and len(with_ar) == 4
    assert ensure_plain(with_ar) == (with_ar, False)


def test_options_convert_as_the_schema_says() -> None:
    """Tuples, flags and optional strings take the schema's text forms; a comma inside an
    option value stays with its spec."""
    from specfork.bench import specs as specs_mod

    s = parse_strategy("dspark:ngram?weights=0.5,0.25,0.25&goodput=no&self_layers=none")
    assert (s.spec.weights, s.spec.goodput, s.spec.self_layers) == ((0.5, 0.25, 0.25), False, None)
    with pytest.raises(ConfigError, match="comma-separated numbers"):
        parse_strategy("dspark:ngram?weights=0.3,abc,0.1")
    with pytest.raises(ConfigError, match="true or false"):
        parse_strategy("speculative:ngram?goodput=maybe")
    parts = specs_mod.split_strategy_list("ar,dspark:ngram?weights=0.3,0.3,0.4,hf:ar")
    assert parts == ["ar", "dspark:ngram?weights=0.3,0.3,0.4", "hf:ar"]


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("bogus", ["unknown strategy 'bogus'", "ar, speculative", "hf"]),
        ("speculative:ngram?kk=3", ["unknown option 'kk'", "k_policy", "max_ngram"]),
        ("speculative:ngram?k=four", ["k='four'", "must be an integer"]),
        ("speculative:ngram?k=0", ["k (draft length)", ">= 1"]),
        ("speculative:bogus", ["unknown drafter"]),
        ("speculative:ngram?k_policy=fastest", ["unknown draft-length policy"]),
        (
            "dspark:ngram?forks=2",
            ["forks is an option of strategy spork", "this one uses strategy dspark"],
        ),
        ("spork?k=3", ["k is an option of strategy speculative", "forks, depth and budget"]),
        ("speculative:ngram?k", ["not key=value"]),
        ("speculative:ngram?k=2&k=3", ["given twice"]),
        ("speculative:ngram?strategy=ar", ["prefix"]),
        ("ar:ngram", ["takes no drafter"]),
        ("speculative:", ["nothing after ':'"]),
        ("hf:fast", ["hf:ar, hf:prompt-lookup, hf:assisted"]),
        ("hf:ar?k=3", ["unknown option 'k' for hf:ar"]),
        ("hf:prompt-lookup?k=x", ["must be an integer"]),
        ("hf:assisted?schedule=often", ["schedule must be one of"]),
        ("ar,ar", ["listed twice"]),
        ("", ["no strategies"]),
    ],
)
def test_bad_specs(text: str, words: list[str]) -> None:
    with pytest.raises(ConfigError) as exc:
        parse_strategies(text)
    for w in words:
        assert w in str(exc.value), (w, str(exc.value))


# ----------------------------------------------------------------------------- prompts


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def test_prompt_file_and_selection(tmp_path: Path) -> None:
    rows = [
        {"question_id": i, "category": c, "turns": [f"q{i}", "second turn"]}
        for i, c in enumerate(["a", "a", "b", "a", "c", "b"])
    ]
    path = _jsonl(tmp_path / "p.jsonl", [rows[0], "", *rows[1:]])  # a blank line is skipped
    prompts = load_prompts(path)
    assert [p.text for p in prompts] == [f"q{i}" for i in range(6)]
    assert [p.question_id for p in select_prompts(prompts, per_category=1)] == [0, 2, 4]
    assert [p.question_id for p in select_prompts(prompts, per_category=2, limit=3)] == [0, 1, 2]
    built_in = builtin_prompts()
    assert 6 <= len(built_in) <= 12 and len({p.category for p in built_in}) == 6


@pytest.mark.parametrize(
    ("lines", "where", "words"),
    [
        (['{"turns": ["ok"]}', "{not json"], 2, "not valid JSON"),
        (['{"turns": ["ok"]}', "", '{"turns": []}'], 3, "non-empty list"),
        (['["a list"]'], 1, "got a JSON list"),
        (['{"turns": ["ok"]}', '{"turns": [""]}'], 2, "non-empty string"),
        (['{"turns": ["ok"], "category": 5}'], 1, "'category'"),
        (['{"question": "no turns"}'], 1, "'turns'"),
    ],
)
def test_prompt_file_errors_name_the_line(tmp_path: Path, lines, where, words) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(PromptError, match=rf"bad\.jsonl:{where}: .*{words}"):
        load_prompts(path)


def test_prompt_files_in_three_formats(tmp_path: Path) -> None:
    text = tmp_path / "prompts.txt"
    text.write_text("First prompt.\n\n  Second, with {braces}.\n")
    assert [(p.text, p.category) for p in load_prompts(text)] == [
        ("First prompt.", "text"),
        ("Second, with {braces}.", "text"),
    ]
    simple = tmp_path / "simple.jsonl"
    simple.write_text('{"prompt": "Hello"}\n{"prompt": "Bye", "category": "qa"}\n')
    assert [(p.text, p.category) for p in load_prompts(simple)] == [
        ("Hello", "uncategorized"),
        ("Bye", "qa"),
    ]
    bare = tmp_path / "prompts"  # no suffix: JSON when the first line is an object
    bare.write_text('{"turns": ["A", "B"]}\n')
    assert [p.text for p in load_prompts(bare)] == ["A"]
    bare.write_text("Plain words\n")
    assert [p.text for p in load_prompts(bare)] == ["Plain words"]


def test_empty_or_missing_prompt_file(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(PromptError, match="no prompts"):
        load_prompts(empty)
    with pytest.raises(PromptError, match="cannot read"):
        load_prompts(tmp_path / "missing.jsonl")


# ----------------------------------------------------------------------------- run order


def _fake(label: str, calls: list, tps: float = 10.0, fail_on: int | None = None) -> BenchStrategy:
    def run(ids: list[int]) -> RunOutput:
        calls.append((label, ids[0]))
        if fail_on is not None and ids[0] == fail_on:
            raise RuntimeError("boom")
        return RunOutput(
            token_ids=[1, 2, 3],
            new_tokens=3,
            decode_tokens_per_second=tps,
            time_to_first_token=0.01,
            target_forwards=2,
            drafted=4,
            accepted=2,
        )

    return BenchStrategy(label, "specfork", run)


def _prompts(n: int, categories: tuple[str, ...] = ("cat",)) -> list[PreparedPrompt]:
    return [
        PreparedPrompt(i, BenchPrompt(i, categories[i % len(categories)], f"p{i}"), [100 + i])
        for i in range(n)
    ]


def test_interleaving_order_warmup_and_rotation() -> None:
    calls: list = []
    strategies = [_fake(x, calls) for x in ("ar", "s1", "s2")]
    ms = run_interleaved(strategies, _prompts(2), repeats=2, warmup=1, measure_memory=False)
    warm = [("ar", 100), ("s1", 100), ("s2", 100)]
    one = ["ar", "s1", "s2", "s1", "s2", "ar"]  # repeat 2 starts one strategy later
    expected = [(label, 100) for label in one] + [(label, 101) for label in one]
    assert calls == warm + expected
    assert [(m.strategy, m.prompt_index, m.repeat) for m in ms] == [
        (label, ids - 100, i // 3 % 2) for i, (label, ids) in enumerate(expected)
    ]
    assert [m.sequence for m in ms] == list(range(12))
    assert run_order(3, 4) == [1, 2, 0]


def test_a_failing_strategy_does_not_stop_the_others() -> None:
    calls: list = []
    broken_warmup = _fake("broken", calls, fail_on=100)  # fails in the warm-up: skipped after
    flaky = _fake("flaky", calls, fail_on=101)  # fails on one prompt only
    never_built = BenchStrategy("unbuilt", "specfork", None, error="cannot build: no model")
    strategies = [_fake("ar", calls), broken_warmup, flaky, never_built]
    ms = run_interleaved(strategies, _prompts(3), repeats=1, warmup=1, measure_memory=False)
    assert broken_warmup.error and "boom" in broken_warmup.error
    assert not any(m.strategy in ("broken", "unbuilt") for m in ms)
    bad = [m for m in ms if not m.ok]
    assert [(m.strategy, m.prompt_index) for m in bad] == [("flaky", 1)]
    assert bad[0].error == "RuntimeError: boom"
    assert sum(m.ok for m in ms) == 5  # ar × 3 + flaky × 2


# ----------------------------------------------------------------------------- near-ties


def test_first_divergence_and_near_tie_rule() -> None:
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 7]) == 2  # a prefix: differs where it ends
    seen = []

    def gap(pos: int) -> float:
        seen.append(pos)
        return {1: 0.125, 2: 3.0}[pos]

    assert compare_greedy([1, 2, 3], [1, 2, 3], gap).status == "exact"
    assert seen == []  # no target forward for equal outputs
    tie = compare_greedy([1, 2, 3], [1, 9, 9], gap, tolerance=0.25)
    assert (tie.status, tie.position, tie.gap) == ("near-tie", 1, 0.125)
    assert compare_greedy([1, 2, 3], [1, 2, 9], gap, tolerance=0.25).status == "differs"
    assert compare_greedy([1, 2, 3], [1, 2, 9], gap, tolerance=5.0).status == "near-tie"


def _m(seq: int, label: str, prompt: int, ids: list[int], tps: float) -> Measurement:
    out = RunOutput(
        token_ids=ids,
        new_tokens=len(ids),
        decode_tokens_per_second=tps,
        time_to_first_token=0.1,
        target_forwards=len(ids) - 1,
    )
    return Measurement(seq, label, prompt, prompt, "cat" if prompt else "dog", 0, True, output=out)


def test_match_rates_and_medians_from_measurements() -> None:
    prompts = _prompts(2, ("dog", "cat"))
    ms = [
        _m(0, "ar", 0, [1, 2, 3, 4], 10.0),
        _m(1, "spec", 0, [1, 2, 3, 4], 20.0),
        _m(2, "ar", 1, [5, 6, 7, 8], 10.0),
        _m(3, "spec", 1, [5, 6, 9, 9], 5.0),
    ]
    contexts = []

    def gap_fn(ctx: list[int]) -> float:
        contexts.append(ctx)
        return 0.1

    rows = per_prompt_figures(ms, ["ar", "spec"], prompts, gap_fn=gap_fn)
    assert contexts == [[101, 5, 6]]  # prompt ids + the reference's tokens before the split
    spec = {r["prompt_index"]: r for r in rows if r["strategy"] == "spec"}
    assert spec[0]["speedup"] == 2.0 and spec[0]["greedy_match"] == "exact"
    assert spec[1]["greedy_match"] == "near-tie" and spec[1]["divergence_position"] == 2
    summary = summarize(rows, ["ar", "spec"], ["dog", "cat"])
    assert summary["spec"]["overall"]["speedup"] == pytest.approx(1.25)  # median of 2.0, 0.5
    assert summary["spec"]["overall"]["greedy_match_rate"] == 1.0
    assert summary["spec"]["overall"]["exact_match_rate"] == 0.5
    assert summary["spec"]["cat"]["speedup"] == 0.5
    assert summary["ar"]["overall"]["target_forwards_per_token"] == 0.75
    strict = per_prompt_figures(ms, ["spec"], prompts, reference="ar", gap_fn=lambda c: 1.0)
    assert [r["greedy_match"] for r in strict] == ["exact", "differs"]


def test_round_efficiency_and_where_the_time_goes() -> None:
    """Efficiency: the run's forwards at plain decoding's step cost on the same prompt (its
    decode time over its forwards) over the run's decode time; shares of decode time by phase,
    the rest as "other"."""
    prompts = _prompts(1, ("dog",))
    plain = RunOutput(
        token_ids=[1] * 11,
        new_tokens=11,
        decode_tokens_per_second=10.0,
        time_to_first_token=0.1,
        target_forwards=10,
        decode_seconds=1.0,
        phase_seconds={"forward": 0.8},
        plain_steps=10.0,
    )
    spec = RunOutput(
        token_ids=[1] * 11,
        new_tokens=11,
        decode_tokens_per_second=12.5,
        time_to_first_token=0.1,
        target_forwards=4,
        decode_seconds=0.8,
        phase_seconds={"draft": 0.2, "forward": 0.4, "learn": 0.04},
        plain_steps=6.0,
        paused_rounds=1,
    )
    ms = [
        Measurement(0, "ar", 0, 0, "dog", 0, True, output=plain),
        Measurement(1, "spec", 0, 0, "dog", 0, True, output=spec),
    ]
    rows = {r["strategy"]: r for r in per_prompt_figures(ms, ["ar", "spec"], prompts)}
    assert rows["ar"]["round_efficiency"] == pytest.approx(1.0)
    assert rows["spec"]["round_efficiency"] == pytest.approx(6 * 0.1 / 0.8)  # 0.75
    assert rows["spec"]["forward_share"] == pytest.approx(0.5)
    assert rows["spec"]["paused_share"] == pytest.approx(0.25)  # 1 of its 4 rounds
    assert rows["spec"]["share_draft"] == pytest.approx(0.25)
    assert rows["spec"]["share_other"] == pytest.approx(0.2)
    assert rows["ar"]["share_draft"] == 0.0 and rows["ar"]["share_other"] == pytest.approx(0.2)
    summary = summarize(list(rows.values()), ["ar", "spec"], ["dog"])
    assert summary["spec"]["overall"]["round_efficiency"] == pytest.approx(0.75)
    no_split = RunOutput(
        token_ids=[1], new_tokens=1, decode_tokens_per_second=1.0, time_to_first_token=0.1
    )  # another engine: no phases
    other = Measurement(2, "hf", 0, 0, "dog", 0, True, output=no_split)
    assert other.figure("forward_share") is None and other.figure("share_other") is None
    assert other.figure("paused_share") is None


# ----------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random Llama with a byte-level tokenizer (no merges) and a chat template."""
    return tiny_chat_llama(tmp_path_factory.mktemp("tiny-bench"))


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="specfork")
    bench_command.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["bench", *argv])


def test_bad_input_fails_before_loading(tmp_path: Path) -> None:
    base = ["--model", "no-such-model", "--out", str(tmp_path / "out")]
    with pytest.raises(ConfigError, match="unknown strategy"):
        bench_command.run(_args(*base, "--strategies", "ar,fast"), Console(file=None))
    bad = _jsonl(tmp_path / "bad.jsonl", [{"turns": ["ok"]}, "oops"])
    with pytest.raises(PromptError, match=r"bad\.jsonl:2"):
        bench_command.run(_args(*base, "--prompts", str(bad)), Console())
    with pytest.raises(ConfigError, match="--per-category must be >= 1"):
        bench_command.run(_args(*base, "--per-category", "0"), Console())
    with pytest.raises(ConfigError, match="repeats"):
        bench_command.run(_args(*base, "--repeats", "0"), Console())
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match="cannot write to the output folder"):
        bench_command.run(
            _args("--model", "no-such-model", "--out", str(blocker / "sub")), Console()
        )
    settings = settings_from_args(_args(*base, "--strategies", "speculative:ngram"))
    assert [s.label for s in settings.strategies] == ["ar", "speculative:ngram"]
    assert settings.notes and "added" in settings.notes[0]


@pytest.mark.usefixtures("one_thread")
def test_bench_end_to_end(tiny_folder: Path, tmp_path: Path, capsys) -> None:
    prompts = _jsonl(
        tmp_path / "p.jsonl",
        [
            {
                "question_id": 1,
                "category": "summarization",
                "turns": ["Repeat: the cat sat on the mat, the cat sat on the mat."],
            },
            {"question_id": 2, "category": "qa", "turns": ["Why is the sky blue?"]},
            {"question_id": 3, "category": "qa", "turns": ["Not picked: --per-category 1"]},
        ],
    )
    out = tmp_path / "out"
    argv = [
        "--model",
        str(tiny_folder),
        "--dtype",
        "float32",
        "--device",
        "cpu",
        "--prompts",
        str(prompts),
        "--per-category",
        "1",
        "-n",
        "8",
        "--ignore-eos",
        "--repeats",
        "2",
        "--out",
        str(out),
        "--quiet",
        "--strategies",
        "speculative:ngram?k=3,speculative:self?self_layers=0-1&k=2&goodput=false,hf:ar,"
        "hf:prompt-lookup?k=3,hf:assisted?k=2",
    ]
    code = bench_command.run(_args(*argv), Console(stderr=True, width=200))
    stdout = capsys.readouterr().out
    assert code == 0
    assert "speedup by category" in stdout and "hf:prompt-lookup?k=3" in stdout
    doc = load_results(out)
    assert (out / "results.json.gz").read_bytes()[:2] == b"\x1f\x8b"  # gzip
    assert set(doc) >= {
        "schema",
        "created",
        "machine",
        "settings",
        "reference",
        "notes",
        "categories",
        "strategies",
        "prompts",
        "measurements",
        "per_prompt",
        "summary",
    }
    assert doc["schema"] == "specfork-bench/1" and doc["reference"] == "ar"
    assert set(doc["machine"]) >= {"cpu", "threads", "torch", "dtype", "specfork", "command"}
    assert doc["machine"]["dtype"] == "float32"
    labels = [
        "ar",
        "speculative:ngram?k=3",
        "speculative:self?self_layers=0-1&k=2&goodput=false",
        "hf:ar",
        "hf:prompt-lookup?k=3",
        "hf:assisted?k=2",
    ]
    assert [s["label"] for s in doc["strategies"]] == labels
    assert all(s["status"] == "ok" for s in doc["strategies"]), doc["strategies"]
    assert any("added" in n for n in doc["notes"])
    assert doc["categories"] == ["summarization", "qa"] and len(doc["prompts"]) == 2
    ms = doc["measurements"]
    assert len(ms) == 6 * 2 * 2 and all(m["ok"] for m in ms)
    # prompt by prompt, every strategy once per repeat
    assert [m["prompt_index"] for m in ms] == [0] * 12 + [1] * 12
    for m in ms:
        assert m["output_tokens"] == 8 and m["decode_tokens_per_second"] > 0
        assert m["peak_rss_mb"] > 0
        assert (m["rounds"] is not None) == (m["repeat"] == 0 and m["strategy"] in labels[:3])
    self_draft = next(m for m in ms if m["strategy"] == labels[2] and m["repeat"] == 0)
    assert self_draft["acceptance_rate"] == 1.0  # the drafter runs all the target's layers
    overall = doc["summary"]["ar"]["overall"]
    assert overall["speedup"] == 1.0 and overall["greedy_match_rate"] == 1.0
    assert overall["target_forwards_per_token"] > 0 and overall["wasted_drafts_per_token"] == 0
    assert overall["round_efficiency"] == pytest.approx(1.0)  # plain decoding against itself
    for label in labels[:3]:  # specfork's strategies: the split of their decode time
        cell = doc["summary"][label]["overall"]
        assert 0 < cell["forward_share"] <= 1 and cell["round_efficiency"] > 0
        shares = [
            cell[f"share_{p}"]
            for p in ("draft", "prepare", "forward", "accept", "commit", "learn", "other")
        ]
        assert sum(shares) == pytest.approx(1.0, abs=0.05)
    assert doc["summary"]["hf:ar"]["overall"]["forward_share"] is None
    for label in labels:
        cell = doc["summary"][label]["overall"]
        assert cell["prompts"] == 2 and cell["failed"] == 0 and cell["speedup"] > 0
        assert cell["greedy_match_rate"] is not None  # n/a only when sampling
    assert doc["summary"]["hf:ar"]["overall"]["acceptance_rate"] is None  # n/a for transformers
    report = (out / "report.md").read_text()
    assert "## Overall" in report and "## Where decode time goes" in report
    assert "round efficiency" in report and "where decode time goes" in stdout
    assert "## Drafts by source" in report and f"| {labels[2]} | self | 100% |" in report
    for label in labels[1:3]:  # every drafted token counted under a source
        for m in (m for m in ms if m["strategy"] == label):
            assert sum(d for d, _ in m["by_source"].values()) == m["drafted"]
    if not HAVE_MATPLOTLIB:
        assert any("matplotlib is not installed" in n for n in doc["notes"])
        return
    assert "speedup.png" in report
    for name in ("speedup", "acceptance"):
        assert (out / PLOT_FILES[name]).stat().st_size > 1000
    for name in ("dspark", "forks"):  # no DSpark/SPORK round fields: no such plots
        assert not (out / PLOT_FILES[name]).exists()


@pytest.mark.usefixtures("one_thread")
def test_failed_strategy_is_recorded(tiny_folder: Path) -> None:
    from specfork.loading.loader import load_model

    loaded = load_model(str(tiny_folder), dtype="float32", device="cpu", progress=False)
    settings = BenchSettings(
        parse_strategies("speculative:model:/no/such/draft.gguf,speculative:ngram?k=2"),
        [BenchPrompt(1, "qa", "Hello there")],
        max_new_tokens=4,
        repeats=1,
        warmup=0,
    )
    results = run_benchmark(settings, loaded=loaded, show_progress=False)
    status = {s.label: s.status for s in results.strategies}
    assert status == {
        "ar": "ok",
        "speculative:model:/no/such/draft.gguf": "failed",
        "speculative:ngram?k=2": "ok",
    }
    assert any("/no/such/draft.gguf" in n for n in results.notes)
    assert len(results.measurements) == 2
    gap = top2_gap(loaded, results.prompts[0].ids)
    assert gap >= 0
    # the output's mean log-probability under the target, by hand: one step at a time
    prompt = list(results.prompts[0].ids)
    out = next(m.output.token_ids for m in results.measurements if m.ok)
    ctx, total = list(prompt), 0.0
    for t in out:
        cache = loaded.model.new_cache(len(ctx) + 4)
        total += float(loaded.model.extend(ctx, cache).log_softmax(-1)[t])
        ctx.append(t)
    assert target_logprob(loaded, prompt, out) == pytest.approx(total / len(out), abs=1e-4)
    assert target_logprob(loaded, prompt, []) is None
    ar = results.summary["ar"]["overall"]["target_logprob"]
    assert ar is not None and ar <= 0


@pytest.mark.usefixtures("one_thread")
def test_seeded_sampled_runs_are_judged_token_for_token(tiny_folder: Path) -> None:
    """With a seed, specfork's strategies emit seeded plain decoding's tokens: the bench
    compares them exactly (100% here); without a seed nothing is judged."""
    from specfork.loading.loader import load_model

    loaded = load_model(str(tiny_folder), dtype="float32", device="cpu", progress=False)
    prompts = [BenchPrompt(1, "qa", "abc abc abc abc"), BenchPrompt(2, "qa", "one two one two")]
    strategies = parse_strategies("speculative:ngram?k=3,spork:recycle+ngram")
    for seed, judged in ((5, True), (None, False)):
        settings = BenchSettings(
            strategies,
            prompts,
            max_new_tokens=12,
            repeats=1,
            warmup=0,
            temperature=0.9,
            seed=seed,
            ignore_eos=True,
        )
        results = run_benchmark(settings, loaded=loaded, show_progress=False)
        rates = {
            label: results.summary[label]["overall"]["greedy_match_rate"]
            for label in ("ar", *(s.label for s in strategies))
        }
        assert rates == dict.fromkeys(rates, 1.0 if judged else None), rates
        assert any(("seed 5" if judged else "without a seed") in n for n in results.notes)


@pytest.mark.skipif(not HAVE_MATPLOTLIB, reason="plots need matplotlib")
def test_dspark_and_fork_plots_from_round_dicts(tmp_path: Path) -> None:
    """The K/C trace and the fork histogram read generic round dicts with extra keys."""

    def rounds(extra):
        return [
            {
                "round": i,
                "position": 2 * i,
                "k": 3 + i % 2,
                "drafted": 3,
                "accepted": 1,
                "emitted": 2,
                **extra(i),
            }
            for i in range(6)
        ]

    def measurement(label, rs):
        return {
            "strategy": label,
            "prompt_index": 0,
            "ok": True,
            "rounds": rs,
            "accepted_by_position": [3, 1],
            "drafted_by_position": [4, 4],
        }

    summary = {
        label: {c: {"speedup": 1.2, "prompts": 1} for c in ("qa", "overall")}
        for label in ("ar", "dspark:ngram", "spork:recycle")
    }
    doc = {
        "schema": "specfork-bench/1",
        "created": "now",
        "reference": "ar",
        "notes": [],
        "machine": {
            "cpu": "cpu",
            "threads": 1,
            "torch": "x",
            "transformers": None,
            "specfork": "0",
            "dtype": "float32",
            "device": "cpu",
            "command": "c",
        },
        "settings": {
            "model": "m",
            "prompts_source": "s",
            "max_new_tokens": 8,
            "ignore_eos": False,
            "temperature": 0.0,
            "warmup": 0,
            "repeats": 1,
            "near_tie_tolerance": 0.25,
        },
        "categories": ["qa"],
        "prompts": [{"index": 0}],
        "strategies": [{"label": x, "family": "specfork", "status": "ok"} for x in summary],
        "measurements": [
            measurement("dspark:ngram", rounds(lambda i: {"confidence": 0.9 - 0.1 * i})),
            measurement("spork:recycle", rounds(lambda i: {"fork": [0, 1, None][i % 3]})),
        ],
        "summary": summary,
    }
    written = write_all(doc, tmp_path)
    assert {p.name for p in written["plots"]} == set(PLOT_FILES.values())
    assert all(p.stat().st_size > 1000 for p in written["plots"])
    assert "dspark_trace.png" in written["report"].read_text()
    # a later run into the same folder without DSpark or forks: their old plots go
    doc["measurements"] = [measurement("dspark:ngram", rounds(lambda i: {}))]
    doc["strategies"] = doc["strategies"][:1]
    rewritten = {p.name for p in write_all(doc, tmp_path)["plots"]}
    assert "dspark_trace.png" not in rewritten and "fork_wins.png" not in rewritten
    assert {p.name for p in tmp_path.glob("*.png")} == rewritten


def test_help_documents_the_spec_syntax(capsys) -> None:
    with pytest.raises(SystemExit):
        _args("--help")
    out = capsys.readouterr().out
    for words in (
        "strategy[:drafter][?key=value&key=value]",
        "k_policy",
        "hf:prompt-lookup",
        "hf:assisted?draft=",
        "results.json",
    ):
        assert words in out, words


def test_results_are_gzip_and_old_plain_files_still_read(tmp_path: Path) -> None:
    import gzip

    from specfork.bench.report import write_results_json

    doc = {"schema": "specfork-bench/1", "summary": {"ar": {}}, "notes": ["é"]}
    new = tmp_path / "new"
    new.mkdir()
    path = write_results_json(doc, new)
    assert path.name == "results.json.gz" and json.loads(gzip.decompress(path.read_bytes())) == doc
    assert write_results_json(doc, new).read_bytes() == path.read_bytes()  # no timestamp inside
    old = tmp_path / "old"
    old.mkdir()
    (old / "results.json").write_text(json.dumps(doc))  # written before compression
    for where in (new, path, old, old / "results.json"):
        assert load_results(where) == doc
    renamed = tmp_path / "copy.json"  # gzip is recognised by its bytes, whatever the name
    renamed.write_bytes(path.read_bytes())
    assert load_results(renamed) == doc
    with pytest.raises(ConfigError, match=r"has no results\.json\.gz"):
        load_results(tmp_path)
    (tmp_path / "broken.json.gz").write_bytes(path.read_bytes()[:20])
    with pytest.raises(ConfigError, match="not a bench results file"):
        load_results(tmp_path / "broken.json.gz")
    (tmp_path / "other.json").write_text('{"a": 1}')
    with pytest.raises(ConfigError, match="no 'summary'"):
        load_results(tmp_path / "other.json")
    with pytest.raises(ConfigError, match="cannot read the results file"):
        load_results(tmp_path / "missing.json")


def test_identical_acceptance_curves_are_one_labelled_line() -> None:
    from specfork.bench.report import _merge_identical

    curves = {"a": [0.5, 0.25], "b": [0.5, 0.25], "c": [0.5, float("nan")]}
    assert _merge_identical(curves) == {"a = b": [0.5, 0.25], "c": curves["c"]}
