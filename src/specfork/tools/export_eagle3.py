"""Export a specfork draft head in the EAGLE-3 layout that vLLM's `llama_eagle3` reads.

vLLM's EAGLE-3 draft (`Eagle3LlamaForCausalLM`, architecture name `LlamaForCausalLMEagle3`) is
one Llama decoder layer, `midlayer`, whose q/k/v read [input_layernorm(E[x]) ; hidden_norm(f)]
(the embedding first, 2·D columns), with the pre-norm feature f as the residual
(`norm_before_residual: false`), then `post_attention_layernorm`, the MLP, `norm` and a
`lm_head` over the draft vocabulary. `fc` fuses the target's auxiliary hidden states, and
`d2t[i]` is the OFFSET target_id - i of draft token i (`t2d` marks the target ids drafted).
The head's embedding is the target's own: no `embed_tokens` is written, so vLLM shares the
target's. That is specfork's head (`heads.model`) weight for weight:

    qkv [q; k; v] over [embed_norm(E) ; hidden_norm(f)]  → midlayer.self_attn.{q,k,v}_proj
    o → o_proj;  gate_up [gate; up] → mlp.{gate,up}_proj;  down → down_proj
    embed_norm → input_layernorm;  hidden_norm → hidden_norm;  post_norm → post_attention_layernorm
    fc, norm, lm_head → fc, norm, lm_head;  d2t (target ids) → d2t offsets, t2d mask

vLLM numbers an auxiliary hidden state by the blocks run before it (id k = the output of block
k - 1, id 0 = the embeddings), so specfork's feature block b is id b + 1; it concatenates them
in increasing layer order, so `fc`'s column blocks are put in that order.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from specfork.config import ModelConfig
from specfork.errors import ConfigError
from specfork.heads.model import DraftHead, HeadConfig
from specfork.tools.export_model import (
    EXPORT_DTYPES,
    prepare_out,
    rope_fields,
    write_json,
    write_weights,
)

log = logging.getLogger(__name__)

FORMATS = ("eagle3",)
ARCHITECTURE = "LlamaForCausalLMEagle3"


@dataclass(frozen=True, slots=True)
class HeadExport:
    """What `export_head` writes: the head folder `head` into `out` in `format`, checked
    against `target` (a model name, .gguf or folder) when given."""

    head: Path
    out: Path
    format: str = "eagle3"
    target: str | None = None
    dtype: str = "float32"
    force: bool = False

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ConfigError(
                f"head export format {self.format!r} is not supported; use {', '.join(FORMATS)}"
            )
        if self.dtype not in EXPORT_DTYPES:
            raise ConfigError(
                f"export dtype {self.dtype!r} is not supported; use {' or '.join(EXPORT_DTYPES)}"
            )
        object.__setattr__(self, "head", Path(self.head))
        object.__setattr__(self, "out", Path(self.out))


def export_head(spec: HeadExport) -> Path:
    """Write the head of `spec.head` as an EAGLE-3 checkpoint folder at `spec.out`."""
    head = read_head(spec.head, _target_config(spec.target) if spec.target else None)
    check_exportable(head.config, str(spec.head))
    prepare_out(spec.out, spec.force)
    weights = eagle3_state_dict(head)
    write_weights(weights, spec.out / "model.safetensors", EXPORT_DTYPES[spec.dtype])
    write_json(spec.out / "config.json", eagle3_config(head.config, spec.dtype))
    log.info("exported the head %s to %s (EAGLE-3, %s)", spec.head, spec.out, spec.dtype)
    return spec.out


def _target_config(target: str) -> ModelConfig:
    """The ModelConfig of a target model, read without loading its weights."""
    from specfork.loading.facts import config_of
    from specfork.loading.registry import resolve_model

    return config_of(resolve_model(target, progress=False))


def read_head(folder: Path, target: ModelConfig | None) -> DraftHead:
    """The head saved in `folder` (float32), checked against `target` when given."""
    from specfork.heads.model import load_head

    folder = Path(folder)
    if target is None:
        target = _implied_target(folder)
    return load_head(folder, target, torch.float32)


def _implied_target(folder: Path) -> ModelConfig:
    """A target shaped as the head's config says (so `load_head` checks only the files)."""
    path = folder / "head.json"
    try:
        cfg = HeadConfig.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError, KeyError) as exc:
        if not path.is_file():
            raise ConfigError(
                f"{folder} is not a draft head: it needs head.json and head.safetensors "
                "(written by specfork train-head)"
            ) from exc
        raise ConfigError(f"the draft head config {path} is invalid: {exc}") from exc
    return ModelConfig(
        arch=cfg.target_arch,
        vocab_size=cfg.target_vocab,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_layers=cfg.target_layers,
        num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
    )


