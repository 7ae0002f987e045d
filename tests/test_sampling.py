"""Sampling: greedy = argmax, masks of top-k/top-p/min-p, seeded reproducibility, validation."""

import math

import pytest
import torch

from distribution import goodness_of_fit
from specfork.config import SamplingParams
from specfork.errors import ConfigError
from specfork.sampling import (
    draw,
    keyed_uniform,
    make_generator,
    next_token,
    probabilities,
    sample,
    sample_at,
)


def test_greedy_is_argmax_one_hot():
    logits = torch.randn(4, 50)
    p = probabilities(logits, SamplingParams(temperature=0))
    assert torch.equal(p.argmax(-1), logits.argmax(-1))
    assert torch.equal(p.sum(-1), torch.ones(4))
    assert next_token(logits[0], SamplingParams(), make_generator(0), 0) == int(logits[0].argmax())


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


def _top_p_by_full_sort(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The reference: sort the whole vocabulary, keep tokens whose mass before is < top_p."""
    values, order = probs.sort(dim=-1, descending=True)
    drop = values.cumsum(-1) - values >= top_p
    drop[..., 0] = False
    return torch.zeros_like(probs).scatter(-1, order, values.masked_fill(drop, 0.0))


@pytest.mark.parametrize("spread", [0.5, 3.0, 8.0])  # flat rows (the whole sort) to peaked ones
def test_top_p_over_a_large_vocabulary_keeps_the_set_a_full_sort_keeps(spread: float) -> None:
    """Top-p looks among the 256 or 4,096 likeliest tokens first; rows whose set lies beyond
    (flat rows) and batches mixing both kinds keep exactly what a full sort keeps."""
    gen = torch.Generator().manual_seed(int(spread * 10))
    logits = torch.randn(6, 20000, generator=gen) * spread  # [6, V]
    logits[0] *= 4.0  # one peaked row beside the others
    for top_p in (0.5, 0.9, 0.97):
        params = SamplingParams(temperature=1.0, top_p=top_p)
        expected = _top_p_by_full_sort(logits.softmax(-1), top_p)
        expected = expected / expected.sum(-1, keepdim=True)
        got = probabilities(logits, params)
        assert torch.equal(got > 0, expected > 0)
        assert torch.allclose(got, expected, atol=1e-7)
        assert torch.equal(probabilities(logits[:1], params)[0] > 0, expected[0] > 0)


def test_min_p_relative_to_max():
    probs = torch.tensor([0.6, 0.25, 0.1, 0.05])
    p = probabilities(probs.log(), SamplingParams(temperature=1.0, min_p=0.2))
    assert torch.nonzero(p).flatten().tolist() == [0, 1]  # threshold 0.12
    assert math.isclose(float(p.sum()), 1.0, rel_tol=1e-6)


def test_seeded_sampling_reproduces_and_seeds_differ():
    logits = torch.randn(1000)
    params = SamplingParams(temperature=1.0)
    draws = [
        [next_token(logits, params, g, i) for i in range(30)]
        for g in (make_generator(5), make_generator(5))
    ]
    assert draws[0] == draws[1]
    other = [next_token(logits, params, make_generator(6), i) for i in range(30)]
    assert other != draws[0]


def test_sample_frequencies_follow_probabilities():
    probs = torch.tensor([0.1, 0.2, 0.7])
    draws = sample(probs.expand(20000, 3), make_generator(0))
    freq = torch.bincount(draws, minlength=3).float() / 20000
    assert torch.allclose(freq, probs, atol=0.015)


def test_sample_never_draws_a_zero_probability_token_and_takes_unnormalised_rows() -> None:
    """Zeros at the start, the middle and the end of a row (where a cumulative distribution
    is flat), and a row whose total is not 1: frequencies follow the normalised row."""
    probs = torch.tensor([0.0, 0.2, 0.0, 0.0, 0.6, 0.2, 0.0]) * 3.0  # total 3
    draws = sample(probs.expand(30000, 7), make_generator(1))
    freq = torch.bincount(draws, minlength=7).float() / 30000
    assert freq[[0, 2, 3, 6]].sum() == 0
    assert torch.allclose(freq, probs / 3.0, atol=0.015)
    one_hot = torch.zeros(3, 49152)
    one_hot[torch.arange(3), torch.tensor([0, 777, 49151])] = 1.0
    assert sample(one_hot, make_generator(2)).tolist() == [0, 777, 49151]
    for broken in (
        torch.zeros(5),
        torch.tensor([0.5, float("nan"), 0.5]),
        torch.tensor([0.5, float("inf"), 0.5]),
    ):
        with pytest.raises(ValueError, match="no finite probability mass"):
            sample(broken, make_generator(3))


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


# ----------------------------------------------------------------------------- keyed draws


def _keyed_pairs(uniform, seeds: range, p1: torch.Tensor, p2: torch.Tensor) -> torch.Tensor:
    """Joint counts [V * V] of two-token sequences drawn the keyed way: x1 at position 10 from
    p1, x2 at position 11 from p2[x1], one sequence per seed."""
    vocab = p1.shape[0]
    counts = torch.zeros(vocab * vocab, dtype=torch.float64)
    for seed in seeds:
        x1 = sample_at(p1, uniform(seed, 10))
        x2 = sample_at(p2[x1], uniform(seed, 11))
        counts[x1 * vocab + x2] += 1
    return counts


def test_keyed_draws_follow_the_joint_distribution_and_a_broken_key_fails() -> None:
    """Across seeds, keyed draws at consecutive positions are distributed as the chain's joint
    (independent uniforms); a key that ignores the position (the same uniform at every
    position) correlates the two tokens and fails the same test."""
    gen = torch.Generator().manual_seed(0)
    p1 = torch.softmax(torch.randn(6, generator=gen), -1)  # [V]
    p2 = torch.softmax(1.5 * torch.randn(6, 6, generator=gen), -1)  # [V, V] given x1
    joint = (p1[:, None] * p2).flatten().double()  # [V * V]
    seeds = range(20_000)
    assert goodness_of_fit(_keyed_pairs(keyed_uniform, seeds, p1, p2), joint) > 1e-3
    broken = _keyed_pairs(lambda seed, position: keyed_uniform(seed, 0), seeds, p1, p2)
    assert goodness_of_fit(broken, joint) < 1e-6


def test_keyed_uniforms_are_fixed_by_seed_and_position() -> None:
    u = [keyed_uniform(7, t) for t in range(1000)]
    assert u == [keyed_uniform(7, t) for t in range(1000)]
    assert all(0.0 <= x < 1.0 for x in u) and len(set(u)) == 1000
    assert keyed_uniform(8, 3) != keyed_uniform(7, 3)
    assert keyed_uniform(2**63 - 1, 2**40) < 1.0  # the largest seed a request may give


def test_a_seeded_draw_is_keyed_and_an_unseeded_one_streams() -> None:
    """`draw` (drafters) and `next_token` (the target) agree at a seeded request's position,
    whatever the generator; unseeded they draw from it."""
    probs = torch.softmax(torch.randn(500), -1)
    seeded = SamplingParams(temperature=1.0, seed=3)
    logits = probs.log()
    for position in range(20):
        expected = sample_at(probabilities(logits, seeded), keyed_uniform(3, position))
        assert draw(probabilities(logits, seeded), seeded, make_generator(position), position) == (
            expected
        )
        assert next_token(logits, seeded, make_generator(99), position) == expected
    free = SamplingParams(temperature=1.0)
    a = [draw(probs, free, g, 0) for g in (make_generator(5),) for _ in range(20)]
    assert a == [draw(probs, free, g, 0) for g in (make_generator(5),) for _ in range(20)]
    assert len(set(a)) > 5  # the stream moves on: not one keyed draw repeated
