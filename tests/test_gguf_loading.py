"""GGUF loading: tiny GGUF files written here from random transformers models, as llama.cpp's
``convert_hf_to_gguf.py`` writes them, load into models whose logits match transformers'.

The conversion follows llama.cpp: tensor names from gguf's own ``TensorNameMap``; the Llama
architecture stores Q and K rows permuted (``permute(w, n_head, n_head_kv)``); Gemma 3 stores
norm weights as 1 + w; 1-D tensors stay F32 while matrices take the file's type; Llama 3 RoPE
scaling becomes a ``rope_freqs`` tensor of per-frequency divisors. For F16 and Q8_0 files the
transformers reference gets the same quantize → dequantize round trip (gguf-py's reference
implementation) applied to its matrices, so the comparison keeps the fp32 tolerance.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from specfork.errors import ModelFormatError
from specfork.loading.loader import load_decoder
from tiny_models import TINY, VOCAB, randomize

ATOL = 1e-4
SEQ = 40


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 4.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
    "rope_theta": 10000.0,
}


@dataclass(frozen=True)
class Case:
    arch: gguf.MODEL_ARCH
    config_cls: type[PretrainedConfig]
    model_cls: type[PreTrainedModel]
    qtype: Q
    overrides: dict = field(default_factory=dict)
    norm_center: float = 1.0
    vocab_as_tokens: bool = False  # no {arch}.vocab_size: the vocab is the token list's length

    def config(self) -> PretrainedConfig:
        return self.config_cls(**{**TINY, **self.overrides})


# What llama.cpp's GGUF format can express for Gemma 3: the local RoPE base 10000, one sliding
# layer pattern (5 sliding, 1 full) and a query scale of head_dim ** -0.5.
GEMMA = {
    "num_hidden_layers": 7,
    "head_dim": 32,
    "sliding_window": 8,
    "query_pre_attn_scalar": 32,
    "final_logit_softcapping": 5.0,
    "rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 20000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    },
    "tie_word_embeddings": True,
    "pad_token_id": 0,
}
LLAMA, QWEN2, QWEN3, GEMMA3 = (
    gguf.MODEL_ARCH.LLAMA,
    gguf.MODEL_ARCH.QWEN2,
    gguf.MODEL_ARCH.QWEN3,
    gguf.MODEL_ARCH.GEMMA3,
)

CASES: dict[str, Case] = {
    "llama-f32": Case(LLAMA, LlamaConfig, LlamaForCausalLM, Q.F32, vocab_as_tokens=True),
    "llama-f16": Case(LLAMA, LlamaConfig, LlamaForCausalLM, Q.F16),
    "llama-q8_0": Case(LLAMA, LlamaConfig, LlamaForCausalLM, Q.Q8_0),
    "llama-biases-f32": Case(LLAMA, LlamaConfig, LlamaForCausalLM, Q.F32, {"attention_bias": True}),
    "llama-rope-llama3-f32": Case(
        LLAMA, LlamaConfig, LlamaForCausalLM, Q.F32, {"rope_parameters": LLAMA3_ROPE}
    ),
    "smollm-tied-q8_0": Case(
        LLAMA, LlamaConfig, LlamaForCausalLM, Q.Q8_0, {"tie_word_embeddings": True}
    ),
    "qwen2-f32": Case(QWEN2, Qwen2Config, Qwen2ForCausalLM, Q.F32, {"rope_theta": 1000.0}),
    "qwen2-tied-q8_0": Case(
        QWEN2, Qwen2Config, Qwen2ForCausalLM, Q.Q8_0, {"tie_word_embeddings": True}
    ),
    "qwen3-f16": Case(QWEN3, Qwen3Config, Qwen3ForCausalLM, Q.F16, {"head_dim": 32}),
    "gemma3-f32": Case(GEMMA3, Gemma3TextConfig, Gemma3ForCausalLM, Q.F32, GEMMA, 0.0),
    "gemma3-q8_0": Case(GEMMA3, Gemma3TextConfig, Gemma3ForCausalLM, Q.Q8_0, GEMMA, 0.0),
}


pytestmark = pytest.mark.usefixtures("one_thread")


# -- a transformers model and its GGUF, as llama.cpp converts it ------------------------------


def permute(w: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: its RoPE rotates adjacent pairs, transformers' halves."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def llama3_rope_factors(params: dict, head_dim: int) -> np.ndarray:
    """LlamaModel.generate_extra_tensors: Llama 3 RoPE scaling as per-frequency divisors."""
    base, factor = params["rope_theta"], params["factor"]
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    old_len = params["original_max_position_embeddings"]
    freqs = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old_len / high:
            factors.append(1.0)
        elif wavelen > old_len / low:
            factors.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def stored_type(name: str, data: np.ndarray, qtype: Q) -> Q:
    """The type llama.cpp gives a tensor: 1-D tensors and norms stay F32."""
    if data.ndim <= 1 or name.endswith("_norm.weight"):
        return Q.F32
    return qtype


def round_trip(data: np.ndarray, qtype: Q) -> np.ndarray:
    """What a tensor of `qtype` decodes to, by gguf-py's reference implementation."""
    return gguf.quants.dequantize(gguf.quants.quantize(data, qtype), qtype).reshape(data.shape)


