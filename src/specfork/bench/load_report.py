"""Reports of a load run (`specfork.bench.load`): medians over repeats, ratios, the greedy-text
check, the markdown tables, results.json and the tokens/s plot.

Greedy decoding of the same prompt must give the same text in every configuration and at every
concurrency: speculation is lossless and a request's output must not depend on the requests that
share its forwards. `text_mismatches` names every request whose text differs from the first
text seen for its prompt (for its prompt and turn in a workload replay, whose later turns carry
the server's earlier answers: deterministic under greedy decoding, so the same everywhere too).

A replay's report adds a table of the later turns (2 and on) beside the one of every request
(`summarize_later_turns`), with turn 1's TTFT and tokens per target forward next to theirs: the
later turns are where the server's prefix cache holds the conversation so far.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specfork.bench.load import (
    LIBRARY_PROMPTS,
    LevelRun,
    LibraryCheck,
    LoadConfig,
    LoadSettings,
    RequestSample,
    SweepResult,
)
from specfork.bench.load_replay import Conversation
from specfork.bench.report import md_table

_EXCERPT = 60  # characters of a prompt or text shown in a mismatch line


@dataclass(frozen=True)
class Row:
    """One configuration at one concurrency level: medians over repeats."""

    config: str
    concurrency: int
    requests: int  # per repeat
    requests_per_s: float
    tokens_per_s: float
    p50: float
    p95: float
    ttft_p50: float
    mean_accepted: float
    differing: int  # requests (all repeats) whose text is not the prompt's reference text
    server_decode_tps: float  # median over repeats' requests on the library check's prompts
    server_latency: float  # the same requests' median latency (seconds, client side)


@dataclass(frozen=True)
class Mismatch:
    """A request whose greedy text differs from the first text of the same prompt (and turn)."""

    prompt: int
    config: str
    concurrency: int
    repeat: int
    reference: str  # where the reference text came from
    position: int  # first differing character
    turn: int = 1


def text_mismatches(runs: Sequence[LevelRun]) -> list[Mismatch]:
    """Every request whose text differs from its prompt's (and turn's) first text (in run
    order)."""
    first: dict[tuple[int, int], tuple[str, str]] = {}  # (prompt, turn) -> (text, where)
    found = []
    for run in runs:
        for s in run.samples:
            where = f"{run.config} at {_clients(run.concurrency)}"
            text, origin = first.setdefault((s.prompt, s.turn), (s.text, where))
            if s.text != text:
                at = _first_difference(text, s.text)
                found.append(
                    Mismatch(s.prompt, run.config, run.concurrency, run.repeat, origin, at, s.turn)
                )
    return found


def _first_difference(a: str, b: str) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


def summarize(
    result: SweepResult, configs: Sequence[LoadConfig], mismatches: Sequence[Mismatch] = ()
) -> list[Row]:
    """A row per configuration and concurrency level, in configuration order."""
    differing = Counter((m.config, m.concurrency) for m in mismatches)
    groups: dict[tuple[str, int], list[LevelRun]] = {}
    for run in result.runs:
        groups.setdefault((run.config, run.concurrency), []).append(run)
    order = {c.label: i for i, c in enumerate(configs)}
    rows = [_row(key, runs, differing.get(key, 0)) for key, runs in groups.items()]
    return sorted(rows, key=lambda r: (order[r.config], r.concurrency))


def summarize_later_turns(
    result: SweepResult, configs: Sequence[LoadConfig], mismatches: Sequence[Mismatch] = ()
) -> tuple[list[Row], list[Row]]:
    """`summarize` of the later turns (2 and on) and of the first turns, each over its levels'
    whole wall time; no rows when no request was a later turn (no replay)."""
    if not any(s.turn >= 2 for r in result.runs for s in r.samples):
        return [], []

    def of(keep: Callable[[int], bool]) -> list[Row]:
        runs = [r.of_turns(keep) for r in result.runs]
        part = SweepResult([r for r in runs if r.samples], result.library)
        return summarize(part, configs, [m for m in mismatches if keep(m.turn)])

    return of(lambda turn: turn >= 2), of(lambda turn: turn == 1)


def _row(key: tuple[str, int], runs: list[LevelRun], differing: int) -> Row:
    def median(value: Callable[[LevelRun], float]) -> float:
        return statistics.median(value(r) for r in runs)

    return Row(
        config=key[0],
        concurrency=key[1],
        requests=len(runs[0].samples),
        requests_per_s=median(lambda r: r.requests_per_s),
        tokens_per_s=median(lambda r: r.tokens_per_s),
        p50=median(lambda r: r.latency(0.5)),
        p95=median(lambda r: r.latency(0.95)),
        ttft_p50=median(lambda r: r.ttft_p50),
        mean_accepted=median(lambda r: r.mean_accepted),
        differing=differing,
        server_decode_tps=_on_library_prompts(runs, lambda s: s.decode_tps),
        server_latency=_on_library_prompts(runs, lambda s: s.latency),
    )


def _on_library_prompts(runs: list[LevelRun], value: Callable[[RequestSample], float]) -> float:
    """Median `value` of the requests on the prompts the library's check runs (the first turns
    of the first LIBRARY_PROMPTS), so server and library compare on the same contexts: a long
    prompt makes prefill and every decode step slower. All requests where none asked those."""
    every = [value(s) for r in runs for s in r.samples]
    same = [value(s) for r in runs for s in r.samples if s.prompt < LIBRARY_PROMPTS and s.turn == 1]
    return statistics.median(same or every)


def ratios(
    rows: Sequence[Row], configs: Sequence[LoadConfig]
) -> dict[str, dict[str, dict[int, float]]]:
    """Tokens/s ratios per concurrency level (`ratio_pairs` says which), by kind and name."""
    tps = {(r.config, r.concurrency): r.tokens_per_s for r in rows}
    levels = sorted({r.concurrency for r in rows})
    out: dict[str, dict[str, dict[int, float]]] = {}
    for kind, pairs in ratio_pairs(configs).items():
        out[kind] = {}
        for name, (a, b) in pairs.items():
            both = [n for n in levels if tps.get((b.label, n)) and (a.label, n) in tps]
            out[kind][name] = {n: tps[(a.label, n)] / tps[(b.label, n)] for n in both}
    return out


def ratio_pairs(
    configs: Sequence[LoadConfig],
) -> dict[str, dict[str, tuple[LoadConfig, LoadConfig]]]:
    """(numerator, denominator) by name: each speculative configuration over plain decoding at
    the same max_running; each max_running N over max-running 1 of the same strategy."""
    plain = {c.max_running: c for c in configs if not c.speculative}
    single = {c.strategy: c for c in configs if c.max_running == 1}
    on_off = {
        f"{c.label} / {plain[c.max_running].strategy}": (c, plain[c.max_running])
        for c in configs
        if c.speculative and c.max_running in plain
    }
    running = {
        f"{c.strategy}: max-running {c.max_running} / 1": (c, single[c.strategy])
        for c in configs
        if c.max_running != 1 and c.strategy in single
    }
    return {"speculation on / off": on_off, "max-running N / max-running 1": running}


# ------------------------------------------------------------------------------------ outputs


@dataclass
class LoadReport:
    """Everything a load run produced, with its derived figures."""

    configs: list[LoadConfig]
    settings: LoadSettings
    prompts: list[str]
    result: SweepResult
    about: dict[str, Any]  # model and machine (results.json)
    conversations: list[Conversation] = field(default_factory=list)  # a replay's

    def __post_init__(self) -> None:
        self.mismatches = text_mismatches(self.result.runs)
        self.rows = summarize(self.result, self.configs, self.mismatches)
        self.ratios = ratios(self.rows, self.configs)
        self.later_rows, self.first_rows = summarize_later_turns(
            self.result, self.configs, self.mismatches
        )

    def mismatch_lines(self) -> list[str]:
        """One line per differing request, naming its prompt (a replay's: its conversation and
        turn)."""
        return [
            f"{self._asked(m)}: {m.config} at {_clients(m.concurrency)} (repeat "
            f"{m.repeat + 1}) differs from {m.reference} at character {m.position}"
            for m in self.mismatches
        ]

    def _asked(self, m: Mismatch) -> str:
        if not self.conversations:
            return f"prompt {m.prompt} ({_excerpt(self.prompts[m.prompt])})"
        conversation = self.conversations[m.prompt]
        return (
            f"conversation {m.prompt} ({conversation.name}) turn {m.turn} "
            f"({_excerpt(conversation.turns[m.turn - 1])})"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": "specfork-serve-load",
            **self.about,
            "settings": dataclasses.asdict(self.settings),
            "configurations": [_config_json(c) for c in self.configs],
            "prompts": self.prompts,
            **(
                {"conversations": [c.to_json() for c in self.conversations]}
                if self.conversations
                else {}
            ),
            "library_decode_tokens_per_s": _library_json(self.result.library, "decode_tps"),
            "library_latency_s": _library_json(self.result.library, "latency"),
            "runs": [_run_json(r) for r in self.result.runs],
            "summary": [dataclasses.asdict(r) for r in self.rows],
            **(
                {
                    "summary_later_turns": [dataclasses.asdict(r) for r in self.later_rows],
                    "summary_first_turns": [dataclasses.asdict(r) for r in self.first_rows],
                }
                if self.later_rows
                else {}
            ),
            "ratios": self.ratios,
            "same_text": not self.mismatches,
            "text_mismatches": [dataclasses.asdict(m) for m in self.mismatches],
        }

    def markdown(self) -> str:
        parts = [self._main_table()]
        if self.later_rows:
            parts.append(self._later_table())
        for kind, table in self.ratios.items():
            if table:
                parts.append(f"Tokens/s ratio, {kind}:\n\n{_ratio_table(table)}")
        if library := self._library_table():
            parts.append(library)
        return "\n\n".join(parts) + "\n"

    def _main_table(self) -> str:
        header = [
            "configuration",
            "clients",
            "requests",
            "requests/s",
            "tokens/s",
            "p50 latency (s)",
            "p95 latency (s)",
            "p50 TTFT (s)",
            "mean accepted length",
            "same text",
        ]
        repeats = self.settings.repeats
        rows = [
            [
                r.config,
                r.concurrency,
                r.requests,
                f"{r.requests_per_s:.2f}",
                f"{r.tokens_per_s:.1f}",
                f"{r.p50:.2f}",
                f"{r.p95:.2f}",
                f"{r.ttft_p50:.2f}",
                f"{r.mean_accepted:.2f}",
                "yes" if not r.differing else f"no ({r.differing} of {r.requests * repeats})",
            ]
            for r in self.rows
        ]
        return md_table(header, rows)

    def _later_table(self) -> str:
        """The later turns (2 and on) of a replay beside its first turns: a later turn's
        prompt holds the conversation so far, which the server's prefix cache keeps."""
        first = {(r.config, r.concurrency): r for r in self.first_rows}
        header = [
            "configuration",
            "clients",
            "requests",
            "requests/s",
            "tokens/s",
            "p50 TTFT (s)",
            "turn 1: p50 TTFT (s)",
            "mean accepted length",
            "turn 1: mean accepted length",
            "same text",
        ]
        rows = []
        for r in self.later_rows:
            one = first.get((r.config, r.concurrency))
            rows.append(
                [
                    r.config,
                    r.concurrency,
                    r.requests,
                    f"{r.requests_per_s:.2f}",
                    f"{r.tokens_per_s:.1f}",
                    f"{r.ttft_p50:.2f}",
                    f"{one.ttft_p50:.2f}" if one else "n/a",
                    f"{r.mean_accepted:.2f}",
                    f"{one.mean_accepted:.2f}" if one else "n/a",
                    "yes" if not r.differing else f"no ({r.differing})",
                ]
            )
        return (
            "Later turns (2 and on) only, beside turn 1 (requests/s and tokens/s: their share "
            f"of the level's, over its whole time):\n\n{md_table(header, rows)}"
        )

    def _library_table(self) -> str:
        """One request through the server (concurrency 1) against the library's
        `Generator.generate` on the same prompts: its decode speed and its whole latency (a
        server slower per request shows up here)."""
        rows = []
        for config in self.configs:
            row = next(
                (r for r in self.rows if r.config == config.label and r.concurrency == 1), None
            )
            checks = self.result.library.get(config.strategy)
            if row is None or not checks:
                continue
            tps = statistics.median(c.decode_tps for c in checks)
            latency = statistics.median(c.latency for c in checks)
            rows.append(
                [
                    config.label,
                    f"{row.server_decode_tps:.1f}",
                    f"{tps:.1f}",
                    _ratio(row.server_decode_tps, tps),
                    f"{row.server_latency:.3f}",
                    f"{latency:.3f}",
                    _ratio(row.server_latency, latency),
                ]
            )
        if not rows:
            return ""
        header = [
            "configuration",
            "decode tok/s, server (1 client)",
            "library",
            "server / library",
            "latency (s), server (1 client)",
            "library",
            "server / library",
        ]
        return (
            f"One request at a time, on the library check's {LIBRARY_PROMPTS} prompts (decode "
            f"speed without prefill; latency of the whole request, prefill included):\n\n"
            f"{md_table(header, rows)}"
        )


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b else "n/a"


