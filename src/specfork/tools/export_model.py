"""Export a model specfork loads (packaged name, .gguf file, checkpoint folder) as a Hugging Face
checkpoint folder that transformers and vLLM load: config.json, model.safetensors, tokenizer
files and generation_config.json.

The weights are the ones specfork runs in float32: a GGUF's blocks dequantized, llama.cpp's Q/K
row permutation undone and Gemma's stored (1 + w) norms shifted back (`loading.gguf`). They are
read from the eager `DecoderLM` and renamed back to transformers' names: the inverse of
`DecoderLM.from_hf_names` (fused q/k/v and gate/up split again, block norms renamed).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from specfork.atomic import atomic_file, output_folder, write_text
from specfork.config import ModelConfig, RopeConfig
from specfork.errors import ConfigError
from specfork.loading.tokenizer import Tokenizer
from specfork.models import DecoderLM
from specfork.models.layers import rope_inv_freq

log = logging.getLogger(__name__)

EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
WEIGHTS_FILE = "model.safetensors"


@dataclass(frozen=True, slots=True)
class ModelExport:
    """What `export_model` writes: `model` (name, .gguf or folder) into `out`, in `dtype`."""

    model: str
    out: Path
    dtype: str = "float32"
    force: bool = False  # write into a non-empty `out` (replacing the files it writes)

    def __post_init__(self) -> None:
        if self.dtype not in EXPORT_DTYPES:
            raise ConfigError(
                f"export dtype {self.dtype!r} is not supported; use {' or '.join(EXPORT_DTYPES)}"
            )
        object.__setattr__(self, "out", Path(self.out))


def prepare_out(out: Path, force: bool) -> None:
    """Check that `out` may be written: absent, empty, or `force`; ConfigError otherwise."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file; give a folder to export into")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ConfigError(
            f"--out {out} exists and is not empty; choose another folder or pass --force to "
            "overwrite the exported files in it"
        )
    output_folder(out, "--out")


def export_model(spec: ModelExport) -> Path:
    """Write `spec.model` as a Hugging Face folder at `spec.out`; returns the folder."""
    from specfork.host import cache_dir
    from specfork.loading.loader import load_eager
    from specfork.loading.registry import resolve_model

    path = resolve_model(spec.model, progress=False)
    prepare_out(spec.out, spec.force)
    if path.is_dir():
        tokenizer = Tokenizer.from_folder(path)
    else:
        tokenizer = Tokenizer.from_gguf(path, cache_dir() / "tokenizers")
    model = load_eager(path, torch.float32, torch.device("cpu"), relayout=False)
    write_weights(hf_state_dict(model), spec.out / WEIGHTS_FILE, EXPORT_DTYPES[spec.dtype])
    write_json(spec.out / "config.json", hf_config(model.config, tokenizer, spec.dtype))
    write_json(spec.out / "generation_config.json", generation_config(tokenizer))
    write_tokenizer(tokenizer, spec.out)
    log.info("exported %s to %s (%s)", path.name, spec.out, spec.dtype)
    return spec.out


# -- weights ----------------------------------------------------------------------------------


def hf_state_dict(model: DecoderLM) -> dict[str, torch.Tensor]:
    """The model's weights under transformers' names (the inverse of `from_hf_names`)."""
    cfg = model.config
    own = model.state_dict()
    out = {
        "model.embed_tokens.weight": own["embed_tokens.weight"],
        "model.norm.weight": own["norm.weight"],
    }
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = own["lm_head.weight"]
    norms = {ours: theirs for theirs, ours in type(model).block_norms.items()}
    for i in range(cfg.num_layers):
        block = {
            k.removeprefix(f"blocks.{i}."): v
            for k, v in own.items()
            if k.startswith(f"blocks.{i}.")
        }
        out.update(_block_to_hf(block, cfg, norms, f"model.layers.{i}."))
    return out


def _block_to_hf(
    block: dict[str, torch.Tensor], cfg: ModelConfig, norms: dict[str, str], prefix: str
) -> dict[str, torch.Tensor]:
    """One block's weights (our names without the block prefix) → transformers' names."""
    q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    out: dict[str, torch.Tensor] = {}
    for name, value in block.items():
        module, _, kind = name.rpartition(".")  # e.g. ("attn.qkv", "weight")
        if module == "attn.qkv":
            for p, part in zip("qkv", value.split((q_dim, kv_dim, kv_dim)), strict=True):
                out[f"{prefix}self_attn.{p}_proj.{kind}"] = part
        elif module == "mlp.gate_up":
            gate, up = value.chunk(2)
            out[f"{prefix}mlp.gate_proj.{kind}"] = gate
            out[f"{prefix}mlp.up_proj.{kind}"] = up
        elif module in ("attn.o", "mlp.down"):
            hf = "self_attn.o_proj" if module == "attn.o" else "mlp.down_proj"
            out[f"{prefix}{hf}.{kind}"] = value
        elif module in ("attn.q_norm", "attn.k_norm"):
            out[f"{prefix}self_attn.{module.removeprefix('attn.')}.{kind}"] = value
        elif module in norms:
            out[f"{prefix}{norms[module]}.{kind}"] = value
        else:
            raise ValueError(f"no transformers name for the block weight {name}")
    return out


