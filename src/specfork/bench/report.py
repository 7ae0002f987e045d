"""Benchmark outputs: terminal tables, results.json, report.md and PNG plots.

Everything here works from the results document (``BenchResults.to_dict()``), so reports and
plots can be made again from a saved file: `load_results` reads ``results.json.gz`` (what the
bench writes: gzip, the results are megabytes of per-round traces) and older plain
``results.json`` files alike. Plots use matplotlib's Agg backend (no display):

- ``speedup.png``: speedup over plain decoding by category and strategy;
- ``acceptance_by_position.png``: acceptance rate at each draft position, per strategy;
- ``dspark_trace.png``: draft length K and confidence C per round against the output position,
  for strategies whose round records carry ``k`` and ``confidence`` (DSpark);
- ``fork_wins.png``: how often each fork won, for strategies whose round records carry
  ``fork`` (SPORK).

The last two read the generic per-round dicts (``RoundRecord.to_dict()`` plus any extra keys)
and are skipped when no strategy's rounds have those keys.
"""

from __future__ import annotations

import gzip
import json
import math
import os
import uuid
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from specfork.bench.records import FIGURES, OVERALL, SHARES
from specfork.bench.sources import SOURCE_HEADER, SOURCE_TEXT, source_rows, source_totals
from specfork.checks import is_number
from specfork.errors import ConfigError

RESULTS_FILE = "results.json.gz"
LEGACY_RESULTS_FILE = "results.json"  # written before the results were compressed
REPORT_FILE = "report.md"
PLOT_FILES = {
    "speedup": "speedup.png",
    "acceptance": "acceptance_by_position.png",
    "dspark": "dspark_trace.png",
    "forks": "fork_wins.png",
}
_FORMATS = {key: fmt for key, _, fmt in FIGURES} | {key: "{:.0%}" for key in SHARES}
_TITLES = {key: title for key, title, _ in FIGURES} | {k: k.removeprefix("share_") for k in SHARES}
_TIME_TITLE = "where decode time goes (median share of decode time, by phase of a round)"
_BY_CATEGORY = (
    "speedup",
    "decode_tokens_per_second",
    "mean_accepted_length",
    "acceptance_rate",
    "greedy_match_rate",
)


def check_output_dir(path: str | Path) -> Path:
    """Create the output folder and prove it is writable (before anything runs)."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".specfork-write-test-{uuid.uuid4().hex}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(
            f"cannot write to the output folder {path}: {exc.strerror or exc}; "
            "choose another one with --out"
        ) from exc
    return path


def fmt(key: str, value: Any) -> str:
    """A figure for people: "n/a" where it does not exist."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return _FORMATS.get(key, "{}").format(value)


_MATCH_KEYS = ("greedy_match_rate", "exact_match_rate")


def fmt_cell(key: str, cell: Mapping[str, Any]) -> str:
    """A summary cell's figure; match rates judged on text (another engine) say so."""
    text = fmt(key, cell.get(key))
    if key in _MATCH_KEYS and cell.get("match_basis") == "text" and text != "n/a":
        return f"{text} (text)"
    return text