def _library_json(library: dict[str, list[LibraryCheck]], field: str) -> dict[str, list[float]]:
    return {name: [getattr(c, field) for c in checks] for name, checks in library.items()}


def _config_json(config: LoadConfig) -> dict[str, Any]:
    return {
        "label": config.label,
        "strategy": config.strategy,
        "spec": config.spec.to_dict(),
        "max_running": config.max_running,
    }


def _run_json(run: LevelRun) -> dict[str, Any]:
    return {
        "config": run.config,
        "repeat": run.repeat,
        "concurrency": run.concurrency,
        "wall_seconds": run.wall,
        "samples": [dataclasses.asdict(s) for s in run.samples],
    }


def _ratio_table(table: dict[str, dict[int, float]]) -> str:
    levels = sorted({n for values in table.values() for n in values})
    header = ["", *(_clients(n) for n in levels)]
    rows = [
        [name, *(f"{v[n]:.2f}" if n in v else "n/a" for n in levels)] for name, v in table.items()
    ]
    return md_table(header, rows)


def _clients(n: int) -> str:
    return f"{n} client" if n == 1 else f"{n} clients"


def _excerpt(text: str) -> str:
    text = " ".join(text.split())
    return repr(text if len(text) <= _EXCERPT else text[: _EXCERPT - 1] + "…")


