"""Logit parity of specfork's decoders with transformers' own implementations.

Every case builds a tiny random-weight model with transformers' config and model classes,
randomizes *every* parameter (biases and norm weights included, which transformers initializes
to zeros/ones), saves it with ``save_pretrained`` (safetensors), loads it back with
``load_decoder`` in float32 and checks the logits against transformers' at every position:
one prefill, chunked prefill plus single steps, a rollback with ``cache.truncate``, explicit
causal and tree masks (plus ``cache.keep`` of an accepted branch) and the ``layers=`` subset.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import pytest
import torch
from transformers import (
    Gemma3Config,
    Gemma3ForCausalLM,
    Gemma3ForConditionalGeneration,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from specfork.kernels import load_kernels
from specfork.loading.loader import load_decoder
from specfork.models import DecoderLM
from specfork.models.base import Segment
from tiny_models import TINY, VOCAB, randomize

ATOL = 1e-4  # max abs logit difference allowed (fp32 on both sides)
SEQ = 40  # tokens of the full prefill: longer than every sliding window and rope scaling range


@dataclass(frozen=True)
class Case:
    """One architecture: transformers' classes, config overrides and what must matter."""

    config_cls: type[PretrainedConfig]
    model_cls: type[PreTrainedModel]
    overrides: dict = field(default_factory=dict)
    norm_center: float = 1.0  # norm weights are drawn around this (Gemma stores w of 1 + w)
    shard_size: str | None = None  # save_pretrained(max_shard_size=...) for a sharded checkpoint
    # config changes that must change the logits at SEQ tokens: proves the feature is exercised
    control: dict | None = None
    subset: tuple[int, ...] = (0, 2)  # a non-contiguous `layers=` subset to check

    def config(self, **extra: object) -> PretrainedConfig:
        return self.config_cls(**{**TINY, **self.overrides, **extra})


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 4.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
    "rope_theta": 10000.0,
}
GEMMA_ROPE = {
    "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 10000.0},
    "sliding_attention": {"rope_type": "default", "rope_theta": 500.0},
}

