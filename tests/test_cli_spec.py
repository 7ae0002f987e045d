"""CLI strategy flags: bad input before loading, trace schema, scan-self, draft-model vocab."""

import json
from pathlib import Path

import pytest
import torch

from cli_run import run_cli as _run
from specfork.cli import main
from specfork.cli.common import read_first_turns
from specfork.errors import SpecforkError
from specfork.tools.self_scan import candidate_flags

PROMPT = "Repeat exactly: one two three, one two three, one two three."


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (
            ["--drafter", "bogus"],
            ["unknown drafter", "ngram, suffix, self, head[:PATH], model:PATH"],
        ),
        (["--k", "0"], ["k (draft length)", ">= 1"]),
        (["--self-layers", "0-5", "--skip-layers", "6-7", "--drafter", "self"], ["either"]),
        (["--max-ngram", "1", "--min-ngram", "2"], ["min_ngram"]),
        (["--self-layers", "0-5"], ["self drafter", "'ngram'", "drafter self"]),
        (["--skip-layers", "3", "--drafter", "ngram+head"], ["skip_layers", "'ngram+head'"]),
    ],
)
def test_bad_strategy_flags_fail_before_loading(capsys, flags, words) -> None:
    # a model that does not exist: the flag error must come first
    argv = ["generate", "-m", "no-such-model", "--strategy", "speculative", *flags, "hi"]
    code, out, err = _run(capsys, argv)
    assert code == 2 and out == ""
    assert "Traceback" not in err
    for w in words:
        assert w in err, (w, err)


def test_unknown_policy_is_a_usage_error(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--k-policy", "fastest", "hi"])
    assert exc.value.code == 2
    assert "constant" in capsys.readouterr().err


@pytest.mark.slow
def test_self_layers_out_of_range(capsys) -> None:
    argv = [
        "generate",
        "--strategy",
        "speculative",
        "--drafter",
        "self",
        "--self-layers",
        "0-99",
        "-n",
        "4",
        PROMPT,
    ]
    code, _, err = _run(capsys, argv)
    assert code == 2 and "0-29" in err and "out of range" in err


@pytest.mark.slow
def test_trace_file_schema_and_stats(capsys, tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    argv = [
        "generate",
        "--dtype",
        "float32",
        "--strategy",
        "speculative",
        "--drafter",
        "ngram",
        "--k",
        "3",
        "-n",
        "24",
        "--ignore-eos",
        "--stats",
        "--trace",
        str(trace),
        PROMPT,
    ]
    code, out, err = _run(capsys, argv)
    assert code == 0 and out.strip()
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    assert records and [r["round"] for r in records] == list(range(len(records)))
    for r in records:
        keys = {"round", "position", "k", "drafted", "accepted", "emitted", "first_rejected"}
        assert set(r) == {*keys, "proposed", "ms"}  # proposed: the draft before the gate
        assert r["ms"]["forward"] > 0 and min(r["ms"].values()) >= 0  # ms: time per phase
        assert r["first_rejected"] == (r["drafted"] > 0 and r["accepted"] == 0)
        assert 0 <= r["accepted"] <= r["drafted"] <= r["proposed"] <= r["k"] <= 3
        assert r["emitted"] == r["accepted"] + 1
    assert sum(r["emitted"] for r in records) + 1 >= 24  # the first token comes from prefill
    assert "acceptance_rate" in err and "draft_forwards" in err


@pytest.mark.slow
def test_trace_to_unwritable_path(capsys, tmp_path: Path) -> None:
    argv = ["generate", "-n", "2", "--trace", str(tmp_path / "missing" / "t.jsonl"), PROMPT]
    code, _, err = _run(capsys, argv)
    assert code == 2 and "trace file" in err


def test_scan_self_candidates_draft_ungated() -> None:
    """The scan's acceptance figures are of whole K = 4 drafts, on any machine: no candidate
    drafts through the goodput gate (which trims by timed costs)."""
    candidates = candidate_flags(30)
    assert len(candidates) == 5
    assert all(spec.k == 4 and not spec.goodput for _, spec in candidates)


@pytest.mark.slow
def test_scan_self_prints_candidates(capsys, tmp_path: Path) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"question_id": 1, "category": "x", "turns": [PROMPT]}) + "\n")
    code, out, err = _run(capsys, ["scan-self", "--prompts", str(prompts), "-n", "6"])
    assert code == 0, err
    assert "--self-layers 0-14" in out and "--skip-layers 10-19" in out


def test_prompt_file_errors_name_the_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"turns": ["ok"]}\n{"turns": []}\n')
    with pytest.raises(SpecforkError, match=r"bad\.jsonl:2"):
        read_first_turns(bad)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(SpecforkError, match="no prompts"):
        read_first_turns(empty)


@pytest.mark.slow
def test_draft_model_with_another_vocabulary(capsys, tmp_path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=100,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "tiny")
    argv = [
        "generate",
        "--strategy",
        "speculative",
        "--drafter",
        f"model:{tmp_path / 'tiny'}",
        "-n",
        "4",
        PROMPT,
    ]
    code, _, err = _run(capsys, argv)
    assert code == 2
    assert "(100 tokens)" in err and "(49152 tokens)" in err
