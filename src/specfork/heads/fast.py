"""The draft head's linear layers on specfork's CPU kernels.

A head step is a handful of one-row products with ~10 M weights; in float32 PyTorch those
weights cost more memory traffic than the head's arithmetic. `on_kernels` returns a copy of a
head whose linear layers read packed weights (bf16, or int8 blocks of 32 with a float16 scale —
Q8_0's layout) through the kernels' `packed_linear`; norms, rotary embedding and attention stay
in PyTorch. Only drafting runs it (a draft's q is whatever it computes, so verification stays
lossless); training uses the float32 head.
"""

from __future__ import annotations

from types import ModuleType

import torch
from torch import nn

from specfork.heads.model import DraftHead
from specfork.kernels.pack import BLOCK, Kind, pack_float, pack_q8

LINEARS = ("fc", "qkv", "o", "gate_up", "down", "lm_head")
KINDS = {"bf16": Kind.BF16, "q8": Kind.Q8}


class KernelLinear(nn.Module):
    """y = x Wᵀ by the kernels over a packed copy of `linear`'s weight."""

    def __init__(self, linear: nn.Linear, kernels: ModuleType, kind: Kind) -> None:
        super().__init__()
        w = linear.weight.detach().float()  # [n, k]
        n, k = w.shape
        self.out_features = n
        self.packed = kernels.Packed(int(kind), n, k, _pack(w, kind), None)
        self._run = kernels.packed_linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])  # [R, k]
        return self._run(self.packed, rows).view(*x.shape[:-1], self.out_features)


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
    """Whether every linear's input size suits the kernels' blocks of 32."""
    return all(getattr(head, name).in_features % BLOCK == 0 for name in LINEARS)


def on_kernels(head: DraftHead, kernels: ModuleType, kind: str = "bf16") -> DraftHead:
    """A copy of `head` (float32 norms) whose linear layers run on the kernels."""
    if kind not in KINDS:
        raise ValueError(f"packed head kind must be one of {sorted(KINDS)}, got {kind!r}")
    fast = DraftHead(head.config, head.d2t)
    fast.load_state_dict({k: v.float() for k, v in head.state_dict().items()})
    for name in LINEARS:
        setattr(fast, name, KernelLinear(getattr(head, name), kernels, KINDS[kind]))
    return fast.eval().requires_grad_(False)