def turn_summaries(doc: Mapping[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(turn, summary) of a multi-turn run, in turn order; empty for a first-turn run."""
    by_turn = doc.get("summary_by_turn") or {}
    return sorted(by_turn.items(), key=lambda item: int(item[0]))


def _figures(doc: Mapping[str, Any]) -> tuple[tuple[str, str, str], ...]:
    """The report's figures: "output valid" only for a constrained run."""
    constrained = doc["settings"].get("constraint") is not None
    return tuple(f for f in FIGURES if constrained or f[0] != "valid_rate")


def _rows(doc: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Strategies with figures (skipped ones have none), in the order given."""
    return [s for s in doc["strategies"] if s["status"] != "skipped"]


# ------------------------------------------------------------------------ terminal


_SPEED = ("decode_tokens_per_second", "speedup", "time_to_first_token", "peak_rss_mb")


def print_tables(doc: Mapping[str, Any], console: Console) -> None:
    """Overall speed, overall drafting figures and the speedup by category (rich tables)."""
    if not console.is_terminal and console.width < 160:  # a file or a pipe: no width to keep
        console = Console(file=console.file, width=160)
    summary = doc["summary"]
    drafting = tuple(k for k, _, _ in _figures(doc) if k not in _SPEED)
    tables = [
        (f"overall speed (medians; speedup over {doc['reference']})", _SPEED, summary),
        ("overall drafting and greedy match (medians)", drafting, summary),
    ]
    if _has_shares(doc):
        tables.append((_TIME_TITLE, SHARES, summary))
    keys = (*_SPEED[:2], "mean_accepted_length", "greedy_match_rate")
    for turn, by_turn in turn_summaries(doc):
        tables.append(
            (
                f"turn {turn} (medians; speedup over {doc['reference']} on turn {turn})",
                keys,
                by_turn,
            )
        )
    if doc.get("summary_later_turns"):
        title = f"later turns, 2 and on (medians; speedup over {doc['reference']} on each turn)"
        tables.append((title, keys, doc["summary_later_turns"]))
    for title, keys, source in tables:
        table = Table(title=title)
        table.add_column("strategy", overflow="fold")
        for key in keys:
            table.add_column(_TITLES[key], justify="right")
        for s in _rows(doc):
            cell = source.get(s["label"], {}).get(OVERALL, {})
            name = s["label"] if s["status"] == "ok" else f"{s['label']} ({s['status']})"
            table.add_row(escape(name), *(fmt_cell(k, cell) for k in keys))
        console.print(table)
    cats = [*doc["categories"], OVERALL]
    by_cat = Table(title="speedup by category (median of per-prompt speedups)")
    by_cat.add_column("strategy", overflow="fold")
    for c in cats:
        by_cat.add_column(escape(c), justify="right")
    for s in _rows(doc):
        cells = (fmt("speedup", summary[s["label"]][c]["speedup"]) for c in cats)
        by_cat.add_row(escape(s["label"]), *cells)
    console.print(by_cat)
    for note in doc.get("notes", []):
        console.print(f"note: {note}", markup=False, highlight=False)


# ------------------------------------------------------------------------ files


def write_results_json(doc: Mapping[str, Any], out: Path) -> Path:
    """``results.json.gz``: the document as gzip-compressed JSON (no timestamp in the gzip
    header, so the same document gives the same bytes)."""
    path = out / RESULTS_FILE
    data = (json.dumps(doc, indent=1, default=str) + "\n").encode("utf-8")
    path.write_bytes(gzip.compress(data, mtime=0))
    return path


def results_path(path: str | Path) -> Path:
    """The results file of a bench output folder (``results.json.gz``, else an old
    ``results.json``), or `path` itself when it is a file."""
    path = Path(path)
    if path.is_dir():
        for name in (RESULTS_FILE, LEGACY_RESULTS_FILE):
            if (path / name).is_file():
                return path / name
        raise ConfigError(
            f"{path} has no {RESULTS_FILE} (nor {LEGACY_RESULTS_FILE}): "
            "give a `specfork bench --out` folder or a results file"
        )
    return path


def load_results(path: str | Path) -> dict[str, Any]:
    """A saved results document: a bench output folder, a ``.json.gz`` or a plain ``.json``
    file (gzip is recognised by its magic bytes, whatever the name)."""
    file = results_path(path)
    try:
        raw = file.read_bytes()
        if raw[:2] == b"\x1f\x8b":
            raw = gzip.decompress(raw)
        doc = json.loads(raw.decode("utf-8"))
    except OSError as exc:
        raise ConfigError(f"cannot read the results file {file}: {exc.strerror or exc}") from exc
    except (EOFError, gzip.BadGzipFile, UnicodeDecodeError, ValueError) as exc:
        raise ConfigError(
            f"{file} is not a bench results file (JSON, optionally gzip): {exc}"
        ) from exc
    if not isinstance(doc, dict) or "summary" not in doc:
        raise ConfigError(f"{file} is not a bench results file: no 'summary' in it")
    return doc


def write_report_md(doc: Mapping[str, Any], out: Path, plots: Sequence[Path] = ()) -> Path:
    """A Markdown report: machine, method, notes, tables, plots."""
    m, st = doc["machine"], doc["settings"]
    cats = [*doc["categories"], OVERALL]
    n_prompts = len({p.get("index", i) for i, p in enumerate(doc["prompts"])})
    lines = [
        f"# specfork bench: {Path(st['model']).name}",
        "",
        f"{doc['created']} · {m['cpu']} · {m['threads']} threads · torch {m['torch']} · "
        f"transformers {m.get('transformers') or 'not installed'} · specfork {m['specfork']} · "
        f"{m.get('backend') or m['dtype'] + ' on ' + m['device']}",
        "",
        f"Command: `{m['command']}`",
        "",
        f"{n_prompts} prompts from {st['prompts_source']} ({len(doc['categories'])} categories), "
        f"{_turns_text(doc)}"
        f"{' + ' + repr(st['prompt_suffix']) if st.get('prompt_suffix') else ''}; "
        f"{st['max_new_tokens']} new tokens at most"
        f"{' (EOS ignored)' if st['ignore_eos'] else ''}, temperature {st['temperature']}; "
        f"warm-up {st['warmup']}, then prompt by prompt with every strategy interleaved, "
        f"{st['repeats']} repeat(s). Figures: per prompt the median over repeats; per category "
        f"and overall the median over prompts. Speedup: decode tokens/s (prefill excluded) over "
        f"`{doc['reference']}` on the same prompt in this run. Greedy match: the output equals "
        f"`{doc['reference']}`'s, or first differs where the target's top-2 logits are within "
        f"{st['near_tie_tolerance']} (a near-tie); exact match counts equal outputs only. "
        "Wasted drafts: (drafted − accepted) per output token. Peak RSS: the process-wide "
        "high-water mark during a strategy's runs (all loaded models count).",
        "",
    ]
    constraint = st.get("constraint")
    if constraint is not None:
        what = constraint["kind"] + (f" `{constraint['source']}`" if constraint["source"] else "")
        lines += [
            f"Structured output: every run is constrained to {what} (the grammar's mask on the "
            "target and the drafts); output valid = the output is complete and parses.",
            "",
        ]
    if doc.get("notes"):
        lines += ["Notes:", "", *(f"- {n}" for n in doc["notes"]), ""]
    if any(c.get("match_basis") == "text" for s in doc["summary"].values() for c in s.values()):
        lines += [
            f"Match rates marked (text) compare decoded text with `{doc['reference']}`'s: "
            "another engine, with its own kernels and tokenizer — information only.",
            "",
        ]
    overall = "## Overall (every turn)" if turn_summaries(doc) else "## Overall"
    lines += [overall, "", _overall_table(doc, doc["summary"]), ""]
    lines += _category_tables(doc, doc["summary"], cats, "")
    if _has_shares(doc):
        lines += [
            f"## {_TIME_TITLE[0].upper()}{_TIME_TITLE[1:]}",
            "",
            _TIME_TEXT,
            "",
            _shares_table(doc),
            "",
        ]
    by_source = source_rows(source_totals(doc.get("measurements", [])))
    if by_source:
        table = md_table(SOURCE_HEADER, by_source)
        lines += ["## Drafts by source", "", SOURCE_TEXT, "", table, ""]
    for turn, by_turn in turn_summaries(doc):
        lines += [f"## Turn {turn}", "", _overall_table(doc, by_turn), ""]
        lines += _category_tables(doc, by_turn, cats, f"turn {turn}: ", ("speedup",))
    later = doc.get("summary_later_turns")
    if later:
        lines += [
            "## Later turns (2 and on, together)",
            "",
            _LATER_TEXT,
            "",
            _overall_table(doc, later),
            "",
        ]
        lines += _category_tables(
            doc, later, cats, "later turns: ", ("speedup", "mean_accepted_length")
        )
    lines += [
        "## Strategies",
        "",
        md_table(
            ["strategy", "family", "status", "error"],
            [
                [s["label"], s["family"], s["status"], s.get("error") or ""]
                for s in doc["strategies"]
            ],
        ),
        "",
    ]
    if plots:
        lines += ["## Plots", ""]
        lines += [f"![{p.stem}]({p.name})" for p in plots]
        lines.append("")
    path = out / REPORT_FILE
    path.write_text("\n".join(lines), encoding="utf-8")
    return path


_LATER_TEXT = (
    "Every turn after the first, each against the reference's run of the same turn: the "
    "context holds the conversation so far, the model's own earlier answers included (turn 1 "
    "figures: the section of turn 1)."
)

_TIME_TEXT = (
    "draft: the policy's shape, the drafters and the goodput gate; prepare: trims, grammar "
    "masks, the rows, tree mask and positions; forward: the target's forward and logits; "
    "accept: the verification rule; commit: the KV cache and the drafters' feedback; learn: "
    "gate, policy, statistics; other: stop checks, detokenizing, the loop. Round efficiency "
    "(overall table): what the run's forwards would cost as plain decoding's steps on the same "
    "prompt (c(rows) steps each, by the measured cost curve), over its decode time."
)


def _has_shares(doc: Mapping[str, Any]) -> bool:
    """Whether any strategy has the phase split (specfork's do; other engines do not)."""
    return any(
        cell.get("share_forward") is not None
        for by_cat in doc["summary"].values()
        for cell in by_cat.values()
    )


def _shares_table(doc: Mapping[str, Any]) -> str:
    summary = doc["summary"]
    return md_table(
        ["strategy", *(_TITLES[k] for k in SHARES)],
        [
            [s["label"], *(fmt_cell(k, summary[s["label"]][OVERALL]) for k in SHARES)]
            for s in _rows(doc)
        ],
    )


def _turns_text(doc: Mapping[str, Any]) -> str:
    if not turn_summaries(doc):
        return "first turn with the chat template"
    ref = doc["reference"]
    return (
        f"every turn of each conversation with the chat template (a later turn follows "
        f"`{ref}`'s own earlier answers, the same context for every strategy; figures per "
        f"turn are against `{ref}`'s run of the same turn)"
    )


def _overall_table(doc: Mapping[str, Any], summary: Mapping[str, Any]) -> str:
    figures = _figures(doc)
    return md_table(
        ["strategy", *(t for _, t, _ in figures)],
        [
            [s["label"], *(fmt_cell(k, summary[s["label"]][OVERALL]) for k, _, _ in figures)]
            for s in _rows(doc)
        ],
    )


def _category_tables(
    doc: Mapping[str, Any],
    summary: Mapping[str, Any],
    cats: Sequence[str],
    prefix: str,
    keys: Sequence[str] = _BY_CATEGORY,
) -> list[str]:
    lines: list[str] = []
    for key in keys:
        lines += [
            f"### {prefix}{_TITLES[key]} by category"
            if prefix
            else f"## {_TITLES[key]} by category",
            "",
            md_table(
                ["strategy", *cats],
                [
                    [s["label"], *(fmt_cell(key, summary[s["label"]][c]) for c in cats)]
                    for s in _rows(doc)
                ],
            ),
            "",
        ]
    return lines


def md_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    def cell(x: object) -> str:
        return str(x).replace("|", "\\|").replace("\n", " ")

    out = ["| " + " | ".join(cell(h) for h in header) + " |", "|---" * len(header) + "|"]
    out += ["| " + " | ".join(cell(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def write_all(doc: Mapping[str, Any], out: Path, plots: bool = True) -> dict[str, Any]:
    """results.json.gz, the PNG plots and report.md; returns what was written."""
    pngs: list[Path] = []
    if plots:
        try:
            pngs = write_plots(doc, out)
        except ImportError:
            note = "matplotlib is not installed: no plots (pip install matplotlib)"
            doc = {**doc, "notes": [*doc.get("notes", []), note]}
    return {
        "results": write_results_json(doc, out),
        "plots": pngs,
        "report": write_report_md(doc, out, pngs),
    }


# ------------------------------------------------------------------------ plots


def write_plots(doc: Mapping[str, Any], out: Path) -> list[Path]:
    """Every plot the data allows (see the module docstring); returns the files written."""
    os.environ.setdefault("MPLBACKEND", "Agg")
    import matplotlib

    matplotlib.use("Agg", force=True)
    written = []
    for make in (_plot_speedup, _plot_acceptance, _plot_dspark, _plot_forks):
        path = make(doc, out)
        if path is not None:
            written.append(path)
    for name in PLOT_FILES.values():  # an earlier run's plot this run has no data for
        stale = out / name
        if stale not in written and stale.is_file():
            stale.unlink()
    return written


def _plot_speedup(doc: Mapping[str, Any], out: Path) -> Path | None:
    """Strategies × categories as a labelled heatmap (green faster, red slower than ar)."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import TwoSlopeNorm

    labels = [s["label"] for s in _rows(doc) if s["label"] != doc["reference"]]
    if not labels:
        return None
    cats = list(doc["categories"])
    cats += [OVERALL] if len(cats) > 1 else []  # one category: "overall" would repeat it
    grid = [[_value(doc["summary"][label][c].get("speedup")) for c in cats] for label in labels]
    finite = [v for row in grid for v in row if not math.isnan(v)] or [1.0]
    low, high = min(min(finite), 0.99), max(max(finite), 1.01)
    width = 2.5 + 0.75 * len(cats) + 0.06 * max(len(x) for x in labels)
    fig, ax = plt.subplots(figsize=(min(width, 16.0), 1.2 + 0.42 * len(labels)))
    image = ax.imshow(grid, cmap="RdYlGn", norm=TwoSlopeNorm(1.0, low, high), aspect="auto")
    for i, row in enumerate(grid):
        for j, v in enumerate(row):
            text = "n/a" if math.isnan(v) else f"{v:.2f}×"
            ax.text(j, i, text, ha="center", va="center", fontsize="small")
    ax.set_xticks(range(len(cats)), cats, rotation=30, ha="right")
    ax.set_yticks(range(len(labels)), labels, fontsize="small")
    ax.set_title(f"Speedup over {doc['reference']} (median of per-prompt decode tok/s ratios)")
    fig.colorbar(image, ax=ax, fraction=0.03, pad=0.02)
    return _save(fig, out / PLOT_FILES["speedup"])


def _value(x: Any) -> float:
    return float(x) if is_number(x) else math.nan


def _plot_acceptance(doc: Mapping[str, Any], out: Path) -> Path | None:
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    curves: dict[str, list[float]] = {}
    for s in _rows(doc):
        acc: list[int] = []
        drafted: list[int] = []
        for m in doc["measurements"]:
            if m["strategy"] != s["label"] or not m["ok"] or not m.get("drafted_by_position"):
                continue
            for i, (a, d) in enumerate(
                zip(m["accepted_by_position"], m["drafted_by_position"], strict=False)
            ):
                if i >= len(drafted):
                    acc.append(0)
                    drafted.append(0)
                acc[i] += a
                drafted[i] += d
        if any(drafted):
            curves[s["label"]] = [
                a / d if d else math.nan for a, d in zip(acc, drafted, strict=True)
            ]
    if not curves:
        return None
    fig, ax = plt.subplots(figsize=(8.0, 4.2))
    markers = "osD^v<>pX*h"
    for n, (label, ys) in enumerate(_merge_identical(curves).items()):
        ax.plot(
            range(1, len(ys) + 1),
            ys,
            marker=markers[n % len(markers)],
            color=plt.get_cmap("tab20")(n % 20),
            label=label,
        )
    ax.set_xlabel("draft position")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("acceptance rate (all runs)")
    ax.set_ylim(0, 1.05)
    ax.set_title("Acceptance by draft position")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return _save(fig, out / PLOT_FILES["acceptance"])


def _merge_identical(curves: dict[str, list[float]]) -> dict[str, list[float]]:
    """Curves with the same values as one line labelled "a = b" (one drawn over the other
    would hide it)."""
    merged: dict[tuple[str, ...], tuple[list[str], list[float]]] = {}
    for label, ys in curves.items():
        key = tuple(f"{y:.6f}" for y in ys)
        merged.setdefault(key, ([], ys))[0].append(label)
    return {" = ".join(labels): ys for labels, ys in merged.values()}


def _rounds_by_strategy(doc: Mapping[str, Any], keys: Sequence[str]) -> dict[str, list[dict]]:
    """Per strategy, the first measured run's rounds whose records all carry `keys`."""
    found: dict[str, list[dict]] = {}
    for m in doc["measurements"]:
        rounds = m.get("rounds") or []
        if m["strategy"] in found or not m["ok"] or not rounds:
            continue
        if all(all(k in r for k in keys) for r in rounds):
            found[m["strategy"]] = rounds
    return found


def _plot_dspark(doc: Mapping[str, Any], out: Path) -> Path | None:
    from specfork.tools.traceplot import plot_k_trace

    traces = _rounds_by_strategy(doc, ("k", "confidence"))
    if not traces:
        return None
    title = "K and C per round (first prompt, first repeat)"
    return plot_k_trace(traces, out / PLOT_FILES["dspark"], title)


def _plot_forks(doc: Mapping[str, Any], out: Path) -> Path | None:
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    wins: dict[str, Counter[str]] = {}
    for m in doc["measurements"]:
        for r in m.get("rounds") or []:
            if "fork" in r:
                wins.setdefault(m["strategy"], Counter())[_fork_name(r["fork"])] += 1
    if not wins:
        return None
    fig, axes = plt.subplots(1, len(wins), figsize=(4.5 * len(wins), 3.8), squeeze=False)
    for ax, (label, counts) in zip(axes[0], wins.items(), strict=True):
        names = sorted(counts, key=_fork_sort_key)
        ax.bar(names, [counts[n] for n in names])
        ax.set_title(label, fontsize="small")
        ax.set_xlabel(
            "winning fork (none: no drafted token was right,\nthe round emitted the "
            "target's own token)",
            fontsize="small",
        )
        ax.set_ylabel("rounds (first repeat)")
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.tick_params(axis="x", rotation=30)
    fig.suptitle("Fork wins")
    return _save(fig, out / PLOT_FILES["forks"])


def _fork_name(value: Any) -> str:
    return "none" if value is None else str(value)


def _fork_sort_key(name: str) -> tuple[int, float, str]:
    try:
        return (0, float(name), name)
    except ValueError:
        return (1, 0.0, name)


def _save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
