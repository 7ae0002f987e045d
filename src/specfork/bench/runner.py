"""The side-by-side benchmark: warm-up, interleaved measurements, greedy matches, medians.

Order of work (`run_interleaved`): a warm-up (each strategy runs `warmup` times on a warm-up
prompt that is not measured — so nothing a drafter learns there, such as SPORK's recycle
table, is about a measured prompt), then the prompts in order; for each prompt every repeat
runs every strategy once, one after the other, and each repeat starts one strategy later than
the one before (a rotation),
so no strategy always runs first after a prompt change. Machine drift thus hits all strategies
alike, and a speedup compares runs minutes, not hours, apart.

Multi-turn conversations (``turns="all"``): a prompt's turns run one after the other, each as
above; a later turn's context is the conversation so far with plain decoding's (``ar``'s)
own first-repeat answers, built once, so every strategy decodes it on the same tokens and its
figures compare with ``ar``'s run of the same turn.

A strategy that cannot be built or fails its warm-up is recorded with its error and skipped;
a measurement that fails is recorded with its error and the benchmark goes on.

Figures (`summary.summarize`): per prompt, the median over repeats; per category and overall, the
median over prompts of those per-prompt medians. The speedup of a prompt is its median decode
tokens/s over specfork's plain decoding's (``ar``) on the same prompt in the same run. The
greedy match of a prompt compares the first repeat's tokens with ``ar``'s: equal, a near-tie
(they first differ where the target's top-2 logits are within `near_tie`, i.e. a rounding
flip of a tied argmax, as in bf16), or different. Peak memory is the process-wide resident-set
high-water mark (VmHWM) during a strategy's runs: the weights of every loaded model count.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from rich.console import Console

from specfork.bench import isolation
from specfork.bench.advice import where_speculation_pays
from specfork.bench.machine import machine_info, peak_memory_mb, reset_peak_memory
from specfork.bench.progress import LiveProgress
from specfork.bench.prompts import BenchPrompt
from specfork.bench.quality import NEAR_TIE, target_logprob, top2_gap
from specfork.bench.records import BenchStrategy, Measurement, PreparedPrompt, RunOutput
from specfork.bench.specs import StrategySpec
from specfork.bench.summary import (
    per_prompt_figures,
    summarize,
    summarize_later_turns,
    turns_of,
)
from specfork.checks import is_int
from specfork.config import GenerationConfig, SamplingParams, SpecConfig
from specfork.constraint import Constraint
from specfork.errors import ConfigError, PromptError
from specfork.loading.loader import DTYPES, resolve_dtype
from specfork.models.target import TargetModel
from specfork.threads import parse_threads

# ------------------------------------------------------------------------ runners


def hf_dtype(model: TargetModel) -> torch.dtype:
    """The float dtype transformers baselines run in: the model's, bf16/fp32 for GGUF blocks."""
    if model.precision == "gguf":
        return resolve_dtype("auto", model.device)
    return DTYPES[model.precision]


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
        constraint = config.constraint
        valid = None
        if constraint is not None:
            valid = res.finish_reason == "stop" and constraint.matches(res.text)
        return RunOutput(
            token_ids=list(res.token_ids),
            new_tokens=s.new_tokens,
            decode_tokens_per_second=s.decode_tokens_per_second,
            time_to_first_token=s.time_to_first_token,
            wall_seconds=wall,
            target_forwards=s.target_forwards,
            draft_forwards=s.draft_forwards,
            drafted=s.drafted,
            accepted=s.accepted,
            mean_accepted_length=s.mean_accepted_length,
            accepted_by_position=list(s.accepted_by_position),
            drafted_by_position=list(s.drafted_by_position),
            rounds=[round_dict(r) for r in s.rounds],
            finish_reason=res.finish_reason,
            valid=valid,
            decode_seconds=s.decode_seconds,
            phase_seconds=dict(s.phase_seconds),
            by_source={name: list(counts) for name, counts in s.by_source.items()},
            paused_rounds=s.paused_rounds,
            plain_steps=plain_steps(
                generator, [(r.drafted + 1, s.prompt_tokens + r.position) for r in s.rounds]
            ),
        )

    return run


