"""The only place logits become probabilities or tokens.

`probabilities(logits, params)` applies temperature, then top-k, top-p and min-p, in that order
(transformers' and vLLM's order), and returns the distribution a token is drawn from. The same
function is applied to the target's p and the drafter's q, which speculative sampling needs.
"""

from __future__ import annotations

import secrets

import numpy as np
import torch

from specfork.config import SamplingParams


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A torch RNG seeded with `seed` (a fresh random seed when None)."""
    gen = torch.Generator(device=device)
    gen.manual_seed(secrets.randbits(63) if seed is None else seed)
    return gen


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """`logits.argmax(-1)` ([...] int64): the first index of each row's maximum, NaN counting
    as the maximum. CPU float32 rows go through NumPy's scan, which gives the same index: for a
    vocabulary row PyTorch's reduction wakes its thread pool and takes 40-200 µs, NumPy 4 µs
    (a plain decoding step spent ~5% of its time here)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and not logits.requires_grad:
        return torch.from_numpy(np.asarray(logits.numpy().argmax(-1)))
    return logits.argmax(-1)


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """float32 probabilities [..., V] after temperature, top-k, top-p and min-p.

    Greedy parameters give the one-hot distribution of the argmax.
    """
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(argmax(logits), logits.shape[-1]).float()
    logits = logits - logits.amax(-1, keepdim=True)  # <= 0: dividing by a tiny t cannot overflow
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k, dim=-1).values[..., -1:]  # [..., 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)  # [..., V]
    if params.top_p < 1.0:
        probs = _top_p(probs, params.top_p)
    if params.min_p > 0.0:
        keep = probs >= params.min_p * probs.amax(-1, keepdim=True)  # [..., V]
        probs = probs * keep
    return probs / probs.sum(-1, keepdim=True)


TOP_P_CANDIDATES = (256, 4096)  # top-p looks among so many most likely tokens before sorting all


def _top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p.

    The set is looked for among the 256 most likely tokens of every row, then the 4,096 most
    likely, and only then among all (sorting a vocabulary of 49,152 took ~4 ms a row on two
    cores, a top-256 0.1 ms; SmolLM2's rows at temperatures 0.7-1 and top_p 0.9-0.95 held
    that mass in their top 256 96% of the time, in their top 4,096 99.9%)."""
    found = None
    for count in TOP_P_CANDIDATES:
        if count >= probs.shape[-1]:
            break
        top = probs.topk(count, dim=-1)  # values descending, [..., C]
        mass = top.values.cumsum(-1)  # [..., C]
        if bool((mass[..., -1] >= top_p).all()):  # every row's set is among its candidates
            found = top.values, top.indices, mass
            break
    if found is None:
        values, order = probs.sort(dim=-1, descending=True)  # [..., V]
        found = values, order, values.cumsum(-1)
    sorted_p, order, mass = found
    drop = mass - sorted_p >= top_p  # the mass strictly before a token reaches top_p
    drop[..., 0] = False  # the most likely token always stays (a top_p below float32's range)
    sorted_p = sorted_p.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter(-1, order, sorted_p)


def sample(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Draw one token per row from probabilities [..., V] (each row's total need not be 1);
    returns [...] int64.

    By the inverse of each row's cumulative distribution (float64): the first token whose
    cumulative mass exceeds u · total, u uniform in [0, 1) from `generator`, so a token of
    probability 0 is never drawn; a row of zeros, NaN or inf is refused, as
    `torch.multinomial` refused it. `torch.multinomial` took ~1 ms for one draw from a
    vocabulary on two cores, a fifth of a decoding step; this takes ~0.1 ms."""
    flat = probs.reshape(-1, probs.shape[-1])  # [N, V]
    cdf = flat.double().cumsum(-1)  # [N, V]
    total = cdf[:, -1]  # [N]
    if not bool(((total > 0) & torch.isfinite(total)).all()):
        raise ValueError("cannot sample from a row with no finite probability mass")
    u = torch.rand(flat.shape[0], 1, generator=generator, dtype=torch.float64, device=flat.device)
    tokens = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)  # [N, 1]
    return tokens.clamp_(max=flat.shape[-1] - 1).view(probs.shape[:-1])


def next_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """Choose the next token from logits [V]: argmax when greedy, else a seeded draw."""
    if params.greedy:
        return int(argmax(logits))
    return int(sample(probabilities(logits, params), generator))
