"""Drafts by source: which drafter proposed the tokens each strategy verified, and how many of
them the target accepted.

Every specfork run records, per source family (`engine.stats.source_family`: "ngram",
"suffix", "recycle", "head", ...), the drafted nodes and the accepted ones; a SPORK tree counts
each node under the source whose proposal of it scored best. Totals are summed over a
strategy's successful runs (every prompt, turn and repeat), so a share is a share of all the
tokens the strategy drafted in the bench.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

#: (drafted, accepted) tokens per source, per strategy label
SourceTotals = dict[str, dict[str, tuple[int, int]]]


def source_totals(measurements: Iterable[Mapping[str, Any]]) -> SourceTotals:
    """Per strategy, per source: drafted and accepted tokens over its successful runs
    (measurement dicts as `Measurement.to_dict` writes them; runs without counts are skipped)."""
    totals: dict[str, dict[str, list[int]]] = {}
    for m in measurements:
        if not m.get("ok") or not m.get("by_source"):
            continue
        per = totals.setdefault(m["strategy"], {})
        for source, (drafted, accepted) in m["by_source"].items():
            counts = per.setdefault(source, [0, 0])
            counts[0] += drafted
            counts[1] += accepted
    return {
        label: {s: (d, a) for s, (d, a) in sorted(per.items(), key=lambda kv: -kv[1][0])}
        for label, per in totals.items()
    }


def source_rows(totals: SourceTotals) -> list[list[str]]:
    """Table rows: strategy, source, share of the drafted tokens, acceptance, share of the
    accepted tokens."""
    rows = []
    for label, per in totals.items():
        drafted = sum(d for d, _ in per.values())
        accepted = sum(a for _, a in per.values())
        for source, (d, a) in per.items():
            rows.append(
                [
                    label,
                    source,
                    f"{d / drafted:.0%}" if drafted else "n/a",
                    f"{a / d:.0%}" if d else "n/a",
                    f"{a / accepted:.0%}" if accepted else "n/a",
                ]
            )
    return rows


SOURCE_HEADER = ("strategy", "source", "share of drafted", "acceptance", "share of accepted")
SOURCE_TEXT = (
    "Every drafted token counted under the drafter that proposed it (a SPORK tree's node under "
    "the source whose proposal of it scored best), summed over every run of the strategy."
)