def write_gguf(case: Case, hf: PreTrainedModel, path: Path) -> None:
    cfg = hf.config
    arch_name = gguf.MODEL_ARCH_NAMES[case.arch]
    n_layers = cfg.num_hidden_layers
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    rope = cfg.rope_parameters
    if case.arch == GEMMA3:
        rope = rope["full_attention"]

    w = gguf.GGUFWriter(path, arch_name)
    w.add_name(f"tiny-{arch_name}")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(n_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(rope["rope_theta"])
    if rope.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    if case.arch == GEMMA3:
        w.add_sliding_window(cfg.sliding_window)
        if cfg.final_logit_softcapping:
            w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    if case.vocab_as_tokens:
        w.add_tokenizer_model("llama")
        w.add_token_list([f"<t{i}>" for i in range(cfg.vocab_size)])
    else:
        w.add_vocab_size(cfg.vocab_size)

    names = gguf.get_tensor_name_map(case.arch, n_layers)
    for hf_name, tensor in hf.state_dict().items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        new_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if new_name is None:
            continue  # buffers such as Gemma's embed_scale
        data = tensor.detach().float().numpy()
        if case.arch == LLAMA and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            data = permute(data, cfg.num_attention_heads, cfg.num_attention_heads)
        if case.arch == LLAMA and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
            data = permute(data, cfg.num_attention_heads, cfg.num_key_value_heads)
        if case.arch == GEMMA3 and hf_name.endswith("norm.weight"):
            data = data + 1.0
        qtype = stored_type(new_name, data, case.qtype)
        w.add_tensor(new_name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    if rope.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(rope, head_dim))

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def quantized_reference(case: Case, hf: PreTrainedModel) -> PreTrainedModel:
    """A copy of hf whose matrices went through the file type's round trip."""
    ref = copy.deepcopy(hf)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            data = p.detach().numpy()
            if stored_type(name, data, case.qtype) != Q.F32:
                p.copy_(torch.from_numpy(round_trip(data, case.qtype)))
    return ref.eval()


@dataclass
class Converted:
    hf: PreTrainedModel  # the reference: the same weights as the file holds
    path: Path


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory):
    made: dict[str, Converted] = {}

    def make(name: str) -> Converted:
        if name not in made:
            case = CASES[name]
            torch.manual_seed(0)
            hf = case.model_cls(case.config())
            randomize(hf, 0, case.norm_center)
            hf.config._attn_implementation = "eager"
            path = tmp_path_factory.mktemp("gguf") / f"{name}.gguf"
            write_gguf(case, hf.eval(), path)
            made[name] = Converted(quantized_reference(case, hf), path)
        return made[name]

    return make


