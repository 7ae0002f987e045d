"""Where logits become probabilities or tokens (the kernels compute the same temperature
softmax and draw for CPU rows, `kernels.sample_rows`, which the engine passes in as a `Sampler`).

`probabilities(logits, params)` applies temperature, then top-k, top-p and min-p, in that order
(transformers' and vLLM's order), and returns the distribution a token is drawn from. The same
function is applied to the target's p and the drafter's q, which speculative sampling needs.

Every draw inverts a row's cumulative distribution at a uniform u. Unseeded requests take u from
their generator's stream. A seeded request's u for the token at sequence position t is
`keyed_uniform(seed, t)`, a function of the seed and t alone: the token plain decoding emits at
t is then fixed by the seed and the prefix, and speculation (which only decides how many of
those tokens one forward confirms) emits exactly the same tokens, however its drafts were
trimmed or batched (`verify.keyed`).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable

import numpy as np
import torch

from specfork.config import SamplingParams

#: draws one token per row of probabilities [..., V] from a generator (`sample`'s signature)
Sampler = Callable[[torch.Tensor, torch.Generator], torch.Tensor]


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


#: softmax(logits / t) of rows [R, V] given 1 / t: the kernels' one call (`kernels.sample_rows`)
Softmax = Callable[[torch.Tensor, float], torch.Tensor]


def probabilities(
    logits: torch.Tensor, params: SamplingParams, softmax: Softmax | None = None
) -> torch.Tensor:
    """float32 probabilities [..., V] after temperature, top-k, top-p and min-p.

    Greedy parameters give the one-hot distribution of the argmax. `softmax` (rows [R, V])
    replaces the temperature and softmax ops; top-k then masks the logits before it (the
    same tokens: dividing by t keeps their order).
    """
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(argmax(logits), logits.shape[-1]).float()
    if softmax is not None:
        probs = softmax(_top_k(logits, params.top_k), 1.0 / params.temperature)  # [R, V]
    else:
        logits = logits - logits.amax(-1, keepdim=True)  # <= 0: a tiny t cannot overflow
        probs = _top_k(logits / params.temperature, params.top_k).softmax(-1)  # [..., V]
    if params.top_p < 1.0:
        probs = _top_p(probs, params.top_p)
    if params.min_p > 0.0:
        keep = probs >= params.min_p * probs.amax(-1, keepdim=True)  # [..., V]
        probs = probs * keep
    return probs / probs.sum(-1, keepdim=True)


def _top_k(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """logits [..., V] with all but the `top_k` largest (and their ties) at −inf; unchanged
    for 0 or a k of the whole vocabulary."""
    if not top_k or top_k >= logits.shape[-1]:
        return logits
    kth = logits.topk(top_k, dim=-1).values[..., -1:]  # [..., 1]
    return logits.masked_fill(logits < kth, float("-inf"))


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


_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """SplitMix64's output function (Steele, Lea and Flood 2014): 64 well-mixed bits of x."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def keyed_uniform(seed: int, position: int) -> float:
    """A uniform in [0, 1) (53 bits) that depends on `seed` and the sequence `position` only:
    the draw of a seeded request's token at that position."""
    return (_splitmix64(_splitmix64(seed) ^ position) >> 11) * 2.0**-53


def sample_at(probs: torch.Tensor, u: float) -> int:
    """The token of probabilities [V] (the total need not be 1) at uniform `u`: the first
    whose cumulative mass exceeds u · total, as `sample` draws."""
    cdf = _cdf(probs.reshape(1, -1))  # [1, V]
    point = torch.tensor([[u]], dtype=torch.float64, device=cdf.device)  # [1, 1]
    return int(_invert(cdf, point)[0])


def draw(q: torch.Tensor, params: SamplingParams, generator: torch.Generator, position: int) -> int:
    """A drafter's token from q [V] for sequence `position`: at the request's keyed uniform
    when it is seeded (coupled with the target's own draw there, so a q close to p proposes
    what the target will emit), else from `generator`."""
    if params.seed is not None:
        return sample_at(q, keyed_uniform(params.seed, position))
    return int(sample(q, generator))


def _cdf(flat: torch.Tensor) -> torch.Tensor:
    """Cumulative distributions [N, V] float64 of rows [N, V], each with finite positive mass."""
    cdf = flat.double().cumsum(-1)  # [N, V]
    total = cdf[:, -1]  # [N]
    if not bool(((total > 0) & torch.isfinite(total)).all()):
        raise ValueError("cannot sample from a row with no finite probability mass")
    return cdf


def _invert(cdf: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Tokens [N] at uniforms u [N, 1]: the first index whose cumulative mass exceeds u · total."""
    tokens = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)  # [N, 1]
    return tokens.clamp_(max=cdf.shape[-1] - 1).view(-1)


def sample(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Draw one token per row from probabilities [..., V] (each row's total need not be 1);
    returns [...] int64.

    By the inverse of each row's cumulative distribution (float64): the first token whose
    cumulative mass exceeds u · total, u uniform in [0, 1) from `generator`, so a token of
    probability 0 is never drawn; a row of zeros, NaN or inf is refused, as
    `torch.multinomial` refused it. `torch.multinomial` took ~1 ms for one draw from a
    vocabulary on two cores, a fifth of a decoding step; this takes ~0.1 ms."""
    flat = probs.reshape(-1, probs.shape[-1])  # [N, V]
    cdf = _cdf(flat)  # [N, V]
    u = torch.rand(flat.shape[0], 1, generator=generator, dtype=torch.float64, device=flat.device)
    return _invert(cdf, u).view(probs.shape[:-1])


def next_token(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator, position: int
) -> int:
    """The token at sequence `position` from logits [V]: the argmax when greedy, else a draw
    (at the keyed uniform of a seeded request)."""
    if params.greedy:
        return int(argmax(logits))
    return draw(probabilities(logits, params), params, generator, position)