def plain_steps(generator: Any, forwards: list[tuple[int, int]]) -> float:
    """What forwards of (rows, cached tokens) cost in one-row steps at their contexts, by the
    model's measured cost curve (read only when some forward had more than one row: plain
    decoding measures none)."""
    if all(rows == 1 for rows, _ in forwards):
        return float(len(forwards))
    curve = generator.cost_curve()
    return sum(curve.at(context)(rows) for rows, context in forwards)


# ------------------------------------------------------------------------ the run


def _persistent_recycle(spec: SpecConfig | None) -> bool:
    return spec is not None and spec.recycle_persist and spec.drafts_with("recycle")


WARMUP_TEXT = "Explain in a few sentences how a bicycle stays upright."  # never measured


def run_order(n_strategies: int, repeat: int) -> list[int]:
    """Strategy indices in the order repeat `repeat` runs them (rotated by the repeat)."""
    return [(repeat + i) % n_strategies for i in range(n_strategies)]


NextTurn = Callable[[PreparedPrompt, RunOutput], PreparedPrompt]


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
    next_turn: NextTurn | None = None,
) -> list[Measurement]:
    """Measure every ready strategy on every prompt; see the module docstring for the order.

    With `next_turn` every turn of a prompt's conversation is measured, one after the other:
    ``next_turn(prompt, output)`` builds the next turn from this turn and the reference's
    first-repeat output on it, so every strategy decodes a later turn on the same context.
    Where the reference has no output for a turn (it failed), the later turns are recorded
    as failed for every strategy.
    """
    ready = [s for s in strategies if s.ok]
    progress = progress or LiveProgress(None, enabled=False)
    measurements: list[Measurement] = []
    turns = sum(len(p.prompt.turns) if next_turn else 1 for p in prompts)
    total = len(ready) * (warmup + repeats * turns)
    running: dict[str, list[float]] = {}
    with progress.running(total):
        for w in range(warmup if prompts else 0):
            p = warmup_prompt or prompts[w % len(prompts)]
            for s in ready:
                progress.describe(f"warm-up {w + 1}/{warmup} · {s.label}")
                if s.error is None:
                    try:
                        s.run_on(p)
                    except Exception as exc:
                        s.error = f"warm-up failed: {_describe(exc)}"
                progress.advance()
        active = [s for s in ready if s.error is None]
        for first in prompts:
            p: PreparedPrompt | None = first
            last = len(first.prompt.turns) if next_turn else 1
            while p is not None:
                _measure_turn(
                    active,
                    p,
                    repeats,
                    len(prompts),
                    measurements,
                    progress,
                    measure_memory,
                    multi_turn=next_turn is not None,
                )
                _update_running(running, measurements, p, reference)
                progress.speedups({k: statistics.median(v) for k, v in running.items() if v})
                if next_turn is None or p.turn >= last:
                    break
                p = _next_turn(
                    next_turn, p, measurements, reference, active, repeats, last, progress
                )
        for s in ready:  # strategies that failed their warm-up: their slots count as done
            if s.error is not None:
                for _ in range(repeats * turns):
                    progress.advance()
    return measurements


def _measure_turn(
    active: Sequence[BenchStrategy],
    p: PreparedPrompt,
    repeats: int,
    n_prompts: int,
    measurements: list[Measurement],
    progress: LiveProgress,
    measure_memory: bool,
    multi_turn: bool,
) -> None:
    """Every repeat of every active strategy on one turn of one prompt (rotated order)."""
    where = f"prompt {p.index + 1}/{n_prompts}" + (f" turn {p.turn}" if multi_turn else "")
    for r in range(repeats):
        for i in run_order(len(active), r):
            s = active[i]
            progress.describe(f"{where} ({p.category}) repeat {r + 1}/{repeats}: {s.label}")
            measurements.append(_measure(s, p, r, len(measurements), measure_memory))
            progress.advance()


