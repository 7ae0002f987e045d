"""GGUF files: metadata → ModelConfig, tensors → transformers-named float tensors.

llama.cpp's converter permutes the rows of Q and K for the Llama architecture (its RoPE pairs
adjacent dimensions, transformers' pairs the two halves); `_unpermute` undoes that. Gemma norms
are stored as (1 + w); transformers' Gemma keeps w, so 1 is subtracted here.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from specfork.config import ModelConfig, RopeConfig
from specfork.errors import ModelFormatError
from specfork.loading.dequant import check_supported, dequantize
from specfork.loading.gguf_index import GGUFIndex

log = logging.getLogger(__name__)

GGUF_ARCHS = ("llama", "qwen2", "qwen3", "gemma3")

_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def config_from_gguf(index: GGUFIndex, path: Path) -> ModelConfig:
    """Map GGUF metadata (and which tensors exist) to a ModelConfig."""
    arch = str(index.value("general.architecture", ""))
    if arch not in GGUF_ARCHS:
        raise ModelFormatError(
            f"{path.name}: GGUF architecture {arch!r} is not supported; "
            f"supported: {', '.join(GGUF_ARCHS)}"
        )
    names = index.names

    def get(key: str, default: object = None) -> object:
        return index.value(f"{arch}.{key}", default)

    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    head_dim = int(get("attention.key_length", hidden // heads))
    vocab = get("vocab_size") or index.length("tokenizer.ggml.tokens")
    n_layers = int(get("block_count"))
    common = {
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_layers": n_layers,
        "num_heads": heads,
        "num_kv_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_eps": float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        "max_position": int(get("context_length", 4096)),
        "tie_embeddings": "output.weight" not in names,
        "qkv_bias": "blk.0.attn_q.bias" in names,
        "o_bias": "blk.0.attn_output.bias" in names,
        "qk_norm": "blk.0.attn_q_norm.weight" in names,
        "name": str(index.value("general.name", path.stem)),
    }
    rope = _rope_from_gguf(index, arch, get("rope.freq_base", 10000.0))
    if arch != "gemma3":
        return ModelConfig(arch="llama", rope=rope, **common)
    window = int(get("attention.sliding_window", 512))
    types = tuple("full" if (i + 1) % 6 == 0 else "sliding" for i in range(n_layers))
    return ModelConfig(
        arch="gemma3",
        rope=rope,
        rope_local=RopeConfig(theta=10000.0),
        hidden_act="gelu_tanh",
        sliding_window=window,
        layer_types=types,
        # llama.cpp: Gemma 3 27B (62 layers) scales queries by hidden/heads, the others by head_dim
        query_pre_attn_scalar=float(hidden // heads if n_layers == 62 else head_dim),
        final_logit_softcapping=get("final_logit_softcapping"),
        **common,
    )


def _rope_from_gguf(index: GGUFIndex, arch: str, theta: object) -> RopeConfig:
    kind = str(index.value(f"{arch}.rope.scaling.type", "none"))
    factor = float(index.value(f"{arch}.rope.scaling.factor", 1.0) or 1.0)
    original = index.value(f"{arch}.rope.scaling.original_context_length")
    freq_factors = _rope_freq_factors(index)
    if kind in ("none", "") or factor == 1.0:
        return RopeConfig(theta=float(theta), freq_factors=freq_factors)
    if kind not in ("linear", "yarn"):
        raise ModelFormatError(f"GGUF RoPE scaling type {kind!r} is not supported")
    return RopeConfig(
        theta=float(theta),
        rope_type=kind,
        factor=factor,
        original_max_position=int(original) if original else None,
        freq_factors=freq_factors,
    )


def _rope_freq_factors(index: GGUFIndex) -> tuple[float, ...] | None:
    """Llama 3.x GGUFs store their RoPE scaling as a per-frequency divisor tensor."""
    if "rope_freqs.weight" not in index.names:
        return None
    for t in index.tensors:
        if t.name == "rope_freqs.weight":
            return tuple(float(x) for x in np.asarray(t.data, dtype=np.float32).ravel())
    return None


def hf_name(gguf_name: str) -> str | None:
    """transformers' name of a GGUF tensor (None for tensors the model does not use)."""
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if parts[0] != "blk" or len(parts) != 4:
        return None
    mapped = _BLOCK_NAMES.get(parts[2])
    if parts[2] == "ffn_norm":
        mapped = "post_attention_layernorm"  # the pre-MLP norm of Llama blocks
    return f"model.layers.{parts[1]}.{mapped}.{parts[3]}" if mapped else None


def iter_tensors(
    index: GGUFIndex, cfg: ModelConfig, dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (transformers name, tensor in `dtype`) for every tensor the model needs."""
    permuted = index.value("general.architecture") == "llama"
    for t in index.entries:
        check_supported(t.tensor_type, t.name)
    for t in index.tensors:
        name = hf_name(t.name)
        if cfg.arch == "gemma3" and t.name.endswith("ffn_norm.weight"):
            name = name.replace("post_attention_layernorm", "pre_feedforward_layernorm")
        if name is None:
            continue
        shape = tuple(int(d) for d in reversed(t.shape))
        w = dequantize(t.data, t.tensor_type, shape)  # [rows, cols] float32
        yield name, _fix_tensor(name, w, cfg, permuted).to(dtype)


def _fix_tensor(name: str, w: torch.Tensor, cfg: ModelConfig, permuted: bool) -> torch.Tensor:
    if permuted and name.endswith(("q_proj.weight", "q_proj.bias")):
        return _unpermute(w, cfg.num_heads)
    if permuted and name.endswith(("k_proj.weight", "k_proj.bias")):
        return _unpermute(w, cfg.num_kv_heads)
    if cfg.arch == "gemma3" and "norm" in name:
        return w - 1.0
    return w


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (pairs of halves → interleaved pairs)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