def write_weights(tensors: dict[str, torch.Tensor], path: Path, dtype: torch.dtype) -> None:
    """One safetensors file of `tensors` (floating-point ones in `dtype`), written atomically."""
    from safetensors.torch import save_file

    data = {
        k: (v.detach().to(dtype) if v.is_floating_point() else v.detach()).contiguous().cpu()
        for k, v in tensors.items()
    }
    with atomic_file(path) as tmp:
        save_file(data, str(tmp), metadata={"format": "pt"})


def write_json(path: Path, data: dict) -> None:
    write_text(path, json.dumps(data, indent=2, ensure_ascii=False) + "\n")


# -- config -----------------------------------------------------------------------------------


def hf_config(cfg: ModelConfig, tokenizer: Tokenizer | None, dtype: str) -> dict:
    """config.json for `cfg`, built by transformers' own config class of the family."""
    from transformers import AutoConfig

    fields = _gemma3_fields(cfg) if cfg.arch == "gemma3" else _llama_fields(cfg)
    model_type = fields.pop("model_type")
    ids = special_ids(tokenizer)
    common = {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.rms_eps,
        "max_position_embeddings": cfg.max_position,
        "tie_word_embeddings": cfg.tie_embeddings,
        **ids,
    }
    config = AutoConfig.for_model(model_type, **common, **fields)
    out = {k: v for k, v in config.to_dict().items() if k not in _GENERIC_KEYS}
    out["torch_dtype"] = out["dtype"] = dtype
    return out


#: PretrainedConfig's task and output switches: not the model's, left to the loader's defaults.
_GENERIC_KEYS = frozenset(
    {
        "transformers_version",
        "_name_or_path",
        "id2label",
        "label2id",
        "problem_type",
        "output_hidden_states",
        "output_attentions",
        "return_dict",
        "chunk_size_feed_forward",
        "is_encoder_decoder",
    }
)


def _llama_fields(cfg: ModelConfig) -> dict:
    """model_type and family fields for the Llama-shaped models (Llama, Mistral, Qwen2/3)."""
    if cfg.qk_norm:
        model_type, arch = "qwen3", "Qwen3ForCausalLM"
    elif cfg.qkv_bias and not cfg.o_bias:
        model_type, arch = "qwen2", "Qwen2ForCausalLM"
    elif cfg.sliding_window:
        model_type, arch = "mistral", "MistralForCausalLM"
    else:
        model_type, arch = "llama", "LlamaForCausalLM"
    fields = {
        "model_type": model_type,
        "architectures": [arch],
        "hidden_act": "silu",
        **rope_fields(cfg.rope, cfg.head_dim),
    }
    if model_type == "llama":
        fields |= {"attention_bias": cfg.qkv_bias, "mlp_bias": cfg.mlp_bias}
    if model_type in ("qwen2", "qwen3"):
        windowed = cfg.sliding_window is not None
        fields |= {"use_sliding_window": windowed, "sliding_window": cfg.sliding_window}
        if model_type == "qwen3":
            fields["attention_bias"] = cfg.qkv_bias
    if model_type == "mistral":
        fields["sliding_window"] = cfg.sliding_window
    return fields


def _gemma3_fields(cfg: ModelConfig) -> dict:
    names = {"full": "full_attention", "sliding": "sliding_attention"}
    local = cfg.rope_local or RopeConfig(theta=10000.0)
    if local.rope_type != "default" or local.freq_factors:
        raise ConfigError("a Gemma 3 model with scaled local RoPE cannot be exported")
    return {
        "model_type": "gemma3_text",
        "architectures": ["Gemma3ForCausalLM"],
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": _number(cfg.query_pre_attn_scalar or cfg.head_dim),
        "sliding_window": cfg.sliding_window,
        "layer_types": [names[cfg.layer_type(i)] for i in range(cfg.num_layers)],
        "final_logit_softcapping": cfg.final_logit_softcapping,
        "attention_bias": cfg.qkv_bias,
        "rope_local_base_freq": local.theta,
        **rope_fields(cfg.rope, cfg.head_dim),
    }


