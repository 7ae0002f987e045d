"""The packaged models against transformers, both loading the same GGUF file in float32.

For SmolLM2-135M-Instruct and Gemma-3-270M: specfork's logits equal transformers' at every
position of a real prompt (for Gemma also of a prompt longer than its 512-token sliding window),
and greedy decoding of 32 tokens with EOS ignored gives exactly transformers'
``generate(do_sample=False)`` tokens (for SmolLM2 also on a chat-template prompt). The bf16 path
runs and its top-1 token agrees with float32 at most positions.

transformers' GGUF loading dominates the runtime (~20 s for SmolLM2, ~50 s for Gemma); each
model is loaded once, and the module-scoped fixture is parametrized by model so that only one
model pair is in memory at a time.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch

from specfork.config import GenerationConfig, SpecConfig
from specfork.engine.generator import Generator
from specfork.loading.loader import LoadedModel, load_model
from specfork.loading.registry import DEFAULT_MODEL, resolve_model

pytestmark = pytest.mark.slow

SMOLLM = "smollm2-135m-instruct"
GEMMA = "gemma3-270m"
assert DEFAULT_MODEL == SMOLLM

# Max abs logit difference allowed. Both sides run float32 on bit-identical dequantized weights
# (specfork dequantizes exactly like gguf-py, which transformers uses), so the only differences
# are rounding from a different order of float32 operations (fused vs separate Q/K/V and gate/up
# matmuls, SDPA vs eager attention): ~1e-7 relative per op, which over 30 (SmolLM2) or 18 (Gemma)
# layers stays around 1e-5 on logits of magnitude 10-30 (we measured 0.0 on the last position of
# both models). 1e-3 leaves ample room for other CPUs' kernels while any real mistake (a norm, a
# RoPE frequency, a mask off by one position, a wrong scale) moves logits by 0.1 or more.
ATOL = 1e-3
N_GREEDY = 32
BF16_MIN_AGREEMENT = 0.9

PROMPT = (
    "The printing press, invented by Johannes Gutenberg around 1440, changed how knowledge "
    "spread across Europe. Before it, books were copied by hand, which made them"
)
CHAT = [
    {"role": "system", "content": "You are a concise assistant."},
    {"role": "user", "content": "Explain in two sentences why the sky is blue."},
]


def _long_text(sentences: int) -> str:
    """Varied, deterministic English text (not a repetition the model could simply copy)."""
    colors = ["red", "green", "silver", "yellow", "purple", "brown", "white"]
    animals = ["fox", "heron", "badger", "otter", "falcon", "tortoise", "lynx", "moth", "crab"]
    places = ["harbour", "old mill", "library", "orchard", "station", "market", "lighthouse"]
    verbs = ["walked", "flew", "crawled", "hurried", "wandered", "swam"]
    return " ".join(
        f"On day {3 * i + 1}, the {colors[i % 7]} {animals[i % 9]} {verbs[i % 6]} "
        f"{(7 * i) % 23 + 2} miles to the {places[i % 7]}."
        for i in range(sentences)
    )


@pytest.fixture(scope="module", params=[SMOLLM, GEMMA])
def pair(request: pytest.FixtureRequest, smollm_f32: LoadedModel) -> Iterator[SimpleNamespace]:
    """specfork's and transformers' float32 models of one packaged GGUF, both on the CPU."""
    from transformers import AutoModelForCausalLM

    name = request.param
    ours = (
        smollm_f32
        if name == SMOLLM
        else load_model(name, dtype="float32", device="cpu", progress=False)
    )
    path = resolve_model(name, progress=False)
    started = time.perf_counter()
    ref = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    print(f"\n{name}: transformers loaded the GGUF in {time.perf_counter() - started:.1f} s")
    yield SimpleNamespace(name=name, ours=ours, ref=ref, gen=Generator(ours))
    del ref


def _our_hidden(loaded: LoadedModel, ids: list[int]) -> torch.Tensor:
    """Final-normed hidden states [T, D] of one prefill."""
    model = loaded.model
    cache = model.new_cache(len(ids))
    with torch.inference_mode():
        tokens = torch.tensor([ids])  # [1, T]
        return model(tokens, torch.arange(len(ids)), cache)[0]  # [T, D]


def _our_logits(loaded: LoadedModel, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return loaded.model.logits(_our_hidden(loaded, ids))  # [T, V] float32


def _ref_logits(ref: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return ref(torch.tensor([ids])).logits[0].float()  # [T, V]


def _prompt_ids(pair: SimpleNamespace, text: str) -> list[int]:
    return pair.gen.encode_prompt(text, chat=False)


def test_logits_match_transformers_at_every_position(pair: SimpleNamespace) -> None:
    ids = _prompt_ids(pair, PROMPT)
    assert len(ids) > 25
    ours, ref = _our_logits(pair.ours, ids), _ref_logits(pair.ref, ids)
    assert ours.shape == ref.shape == (len(ids), pair.ours.config.vocab_size)
    diff = (ours - ref).abs().amax(-1)  # [T]
    print(f"{pair.name}: max abs logit diff {diff.max().item():.2e} over {len(ids)} positions")
    assert diff.max().item() <= ATOL, diff
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    assert ref.abs().amax().item() > 5  # real logits, not an all-zero output


def test_logits_past_the_sliding_window(pair: SimpleNamespace) -> None:
    """Gemma 3's sliding layers see only the last 512 positions: check 600 of them.

    Some of these positions are ill-conditioned (at position 483, transformers' own fp32
    hidden state is 0.067 away from its float64 value), so specfork is held to the float64
    truth: at every position no further from it than transformers' fp32 is, plus ATOL.
    """
    if pair.name != GEMMA:
        pytest.skip("SmolLM2 has no sliding window")
    ids = _prompt_ids(pair, _long_text(60))[:600]
    window = pair.ours.config.sliding_window
    assert window == 512 and len(ids) == 600
    assert pair.ref.config.sliding_window == window
    assert "sliding_attention" in pair.ref.config.layer_types
    assert pair.ref.config.final_logit_softcapping is None
    ours = _our_hidden(pair.ours, ids)  # [T, D]
    with torch.inference_mode():
        ref = pair.ref.model(torch.tensor([ids])).last_hidden_state[0]  # [T, D]
        truth = _float64_hidden(pair.ref, ids)  # [T, D]
        head64 = pair.ref.lm_head.weight.double()  # [V, D]
        worst = 0.0
        for start in range(0, len(ids), 100):  # logits [100, 262144] at a time
            rows = slice(start, start + 100)
            mine = pair.ours.model.logits(ours[rows])
            theirs = pair.ref.lm_head(ref[rows]).float()
            exact = truth[rows] @ head64.T
            ours_err = (mine.double() - exact).abs().amax(-1)  # [100]
            theirs_err = (theirs.double() - exact).abs().amax(-1)  # [100]
            worst = max(worst, float((ours_err - theirs_err).max()))
            assert torch.equal(mine.argmax(-1), theirs.argmax(-1)), start
    print(f"{pair.name}: logit error beyond transformers' fp32, worst {worst:.2e}")
    assert worst <= ATOL


def _float64_hidden(ref: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """transformers' final hidden states in float64 (the model is restored to float32; nn.Module's
    own casts, because transformers refuses .float() on a model it loaded from a GGUF)."""
    try:
        torch.nn.Module.double(ref)
        return ref.model(torch.tensor([ids])).last_hidden_state[0]  # [T, D] float64
    finally:
        torch.nn.Module.float(ref)


def test_speculation_is_exact_past_the_sliding_window(pair: SimpleNamespace) -> None:
    """Chains and trees verified at positions past Gemma's 512-token window (where a tree
    node's position differs from its cache slot, so sliding masks must use positions) give
    plain greedy's tokens; on SmolLM2 (no window) the same checks run on a long prompt."""
    ids = _prompt_ids(pair, _long_text(40) + " Summary of the journeys: on day 1, the red fox")
    assert len(ids) > 600
    config = GenerationConfig(max_new_tokens=48, ignore_eos=True)
    plain = pair.gen.generate(ids, config=config).token_ids
    half = pair.ours.config.num_layers // 2
    specs = [  # ungated: the goodput gates weigh drafts by timed costs, and on a slow or
        # loaded machine they may skip every tree this test is here to verify
        SpecConfig("speculative", "ngram", k=4, goodput=False),
        SpecConfig("spork", "recycle+ngram", goodput=False),
        SpecConfig("spork", "recycle", tree="dynamic", goodput=False),
        SpecConfig(
            "spork", "self", skip_layers=f"{half}-{half + 3}", tree="dynamic", goodput=False
        ),
    ]
    for spec in specs:
        result = pair.gen.generate(ids, config=config, spec=spec)
        assert result.token_ids == plain, (pair.name, spec)
        assert result.stats.accepted > 0, (pair.name, spec)  # trees were really verified


