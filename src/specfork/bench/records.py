"""The benchmark's records: what a run produced, a strategy ready to measure, a prepared prompt,
one measurement, and the figures every report shows."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from specfork.bench.prompts import BenchPrompt
from specfork.engine.stats import PHASES

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
    ("round_efficiency", "round efficiency", "{:.2f}"),
    ("forward_share", "in forwards", "{:.0%}"),
    ("paused_share", "paused", "{:.0%}"),  # rounds payback kept from drafting
    ("valid_rate", "output valid", "{:.0%}"),  # constrained runs: the output parses
    ("greedy_match_rate", "greedy match", "{:.0%}"),
    ("exact_match_rate", "exact match", "{:.0%}"),
    ("target_logprob", "target log p/token", "{:.3f}"),
    ("peak_rss_mb", "peak RSS (MB)", "{:.0f}"),
)

#: the shares of decode time in each phase of a round (engine/stats.py PHASES) and the rest
SHARES = tuple(f"share_{p}" for p in (*PHASES, "other"))

PER_RUN = (
    "decode_tokens_per_second",
    "mean_accepted_length",
    "acceptance_rate",
    "time_to_first_token",
    "target_forwards_per_token",
    "wasted_drafts_per_token",
    "forward_share",
    "paused_share",
    *SHARES,
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
    text: str | None = None  # the output as text, from runners that get no token ids (openai:)
    valid: bool | None = None  # a constrained run: the output is complete and parses
    decode_seconds: float | None = None  # specfork: first token to the end
    phase_seconds: dict[str, float] | None = None  # specfork: of the decode time, by phase
    plain_steps: float | None = None  # Σ over rounds of c(rows): its forwards in one-row steps
    by_source: dict[str, list[int]] | None = None  # specfork: source -> [drafted, accepted]
    paused_rounds: int | None = None  # specfork: rounds payback kept from drafting


@dataclass
class BenchStrategy:
    """A strategy ready to measure: ``run(prompt_ids) -> RunOutput``, or with
    ``takes_prompt`` ``run(prepared_prompt)`` (runners that send text or chat messages)."""

    label: str
    family: str
    run: Callable[[Any], RunOutput] | None
    description: dict[str, Any] = field(default_factory=dict)
    error: str | None = None  # set when it could not be built or failed its warm-up
    skipped: bool = False  # not run at all (e.g. transformers missing); `error` says why
    takes_prompt: bool = False  # run() gets the PreparedPrompt, not its token ids

    def run_on(self, prompt: PreparedPrompt) -> RunOutput:
        """Run once on `prompt` (its token ids, or the prompt itself for ``takes_prompt``)."""
        assert self.run is not None
        return self.run(prompt if self.takes_prompt else list(prompt.ids))

    @property
    def ok(self) -> bool:
        return self.error is None and self.run is not None and not self.skipped

    @property
    def status(self) -> str:
        return "skipped" if self.skipped else ("ok" if self.ok else "failed")

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.description,
            "label": self.label,
            "family": self.family,
            "status": self.status,
            "error": self.error,
        }


@dataclass
class PreparedPrompt:
    """One turn of a benchmark prompt and its token ids (chat template applied).

    ``messages`` is the conversation up to this turn's user message (later turns carry the
    reference's earlier answers); ``chat`` says whether the ids went through the chat template
    (without one, the ids are the first turn's plain text).
    """

    index: int
    prompt: BenchPrompt
    ids: list[int]
    turn: int = 1
    messages: list[dict[str, str]] = field(default_factory=list)
    chat: bool = True

    @property
    def category(self) -> str:
        return self.prompt.category

    @property
    def text(self) -> str:
        """This turn's user message."""
        return self.prompt.turns[self.turn - 1]


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
    turn: int = 1

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
        if key == "paused_share":  # of the run's rounds (its target forwards)
            if o.paused_rounds is None or not o.target_forwards:
                return None
            return o.paused_rounds / o.target_forwards
        if key == "forward_share" or key in SHARES:
            return self._share("forward" if key == "forward_share" else key.removeprefix("share_"))
        raise KeyError(key)

    def _share(self, phase: str) -> float | None:
        """A phase's share of the run's decode time ("other": what no phase took)."""
        o = self.output
        if o is None or not o.decode_seconds or o.phase_seconds is None:
            return None
        phases = o.phase_seconds
        if phase == "other":
            return max(0.0, 1.0 - sum(phases.get(p, 0.0) for p in PHASES) / o.decode_seconds)
        return phases.get(phase, 0.0) / o.decode_seconds

    def to_dict(self) -> dict[str, Any]:
        o = self.output
        out: dict[str, Any] = {
            "sequence": self.sequence,
            "strategy": self.strategy,
            "prompt_index": self.prompt_index,
            "turn": self.turn,
            "question_id": self.question_id,
            "category": self.category,
            "repeat": self.repeat,
            "ok": self.ok,
            "error": self.error,
            "peak_rss_mb": self.peak_rss_mb,
        }
        if o is not None:
            out.update(
                output_tokens=len(o.token_ids),
                new_tokens=o.new_tokens,
                finish_reason=o.finish_reason,
                valid=o.valid,
                wall_seconds=o.wall_seconds,
                target_forwards=o.target_forwards,
                draft_forwards=o.draft_forwards,
                drafted=o.drafted,
                accepted=o.accepted,
                accepted_by_position=o.accepted_by_position,
                drafted_by_position=o.drafted_by_position,
                decode_seconds=o.decode_seconds,
                phase_seconds=o.phase_seconds,
                plain_steps=o.plain_steps,
                by_source=o.by_source,
                paused_rounds=o.paused_rounds,
                **{k: self.figure(k) for k in PER_RUN},
                token_ids=o.token_ids,
                rounds=o.rounds,
            )
            if o.text is not None:
                out["text"] = o.text
        return out