def _next_turn(
    next_turn: NextTurn,
    p: PreparedPrompt,
    measurements: list[Measurement],
    reference: str,
    active: Sequence[BenchStrategy],
    repeats: int,
    last: int,
    progress: LiveProgress,
) -> PreparedPrompt | None:
    """The prompt's next turn built on the reference's answer; None (and every later turn
    recorded as failed) when the reference has no answer or the turn cannot be built."""
    ref = [
        m
        for m in measurements
        if (m.strategy, m.prompt_index, m.turn) == (reference, p.index, p.turn)
        and m.ok
        and m.output is not None
    ]
    if ref:
        try:
            return next_turn(p, min(ref, key=lambda m: m.repeat).output)  # type: ignore[arg-type]
        except Exception as exc:
            error = f"turn {p.turn + 1} could not be built: {_describe(exc)}"
    else:
        error = f"no context for turn {p.turn + 1}: {reference} has no answer to turn {p.turn}"
    for turn in range(p.turn + 1, last + 1):
        for r in range(repeats):
            for s in active:
                measurements.append(
                    Measurement(
                        len(measurements),
                        s.label,
                        p.index,
                        p.prompt.question_id,
                        p.category,
                        r,
                        False,
                        error=error,
                        turn=turn,
                    )
                )
                progress.advance()
    return None


def _measure(
    s: BenchStrategy, p: PreparedPrompt, repeat: int, sequence: int, measure_memory: bool
) -> Measurement:
    m = Measurement(
        sequence, s.label, p.index, p.prompt.question_id, p.category, repeat, True, turn=p.turn
    )
    if measure_memory:
        reset_peak_memory()
    try:
        m.output = s.run_on(p)
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
    running: dict[str, list[float]], ms: Sequence[Measurement], p: PreparedPrompt, reference: str
) -> None:
    rates: dict[str, list[float]] = {}
    for m in ms:
        if (m.prompt_index, m.turn) == (p.index, p.turn) and m.ok and m.output is not None:
            rates.setdefault(m.strategy, []).append(m.output.decode_tokens_per_second)
    ref = rates.get(reference)
    if not ref or statistics.median(ref) <= 0:
        return
    base = statistics.median(ref)
    for label, values in rates.items():
        if label != reference:
            running.setdefault(label, []).append(statistics.median(values) / base)


# ------------------------------------------------------------------------ the whole benchmark


