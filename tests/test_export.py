"""`export-model` and `export-head`: the exported folders compute what specfork computes.

Models: tiny random transformers checkpoints (Llama and Gemma 3, with a tokenizer) and tiny
GGUFs written as llama.cpp writes them (permuted Q/K, shifted Gemma norms, Llama 3 RoPE as
per-frequency divisors) are exported; transformers loads the export and its logits equal
specfork's float32 logits of the source, and its tokenizer encodes and renders the chat
template as specfork's does. Heads: a reference EAGLE-3 step written here from the exported
tensors only (vLLM's `llama_eagle3` math in plain torch) gives the logits specfork's
`DraftHead` gives.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
)

from cli_run import run_cli
from specfork.config import ModelConfig
from specfork.errors import ConfigError
from specfork.heads.model import DraftHead, HeadConfig, save_head
from specfork.loading.loader import load_eager, load_model
from specfork.models import DecoderLM
from specfork.tools.export_eagle3 import HeadExport, export_head
from specfork.tools.export_model import (
    ModelExport,
    export_model,
    hf_config,
    hf_state_dict,
    write_json,
    write_weights,
)
from test_gguf_loading import converted  # noqa: F401  (the fixture: tiny llama.cpp-style GGUFs)
from test_tokenizer import CHATML_TEMPLATE, _byte_level_backend
from tiny_models import TINY, randomize

ATOL = 1e-4
TOKENIZER_VOCAB = 448  # the byte-level test tokenizer's ids fit below this
GEMMA = {
    "num_hidden_layers": 7,
    "head_dim": 32,
    "sliding_window": 8,
    "query_pre_attn_scalar": 24,
    "final_logit_softcapping": 5.0,
    "rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 20000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    },
    "tie_word_embeddings": True,
}
PROMPTS = ["Hello world, this is a test.", "  tabs\tand\nnew lines é 中 🤖", ""]
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3 + 3?"},
]

pytestmark = pytest.mark.usefixtures("one_thread")


# -- tiny checkpoint folders with a tokenizer ---------------------------------------------------


def _folder(tmp: Path, name: str) -> Path:
    """A tiny random transformers checkpoint with a ChatML byte-level tokenizer."""
    torch.manual_seed(0)
    if name == "llama":
        cfg = LlamaConfig(**{**TINY, "vocab_size": TOKENIZER_VOCAB, "attention_bias": True})
        model, center = LlamaForCausalLM(cfg), 1.0
    else:
        cfg = Gemma3TextConfig(**{**TINY, "vocab_size": TOKENIZER_VOCAB, **GEMMA})
        model, center = Gemma3ForCausalLM(cfg), 0.0
    randomize(model, 0, center)
    folder = tmp / name
    model.save_pretrained(folder)
    backend = _byte_level_backend()
    backend.save(str(folder / "tokenizer.json"))
    tok_cfg = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": CHATML_TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("sources")
    return {name: _folder(tmp, name) for name in ("llama", "gemma3")}


def _specfork_logits(model: DecoderLM, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        cache = model.new_cache(len(ids) + 1)
        return model.logits(model(torch.tensor([ids]), torch.arange(len(ids)), cache))[0]


def _hf_logits(folder: Path, ids: list[int]) -> torch.Tensor:
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(input_ids=torch.tensor([ids])).logits[0].float()


def _assert_close(ours: torch.Tensor, ref: torch.Tensor, what: str, atol: float = ATOL) -> None:
    assert ours.shape == ref.shape, what
    assert ref.std() > 0.3, f"{what}: degenerate logits"
    diff = float((ours - ref).abs().max())
    assert diff <= atol, f"{what}: max |Δlogit| {diff:.2e}"


# -- export-model -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_exported_folder_matches_specfork(folders, tmp_path: Path, name: str) -> None:
    out = export_model(ModelExport(str(folders[name]), tmp_path / "out"))
    expected = {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
        "special_tokens_map.json",
    }
    assert expected <= {p.name for p in out.iterdir()}
    config = json.loads((out / "config.json").read_text())
    arch = "LlamaForCausalLM" if name == "llama" else "Gemma3ForCausalLM"
    assert config["architectures"] == [arch] and config["torch_dtype"] == "float32"

    source = load_model(str(folders[name]), dtype="float32", device="cpu", kernels=False)
    ids = torch.randint(0, TOKENIZER_VOCAB, (24,), generator=torch.Generator().manual_seed(3))
    ours = _specfork_logits(source.model, ids.tolist())
    _assert_close(ours, _hf_logits(out, ids.tolist()), f"{name} export")

    hf_tok = AutoTokenizer.from_pretrained(out)
    for text in PROMPTS:
        assert hf_tok(text)["input_ids"] == source.tokenizer.encode(text), text
    rendered = source.tokenizer.apply_chat_template(MESSAGES)
    assert hf_tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True) == (
        rendered
    )
    generation = json.loads((out / "generation_config.json").read_text())
    eos = generation["eos_token_id"]
    assert set(eos if isinstance(eos, list) else [eos]) == set(source.tokenizer.eos_ids)


@pytest.mark.parametrize("case", ["llama-q8_0", "llama-rope-llama3-f32", "gemma3-q8_0"])
def test_gguf_weights_export_to_transformers(converted, tmp_path: Path, case: str) -> None:  # noqa: F811
    """A GGUF's weights (Q/K un-permuted, Gemma norms shifted back, Llama 3 RoPE divisors
    turned back into transformers' parameters) load into transformers with specfork's logits."""
    path = converted(case).path
    model = load_eager(path, torch.float32, torch.device("cpu"), relayout=False)
    write_weights(hf_state_dict(model), tmp_path / "model.safetensors", torch.float32)
    write_json(tmp_path / "config.json", hf_config(model.config, None, "float32"))
    ids = torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    _assert_close(_specfork_logits(model, ids), _hf_logits(tmp_path, ids), case)
    if case == "llama-rope-llama3-f32":
        rope = json.loads((tmp_path / "config.json").read_text())["rope_parameters"]
        assert rope["rope_type"] == "llama3" and rope["original_max_position_embeddings"] == 16


def test_hf_names_invert_the_loaders_names(folders) -> None:
    model = load_eager(folders["llama"], torch.float32, torch.device("cpu"), relayout=False)
    back = model.from_hf_names(hf_state_dict(model))
    own = model.state_dict()
    assert set(back) == set(own) - {"lm_head.weight"} | ({"lm_head.weight"} & set(back))
    for name, value in back.items():
        assert torch.equal(value, own[name]), name


@pytest.mark.parametrize("command", ["export-model", "train-head"])
def test_an_out_folder_that_cannot_be_written_is_refused_first(
    folders, tmp_path: Path, capsys, command: str
) -> None:
    """A file in the way, or a path that cannot be created: one line naming --out, before any
    model is loaded (train-head would otherwise make data for minutes first)."""
    (tmp_path / "a-file").write_text("x")
    for out, words in ((tmp_path / "a-file", "is a file"), (Path("/proc/specfork-x"), "cannot")):
        argv = [command, "-m", str(folders["llama"]), "--out", str(out)]
        code, _, err = run_cli(capsys, argv)
        assert code == 2 and f"--out {out}" in err and words in err, err
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_bfloat16_export_halves_the_weights(folders, tmp_path: Path) -> None:
    out = export_model(ModelExport(str(folders["llama"]), tmp_path / "bf16", dtype="bfloat16"))
    weights = load_file(str(out / "model.safetensors"))
    assert {w.dtype for w in weights.values()} == {torch.bfloat16}
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_export_model_refuses_a_non_empty_out(folders, tmp_path: Path, capsys) -> None:
    (tmp_path / "keep.txt").write_text("mine")
    code, _, err = run_cli(
        capsys, ["export-model", "-m", str(folders["llama"]), "--out", str(tmp_path)]
    )
    assert code == 2 and "not empty" in err and "--force" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    code, _, err = run_cli(
        capsys, ["export-model", "-m", str(folders["llama"]), "--out", str(tmp_path), "--force"]
    )
    assert code == 0 and (tmp_path / "model.safetensors").is_file()
    assert (tmp_path / "keep.txt").read_text() == "mine"
    with pytest.raises(ConfigError, match="dtype"):
        ModelExport("x", tmp_path, dtype="float16")


# -- export-head --------------------------------------------------------------------------------

TARGET = ModelConfig(
    arch="llama",
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_layers=5,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    rms_eps=1e-6,
)
LAYERS = (3, 0, 2)  # deliberately not ascending: vLLM concatenates its aux states in layer order


def _random_head(draft_vocab: int = 40, seed: int = 0) -> DraftHead:
    gen = torch.Generator().manual_seed(seed)
    d2t = torch.randperm(TARGET.vocab_size, generator=gen)[:draft_vocab].sort().values
    head = DraftHead(HeadConfig.for_target(TARGET, draft_vocab, LAYERS), d2t)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
    return head.eval()


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _neox_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """vLLM's `get_rope(..., is_neox_style=True)` (Llama's): rotate the two halves. x [T, H, d]"""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)  # [d/2]
    ang = positions.float()[:, None] * inv[None]  # [T, d/2]
    cos, sin = ang.cos()[:, None], ang.sin()[:, None]  # [T, 1, d/2]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def eagle3_reference(
    folder: Path, embed: torch.Tensor, aux: dict[int, torch.Tensor], positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's llama_eagle3 step from the exported files only: target-vocabulary logits [T, V]
    (-inf off the draft vocabulary) and the pre-norm output [T, D] fed to the next step.

    `embed` [T, D] are the target's embeddings of the tokens; `aux` the target's auxiliary
    hidden states [T, D] by vLLM layer id.
    """
    cfg = json.loads((folder / "config.json").read_text())
    w = load_file(str(folder / "model.safetensors"))
    eps, hd = cfg["rms_norm_eps"], cfg["head_dim"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    ids = cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    hidden = torch.cat([aux[i] for i in sorted(ids)], dim=-1) @ w["fc.weight"].T  # [T, D]
    m = "midlayer."
    residual = hidden  # norm_before_residual: false
    x = torch.cat(
        (
            _rms(embed, w[m + "input_layernorm.weight"], eps),
            _rms(hidden, w[m + "hidden_norm.weight"], eps),
        ),
        dim=-1,
    )
    t = x.shape[0]
    q = (x @ w[m + "self_attn.q_proj.weight"].T).view(t, nh, hd)
    k = (x @ w[m + "self_attn.k_proj.weight"].T).view(t, nkv, hd)
    v = (x @ w[m + "self_attn.v_proj.weight"].T).view(t, nkv, hd)
    theta = cfg["rope_theta"] if "rope_theta" in cfg else cfg["rope_parameters"]["rope_theta"]
    q, k = _neox_rope(q, positions, theta), _neox_rope(k, positions, theta)
    k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
    scores = torch.einsum("thd,shd->hts", q, k) * hd**-0.5  # [H, T, T]
    scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
    attn = torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(t, nh * hd)
    residual = residual + attn @ w[m + "self_attn.o_proj.weight"].T
    h = _rms(residual, w[m + "post_attention_layernorm.weight"], eps)
    mlp = F.silu(h @ w[m + "mlp.gate_proj.weight"].T) * (h @ w[m + "mlp.up_proj.weight"].T)
    prenorm = residual + mlp @ w[m + "mlp.down_proj.weight"].T  # [T, D]
    logits = _rms(prenorm, w["norm.weight"], eps) @ w["lm_head.weight"].T  # [T, Vd]
    targets = torch.arange(cfg["draft_vocab_size"]) + w["d2t"]  # d2t holds offsets
    full = logits.new_full((t, cfg["vocab_size"]), float("-inf"))
    full[:, targets] = logits
    return full, prenorm


def _specfork_step(
    head: DraftHead, embed: torch.Tensor, feats: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The head's own step (as its drafter runs it): target-vocabulary logits [T, V] and g."""
    with torch.no_grad():
        f = head.fuse(feats)[None]  # [1, T, D]
        q, k, v = head.project(embed[None], f, positions)
        mask = torch.ones(len(positions), len(positions), dtype=torch.bool).tril()
        g = head.finish(f, head.attend(q, k, v, mask))[0]  # [T, D]
        logits = head.logits(g)  # [T, Vd]
    full = logits.new_full((len(positions), head.config.target_vocab), float("-inf"))
    full[:, head.d2t] = logits
    return full, g


def test_eagle3_export_computes_the_heads_logits(tmp_path: Path) -> None:
    head = _random_head()
    save_head(head, tmp_path / "head")
    out = export_head(HeadExport(tmp_path / "head", tmp_path / "eagle3"))
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]  # blocks + 1
    assert cfg["draft_vocab_size"] == 40 and cfg["vocab_size"] == TARGET.vocab_size
    tensors = load_file(str(out / "model.safetensors"))
    assert not any("embed_tokens" in name for name in tensors)  # vLLM shares the target's
    assert tensors["t2d"].dtype == torch.bool and int(tensors["t2d"].sum()) == 40
    assert torch.equal(tensors["t2d"].nonzero()[:, 0], head.d2t)

    gen = torch.Generator().manual_seed(7)
    t, d = 9, TARGET.hidden_size
    embed = torch.randn(t, d, generator=gen)
    blocks = {b: torch.randn(t, d, generator=gen) for b in LAYERS}  # block outputs
    feats = torch.cat([blocks[b] for b in LAYERS], dim=-1)  # specfork's order
    positions = torch.arange(5, 5 + t)
    ref, ref_g = eagle3_reference(out, embed, {b + 1: x for b, x in blocks.items()}, positions)
    ours, g = _specfork_step(head, embed, feats, positions)
    assert torch.equal(ref.isinf(), ours.isinf())
    finite = ~ref.isinf()
    assert float((ref[finite] - ours[finite]).abs().max()) < 1e-4
    assert float((ref_g - g).abs().max()) < 1e-4
    assert ours[finite].std() > 0.3


def test_head_export_refuses_foreign_corrupt_and_gemma_heads(folders, tmp_path, capsys) -> None:
    head = _random_head()
    save_head(head, tmp_path / "head")
    argv = ["export-head", str(tmp_path / "head"), "-m", str(folders["llama"])]
    code, _, err = run_cli(capsys, [*argv, "--out", str(tmp_path / "o1")])
    assert code == 2 and "trained for" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "o1").exists()

    bad = tmp_path / "corrupt"
    bad.mkdir()
    (bad / "head.json").write_text((tmp_path / "head" / "head.json").read_text())
    (bad / "head.safetensors").write_bytes(b"not safetensors")
    code, _, err = run_cli(capsys, ["export-head", str(bad), "--out", str(tmp_path / "o2")])
    assert code == 2 and "corrupt" in err
    code, _, err = run_cli(capsys, ["export-head", str(tmp_path), "--out", str(tmp_path / "o3")])
    assert code == 2 and "not a draft head" in err
    (bad / "head.json").write_text("{not json")
    code, _, err = run_cli(capsys, ["export-head", str(bad), "--out", str(tmp_path / "o4")])
    assert code == 2 and "invalid" in err

    gemma = DraftHead(HeadConfig.for_target(replace(TARGET, arch="gemma3"), 40, LAYERS))
    save_head(gemma, tmp_path / "gemma")
    code, _, err = run_cli(
        capsys, ["export-head", str(tmp_path / "gemma"), "--out", str(tmp_path / "o5")]
    )
    assert code == 2 and "Llama-family" in err

    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    code, _, err = run_cli(
        capsys, ["export-head", str(tmp_path / "head"), "--out", str(tmp_path / "full")]
    )
    assert code == 2 and "not empty" in err


