"""The side-by-side benchmark: warm-up, interleaved measurements, greedy matches, medians.

Order of work (`run_interleaved`): a warm-up (each strategy runs `warmup` times on a warm-up
prompt that is not measured — so nothing a drafter learns there, such as SPORK's recycle
table, is about a measured prompt), then the prompts in order; for each prompt every repeat
runs every strategy once, one after the other, and each repeat starts one strategy later than
the one before (a rotation),
so no strategy always runs first after a prompt change. Machine drift thus hits all strategies
alike, and a speedup compares runs minutes, not hours, apart.

A strategy that cannot be built or fails its warm-up is recorded with its error and skipped;
a measurement that fails is recorded with its error and the benchmark goes on.

Figures (`summarize`): per prompt, the median over repeats; per category and overall, the
median over prompts of those per-prompt medians. The speedup of a prompt is its median decode
tokens/s over specfork's plain decoding's (``ar``) on the same prompt in the same run. The
greedy match of a prompt compares the first repeat's tokens with ``ar``'s: equal, a near-tie
(they first differ where the target's top-2 logits are within `near_tie`, i.e. a rounding
flip of a tied argmax, as in bf16), or different. Peak memory is the process-wide resident-set
high-water mark (VmHWM) during a strategy's runs: the weights of every loaded model count.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)

from specfork import __version__
from specfork.bench.prompts import BenchPrompt
from specfork.bench.specs import StrategySpec
from specfork.config import GenerationConfig, SamplingParams, SpecConfig
from specfork.errors import ConfigError, PromptError

NEAR_TIE = 0.25  # top-2 logit gap: two bf16 steps at logits of magnitude 16-32
OVERALL = "overall"

# (key, short title, format) of every figure, in report order
FIGURES: tuple[tuple[str, str, str], ...] = (
    ("decode_tokens_per_second", "decode tok/s", "{:.1f}"),
    ("speedup", "speedup", "{:.2f}×"),
    ("mean_accepted_length", "tokens/forward", "{:.2f}"),
    ("acceptance_rate", "acceptance", "{:.0%}"),
    ("time_to_first_token", "TTFT (s)", "{:.3f}"),
    ("target_forwards_per_token", "target fwd/token", "{:.2f}"),
    ("wasted_drafts_per_token", "wasted drafts/token", "{:.2f}"),
    ("greedy_match_rate", "greedy match", "{:.0%}"),
    ("exact_match_rate", "exact match", "{:.0%}"),
    ("target_logprob", "target log p/token", "{:.3f}"),
    ("peak_rss_mb", "peak RSS (MB)", "{:.0f}"),
)
_PER_RUN = (
    "decode_tokens_per_second",
    "mean_accepted_length",
    "acceptance_rate",
    "time_to_first_token",
    "target_forwards_per_token",
    "wasted_drafts_per_token",
)


@dataclass
class RunOutput:
    """What one run of one strategy on one prompt produced (None: not measured)."""

    token_ids: list[int]
    new_tokens: int  # tokens decoded, an ending EOS included
    decode_tokens_per_second: float
    time_to_first_token: float
    wall_seconds: float = 0.0
    target_forwards: int | None = None
    draft_forwards: int | None = None
    drafted: int | None = None
    accepted: int | None = None
    mean_accepted_length: float | None = None
    accepted_by_position: list[int] | None = None
    drafted_by_position: list[int] | None = None
    rounds: list[dict] | None = None
    finish_reason: str | None = None


@dataclass
class BenchStrategy:
    """A strategy ready to measure: ``run(prompt_ids) -> RunOutput``."""

    label: str
    family: str
    run: Callable[[list[int]], RunOutput] | None
    description: dict[str, Any] = field(default_factory=dict)
    error: str | None = None  # set when it could not be built or failed its warm-up
    skipped: bool = False  # not run at all (e.g. transformers missing); `error` says why

    @property
    def ok(self) -> bool:
        return self.error is None and self.run is not None and not self.skipped

    @property
    def status(self) -> str:
        return "skipped" if self.skipped else ("ok" if self.ok else "failed")

    def to_dict(self) -> dict[str, Any]:
        return {**self.description, "label": self.label, "family": self.family,
                "status": self.status, "error": self.error}  # fmt: skip


@dataclass
class PreparedPrompt:
    """A benchmark prompt and its token ids (chat template applied)."""

    index: int
    prompt: BenchPrompt
    ids: list[int]

    @property
    def category(self) -> str:
        return self.prompt.category


@dataclass
class Measurement:
    """One run of one strategy on one prompt (one repeat)."""

    sequence: int  # position in the run order (0 = first measured run)
    strategy: str
    prompt_index: int
    question_id: str | int
    category: str
    repeat: int
    ok: bool
    error: str | None = None
    output: RunOutput | None = None
    peak_rss_mb: float | None = None

    @property
    def new_tokens(self) -> int:
        return self.output.new_tokens if self.output else 0

    def figure(self, key: str) -> float | None:
        """A per-run figure (None where the strategy does not have it)."""
        o = self.output
        if o is None:
            return None
        n = max(o.new_tokens, 1)
        if key == "decode_tokens_per_second":
            return o.decode_tokens_per_second
        if key == "time_to_first_token":
            return o.time_to_first_token
        if key == "mean_accepted_length":
            return o.mean_accepted_length
        if key == "acceptance_rate":
            return o.accepted / o.drafted if o.drafted else None
        if key == "target_forwards_per_token":
            return o.target_forwards / n if o.target_forwards is not None else None
        if key == "wasted_drafts_per_token":
            if o.drafted is None or o.accepted is None:
                return None
            return (o.drafted - o.accepted) / n
        raise KeyError(key)

    def to_dict(self) -> dict[str, Any]:
        o = self.output
        out: dict[str, Any] = {
            "sequence": self.sequence, "strategy": self.strategy,
            "prompt_index": self.prompt_index, "question_id": self.question_id,
            "category": self.category, "repeat": self.repeat, "ok": self.ok,
            "error": self.error, "peak_rss_mb": self.peak_rss_mb,
        }  # fmt: skip
        if o is not None:
            out.update(
                output_tokens=len(o.token_ids),
                new_tokens=o.new_tokens,
                finish_reason=o.finish_reason,
                wall_seconds=o.wall_seconds,
                target_forwards=o.target_forwards,
                draft_forwards=o.draft_forwards,
                drafted=o.drafted,
                accepted=o.accepted,
                accepted_by_position=o.accepted_by_position,
                drafted_by_position=o.drafted_by_position,
                **{k: self.figure(k) for k in _PER_RUN},
                token_ids=o.token_ids,
                rounds=o.rounds,
            )
        return out


@dataclass
class MatchResult:
    """A greedy output compared with the reference: "exact", "near-tie" or "differs"."""

    status: str
    position: int | None = None  # first diverging output position
    gap: float | None = None  # the target's top-2 logit gap there


# ------------------------------------------------------------------------ memory, machine


def reset_peak_memory() -> bool:
    """Reset the process's VmHWM (Linux `clear_refs` 5); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_memory_mb() -> float | None:
    """The process's resident-set high-water mark (VmHWM) in MB, None off Linux."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def cpu_name() -> str:
    """The CPU model from /proc/cpuinfo (platform.processor() elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def command_line(argv: Sequence[str] | None = None) -> str:
    """The command that started this process (its program named by its file name)."""
    argv = list(sys.argv if argv is None else argv)
    if argv:
        argv[0] = Path(argv[0]).name
    return shlex.join(argv)


def machine_info(dtype: str | None = None, device: str | None = None) -> dict[str, Any]:
    """What results.json records about the machine and software."""
    try:
        import transformers

        tf_version: str | None = transformers.__version__
    except ImportError:
        tf_version = None
    return {
        "cpu": cpu_name(), "cpu_count": os.cpu_count(), "threads": torch.get_num_threads(),
        "torch": torch.__version__, "transformers": tf_version, "python": platform.python_version(),
        "platform": platform.platform(), "specfork": __version__, "dtype": dtype, "device": device,
        "command": command_line(),
    }  # fmt: skip


# ------------------------------------------------------------------------ runners


def round_dict(record: Any) -> dict:
    """A per-round trace record as a dict (RoundRecord.to_dict() plus any extra keys)."""
    if hasattr(record, "to_dict"):
        return dict(record.to_dict())
    if dataclasses.is_dataclass(record) and not isinstance(record, type):
        return dataclasses.asdict(record)
    if isinstance(record, Mapping):
        return dict(record)
    return dict(vars(record))


def specfork_runner(
    generator: Any, spec: StrategySpec, config: GenerationConfig, sampling: SamplingParams
) -> Callable[[list[int]], RunOutput]:
    """Runs `spec` on a shared specfork Generator (its drafter is built on first use)."""

    def run(ids: list[int]) -> RunOutput:
        t0 = time.perf_counter()
        res = generator.generate(list(ids), config=config, sampling=sampling, spec=spec.spec)
        wall = time.perf_counter() - t0
        s = res.stats
        return RunOutput(
            token_ids=list(res.token_ids), new_tokens=s.new_tokens,
            decode_tokens_per_second=s.decode_tokens_per_second,
            time_to_first_token=s.time_to_first_token, wall_seconds=wall,
            target_forwards=s.target_forwards, draft_forwards=s.draft_forwards,
            drafted=s.drafted, accepted=s.accepted,
            mean_accepted_length=s.mean_accepted_length,
            accepted_by_position=list(s.accepted_by_position),
            drafted_by_position=list(s.drafted_by_position),
            rounds=[round_dict(r) for r in s.rounds], finish_reason=res.finish_reason,
        )  # fmt: skip

    return run


def target_logprob(loaded: Any, prompt: Sequence[int], output: Sequence[int]) -> float | None:
    """Mean log-probability the target gives each output token after the prompt and the
    output before it (one forward): how far a lossy strategy drifted from what the target
    itself would say (plain greedy maximises each step's term)."""
    if not output:
        return None
    with torch.inference_mode():
        cache = loaded.model.new_cache(len(prompt) + len(output) + 8)
        ids = [*prompt, *output]
        logits = loaded.model.extend(ids[:-1], cache, last_only=False)  # [P + O - 1, V]
        logp = logits[len(prompt) - 1 :].log_softmax(-1)  # [O, V]
        target = torch.tensor(list(output), device=logp.device)  # [O]
        return float(logp.gather(-1, target[:, None]).mean())


def top2_gap(loaded: Any, ids: Sequence[int]) -> float:
    """The target's top-2 logit gap after `ids` (one prefill, a fresh cache)."""
    with torch.inference_mode():
        cache = loaded.model.new_cache(len(ids) + 8)
        top = loaded.model.extend(list(ids), cache).topk(2).values
    return float(top[0] - top[1])


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first position where two outputs differ (the shorter length if one is a prefix of
    the other); None when they are equal."""
    if list(a) == list(b):
        return None
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


def compare_greedy(
    reference: Sequence[int],
    other: Sequence[int],
    gap_at: Callable[[int], float],
    tolerance: float = NEAR_TIE,
) -> MatchResult:
    """Exact, near-tie or differs; `gap_at(i)` is the target's top-2 gap before output token i
    of the reference (its context: the prompt and the reference's first i tokens)."""
    pos = first_divergence(reference, other)
    if pos is None:
        return MatchResult("exact")
    gap = gap_at(pos)
    return MatchResult("near-tie" if gap <= tolerance else "differs", pos, gap)


# ------------------------------------------------------------------------ the run


class LiveProgress:
    """A rich progress bar (stderr): the current prompt and strategy, running speedups."""

    def __init__(self, console: Console | None, enabled: bool = True) -> None:
        self._progress = Progress(
            SpinnerColumn(),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.description}\n[dim]{task.fields[speedups]}"),
            console=console,
            disable=not enabled,
            transient=False,
        )
        self._task: Any = None

    @contextmanager
    def running(self, total: int) -> Iterator[LiveProgress]:
        with self._progress:
            self._task = self._progress.add_task("warm-up", total=total, speedups="")
            yield self

    def describe(self, text: str) -> None:
        if self._task is not None:
            self._progress.update(self._task, description=escape(text))

    def advance(self) -> None:
        if self._task is not None:
            self._progress.advance(self._task)

    def speedups(self, values: Mapping[str, float]) -> None:
        if self._task is not None:
            text = "speedups so far: " + ", ".join(f"{k} {v:.2f}×" for k, v in values.items())
            self._progress.update(self._task, speedups=escape(text))


def _persistent_recycle(spec: SpecConfig | None) -> bool:
    if spec is None or spec.strategy != "spork":
        return False
    return "recycle" in spec.drafter.split("+") and spec.recycle_persist


WARMUP_TEXT = "Explain in a few sentences how a bicycle stays upright."  # never measured


def run_order(n_strategies: int, repeat: int) -> list[int]:
    """Strategy indices in the order repeat `repeat` runs them (rotated by the repeat)."""
    return [(repeat + i) % n_strategies for i in range(n_strategies)]


def run_interleaved(
    strategies: Sequence[BenchStrategy],
    prompts: Sequence[PreparedPrompt],
    *,
    repeats: int = 3,
    warmup: int = 1,
    reference: str = "ar",
    progress: LiveProgress | None = None,
    measure_memory: bool = True,
    warmup_prompt: PreparedPrompt | None = None,
) -> list[Measurement]:
    """Measure every ready strategy on every prompt; see the module docstring for the order."""
    ready = [s for s in strategies if s.ok]
    progress = progress or LiveProgress(None, enabled=False)
    measurements: list[Measurement] = []
    total = len(ready) * (warmup + repeats * len(prompts))
    running: dict[str, list[float]] = {}
    with progress.running(total):
        for w in range(warmup if prompts else 0):
            p = warmup_prompt or prompts[w % len(prompts)]
            for s in ready:
                progress.describe(f"warm-up {w + 1}/{warmup} · {s.label}")
                if s.error is None:
                    try:
                        s.run(list(p.ids))  # type: ignore[misc]
                    except Exception as exc:
                        s.error = f"warm-up failed: {_describe(exc)}"
                progress.advance()
        active = [s for s in ready if s.error is None]
        for p in prompts:
            for r in range(repeats):
                for i in run_order(len(active), r):
                    s = active[i]
                    progress.describe(
                        f"prompt {p.index + 1}/{len(prompts)} ({p.category}) "
                        f"repeat {r + 1}/{repeats}: {s.label}"
                    )
                    measurements.append(_measure(s, p, r, len(measurements), measure_memory))
                    progress.advance()
            _update_running(running, measurements, p.index, reference)
            progress.speedups({k: statistics.median(v) for k, v in running.items() if v})
        for s in ready:  # strategies that failed their warm-up: their slots count as done
            if s.error is not None:
                for _ in range(repeats * len(prompts)):
                    progress.advance()
    return measurements


def _measure(
    s: BenchStrategy, p: PreparedPrompt, repeat: int, sequence: int, measure_memory: bool
) -> Measurement:
    m = Measurement(sequence, s.label, p.index, p.prompt.question_id, p.category, repeat, True)
    if measure_memory:
        reset_peak_memory()
    try:
        m.output = s.run(list(p.ids))  # type: ignore[misc]
        if repeat > 0 and m.output.rounds is not None:
            m.output.rounds = None  # per-round traces are kept for the first repeat only
    except Exception as exc:
        m.ok, m.error = False, _describe(exc)
    if measure_memory:
        m.peak_rss_mb = peak_memory_mb()
    return m


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _update_running(
    running: dict[str, list[float]], ms: Sequence[Measurement], index: int, reference: str
) -> None:
    rates: dict[str, list[float]] = {}
    for m in ms:
        if m.prompt_index == index and m.ok and m.output is not None:
            rates.setdefault(m.strategy, []).append(m.output.decode_tokens_per_second)
    ref = rates.get(reference)
    if not ref or statistics.median(ref) <= 0:
        return
    base = statistics.median(ref)
    for label, values in rates.items():
        if label != reference:
            running.setdefault(label, []).append(statistics.median(values) / base)


# ------------------------------------------------------------------------ figures


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
) -> list[dict[str, Any]]:
    """One row per (strategy, prompt): medians over the repeats, speedup, greedy match.

    `gap_fn(context_ids)` gives the target's top-2 logit gap after a context; without it (or
    when sampling) greedy matches are not judged. `logprob_fn(prompt, output)` scores the
    first repeat's output under the target (`target_logprob`).
    """
    by_key: dict[tuple[str, int], list[Measurement]] = {}
    for m in measurements:
        by_key.setdefault((m.strategy, m.prompt_index), []).append(m)
    rows = []
    for p in prompts:
        ref_ok = [m for m in by_key.get((reference, p.index), []) if m.ok and m.output]
        ref_tps = _median([m.figure("decode_tokens_per_second") for m in ref_ok])
        ref_ids = min(ref_ok, key=lambda m: m.repeat).output.token_ids if ref_ok else None  # type: ignore[union-attr]
        gaps: dict[int, float] = {}

        def gap_at(pos: int, p: PreparedPrompt = p, ref_ids=ref_ids, gaps=gaps) -> float:
            if pos not in gaps:
                gaps[pos] = gap_fn([*p.ids, *ref_ids[:pos]])  # type: ignore[misc]
            return gaps[pos]

        for label in strategies:
            ms = by_key.get((label, p.index), [])
            ok = [m for m in ms if m.ok and m.output is not None]
            row: dict[str, Any] = {
                "strategy": label, "prompt_index": p.index,
                "question_id": p.prompt.question_id, "category": p.category,
                "runs": len(ok), "failed": len(ms) - len(ok),
                "errors": sorted({m.error for m in ms if m.error}),
            }  # fmt: skip
            for key in _PER_RUN:
                row[key] = _median([m.figure(key) for m in ok])
            tps = row["decode_tokens_per_second"]
            row["speedup"] = tps / ref_tps if tps is not None and ref_tps else None
            peaks = [m.peak_rss_mb for m in ms if m.peak_rss_mb is not None]
            row["peak_rss_mb"] = max(peaks) if peaks else None
            match = None
            if ok and ref_ids is not None and greedy and gap_fn is not None:
                first = min(ok, key=lambda m: m.repeat).output.token_ids  # type: ignore[union-attr]
                match = compare_greedy(ref_ids, first, gap_at, near_tie)
            first_out = min(ok, key=lambda m: m.repeat).output if ok else None
            score = logprob_fn if logprob_fn is not None and first_out is not None else None
            row["target_logprob"] = score(list(p.ids), first_out.token_ids) if score else None  # type: ignore[union-attr]
            row["greedy_match"] = match.status if match else None
            row["divergence_position"] = match.position if match else None
            row["top2_gap"] = match.gap if match else None
            rows.append(row)
    return rows


