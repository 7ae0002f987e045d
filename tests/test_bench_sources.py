"""Drafts by source: the families the engine counts under, and the bench's totals and table."""

from __future__ import annotations

import pytest

from specfork.bench.sources import source_rows, source_totals
from specfork.engine.stats import GenerationStats, source_family


@pytest.mark.parametrize(
    ("label", "family"),
    [
        ("ngram-3", "ngram"),
        ("suffix-8", "suffix"),
        ("head", "head"),
        ("recycle", "recycle"),
        ("model:a-b", "model:a-b"),
        ("", ""),
    ],
)
def test_source_family_drops_the_match_bucket(label: str, family: str) -> None:
    assert source_family(label) == family


def test_record_sources_counts_drafted_and_accepted_nodes() -> None:
    stats = GenerationStats()
    stats.record_sources(["ngram-3", "ngram-3", "recycle", "recycle"], {0, 1})
    stats.record_sources(["suffix-2", "recycle"], {1})
    assert stats.by_source == {"ngram": [2, 2], "recycle": [3, 1], "suffix": [1, 0]}


def test_totals_sum_successful_runs_and_rows_give_shares() -> None:
    runs = [
        {"strategy": "spork", "ok": True, "by_source": {"recycle": [6, 1], "ngram": [2, 2]}},
        {"strategy": "spork", "ok": True, "by_source": {"recycle": [2, 1]}},
        {"strategy": "spork", "ok": False, "by_source": {"recycle": [100, 0]}},  # failed: out
        {"strategy": "ar", "ok": True, "by_source": {}},
    ]
    totals = source_totals(runs)
    assert totals == {"spork": {"recycle": (8, 2), "ngram": (2, 2)}}
    assert source_rows(totals) == [
        ["spork", "recycle", "80%", "25%", "50%"],
        ["spork", "ngram", "20%", "100%", "50%"],
    ]
