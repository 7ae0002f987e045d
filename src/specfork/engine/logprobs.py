"""Log-probabilities of emitted tokens, as the target computed them.

They are the raw log-softmax of the target's logits (after Gemma's final soft-capping, before
the request's temperature, top-k, top-p and min-p), read from the verification forward that
accepted each token: a speculative round reports, for every token it emits, the row of that
forward which predicted it. On batch-invariant steps (specfork's CPU kernels) these rows are
bitwise the logits plain decoding computes, so the numbers are the same as plain decoding's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

FLOOR = -9999.0  # the lowest log-probability reported (vLLM's), for -inf and NaN too


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One emitted token's log-probability and the `n` most likely tokens at its position.

    `text` is the token's piece of the output text as decoded in context (a leading space
    included; "" for the first bytes of a character that a later token completes).
    """

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, log-probability), most likely first
    text: str = ""


def token_logprobs(logits: torch.Tensor, tokens: Sequence[int], n: int) -> list[TokenLogprob]:
    """Entries for `tokens` [R] predicted by the rows of `logits` [R, V] (float32)."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # [R, V]
    logp = logp.nan_to_num(nan=FLOOR, neginf=FLOOR).clamp(min=FLOOR)  # JSON has no -inf/NaN
    chosen = logp.gather(-1, torch.tensor(tokens, device=logp.device)[:, None])[:, 0]  # [R]
    top_p, top_i = logp.topk(n, dim=-1) if n else (logp[:, :0], logp[:, :0].long())  # [R, n]
    out = []
    for r, token in enumerate(tokens):
        top = tuple(zip(top_i[r].tolist(), top_p[r].tolist(), strict=True))
        out.append(TokenLogprob(int(token), float(chosen[r]), top))
    return out
