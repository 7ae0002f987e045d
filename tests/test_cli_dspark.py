"""DSpark from the command line: flags, the per-round trace, calibrate, trace-plot."""

import itertools
import json
from pathlib import Path

import pytest

from cli_run import run_cli as _run
from specfork.cli import main
from specfork.engine.stats import PHASES

PROMPT = "Repeat exactly: one two three, one two three, one two three."
DSPARK_FIELDS = {
    *("round", "position", "k", "drafted", "accepted", "emitted", "first_rejected"),
    *("top1", "margin", "ema", "confidence", "next_k", "first_rejection_rate"),
    "proposed",  # the draft before the goodput gate shortened it
    *("low", "high", "min_k"),  # the policy's settings, for plots
    "ms",  # milliseconds of each phase of the round
}


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--min-k", "0"], "min_k must be an integer >= 1"),
        (["--max-k", "1"], "max_k must be an integer >= min_k (2)"),
        (["--low", "0.8", "--high", "0.2"], "low < high"),
        (["--weights", "0.5,-1,0.5"], "weights must be three numbers >= 0"),
        (["--weights", "0,0,0"], "positive sum"),
        (["--ema-rate", "0"], "ema_rate must be in (0, 1]"),
        (["--ema-rate", "1.01"], "ema_rate must be in (0, 1]"),
    ],
)
def test_bad_dspark_flags_fail_before_loading(capsys, flags: list[str], words: str) -> None:
    argv = ["generate", "-m", "no-such-model", "--strategy", "dspark", *flags, "hi"]
    code, out, err = _run(capsys, argv)
    assert code == 2 and out == "" and "Traceback" not in err
    assert words in err, err


def test_unparsable_weights_are_a_usage_error(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--strategy", "dspark", "--weights", "a,b,c", "hi"])
    assert exc.value.code == 2
    assert "comma-separated numbers" in capsys.readouterr().err


@pytest.fixture(scope="module")
def dspark_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    trace = tmp_path_factory.mktemp("dspark") / "trace.jsonl"
    # ungated (--no-goodput): the gate weighs drafts by timed costs, and on a slow or loaded
    # machine it may trim every draft, leaving no accepted round to check
    argv = [
        "generate",
        "--dtype",
        "float32",
        "--strategy",
        "dspark",
        "--drafter",
        "ngram",
        "--no-goodput",
        "-n",
        "40",
        "--ignore-eos",
        "--trace",
        str(trace),
        "-q",
        PROMPT,
    ]
    assert main(argv) == 0
    return trace


@pytest.mark.slow
def test_dspark_trace_schema(dspark_trace: Path) -> None:
    records = [json.loads(line) for line in dspark_trace.read_text().splitlines()]
    assert [r["round"] for r in records] == list(range(len(records)))
    for r in records:
        assert set(r) == DSPARK_FIELDS
        assert 0 <= r["k"] <= 16 and 2 <= r["next_k"] <= 16  # k < 2 only where the budget cut it
        assert 0 <= r["accepted"] <= r["drafted"] <= r["proposed"] <= r["k"]
        assert 0 <= r["confidence"] <= 1 and 0 < r["top1"] <= 1 and 0 <= r["margin"] <= 1
        assert r["first_rejected"] == (r["drafted"] > 0 and r["accepted"] == 0)
        assert set(r["ms"]) <= set(PHASES) and r["ms"]["forward"] > 0
        if r["first_rejected"]:
            assert r["next_k"] == 2
    for prev, cur in itertools.pairwise(records):
        assert cur["k"] <= prev["next_k"]  # less only where the token budget cut the draft
    assert any(r["accepted"] > 0 for r in records)  # the repetitive prompt gives drafts


@pytest.mark.slow
def test_trace_plot_writes_a_png(capsys, dspark_trace: Path, tmp_path: Path) -> None:
    out = tmp_path / "k.png"
    code, _, err = _run(capsys, ["trace-plot", str(dspark_trace), "--out", str(out)])
    assert code == 0, err
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_trace_plot_errors(capsys, tmp_path: Path) -> None:
    plain = tmp_path / "plain.jsonl"
    plain.write_text(json.dumps({"round": 0, "k": 4, "drafted": 4}) + "\n")
    code, _, err = _run(capsys, ["trace-plot", str(plain)])
    assert code == 2 and "--strategy dspark" in err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"k": 1, "confidence": 0.5}\nnot json\n')
    code, _, err = _run(capsys, ["trace-plot", str(bad)])
    assert code == 2 and "bad.jsonl:2" in err
    code, _, err = _run(capsys, ["trace-plot", str(tmp_path / "missing.jsonl")])
    assert code == 2 and "cannot read the trace file" in err
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(b"\xc1\xff{}\n")
    code, _, err = _run(capsys, ["trace-plot", str(binary)])
    assert code == 2 and "cannot read the trace file" in err and "Traceback" not in err
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({"round": 0, "k": 4, "confidence": 0.5}) + "\n")
    code, _, err = _run(capsys, ["trace-plot", str(good), "--out", str(tmp_path / "k.txt")])
    assert code == 2 and ".png" in err and not (tmp_path / "k.txt").exists()
    code, _, err = _run(capsys, ["trace-plot", str(good), "--out", str(tmp_path)])
    assert code == 2 and "is a folder" in err
    too_long = tmp_path / ("x" * 300 + ".png")  # the name alone makes the OS refuse it
    code, _, err = _run(capsys, ["trace-plot", str(good), "--out", str(too_long)])
    assert code == 2 and "cannot write the plot" in err and "Traceback" not in err
    assert not list(tmp_path.parent.glob(f"{tmp_path.name}.png"))


