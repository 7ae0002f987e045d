"""Reductions over logits rows on the kernels where a model has loaded them, PyTorch elsewhere:
the k best ids (Token Recycling's table, and writing them into it), log-sum-exp and the two
best tokens' probabilities (DSpark's confidence)."""

from __future__ import annotations

from types import ModuleType

import torch

from specfork.kernels.build import loaded_kernels


def kernels_for(logits: torch.Tensor) -> ModuleType | None:
    """The loaded kernels when they take these logits (CPU float32 [R, V]), else None."""
    kernels = loaded_kernels()
    plain = logits.device.type == "cpu" and logits.dtype == torch.float32
    if kernels is None or not plain or logits.dim() != 2 or logits.requires_grad:
        return None
    return kernels


def top_k_ids(logits: torch.Tensor, k: int) -> torch.Tensor:
    """[R, k] int64: the indices of each row's k largest logits [R, V], largest first.

    On the kernels one pass a row (a few µs for V = 49,152, where `torch.topk` took ~60 µs;
    an earlier index first among equal values); otherwise `torch.topk` (whose order among
    equal values is its own)."""
    if not 1 <= k <= logits.shape[-1]:
        raise ValueError(f"k must be in 1..{logits.shape[-1]}, got {k}")
    kernels = kernels_for(logits)
    return logits.topk(k, dim=-1).indices if kernels is None else kernels.top_k_ids(logits, k)


def put_top_k_ids(table: torch.Tensor, tokens: torch.Tensor, logits: torch.Tensor) -> None:
    """table[tokens[i]] = the k best ids of logits[i] (as `top_k_ids`, k = table's width), in
    place; a token in several rows keeps its last row's. table [N, k] int32, tokens [R] int64
    in [0, N), logits [R, V].

    On the kernels one call (a round's rows cost ~20 µs right after a forward, where the
    torch ops it replaces took ~120 µs); otherwise `top_k_ids` and one indexed write."""
    kernels = kernels_for(logits)
    cpu_int32 = table.device.type == "cpu" and table.dtype == torch.int32
    if kernels is not None and cpu_int32 and table.is_contiguous():
        kernels.put_top_k_ids(table, tokens.to(torch.long), logits)
        return
    newest = {t: r for r, t in enumerate(tokens.tolist())}  # a token's later row wins
    rows = torch.tensor(list(newest.values()), dtype=torch.long)  # [U]
    top = top_k_ids(logits, table.shape[1])[rows.to(logits.device)]  # [U, k]
    table[torch.tensor(list(newest), dtype=torch.long, device=table.device)] = top.to(
        device=table.device, dtype=torch.int32
    )


def logsumexp(logits: torch.Tensor) -> torch.Tensor:
    """[R] float32: log Σ exp of each row of logits [R, V] (the log of softmax's normaliser).

    On the kernels two vectorised passes a row (~6 µs for V = 49,152, where
    `torch.logsumexp` took 20-50 µs); otherwise `torch.logsumexp`."""
    kernels = kernels_for(logits)
    if kernels is None or logits.shape[-1] == 0:
        return torch.logsumexp(logits.float(), dim=-1)
    return kernels.logsumexp_rows(logits)


def top2_probabilities(logits: torch.Tensor) -> torch.Tensor:
    """[R, 2] float32: the softmax probabilities of each row's two largest logits [R, V]
    (V >= 2), largest first: exp(logit − logsumexp).

    On the kernels one call (~30 µs right after a forward, where the top-2, log-sum-exp, gather
    and exp it replaces took ~100 µs); otherwise the same from `top_k_ids` and `logsumexp`."""
    kernels = kernels_for(logits)
    if kernels is not None and logits.shape[-1] >= 2:
        return kernels.top2_probs_rows(logits)
    top = logits.float().gather(-1, top_k_ids(logits, 2))  # [R, 2]
    return (top - logsumexp(logits)[:, None]).exp()
