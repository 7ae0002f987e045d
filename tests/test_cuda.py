"""CUDA: the eager path on a GPU (skipped without one; benchmarks/gpu_check.sh runs it).

Greedy exactness of the strategies (n-gram, DSpark, SPORK, self-speculation, the packaged draft
head) against plain decoding in fp32 on the GPU, the bf16 match rate reported (GPU matmuls are
not batch-invariant: differences must start at near-ties); continuous batching, the prefix cache
and the server on a GPU model; and the kernels refusing CUDA with a clear error.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from specfork.config import GenerationConfig, SpecConfig
from specfork.engine.generator import Generator
from specfork.errors import ConfigError
from specfork.loading.loader import LoadedModel, load_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")

PROMPTS = [
    "Repeat exactly: one two three, one two three, one two three.",
    "Explain how a refrigerator works.",
]
SPECS = {
    "ngram": SpecConfig("speculative", "ngram", k=4, goodput=False),
    "dspark": SpecConfig("dspark", "ngram"),
    "spork": SpecConfig("spork", "recycle+ngram"),
    "self": SpecConfig("speculative", "self", skip_layers="10-19", k=3),
    "head": SpecConfig("speculative", "head"),
}
NEAR_TIE = 0.25


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def cuda_model(request: pytest.FixtureRequest) -> LoadedModel:
    return load_model("smollm2-135m-instruct", dtype=request.param, device="cuda", progress=False)


def test_the_model_runs_on_the_gpu(cuda_model: LoadedModel) -> None:
    assert cuda_model.model.device.type == "cuda"
    assert not cuda_model.model.batch_invariant


@pytest.mark.parametrize("name", list(SPECS))
def test_strategies_against_plain_decoding(
    cuda_model: LoadedModel, name: str, record_property: Callable[[str, object], None]
) -> None:
    config = GenerationConfig(max_new_tokens=48, ignore_eos=True)
    plain, spec = Generator(cuda_model), Generator(cuda_model, spec=SPECS[name])
    same, gaps = 0, []
    for prompt in PROMPTS:
        a, b = plain.generate(prompt, config=config), spec.generate(prompt, config=config)
        if a.token_ids == b.token_ids:
            same += 1
            continue
        pairs = zip(a.token_ids, b.token_ids, strict=True)  # both exactly 48 tokens
        first = next(i for i, (x, y) in enumerate(pairs) if x != y)
        with torch.inference_mode():
            cache = cuda_model.model.new_cache(len(a.prompt_ids) + first + 8)
            top = cuda_model.model.extend(a.prompt_ids + a.token_ids[:first], cache).topk(2)
        gaps.append(float(top.values[0] - top.values[1]))
    record_property("match_rate", same / len(PROMPTS))
    if cuda_model.model.precision == "float32":
        assert same == len(PROMPTS), gaps
    assert all(g <= NEAR_TIE for g in gaps), gaps


def test_kernels_and_exact_are_refused_on_cuda() -> None:
    with pytest.raises(ConfigError, match="CPU"):
        load_model("smollm2-135m-instruct", device="cuda", kernels=True, progress=False)


def _first_gap(model: LoadedModel, prompt_ids: list[int], a: list[int], b: list[int]) -> float:
    """The top-1/top-2 logit gap of plain decoding where token lists a and b first differ."""
    first = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    with torch.inference_mode():
        cache = model.model.new_cache(len(prompt_ids) + first + 8)
        top = model.model.extend(prompt_ids + a[:first], cache).topk(2)
    return float(top.values[0] - top.values[1])


@pytest.mark.parametrize("name", ["ar", *SPECS])
def test_a_batch_on_the_gpu_gives_each_request_its_lone_output(
    cuda_model: LoadedModel, name: str, record_property: Callable[[str, object], None]
) -> None:
    """Continuous batching on the GPU: four requests, two running at a time, with prompts
    prefilled in chunks beside decoding rows; fp32 outputs equal the lone runs, bf16
    differences start at near-ties (GPU matmuls are not batch-invariant)."""
    from specfork.engine.batch import BatchConfig, generate_batch

    spec = SPECS.get(name, SpecConfig())
    gen = Generator(cuda_model, spec=spec)
    config = GenerationConfig(max_new_tokens=32, ignore_eos=True)
    prompts = [*PROMPTS, "Write a haiku about the sea.", "List three prime numbers."]
    alone = [gen.generate(p, config=config) for p in prompts]
    batch = BatchConfig(max_running=2, step_rows=16)
    together = generate_batch(gen, prompts, config=config, batch=batch)
    differ = [(a, b) for a, b in zip(alone, together, strict=True) if a.token_ids != b.token_ids]
    record_property("match_rate", 1 - len(differ) / len(prompts))
    gaps = [_first_gap(cuda_model, a.prompt_ids, a.token_ids, b.token_ids) for a, b in differ]
    if cuda_model.model.precision == "float32":
        assert not differ, gaps
    assert all(g <= NEAR_TIE for g in gaps), gaps
    assert all(r.stats.new_tokens == 32 for r in together)


def test_a_prefix_cache_hit_on_the_gpu_gives_the_same_output(cuda_model: LoadedModel) -> None:
    """A batch generator with a prefix cache on GPU caches: a second request sharing a long
    prefix loads it and decodes what it decodes without the hit (fp32: identical)."""
    from specfork.engine.batch import BatchConfig, generate_batch

    gen = Generator(cuda_model)
    config = GenerationConfig(max_new_tokens=24, ignore_eos=True)
    system = "You are a careful assistant. " * 40
    prompts = [system + "Name a colour.", system + "Name a fruit."]
    alone = [gen.generate(p, config=config, chat=False) for p in prompts]
    batch = BatchConfig(max_running=1, prefix_cache_bytes=64 << 20)
    together = generate_batch(gen, prompts, config=config, batch=batch, chat=False)
    if cuda_model.model.precision == "float32":
        assert [r.token_ids for r in together] == [r.token_ids for r in alone]
    assert together[1].stats.cached_prompt_tokens > 200


def test_the_server_batches_requests_on_the_gpu(cuda_model: LoadedModel) -> None:
    """The OpenAI-compatible server on a GPU model: concurrent greedy requests in one batch
    answer what a lone generate answers (fp32), and /metrics counts them."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    from specfork.server.app import create_app
    from specfork.server.run import serve_in_background

    gen = Generator(cuda_model, spec=SPECS["ngram"])
    config = GenerationConfig(max_new_tokens=24, ignore_eos=True)
    prompts = [*PROMPTS, "Write a haiku about the sea.", "List three prime numbers."]
    alone = [gen.generate(p, config=config, chat=False).text for p in prompts]
    app = create_app(gen, model_name="smollm2", max_running=4)
    body = {"max_tokens": 24, "temperature": 0, "ignore_eos": True}
    with serve_in_background(app) as url, ThreadPoolExecutor(4) as pool:

        def post(prompt: str) -> str:
            resp = httpx.post(f"{url}/v1/completions", json={**body, "prompt": prompt}, timeout=300)
            assert resp.status_code == 200, resp.text
            return resp.json()["choices"][0]["text"]

        texts = list(pool.map(post, prompts))
        metrics = httpx.get(f"{url}/metrics", timeout=30).text
    if cuda_model.model.precision == "float32":
        assert texts == alone
    assert "specfork_batch_size_count" in metrics
