"""Helpers shared by the tests that build tiny random-weight transformers models."""

from __future__ import annotations

import json
from pathlib import Path

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


CHAT = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def tiny_chat_llama(
    folder: Path, chat: bool = True, seed: int = 0, eos_token_id: int = 257, context: int = 512
) -> Path:
    """A 2-layer random Llama checkpoint in `folder` (as transformers saves it: config.json,
    model.safetensors) with a byte-level tokenizer (no merges) and a ChatML chat template (none
    with ``chat=False``), `context` positions: end-to-end tests run it in seconds."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(SPECIALS)
    backend.save(str(folder / "tokenizer.json"))
    config = {
        "eos_token": "<|im_end|>",
        "bos_token": None,
        **({"chat_template": CHAT} if chat else {}),
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    cfg = LlamaConfig(
        vocab_size=260,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=context,
        eos_token_id=eos_token_id,
        bos_token_id=None,
        pad_token_id=256,
    )
    model = LlamaForCausalLM(cfg)
    randomize(model, seed=seed, norm_center=1.0)  # logits O(1): no accidental near-ties
    model.save_pretrained(folder)
    return folder
