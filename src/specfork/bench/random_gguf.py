"""Random-weight Llama GGUF files of real shapes, in the block mixes hub files use.

For timing bigger targets than the packaged models (`benchmarks/big_targets.py`) and for tests
of block types gguf-py cannot quantize (the K-quants): every matrix is random blocks of its
type, with the fp16 super-block scales drawn small and finite so that a forward stays finite.
The file carries a placeholder vocabulary (`<t0>`, `<t1>`, ...) so that llama.cpp loads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

#: each block type's fp16 scale fields (byte offsets in a block, ggml-common.h)
F16_FIELDS = {
    Q.Q4_0: (0,),
    Q.Q4_1: (0, 2),
    Q.Q5_0: (0,),
    Q.Q5_1: (0, 2),
    Q.Q8_0: (0,),
    Q.Q2_K: (80, 82),
    Q.Q3_K: (108,),
    Q.Q4_K: (0, 2),
    Q.Q5_K: (0, 2),
    Q.Q6_K: (208,),
}
#: the fp16 scales each type draws: a weight of about 0.01-0.1 for every type
SCALES = {Q.Q6_K: (2e-5, 2e-4), Q.Q8_0: (2e-4, 1e-3)}
DEFAULT_SCALE = (1e-4, 1e-3)


def random_blocks(
    qtype: Q, n: int, k: int, rng: np.random.Generator, scale: tuple[float, float] | None = None
) -> np.ndarray:
    """Random blocks of a weight [n, k] of `qtype` as a GGUF stores them: [n, bytes per row]
    (random codes, sub-block scales and mins; fp16 scales uniform in `scale`)."""
    block, size = GGML_QUANT_SIZES[qtype]
    if qtype not in F16_FIELDS:
        raise ValueError(f"no random blocks for {qtype.name}")
    if k % block:
        raise ValueError(f"{qtype.name} needs rows of a multiple of {block} values, not {k}")
    low, high = scale or SCALES.get(qtype, DEFAULT_SCALE)
    blocks = rng.integers(0, 256, size=(n, k // block, size), dtype=np.uint8)
    for at in F16_FIELDS[qtype]:
        d = rng.uniform(low, high, size=(n, k // block)).astype(np.float16)
        blocks[..., at : at + 2] = d.view(np.uint8).reshape(n, k // block, 2)
    return blocks.reshape(n, -1)


@dataclass(frozen=True)
class LlamaShape:
    """A Llama layout: hidden size, FFN size, layers, heads, KV heads, vocabulary."""

    name: str
    hidden: int
    ffn: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def matrices(self) -> dict[str, tuple[int, int]]:
        """GGUF tensor name → [n, k] of every matrix."""
        kv = self.kv_heads * self.head_dim
        per_layer = {
            "attn_q": (self.hidden, self.hidden),
            "attn_k": (kv, self.hidden),
            "attn_v": (kv, self.hidden),
            "attn_output": (self.hidden, self.hidden),
            "ffn_gate": (self.ffn, self.hidden),
            "ffn_up": (self.ffn, self.hidden),
            "ffn_down": (self.hidden, self.ffn),
        }
        out = {"token_embd.weight": (self.vocab, self.hidden)}
        for i in range(self.layers):
            out |= {f"blk.{i}.{part}.weight": shape for part, shape in per_layer.items()}
        return out | {"output.weight": (self.vocab, self.hidden)}

    def parameters(self) -> int:
        return sum(n * k for n, k in self.matrices().values())


#: TinyLlama-1.1B's layout and Llama-3.2-3B's; SmolLM2-135M's with the 1.1B's vocabulary (the
#: small draft model of the same tokenizer)
SHAPES = {
    "135m": LlamaShape("llama-135m-draft", 576, 1536, 30, 9, 3, 32000),
    "1b": LlamaShape("llama-1.1b", 2048, 5632, 22, 32, 4, 32000),
    "3b": LlamaShape("llama-3.2-3b", 3072, 8192, 28, 24, 8, 128256),
}

#: block type of each matrix kind in a mix: Q4_K_M (llama.cpp gives attn_v, ffn_down and the
#: output Q6_K; here all of them, a little heavier than its alternating layers) and Q8_0
MIXES = {
    "Q4_K_M": {"attn_v": Q.Q6_K, "ffn_down": Q.Q6_K, "output": Q.Q6_K, "*": Q.Q4_K},
    "Q8_0": {"*": Q.Q8_0},
}


def block_type(mix: dict[str, Q], tensor: str) -> Q:
    """The type `mix` gives tensor `tensor` ("blk.3.attn_v.weight" → its "attn_v" entry)."""
    part = tensor.removesuffix(".weight").split(".")[-1]
    return mix.get(part, mix["*"])


#: the Llama-layout architectures a file can name, and what each adds to the Llama tensors
ARCH_EXTRAS = {
    "llama": (),
    "qwen2": ("attn_q.bias", "attn_k.bias", "attn_v.bias"),
    "qwen3": ("attn_q_norm.weight", "attn_k_norm.weight"),
}


def _extra_vector(shape: LlamaShape, extra: str, rng: np.random.Generator) -> np.ndarray:
    """An architecture's extra vector: a bias (small random) or a q/k norm (ones)."""
    if extra.endswith("norm.weight"):
        return np.ones(shape.head_dim, dtype=np.float32)
    size = shape.hidden if extra.startswith("attn_q") else shape.kv_heads * shape.head_dim
    return (rng.standard_normal(size) * 0.01).astype(np.float32)


def write_random_llama(
    path: Path, shape: LlamaShape, mix: str | dict[str, Q], seed: int = 0, arch: str = "llama"
) -> Path:
    """A random-weight GGUF of `shape` with the block types of `mix` (a MIXES name, or matrix
    kind → type with a "*" default), as architecture `arch` (ARCH_EXTRAS: Qwen2's q/k/v biases,
    Qwen3's q/k norms)."""
    if arch not in ARCH_EXTRAS:
        raise ValueError(f"unknown architecture {arch!r}; use one of {', '.join(ARCH_EXTRAS)}")
    if isinstance(mix, str) and mix not in MIXES:
        raise ValueError(f"unknown mix {mix!r}; use one of {', '.join(MIXES)}")
    types = MIXES[mix] if isinstance(mix, str) else mix
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(path, arch)
    w.add_name(f"random-{shape.name}")
    w.add_context_length(8192)
    w.add_embedding_length(shape.hidden)
    w.add_block_count(shape.layers)
    w.add_feed_forward_length(shape.ffn)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(shape.vocab)
    w.add_tokenizer_model("llama")
    w.add_token_list([f"<t{i}>" for i in range(shape.vocab)])
    w.add_token_scores([0.0] * shape.vocab)
    w.add_token_types([1] * shape.vocab)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    for name, (n, k) in shape.matrices().items():
        qtype = block_type(types, name)
        w.add_tensor(name, random_blocks(qtype, n, k, rng), raw_dtype=qtype)
    ones = np.ones(shape.hidden, dtype=np.float32)
    w.add_tensor("output_norm.weight", ones)
    for i in range(shape.layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", ones)
        w.add_tensor(f"blk.{i}.ffn_norm.weight", ones)
        for extra in ARCH_EXTRAS[arch]:
            w.add_tensor(f"blk.{i}.{extra}", _extra_vector(shape, extra, rng))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
