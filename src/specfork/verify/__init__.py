"""Verification of drafted chains: pure tensor functions, the paper's notation.

p is the target's distribution, q the drafter's, both after the same sampling transforms
(`sampling.probabilities`). A chain of K drafted tokens x_1..x_K is checked against p at K + 1
positions (one target forward); the result is the accepted prefix plus one token from the
target, so every round emits at least one token.

- Greedy: accept the longest prefix equal to the target's argmax, then the target's argmax.
- Sampling (Leviathan et al. 2023; Chen et al. 2023): accept x_i with probability
  min(1, p_i(x_i) / q_i(x_i)); at the first rejection draw from normalise(max(0, p_i - q_i));
  if all K are accepted draw the bonus token from p_{K+1}. The output is distributed exactly as
  sampling from p token by token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specfork.sampling import Sampler, argmax, sample


@dataclass(frozen=True, slots=True)
class Verdict:
    """Outcome of verifying a draft (a chain or a tree): the accepted path, then the tokens.

    For a chain the path is nodes 0..accepted-1; for a tree, the accepted nodes from the
    root's child down.
    """

    path: list[int]  # accepted node indices, root's child first, deepest last
    tokens: list[int]  # the accepted nodes' tokens followed by one token from the target

    @property
    def accepted(self) -> int:
        """Number of accepted drafted tokens (the target's token not included)."""
        return len(self.path)


def verify_greedy(draft: torch.Tensor, target_logits: torch.Tensor) -> Verdict:
    """Greedy verification of draft [K] against the target's logits [K + 1, V]."""
    target = argmax(target_logits).tolist()  # [K + 1]
    drafted = draft.tolist()  # [K]
    n = 0
    while n < len(drafted) and drafted[n] == target[n]:  # the prefix the target agrees with
        n += 1
    return Verdict(list(range(n)), [*drafted[:n], target[n]])


def one_hot_q(draft: torch.Tensor, vocab: int) -> torch.Tensor:
    """q [K, V] of deterministic proposals (n-gram lookup, top-K forks): one-hot rows."""
    return torch.nn.functional.one_hot(draft, vocab).float()


def verify_sampling(
    draft: torch.Tensor,
    p: torch.Tensor,
    q: torch.Tensor | None,
    generator: torch.Generator,
    sampler: Sampler = sample,
) -> Verdict:
    """Lossless speculative sampling of draft [K] with p [K + 1, V] and q [K, V].

    q must be the distribution each draft token was actually drawn from; None for deterministic
    drafts (n-gram lookup, greedy heads), the same as `one_hot_q(draft, V)` without building
    it: x_i is accepted with probability p_i(x_i), and the residual is p_i with x_i removed.
    `sampler` draws the emitted token (`sampling.sample`, or the kernels' equal).
    """
    k = draft.shape[0]
    if k == 0:  # plain decoding's round: no uniform is drawn for an empty draft either way
        return Verdict([], [int(sampler(p[0], generator))])
    idx = torch.arange(k, device=draft.device)
    p_x = p[idx, draft]  # [K] target probability of each drafted token
    u = torch.rand(k, generator=generator, device=p.device)  # [K]
    if q is not None:
        u = u * q[idx, draft].clamp_min(torch.finfo(q.dtype).tiny)  # [K] u · q(x)
    rejected = (u >= p_x).nonzero()  # u >= p/q  ⇔  rejection
    if rejected.numel() == 0:
        return Verdict(list(range(k)), [*draft.tolist(), int(sampler(p[k], generator))])
    n = int(rejected[0])
    if q is None:
        residual = p[n].clone()
        residual[draft[n]] = 0.0  # max(0, p - one_hot(x))
    else:
        residual = (p[n] - q[n]).clamp_min(0)  # [V]
    total = residual.sum()
    residual = residual / total if total > 0 else p[n]
    return Verdict(list(range(n)), [*draft[:n].tolist(), int(sampler(residual, generator))])