def test_head_export_checks_the_target_it_was_trained_for(folders, tmp_path, capsys) -> None:
    source = load_model(str(folders["llama"]), dtype="float32", device="cpu", kernels=False)
    head = DraftHead(HeadConfig.for_target(source.config, 32, (0, 1, 2)))
    save_head(head, tmp_path / "head")
    argv = ["export-head", str(tmp_path / "head"), "-m", str(folders["llama"])]
    code, _, err = run_cli(capsys, [*argv, "--out", str(tmp_path / "o")])
    assert code == 0, err
    assert (tmp_path / "o" / "model.safetensors").is_file()


# -- the packaged model -------------------------------------------------------------------------


@pytest.mark.slow
def test_packaged_smollm_export_matches_specfork(smollm_f32, tmp_path: Path) -> None:
    """The packaged Q4_1 GGUF → a Hugging Face folder transformers runs with our logits."""
    out = export_model(ModelExport("smollm2-135m-instruct", tmp_path / "smol"))
    tok = smollm_f32.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "Name three rivers."}])
    hf_tok = AutoTokenizer.from_pretrained(out)
    rendered = hf_tok.apply_chat_template(
        [{"role": "user", "content": "Name three rivers."}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert rendered == prompt
    ids = tok.encode(prompt)
    assert hf_tok(prompt)["input_ids"] == ids
    model = load_eager(smollm_f32.path, torch.float32, torch.device("cpu"), relayout=False)
    _assert_close(_specfork_logits(model, ids), _hf_logits(out, ids), "smollm2", atol=2e-4)
