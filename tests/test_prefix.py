"""The prefix cache (engine/prefix.py): a radix tree of cached keys/values — longest-prefix
loads, edge splits, LRU eviction under a byte budget — and, in the batch scheduler, outputs
that do not depend on a cache hit while the hit spares the prefill."""

from __future__ import annotations

import pytest
import torch

from specfork.config import GenerationConfig, SpecConfig
from specfork.engine.batch import BatchConfig, Scheduler, generate_batch
from specfork.engine.generator import Generator
from specfork.engine.prefix import PrefixCache
from specfork.errors import ConfigError
from specfork.kernels import load_kernels
from specfork.kv_cache import KVCache
from specfork.loading.loader import LoadedModel, load_model
from specfork.models.cost import CostCurve
from specfork.strategies.rate_memory import RateBook
from tiny_models import tiny_chat_llama

CURVE = CostCurve((1, 2, 4, 8, 16, 32), (1.0, 1.25, 1.5, 2.3, 3.9, 6.8))


def _filled(n: int, seed: int) -> KVCache:
    """A cache whose first n slots hold random keys/values."""
    cache = KVCache(2, 2, 4, 64)
    g = torch.Generator().manual_seed(seed)
    cache.k[:, :, :, :n] = torch.randn(2, 1, 2, n, 4, generator=g)
    cache.v[:, :, :, :n] = torch.randn(2, 1, 2, n, 4, generator=g)
    cache.length = n
    return cache


def test_longest_prefix_is_loaded_and_edges_split() -> None:
    prefix = PrefixCache(1 << 20)
    a = list(range(10))
    one = _filled(10, 0)
    prefix.store(a, one)
    target = KVCache(2, 2, 4, 64)
    assert prefix.load([*a, 99], target) == 10
    assert torch.equal(target.k[:, :, :, :10], one.k[:, :, :, :10])
    assert torch.equal(target.v[:, :, :, :10], one.v[:, :, :, :10])
    assert target.length == 10 and target.positions[:10].tolist() == list(range(10))
    b = [*a[:6], 50, 51, 52, 53]
    two = _filled(10, 1)
    two.k[:, :, :, :6] = one.k[:, :, :, :6]  # the shared prefix has the same KV
    two.v[:, :, :, :6] = one.v[:, :, :, :6]
    prefix.store(b, two)  # splits the first edge after 6 tokens
    assert prefix.tokens == 14
    for ids, source in ((b, two), (a, one)):
        target = KVCache(2, 2, 4, 64)
        assert prefix.load(ids, target) == 9  # all but the last token: its logits are needed
        assert torch.equal(target.k[:, :, :, :9], source.k[:, :, :, :9])
    assert prefix.load([7, 8, 9], KVCache(2, 2, 4, 64)) == 0
    assert prefix.stats.lookups == 4 and prefix.stats.hits == 3


def test_least_recently_used_leaves_are_evicted_under_the_budget() -> None:
    per_token = 2 * 2 * 2 * 4 * 4  # k and v, 2 layers, 2 heads, 4 dims, float32
    prefix = PrefixCache(25 * per_token)
    prefix.store(list(range(10)), _filled(10, 0))
    prefix.store(list(range(100, 110)), _filled(10, 1))
    prefix.load([*range(10), 5], KVCache(2, 2, 4, 64))  # the first is used again
    prefix.store(list(range(200, 210)), _filled(10, 2))  # 30 tokens > 25: one must go
    assert prefix.nbytes <= prefix.capacity and prefix.stats.evicted == 1
    assert prefix.load([*range(10), 1], KVCache(2, 2, 4, 64)) == 10
    assert prefix.load([*range(100, 110), 1], KVCache(2, 2, 4, 64)) == 0


def test_bad_prefix_cache_settings_are_refused() -> None:
    with pytest.raises(ConfigError, match="prefix cache size"):
        PrefixCache(0)
    with pytest.raises(ConfigError, match="prefix_cache_bytes"):
        BatchConfig(prefix_cache_bytes=-1)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory, one_thread) -> LoadedModel:
    if load_kernels() is None:
        pytest.skip("the kernels cannot be built here")
    folder = tiny_chat_llama(tmp_path_factory.mktemp("tiny"), chat=True, seed=4)
    return load_model(str(folder), dtype="float32", kernels=True, progress=False)


