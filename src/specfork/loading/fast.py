"""A GGUF model straight onto the kernels, its quantized weights kept as they are.

Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K blocks are re-laid out for the kernels bit
for bit (`kernels.pack`), so the model that runs is the one in the file, computed the way
llama.cpp computes it (int8 activations per block of 32). Float tensors (norms, biases, F16/F32
weights) are read as float32. A file with other block types (Q2_K, Q3_K) runs in bfloat16
instead; the caller asks `unsupported(index)` first. At bfloat16 or float32 every weight matrix is
dequantized and packed at that precision (norms and biases stay float32), with no eager model
in between; either way the packed model is kept in the cache (`packed_cache`).
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import gguf
import torch

from specfork.config import ModelConfig
from specfork.errors import ModelFormatError
from specfork.kernels.pack import GGUF_KINDS, Kind, pack_float, pack_gguf
from specfork.loading.dequant import _raw_bytes, check_supported, dequantize
from specfork.loading.gguf import config_from_gguf
from specfork.loading.gguf_index import GGUFIndex, load_index
from specfork.loading.packed_cache import PackedWeights, packed_file
from specfork.models.fast import FastLM, LayerWeights

FLOAT_TYPES = (
    gguf.GGMLQuantizationType.F32,
    gguf.GGMLQuantizationType.F16,
    gguf.GGMLQuantizationType.BF16,
)
_LINEARS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


#: the precisions `load_gguf_fast` runs and how it packs float weight matrices at each
FLOAT_KINDS = {"gguf": Kind.F32, "bfloat16": Kind.BF16, "float32": Kind.F32}


def unsupported(index: GGUFIndex) -> str | None:
    """Why the file's weights cannot run on the kernels as stored, or None if they can."""
    kinds = (*GGUF_KINDS, *FLOAT_TYPES)
    matrices = [t for t in index.entries if t.name.endswith(".weight") and len(t.shape) == 2]
    odd = sorted({t.tensor_type.name for t in matrices if t.tensor_type not in kinds})
    if odd:
        runs = ", ".join(sorted(t.name for t in GGUF_KINDS))
        return f"its {', '.join(odd)} weights have no kernel (kernels run {runs})"
    return None


