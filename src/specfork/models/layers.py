"""Building blocks shared by the decoder families: norms, RoPE, attention, MLP."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specfork.config import ModelConfig, RopeConfig
from specfork.kv_cache import KVCache


class Linear(nn.Linear):
    """nn.Linear that can also keep a oneDNN-packed copy of its weight for multi-row inputs.

    On the CPU in bf16, oneDNN re-lays the weight out on every call unless it is packed once
    (what that saves: docs/benchmarks.md). One row still goes through the plain weight (ATen's
    GEMV is faster there).
    """

    packed: torch.Tensor | None = None

    def pack(self, rows_hint: int = 8) -> None:
        """Keep a oneDNN-packed copy of the weight (costs the weight's size in memory)."""
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), rows_hint)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None and x.numel() > x.shape[-1]:  # more than one row
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    """RMS norm computed in float32. Gemma scales by (1 + w), Llama by w."""

    def __init__(self, dim: int, eps: float, unit_offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))
        self.eps = eps
        self.unit_offset = unit_offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (h * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * h.to(x.dtype)


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim / 2] and the attention scaling for one RoPE config."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim  # [D/2]
    inv_freq = 1.0 / (rope.theta**exponents)  # [D/2]
    scaling = 1.0
    if rope.rope_type == "linear":
        inv_freq = inv_freq / rope.factor
    # "dynamic" NTK scaling changes nothing up to the original context length, which is the
    # longest context specfork runs such a model at (ModelConfig.max_position).
    elif rope.rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, rope)
    elif rope.rope_type == "yarn":
        inv_freq, scaling = _yarn_inv_freq(inv_freq, rope, head_dim)
    if rope.freq_factors is not None:
        inv_freq = inv_freq / torch.tensor(rope.freq_factors, dtype=torch.float32)
    return inv_freq, scaling


