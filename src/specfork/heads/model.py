"""An EAGLE-3-style draft head: one decoder layer over the target's own features.

The head predicts the token after next from what the target already computed. Its input at
position i is the target's features there — the outputs of three of its blocks (low, middle,
high; EAGLE-3's choice: 2, L/2, L-3), concatenated and fused by `fc` into one hidden vector f_i —
together with the embedding of the token at i + 1. One decoder layer (attention over the head's
own earlier positions, then an MLP) turns them into g_i, whose logits over a reduced draft
vocabulary (the target's most frequent tokens; `d2t` maps them back) predict the token at i + 2.
Drafting further, the head feeds its own g in place of the target's features:

    g_i = layer(norm_e(E[x_{i+1}]) ⊕ norm_f(f_i), residual f_i)      (teacher forced)
    g'  = layer(norm_e(E[d_1]) ⊕ norm_f(g_i), residual g_i)          (its own draft, next row)
    q   = softmax(lm_head(norm(g)))                                   (over the draft vocabulary)

The layer mirrors vLLM's `llama_eagle3` midlayer (input_layernorm on the embedding, hidden_norm on
the feature, q/k/v from their concatenation, the residual from the feature), so the weights map
one to one onto the EAGLE-3 layout. Attention is explicit (keys, values and a boolean mask are
arguments), so drafting, tree drafting and training-time test share one function.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specfork.checks import is_int
from specfork.config import ModelConfig, RopeConfig
from specfork.errors import ConfigError
from specfork.models.layers import RMSNorm, Rotary, apply_rope

HEAD_FORMAT = 1  # bumped when the saved layout changes


@dataclass(frozen=True, slots=True)
class HeadConfig:
    """The head's shape and the target it was trained for (checked when it is loaded)."""

    hidden_size: int  # D, the target's hidden size
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_eps: float
    rope: RopeConfig
    feature_layers: tuple[int, ...]  # the target's blocks whose outputs are fused
    draft_vocab: int
    target_vocab: int
    target_layers: int
    target_arch: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "feature_layers", tuple(self.feature_layers))
        sizes = ("hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size")
        for name in (*sizes, "draft_vocab", "target_vocab", "target_layers"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ValueError(f"head config {name} must be an integer >= 1, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        if self.draft_vocab > self.target_vocab:
            raise ValueError("the draft vocabulary cannot exceed the target's")
        if not self.feature_layers or any(
            not 0 <= i < self.target_layers for i in self.feature_layers
        ):
            raise ValueError(f"feature layers {self.feature_layers} outside the target's blocks")

    @classmethod
    def for_target(
        cls, cfg: ModelConfig, draft_vocab: int, feature_layers: tuple[int, ...] | None = None
    ) -> HeadConfig:
        """A head shaped like one block of the target `cfg`."""
        n = cfg.num_layers
        layers = feature_layers or default_feature_layers(n)
        return cls(
            hidden_size=cfg.hidden_size,
            num_heads=cfg.num_heads,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            intermediate_size=cfg.intermediate_size,
            rms_eps=cfg.rms_eps,
            rope=cfg.rope,
            feature_layers=tuple(layers),
            draft_vocab=draft_vocab,
            target_vocab=cfg.vocab_size,
            target_layers=n,
            target_arch=cfg.arch,
        )

    def check_target(self, cfg: ModelConfig, where: str) -> None:
        """Raise ConfigError naming both shapes when this head was made for another model."""
        mine = (self.target_arch, self.hidden_size, self.target_vocab, self.target_layers)
        theirs = (cfg.arch, cfg.hidden_size, cfg.vocab_size, cfg.num_layers)
        if mine != theirs:
            raise ConfigError(
                f"the draft head {where} was trained for a {_shape(*mine)} model, but the "
                f"target is a {_shape(*theirs)} model; train a head for this target with "
                "specfork train-head"
            )

    def to_dict(self) -> dict:
        return {**asdict(self), "format": HEAD_FORMAT}

    @classmethod
    def from_dict(cls, d: dict) -> HeadConfig:
        d = dict(d)
        if d.pop("format", None) != HEAD_FORMAT:
            raise ValueError(f"not a specfork head of format {HEAD_FORMAT}")
        rope = d.pop("rope")
        factors = rope.get("freq_factors")
        rope = RopeConfig(**{**rope, "freq_factors": tuple(factors) if factors else None})
        return cls(rope=rope, **d)


def _shape(arch: str, hidden: int, vocab: int, layers: int) -> str:
    return f"{arch} ({layers} layers, hidden size {hidden}, vocabulary {vocab})"


def default_feature_layers(num_layers: int) -> tuple[int, ...]:
    """A low, a middle and a high block (2, L/2, L-3), distinct and within the model (fewer for
    very shallow ones). Their *outputs* are the features: in vLLM's numbering (its aux hidden
    state id i is the input of block i) these are ids 3, L/2+1, L-2 — `export-head` writes
    them so; vLLM's own default ids (2, L/2, L-3) are one block lower."""
    low, mid, high = 2, num_layers // 2, num_layers - 3
    return tuple(sorted({max(0, min(i, num_layers - 1)) for i in (low, mid, high)}))


class DraftHead(nn.Module):
    """The head's weights and its one layer (see the module docstring)."""

    def __init__(self, cfg: HeadConfig, d2t: torch.Tensor | None = None) -> None:
        super().__init__()
        self.config = cfg
        d, hd = cfg.hidden_size, cfg.head_dim
        q_dim, kv_dim = cfg.num_heads * hd, cfg.num_kv_heads * hd
        self.fc = nn.Linear(len(cfg.feature_layers) * d, d, bias=False)
        self.embed_norm = RMSNorm(d, cfg.rms_eps)
        self.hidden_norm = RMSNorm(d, cfg.rms_eps)
        self.qkv = nn.Linear(2 * d, q_dim + 2 * kv_dim, bias=False)
        self.o = nn.Linear(q_dim, d, bias=False)
        self.post_norm = RMSNorm(d, cfg.rms_eps)
        self.gate_up = nn.Linear(d, 2 * cfg.intermediate_size, bias=False)
        self.down = nn.Linear(cfg.intermediate_size, d, bias=False)
        self.norm = RMSNorm(d, cfg.rms_eps)
        self.lm_head = nn.Linear(d, cfg.draft_vocab, bias=False)
        self.rotary = Rotary(cfg.rope, hd)
        if d2t is None:
            d2t = torch.arange(cfg.draft_vocab)
        self.register_buffer("d2t", d2t.long().clone(), persistent=True)  # [Vd] target ids

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the head computes in (its norms'; linears may run packed)."""
        return self.norm.weight.dtype

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """The target's concatenated block outputs [..., C·D] → one feature [..., D]."""
        return self.fc(features.to(self.dtype))

    def ropes(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rotary(positions, self.dtype)  # [T, hd] each

    def project(
        self, embeds: torch.Tensor, feats: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [B, H, T, hd], k and v [B, Hkv, T, hd] of rows (embeds, feats [B, T, D])."""
        c = self.config
        b, t, _ = embeds.shape
        x = torch.cat((self.embed_norm(embeds), self.hidden_norm(feats)), dim=-1)  # [B, T, 2D]
        q_dim, kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        q, k, v = self.qkv(x).split((q_dim, kv_dim, kv_dim), dim=-1)
        cos, sin = self.ropes(positions)
        q = apply_rope(q.view(b, t, c.num_heads, c.head_dim).transpose(1, 2), cos, sin)
        k = apply_rope(k.view(b, t, c.num_kv_heads, c.head_dim).transpose(1, 2), cos, sin)
        v = v.view(b, t, c.num_kv_heads, c.head_dim).transpose(1, 2)
        return q, k, v

    def finish(self, feats: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """The rows' outputs g [B, T, D] from their attention outputs [B, H, T, hd]."""
        b, _, t, _ = attended.shape
        h = feats + self.o(attended.transpose(1, 2).reshape(b, t, -1))  # residual: the feature
        gate, up = self.gate_up(self.post_norm(h)).chunk(2, dim=-1)
        return h + self.down(F.silu(gate) * up)

    def attend(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """Attention of q [B, H, T, hd] over keys/values [B, Hkv, S, hd] (mask [.., T, S])."""
        c = self.config
        gqa = c.num_kv_heads != c.num_heads
        return F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, scale=c.head_dim**-0.5, enable_gqa=gqa
        )

    def logits(self, g: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [..., Vd] (float32) of outputs g [..., D]."""
        return self.lm_head(self.norm(g)).float()

    def rows(
        self,
        embeds: torch.Tensor,
        feats: torch.Tensor,
        positions: torch.Tensor,
        cache: tuple[torch.Tensor, torch.Tensor],
        start: int,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """One drafting step over rows (embeds, feats [T, D] at positions [T]): their keys and
        values go to slots [start, start + T) of `cache` (keys, values [1, Hkv, S, hd]), each
        row attends to the slots its `mask` [T, start + T] row allows (None: all before
        `start`, the new rows causally); returns the outputs g [T, D]."""
        q, k, v = self.project(embeds[None], feats[None], positions)
        t = q.shape[2]
        keys, values = cache
        keys[:, :, start : start + t] = k
        values[:, :, start : start + t] = v
        if mask is None:
            mask = torch.ones(t, start + t, dtype=torch.bool, device=q.device).tril(start)
        seen = (keys[:, :, : start + t].to(q.dtype), values[:, :, : start + t].to(q.dtype))
        attended = self.attend(q, *seen, mask)
        return self.finish(feats[None], attended)[0]

    @property
    def weight_count(self) -> int:
        """Weights one step multiplies (every parameter)."""
        return sum(p.numel() for p in self.parameters())


def save_head(head: DraftHead, folder: Path, dtype: torch.dtype | None = None) -> None:
    """Write `head.json` (config) and `head.safetensors` (weights in `dtype`, default their
    own; d2t) into `folder`."""
    from safetensors.torch import save_file

    from specfork.atomic import atomic_file, write_text

    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous().cpu() for k, v in head.state_dict().items()}
    if dtype is not None:
        tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
    with atomic_file(folder / "head.safetensors") as tmp:  # readable by all, like the json
        save_file(tensors, str(tmp))
    write_text(folder / "head.json", json.dumps(head.config.to_dict(), indent=1))


def _check_tensors(head: DraftHead, tensors: dict[str, torch.Tensor], folder: Path) -> None:
    """ConfigError naming the first tensor whose name or shape head.json does not expect."""
    expected = head.state_dict()
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected))
    wrong = [n for n in expected if n in tensors and tensors[n].shape != expected[n].shape]
    if not (missing or extra or wrong):
        return
    if wrong:
        name = wrong[0]
        what = (
            f"tensor {name} is {tuple(tensors[name].shape)} in head.safetensors but "
            f"{tuple(expected[name].shape)} by head.json"
        )
    else:
        absent, unknown = ", ".join(missing[:3]) or "none", ", ".join(extra[:3]) or "none"
        what = f"missing tensors: {absent}; unknown tensors: {unknown}"
    raise ConfigError(
        f"the draft head {folder}: head.json does not match head.safetensors ({what}); keep "
        "the two files of one train-head run together, or train the head again"
    )


def read_head_config(folder: Path, target: ModelConfig) -> HeadConfig:
    """The config of the head saved in `folder`, checked against `target` without reading the
    head's weights; ConfigError when it is no head or was made for another model."""
    if not (folder / "head.json").is_file() or not (folder / "head.safetensors").is_file():
        raise ConfigError(
            f"{folder} is not a draft head: it needs head.json and head.safetensors (written by "
            "specfork train-head)"
        )
    try:
        cfg = HeadConfig.from_dict(json.loads((folder / "head.json").read_text()))
    except (ValueError, TypeError, KeyError, OSError) as exc:
        where = folder / "head.json"
        raise ConfigError(f"the draft head config {where} is invalid: {exc}") from exc
    cfg.check_target(target, str(folder))
    return cfg


def load_head(folder: Path, target: ModelConfig, dtype: torch.dtype = torch.float32) -> DraftHead:
    """A saved head, checked against `target`; ConfigError for a foreign, corrupt or partial
    checkpoint (naming what is wrong)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(folder)
    cfg = read_head_config(folder, target)
    head = DraftHead(cfg)
    try:
        tensors = load_file(str(folder / "head.safetensors"))
    except (SafetensorError, RuntimeError, OSError) as exc:
        raise ConfigError(
            f"the draft head weights {folder / 'head.safetensors'} are corrupt or incomplete "
            f"({str(exc).splitlines()[0]}); train or copy the head again"
        ) from exc
    _check_tensors(head, tensors, folder)
    head.load_state_dict(tensors, strict=True)
    d2t = head.d2t
    if d2t.numel() != cfg.draft_vocab or d2t.min() < 0 or d2t.max() >= cfg.target_vocab:
        raise ConfigError(f"the draft head {folder} maps draft tokens outside the vocabulary")
    return head.to(dtype).eval().requires_grad_(False)