def _number(x: float) -> int | float:
    """An integral float as an int (transformers' configs type such fields strictly)."""
    return int(x) if float(x).is_integer() else x


def rope_fields(rope: RopeConfig, head_dim: int) -> dict:
    """rope_theta and rope_scaling (transformers' v4 names; v5 converts them itself)."""
    if rope.freq_factors is not None:
        rope = llama3_from_factors(rope, head_dim)
    scaling: dict | None = None
    if rope.rope_type in ("linear", "dynamic"):
        scaling = {"rope_type": rope.rope_type, "factor": rope.factor}
    elif rope.rope_type == "llama3":
        scaling = {
            "rope_type": "llama3",
            "factor": rope.factor,
            "low_freq_factor": rope.low_freq_factor,
            "high_freq_factor": rope.high_freq_factor,
            "original_max_position_embeddings": rope.original_max_position,
        }
    elif rope.rope_type == "yarn":
        scaling = {
            "rope_type": "yarn",
            "factor": rope.factor,
            "original_max_position_embeddings": rope.original_max_position,
            "beta_fast": rope.beta_fast,
            "beta_slow": rope.beta_slow,
        }
        if rope.attention_factor is not None:
            scaling["attention_factor"] = rope.attention_factor
    return {"rope_theta": rope.theta, "rope_scaling": scaling}


def llama3_from_factors(rope: RopeConfig, head_dim: int) -> RopeConfig:
    """The Llama 3 RoPE scaling whose frequencies equal a GGUF's per-frequency divisors.

    llama.cpp stores Llama 3.x scaling as `rope_freqs` (one divisor per frequency); transformers
    wants its parameters. The factor is the largest divisor; the original context and the
    low/high frequency factors are found among the values Llama 3 models use, checked by
    recomputing every frequency. ConfigError when none reproduces them.
    """
    if rope.rope_type != "default":
        raise ConfigError("RoPE divisors on top of another RoPE scaling cannot be exported")
    target, _ = rope_inv_freq(rope, head_dim)  # [D/2]
    factor = max(rope.freq_factors or (1.0,))
    for original in (2**k for k in range(4, 21)):
        for low, high in ((1.0, 4.0), (1.0, 2.0), (1.0, 8.0), (2.0, 4.0)):
            guess = RopeConfig(
                theta=rope.theta,
                rope_type="llama3",
                factor=factor,
                low_freq_factor=low,
                high_freq_factor=high,
                original_max_position=original,
            )
            inv, _ = rope_inv_freq(guess, head_dim)
            if torch.allclose(inv, target, rtol=1e-5, atol=0.0):
                return guess
    raise ConfigError(
        "this GGUF's RoPE frequency divisors (rope_freqs) match no Llama 3 scaling that a "
        "transformers config can express; export the original checkpoint folder instead"
    )


def special_ids(tokenizer: Tokenizer | None) -> dict:
    """bos/eos/pad token ids for config.json, from the tokenizer."""
    if tokenizer is None:
        return {}
    eos_token = tokenizer.template_tokens.get("eos_token")
    eos = tokenizer.token_id(eos_token) if eos_token else None
    pad_token = tokenizer.template_tokens.get("pad_token")
    pad = tokenizer.token_id(pad_token) if pad_token else None
    if eos is None and tokenizer.eos_ids:
        eos = min(tokenizer.eos_ids)
    return {"bos_token_id": tokenizer.bos_id, "eos_token_id": eos, "pad_token_id": pad}


def generation_config(tokenizer: Tokenizer) -> dict:
    """Every id specfork stops at (EOS and the chat template's end of turn)."""
    eos = sorted(tokenizer.eos_ids)
    out: dict = {"bos_token_id": tokenizer.bos_id, "do_sample": False}
    out["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    return out


# -- tokenizer --------------------------------------------------------------------------------


def write_tokenizer(tokenizer: Tokenizer, out: Path) -> None:
    """tokenizer.json, tokenizer_config.json (chat template, named special tokens) and
    special_tokens_map.json, as transformers' fast tokenizers save them."""
    with atomic_file(out / "tokenizer.json") as tmp:
        tokenizer.save(tmp)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1_000_000_000_000_000_019_884_624_838_656,
        **tokenizer.template_tokens,
    }
    if tokenizer.chat_template is not None:
        config["chat_template"] = tokenizer.chat_template
    write_json(out / "tokenizer_config.json", config)
    write_json(out / "special_tokens_map.json", dict(tokenizer.template_tokens))
