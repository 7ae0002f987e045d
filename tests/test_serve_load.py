"""The load run of `specfork serve` (benchmarks/serve_load.py, specfork.bench.load[_report]).

End to end on real in-process servers of a tiny random model (concurrency 1 and 2, 2 requests,
4 tokens): the structure of the results, equal greedy texts across configurations and
concurrency levels, and the files written; the same for a workload replay (two multi-turn
chats, every turn after the server's own answers). The replay's request building is checked on
a fake client. The text check is shown to fail on servers of two
different models. Figures are computed from fabricated runs where their values are asserted;
nothing depends on timing.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from collections.abc import Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from types import ModuleType

import pytest

from specfork.bench.load import (
    LIBRARY_PROMPTS,
    InProcessServers,
    LevelRun,
    LibraryCheck,
    LoadConfig,
    LoadSettings,
    RequestSample,
    SweepResult,
    configurations,
    parse_load_strategies,
    percentile,
    sweep,
)
from specfork.bench.load_replay import (
    Conversation,
    replay_level,
    replay_runner,
    workload_conversations,
)
from specfork.bench.load_report import LoadReport, ratios, summarize, write_outputs
from specfork.bench.prompt_file import Prompt
from specfork.config import SpecConfig
from specfork.engine.thread import model_thread, run_in
from specfork.errors import ConfigError, SpecforkError
from specfork.loading.loader import load_model
from specfork.server.worker import ServerSettings
from tiny_models import tiny_chat_llama

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "serve_load.py"
PROMPTS = ["Repeat: one two three, one two three.", "Why is the sky blue?"]
PLAIN, NGRAM = SpecConfig(), SpecConfig("speculative", "ngram", k=4)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_chat_llama(tmp_path_factory.mktemp("tiny-load"))


@pytest.fixture(scope="module")
def script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("serve_load", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _servers(folder: Path) -> InProcessServers:
    thread = model_thread()
    loaded = run_in(thread, load_model, str(folder), dtype="float32", device="cpu", progress=False)
    return InProcessServers(loaded, thread, max_context=256)


# ----------------------------------------------------------------------------- settings


def test_settings_and_strategies() -> None:
    assert LoadSettings().concurrency == (1, 2, 4, 8, 16, 32)
    settings = LoadSettings(concurrency=(1, 8), requests=4)
    assert [settings.requests_at(c) for c in (1, 8)] == [16, 16]  # 2 per client of the largest
    assert LoadSettings(concurrency=(1, 2), requests=8).requests_at(1) == 8
    for bad, words in (
        ({"concurrency": (1, 0)}, "--concurrency must list integers >= 1"),
        ({"concurrency": ()}, "--concurrency"),
        ({"concurrency": (2, 2)}, "lists a level twice"),
        ({"requests": 0}, "--requests must be an integer >= 1"),
        ({"max_tokens": True}, "--max-tokens must be an integer >= 1"),
        ({"repeats": 0}, "--repeats"),
    ):
        with pytest.raises(ConfigError, match=words):
            LoadSettings(**bad)

    strategies = parse_load_strategies("ngram,dspark,speculative:ngram?k=6&k_policy=heuristic")
    assert [label for label, _ in strategies] == [
        "ar (plain)",
        "speculative ngram k=4",
        "dspark ngram",
        "speculative:ngram?k=6&k_policy=heuristic",
    ]
    assert strategies[1][1] == NGRAM and strategies[2][1].strategy == "dspark"
    assert strategies[3][1].k == 6 and strategies[3][1].k_policy == "heuristic"
    with pytest.raises(ConfigError, match="not a strategy specfork serves"):
        parse_load_strategies("ar,hf:ar")
    with pytest.raises(ConfigError, match="unknown strategy 'fast'"):
        parse_load_strategies("ar,fast")

    configs = configurations(strategies[:2], max_running=4)
    assert [c.label for c in configs] == [
        "ar (plain), max-running 4",
        "ar (plain), max-running 1",
        "speculative ngram k=4, max-running 4",
        "speculative ngram k=4, max-running 1",
    ]
    assert [c.max_running for c in configurations(strategies[:2], 1)] == [1, 1]
    with pytest.raises(ConfigError, match="--max-running must be an integer >= 1"):
        configurations(strategies, 0)


def test_server_settings_max_running() -> None:
    assert ServerSettings("m").max_running == 8
    assert ServerSettings("m", max_running=1).max_running == 1
    for bad in (0, -2, True, 2.0, "4"):
        with pytest.raises(
            SpecforkError, match=f"max_running must be an integer >= 1, got {bad!r}"
        ):
            ServerSettings("m", max_running=bad)


def test_percentile() -> None:
    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert [percentile(values, q) for q in (0.0, 0.5, 0.95, 1.0)] == [1.0, 3.0, 5.0, 5.0]
    assert percentile([7.0], 0.95) == 7.0
    assert percentile(list(map(float, range(1, 21))), 0.95) == 19.0  # nearest rank of 20
    with pytest.raises(ValueError, match="no values"):
        percentile([], 0.5)


# ----------------------------------------------------------------------------- report logic


def _sample(prompt: int, text: str, tokens: int = 10, latency: float = 1.0) -> RequestSample:
    return RequestSample(prompt, text, tokens, latency, latency / 4, 20.0, 1.5, 4)


def _run(config: LoadConfig, c: int, wall: float, texts: Sequence[str] = ("a", "b")) -> LevelRun:
    samples = [_sample(i % 2, texts[i % 2], latency=float(i + 1)) for i in range(2 * c)]
    return LevelRun(config.label, 0, c, wall, samples)


def test_figures_ratios_and_text_mismatch_named() -> None:
    configs = configurations([("ar (plain)", PLAIN), ("ngram", NGRAM)], max_running=4)
    walls = {configs[0]: 2.0, configs[1]: 4.0, configs[2]: 1.0, configs[3]: 2.0}
    runs = [_run(cfg, c, wall * c) for cfg, wall in walls.items() for c in (1, 2)]
    runs[-1] = _run(configs[3], 2, 4.0, texts=("a", "b!"))  # ngram, max-running 1, 2 clients
    report = LoadReport(
        configs, LoadSettings((1, 2), 2, 10), ["p0", "p1"], SweepResult(runs, {}), {"model": "fake"}
    )

    row = report.rows[0]  # ar (plain), max-running 4, 1 client: 2 requests x 10 tokens in 2 s
    assert (row.config, row.concurrency, row.requests) == (configs[0].label, 1, 2)
    assert (row.requests_per_s, row.tokens_per_s, row.p50, row.p95) == (1.0, 10.0, 1.0, 2.0)
    assert row.mean_accepted == 1.5
    on_off = report.ratios["speculation on / off"]
    assert on_off == {
        "ngram, max-running 4 / ar (plain)": {1: 2.0, 2: 2.0},
        "ngram, max-running 1 / ar (plain)": {1: 2.0, 2: 2.0},
    }
    assert report.ratios["max-running N / max-running 1"] == {
        "ar (plain): max-running 4 / 1": {1: 2.0, 2: 2.0},
        "ngram: max-running 4 / 1": {1: 2.0, 2: 2.0},
    }
    assert ratios(summarize(SweepResult(runs[:2], {}), configs[:1]), configs[:1]) == {
        "speculation on / off": {},
        "max-running N / max-running 1": {},
    }

    assert [(r.config, r.concurrency) for r in report.rows if r.differing] == [
        (configs[3].label, 2)
    ]
    line = (
        "prompt 1 ('p1'): ngram, max-running 1 at 2 clients (repeat 1) differs from "
        "ar (plain), max-running 4 at 1 client at character 1"
    )
    assert report.mismatch_lines() == [line, line]  # the 2nd and 4th request ask prompt 1
    table = report.markdown()
    assert "| ngram, max-running 1 | 2 | 4 |" in table and "| no (2 of 4) |" in table
    assert report.to_json()["same_text"] is False


def test_server_decode_speed_is_read_on_the_library_checks_prompts() -> None:
    """The library's decode check runs the first LIBRARY_PROMPTS prompts: the server's figure
    beside it comes from its requests on those prompts, not from longer ones."""
    config = configurations([("ar (plain)", PLAIN)], max_running=2)[0]
    speeds = {0: 200.0, 1: 220.0, LIBRARY_PROMPTS: 50.0, LIBRARY_PROMPTS + 1: 40.0}
    samples = [RequestSample(p, "t", 4, 40 / tps, 0.1, tps, 1.0, 4) for p, tps in speeds.items()]
    row = summarize(SweepResult([LevelRun(config.label, 0, 1, 4.0, samples)], {}), [config])[0]
    assert row.server_decode_tps == 210.0  # all four requests: 120.0
    assert row.server_latency == pytest.approx((40 / 200 + 40 / 220) / 2)
    later = range(LIBRARY_PROMPTS, LIBRARY_PROMPTS + 3)
    others = [RequestSample(p, "t", 4, 1.0, 0.1, 26.0 + p, 1.0, 4) for p in later]
    row = summarize(SweepResult([LevelRun(config.label, 0, 1, 4.0, others)], {}), [config])[0]
    assert row.server_decode_tps == 27.0 + LIBRARY_PROMPTS  # none on those prompts: all requests


# ----------------------------------------------------------------------------- end to end


@pytest.mark.usefixtures("one_thread")
def test_load_run_end_to_end(script: ModuleType, tiny_folder: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    argv = [
        "--model",
        str(tiny_folder),
        "--dtype",
        "float32",
        "--device",
        "cpu",
        "--max-context",
        "256",
        "--strategies",
        "ar,ngram",
        "--max-running",
        "2",
        "--concurrency",
        "1,2",
        "--requests",
        "2",
        "--max-tokens",
        "4",
        "--step-rows",
        "3",
        "--out",
        str(out),
    ]
    assert script.main(argv) == 0
    assert {p.name for p in out.iterdir()} == {"results.json", "table.md", "load.png"}
    assert (out / "load.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    doc = json.loads((out / "results.json").read_text())
    ngram = "speculative ngram k=4"
    labels = [
        "ar (plain), max-running 2",
        "ar (plain), max-running 1",
        f"{ngram}, max-running 2",
        f"{ngram}, max-running 1",
    ]
    assert [c["label"] for c in doc["configurations"]] == labels
    assert [c["max_running"] for c in doc["configurations"]] == [2, 1, 2, 1]
    runs = doc["runs"]
    assert [(r["config"], r["concurrency"]) for r in runs] == [
        (c, n) for c in labels for n in (1, 2)
    ]
    assert [len(r["samples"]) for r in runs] == [4, 4] * 4  # the same at every level
    assert [s["prompt"] for s in runs[0]["samples"]] == [0, 1, 2, 3]
    samples = [s for r in runs for s in r["samples"]]
    assert all(s["tokens"] == 4 for s in samples)  # EOS ignored: exactly --max-tokens each
    assert [s["prompt"] for s in runs[1]["samples"]] == [0, 1, 2, 3]
    texts: dict[int, set[str]] = {}
    for s in samples:
        texts.setdefault(s["prompt"], set()).add(s["text"])
    assert all(len(t) == 1 and next(iter(t)) for t in texts.values()), texts
    assert doc["same_text"] is True and doc["text_mismatches"] == []
    assert doc["step_rows"] == 3  # steps of 3 rows: prompts are split, texts the same
    assert sorted(doc["library_decode_tokens_per_s"]) == ["ar (plain)", "speculative ngram k=4"]
    latencies = doc["library_latency_s"]
    assert sorted(latencies) == ["ar (plain)", "speculative ngram k=4"]
    assert all(len(v) == 1 and v[0] > 0 for v in latencies.values())  # one repeat
    assert all(s["server_latency"] > 0 for s in doc["summary"])
    assert len(doc["summary"]) == 8 and doc["settings"]["concurrency"] == [1, 2]
    assert list(doc["ratios"]["speculation on / off"]) == [
        "speculative ngram k=4, max-running 2 / ar (plain)",
        "speculative ngram k=4, max-running 1 / ar (plain)",
    ]
    table = (out / "table.md").read_text()
    for label in labels:
        assert f"| {label} | 1 | 4 |" in table and f"| {label} | 2 | 4 |" in table
    assert "speculation on / off" in table and "max-running N / max-running 1" in table
    assert "latency (s), server (1 client)" in table  # the lone request against the library


class _TwoModels:
    """Servers of model A for plain decoding and of model B for speculation."""

    def __init__(self, a: InProcessServers, b: InProcessServers) -> None:
        self.a, self.b = a, b

    def _pick(self, spec: SpecConfig) -> InProcessServers:
        return self.b if spec.strategy != "ar" else self.a

    def serve(self, config: LoadConfig, queue_size: int) -> AbstractContextManager[str]:
        return self._pick(config.spec).serve(config, queue_size)

    def library_check(self, spec: SpecConfig, prompts: Sequence[str], n: int) -> LibraryCheck:
        return self._pick(spec).library_check(spec, prompts, n)


@pytest.mark.usefixtures("one_thread")
def test_text_check_catches_a_different_model(tiny_folder: Path, tmp_path: Path) -> None:
    other = tiny_chat_llama(tmp_path / "other", seed=1)
    servers = _TwoModels(_servers(tiny_folder), _servers(other))
    configs = configurations([("ar (plain)", PLAIN), ("ngram", NGRAM)], max_running=1)
    settings = LoadSettings(concurrency=(1,), requests=2, max_tokens=4)
    result = sweep(configs, PROMPTS, settings, servers)
    report = LoadReport(configs, settings, PROMPTS, result, {})
    assert {(m.prompt, m.config) for m in report.mismatches} == {
        (0, "ngram, max-running 1"),
        (1, "ngram, max-running 1"),
    }
    assert report.mismatch_lines()[0].startswith(f"prompt 0 ({PROMPTS[0]!r}): ngram")
    paths = write_outputs(report, tmp_path)
    assert all(p.exists() for p in paths.values())


def test_bad_input_fails_before_loading(script: ModuleType, capsys, tmp_path: Path) -> None:
    base = ["--model", "no-such-model"]
    for argv, words in (
        (["--concurrency", "0,2"], "--concurrency must list integers >= 1"),
        (["--strategies", "ar,hf:ar"], "not a strategy specfork serves"),
        (["--max-running", "0"], "--max-running must be an integer >= 1"),
        (["--requests", "0"], "--requests must be an integer >= 1"),
        (["--step-rows", "0"], "step_rows must be an integer >= 1"),
        (
            ["--step-rows", "4"],
            "step_rows (4) must hold at least one row per running request (max_running 8)",
        ),
    ):
        assert script.main(base + argv) == 2
        err = capsys.readouterr().err
        assert words in err and err.count("\n") == 1 and "Traceback" not in err
    with pytest.raises(SystemExit) as exc:
        script.main([*base, "--concurrency", "1,two"])
    assert exc.value.code == 2
    assert "not a list of integers" in capsys.readouterr().err


class _Counting:
    """InProcessServers that record which configuration each started server was for."""

    def __init__(self, servers: InProcessServers) -> None:
        self.servers, self.started = servers, []

    def serve(self, config: LoadConfig, queue_size: int) -> AbstractContextManager[str]:
        self.started.append(config.label)
        return self.servers.serve(config, queue_size)

    def library_check(self, spec: SpecConfig, prompts: Sequence[str], n: int) -> LibraryCheck:
        return self.servers.library_check(spec, prompts, n)


@pytest.mark.usefixtures("one_thread")
def test_every_level_gets_a_fresh_server(tiny_folder: Path) -> None:
    """Every level asks the same prompts: a server reused across levels would answer the later
    levels from its prefix cache, so each (configuration, level, repeat) starts its own."""
    servers = _Counting(_servers(tiny_folder))
    configs = configurations([("ar (plain)", PLAIN)], max_running=2)
    settings = LoadSettings(concurrency=(1, 2), requests=2, max_tokens=4, repeats=2)
    result = sweep(configs, PROMPTS, settings, servers)
    labels = [c.label for c in configs]
    assert servers.started == [label for _ in range(2) for label in labels for _ in (1, 2)]
    assert [(r.config, r.repeat, r.concurrency) for r in result.runs] == [
        (label, repeat, c) for repeat in range(2) for label in labels for c in (1, 2)
    ]
    assert all(s.prompt >= 0 for r in result.runs for s in r.samples)  # the warm-up is not kept


# ----------------------------------------------------------------------------- workload replay


def test_replay_settings() -> None:
    settings = LoadSettings(concurrency=(1, 4), requests=2, workload="agent")
    assert settings.replay and not LoadSettings().replay
    assert settings.requests_at(1) == 4  # conversations: at least one per client of the largest
    assert LoadSettings(concurrency=(1, 4), requests=6, workload="all").requests_at(4) == 6
    with pytest.raises(ConfigError, match=r"--workload agent and --prompts p\.jsonl cannot be"):
        LoadSettings(workload="agent", prompts="p.jsonl")
    with pytest.raises(ConfigError, match="unknown workload 'agents'; choose one of"):
        LoadSettings(workload="agents")


def test_workload_conversations() -> None:
    agent = workload_conversations("agent")
    assert len(agent) == 12 and all(len(c.turns) >= 4 for c in agent)
    assert [m["role"] for m in agent[0].context] == ["system"]
    every = workload_conversations("all")
    assert len(every) == 48  # the workloads taken in turn: the first four cover all of them
    assert [c.name.split("-")[0] for c in every[:4]] == ["multi", "agent", "code", "rag"]


class _FakeClient:
    """Answers a request with a text naming its conversation and turn; records the messages."""

    def __init__(self) -> None:
        self.asked: list[tuple[int, int, list[dict[str, str]]]] = []

    def request(
        self, prompt_index: int, prompt: Prompt, max_tokens: int | None = None, turn: int = 1
    ) -> RequestSample:
        assert isinstance(prompt, list)
        self.asked.append((prompt_index, turn, prompt))
        return RequestSample(
            prompt_index, f"answer {prompt_index}.{turn}", 4, 1.0, 0.1, 9.0, 1.0, 4, turn
        )


def test_replay_builds_each_turn_on_the_servers_answers() -> None:
    system = {"role": "system", "content": "tools: search"}
    conversations = [
        Conversation("a", (system,), ("find flights", "tool result: AB12", "book it")),
        Conversation("b", (), ("hello", "more")),
    ]
    client = _FakeClient()
    wall, samples = replay_level(conversations, client, 3, concurrency=2)
    assert wall >= 0
    # conversation i mod 2 for the i-th, samples in conversation order, turns in order
    first, second = [(0, 1), (0, 2), (0, 3)], [(1, 1), (1, 2)]
    assert [(s.prompt, s.turn) for s in samples] == [*first, *second, *first]
    assert len(client.asked) == 8
    asked = {(i, t): m for i, t, m in client.asked}
    assert asked[(0, 1)] == [system, {"role": "user", "content": "find flights"}]
    assert asked[(0, 3)] == [
        system,
        {"role": "user", "content": "find flights"},
        {"role": "assistant", "content": "answer 0.1"},
        {"role": "user", "content": "tool result: AB12"},
        {"role": "assistant", "content": "answer 0.2"},
        {"role": "user", "content": "book it"},
    ]
    assert asked[(1, 2)] == [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "answer 1.1"},
        {"role": "user", "content": "more"},
    ]
    assert conversations[0].first_messages() == asked[(0, 1)]
    with pytest.raises(ValueError, match="all answered"):
        conversations[1].messages(["x", "y"])
    with pytest.raises(ValueError, match="no conversations"):
        replay_runner([])


def test_later_turns_reported_apart() -> None:
    config = configurations([("ar (plain)", PLAIN)], max_running=2)[0]
    # turn 1: TTFT 0.5 s, 1 token a forward; turns 2 and 3: TTFT 0.1 s, 2 tokens a forward
    samples = [
        RequestSample(c, "t", 10, 1.0, 0.5 if t == 1 else 0.1, 20.0, 1.0 if t == 1 else 2.0, 5, t)
        for c in range(2)
        for t in (1, 2, 3)
    ]
    samples[-1] = dataclasses.replace(samples[-1], text="other")  # conversation 1, turn 3
    rerun = [dataclasses.replace(s, text="t") for s in samples]
    runs = [LevelRun(config.label, 0, 1, 4.0, samples), LevelRun(config.label, 0, 2, 2.0, rerun)]
    conversations = [Conversation(n, (), ("q1", "q2", "q3 " + n)) for n in ("c0", "c1")]
    report = LoadReport(
        [config],
        LoadSettings((1, 2), 2, 10, workload="multi-turn"),
        ["q1", "q1"],
        SweepResult(runs, {}),
        {},
        conversations,
    )
    all_rows, later, first = report.rows, report.later_rows, report.first_rows
    assert [(r.requests, r.requests_per_s, r.tokens_per_s) for r in all_rows] == [
        (6, 1.5, 15.0),
        (6, 3.0, 30.0),
    ]
    assert [(r.requests, r.requests_per_s, r.ttft_p50, r.mean_accepted) for r in later] == [
        (4, 1.0, 0.1, 2.0),  # 4 later turns in the level's 4 s
        (4, 2.0, 0.1, 2.0),
    ]
    assert [(r.requests, r.ttft_p50, r.mean_accepted) for r in first] == [(2, 0.5, 1.0)] * 2
    assert [r.differing for r in later] == [0, 1] and [r.differing for r in first] == [0, 0]
    assert report.mismatch_lines() == [
        "conversation 1 (c1) turn 3 ('q3 c1'): ar (plain), max-running 2 at 2 clients "
        "(repeat 1) differs from ar (plain), max-running 2 at 1 client at character 0"
    ]
    table = report.markdown()
    assert "Later turns (2 and on) only, beside turn 1" in table
    assert (
        "| ar (plain), max-running 2 | 1 | 4 | 1.00 | 10.0 | 0.10 | 0.50 | 2.00 | 1.00 | yes |"
        in table
    )
    assert "| no (1) |" in table
    doc = report.to_json()
    assert [r["requests"] for r in doc["summary_later_turns"]] == [4, 4]
    assert [c["name"] for c in doc["conversations"]] == ["c0", "c1"]
    plain = [dataclasses.replace(s, turn=1) for s in samples]
    flat = LoadReport(
        [config],
        LoadSettings((1,), 2, 10),
        ["p", "q"],
        SweepResult([LevelRun(config.label, 0, 1, 4.0, plain)], {}),
        {},
    )
    assert flat.later_rows == [] and "Later turns" not in flat.markdown()
    assert "summary_later_turns" not in flat.to_json()


@pytest.fixture(scope="module")
def long_tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model with room for a whole multi-turn chat (byte-level: a token a character)."""
    return tiny_chat_llama(tmp_path_factory.mktemp("tiny-replay"), context=1024)


