"""Bit-exact speculation on the compiled kernels (the default CPU path): a row's logits do not
depend on the other rows of its forward, so every lossless strategy reproduces plain greedy
decoding token for token in every precision, bf16 and the GGUF's own Q4_1/Q8_0 included.

Checked on the real default model (SmolLM2-135M-Instruct): logits of the same tokens bitwise
equal for one row at a time and for chains of 2-32 rows, for a chain and for the same path
inside a tree with siblings interleaved, and the outputs of the strategies against plain.
"""

from __future__ import annotations

import pytest
import torch

from specfork.config import GenerationConfig, SpecConfig
from specfork.engine.generator import Generator
from specfork.kernels import load_kernels
from specfork.loading.loader import LoadedModel, load_model
from specfork.models.cost import CostCurve
from specfork.tree import Tree, tree_mask, tree_positions

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(load_kernels() is None, reason="the kernels cannot be built here"),
]

PRECISIONS = ("gguf", "bfloat16")
PROMPTS = [
    "Explain how a refrigerator works.",
    "Summarize: Cats are small mammals. Cats like to sleep. Cats are popular pets around the "
    "world. Many people keep cats.",
    "Translate to French: The weather is nice today and we are going to the park.",
    "What is 17 times 23? Show your work.",
]
STRATEGIES = {
    "ngram": SpecConfig("speculative", "ngram", k=4),
    "dspark": SpecConfig("dspark", "ngram"),
    "spork": SpecConfig("spork", "recycle+ngram"),
    "self-skip": SpecConfig("speculative", "self", skip_layers="10-19", k=3),
    "spork-self-dynamic": SpecConfig("spork", "recycle+self", skip_layers="10-19", tree="dynamic"),
}
N = 48
# a CPU-like cost curve (fixed, so what the goodput gate drafts does not depend on timing)
CURVE = CostCurve((1, 2, 4, 8, 16, 32), (1.0, 1.25, 1.5, 2.3, 3.9, 6.8))


@pytest.fixture(scope="module", params=PRECISIONS)
def loaded(request: pytest.FixtureRequest) -> LoadedModel:
    return load_model("smollm2-135m-instruct", dtype=request.param, kernels=True, progress=False)


def _logits(loaded: LoadedModel, prefix: list[int], tokens: list[int], **kw) -> torch.Tensor:
    """Logits [T, V] of `tokens` after `prefix` (mask/positions in kw for trees)."""
    model = loaded.model
    cache = model.new_cache(len(prefix) + len(tokens) + 8)
    with torch.inference_mode():
        model.extend(prefix, cache)
        t = torch.tensor(tokens)
        positions = kw.pop("positions", torch.arange(len(prefix), len(prefix) + len(t)))
        hidden = model(t[None], positions, cache, **kw)[0]
        return model.logits(hidden)


def test_a_rows_logits_do_not_depend_on_the_row_count(loaded: LoadedModel) -> None:
    ids = Generator(loaded).encode_prompt(PROMPTS[0])
    chain = list(range(1000, 1032))  # 32 tokens after the prompt
    model = loaded.model
    cache = model.new_cache(len(ids) + 40)
    with torch.inference_mode():
        model.extend(ids, cache)
        one_at_a_time = torch.stack([model.extend([t], cache) for t in chain])  # [32, V]
    for rows in (2, 3, 5, 8, 16, 17, 32):
        block = _logits(loaded, ids, chain[:rows])
        assert torch.equal(block, one_at_a_time[:rows]), rows


@pytest.mark.parametrize("dtype", ["gguf", "bfloat16", "float32"])
def test_rows_read_the_cache_in_place_or_copied_alike(dtype: str) -> None:
    """Rows read a contiguous chunk of their cache in place (fp16, bf16 or fp32 keys; any
    number of rows on AVX-512, up to two rows of a group of three on AVX2) or through a float
    copy of it (more rows on AVX2, a tree's scattered slots everywhere): after a 300-token
    context (chunks of 128 slots, the last partial block of 16 keys in each) the logits are
    bitwise the same either way."""
    model = load_model("smollm2-135m-instruct", dtype=dtype, kernels=True, progress=False).model
    ids = [(7 * i) % 40000 + 100 for i in range(300)]
    chain = list(range(1000, 1008))
    cache = model.new_cache(len(ids) + 16)
    with torch.inference_mode():
        model.extend(ids, cache)
        one_at_a_time = torch.stack([model.extend([t], cache) for t in chain])  # [8, V]
        for rows in (2, 5, 6, 7, 8):
            cache.truncate(len(ids))
            block = model.logits(
                model(
                    torch.tensor(chain[:rows])[None], torch.arange(len(ids), len(ids) + rows), cache
                )[0]
            )
            assert torch.equal(block, one_at_a_time[:rows]), (dtype, rows)


def test_a_path_in_a_tree_equals_the_chain(loaded: LoadedModel) -> None:
    """Branch A (root, a1, a2, a3) interleaved with branch B in slot order, built by the
    engine's own tree functions."""
    ids = Generator(loaded).encode_prompt(PROMPTS[1])
    root, nodes = 2000, Tree([2001, 3001, 2002, 3002, 2003, 3003], [-1, -1, 0, 1, 2, 3])
    tokens = [root, *nodes.tokens.tolist()]  # rows: r a1 b1 a2 b2 a3 b3
    positions = tree_positions(nodes, len(ids))
    tree = _logits(loaded, ids, tokens, positions=positions, mask=tree_mask(nodes))
    branch_a = [0, 1, 3, 5]
    chain = _logits(loaded, ids, [tokens[i] for i in branch_a])
    assert torch.equal(tree[branch_a], chain)
    single = _logits(loaded, ids, [tokens[0]])
    assert torch.equal(tree[:1], single)


@pytest.fixture(scope="module")
def plain_runs(loaded: LoadedModel) -> list:
    gen = Generator(loaded)
    config = GenerationConfig(max_new_tokens=N, ignore_eos=True, logprobs=5)
    return [gen.generate(p, config=config) for p in PROMPTS]


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_every_strategy_reproduces_plain_decoding(
    loaded: LoadedModel, plain_runs: list, name: str
) -> None:
    """The same tokens, and bitwise the same log-probabilities (emitted and top 5): each is
    read from the verification row that predicted the token, which equals plain decoding's."""
    gen = Generator(loaded, spec=STRATEGIES[name], cost_curve=CURVE)
    config = GenerationConfig(max_new_tokens=N, ignore_eos=True, logprobs=5)
    drafted = 0
    for prompt, plain in zip(PROMPTS, plain_runs, strict=True):
        result = gen.generate(prompt, config=config)
        assert result.token_ids == plain.token_ids, (name, prompt)
        assert result.logprobs == plain.logprobs, (name, prompt)
        drafted += result.stats.drafted
    assert drafted > 0  # the strategy really speculated
