"""Per-request statistics of a decoding run."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

from specfork.threads import ThreadReport


@dataclass(frozen=True, slots=True)
class RoundRecord:
    """One decoding round: where it started, how much was drafted and accepted."""

    round: int
    position: int  # output tokens before this round
    k: int  # draft length asked of the drafter
    drafted: int
    accepted: int
    emitted: int  # accepted + the target's token (before stop truncation)
    first_rejected: bool = False  # drafted, and the first draft token already failed
    extra: dict = field(default_factory=dict)  # what the policy computed (DSpark: C, ...)

    def to_dict(self) -> dict:
        out = asdict(self)
        out.update(out.pop("extra"))
        return out


#: Where a decoding round's time goes (`GenerationStats.phase_seconds`): drafting (the policy's
#: shape, the drafters, the goodput gate), preparing the verification (trims, grammar masks, the
#: rows, the tree mask and positions), the target's forward (and its logits), accepting (the
#: verification rule, log-probabilities, the grammar), committing (the KV cache, the drafters'
#: feedback) and learning (gate, policy, statistics). "other" is the rest of the decode time:
#: stop checks, detokenizing, the loop itself (and, batched, the other requests' work).
PHASES = ("draft", "prepare", "forward", "accept", "commit", "learn")


def source_family(source: str) -> str:
    """A draft source's family: its label without the match-length bucket the goodput gate
    keeps apart ("ngram-3" -> "ngram", "suffix-8" -> "suffix"; "head" stays)."""
    name, _, bucket = source.rpartition("-")
    return name if name and bucket.isdigit() else source


@dataclass(slots=True)
class GenerationStats:
    """Counters and timings of one request.

    `mean_accepted_length` is tokens emitted per target forward after prefill (bonus token
    included): 1.0 for plain decoding, K + 1 when every draft of length K is accepted.
    """

    prompt_tokens: int = 0
    new_tokens: int = 0
    target_forwards: int = 0  # decoding forwards, prefill excluded
    draft_forwards: int = 0
    drafted: int = 0
    accepted: int = 0
    drafting_rounds: int = 0  # rounds with a non-empty draft
    first_token_rejections: int = 0  # drafting rounds whose first draft token was rejected
    paused_rounds: int = 0  # rounds kept from drafting: drafting lost to plain steps (payback)
    accepted_by_position: list[int] = field(default_factory=list)
    drafted_by_position: list[int] = field(default_factory=list)
    rounds: list[RoundRecord] = field(default_factory=list)
    lossy: bool = False  # verified with a lossy rule (SPORK's typical acceptance)
    verify_seconds: float = 0.0  # inside the target's verification forwards
    grammar_seconds: float = 0.0  # computing a constraint's token masks (0: unconstrained)
    prefill_seconds: float = 0.0
    cached_prompt_tokens: int = 0  # prompt tokens served by the prefix cache, not prefilled
    time_to_first_token: float = 0.0
    decode_seconds: float = 0.0
    threads: ThreadReport | None = None  # the threads it ran on; whether the cores were busy
    phase_seconds: dict[str, float] = field(default_factory=dict)  # of the decode time: PHASES
    #: source family (`source_family`) -> [drafted, accepted] tokens it proposed
    by_source: dict[str, list[int]] = field(default_factory=dict)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def first_token_rejection_rate(self) -> float:
        """Share of drafting rounds that accepted nothing (the first draft token failed)."""
        return self.first_token_rejections / self.drafting_rounds if self.drafting_rounds else 0.0

    @property
    def mean_accepted_length(self) -> float:
        decoded = max(self.new_tokens - 1, 0)  # the first token comes from the prefill
        return decoded / self.target_forwards if self.target_forwards else 0.0

    @property
    def verify_share(self) -> float:
        """Share of decoding time spent in the target's verification forwards."""
        return self.verify_seconds / self.decode_seconds if self.decode_seconds > 0 else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        decoded = max(self.new_tokens - 1, 0)
        return decoded / self.decode_seconds if self.decode_seconds > 0 else 0.0

    @property
    def prefill_tokens_per_second(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds > 0 else 0.0

    def spend(self, phase: str, since: float) -> float:
        """Count the time since `since` (a perf_counter reading) towards `phase`; now."""
        now = time.perf_counter()
        self.phase_seconds[phase] = self.phase_seconds.get(phase, 0.0) + (now - since)
        return now

    def phase_shares(self) -> dict[str, float]:
        """Each phase's share of the decode time, and "other" (the rest); {} before decoding."""
        if self.decode_seconds <= 0:
            return {}
        shares = {p: self.phase_seconds.get(p, 0.0) / self.decode_seconds for p in PHASES}
        shares["other"] = max(0.0, 1.0 - sum(shares.values()))
        return shares

    def record_round(self, drafted: int, accepted: int, depth: int | None = None) -> None:
        """Count one verification round with `drafted` proposals of which `accepted` held.

        For a tree, `drafted` counts its nodes and `depth` its depth: per-position counts
        then run over depths (a tree drafts position j when it has a node at depth j + 1).
        """
        self.target_forwards += 1
        self.drafted += drafted
        self.accepted += accepted
        if drafted:
            self.drafting_rounds += 1
            self.first_token_rejections += int(accepted == 0)
        for pos in range(drafted if depth is None else depth):
            if pos >= len(self.drafted_by_position):
                self.drafted_by_position.append(0)
                self.accepted_by_position.append(0)
            self.drafted_by_position[pos] += 1
            self.accepted_by_position[pos] += int(pos < accepted)

    def record_sources(self, origins: list[str], accepted: set[int]) -> None:
        """Count a round's drafted nodes by their source (`origins[i]`: node i's) and the
        `accepted` ones (node indices) by theirs."""
        for node, origin in enumerate(origins):
            counts = self.by_source.setdefault(source_family(origin), [0, 0])
            counts[0] += 1
            counts[1] += int(node in accepted)

    def to_dict(self) -> dict:
        out = asdict(self)
        del out["rounds"]  # per-round records go to the trace, not the summary
        out.update(
            acceptance_rate=self.acceptance_rate,
            first_token_rejection_rate=self.first_token_rejection_rate,
            verify_share=self.verify_share,
            mean_accepted_length=self.mean_accepted_length,
            decode_tokens_per_second=self.decode_tokens_per_second,
            prefill_tokens_per_second=self.prefill_tokens_per_second,
            phase_shares=self.phase_shares(),
        )
        return out

    def summary(self) -> str:
        """One line for humans (the CLI prints it to stderr)."""
        line = (
            f"{self.prompt_tokens} prompt + {self.new_tokens} new tokens | prefill "
            f"{self.prefill_tokens_per_second:.0f} tok/s | decode "
            f"{self.decode_tokens_per_second:.1f} tok/s | TTFT {self.time_to_first_token:.2f} s"
        )
        if self.threads is not None:
            line += f" | {self.threads.describe()}"
        if self.grammar_seconds > 0:
            line += f" | grammar masks {self.grammar_seconds:.2f} s"
        if self.lossy:
            line += " | LOSSY (typical acceptance: output may differ from plain decoding)"
        if self.drafted:
            line += (
                f" | accepted {self.accepted}/{self.drafted} ({self.acceptance_rate:.0%}), "
                f"{self.mean_accepted_length:.2f} tokens/forward"
            )
        if len(self.by_source) > 1:
            line += " | by source " + ", ".join(
                f"{name} {a}/{d}" for name, (d, a) in sorted(self.by_source.items())
            )
        return line
