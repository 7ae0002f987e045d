"""The note a bench run ends with when its prompts gave speculation little to copy."""

from __future__ import annotations

from specfork.bench.advice import PAYS, where_speculation_pays


def _rows(label: str, category: str, speedups: list[float]) -> list[dict]:
    return [{"strategy": label, "category": category, "speedup": s} for s in speedups]


def test_slow_first_turns_point_at_the_workloads() -> None:
    rows = _rows("speculative:ngram?k=4", "writing", [0.9, 1.1, 1.0]) + _rows(
        "dspark:ngram", "writing", [1.2, 1.2, 1.1]
    )
    note = where_speculation_pays(rows, ["speculative:ngram?k=4", "dspark:ngram"])
    assert note is not None
    assert "dspark:ngram" in note and "1.20×" in note and "--workload all" in note


def test_no_note_when_speculation_pays() -> None:
    rows = _rows("dspark:ngram", "writing", [PAYS + 0.1, PAYS + 0.5, PAYS])
    assert where_speculation_pays(rows, ["dspark:ngram"]) is None


def test_workload_rows_and_other_strategies_do_not_count() -> None:
    rows = _rows("dspark:ngram", "agent", [0.5, 0.6]) + _rows("hf:ar", "writing", [0.4])
    assert where_speculation_pays(rows, ["dspark:ngram"]) is None  # only workload rows
    assert where_speculation_pays(rows, []) is None
    failed = [{"strategy": "dspark:ngram", "category": "qa", "speedup": None}]
    assert where_speculation_pays(failed, ["dspark:ngram"]) is None
