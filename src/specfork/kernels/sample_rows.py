"""Temperature sampling on the kernels where a model has loaded them, `specfork.sampling`
elsewhere: the target's probabilities at a temperature and the inverse-CDF draw, each one call
for a round's rows (`csrc/sample_rows.h`).

As PyTorch ops a row cost ~0.2 ms right after a forward (max, subtract, divide, softmax, sum,
a float64 cumsum over the vocabulary, searchsorted: each op a pass over a cold row and a
wake-up of PyTorch's thread pool), ~10% of a sampled decoding step. The kernels compute the
same distribution (softmax(logits / t), up to float rounding) and draw at the same uniform
from the same generator, so a request's random stream is consumed as before.
"""

from __future__ import annotations

import torch

from specfork.config import SamplingParams
from specfork.kernels.logit_rows import kernels_for
from specfork.sampling import keyed_uniform, next_token, probabilities, sample, sample_at


def fast_probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """`sampling.probabilities` of logits [R, V] or [V] with the kernels' softmax at the
    temperature (top-k, top-p and min-p applied around it as `sampling` applies them; with none
    of them the kernels' rows are the distribution), else as `sampling` computes it."""
    if logits.dim() == 1:
        return fast_probabilities(logits[None], params)[0]
    kernels = None if params.greedy else kernels_for(logits)
    if kernels is None or logits.shape[-1] == 0:
        return probabilities(logits, params)
    if not params.top_k and params.top_p >= 1.0 and params.min_p <= 0:
        return kernels.softmax_rows(logits, 1.0 / params.temperature)  # t >= 1e-5: not greedy
    return probabilities(logits, params, kernels.softmax_rows)


def fast_sample(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """`sampling.sample`: one token per row of probabilities [..., V] at a uniform from
    `generator` (float64, as `sample` draws it), on the kernels for CPU float32 rows; a row
    with no finite positive mass is refused as `sample` refuses it."""
    flat = probs.reshape(-1, probs.shape[-1])  # [N, V]
    kernels = kernels_for(flat)
    if kernels is None or generator.device.type != "cpu" or flat.shape[-1] == 0:
        return sample(probs, generator)
    u = torch.rand(flat.shape[0], generator=generator, dtype=torch.float64)  # [N]
    tokens = kernels.sample_rows(flat, u)  # [N]
    if bool((tokens < 0).any()):
        raise ValueError("cannot sample from a row with no finite probability mass")
    return tokens.view(probs.shape[:-1])


def fast_sample_at(probs: torch.Tensor, u: float) -> int:
    """`sampling.sample_at`: the token of probabilities [V] at uniform `u` (a seeded request's
    keyed draw), on the kernels for a CPU float32 row."""
    row = probs.reshape(1, -1)  # [1, V]
    kernels = kernels_for(row)
    if kernels is None or row.shape[-1] == 0:
        return sample_at(probs, u)
    token = int(kernels.sample_rows(row, torch.tensor([u], dtype=torch.float64))[0])
    if token < 0:
        raise ValueError("cannot sample from a row with no finite probability mass")
    return token


def fast_draw(
    q: torch.Tensor, params: SamplingParams, generator: torch.Generator, position: int
) -> int:
    """`sampling.draw` on the kernels: a drafter's token from q [V] at the request's keyed
    uniform for `position` when it is seeded (the target's own draw there, `fast_sample_at`,
    walks the same cumulative sums), else from `generator`."""
    if params.seed is not None:
        return fast_sample_at(q, keyed_uniform(params.seed, position))
    return int(fast_sample(q, generator))


def fast_next_token(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator, position: int
) -> int:
    """`sampling.next_token` on the kernels: the argmax when greedy, else a draw from the
    kernels' probabilities of logits [V] (at the keyed uniform of a seeded request)."""
    if params.greedy:
        return next_token(logits, params, generator, position)
    return fast_draw(fast_probabilities(logits, params), params, generator, position)