@dataclass
class BenchSettings:
    """Everything one benchmark run needs (validated on construction)."""

    strategies: list[StrategySpec]
    prompts: list[BenchPrompt]
    model: str = "smollm2-135m-instruct"
    dtype: str = "auto"
    device: str = "auto"
    kernels: bool | None = None  # specfork's compiled CPU kernels: None = where they help
    threads: int | str | None = None  # None/"auto": the usable cores, fewer while busy
    exact: bool = False  # every specfork strategy must run batch-invariant steps
    max_new_tokens: int = 128
    temperature: float = 0.0
    seed: int | None = None
    ignore_eos: bool = False
    repeats: int = 3
    warmup: int = 1
    near_tie: float = NEAR_TIE
    constraint: Constraint | None = None  # structured output: every run must match it
    prompts_source: str = "built-in"
    prompt_suffix: str = ""  # appended to every prompt (e.g. "Answer in JSON.")
    notes: list[str] = field(default_factory=list)
    turns: str = "first"  # "first": first turns only; "all": every turn of a conversation

    def __post_init__(self) -> None:
        if self.turns not in TURNS:
            raise ConfigError(f"turns must be one of {', '.join(TURNS)}, got {self.turns!r}")
        if not is_int(self.repeats) or self.repeats < 1:
            raise ConfigError(f"repeats must be an integer >= 1, got {self.repeats}")
        if not is_int(self.warmup) or self.warmup < 0:
            raise ConfigError(f"warmup must be an integer >= 0, got {self.warmup}")
        if not (isinstance(self.near_tie, (int, float)) and self.near_tie >= 0):
            raise ConfigError(f"the near-tie tolerance must be >= 0, got {self.near_tie}")
        parse_threads(self.threads)
        if not self.prompts:
            raise PromptError("no prompts to run (check --per-category / --limit)")
        if not self.strategies:
            raise ConfigError("no strategies to run")
        self.generation_config()
        self.sampling()
        baselines = [s.label for s in self.strategies if s.family != "specfork"]
        if self.constraint is not None and baselines:
            raise ConfigError(
                f"{', '.join(baselines)} cannot run constrained (structured output is "
                "specfork's); drop them or the --json / --json-schema / --regex flag"
            )

    def generation_config(self) -> GenerationConfig:
        return GenerationConfig(
            max_new_tokens=self.max_new_tokens,
            ignore_eos=self.ignore_eos,
            exact=self.exact,
            constraint=self.constraint,
        )

    def sampling(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, seed=self.seed)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "dtype": self.dtype,
            "device": self.device,
            "kernels": self.kernels,
            "threads": self.threads,
            "exact": self.exact,
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "seed": self.seed,
            "ignore_eos": self.ignore_eos,
            "repeats": self.repeats,
            "warmup": self.warmup,
            "near_tie_tolerance": self.near_tie,
            "prompts_source": self.prompts_source,
            "turns": self.turns,
            "prompt_suffix": self.prompt_suffix,
            "constraint": None
            if self.constraint is None
            else {"kind": self.constraint.kind, "source": self.constraint.source},
            "strategy_specs": [s.label for s in self.strategies],
        }


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
    summary_by_turn: dict[str, dict[str, dict[str, dict[str, Any]]]] | None = None
    summary_later_turns: dict[str, dict[str, dict[str, Any]]] | None = None  # turns 2 and on

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
                {
                    "index": p.index,
                    "turn": p.turn,
                    **p.prompt.to_dict(),
                    "prompt_tokens": len(p.ids),
                }
                for p in self.prompts
            ],
            "measurements": [m.to_dict() for m in self.measurements],
            "per_prompt": self.per_prompt,
            "summary": self.summary,
            **({"summary_by_turn": self.summary_by_turn} if self.summary_by_turn else {}),
            **(
                {"summary_later_turns": self.summary_later_turns}
                if self.summary_later_turns
                else {}
            ),
        }


SCHEMA = "specfork-bench/1"
TURNS = ("first", "all")


