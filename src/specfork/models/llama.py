"""Llama family: Llama 2/3, SmolLM/SmolLM2, Mistral, Qwen2/2.5 (q/k/v biases), Qwen3 (q/k norm)."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from specfork.config import ModelConfig
from specfork.kv_cache import KVCache
from specfork.models.base import DecoderLM
from specfork.models.layers import Attention, GatedMLP, PackedRows, RMSNorm


class LlamaBlock(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.attn = Attention(cfg, layer, unit_offset_norm=False)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.mlp = GatedMLP(cfg)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        cache: KVCache | PackedRows,
        start: int,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), rope, cache, start, mask)  # [B, T, D]
        return x + self.mlp(self.mlp_norm(x))  # [B, T, D]


class LlamaLM(DecoderLM):
    block_norms: ClassVar[dict[str, str]] = {
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "mlp_norm",
    }

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.blocks = nn.ModuleList(LlamaBlock(cfg, i) for i in range(cfg.num_layers))