def summarize(
    rows: Sequence[Mapping[str, Any]], strategies: Sequence[str], categories: Sequence[str]
) -> dict[str, dict[str, dict[str, Any]]]:
    """summary[strategy][category or "overall"][figure]: medians of the per-prompt rows
    (match rates are fractions of prompts; peak memory is the maximum)."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for label in strategies:
        out[label] = {}
        for cat in [*categories, OVERALL]:
            sel = [r for r in rows if r["strategy"] == label and cat in (r["category"], OVERALL)]
            cell: dict[str, Any] = {"prompts": len(sel), "failed": sum(r["failed"] for r in sel)}
            for key in (*_PER_RUN, "speedup", "target_logprob"):
                cell[key] = _median([r.get(key) for r in sel])
            judged = [r["greedy_match"] for r in sel if r["greedy_match"] is not None]
            cell["greedy_match_rate"] = (
                sum(j in ("exact", "near-tie") for j in judged) / len(judged) if judged else None
            )
            cell["exact_match_rate"] = (
                sum(j == "exact" for j in judged) / len(judged) if judged else None
            )
            peaks = [r["peak_rss_mb"] for r in sel if r["peak_rss_mb"] is not None]
            cell["peak_rss_mb"] = max(peaks) if peaks else None
            out[label][cat] = cell
    return out


def _median(values: Sequence[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


# ------------------------------------------------------------------------ the whole benchmark


@dataclass
class BenchSettings:
    """Everything one benchmark run needs (validated on construction)."""

    strategies: list[StrategySpec]
    prompts: list[BenchPrompt]
    model: str = "smollm2-135m-instruct"
    dtype: str = "auto"
    device: str = "auto"
    max_new_tokens: int = 128
    temperature: float = 0.0
    seed: int | None = None
    ignore_eos: bool = False
    repeats: int = 3
    warmup: int = 1
    near_tie: float = NEAR_TIE
    prompts_source: str = "built-in"
    notes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not _is_int(self.repeats) or self.repeats < 1:
            raise ConfigError(f"repeats must be an integer >= 1, got {self.repeats}")
        if not _is_int(self.warmup) or self.warmup < 0:
            raise ConfigError(f"warmup must be an integer >= 0, got {self.warmup}")
        if not (isinstance(self.near_tie, (int, float)) and self.near_tie >= 0):
            raise ConfigError(f"the near-tie tolerance must be >= 0, got {self.near_tie}")
        if not self.prompts:
            raise PromptError("no prompts to run (check --per-category / --limit)")
        if not self.strategies:
            raise ConfigError("no strategies to run")
        self.generation_config()
        self.sampling()

    def generation_config(self) -> GenerationConfig:
        return GenerationConfig(max_new_tokens=self.max_new_tokens, ignore_eos=self.ignore_eos)

    def sampling(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, seed=self.seed)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model, "dtype": self.dtype, "device": self.device,
            "max_new_tokens": self.max_new_tokens, "temperature": self.temperature,
            "seed": self.seed, "ignore_eos": self.ignore_eos, "repeats": self.repeats,
            "warmup": self.warmup, "near_tie_tolerance": self.near_tie,
            "prompts_source": self.prompts_source,
            "strategy_specs": [s.label for s in self.strategies],
        }  # fmt: skip


@dataclass
class BenchResults:
    """A finished benchmark: what ran, every measurement and the figures."""

    settings: BenchSettings
    machine: dict[str, Any]
    strategies: list[BenchStrategy]
    prompts: list[PreparedPrompt]
    measurements: list[Measurement]
    per_prompt: list[dict[str, Any]]
    summary: dict[str, dict[str, dict[str, Any]]]
    categories: list[str]
    reference: str
    notes: list[str]
    model_path: str = ""

    @property
    def labels(self) -> list[str]:
        """Labels of the strategies that have figures (not skipped), in the given order."""
        return [s.label for s in self.strategies if not s.skipped]

    def to_dict(self) -> dict[str, Any]:
        """The results.json document (schema "specfork-bench/1")."""
        return {
            "schema": SCHEMA,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "machine": self.machine,
            "settings": {**self.settings.to_dict(), "model_path": self.model_path},
            "reference": self.reference,
            "notes": self.notes,
            "categories": self.categories,
            "strategies": [s.to_dict() for s in self.strategies],
            "prompts": [
                {"index": p.index, **p.prompt.to_dict(), "prompt_tokens": len(p.ids)}
                for p in self.prompts
            ],
            "measurements": [m.to_dict() for m in self.measurements],
            "per_prompt": self.per_prompt,
            "summary": self.summary,
        }


SCHEMA = "specfork-bench/1"


def run_benchmark(
    settings: BenchSettings,
    *,
    console: Console | None = None,
    show_progress: bool = True,
    loaded: Any = None,
) -> BenchResults:
    """Load the model (unless `loaded` is given), build every strategy, measure, summarize."""
    from specfork.bench.specs import ensure_plain
    from specfork.engine import Generator

    notes = list(settings.notes)
    specs, added = ensure_plain(settings.strategies)
    if added:
        notes.append("added `ar` (plain decoding): speedups and greedy matches are against it")
    config, sampling = settings.generation_config(), settings.sampling()
    if loaded is None:
        from specfork.loading.loader import load_model

        status = console.status(f"loading {settings.model}…") if console else _null()
        with status:
            loaded = load_model(settings.model, dtype=settings.dtype, device=settings.device,
                                progress=False)  # fmt: skip
    generator = Generator(loaded)
    reference = next(s.label for s in specs if s.is_plain)
    if settings.repeats > 1 and any(_persistent_recycle(s.spec) for s in specs):
        notes.append(
            "recycle tables persist across requests: a repeat of a prompt drafts from a table "
            "that learned that prompt's earlier run; measure with recycle_persist=false or "
            "--repeats 1 for figures free of that"
        )
    strategies = _build_strategies(specs, loaded, generator, settings, config, sampling, notes)
    prompts = [
        PreparedPrompt(i, p, generator.encode_prompt(p.text))
        for i, p in enumerate(settings.prompts)
    ]
    progress = LiveProgress(console, enabled=show_progress and console is not None)
    warmup = BenchPrompt("warm-up", "warm-up", WARMUP_TEXT)
    measurements = run_interleaved(
        strategies, prompts, repeats=settings.repeats, warmup=settings.warmup,
        reference=reference, progress=progress,
        warmup_prompt=PreparedPrompt(-1, warmup, generator.encode_prompt(WARMUP_TEXT)),
    )  # fmt: skip
    for s in strategies:
        if s.error and not s.skipped:
            notes.append(f"{s.label} failed: {s.error}")
    if not reset_peak_memory():
        notes.append("peak memory is the process's high-water mark since it started")
    if not sampling.greedy:
        notes.append("sampling (temperature > 0): greedy match rates are not judged")
    labels = [s.label for s in strategies if not s.skipped]
    categories = list(dict.fromkeys(p.category for p in prompts))
    per_prompt = per_prompt_figures(
        measurements, labels, prompts, reference=reference,
        gap_fn=lambda ctx: top2_gap(loaded, ctx), greedy=sampling.greedy,
        near_tie=settings.near_tie,
        logprob_fn=lambda prompt, out: target_logprob(loaded, prompt, out),
    )  # fmt: skip
    return BenchResults(
        settings=settings, machine=machine_info(str(loaded.model.dtype).removeprefix("torch."),
                                                str(loaded.model.device)),
        strategies=strategies, prompts=prompts, measurements=measurements,
        per_prompt=per_prompt, summary=summarize(per_prompt, labels, categories),
        categories=categories, reference=reference, notes=notes, model_path=str(loaded.path),
    )  # fmt: skip


def _build_strategies(
    specs: Sequence[StrategySpec],
    loaded: Any,
    generator: Any,
    settings: BenchSettings,
    config: GenerationConfig,
    sampling: SamplingParams,
    notes: list[str],
) -> list[BenchStrategy]:
    out: list[BenchStrategy] = []
    hf_state: dict[str, Any] = {}  # the transformers models, shared by all baselines
    for spec in specs:
        if spec.family == "hf":
            out.append(_build_hf(spec, specs, loaded, settings, sampling, notes, hf_state))
            continue
        spec = _with_expected_length(spec, settings.max_new_tokens)
        strategy = BenchStrategy(spec.label, "specfork", None, spec.describe())
        try:
            generator.use_strategy(spec.spec)  # builds (and checks) its drafter once
            strategy.run = specfork_runner(generator, spec, config, sampling)
        except Exception as exc:
            strategy.error = f"cannot build: {_describe(exc)}"
        out.append(strategy)
    return out


def _build_hf(
    spec: StrategySpec,
    specs: Sequence[StrategySpec],
    loaded: Any,
    settings: BenchSettings,
    sampling: SamplingParams,
    notes: list[str],
    state: dict[str, Any],
) -> BenchStrategy:
    from specfork.bench import hf

    if not hf.transformers_available():
        note = "transformers is not installed: its baselines are skipped (pip install transformers)"
        if note not in notes:
            notes.append(note)
        return BenchStrategy(spec.label, "hf", None, spec.describe(),
                             error="transformers is not installed", skipped=True)  # fmt: skip
    if "models" not in state:
        state["models"] = hf.HFModels(loaded.model.dtype, loaded.model.device)
    drafts = [
        s.spec.drafter.removeprefix("model:")
        for s in specs
        if s.spec is not None and str(s.spec.drafter).startswith("model:")
    ]
    return hf.build_hf_strategy(
        spec, target_path=loaded.path, models=state["models"], n=settings.max_new_tokens,
        eos_ids=loaded.tokenizer.eos_ids, sampling=sampling, ignore_eos=settings.ignore_eos,
        default_draft=drafts[0] if drafts else None,
    )  # fmt: skip


def _with_expected_length(spec: StrategySpec, n: int) -> StrategySpec:
    """Policies that plan for the output length (linear decay) get max_new_tokens unless the
    spec sets expected_length itself."""
    assert spec.spec is not None
    names = {f.name for f in dataclasses.fields(spec.spec)}
    if "expected_length" in names and "expected_length" not in spec.options:
        return dataclasses.replace(spec, spec=dataclasses.replace(spec.spec, expected_length=n))
    return spec


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@contextmanager
def _null() -> Iterator[None]:
    yield