@pytest.mark.slow
def test_calibrate_suggests_thresholds(capsys) -> None:
    argv = ["calibrate", "--dtype", "float32", "--limit", "2", "-n", "32", "--json"]
    code, out, err = _run(capsys, argv)
    assert code == 0, err
    result = json.loads(out)
    assert result["k"] == 4 and result["prompts"] == 2
    assert sum(result["accepted_counts"]) == result["rounds"] > 0
    assert len(result["accepted_counts"]) == 5
    assert result["low"] < result["high"]
    assert result["flags"] == f"--low {result['low']:.2f} --high {result['high']:.2f}"
    assert result["method"] in ("outcomes", "percentiles")
    assert result["rounds"] < 200 and "drafting rounds" in result["caution"]  # 2 short prompts


def test_calibration_caution_depends_on_the_rounds() -> None:
    from specfork.cli.tools import MIN_CALIBRATION_ROUNDS, _caution

    assert _caution(MIN_CALIBRATION_ROUNDS) is None
    assert "only 27 drafting rounds" in str(_caution(27))


@pytest.mark.slow
def test_calibrate_table(capsys) -> None:
    code, out, err = _run(capsys, ["calibrate", "--limit", "1", "-n", "16", "--fixed-k", "3"])
    assert code == 0, err
    text = " ".join(out.split())  # the table title may wrap
    assert "accepted draft tokens per round (K = 3" in text
    assert "--strategy dspark --drafter ngram --low" in text
    assert "caution: only" in text  # one prompt of 16 tokens: a rough suggestion


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--strategy", "spork"], "so it runs --strategy dspark; leave out --strategy spork"),
        (["--strategy", "ar"], "leave out --strategy ar"),
        (["--forks", "3"], "--forks is a flag of --strategy spork"),
        (["--drafter", "recycle"], "recycle drafts trees: strategy spork"),
    ],
)
def test_calibrate_refuses_other_strategies_and_their_flags(capsys, flags, words) -> None:
    """calibrate always runs DSpark: another strategy, or a flag DSpark does not read, is a
    one-line error before any model loads (it was "unknown drafter 'recycle'")."""
    code, _, err = _run(capsys, ["calibrate", "-n", "4", "--limit", "1", *flags])
    assert code == 2 and words in err, err
