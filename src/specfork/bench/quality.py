"""How far a strategy's output is from the reference: greedy matches with the near-tie rule, and
the target's log-probability of an output (the lossy gate's drift)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

NEAR_TIE = 0.25  # top-2 logit gap: two bf16 steps at logits of magnitude 16-32


@dataclass
class MatchResult:
    """A greedy output compared with the reference: "exact", "near-tie" or "differs"."""

    status: str
    position: int | None = None  # first diverging output position
    gap: float | None = None  # the target's top-2 logit gap there


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


def first_divergence(a: Sequence[Any], b: Sequence[Any]) -> int | None:
    """The first position where two outputs differ (the shorter length if one is a prefix of
    the other); None when they are equal."""
    if list(a) == list(b):
        return None
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


TEXT_STATUSES = ("text-equal", "text-differs")


def compare_text(reference: str, other: str) -> MatchResult:
    """Two outputs compared as text (another engine's tokens are not ours): "text-equal" or
    "text-differs" with the first differing character's index; no near-tie rule. Replacement
    characters at the end are dropped first: a character cut by the token limit decodes to
    U+FFFD in one place and is held back by a streaming server's decoder in another."""
    pos = first_divergence(reference.rstrip("\ufffd"), other.rstrip("\ufffd"))
    return MatchResult("text-equal" if pos is None else "text-differs", pos)


def compare_tokens(reference: Sequence[int], other: Sequence[int]) -> MatchResult:
    """Two seeded sampled outputs: "exact", or "differs" at the first differing token (a seeded
    request emits plain decoding's tokens whatever the strategy: no near-tie excuses it)."""
    pos = first_divergence(reference, other)
    return MatchResult("exact" if pos is None else "differs", pos)


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
