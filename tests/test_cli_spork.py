"""SPORK from the command line: flags, the trace, the lossy gate's labels."""

import json
from pathlib import Path

import pytest

from cli_run import run_cli as _run

PROMPT = "Repeat exactly: one two three, one two three, one two three."


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--forks", "0"], "forks must be an integer >= 1"),
        (["--depth", "0"], "depth must be an integer >= 1"),
        (["--budget", "3", "--depth", "4"], "smaller than the depth"),
        (["--tau", "1"], "tau must be in [0, 1)"),
        (["--tau-max", "1.5"], "tau_max must be in [0, 1)"),
        (["--drafter", "recycle+nope"], "unknown spork drafter 'nope'"),
    ],
)
def test_bad_spork_flags_fail_before_loading(capsys, flags: list[str], words: str) -> None:
    argv = ["generate", "-m", "no-such-model", "--strategy", "spork", *flags, "hi"]
    code, out, err = _run(capsys, argv)
    assert code == 2 and out == "" and "Traceback" not in err
    assert words in err, err


def test_lossy_gate_needs_spork(capsys) -> None:
    argv = ["generate", "-m", "x", "--strategy", "speculative", "--lossy-typical", "hi"]
    code, _, err = _run(capsys, argv)
    assert code == 2 and "--strategy spork" in err  # named before any model is looked up


@pytest.mark.slow
def test_tree_larger_than_the_context() -> None:
    from specfork.config import SpecConfig
    from specfork.engine.generator import Generator
    from specfork.errors import ConfigError
    from specfork.loading.loader import load_model

    loaded = load_model("smollm2-135m-instruct")
    with pytest.raises(ConfigError, match=r"context holds \(16\)"):
        Generator(loaded, max_context=16, spec=SpecConfig("spork", budget=16))
    gen = Generator(loaded, max_context=64)
    with pytest.raises(ConfigError, match=r"context holds \(64\)"):
        gen.generate("hi", spec=SpecConfig("spork", depth=64, budget=80))
    # within the budget, a tree is cut to the room the context has left
    result = gen.generate("Say one two three.", spec=SpecConfig("spork", "recycle", budget=48))
    assert result.finish_reason in ("stop", "length")


@pytest.mark.slow
@pytest.mark.parametrize("lossy", [False, True])
def test_spork_trace_and_stats(capsys, tmp_path: Path, lossy: bool) -> None:
    trace = tmp_path / "t.jsonl"
    # ungated (--no-goodput): the gate weighs trees by timed costs, and on a slow or loaded
    # machine it may skip every tree, leaving no accepted round to check
    argv = [
        "generate",
        "--dtype",
        "float32",
        "--strategy",
        "spork",
        "--drafter",
        "recycle+ngram",
        "--no-goodput",
        "-n",
        "32",
        "--ignore-eos",
        "--stats",
        "--trace",
        str(trace),
        PROMPT,
    ]
    code, out, err = _run(capsys, argv + (["--lossy-typical"] if lossy else []))
    assert code == 0 and out.strip(), err
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    for r in records:
        assert {"fork", "nodes", "tree_depth", "forks", "depth", "tau", "next_tau"} <= set(r)
        assert r["nodes"] == r["drafted"] and 0 <= r["accepted"] <= r["tree_depth"]
        assert r["fork"] is None or 0 <= r["fork"] < r["nodes"]
        assert r.get("lossy", False) == lossy
    assert any(r["accepted"] > 0 for r in records)
    assert "verify_share" in err
    assert ("LOSSY" in err) == lossy


@pytest.mark.slow
def test_self_drafted_dynamic_tree_traces_its_model_depth(capsys, tmp_path: Path) -> None:
    """EAGLE-2 trees from the target's own layers; their depth adapts by cost (in the trace)."""
    trace = tmp_path / "t.jsonl"
    argv = [
        "generate",
        "--dtype",
        "float32",
        "--strategy",
        "spork",
        "--drafter",
        "self",
        "--skip-layers",
        "10-19",
        "--tree",
        "dynamic",
        "--tau-max",
        "0.1",
        "-n",
        "24",
        "--ignore-eos",
        "--trace",
        str(trace),
        PROMPT,
    ]
    code, out, err = _run(capsys, argv)
    assert code == 0 and out.strip(), err
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    assert all(1 <= r["model_depth"] <= r["depth"] for r in records)
    assert all(r["tree_depth"] <= r["model_depth"] for r in records)  # self is the only source
    assert all(r["tau"] <= 0.1 for r in records)


def test_spork_flags_reach_the_config() -> None:
    from specfork.cli import build_parser
    from specfork.cli.common import spec_from_args

    argv = ["generate", "--strategy", "spork", "--recycle-prior", "--tau-max", "0.2"]
    argv += ["--tree", "dynamic", "hi"]
    spec = spec_from_args(build_parser().parse_args(argv), 64)
    assert (spec.recycle_prior, spec.tau_max, spec.tree) == (True, 0.2, "dynamic")
    plain = spec_from_args(build_parser().parse_args(["generate", "--strategy", "spork", "hi"]), 64)
    assert (plain.recycle_prior, plain.tau_max) == (False, 0.0)
