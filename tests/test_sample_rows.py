"""kernels.sample_rows: the kernels' temperature softmax and draw against `specfork.sampling`."""

from __future__ import annotations

import pytest
import torch

from distribution import goodness_of_fit
from isa_run import run_under, skip_unless_lower
from specfork.config import SamplingParams
from specfork.kernels import load_kernels
from specfork.kernels import logit_rows as logit_rows_module
from specfork.kernels.sample_rows import (
    fast_draw,
    fast_next_token,
    fast_probabilities,
    fast_sample,
    fast_sample_at,
)
from specfork.sampling import (
    draw,
    keyed_uniform,
    next_token,
    probabilities,
    sample,
    sample_at,
)

K = load_kernels()
needs_kernels = pytest.mark.skipif(K is None, reason="the kernels cannot be built here")
INF = float("inf")


@needs_kernels
@pytest.mark.parametrize(("rows", "vocab"), [(1, 49152), (4, 1000), (3, 37), (2, 1)])
@pytest.mark.parametrize("temperature", [0.05, 0.7, 1.0, 3.0])
def test_softmax_matches_sampling_probabilities(rows: int, vocab: int, temperature: float) -> None:
    x = 4 * torch.randn(rows, vocab, generator=torch.Generator().manual_seed(rows + vocab))
    params = SamplingParams(temperature=temperature)
    got = fast_probabilities(x, params)
    assert got.shape == (rows, vocab) and got.dtype == torch.float32
    assert torch.allclose(got, probabilities(x, params), rtol=1e-5, atol=1e-9)


@needs_kernels
def test_minus_inf_is_exactly_zero_and_never_drawn() -> None:
    x = torch.randn(1, 3000)
    x[0, ::2] = -INF  # a grammar's mask: every even token forbidden
    p = fast_probabilities(x, SamplingParams(temperature=1.0))
    assert bool((p[0, ::2] == 0).all()) and float(p.sum()) == pytest.approx(1.0, abs=1e-5)
    g = torch.Generator().manual_seed(0)
    drawn = torch.stack([fast_sample(p[0], g) for _ in range(2000)])
    assert bool((drawn % 2 == 1).all())


@needs_kernels
@pytest.mark.parametrize("bad", [float("nan"), INF])
def test_rows_without_a_distribution_are_refused_as_sample_refuses_them(bad: float) -> None:
    x = torch.randn(2, 50)
    x[1, 7] = bad
    p = fast_probabilities(x, SamplingParams(temperature=0.8))
    assert bool(p[1].isnan().all()) and bool(probabilities(x, SamplingParams(0.8))[1].isnan().all())
    g = torch.Generator().manual_seed(0)
    fast_sample(p[0], g)  # the good row draws
    with pytest.raises(ValueError, match="no finite probability mass"):
        fast_sample_at(p[1], 0.5)
    for row in (p[1], torch.full((50,), -INF).softmax(-1), torch.zeros(50)):
        with pytest.raises(ValueError, match="no finite probability mass"):
            fast_sample(row, g)
        with pytest.raises(ValueError, match="no finite probability mass"):
            sample(row, g)


@needs_kernels
@pytest.mark.parametrize("vocab", [5, 511, 512, 513, 49152])
def test_the_draw_is_samples_own_from_the_same_stream(vocab: int) -> None:
    """The same uniform from the same generator gives the same token (the cumulative sums'
    rounding differs, which moves a draw only within ~1e-16 of a boundary), and the stream
    is left where `sample` leaves it."""
    gen = torch.Generator().manual_seed(vocab)
    p = torch.rand(vocab, generator=gen) ** 4  # uneven, unnormalised
    p[::3] = 0.0
    if vocab > 1000:
        p[20000:] = 0.0  # mass only in the first blocks
    a, b = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    drawn = [int(fast_sample(p, a)) for _ in range(300)]
    assert drawn == [int(sample(p, b)) for _ in range(300)]
    assert torch.equal(a.get_state(), b.get_state())
    keyed = [keyed_uniform(vocab, t) for t in range(300)]
    assert [fast_sample_at(p, u) for u in keyed] == [sample_at(p, u) for u in keyed]
    batch = fast_sample(torch.stack([p, p.flip(0)]), a)  # rows: one draw each
    assert batch.shape == (2,) and torch.equal(batch, sample(torch.stack([p, p.flip(0)]), b))


@needs_kernels
def test_draws_follow_the_distribution_and_a_wrong_one_fails() -> None:
    x = torch.randn(1, 40, generator=torch.Generator().manual_seed(3))
    params = SamplingParams(temperature=0.7)
    p = fast_probabilities(x, params)[0]
    g = torch.Generator().manual_seed(5)
    counts = torch.bincount(torch.stack([fast_sample(p, g) for _ in range(20000)]), minlength=40)
    assert goodness_of_fit(counts, probabilities(x, params)[0]) > 1e-3
    wrong = probabilities(x, SamplingParams(temperature=1.0))[0]  # negative control
    assert goodness_of_fit(counts, wrong) < 1e-6


