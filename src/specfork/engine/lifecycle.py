"""A request's life around its rounds: the first token after the prompt, taking a round's
tokens into the output, deciding when to stop, and the final result.

The one-request loop (`Generator.stream`) and the batched scheduler (`engine.batch`) share
these steps, so a request ends the same way whichever of them runs it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch

from specfork.engine.logprobs import TokenLogprob
from specfork.engine.request import Request
from specfork.engine.round import constrained
from specfork.engine.stats import GenerationStats
from specfork.kernels.sample_rows import fast_next_token
from specfork.models.base import Steps


@dataclass
class GenerationResult:
    """What one request produced."""

    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS, stop id or stop string), "length", "time" or "cancelled"
    prompt_ids: list[int]
    stats: GenerationStats
    logprobs: list[TokenLogprob] | None = None  # one per token id, when the config asks


def first_tokens(req: Request, logits: torch.Tensor) -> list[int]:
    """The token the target chooses after the prompt, from its last row's logits [V]."""
    grammar = req.grammar
    allowed = None if grammar is None else grammar.mask()  # [V]
    p_logits = req.target_logits(logits[None])[0]  # [V], penalised when the request asks
    chosen = p_logits if allowed is None else constrained(p_logits, allowed)
    tokens = [fast_next_token(chosen, req.sampling, req.rng, len(req.history))]
    if grammar is not None:
        tokens = grammar.advance(tokens)
    req.note_logprobs(logits[None], [0], tokens)
    return tokens


def take(req: Request, tokens: list[int]) -> None:
    """A round's tokens into the output (up to a stop), the history and the
    log-probabilities (of the tokens the output kept: not a stop id)."""
    out, kept = req.out, len(req.out.token_ids)
    used = out.add(tokens)
    req.stats.new_tokens += used
    req.history += tokens[:used]
    if req.logprobs is not None:
        fresh = req.round_logprobs[: len(out.token_ids) - kept]
        pieces = out.pieces[kept:]
        req.logprobs += [replace(e, text=t) for e, t in zip(fresh, pieces, strict=True)]


def stopped(req: Request, started: float) -> bool:
    """Whether the request ends after the tokens just taken (a stop, its constraint complete,
    its cache full, or its time limit counted from `started`, a perf_counter time)."""
    out = req.out
    if req.grammar is not None and req.grammar.finished:
        out.finish("stop")  # the constraint is complete: only an end could follow
    if out.done:
        return True
    if req.cache.length >= req.cache.max_len:
        out.finish("length")
    limit = out.config.max_seconds
    if limit is not None and time.perf_counter() - started > limit:
        out.finish("time")
    return out.done


def result(req: Request, model: Steps) -> GenerationResult:
    """The request's result (after its output has ended, or been ended) on `model`."""
    if req.grammar is not None:
        req.stats.grammar_seconds = req.grammar.mask_seconds
    if req.threads_at_start is not None:
        req.stats.threads = model.thread_use().since(req.threads_at_start)
    out = req.out
    reason = out.finish_reason or "length"
    return GenerationResult(
        out.text, out.token_ids, reason, req.prompt_ids, req.stats, req.logprobs
    )
