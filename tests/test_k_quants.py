"""GGUF files with K-quant and Q5_0 weights (what hub Q4_K_M files hold) on the kernels at
their own precision: a tiny Llama written here with random blocks of every type a Q4_K_M or
Gemma 3 file mixes, loaded as stored, against the same file dequantized to float32."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from specfork.bench.random_gguf import MIXES, LlamaShape, block_type, write_random_llama
from specfork.kernels import load_kernels
from specfork.loading.fast import load_gguf_fast, unsupported
from specfork.loading.gguf_index import load_index

K = load_kernels()
pytestmark = pytest.mark.skipif(K is None, reason="the kernels cannot be built here")

SHAPE = LlamaShape("tiny", hidden=256, ffn=512, layers=2, heads=4, kv_heads=2, vocab=96)
#: Q4_K_M's mix (Q4_K, Q6_K for attn_v / ffn_down / output) with Gemma 3's Q5_0 and Q8_0 and
#: Q5_K_M's Q5_K (and Q5_1) beside them: every block type the kernels run as stored
MIX = {
    **MIXES["Q4_K_M"],
    "token_embd": Q.Q8_0,
    "attn_k": Q.Q5_0,
    "ffn_up": Q.Q5_0,
    "attn_output": Q.Q5_K,
    "ffn_gate": Q.Q5_1,
}


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def k_quant_file(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Path:
    """The tiny file as each Llama-layout architecture (Qwen2 with q/k/v biases, Qwen3 with
    q/k norms)."""
    folder = tmp_path_factory.mktemp("k-quants")
    return write_random_llama(folder / f"tiny-{request.param}.gguf", SHAPE, MIX, arch=request.param)


def test_the_mix_names_each_matrix_kind() -> None:
    assert block_type(MIX, "blk.3.attn_v.weight") == Q.Q6_K
    assert block_type(MIX, "blk.0.attn_q.weight") == Q.Q4_K
    assert block_type(MIX, "token_embd.weight") == Q.Q8_0
    assert SHAPE.parameters() == 2 * 96 * 256 + 2 * (2 * 256 * 256 + 2 * 128 * 256 + 3 * 512 * 256)


def test_a_q4_k_m_file_runs_as_stored(k_quant_file: Path) -> None:
    """No block type of the file falls back to floats: it runs at precision "gguf"."""
    index = load_index(k_quant_file)
    kinds = {Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q5_0, Q.Q5_1, Q.Q8_0}
    assert {t.tensor_type for t in index.entries} >= kinds
    assert unsupported(index) is None
    model = load_gguf_fast(k_quant_file, K, precision="gguf")
    assert model.precision == "gguf"
    arch = k_quant_file.stem.removeprefix("tiny-")
    assert (model.config.qkv_bias, model.config.qk_norm) == (arch == "qwen2", arch == "qwen3")


def test_k_quant_logits_match_the_dequantized_file(k_quant_file: Path) -> None:
    """The packed blocks compute what the file's dequantized float32 weights compute, up to
    the int8 activations every GGUF precision uses (llama.cpp's arithmetic)."""
    ids = torch.randint(0, SHAPE.vocab, (24,), generator=torch.Generator().manual_seed(0)).tolist()
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