@needs_kernels
def test_top_k_top_p_and_min_p_apply_around_the_kernels_softmax() -> None:
    x = 2 * torch.randn(3, 3000, generator=torch.Generator().manual_seed(8))
    for params in (
        SamplingParams(temperature=0.7, top_p=0.9),
        SamplingParams(temperature=0.7, top_k=20),
        SamplingParams(temperature=1.3, min_p=0.05),
        SamplingParams(temperature=0.5, top_k=50, top_p=0.8, min_p=0.01),
    ):
        got, want = fast_probabilities(x, params), probabilities(x, params)
        assert torch.equal(got > 0, want > 0), params  # the same tokens kept
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-9), params


def test_greedy_and_other_dtypes_go_through_sampling_unchanged() -> None:
    x = torch.randn(3, 300)
    assert torch.equal(fast_probabilities(x, SamplingParams()), probabilities(x, SamplingParams()))
    params = SamplingParams(temperature=0.7, top_p=0.9)
    assert torch.equal(fast_probabilities(x.double(), params), probabilities(x.double(), params))


def test_without_loaded_kernels_sampling_answers(monkeypatch) -> None:
    monkeypatch.setattr(logit_rows_module, "loaded_kernels", lambda: None)
    x = torch.randn(2, 100)
    params = SamplingParams(temperature=0.9)
    assert torch.equal(fast_probabilities(x, params), probabilities(x, params))
    a, b = torch.Generator().manual_seed(2), torch.Generator().manual_seed(2)
    fast = fast_sample(fast_probabilities(x, params), a)
    assert torch.equal(fast, sample(probabilities(x, params), b))


ISA_SCRIPT = """
import sys, torch
from specfork.config import SamplingParams
from specfork.kernels import load_kernels
from specfork.kernels.sample_rows import (
    fast_draw,
    fast_probabilities,
    fast_sample,
    fast_sample_at,
)
assert load_kernels().isa().startswith(sys.argv[2])
x = torch.load(sys.argv[1])
p = fast_probabilities(x, SamplingParams(temperature=0.6))
tokens = fast_sample(p[[0, 1, 2, 4]], torch.Generator().manual_seed(4))
torch.save((p, tokens), sys.argv[1] + ".out")
"""


@needs_kernels
@pytest.mark.parametrize("isa", ["generic", "avx2"])
def test_every_instruction_set_computes_the_same(tmp_path, isa: str) -> None:
    skip_unless_lower(K, isa)
    x = 3 * torch.randn(5, 5003, generator=torch.Generator().manual_seed(12))
    x[1, 10:4000] = -INF
    x[3, 4] = float("nan")
    p, tokens = run_under(isa, ISA_SCRIPT, x, tmp_path)
    ours = fast_probabilities(x, SamplingParams(temperature=0.6))
    assert torch.equal(p.isnan(), ours.isnan()) and bool((p[1, 10:4000] == 0).all())
    good = [0, 1, 2, 4]
    # exp's last bits differ by ISA, and an exponent of −60 carries ~4e-6 of rounding
    assert torch.allclose(p[good], ours[good], rtol=1e-4, atol=1e-9)
    assert torch.equal(tokens, fast_sample(ours[good], torch.Generator().manual_seed(4)))


@needs_kernels
def test_a_temperature_past_float32s_range_is_uniform_over_the_finite_logits() -> None:
    """As x / t gives it in float32 (t rounds to inf: every finite logit becomes 0); a masked
    token keeps probability 0 (where PyTorch's −inf / inf makes the row NaN)."""
    x = torch.randn(2, 300)
    x[1, :100] = -INF
    params = SamplingParams(temperature=1e308)  # 1 / t is a subnormal double
    p = fast_probabilities(x, params)
    assert torch.allclose(p[0], probabilities(x, params)[0], atol=1e-9)
    assert bool((p[1, :100] == 0).all()) and torch.allclose(p[1, 100:], torch.full((200,), 1 / 200))


@needs_kernels
def test_fast_draw_is_samplings_draw() -> None:
    q = fast_probabilities(torch.randn(1, 5000), SamplingParams(temperature=0.8))[0]
    seeded = SamplingParams(temperature=0.8, seed=11)
    assert [fast_draw(q, seeded, torch.Generator(), t) for t in range(50)] == [
        draw(q, seeded, torch.Generator(), t) for t in range(50)
    ]
    a, b = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    free = SamplingParams(temperature=0.8)
    assert [fast_draw(q, free, a, t) for t in range(50)] == [draw(q, free, b, t) for t in range(50)]


@needs_kernels
def test_fast_next_token_is_samplings_next_token() -> None:
    logits = 2 * torch.randn(3000, generator=torch.Generator().manual_seed(6))  # [V]
    for params in (
        SamplingParams(),
        SamplingParams(temperature=0.9, seed=4),
        SamplingParams(temperature=0.9, top_p=0.8),
    ):
        a, b = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
        got = [fast_next_token(logits, params, a, t) for t in range(40)]
        assert got == [next_token(logits, params, b, t) for t in range(40)], params