def _ref_greedy(ref: torch.nn.Module, ids: list[int], n: int) -> list[int]:
    prompt = torch.tensor([ids])
    with torch.inference_mode():
        out = ref.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=None,  # ignore EOS, as ignore_eos=True does
            pad_token_id=0,
        )
    return out[0, len(ids) :].tolist()


def test_greedy_matches_transformers_generate(pair: SimpleNamespace) -> None:
    prompts = [_prompt_ids(pair, PROMPT)]
    if pair.name == SMOLLM:
        prompts.append(pair.gen.encode_prompt(CHAT))
        shown = pair.ours.tokenizer.decode(prompts[-1])
        assert "<|im_start|>assistant\n" in shown and "concise assistant" in shown
    config = GenerationConfig(max_new_tokens=N_GREEDY, ignore_eos=True)
    for ids in prompts:
        ours = pair.gen.generate(ids, config=config)
        assert ours.finish_reason == "length"
        assert ours.token_ids == _ref_greedy(pair.ref, ids, N_GREEDY)
        assert len(ours.token_ids) == N_GREEDY


def test_bf16_agrees_with_fp32(pair: SimpleNamespace) -> None:
    bf16 = load_model(pair.name, dtype="bfloat16", device="cpu", progress=False)
    assert bf16.model.dtype == torch.bfloat16
    ids = _prompt_ids(pair, PROMPT + " " + _long_text(8))
    fp32 = _ref_logits(pair.ref, ids).argmax(-1)
    low = _our_logits(bf16, ids)
    assert low.dtype == torch.float32 and torch.isfinite(low).all()
    rate = (low.argmax(-1) == fp32).float().mean().item()
    print(f"{pair.name}: bf16 top-1 agrees with fp32 at {rate:.1%} of {len(ids)} positions")
    assert rate >= BF16_MIN_AGREEMENT
    # The bf16 path also generates through the engine.
    result = Generator(bf16).generate(PROMPT, chat=False, config=GenerationConfig(max_new_tokens=4))
    assert 1 <= len(result.token_ids) <= 4