@pytest.mark.usefixtures("one_thread")
def test_replay_end_to_end(script: ModuleType, long_tiny_folder: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    argv = [
        *("--model", str(long_tiny_folder), "--dtype", "float32", "--device", "cpu"),
        *("--max-context", "1024", "--strategies", "ar,ngram", "--max-running", "2"),
        *("--concurrency", "1,2", "--requests", "2", "--max-tokens", "4"),
        *("--workload", "multi-turn", "--out", str(out)),
    ]
    assert script.main(argv) == 0
    doc = json.loads((out / "results.json").read_text())
    chats = workload_conversations("multi-turn")[:2]
    turns = [(i, t) for i, c in enumerate(chats) for t in range(1, len(c.turns) + 1)]
    assert doc["workload"] == "multi-turn" and doc["settings"]["workload"] == "multi-turn"
    assert [c["name"] for c in doc["conversations"]] == [c.name for c in chats]
    for run in doc["runs"]:
        assert [(s["prompt"], s["turn"]) for s in run["samples"]] == turns
        assert all(s["tokens"] == 4 for s in run["samples"])
    texts: dict[tuple[int, int], set[str]] = {}
    for s in (s for r in doc["runs"] for s in r["samples"]):
        texts.setdefault((s["prompt"], s["turn"]), set()).add(s["text"])
    assert len(texts) == len(turns) and all(len(t) == 1 for t in texts.values()), texts
    assert doc["same_text"] is True
    later = len(turns) - len(chats)
    assert [r["requests"] for r in doc["summary_later_turns"]] == [later] * 8
    assert "Later turns (2 and on)" in (out / "table.md").read_text()


def test_workload_with_prompts_fails_before_loading(script: ModuleType, capsys) -> None:
    argv = ["--model", "no-such-model", "--workload", "agent", "--prompts", "p.jsonl"]
    assert script.main(argv) == 2
    err = capsys.readouterr().err
    assert "--workload agent and --prompts p.jsonl cannot be given together" in err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert script.main(["--model", "no-such-model", "--workload", "agents"]) == 2
    assert "unknown workload 'agents'" in capsys.readouterr().err