def tokens_of(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def assert_close(ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    assert ours.shape == ref.shape, f"{what}: shape {tuple(ours.shape)} != {tuple(ref.shape)}"
    diff = (ours - ref).abs().max(dim=-1).values  # [T]
    assert float(diff.max()) <= ATOL, (
        f"{what}: max |Δlogit| {float(diff.max()):.3e} at position {int(diff.argmax())}"
    )


# -- parity -------------------------------------------------------------------------------------


def test_writer_follows_llama_cpp_layout(converted) -> None:
    """The file holds what llama.cpp would write: permuted Q/K, shifted Gemma norms, F32
    vectors, Q8_0 matrices, rope_freqs (guards the test's converter against drifting)."""
    reader = gguf.GGUFReader(converted("llama-q8_0").path)
    by_name = {t.name: t for t in reader.tensors}
    assert by_name["blk.0.attn_q.weight"].tensor_type == Q.Q8_0
    assert by_name["token_embd.weight"].tensor_type == Q.Q8_0
    assert by_name["blk.0.attn_norm.weight"].tensor_type == Q.F32
    assert "output.weight" in by_name

    conv = converted("llama-f32")
    reader = gguf.GGUFReader(conv.path)
    q = np.array(next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight").data)
    hf_q = conv.hf.model.layers[0].self_attn.q_proj.weight.detach().numpy()
    assert not np.array_equal(q, hf_q)  # the rows are permuted...
    np.testing.assert_array_equal(q, permute(hf_q, 4, 4))  # ...as llama.cpp does it
    assert reader.fields.get("llama.vocab_size") is None

    reader = gguf.GGUFReader(converted("gemma3-f32").path)
    norm = next(t for t in reader.tensors if t.name == "blk.0.attn_norm.weight")
    hf_norm = converted("gemma3-f32").hf.model.layers[0].input_layernorm.weight.detach().numpy()
    np.testing.assert_allclose(np.array(norm.data), hf_norm + 1.0)
    assert "output.weight" not in {t.name for t in reader.tensors}

    reader = gguf.GGUFReader(converted("llama-rope-llama3-f32").path)
    freqs = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
    factors = np.array(freqs.data).tolist()
    assert max(factors) == LLAMA3_ROPE["factor"] and 1.0 < min(factors) < max(factors)


@pytest.mark.parametrize("name", list(CASES))
def test_gguf_logits_match_transformers(converted, name: str) -> None:
    conv = converted(name)
    model = load_decoder(conv.path, dtype=torch.float32, device="cpu")
    cfg, hf_cfg = model.config, conv.hf.config
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == (
        hf_cfg.num_hidden_layers,
        hf_cfg.num_attention_heads,
        hf_cfg.num_key_value_heads,
    )
    assert cfg.vocab_size == VOCAB
    assert cfg.tie_embeddings == bool(hf_cfg.tie_word_embeddings)
    seq = tokens_of(SEQ, 1)
    with torch.no_grad():
        ref = conv.hf(input_ids=seq[None]).logits[0].float()
        cache_ = model.new_cache(64)
        prefill = model.logits(model(seq[None, :30], torch.arange(30), cache_))[0]
        steps = [
            model.logits(model(seq[None, i : i + 1], torch.tensor([i]), cache_))[0]
            for i in range(30, SEQ)
        ]
    assert ref.std() > 0.3
    assert_close(torch.cat([prefill, *steps]), ref, f"{name} (prefill + steps)")


@pytest.mark.parametrize("name", ["llama-q8_0", "gemma3-q8_0"])
def test_quantization_is_visible(converted, name: str) -> None:
    """The Q8_0 round trip changes the logits far beyond the tolerance, so the tight match above
    proves the loader decodes exactly the stored blocks (not, say, the original weights)."""
    conv = converted(name)
    case = CASES[name]
    torch.manual_seed(0)
    exact = case.model_cls(case.config())
    randomize(exact, 0, case.norm_center)
    exact.config._attn_implementation = "eager"
    seq = tokens_of(SEQ, 1)
    with torch.no_grad():
        a = exact.eval()(input_ids=seq[None]).logits[0]
        b = conv.hf(input_ids=seq[None]).logits[0]
    assert (a - b).abs().max() > 100 * ATOL


# -- files that are not supported ---------------------------------------------------------------


def test_unsupported_architecture_is_named(tmp_path: Path) -> None:
    path = tmp_path / "phi.gguf"
    w = gguf.GGUFWriter(path, "phi3")
    w.add_block_count(1)
    w.add_embedding_length(64)
    w.add_head_count(4)
    w.add_tensor("token_embd.weight", np.zeros((8, 64), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelFormatError, match="phi3"):
        load_decoder(path, dtype=torch.float32, device="cpu")


@pytest.mark.parametrize(
    "content",
    [b"", b"this is not a GGUF file\n" * 20, b"GGUF" + bytes(3)],
    ids=["empty", "text", "truncated-header"],
)
def test_non_gguf_file(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    with pytest.raises(ModelFormatError):
        load_decoder(path, dtype=torch.float32, device="cpu")


def test_truncated_gguf(converted, tmp_path: Path) -> None:
    data = converted("llama-f32").path.read_bytes()
    path = tmp_path / "cut.gguf"
    for cut in (len(data) // 2, 64):  # in the tensors; in the header's key-value pairs
        path.write_bytes(data[:cut])
        with pytest.raises(ModelFormatError, match="GGUF file: it ends before the data its header"):
            load_decoder(path, dtype=torch.float32, device="cpu")


def test_transformers_baseline_loads_without_progress_bars(
    converted, capfd: pytest.CaptureFixture[str]
) -> None:
    """The bench's transformers baseline loads a GGUF without tqdm bars on stderr, which
    flood a log file or a CI log with carriage-return lines."""
    from specfork.bench.hf import load_hf_model

    model = load_hf_model(converted("llama-q8_0").path, torch.float32)
    assert model is not None
    err = capfd.readouterr().err
    assert "\r" not in err and "it/s" not in err
