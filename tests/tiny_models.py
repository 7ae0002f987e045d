"""Helpers shared by the tests that build tiny random-weight transformers models."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

VOCAB = 128

#: A tiny transformers config (Llama-shaped keys) every architecture test starts from.
TINY = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}


def randomize(model: PreTrainedModel, seed: int, norm_center: float) -> None:
    """Random values for every parameter (biases and norm weights included, which transformers
    initializes to constants), at a scale that keeps the logits O(1)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(norm_center + 0.5 * (torch.rand(p.shape, generator=gen) - 0.5))
            elif name.endswith("bias"):
                p.copy_(0.3 * noise)
            elif "embed_tokens" in name:
                p.copy_(noise)
            else:  # linear weights [out, in]
                p.copy_(noise * p.shape[-1] ** -0.5)