CASES: dict[str, Case] = {
    "llama": Case(LlamaConfig, LlamaForCausalLM),
    "llama-rope-llama3": Case(
        LlamaConfig,
        LlamaForCausalLM,
        {"rope_parameters": LLAMA3_ROPE},
        control={"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
    ),
    "llama-rope-linear": Case(
        LlamaConfig,
        LlamaForCausalLM,
        {"rope_parameters": {"rope_type": "linear", "factor": 3.0, "rope_theta": 10000.0}},
        control={"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
    ),
    "llama-biases": Case(LlamaConfig, LlamaForCausalLM, {"attention_bias": True, "mlp_bias": True}),
    "smollm-tied": Case(LlamaConfig, LlamaForCausalLM, {"tie_word_embeddings": True}),
    "llama-sharded": Case(LlamaConfig, LlamaForCausalLM, shard_size="24KB"),
    "mistral-swa": Case(
        MistralConfig,
        MistralForCausalLM,
        {"sliding_window": 8},
        control={"sliding_window": None},
    ),
    "qwen2": Case(Qwen2Config, Qwen2ForCausalLM, {"rope_theta": 1000.0}),
    "qwen2-yarn": Case(
        Qwen2Config,
        Qwen2ForCausalLM,
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 16,
                "rope_theta": 10000.0,
            },
            "tie_word_embeddings": True,
        },
        control={"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
    ),
    "qwen3": Case(Qwen3Config, Qwen3ForCausalLM, {"head_dim": 24}),
    "gemma3": Case(
        Gemma3TextConfig,
        Gemma3ForCausalLM,
        {
            "num_hidden_layers": 7,  # layers 0-4 and 6 sliding, layer 5 full
            "head_dim": 32,  # heads * head_dim != hidden
            "sliding_window": 8,
            "query_pre_attn_scalar": 20,
            "final_logit_softcapping": 5.0,
            "rope_parameters": copy.deepcopy(GEMMA_ROPE),
            "tie_word_embeddings": True,
            "pad_token_id": 0,
        },
        norm_center=0.0,
        control={"sliding_window": 4096},
        subset=(0, 5),
    ),
}


# -- helpers ------------------------------------------------------------------------------------


pytestmark = pytest.mark.usefixtures("one_thread")


def build_reference(case: Case, seed: int = 0, **extra: object) -> PreTrainedModel:
    torch.manual_seed(seed)
    model = case.model_cls(case.config(**extra))
    randomize(model, seed, case.norm_center)
    model.config._attn_implementation = "eager"
    return model.eval()


@dataclass
class Pair:
    """transformers' model and specfork's model loaded from its saved checkpoint."""

    case: Case
    hf: PreTrainedModel
    ours: DecoderLM
    folder: Path

    def ref(self, tokens: torch.Tensor) -> torch.Tensor:
        """transformers' float32 logits [T, V] of one plain sequence tokens [T]."""
        with torch.no_grad():
            return self.hf(input_ids=tokens[None]).logits[0].float()

    def run(
        self,
        cache_,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        layers: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """specfork's logits [T, V] for tokens [T] appended to `cache_`."""
        if positions is None:
            positions = torch.arange(cache_.length, cache_.length + tokens.shape[-1])
        with torch.no_grad():
            hidden = self.ours(tokens[None], positions, cache_, mask=mask, layers=layers)
        return self.ours.logits(hidden)[0]


#: the eager PyTorch decoders and the compiled kernels' FastLM (models/fast.py)
BACKENDS = ("eager", "kernels")


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Pair]:
    @cache
    def checkpoint(name: str) -> tuple[PreTrainedModel, Path]:
        case = CASES[name]
        hf = build_reference(case)
        folder = tmp_path_factory.mktemp(name)
        kwargs = {"max_shard_size": case.shard_size} if case.shard_size else {}
        hf.save_pretrained(folder, **kwargs)
        return hf, folder

    @cache
    def make(name: str, backend: str = "eager") -> Pair:
        if backend == "kernels" and load_kernels() is None:
            pytest.skip("the compiled kernels cannot be built here")
        hf, folder = checkpoint(name)
        ours = load_decoder(folder, dtype="float32", device="cpu", kernels=backend == "kernels")
        return Pair(CASES[name], hf, ours, folder)

    return make


def tokens_of(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def assert_close(ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    assert ours.shape == ref.shape, f"{what}: shape {tuple(ours.shape)} != {tuple(ref.shape)}"
    assert torch.isfinite(ours).all(), f"{what}: non-finite logits"
    diff = (ours - ref).abs().max(dim=-1).values  # [T]
    worst = int(diff.argmax())
    assert float(diff.max()) <= ATOL, (
        f"{what}: max |Δlogit| {float(diff.max()):.3e} at position {worst} "
        f"(per position: {[round(float(d), 6) for d in diff]})"
    )


IDS = list(CASES)


# -- sanity of the setup ------------------------------------------------------------------------


@pytest.mark.parametrize("name", IDS)
def test_checkpoint_is_random_and_as_intended(pairs, name: str) -> None:
    pair = pairs(name)
    hf, cfg = pair.hf, pair.ours.config
    # transformers' defaults (zeros / ones) were all replaced
    for pname, p in hf.named_parameters():
        assert p.std() > 1e-3, f"{pname} was not randomized"
    ref = pair.ref(tokens_of(SEQ, 1))
    assert ref.std() > 0.3, "logits too flat for the comparison to mean anything"
    assert cfg.num_layers == hf.config.num_hidden_layers
    assert cfg.tie_embeddings == bool(hf.config.tie_word_embeddings)
    files = sorted(pair.folder.glob("*.safetensors"))
    if pair.case.shard_size:
        assert len(files) > 1, f"expected a sharded checkpoint, got {files}"
        assert (pair.folder / "model.safetensors.index.json").exists()
    else:
        assert len(files) == 1


@pytest.mark.parametrize("name", [n for n in IDS if CASES[n].control])
def test_feature_changes_the_logits(pairs, name: str) -> None:
    """The rope scaling / sliding window of the case matters at SEQ tokens: without it,
    transformers' logits differ far beyond the tolerance (so parity really checks it)."""
    pair = pairs(name)
    control = build_reference(pair.case, **pair.case.control)
    seq = tokens_of(SEQ, 1)
    with torch.no_grad():
        other = control(input_ids=seq[None]).logits[0]
    assert (other - pair.ref(seq)).abs().max() > 100 * ATOL


# -- parity -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", IDS)
def test_full_prefill(pairs, name: str) -> None:
    """A batch of two sequences (the eager decoders take [B, T]; FastLM runs one sequence)."""
    pair = pairs(name)
    batch = torch.stack((tokens_of(SEQ, 1), tokens_of(SEQ, 2)))  # [2, SEQ]
    cache_ = pair.ours.new_cache(64, batch=2)
    with torch.no_grad():
        hidden = pair.ours(batch, torch.arange(SEQ), cache_)
    logits = pair.ours.logits(hidden)  # [2, SEQ, V]
    assert logits.dtype == torch.float32
    assert cache_.length == SEQ
    for row in range(2):
        assert_close(logits[row], pair.ref(batch[row]), f"{name} prefill row {row}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", IDS)
def test_chunked_prefill_then_steps(pairs, name: str, backend: str) -> None:
    pair = pairs(name, backend)
    seq = tokens_of(SEQ, 3)
    cache_ = pair.ours.new_cache(64)
    parts = [pair.run(cache_, seq[:17]), pair.run(cache_, seq[17:26])]
    for i in range(26, SEQ):
        parts.append(pair.run(cache_, seq[i : i + 1]))
    assert cache_.length == SEQ
    assert_close(torch.cat(parts), pair.ref(seq), f"{name} chunked")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", IDS)
def test_truncate_then_continue(pairs, name: str, backend: str) -> None:
    pair = pairs(name, backend)
    prefix, rejected = tokens_of(30, 4), tokens_of(5, 5)
    accepted = (tokens_of(10, 6) + 1 + rejected.repeat(2)) % VOCAB  # differs from `rejected`
    cache_ = pair.ours.new_cache(64)
    head = pair.run(cache_, prefix)
    pair.run(cache_, rejected)
    assert cache_.length == 35
    cache_.truncate(30)
    # a block shorter than what was rolled back (stale slots 33-34 stay past the end) ...
    parts = [head, pair.run(cache_, accepted[:3])]
    for i in range(3, 10):  # ... then single steps that overwrite them
        parts.append(pair.run(cache_, accepted[i : i + 1]))
    assert cache_.length == 40
    assert_close(torch.cat(parts), pair.ref(torch.cat((prefix, accepted))), f"{name} rollback")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", IDS)
def test_explicit_causal_mask_equals_none(pairs, name: str, backend: str) -> None:
    pair = pairs(name, backend)
    prefix, block = tokens_of(20, 7), tokens_of(12, 8)
    cache_ = pair.ours.new_cache(64)
    pair.run(cache_, prefix)
    implicit = pair.run(cache_, block)
    cache_.truncate(20)
    explicit = pair.run(cache_, block, mask=torch.ones(12, 12, dtype=torch.bool).tril())
    torch.testing.assert_close(explicit, implicit, atol=0, rtol=0)
    assert_close(explicit, pair.ref(torch.cat((prefix, block)))[20:], f"{name} tril mask")


# A tree of two branches sharing a root, nodes interleaved so that slot order != depth order:
#   slot:   0  1   2   3   4   5   6   7
#   node:   r  a1  b1  a2  b2  a3  b3  a4
TREE_PARENTS = (-1, 0, 0, 1, 2, 3, 4, 5)
BRANCH_A = (0, 1, 3, 5, 7)
BRANCH_B = (0, 2, 4, 6)


def tree_mask_and_depths(parents: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    depth = torch.zeros(n, dtype=torch.long)
    for i in range(n):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
        depth[i] = int(mask[i].sum()) - 1
    return mask, depth


def test_tree_mask_helper() -> None:
    mask, depth = tree_mask_and_depths(TREE_PARENTS)
    assert depth.tolist() == [0, 1, 1, 2, 2, 3, 3, 4]
    assert mask[7].nonzero().flatten().tolist() == list(BRANCH_A)
    assert mask[6].nonzero().flatten().tolist() == list(BRANCH_B)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", IDS)
def test_tree_mask_then_keep_branch(pairs, name: str, backend: str) -> None:
    pair = pairs(name, backend)
    p = 20  # longer than the sliding windows: the window must follow positions, not slots
    # 8 steps after the kept branch reach position 31, where a window of 8 starts to hide
    # kept slots: only right if keep() moved the slots' positions along with their K/V
    prefix, nodes, tail = tokens_of(p, 9), tokens_of(len(TREE_PARENTS), 10), tokens_of(8, 11)
    mask, depth = tree_mask_and_depths(TREE_PARENTS)
    cache_ = pair.ours.new_cache(64)
    pair.run(cache_, prefix)
    tree = pair.run(cache_, nodes, positions=p + depth, mask=mask)
    for label, branch in (("A", BRANCH_A), ("B", BRANCH_B)):
        ref = pair.ref(torch.cat((prefix, nodes[list(branch)])))[p:]
        assert_close(tree[list(branch)], ref, f"{name} tree branch {label}")
    # accept branch A: compact its slots, then keep decoding after it
    cache_.keep([p + i for i in BRANCH_A])
    assert cache_.length == p + len(BRANCH_A)
    steps = [pair.run(cache_, tail[i : i + 1]) for i in range(len(tail))]
    ref = pair.ref(torch.cat((prefix, nodes[list(BRANCH_A)], tail)))[-len(tail) :]
    assert_close(torch.cat(steps), ref, f"{name} after keep")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", IDS)
def test_a_batch_step_matches_the_reference_per_sequence(pairs, name: str, backend: str) -> None:
    """Three sequences in one `forward_batch` (a chain, a tree with its mask, one row), each
    after its own prefix (past the sliding windows for one of them), then a second batch step
    after the tree kept a branch: every row's logits are the reference model's for its own
    sequence."""
    pair = pairs(name, backend)
    model = pair.ours
    lengths = (20, 3, 12)
    prefixes = [tokens_of(n, 20 + i) for i, n in enumerate(lengths)]
    chain, nodes, one = tokens_of(3, 30), tokens_of(len(TREE_PARENTS), 31), tokens_of(1, 32)
    mask, depth = tree_mask_and_depths(TREE_PARENTS)
    caches = [model.new_cache(64) for _ in prefixes]
    for c, prefix in zip(caches, prefixes, strict=True):
        pair.run(c, prefix)
    p0, p1, p2 = lengths
    segments = [
        Segment(chain, torch.arange(p0, p0 + 3), caches[0]),
        Segment(nodes, p1 + depth, caches[1], mask),
        Segment(one, torch.tensor([p2]), caches[2]),
    ]
    with torch.no_grad():
        logits = model.logits(model.forward_batch(segments)[0])  # [3 + N + 1, V]
    n = len(TREE_PARENTS)
    got_chain, got_tree, got_one = logits[:3], logits[3 : 3 + n], logits[3 + n :]
    assert_close(got_chain, pair.ref(torch.cat((prefixes[0], chain)))[p0:], f"{name} chain")
    ref = pair.ref(torch.cat((prefixes[1], nodes[list(BRANCH_A)])))[p1:]
    assert_close(got_tree[list(BRANCH_A)], ref, f"{name} tree branch A")
    assert_close(got_one, pair.ref(torch.cat((prefixes[2], one)))[p2:], f"{name} one row")
    caches[1].keep([p1 + i for i in BRANCH_A])
    histories = [
        torch.cat((prefixes[0], chain)),
        torch.cat((prefixes[1], nodes[list(BRANCH_A)])),
        torch.cat((prefixes[2], one)),
    ]
    nxt = tokens_of(3, 33)
    segments = [
        Segment(nxt[i : i + 1], torch.tensor([len(h)]), c)
        for i, (h, c) in enumerate(zip(histories, caches, strict=True))
    ]
    with torch.no_grad():
        logits = model.logits(model.forward_batch(segments)[0])  # [3, V]
    for i, h in enumerate(histories):
        ref = pair.ref(torch.cat((h, nxt[i : i + 1])))[-1:]
        assert_close(logits[i : i + 1], ref, f"{name} second step, sequence {i}")


def v4_layout(config: dict) -> dict:
    """The same config as transformers 4.x wrote it (as most Hub checkpoints still are):
    top-level rope_theta / rope_scaling (and rope_local_base_freq for Gemma 3) instead of v5's
    rope_parameters, and a sliding_window_pattern instead of layer_types for Gemma 3."""
    d = dict(config)
    params = d.pop("rope_parameters")
    if d["model_type"] == "gemma3_text":
        d["rope_local_base_freq"] = params["sliding_attention"]["rope_theta"]
        params = params["full_attention"]
        d["sliding_window_pattern"] = d.pop("_sliding_window_pattern")
        del d["layer_types"]
    params = dict(params)
    d["rope_theta"] = params.pop("rope_theta")
    if params.get("rope_type", "default") != "default":
        d["rope_scaling"] = params
    return d


@pytest.mark.parametrize("name", ["llama-rope-llama3", "llama-rope-linear", "qwen2", "gemma3"])
def test_v4_config_layout(pairs, name: str, tmp_path: Path) -> None:
    pair = pairs(name)
    for file in pair.folder.iterdir():
        (tmp_path / file.name).write_bytes(file.read_bytes())
    config = json.loads((pair.folder / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(v4_layout(config)))
    ours = load_decoder(tmp_path, dtype=torch.float32, device="cpu")
    seq = tokens_of(SEQ, 13)
    with torch.no_grad():
        logits = ours.logits(ours(seq[None], torch.arange(SEQ), ours.new_cache(SEQ)))[0]
    assert_close(logits, pair.ref(seq), f"{name} v4 config")


def truncated_reference(pair: Pair, subset: Sequence[int]) -> PreTrainedModel:
    """transformers' model made of the layers `subset` of pair.hf (same weights), in order."""
    cfg = copy.deepcopy(pair.hf.config)
    cfg.num_hidden_layers = len(subset)
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = [pair.hf.config.layer_types[i] for i in subset]
    small = pair.case.model_cls(cfg)
    small.config._attn_implementation = "eager"
    state = {}
    for key, value in pair.hf.state_dict().items():
        if key.startswith("model.layers."):
            index, rest = key.removeprefix("model.layers.").split(".", 1)
            if int(index) not in subset:
                continue
            key = f"model.layers.{subset.index(int(index))}.{rest}"
        state[key] = value
    missing, unexpected = small.load_state_dict(state, strict=False)
    assert not unexpected
    assert all("inv_freq" in m or "embed_scale" in m for m in missing), missing
    return small.eval()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("which", ["first", "subset"])
@pytest.mark.parametrize("name", IDS)
def test_layer_subset(pairs, name: str, which: str, backend: str) -> None:
    """`layers=` runs only those blocks (then the final norm): the same as transformers' model
    built from just those layers, for a prefill and the single steps after it."""
    pair = pairs(name, backend)
    subset = (0,) if which == "first" else pair.case.subset
    small = truncated_reference(pair, subset)
    seq = tokens_of(24, 12)
    with torch.no_grad():
        ref_hidden = small.model(input_ids=seq[None]).last_hidden_state[0]
        ref_logits = small(input_ids=seq[None]).logits[0].float()
    cache_ = pair.ours.new_cache(64)
    hidden, logits = [], []
    for chunk in (seq[:20], *seq[20:].split(1)):
        positions = torch.arange(cache_.length, cache_.length + len(chunk))
        with torch.no_grad():
            h = pair.ours(chunk[None], positions, cache_, layers=list(subset))[0]
        hidden.append(h)
        logits.append(pair.ours.logits(h))
    assert_close(torch.cat(hidden), ref_hidden, f"{name} layers={subset} hidden")
    assert_close(torch.cat(logits), ref_logits, f"{name} layers={subset} logits")
    # and the subset really differs from the whole model
    assert (ref_logits - pair.ref(seq)).abs().max() > 100 * ATOL


def test_gemma3_multimodal_checkpoint(tmp_path: Path) -> None:
    """A Gemma3ForConditionalGeneration folder (model_type "gemma3", the text model's config
    under text_config, weights under language_model.*, a vision tower to ignore) loads as its
    text decoder. No final-logit softcapping here: transformers' multimodal class ignores it."""
    text = CASES["gemma3"].config(final_logit_softcapping=None).to_dict()
    vision = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "image_size": 28,
        "patch_size": 14,
    }
    config = Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=4,
        image_token_index=VOCAB + 10,  # out of the tiny vocab: no token is an image token
        boi_token_index=VOCAB + 11,
        eoi_token_index=VOCAB + 12,
    )
    torch.manual_seed(0)
    hf = Gemma3ForConditionalGeneration(config)
    randomize(hf, 0, norm_center=0.0)
    hf.eval().save_pretrained(tmp_path)
    ours = load_decoder(tmp_path, dtype=torch.float32, device="cpu")
    assert ours.config.arch == "gemma3" and ours.config.num_layers == 7
    seq = tokens_of(SEQ, 14)
    with torch.no_grad():
        ref = hf(input_ids=seq[None]).logits[0].float()
        logits = ours.logits(ours(seq[None], torch.arange(SEQ), ours.new_cache(SEQ)))[0]
    assert_close(logits, ref, "gemma3 multimodal checkpoint")


def test_dynamic_rope_within_original_length(tmp_path: Path) -> None:
    case = Case(
        LlamaConfig,
        LlamaForCausalLM,
        {"rope_parameters": {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0}},
    )
    hf = build_reference(case)  # max_position_embeddings 256 > SEQ: no scaling in transformers
    hf.save_pretrained(tmp_path)
    ours = load_decoder(tmp_path, dtype=torch.float32, device="cpu")
    seq = tokens_of(SEQ, 15)
    with torch.no_grad():
        ref = hf(input_ids=seq[None]).logits[0].float()
        logits = ours.logits(ours(seq[None], torch.arange(SEQ), ours.new_cache(SEQ)))[0]
    assert_close(logits, ref, "llama dynamic rope")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_captured_hidden_states_are_the_blocks_outputs(pairs, name: str, backend: str) -> None:
    """`forward_capturing` returns chosen blocks' outputs (transformers' hidden_states[i + 1])
    in the order asked, for a prefill and for a tree forward, and capturing changes nothing."""
    pair = pairs(name, backend)
    last = pair.ours.config.num_layers - 1
    capture = (last, 0, 1)  # any order; the last block's output is before the final norm
    seq = tokens_of(20, 21)
    with torch.no_grad():
        ref = pair.hf(input_ids=seq[None], output_hidden_states=True).hidden_states
        cache_ = pair.ours.new_cache(64)
        hidden, captured = pair.ours.forward_capturing(
            seq[None], torch.arange(20), cache_, capture=capture
        )
    assert captured is not None and captured.shape == (3, 20, pair.ours.config.hidden_size)
    assert captured.dtype == torch.float32
    assert_close(captured[1], ref[1][0].float(), f"{name} block 0 output")
    assert_close(captured[2], ref[2][0].float(), f"{name} block 1 output")
    assert_close(hidden[0], ref[-1][0].float(), f"{name} final hidden")  # normed, as before
    with torch.no_grad():
        renormed = pair.ours.norm(captured[0]) if backend == "eager" else None
    if renormed is not None:
        torch.testing.assert_close(renormed, hidden[0], atol=1e-5, rtol=1e-5)
    # a tree forward with capture gives the same hidden states as without
    mask, depth = tree_mask_and_depths(TREE_PARENTS)
    nodes = tokens_of(len(TREE_PARENTS), 22)
    with torch.no_grad():
        plain = pair.ours(nodes[None], 20 + depth, cache_, mask=mask)
        cache_.truncate(20)
        again, states = pair.ours.forward_capturing(
            nodes[None], 20 + depth, cache_, mask=mask, capture=(0,)
        )
    torch.testing.assert_close(again, plain, atol=0, rtol=0)
    assert states is not None and states.shape == (1, len(TREE_PARENTS), hidden.shape[-1])
    with pytest.raises(ValueError, match="among those run"):
        pair.ours.forward_capturing(
            seq[None, :2], torch.arange(2), cache_, layers=[0], capture=(1,)
        )
