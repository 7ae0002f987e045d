"""Hugging Face checkpoint folders: `config.json` → ModelConfig, `*.safetensors` → tensors."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from specfork.config import ModelConfig, RopeConfig
from specfork.errors import ModelFormatError

LLAMA_TYPES = ("llama", "mistral", "qwen2", "qwen3")
GEMMA_TYPES = ("gemma3_text", "gemma3")


def read_config(folder: Path) -> dict:
    """The parsed config.json of a checkpoint folder."""
    path = folder / "config.json"
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelFormatError(f"cannot read {path}: {exc}") from exc


def config_from_hf(d: dict) -> ModelConfig:
    """Map a transformers config dict (v4 or v5 layout) to a ModelConfig."""
    model_type = d.get("model_type", "")
    if model_type == "gemma3" and "text_config" in d:
        d = {**d["text_config"], "model_type": "gemma3_text"}
        model_type = "gemma3_text"
    if model_type not in LLAMA_TYPES + GEMMA_TYPES:
        raise ModelFormatError(
            f"model_type {model_type!r} is not supported; supported: "
            f"{', '.join(LLAMA_TYPES + GEMMA_TYPES)}"
        )
    heads = d["num_attention_heads"]
    common = {
        "vocab_size": d["vocab_size"],
        "hidden_size": d["hidden_size"],
        "intermediate_size": d["intermediate_size"],
        "num_layers": d["num_hidden_layers"],
        "num_heads": heads,
        "num_kv_heads": d.get("num_key_value_heads") or heads,
        "head_dim": d.get("head_dim") or d["hidden_size"] // heads,
        "rms_eps": d.get("rms_norm_eps", 1e-6),
        "max_position": d.get("max_position_embeddings", 4096),
        "tie_embeddings": d.get("tie_word_embeddings", model_type in GEMMA_TYPES),
        "name": d.get("_name_or_path", ""),
    }
    if model_type in GEMMA_TYPES:
        return _gemma3_config(d, common)
    return ModelConfig(
        arch="llama",
        rope=_rope(d, "full_attention", d.get("rope_theta", 10000.0)),
        qkv_bias=model_type == "qwen2" or d.get("attention_bias", False),
        o_bias=d.get("attention_bias", False),
        mlp_bias=d.get("mlp_bias", False),
        qk_norm=model_type == "qwen3",
        sliding_window=_llama_window(d, model_type),
        layer_types=_layer_types(d) if _llama_window(d, model_type) else (),
        **common,
    )


def _gemma3_config(d: dict, common: dict) -> ModelConfig:
    n = d["num_hidden_layers"]
    pattern = d.get("sliding_window_pattern") or d.get("_sliding_window_pattern") or 6
    types = _layer_types(d) or tuple(
        "full" if (i + 1) % pattern == 0 else "sliding" for i in range(n)
    )
    if d.get("hidden_activation", "gelu_pytorch_tanh") not in ("gelu_pytorch_tanh", "gelu"):
        raise ModelFormatError(f"Gemma 3 activation {d.get('hidden_activation')} unsupported")
    return ModelConfig(
        arch="gemma3",
        rope=_rope(d, "full_attention", d.get("rope_theta", 1_000_000.0)),
        rope_local=_rope(d, "sliding_attention", d.get("rope_local_base_freq", 10000.0), False),
        qkv_bias=d.get("attention_bias", False),
        o_bias=d.get("attention_bias", False),
        qk_norm=True,
        hidden_act="gelu_tanh",
        sliding_window=d.get("sliding_window") or 4096,
        layer_types=types,
        query_pre_attn_scalar=d.get("query_pre_attn_scalar"),
        final_logit_softcapping=d.get("final_logit_softcapping"),
        **common,
    )


def _layer_types(d: dict) -> tuple[str, ...]:
    names = {"full_attention": "full", "sliding_attention": "sliding"}
    return tuple(names[t] for t in d.get("layer_types") or ())


def _llama_window(d: dict, model_type: str) -> int | None:
    if model_type in ("qwen2", "qwen3") and not d.get("use_sliding_window", False):
        return None
    return d.get("sliding_window")


def _rope(d: dict, layer_type: str, theta: float, use_v4_scaling: bool = True) -> RopeConfig:
    """RoPE parameters from v5 `rope_parameters` (maybe per layer type) or v4 fields."""
    params = d.get("rope_parameters")
    if isinstance(params, dict) and layer_type in params:
        params = params[layer_type]
    if not params:
        params = (d.get("rope_scaling") or {}) if use_v4_scaling else {}
    kind = params.get("rope_type") or params.get("type") or "default"
    return RopeConfig(
        theta=float(params.get("rope_theta", theta)),
        rope_type=kind,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position=params.get("original_max_position_embeddings")
        or (d.get("max_position_embeddings") if kind in ("yarn", "dynamic") else None),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        attention_factor=params.get("attention_factor"),
    )


def iter_tensors(folder: Path, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor in `dtype`) from every `*.safetensors` file (sharded or not)."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelFormatError(f"no *.safetensors files in {folder}")
    for file in files:
        try:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                    key = name.removeprefix("language_model.")
                    yield key, f.get_tensor(name).to(dtype)
        except (SafetensorError, OSError) as exc:
            raise ModelFormatError(f"cannot read {file}: {exc}") from exc
