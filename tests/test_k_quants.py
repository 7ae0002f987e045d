"""GGUF files with K-quant and Q5_0 weights (what hub Q4_K_M files hold) on the kernels at
their own precision: a tiny Llama written here with random blocks of every type a Q4_K_M or
Gemma 3 file mixes, loaded as stored, against the same file dequantized to float32."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from specfork.kernels import load_kernels
from specfork.loading.fast import load_gguf_fast, unsupported
from specfork.loading.gguf_index import load_index
from tiny_models import K_QUANT_F16, k_quant_blocks

K = load_kernels()
pytestmark = pytest.mark.skipif(K is None, reason="the kernels cannot be built here")

HIDDEN, FFN, HEADS, KV_HEADS, LAYERS, VOCAB = 256, 512, 4, 2, 2, 96
HEAD_DIM = HIDDEN // HEADS
#: each matrix's block type: Q4_K_M's mix (Q4_K, Q6_K for attn_v / ffn_down / output) with
#: Gemma 3's Q5_0 and Q8_0 beside them
TYPES = {
    "token_embd": Q.Q8_0,
    "output": Q.Q6_K,
    "attn_q": Q.Q4_K,
    "attn_k": Q.Q5_0,
    "attn_v": Q.Q6_K,
    "attn_output": Q.Q4_K,
    "ffn_gate": Q.Q4_K,
    "ffn_up": Q.Q5_0,
    "ffn_down": Q.Q6_K,
}


def _blocks(qtype: Q, n: int, k: int, seed: int) -> np.ndarray:
    if qtype in K_QUANT_F16:
        return k_quant_blocks(qtype, n, k, seed, scale=(2e-4, 2e-3))
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.05
    return gguf.quants.quantize(w, qtype)


def _shapes() -> dict[str, tuple[int, int]]:
    """GGUF tensor name → [n, k] of every matrix."""
    per_layer = {
        "attn_q": (HIDDEN, HIDDEN),
        "attn_k": (KV_HEADS * HEAD_DIM, HIDDEN),
        "attn_v": (KV_HEADS * HEAD_DIM, HIDDEN),
        "attn_output": (HIDDEN, HIDDEN),
        "ffn_gate": (FFN, HIDDEN),
        "ffn_up": (FFN, HIDDEN),
        "ffn_down": (HIDDEN, FFN),
    }
    out = {"token_embd.weight": (VOCAB, HIDDEN), "output.weight": (VOCAB, HIDDEN)}
    for i in range(LAYERS):
        out |= {f"blk.{i}.{name}.weight": shape for name, shape in per_layer.items()}
    return out


@pytest.fixture(scope="module")
def k_quant_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("k-quants") / "tiny-Q4_K_M.gguf"
    w = gguf.GGUFWriter(path, "llama")
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(VOCAB)
    for seed, (name, (n, k)) in enumerate(_shapes().items()):
        qtype = TYPES[name.split(".")[-2]]
        w.add_tensor(name, _blocks(qtype, n, k, seed), raw_dtype=qtype)
    ones = np.ones(HIDDEN, dtype=np.float32)
    w.add_tensor("output_norm.weight", ones)
    for i in range(LAYERS):
        w.add_tensor(f"blk.{i}.attn_norm.weight", ones)
        w.add_tensor(f"blk.{i}.ffn_norm.weight", ones)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_a_q4_k_m_file_runs_as_stored(k_quant_file: Path) -> None:
    """No block type of the file falls back to floats: it runs at precision "gguf"."""
    index = load_index(k_quant_file)
    assert {t.tensor_type for t in index.entries} >= {Q.Q4_K, Q.Q6_K, Q.Q5_0, Q.Q8_0}
    assert unsupported(index) is None
    model = load_gguf_fast(k_quant_file, K, precision="gguf")
    assert model.precision == "gguf"


def test_k_quant_logits_match_the_dequantized_file(k_quant_file: Path) -> None:
    """The packed blocks compute what the file's dequantized float32 weights compute, up to
    the int8 activations every GGUF precision uses (llama.cpp's arithmetic)."""
    ids = torch.randint(0, VOCAB, (24,), generator=torch.Generator().manual_seed(0)).tolist()
    logits = {}
    for precision in ("gguf", "float32"):
        model = load_gguf_fast(k_quant_file, K, precision=precision)
        with torch.inference_mode():
            logits[precision] = model.extend(ids, model.new_cache(32), last_only=False)
    ref, got = logits["float32"], logits["gguf"]
    assert ref.std() > 0.1
    err = float((got - ref).norm() / ref.norm())
    assert err < 0.05, f"relative error {err:.3e}"  # 0.028 here; a swapped scale gives > 1
    assert not torch.equal(got, ref)  # int8 activations: not the float path


def test_k_quant_rows_are_batch_invariant(k_quant_file: Path) -> None:
    """Eight one-token steps and one eight-row forward give bitwise the same logits."""
    model = load_gguf_fast(k_quant_file, K, precision="gguf")
    prompt, chain = list(range(3, 15)), list(range(40, 48))
    cache = model.new_cache(32)
    with torch.inference_mode():
        model.extend(prompt, cache)
        steps = torch.stack([model.extend([t], cache) for t in chain])
        cache.truncate(len(prompt))
        block = model.extend(chain, cache, last_only=False)
    assert torch.equal(steps, block)
