"""Gemma 3 text: sliding and global layers with their own RoPE bases, q/k norm, four norms per
block, (1 + w) norms, embeddings scaled by sqrt(hidden), GELU-tanh MLP."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from specfork.config import ModelConfig
from specfork.kv_cache import KVCache
from specfork.models.base import DecoderLM
from specfork.models.layers import Attention, GatedMLP, PackedRows, RMSNorm


class Gemma3Block(nn.Module):
    """Sandwich-norm block: norms before and after both attention and MLP."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        d, eps = cfg.hidden_size, cfg.rms_eps
        self.attn_norm = RMSNorm(d, eps, unit_offset=True)
        self.attn = Attention(cfg, layer, unit_offset_norm=True)
        self.post_attn_norm = RMSNorm(d, eps, unit_offset=True)
        self.mlp_norm = RMSNorm(d, eps, unit_offset=True)
        self.mlp = GatedMLP(cfg)
        self.post_mlp_norm = RMSNorm(d, eps, unit_offset=True)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        cache: KVCache | PackedRows,
        start: int,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        x = x + self.post_attn_norm(self.attn(self.attn_norm(x), rope, cache, start, mask))
        return x + self.post_mlp_norm(self.mlp(self.mlp_norm(x)))  # [B, T, D]


class Gemma3LM(DecoderLM):
    unit_offset_norm = True
    block_norms: ClassVar[dict[str, str]] = {
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "post_attn_norm",
        "pre_feedforward_layernorm": "mlp_norm",
        "post_feedforward_layernorm": "post_mlp_norm",
    }

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.blocks = nn.ModuleList(Gemma3Block(cfg, i) for i in range(cfg.num_layers))

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(tokens)  # [B, T, D]
        return h * torch.tensor(self.config.embedding_scale, dtype=h.dtype)
