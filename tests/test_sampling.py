"""Sampling: greedy = argmax, masks of top-k/top-p/min-p, seeded reproducibility, validation."""

import math

import pytest
import torch

from specfork.config import SamplingParams
from specfork.errors import ConfigError
from specfork.sampling import make_generator, next_token, probabilities, sample


def test_greedy_is_argmax_one_hot():
    logits = torch.randn(4, 50)
    p = probabilities(logits, SamplingParams(temperature=0))
    assert torch.equal(p.argmax(-1), logits.argmax(-1))
    assert torch.equal(p.sum(-1), torch.ones(4))
    assert next_token(logits[0], SamplingParams(), make_generator(0)) == int(logits[0].argmax())


def test_temperature_scales_logits():
    logits = torch.tensor([1.0, 2.0, 3.0])
    p = probabilities(logits, SamplingParams(temperature=0.5))
    assert torch.allclose(p, torch.softmax(logits / 0.5, -1))


def test_top_k_keeps_k_largest():
    logits = torch.tensor([0.1, 3.0, 2.0, -1.0, 2.5])
    p = probabilities(logits, SamplingParams(temperature=1.0, top_k=2))
    assert set(torch.nonzero(p).flatten().tolist()) == {1, 4}
    expected = torch.softmax(torch.tensor([3.0, 2.5]), -1)
    assert torch.allclose(p[[1, 4]], expected)


def test_top_p_smallest_set_reaching_mass():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    p = probabilities(probs.log(), SamplingParams(temperature=1.0, top_p=0.8))
    assert torch.nonzero(p).flatten().tolist() == [0, 1]  # 0.5 + 0.3 reaches 0.8
    p = probabilities(probs.log(), SamplingParams(temperature=1.0, top_p=0.81))
    assert torch.nonzero(p).flatten().tolist() == [0, 1, 2]
    p = probabilities(probs.log(), SamplingParams(temperature=1.0, top_p=0.01))
    assert torch.nonzero(p).flatten().tolist() == [0]  # never empty


def test_min_p_relative_to_max():
    probs = torch.tensor([0.6, 0.25, 0.1, 0.05])
    p = probabilities(probs.log(), SamplingParams(temperature=1.0, min_p=0.2))
    assert torch.nonzero(p).flatten().tolist() == [0, 1]  # threshold 0.12
    assert math.isclose(float(p.sum()), 1.0, rel_tol=1e-6)


def test_seeded_sampling_reproduces_and_seeds_differ():
    logits = torch.randn(1000)
    params = SamplingParams(temperature=1.0)
    draws = [[next_token(logits, params, g) for _ in range(30)] for g in (make_generator(5),
             make_generator(5))]  # fmt: skip
    assert draws[0] == draws[1]
    other = [next_token(logits, params, make_generator(6)) for _ in range(30)]
    assert other != draws[0]


def test_sample_frequencies_follow_probabilities():
    probs = torch.tensor([0.1, 0.2, 0.7])
    draws = sample(probs.expand(20000, 3), make_generator(0))
    freq = torch.bincount(draws, minlength=3).float() / 20000
    assert torch.allclose(freq, probs, atol=0.015)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -0.1},
        {"temperature": float("nan")},
        {"temperature": float("inf")},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"top_k": -2},
        {"min_p": -0.1},
        {"min_p": 1.1},
    ],
)
def test_invalid_values_rejected(kwargs):
    with pytest.raises(ConfigError):
        SamplingParams(**kwargs)


def test_top_k_minus_one_is_off_as_in_vllm() -> None:
    assert SamplingParams(temperature=1.0, top_k=-1) == SamplingParams(temperature=1.0, top_k=0)


def test_temperatures_and_top_p_below_float32s_range_stay_distributions() -> None:
    """A temperature under 1e-5 is greedy (vLLM's rule: dividing float32 logits by less
    overflows); a top_p that is 0 in float32 keeps the most likely token."""
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    for t in (5e-324, 1e-46, 1e-6):
        assert SamplingParams(temperature=t).greedy
    assert not SamplingParams(temperature=1e-5).greedy
    for top_p in (5e-324, 1e-46):
        probs = probabilities(logits, SamplingParams(temperature=1.0, top_p=top_p))
        assert torch.isfinite(probs).all()
        assert torch.equal(probs.argmax(-1), logits.argmax(-1))
        assert torch.allclose(probs.amax(-1), torch.ones(4))
