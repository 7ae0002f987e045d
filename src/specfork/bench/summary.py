"""The figures of a benchmark: per prompt the median over repeats, per category and overall the
median over prompts; speedup over the reference, greedy match rates, peak memory.

A multi-turn run has a row per (strategy, prompt, turn): each turn is compared with the
reference's run of the same turn. Rows of strategies that give text, not token ids (another
engine behind an OpenAI-compatible API), compare their text with the reference's decoded text:
"text-equal" or "text-differs", information only (another tokenizer, other kernels).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from specfork.bench.quality import (
    NEAR_TIE,
    TEXT_STATUSES,
    compare_greedy,
    compare_text,
    compare_tokens,
)
from specfork.bench.records import OVERALL, PER_RUN, Measurement, PreparedPrompt

MATCHES = ("exact", "near-tie", "text-equal")  # counted as greedy matches
EXACT = ("exact", "text-equal")  # counted as exact matches


def per_prompt_figures(
    measurements: Sequence[Measurement],
    strategies: Sequence[str],
    prompts: Sequence[PreparedPrompt],
    *,
    reference: str = "ar",
    gap_fn: Callable[[list[int]], float] | None = None,
    greedy: bool = True,
    near_tie: float = NEAR_TIE,
    logprob_fn: Callable[[list[int], list[int]], float | None] | None = None,
    decode_fn: Callable[[list[int]], str] | None = None,
    text_labels: Collection[str] = (),
    seeded_labels: Collection[str] = (),
) -> list[dict[str, Any]]:
    """One row per (strategy, prompt, turn): medians over the repeats, speedup, greedy match.

    `gap_fn(context_ids)` gives the target's top-2 logit gap after a context; without it (or
    when sampling) greedy matches are not judged. `logprob_fn(prompt, output)` scores the
    first repeat's output under the target (`target_logprob`). Strategies in `text_labels`
    are compared by text with the reference's output decoded by `decode_fn`. When sampling
    with a seed, the strategies in `seeded_labels` (specfork's: they emit seeded plain
    decoding's tokens) are compared token for token, without the near-tie rule.
    """
    by_key: dict[tuple[str, int, int], list[Measurement]] = {}
    for m in measurements:
        by_key.setdefault((m.strategy, m.prompt_index, m.turn), []).append(m)
    rows = []
    for p in prompts:
        ref_ok = [m for m in by_key.get((reference, p.index, p.turn), []) if m.ok and m.output]
        ref_tps = _median([m.figure("decode_tokens_per_second") for m in ref_ok])
        ref_step = _median([_step_seconds(m) for m in ref_ok])
        ref_ids = min(ref_ok, key=lambda m: m.repeat).output.token_ids if ref_ok else None  # type: ignore[union-attr]
        gaps: dict[int, float] = {}

        def gap_at(pos: int, p: PreparedPrompt = p, ref_ids=ref_ids, gaps=gaps) -> float:
            if pos not in gaps:
                gaps[pos] = gap_fn([*p.ids, *ref_ids[:pos]])  # type: ignore[misc]
            return gaps[pos]

        for label in strategies:
            ms = by_key.get((label, p.index, p.turn), [])
            ok = [m for m in ms if m.ok and m.output is not None]
            row: dict[str, Any] = {
                "strategy": label,
                "prompt_index": p.index,
                "turn": p.turn,
                "question_id": p.prompt.question_id,
                "category": p.category,
                "runs": len(ok),
                "failed": len(ms) - len(ok),
                "errors": sorted({m.error for m in ms if m.error}),
            }
            for key in PER_RUN:
                row[key] = _median([m.figure(key) for m in ok])
            tps = row["decode_tokens_per_second"]
            row["speedup"] = tps / ref_tps if tps is not None and ref_tps else None
            row["round_efficiency"] = _efficiency(ok, ref_step)
            peaks = [m.peak_rss_mb for m in ms if m.peak_rss_mb is not None]
            row["peak_rss_mb"] = max(peaks) if peaks else None
            row["valid_rate"] = _mean([m.output.valid for m in ok])  # type: ignore[union-attr]
            match = None
            first_out = min(ok, key=lambda m: m.repeat).output if ok else None
            if label in text_labels:
                if first_out is not None and ref_ids is not None and greedy and decode_fn:
                    match = compare_text(decode_fn(ref_ids), first_out.text or "")
            elif first_out is not None and ref_ids is not None and greedy and gap_fn is not None:
                match = compare_greedy(ref_ids, first_out.token_ids, gap_at, near_tie)
            elif first_out is not None and ref_ids is not None and label in seeded_labels:
                match = compare_tokens(ref_ids, first_out.token_ids)
            score = logprob_fn if logprob_fn is not None and first_out is not None else None
            row["target_logprob"] = score(list(p.ids), first_out.token_ids) if score else None  # type: ignore[union-attr]
            row["greedy_match"] = match.status if match else None
            row["divergence_position"] = match.position if match else None
            row["top2_gap"] = match.gap if match else None
            rows.append(row)
    return rows


def summarize(
    rows: Sequence[Mapping[str, Any]],
    strategies: Sequence[str],
    categories: Sequence[str],
    turn: int | None = None,
) -> dict[str, dict[str, dict[str, Any]]]:
    """summary[strategy][category or "overall"][figure]: medians of the per-prompt rows
    (match rates are fractions of prompts; peak memory is the maximum); `turn` keeps that
    turn's rows only (None: every turn's)."""
    if turn is not None:
        rows = [r for r in rows if r.get("turn", 1) == turn]
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for label in strategies:
        out[label] = {}
        for cat in [*categories, OVERALL]:
            sel = [r for r in rows if r["strategy"] == label and cat in (r["category"], OVERALL)]
            cell: dict[str, Any] = {"prompts": len(sel), "failed": sum(r["failed"] for r in sel)}
            for key in (*PER_RUN, "speedup", "round_efficiency", "target_logprob"):
                cell[key] = _median([r.get(key) for r in sel])
            judged = [r["greedy_match"] for r in sel if r["greedy_match"] is not None]
            cell["greedy_match_rate"] = (
                sum(j in MATCHES for j in judged) / len(judged) if judged else None
            )
            cell["exact_match_rate"] = (
                sum(j in EXACT for j in judged) / len(judged) if judged else None
            )
            if any(j in TEXT_STATUSES for j in judged):
                cell["match_basis"] = "text"
            cell["valid_rate"] = _mean([r.get("valid_rate") for r in sel])
            peaks = [r["peak_rss_mb"] for r in sel if r["peak_rss_mb"] is not None]
            cell["peak_rss_mb"] = max(peaks) if peaks else None
            out[label][cat] = cell
    return out


def summarize_later_turns(
    rows: Sequence[Mapping[str, Any]], strategies: Sequence[str], categories: Sequence[str]
) -> dict[str, dict[str, dict[str, Any]]] | None:
    """`summarize` over every turn after the first together (each row against the reference's
    run of the same turn); None when no row is of a later turn."""
    later = [r for r in rows if r.get("turn", 1) > 1]
    return summarize(later, strategies, categories) if later else None


def _step_seconds(m: Measurement) -> float | None:
    """Seconds of one decoding step of a plain run: its decode time over its forwards."""
    o = m.output
    if o is None or not o.decode_seconds or not o.target_forwards:
        return None
    return o.decode_seconds / o.target_forwards


def _efficiency(runs: Sequence[Measurement], step: float | None) -> float | None:
    """Round efficiency of a strategy's runs on a prompt: the time their forwards would take at
    plain decoding's step cost on that prompt (`step` seconds a one-row step, c(rows) steps a
    forward by the cost curve) over their decode time (medians over the repeats). 1 for plain
    decoding; below 1 where drafting, trees, acceptance, bookkeeping or forwards dearer than
    the curve says cost time."""
    outs = [m.output for m in runs if m.output is not None]
    steps = _median([o.plain_steps for o in outs])
    seconds = _median([o.decode_seconds for o in outs])
    if step is None or steps is None or not seconds:
        return None
    return steps * step / seconds


def turns_of(rows: Sequence[Mapping[str, Any]]) -> list[int]:
    """The turns the rows cover, in order."""
    return sorted({int(r.get("turn", 1)) for r in rows})


def _mean(values: Sequence[float | bool | None]) -> float | None:
    """The mean of the values that exist (a share, for booleans); None when none do."""
    vals = [float(v) for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


def _median(values: Sequence[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None
