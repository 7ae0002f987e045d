"""CUDA: the eager path on a GPU (skipped without one; benchmarks/gpu_check.sh runs it).

Greedy exactness of the strategies against plain decoding in fp32 on the GPU, the bf16 match
rate reported (GPU matmuls are not batch-invariant: differences must start at near-ties), and
the kernels refusing CUDA with a clear error.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from specfork.config import GenerationConfig, SpecConfig
from specfork.engine import Generator
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