def _llama3_inv_freq(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    old_len = rope.original_max_position
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq  # [D/2]
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_inv_freq(
    inv_freq: torch.Tensor, rope: RopeConfig, head_dim: int
) -> tuple[torch.Tensor, float]:
    factor = rope.factor
    attention = rope.attention_factor or (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0)

    def correction_dim(rotations: float) -> float:
        return (head_dim * math.log(rope.original_max_position / (rotations * 2 * math.pi))) / (
            2 * math.log(rope.theta)
        )

    low = max(math.floor(correction_dim(rope.beta_fast)), 0)
    high = min(math.ceil(correction_dim(rope.beta_slow)), head_dim - 1)
    if low == high:
        high += 0.001
    ramp = (torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)  # [D/2]
    extrapolation = 1 - ramp.clamp(0, 1)
    inv = inv_freq / factor * (1 - extrapolation) + inv_freq * extrapolation
    return inv, attention


class Rotary(nn.Module):
    """cos/sin tables for given positions, computed in float32 like transformers."""

    def __init__(self, rope: RopeConfig, head_dim: int) -> None:
        super().__init__()
        self.rope, self.head_dim = rope, head_dim
        inv_freq, self.scaling = rope_inv_freq(rope, head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # [D/2]

    def reset_inv_freq(self, device: torch.device) -> None:
        """Recompute the frequencies (after the module was built on the meta device)."""
        inv_freq, self.scaling = rope_inv_freq(self.rope, self.head_dim)
        self.inv_freq = inv_freq.to(device)  # [D/2]

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
        cos = (emb.cos() * self.scaling).to(dtype)  # [T, D]
        sin = (emb.sin() * self.scaling).to(dtype)  # [T, D]
        return cos, sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, H, T, D] by the tables [T, D] (the rotate-half convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)  # [B, H, T, D]
    return x * cos + rotated * sin


@dataclass(frozen=True, eq=False)
class PackedRows:
    """Several sequences' rows packed into one forward's [1, T, D]: the rows [a, b) of each
    span belong to one sequence and attend to its own cache only. Passed as a block's `cache`:
    the linears run once over all rows, attention once per span."""

    spans: tuple[tuple[int, int], ...]  # row ranges [a, b), in row order
    caches: tuple[KVCache, ...]
    starts: tuple[int, ...]  # each cache's first new slot
    masks: tuple[dict[str, torch.Tensor | None], ...]  # per span: its masks by layer type


class Attention(nn.Module):
    """Grouped-query attention over a KV cache, q/k/v projected by one fused linear."""

    def __init__(self, cfg: ModelConfig, layer: int, unit_offset_norm: bool) -> None:
        super().__init__()
        self.layer, self.kind = layer, cfg.layer_type(layer)
        self.n_heads, self.n_kv, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv = Linear(cfg.hidden_size, q_dim + 2 * kv_dim, bias=cfg.qkv_bias)
        self.o = Linear(q_dim, cfg.hidden_size, bias=cfg.o_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_eps, unit_offset_norm) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_eps, unit_offset_norm) if cfg.qk_norm else None
        scalar = cfg.query_pre_attn_scalar or cfg.head_dim
        self.scale = scalar**-0.5

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        cache: KVCache | PackedRows,
        start: int,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """x [B, T, D] → [B, T, D]; with `PackedRows` for `cache` (B = 1), each span of rows
        attends to its own cache (`start` and `mask` unused)."""
        b, t, _ = x.shape
        q_dim, kv_dim = self.n_heads * self.head_dim, self.n_kv * self.head_dim
        q, k, v = self.qkv(x).split((q_dim, kv_dim, kv_dim), dim=-1)
        q = q.view(b, t, self.n_heads, self.head_dim)  # [B, T, H, D]
        k = k.view(b, t, self.n_kv, self.head_dim)  # [B, T, Hkv, D]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q.transpose(1, 2), *rope)  # [B, H, T, D]
        k = apply_rope(k.transpose(1, 2), *rope)  # [B, Hkv, T, D]
        v = v.view(b, t, self.n_kv, self.head_dim).transpose(1, 2)  # [B, Hkv, T, D]
        if isinstance(cache, PackedRows):
            parts = zip(cache.spans, cache.caches, cache.starts, cache.masks, strict=True)
            out = torch.cat(
                [
                    self._attend(q[:, :, i:j], k[:, :, i:j], v[:, :, i:j], c, s0, m[self.kind])
                    for (i, j), c, s0, m in parts
                ],
                dim=2,
            )  # [1, H, T, D]
        else:
            out = self._attend(q, k, v, cache, start, mask)  # [B, H, T, D]
        return self.o(out.transpose(1, 2).reshape(b, t, q_dim))

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: KVCache,
        start: int,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """Write k, v [B, Hkv, T, D] to the cache from slot `start`; q [B, H, T, D] attends
        over it (mask [.., T, S] or None); [B, H, T, D]."""
        keys, values = cache.write(self.layer, start, k, v)  # [B, Hkv, S, D]
        if q.shape[2] == 1 and (mask is None or mask.dim() == 2):
            return self._single_query(q, keys, values, mask)  # [B, H, 1, D]
        return F.scaled_dot_product_attention(
            q,
            keys,
            values,
            attn_mask=mask,
            scale=self.scale,
            enable_gqa=self.n_kv != self.n_heads,
        )  # [B, H, T, D]

    def _single_query(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """One decode step: two small matmuls beat SDPA's CPU kernel launch several times over.

        The query heads sharing a KV head are stacked as rows, so K/V are never repeated.
        """
        b = q.shape[0]
        qg = q.reshape(b, self.n_kv, self.n_heads // self.n_kv, self.head_dim)  # [B, Hkv, G, D]
        scores = (qg @ keys.transpose(-1, -2)).float() * self.scale  # [B, Hkv, G, S]
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))  # mask [1, S]
        probs = scores.softmax(-1).to(values.dtype)  # [B, Hkv, G, S]
        out = probs @ values  # [B, Hkv, G, D]
        return out.reshape(b, self.n_heads, 1, self.head_dim)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up fused into one linear."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.gelu = cfg.hidden_act == "gelu_tanh"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)  # [B, T, F] each
        act = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return self.down(act * up)