def run_benchmark(
    settings: BenchSettings,
    *,
    console: Console | None = None,
    show_progress: bool = True,
    loaded: Any = None,
) -> BenchResults:
    """Load the model (unless `loaded` is given), build every strategy, measure, summarize."""
    from specfork.bench.specs import ensure_plain
    from specfork.engine.generator import Generator

    notes = list(settings.notes)
    specs, added = ensure_plain(settings.strategies)
    if added:
        notes.append("added `ar` (plain decoding): speedups and greedy matches are against it")
    sampling = settings.sampling()
    if loaded is None:
        from specfork.loading.loader import load_model

        status = console.status(f"loading {settings.model}…") if console else _null()
        with status:
            loaded = load_model(
                settings.model,
                dtype=settings.dtype,
                device=settings.device,
                kernels=True if settings.exact else settings.kernels,
                threads=settings.threads,
                progress=False,
            )
    generator = Generator(loaded)
    reference = next(s.label for s in specs if s.is_plain)
    if settings.repeats > 1 and any(_persistent_recycle(s.spec) for s in specs):
        notes.append(
            "recycle tables persist across requests: a repeat of a prompt drafts from a table "
            "that learned that prompt's earlier run; measure with recycle_persist=false or "
            "--repeats 1 for figures free of that"
        )
    chat = generator.tokenizer.chat_template is not None
    multi_turn = settings.turns == "all"
    if multi_turn and not chat and any(p.later_turns for p in settings.prompts):
        raise ConfigError(
            f"--turns all puts earlier answers in the context as chat messages, and the model "
            f"{settings.model} has no chat template; use --turns first"
        )
    given_chat = [str(p.question_id) for p in settings.prompts if p.chat]
    if given_chat and not chat:
        raise ConfigError(
            f"prompt(s) {', '.join(given_chat[:5])} are chat messages (a system prompt or "
            f"'messages'), and the model {settings.model} has no chat template; give a chat "
            "model or text prompts"
        )
    suffix = settings.prompt_suffix
    prompts = [first_turn(generator, i, p, chat, suffix) for i, p in enumerate(settings.prompts)]
    context = min(generator.context, _longest(generator, prompts, settings, multi_turn))
    strategies = _build_strategies(specs, loaded, generator, settings, sampling, notes, context)
    progress = LiveProgress(console, enabled=show_progress and console is not None)
    warmup = BenchPrompt("warm-up", "warm-up", WARMUP_TEXT)
    later: list[PreparedPrompt] = []  # the later turns, as the run builds them

    def next_turn(p: PreparedPrompt, answer: RunOutput) -> PreparedPrompt:
        later.append(following_turn(generator, p, answer, suffix))
        return later[-1]

    threads_at_start = loaded.model.thread_use()
    measurements = run_interleaved(
        strategies,
        prompts,
        repeats=settings.repeats,
        warmup=settings.warmup,
        reference=reference,
        progress=progress,
        warmup_prompt=first_turn(generator, -1, warmup, chat),
        next_turn=next_turn if multi_turn else None,
    )
    threads = loaded.model.thread_use().since(threads_at_start)
    if threads.warning() is not None:
        notes.append(
            f"{threads.warning()}: compare the strategies' ratios (interleaved, so they shared "
            "the same conditions), not their absolute tok/s; rerun on a quiet machine for those"
        )
    prompts = sorted([*prompts, *later], key=lambda p: (p.index, p.turn))
    built = {(p.index, p.turn) for p in prompts}
    for m in measurements:  # later turns that could not be built have no rows: say why
        note = f"question {m.question_id} turn {m.turn} was not run: {m.error}"
        if (m.prompt_index, m.turn) not in built and note not in notes:
            notes.append(note)
    for s in strategies:
        if s.error and not s.skipped:
            notes.append(f"{s.label} failed: {s.error}")
    if not reset_peak_memory():
        notes.append("peak memory is the process's high-water mark since it started")
    seeded = not sampling.greedy and sampling.seed is not None
    if seeded:
        notes.append(
            f"seeded sampling (seed {sampling.seed}): specfork's outputs are compared with plain "
            "decoding's token for token (a seeded request emits plain decoding's tokens)"
        )
    elif not sampling.greedy:
        notes.append("sampling without a seed: match rates are not judged (use --seed)")
    labels = [s.label for s in strategies if not s.skipped]
    categories = list(dict.fromkeys(p.category for p in prompts))
    text_labels = {s.label for s in strategies if s.family == "openai"}
    seeded_labels = {s.label for s in strategies if s.family == "specfork"} if seeded else set()
    per_prompt = per_prompt_figures(
        measurements,
        labels,
        prompts,
        reference=reference,
        gap_fn=lambda ctx: top2_gap(loaded, ctx),
        greedy=sampling.greedy,
        near_tie=settings.near_tie,
        logprob_fn=lambda prompt, out: target_logprob(loaded, prompt, out),
        decode_fn=lambda ids: loaded.tokenizer.decode(ids, skip_special_tokens=True),
        text_labels=text_labels,
        seeded_labels=seeded_labels,
    )
    speculative = [s.label for s in strategies if s.family == "specfork" and s.label != reference]
    advice = where_speculation_pays(per_prompt, speculative)
    if advice is not None:
        notes.append(advice)
    by_turn, later_turns = None, None
    if multi_turn:
        by_turn = {
            str(t): summarize(per_prompt, labels, categories, turn=t) for t in turns_of(per_prompt)
        }
        later_turns = summarize_later_turns(per_prompt, labels, categories)
    machine = machine_info(
        loaded.model.precision, str(loaded.model.device), loaded.model.describe(), threads.threads
    )
    machine["thread_use"] = asdict(threads)
    return BenchResults(
        settings=settings,
        machine=machine,
        strategies=strategies,
        prompts=prompts,
        measurements=measurements,
        per_prompt=per_prompt,
        summary=summarize(per_prompt, labels, categories),
        categories=categories,
        reference=reference,
        notes=notes,
        model_path=str(loaded.path),
        summary_by_turn=by_turn,
        summary_later_turns=later_turns,
    )


