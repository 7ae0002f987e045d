"""bf16 greedy on the eager PyTorch path (kernels off): speculative output vs plain decoding —
match rate, and every difference a near-tie. (The compiled kernels, the default CPU path, are
batch-invariant: there every strategy equals plain decoding bit for bit, tests/test_exact.py.)

In eager bf16 a verification forward over K + 1 rows rounds differently from K + 1 one-row steps, so
where the target's top two logits are (nearly) tied the argmax can flip. Such a flip is allowed
only at a near-tie: at the first diverging position the top-2 gap of the target's logits (plain
decoding's context, recomputed in one prefill — a third rounding path) must be within
NEAR_TIE = 0.25, two bf16 steps for logits of magnitude 16–32 (the spacing there is 0.125).
Measured (5 prompts × 96 tokens, SmolLM2-135M): 7/10 runs identical; the 3 differences had
gaps 0.0, 0.0 and 0.125.
"""

from collections.abc import Callable

import pytest
import torch

from specfork.config import GenerationConfig, SpecConfig
from specfork.engine import Generator
from specfork.loading.loader import LoadedModel, load_model

NEAR_TIE = 0.25
PROMPTS = [
    "Explain how a refrigerator works.",
    "Write a short poem about the sea.",
    "Summarize: Cats are small mammals. Cats like to sleep. Cats are popular pets around the "
    "world. Many people keep cats.",
    "Translate to French: The weather is nice today and we are going to the park.",
    "What is 17 times 23? Show your work.",
]
SPECS = {
    "ngram": SpecConfig("speculative", "ngram", k=4),
    "self-draft-model": SpecConfig("speculative", "model:smollm2-135m-instruct", k=4),
}


@pytest.fixture(scope="module")
def smollm_bf16() -> LoadedModel:
    return load_model(
        "smollm2-135m-instruct", dtype="bfloat16", device="cpu", kernels=False, progress=False
    )


@pytest.fixture(scope="module")
def plain_runs(smollm_bf16: LoadedModel) -> list:
    plain = Generator(smollm_bf16)
    return [plain.generate(p, config=GenerationConfig(max_new_tokens=96)) for p in PROMPTS]


def _top2_gap(loaded: LoadedModel, ids: list[int]) -> float:
    with torch.inference_mode():
        cache = loaded.model.new_cache(len(ids) + 8)
        top = loaded.model.extend(ids, cache).topk(2).values
    return float(top[0] - top[1])


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SPECS))
def test_bf16_differences_start_at_near_ties(
    smollm_bf16: LoadedModel,
    plain_runs: list,
    name: str,
    record_property: Callable[[str, object], None],
) -> None:
    cfg = GenerationConfig(max_new_tokens=96)
    spec = Generator(smollm_bf16, spec=SPECS[name])
    matches, gaps = 0, []
    for prompt, a in zip(PROMPTS, plain_runs, strict=True):
        b = spec.generate(prompt, config=cfg)
        if a.token_ids == b.token_ids:
            matches += 1
            continue
        pairs = zip(a.token_ids, b.token_ids, strict=False)
        first = next((i for i, (x, y) in enumerate(pairs) if x != y), None)
        first = min(len(a.token_ids), len(b.token_ids)) if first is None else first
        gaps.append(_top2_gap(smollm_bf16, a.prompt_ids + a.token_ids[:first]))
    record_property("bf16_match_rate", matches / len(PROMPTS))
    record_property("bf16_divergence_gaps", gaps)
    assert all(g <= NEAR_TIE for g in gaps), f"differences not at near-ties: gaps {gaps}"
    assert matches >= 2, f"only {matches}/{len(PROMPTS)} bf16 runs identical (gaps {gaps})"