class _Reader:
    """The tensors of one GGUF file, as packed weights and float vectors; what it returns is
    recorded in `packed` (for the cache, `packed_cache`). `precision`: "gguf" keeps the blocks
    the kernels run as stored; "bfloat16" and "float32" pack every weight matrix as floats."""

    def __init__(
        self, index: GGUFIndex, cfg: ModelConfig, kernels: ModuleType, precision: str = "gguf"
    ) -> None:
        self.tensors = {t.name: t for t in index.tensors}
        self.cfg = cfg
        self.kernels = kernels
        self.precision, self.float_kind = precision, FLOAT_KINDS[precision]
        self.permuted = index.value("general.architecture") == "llama"
        types = sorted({t.tensor_type.name for t in index.entries if len(t.shape) == 2})
        self.packed = PackedWeights(cfg, "+".join(types) if precision == "gguf" else "")

    def vector(self, name: str) -> torch.Tensor | None:
        """A float32 vector (norm weights as the file stores them), or None."""
        v = self._vector(name)
        self.packed.add_vector(name, v)
        return v

    def _vector(self, name: str) -> torch.Tensor | None:
        t = self.tensors.get(name)
        if t is None:
            return None
        v = dequantize(t.data, t.tensor_type, (int(t.shape[0]),), name=name)
        return self._unpermute(name, v)

    def linear(self, name: str) -> object:
        """The weight `name` [n, k] (and its bias, if any) as a kernels.Packed."""
        t = self.tensors.get(name)
        if t is None:
            raise ModelFormatError(f"the GGUF file of {self.cfg.name} has no tensor {name}")
        k, n = (int(d) for d in t.shape)
        bias = self._vector(name.removesuffix("weight") + "bias")
        if self.precision == "gguf" and t.tensor_type in GGUF_KINDS:
            raw = _raw_bytes(t.data).view(n, -1)  # [n, bytes per row]
            kind, data = pack_gguf(self._unpermute(name, raw), t.tensor_type, n, k)
        else:
            w = dequantize(t.data, t.tensor_type, (n, k), name=name)  # [n, k] float32
            kind = self.float_kind
            data = pack_float(self._unpermute(name, w), kind)
        self.packed.add_linear(name, int(kind), n, k, data, bias)
        return self.kernels.Packed(int(kind), n, k, data, bias)

    def _unpermute(self, name: str, rows: torch.Tensor) -> torch.Tensor:
        """Undo llama.cpp's Q/K row permutation (on raw block rows or on float rows)."""
        heads = {"attn_q": self.cfg.num_heads, "attn_k": self.cfg.num_kv_heads}
        kind = name.split(".")[2] if name.startswith("blk.") else ""
        if not (self.permuted and kind in heads):
            return rows
        n = rows.shape[0]
        shape = (heads[kind], n // heads[kind] // 2, 2, *rows.shape[1:])
        return rows.reshape(shape).transpose(1, 2).reshape(rows.shape).contiguous()


class _Stored:
    """A packed model read back from the cache, with `_Reader`'s interface."""

    def __init__(self, packed: PackedWeights, kernels: ModuleType) -> None:
        self.packed, self.cfg, self.kernels = packed, packed.cfg, kernels

    def vector(self, name: str) -> torch.Tensor | None:
        return self.packed.vector(name)

    def linear(self, name: str) -> object:
        return self.packed.linear(name, self.kernels)


def load_gguf_fast(
    path: Path,
    kernels: ModuleType,
    index: GGUFIndex | None = None,
    folder: Path | None = None,
    precision: str = "gguf",
) -> FastLM:
    """The model of a GGUF file on the kernels (`index`: its header, else read here), at the
    file's own precision ("gguf") or with its weights as "bfloat16" or "float32". With
    `folder`, the packed model is kept there (`packed_cache`) and read back from it by later
    loads, without reading the GGUF's tensors."""
    if precision not in FLOAT_KINDS:
        raise ValueError(f"precision must be one of {', '.join(FLOAT_KINDS)}, not {precision!r}")
    stored_at = packed_file(folder, path, kernels, precision) if folder is not None else None
    stored = PackedWeights.read(stored_at) if stored_at is not None else None
    if stored is not None:
        return _assemble(_Stored(stored, kernels), precision)
    index = index or load_index(path)
    why = unsupported(index) if precision == "gguf" else None
    if why:
        raise ModelFormatError(f"{path.name} cannot run at --dtype gguf: {why}")
    for t in index.entries:  # a block type no code here reads: named before any work
        check_supported(t.tensor_type, t.name)
    r = _Reader(index, config_from_gguf(index, path), kernels, precision)
    model = _assemble(r, precision)
    if stored_at is not None:
        r.packed.write(stored_at, path)
    return model


def is_packed(path: Path, kernels: ModuleType, folder: Path, precision: str = "gguf") -> bool:
    """Whether the GGUF at `path` is in the cache packed for these kernels at `precision`."""
    return packed_file(folder, path, kernels, precision).exists()


def _assemble(r: _Reader | _Stored, precision: str) -> FastLM:
    cfg = r.cfg
    layers = [_layer(r, i) for i in range(cfg.num_layers)]
    embedding = r.linear("token_embd.weight")
    head = embedding if cfg.tie_embeddings else r.linear("output.weight")
    return FastLM.from_layers(
        r.kernels,
        cfg,
        precision,
        embedding,
        [head],
        r.vector("output_norm.weight"),
        layers,
        r.packed.detail,
    )


def _layer(r: _Reader | _Stored, i: int) -> LayerWeights:
    b = f"blk.{i}."
    p = {name: r.linear(f"{b}{name}.weight") for name in _LINEARS}
    names = {  # ours: GGUF's (ffn_norm is the pre-MLP norm in both families)
        "attn_norm": "attn_norm",
        "mlp_norm": "ffn_norm",
        "post_attn_norm": "post_attention_norm",
        "post_mlp_norm": "post_ffw_norm",
        "q_norm": "attn_q_norm",
        "k_norm": "attn_k_norm",
    }
    norms = {own: r.vector(f"{b}{gg}.weight") for own, gg in names.items()}
    return LayerWeights(
        qkv=[p["attn_q"], p["attn_k"], p["attn_v"]],
        o=[p["attn_output"]],
        gate_up=[p["ffn_gate"], p["ffn_up"]],
        down=[p["ffn_down"]],
        norms={k: v for k, v in norms.items() if v is not None},
    )
