"""OpenAI's presence and frequency penalties and logit biases, at every verified row.

The penalised logits are the target's distribution p (before temperature, top-k, top-p):

    logit[t] += bias[t] − frequency · c[t] − presence · (c[t] > 0)

with c[t] the number of times t occurs in the output so far. A round's rows continue different
outputs: row 0 (the root) the output as emitted, row i + 1 the output followed by the drafted
tokens on the path to node i. Each row gets the counts of its own path, so every row's p is
exactly what plain decoding would compute at that position, and verification stays lossless
(greedy: the same argmax; sampling: the same p for rejection sampling).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch

from specfork.config import SamplingParams


def penalized(
    logits: torch.Tensor, params: SamplingParams, output: Sequence[int], paths: list[list[int]]
) -> torch.Tensor:
    """The logits [R, V] of R rows with `params`' biases and penalties applied (a new tensor;
    the input when there are none). `output`: the tokens emitted so far; `paths[r]`: the
    drafted tokens between the output and row r ([] for the root)."""
    if not params.penalized:
        return logits
    out = logits.float().clone()  # [R, V]
    if params.logit_bias:
        ids = torch.tensor([t for t, _ in params.logit_bias], device=out.device)  # [B]
        bias = torch.tensor([b for _, b in params.logit_bias], device=out.device)  # [B]
        out[:, ids] += bias
    if params.presence_penalty or params.frequency_penalty:
        counts = Counter(output)
        _penalize_output(out, counts, params)
        for row, path in enumerate(paths):
            for token, extra in Counter(path).items():
                before = counts.get(token, 0)
                out[row, token] -= _penalty(before + extra, params) - _penalty(before, params)
    return out


def _penalize_output(out: torch.Tensor, counts: Counter, params: SamplingParams) -> None:
    """Every row's penalty for the output's own counts (in place on out [R, V])."""
    if not counts:
        return
    ids = torch.tensor(list(counts), device=out.device)  # [U]
    c = torch.tensor(list(counts.values()), dtype=out.dtype, device=out.device)  # [U]
    out[:, ids] -= params.frequency_penalty * c + params.presence_penalty * (c > 0).to(out.dtype)


def _penalty(count: int, params: SamplingParams) -> float:
    return params.frequency_penalty * count + params.presence_penalty * (count > 0)


def row_paths(tokens: list[int], parents: list[int] | None) -> list[list[int]]:
    """The drafted tokens before each of a round's rows: [] for the root, then each node's
    path of tokens from the root's first child down to the node itself. `parents`: a tree's
    parent node indices (-1: the root); None for a chain."""
    out: list[list[int]] = [[]]
    for i, token in enumerate(tokens):
        parent = i - 1 if parents is None else parents[i]
        out.append([*out[parent + 1], token])
    return out
