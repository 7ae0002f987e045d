"""The draft head's layer on specfork's CPU kernels: one call per drafting step.

A head step is a handful of one-row products with ~10 M weights, and in PyTorch a score of small
operations (norms, a concatenation, rotary tables, attention, the activation) whose dispatch
costs more than their arithmetic: ~0.8 ms a step on two cores against a 5 ms target step.
`KernelHead` packs the head's linear layers for the kernels (bf16, or int8 blocks of 32 with a
float16 scale — Q8_0's layout) and runs its whole layer in C++ (`FastHead`, csrc/head.cpp):
`fuse`, `rows` and `logits` are one call each, and so is a whole greedy chain (`chain`: the
steps, their argmaxes and the drafted tokens' embeddings in C++). Only drafting runs it (a
draft's q is whatever it computes, so verification stays lossless); training uses the float32
`DraftHead`.
"""

from __future__ import annotations

from types import ModuleType

import torch

from specfork.heads.model import DraftHead, HeadConfig
from specfork.kernels.pack import BLOCK, Kind, pack_float, pack_q8
from specfork.models.layers import rope_inv_freq

LINEARS = ("fc", "qkv", "o", "gate_up", "down", "lm_head")
NORMS = ("embed_norm", "hidden_norm", "post_norm", "norm")
KINDS = {"bf16": Kind.BF16, "q8": Kind.Q8}


class KernelHead:
    """A `DraftHead`'s drafting interface (`fuse`, `rows`, `logits`) on the kernels."""

    def __init__(
        self,
        head: DraftHead,
        kernels: ModuleType,
        kind: str = "bf16",
        embeddings: torch.Tensor | None = None,
    ) -> None:
        """`embeddings`: the target's input embeddings of the draft vocabulary [Vd, D] (rows
        of `head.d2t`); without them `chain` is not available (`chains` is False)."""
        if kind not in KINDS:
            raise ValueError(f"packed head kind must be one of {sorted(KINDS)}, got {kind!r}")
        c = head.config
        self.config: HeadConfig = c
        self.d2t = head.d2t.clone()  # [Vd] target ids
        self.dtype = torch.float32
        self.weight_count = head.weight_count
        packed = {
            name: _packed(getattr(head, name).weight, kernels, KINDS[kind]) for name in LINEARS
        }
        self.nbytes = sum(p.nbytes for p in packed.values())
        core = kernels.FastHead(
            c.hidden_size,
            c.num_heads,
            c.num_kv_heads,
            c.head_dim,
            c.intermediate_size,
            c.rms_eps,
            c.head_dim**-0.5,
        )
        inv_freq, scaling = rope_inv_freq(c.rope, c.head_dim)
        core.set_rope(inv_freq, scaling)
        norms = [getattr(head, name).weight.detach().float() for name in NORMS]
        core.set_weights(*(packed[name] for name in LINEARS), *norms)
        self.chains = embeddings is not None
        if embeddings is not None:
            core.set_embeddings(embeddings)
        self.t2d = torch.full((c.target_vocab,), -1, dtype=torch.int64)  # [V] draft id or -1
        self.t2d[self.d2t] = torch.arange(len(self.d2t))
        self._core = core

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """The target's concatenated block outputs [T, C·D] → one feature [T, D]."""
        return self._core.fuse(features)

    def rows(
        self,
        embeds: torch.Tensor,
        feats: torch.Tensor,
        positions: torch.Tensor,
        cache: tuple[torch.Tensor, torch.Tensor],
        start: int,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """`DraftHead.rows` in one kernel call (the cache: float32 [1, Hkv, S, hd])."""
        return self._core.rows(embeds, feats, positions, mask, cache[0], cache[1], start)

    def logits(self, g: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [T, Vd] (float32) of outputs g [T, D]."""
        return self._core.logits(g)

    def chain(
        self,
        root: torch.Tensor,
        forced: torch.Tensor,
        keep: float,
        depth: int,
        rule: tuple[float, ...],
        cache: tuple[torch.Tensor, torch.Tensor],
        start: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A greedy chain of at most `depth` tokens below the output `root` [D], whose first
        token sits at sequence position `start` (its rows go to cache slots from `start` on,
        each seeing every slot before it): the `forced` draft ids [m] while each has at least
        `keep` times the probability of the head's favourite, then the head's argmax, stopped
        before an own token whose confidence fails `rule` (`StepConfidence.coefficients`; ()
        for none). Returns the draft ids [n] and the head's probability of each [n]."""
        rule_t = torch.tensor(rule, dtype=torch.float32)  # [5] or [0]
        return self._core.chain(root, forced, keep, depth, rule_t, cache[0], cache[1], start, start)


def _packed(weight: torch.Tensor, kernels: ModuleType, kind: Kind) -> object:
    """A kernels.Packed copy of a linear layer's weight [n, k]."""
    w = weight.detach().float()  # [n, k]
    n, k = w.shape
    return kernels.Packed(int(kind), n, k, _pack(w, kind), None)


def _pack(w: torch.Tensor, kind: Kind) -> torch.Tensor:
    if kind != Kind.Q8:
        return pack_float(w, kind)
    n, k = w.shape
    blocks = w.view(n, k // BLOCK, BLOCK)  # [n, nb, 32]
    d = (blocks.abs().amax(-1) / 127).half()  # [n, nb] scale per block
    safe = d.float().clamp(min=1e-30)[..., None]
    codes = (blocks / safe).round().clamp(-127, 127).to(torch.int8).view(n, k)  # [n, k]
    return pack_q8(codes, d)


def can_pack(head: DraftHead) -> bool:
    """Whether the head's sizes suit the kernels' blocks of 32."""
    c = head.config
    sizes = (c.hidden_size, c.intermediate_size, c.num_heads * c.head_dim)
    return all(n % BLOCK == 0 for n in sizes)


def on_kernels(
    head: DraftHead,
    kernels: ModuleType,
    kind: str = "bf16",
    embeddings: torch.Tensor | None = None,
) -> KernelHead:
    """`head` on the kernels (its linear layers packed as `kind`: "bf16" or "q8"; greedy
    chains in one call when given the draft vocabulary's `embeddings` [Vd, D])."""
    return KernelHead(head, kernels, kind, embeddings)