def first_turn(
    generator: Any, index: int, prompt: BenchPrompt, chat: bool, suffix: str = ""
) -> PreparedPrompt:
    """A prompt's first turn: its messages (+ `suffix`) through the chat template (its text
    without one)."""
    messages = prompt.first_messages(suffix)
    ids = generator.encode_prompt(messages if chat else prompt.text + suffix, chat)
    return PreparedPrompt(index, prompt, ids, 1, messages, chat)


def following_turn(
    generator: Any, p: PreparedPrompt, answer: RunOutput, suffix: str = ""
) -> PreparedPrompt:
    """The turn after `p`: its conversation, `answer` as the assistant's message, then the
    next user message (+ `suffix`), through the chat template."""
    text = answer.text
    if text is None:
        text = generator.tokenizer.decode(answer.token_ids, skip_special_tokens=True)
    messages = [
        *p.messages,
        {"role": "assistant", "content": text},
        {"role": "user", "content": p.prompt.turns[p.turn] + suffix},
    ]
    return PreparedPrompt(
        p.index, p.prompt, generator.encode_prompt(messages), p.turn + 1, messages, p.chat
    )


def _longest(
    generator: Any, prompts: Sequence[PreparedPrompt], settings: BenchSettings, multi_turn: bool
) -> int:
    """Tokens a baseline's cache must hold: the longest prompt with its answer (every turn's
    user message and answer for a multi-turn run, with room for the template), the warm-up."""
    longest = 0
    for p in prompts:
        size = len(p.ids) + settings.max_new_tokens
        if multi_turn:
            for text in p.prompt.later_turns:
                size += len(generator.tokenizer.encode(text)) + settings.max_new_tokens + 32
        longest = max(longest, size)
    return longest + 64


def _build_strategies(
    specs: Sequence[StrategySpec],
    loaded: Any,
    generator: Any,
    settings: BenchSettings,
    sampling: SamplingParams,
    notes: list[str],
    context: int,
) -> list[BenchStrategy]:
    """Every strategy ready to run; `context` is the tokens a baseline's cache must hold."""
    config = settings.generation_config()
    out: list[BenchStrategy] = []
    hf_state: dict[str, Any] = {}  # the transformers models, shared by all baselines
    for spec in specs:
        if spec.family == "hf":
            out.append(_build_hf(spec, specs, loaded, settings, sampling, notes, hf_state))
            continue
        if spec.family == "llamacpp":
            out.append(_build_llamacpp(spec, loaded, settings, sampling, notes, context))
            continue
        if spec.family == "openai":
            out.append(_build_openai(spec, loaded, settings, sampling, notes))
            continue
        spec = _with_expected_length(spec, settings.max_new_tokens)
        strategy = BenchStrategy(spec.label, "specfork", None, spec.describe())
        try:
            if spec.spec.drafts_with("suffix"):  # an index of its own, reset per turn
                strategy.run, strategy.takes_prompt = _suffix_runner(loaded, spec, config, sampling)
                _note(notes, isolation.SUFFIX_NOTE)
            else:
                generator.use_strategy(spec.spec)  # builds (and checks) its drafter once
                rates = generator.rates.memory(spec.spec)  # reset per turn
                run = specfork_runner(generator, spec, config, sampling)
                strategy.run, strategy.takes_prompt = isolation.isolated_runner([rates], run), True
            if spec.spec.goodput and spec.spec.drafts:
                _note(notes, isolation.RATES_NOTE)
        except Exception as exc:
            strategy.error = f"cannot build: {_describe(exc)}"
        out.append(strategy)
    return out


def _suffix_runner(
    loaded: Any, spec: StrategySpec, config: GenerationConfig, sampling: SamplingParams
) -> tuple[Callable[[Any], RunOutput], bool]:
    """A suffix-index strategy's runner: its own Generator, its index and rates reset before
    every repeat of a turn (`isolation`)."""
    from specfork.engine.generator import Generator

    own = Generator(loaded, spec=spec.spec)
    run = specfork_runner(own, spec, config, sampling)
    stores = [own.stores.suffix, own.rates.memory(spec.spec)]
    return isolation.isolated_runner(stores, run), True