def write_outputs(report: LoadReport, out: Path, title: str = "") -> dict[str, Path]:
    """results.json, table.md and load.png in `out` (which exists)."""
    paths = {"results": out / "results.json", "table": out / "table.md", "plot": out / "load.png"}
    paths["results"].write_text(json.dumps(report.to_json(), indent=1) + "\n")
    paths["table"].write_text((f"{title}\n\n" if title else "") + report.markdown())
    plot_tokens_per_s(report.rows, report.configs, paths["plot"])
    return paths


def plot_tokens_per_s(rows: Sequence[Row], configs: Sequence[LoadConfig], path: Path) -> Path:
    """Tokens/s against concurrency (log2 axis), one line per configuration."""
    os.environ.setdefault("MPLBACKEND", "Agg")
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for config in configs:
        mine = [r for r in rows if r.config == config.label]
        style = "-" if config.max_running > 1 else "--"
        ax.plot(
            [r.concurrency for r in mine],
            [r.tokens_per_s for r in mine],
            style,
            marker="o",
            label=config.label,
        )
    levels = sorted({r.concurrency for r in rows})
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(n) for n in levels])
    ax.set_xlabel("concurrent clients")
    ax.set_ylim(bottom=0)
    ax.set_ylabel("generated tokens/s")
    ax.set_title("specfork serve: throughput against concurrency (medians)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