def check_exportable(cfg: HeadConfig, where: str) -> None:
    """ConfigError for heads vLLM's EAGLE-3 draft cannot compute exactly."""
    if cfg.target_arch != "llama":
        raise ConfigError(
            f"the draft head {where} drafts for a {cfg.target_arch} model; vLLM's EAGLE-3 "
            "draft feeds the target's unscaled embedding, so only heads of Llama-family "
            "targets (Llama, SmolLM, Mistral, Qwen) export exactly"
        )


def aux_layer_ids(cfg: HeadConfig) -> list[int]:
    """vLLM's eagle_aux_hidden_state_layer_ids of the head's feature blocks (block b → b + 1)."""
    return [b + 1 for b in sorted(cfg.feature_layers)]


def eagle3_state_dict(head: DraftHead) -> dict[str, torch.Tensor]:
    """The head's weights under the EAGLE-3 checkpoint names (see the module docstring)."""
    c = head.config
    q_dim, kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    q, k, v = head.qkv.weight.split((q_dim, kv_dim, kv_dim))
    gate, up = head.gate_up.weight.chunk(2)
    m = "midlayer."
    return {
        "fc.weight": _fc_in_layer_order(head.fc.weight, c),
        f"{m}input_layernorm.weight": head.embed_norm.weight,
        f"{m}hidden_norm.weight": head.hidden_norm.weight,
        f"{m}self_attn.q_proj.weight": q,
        f"{m}self_attn.k_proj.weight": k,
        f"{m}self_attn.v_proj.weight": v,
        f"{m}self_attn.o_proj.weight": head.o.weight,
        f"{m}post_attention_layernorm.weight": head.post_norm.weight,
        f"{m}mlp.gate_proj.weight": gate,
        f"{m}mlp.up_proj.weight": up,
        f"{m}mlp.down_proj.weight": head.down.weight,
        "norm.weight": head.norm.weight,
        "lm_head.weight": head.lm_head.weight,
        **draft_maps(head.d2t, c.target_vocab),
    }


def _fc_in_layer_order(w: torch.Tensor, cfg: HeadConfig) -> torch.Tensor:
    """fc's columns [D, C·D] reordered so block i reads the i-th lowest feature layer."""
    d = cfg.hidden_size
    order = sorted(range(len(cfg.feature_layers)), key=lambda i: cfg.feature_layers[i])
    return torch.cat([w[:, i * d : (i + 1) * d] for i in order], dim=1)  # [D, C·D]


def draft_maps(d2t: torch.Tensor, target_vocab: int) -> dict[str, torch.Tensor]:
    """EAGLE-3's d2t (offsets: target id - draft id, int64) and t2d (bool over the target
    vocabulary) of a draft → target id table."""
    ids = d2t.long()  # [Vd]
    t2d = torch.zeros(target_vocab, dtype=torch.bool)  # [V]
    t2d[ids] = True
    return {"d2t": ids - torch.arange(ids.numel()), "t2d": t2d}


def eagle3_config(cfg: HeadConfig, dtype: str) -> dict:
    """config.json of the EAGLE-3 draft, with every field vLLM's llama_eagle3 reads."""
    layers = aux_layer_ids(cfg)
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "target_hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_eps,
        **rope_fields(cfg.rope, cfg.head_dim),
        "max_position_embeddings": 131072,
        "attention_bias": False,
        "mlp_bias": False,
        "vocab_size": cfg.target_vocab,
        "draft_vocab_size": cfg.draft_vocab,
        "tie_word_embeddings": False,
        "norm_before_residual": False,
        "eagle_aux_hidden_state_layer_ids": layers,
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": layers,
            "use_aux_hidden_state": True,
            "norm_before_fc": False,
        },
        "torch_dtype": dtype,
        "dtype": dtype,
    }