SYSTEM = "You are a helpful assistant who answers briefly and politely. " * 4


@pytest.mark.parametrize(
    "spec", [SpecConfig(), SpecConfig("spork", "recycle+ngram")], ids=["ar", "spork"]
)
def test_a_shared_system_prompt_is_prefilled_once_and_outputs_do_not_change(
    loaded: LoadedModel, spec: SpecConfig
) -> None:
    gen = Generator(loaded, spec=spec, cost_curve=CURVE, rates=RateBook(shared=False))
    config = GenerationConfig(max_new_tokens=16, ignore_eos=True)
    chats = [
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
        for q in ("first question", "second one", "and a third")
    ]
    alone = [gen.generate(c, config=config) for c in chats]
    scheduler = Scheduler(gen, BatchConfig(max_running=1, prefix_cache_bytes=1 << 24))
    results = []
    for chat in chats:  # one after another: each finds what the earlier ones stored
        scheduler.add(chat, config=config)
        while scheduler.running:
            results += [u.result for u in scheduler.step() if u.result is not None]
    assert [r.token_ids for r in results] == [r.token_ids for r in alone]
    cached = [r.stats.cached_prompt_tokens for r in results]
    if spec.strategy == "spork":  # Token Recycling learns from the prompt's logits: no hits
        assert cached == [0, 0, 0]
        assert [r.stats.drafted for r in results] == [r.stats.drafted for r in alone]
    else:
        assert cached[0] == 0 and min(cached[1:]) > len(SYSTEM) // 2  # byte-level tokens
    prefilled = sum(s.prefill_rows for s in scheduler.steps)
    assert prefilled == sum(r.stats.prompt_tokens for r in results) - sum(cached)


def test_the_next_turn_of_a_chat_reuses_the_answer(loaded: LoadedModel) -> None:
    """Turn two starts with turn one's prompt and answer (as token ids, so no re-encoding
    blurs it): the hit covers the answer too, and the output equals a lone run's."""
    gen = Generator(loaded, cost_curve=CURVE)
    config = GenerationConfig(max_new_tokens=12, ignore_eos=True)
    scheduler = Scheduler(gen, BatchConfig(max_running=2, prefix_cache_bytes=1 << 24))
    scheduler.add([{"role": "user", "content": "tell me something"}], config=config)
    while scheduler.running:
        done = [u.result for u in scheduler.step() if u.result is not None]
    answer = done[0]
    follow = gen.tokenizer.encode("<|im_end|>\n<|im_start|>user\nmore<|im_end|>\n")
    second = answer.prompt_ids + answer.token_ids + follow
    expected = gen.generate(second, config=config).token_ids
    scheduler.add(second, config=config)
    while scheduler.running:
        done = [u.result for u in scheduler.step() if u.result is not None]
    assert done[0].token_ids == expected
    stored = len(answer.prompt_ids) + len(answer.token_ids) - 1  # the last token had no KV yet
    assert done[0].stats.cached_prompt_tokens == stored


def test_generate_batch_with_a_prefix_cache_equals_without(loaded: LoadedModel) -> None:
    gen = Generator(loaded, spec=SpecConfig("speculative", "ngram", k=4), cost_curve=CURVE)
    config = GenerationConfig(max_new_tokens=10, ignore_eos=True)
    prompts = [SYSTEM + q for q in ("a", "b", "c", "d")]
    plain = generate_batch(gen, prompts, config=config, batch=BatchConfig(max_running=2))
    cached = generate_batch(
        gen, prompts, config=config, batch=BatchConfig(max_running=2, prefix_cache_bytes=1 << 24)
    )
    assert [r.token_ids for r in cached] == [r.token_ids for r in plain]
    assert sum(r.stats.cached_prompt_tokens for r in cached) > 0