def _note(notes: list[str], note: str) -> None:
    if note not in notes:
        notes.append(note)


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
        return BenchStrategy(
            spec.label,
            "hf",
            None,
            spec.describe(),
            error="transformers is not installed",
            skipped=True,
        )
    if "models" not in state:
        state["models"] = hf.HFModels(hf_dtype(loaded.model), loaded.model.device)
    drafts = [
        source.path
        for s in specs
        if s.spec is not None
        for source in s.spec.sources
        if source.kind == "model"
    ]
    return hf.build_hf_strategy(
        spec,
        target_path=loaded.path,
        models=state["models"],
        n=settings.max_new_tokens,
        eos_ids=loaded.tokenizer.eos_ids,
        sampling=sampling,
        ignore_eos=settings.ignore_eos,
        default_draft=drafts[0] if drafts else None,
        threads=loaded.model.thread_use().threads,
    )


def _build_llamacpp(
    spec: StrategySpec,
    loaded: Any,
    settings: BenchSettings,
    sampling: SamplingParams,
    notes: list[str],
    context: int,
) -> BenchStrategy:
    from specfork.bench import llamacpp
    from specfork.extras import EXTRAS

    if not llamacpp.llamacpp_available():
        note = (
            "llama-cpp-python is not installed: its baselines are skipped "
            '(pip install "specfork[llamacpp]", see docs/benchmarks.md)'
        )
        if note not in notes:
            notes.append(note)
        error = f"{spec.label} needs llama-cpp-python: {EXTRAS['llama_cpp'].command}"
        return BenchStrategy(
            spec.label, "llamacpp", None, spec.describe(), error=error, skipped=True
        )
    return llamacpp.build_llamacpp_strategy(
        spec,
        target_path=loaded.path,
        n=settings.max_new_tokens,
        context=context,
        eos_ids=loaded.tokenizer.eos_ids,
        sampling=sampling,
        ignore_eos=settings.ignore_eos,
        threads=loaded.model.thread_use().threads,
    )


def _build_openai(
    spec: StrategySpec,
    loaded: Any,
    settings: BenchSettings,
    sampling: SamplingParams,
    notes: list[str],
) -> BenchStrategy:
    from specfork.bench import openai_api

    if not openai_api.httpx_available():
        note = f"httpx is not installed: openai: baselines are skipped ({openai_api.INSTALL})"
        if note not in notes:
            notes.append(note)
        return BenchStrategy(
            spec.label,
            "openai",
            None,
            spec.describe(),
            error="httpx is not installed",
            skipped=True,
        )
    for note in _openai_notes(settings):
        if note not in notes:
            notes.append(note)
    chat = loaded.tokenizer.chat_template is not None
    return openai_api.build_openai_strategy(
        spec,
        n=settings.max_new_tokens,
        sampling=sampling,
        ignore_eos=settings.ignore_eos,
        chat=chat,
    )


def _openai_notes(settings: BenchSettings) -> list[str]:
    notes = [
        "openai: rows are another engine behind its HTTP API (its kernels, tokenizer and "
        "streaming): their speedup compares engines, tokens are its usage counts, and their "
        "match with ar compares text, information only"
    ]
    if settings.ignore_eos:
        notes.append(
            "openai: requests carry ignore_eos (vLLM and specfork serve honour it; a "
            "server that does not may stop at EOS)"
        )
    return notes


def _with_expected_length(spec: StrategySpec, n: int) -> StrategySpec:
    """Policies that plan for the output length (linear decay) get max_new_tokens unless the
    spec sets expected_length itself."""
    assert spec.spec is not None
    names = {f.name for f in dataclasses.fields(spec.spec)}
    if "expected_length" in names and "expected_length" not in spec.options:
        return dataclasses.replace(spec, spec=dataclasses.replace(spec.spec, expected_length=n))
    return spec


@contextmanager
def _null() -> Iterator[None]:
    yield
