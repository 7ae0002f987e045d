"""DSpark: the confidence schedule (unit), its config errors, the variable-K sampling loop."""

import math

import pytest
import torch

from distribution import chi2_sf, chi2_stat
from specfork.config import SpecConfig
from specfork.errors import ConfigError
from specfork.sampling import sample
from specfork.strategies.dspark import EMA_START, DSparkPolicy, block_signals
from specfork.strategies.policies import RoundInfo
from specfork.verify import verify_sampling

pytestmark = pytest.mark.usefixtures("one_thread")

V = 50


def _logits(top1: float, top2: float, rows: int = 1) -> torch.Tensor:
    """Logits [rows, V] whose softmax has top-1 `top1`, top-2 `top2`, the rest spread evenly."""
    rest = (1.0 - top1 - top2) / (V - 2)
    probs = torch.full((rows, V), rest)
    probs[:, 0], probs[:, 1] = top1, top2
    return probs.log()


def _policy(**kwargs) -> DSparkPolicy:
    """DSpark's policy; K in [2, 8] unless said (the figures below are worked out for 8)."""
    return DSparkPolicy(SpecConfig("dspark", **{"max_k": 8, **kwargs}))


def _info(drafted: int, accepted: int, logits: torch.Tensor) -> RoundInfo:
    return RoundInfo(drafted, accepted, generated=10, target_logits=logits)


# ----------------------------------------------------------------------------- signals


def test_block_signals_are_mean_top1_and_margin() -> None:
    logits = torch.cat([_logits(0.9, 0.05), _logits(0.5, 0.3)])  # [2, V]
    top1, margin = block_signals(logits)
    assert top1 == pytest.approx((0.9 + 0.5) / 2, abs=1e-5)
    assert margin == pytest.approx((0.85 + 0.2) / 2, abs=1e-5)


@pytest.mark.parametrize("spread", [0.1, 3.0, 40.0])
def test_block_signals_agree_with_a_full_softmax(spread: float) -> None:
    logits = torch.randn(4, 49152, generator=torch.Generator().manual_seed(7)) * spread
    top = logits.softmax(-1).topk(2, dim=-1).values  # [4, 2]
    top1, margin = block_signals(logits)
    assert top1 == pytest.approx(float(top[:, 0].mean()), abs=1e-5)
    assert margin == pytest.approx(float((top[:, 0] - top[:, 1]).mean()), abs=1e-5)


def test_confidence_uses_only_the_verified_rows() -> None:
    """Rows after the first rejection were conditioned on a rejected token: not used."""
    pol = _policy()
    logits = torch.cat([_logits(0.9, 0.05), _logits(0.9, 0.05), _logits(0.2, 0.19, rows=3)])
    conf = pol.confidence(_info(4, 1, logits))  # accepted 1: rows 0 and 1
    assert conf.top1 == pytest.approx(0.9, abs=1e-5)


def test_confidence_formula_default_weights() -> None:
    pol = _policy()
    pol.update(_info(4, 2, _logits(0.6, 0.3, rows=5)))  # EMA = 0.5 (first ratio)
    top1, margin, ema = 0.6, 0.3, 0.5
    want = 0.4 * top1 + 0.3 * min(5 * margin, 1) + 0.3 * ema
    assert pol.trace()["confidence"] == pytest.approx(want, abs=1e-3)


def test_margin_is_scaled_by_five_and_capped_at_one() -> None:
    pol = _policy(weights=(0.0, 1.0, 0.0))
    assert pol.confidence(_info(0, 0, _logits(0.5, 0.44))).value == pytest.approx(0.3, abs=1e-4)
    assert pol.confidence(_info(0, 0, _logits(0.9, 0.05))).value == pytest.approx(1.0)


def test_weights_are_normalised_by_their_sum() -> None:
    a = _policy(weights=(0.4, 0.3, 0.3)).confidence(_info(2, 1, _logits(0.7, 0.1, 2)))
    b = _policy(weights=(4.0, 3.0, 3.0)).confidence(_info(2, 1, _logits(0.7, 0.1, 2)))
    assert a.value == pytest.approx(b.value)


def test_ema_starts_at_the_first_ratio_then_moves_at_its_rate() -> None:
    pol = _policy(ema_rate=0.25)
    logits = _logits(0.5, 0.2, rows=5)
    assert pol.confidence(_info(0, 0, logits[:1])).ema == EMA_START  # nothing drafted yet
    pol.update(_info(4, 4, logits))
    assert pol.ema == 1.0
    pol.update(_info(4, 0, logits))
    assert pol.ema == pytest.approx(1.0 + 0.25 * (0.0 - 1.0))
    pol.update(_info(0, 0, logits[:1]))  # an empty draft leaves the EMA alone
    assert pol.ema == pytest.approx(0.75)


# ----------------------------------------------------------------------------- schedule


@pytest.mark.parametrize(
    ("c", "k"),
    [(0.0, 2), (0.3, 2), (0.4, 4), (0.5, 5), (0.6, 7), (0.7, 8), (1.0, 8)],
)
def test_schedule_maps_low_high_onto_min_max_and_clamps(c: float, k: int) -> None:
    # min_k + (max_k - min_k)(c - low)/(high - low) = 2 + 6 (c - 0.3)/0.4, rounded, clamped
    assert _policy().schedule(c) == k


def test_k_rises_after_an_accepted_round() -> None:
    pol = _policy()
    assert pol.next_shape(0).depth == 2
    pol.update(_info(2, 2, _logits(0.95, 0.01, rows=3)))
    assert pol.next_shape(3).depth == 8


def test_k_may_not_rise_when_nothing_was_accepted() -> None:
    """An empty draft (no n-gram match) with a confident target: K stays where it was."""
    pol = _policy()
    pol.update(_info(0, 0, _logits(0.99, 0.005)))
    assert pol.schedule(pol.trace()["confidence"]) == 8  # the mapping alone would rise
    assert pol.next_shape(1).depth == 2


def test_k_may_fall_without_acceptance() -> None:
    pol = _policy()
    pol.update(_info(2, 2, _logits(0.95, 0.01, rows=3)))  # K -> 8
    pol.update(_info(0, 0, _logits(0.3, 0.29)))  # empty draft, low confidence
    assert pol.next_shape(5).depth < 8


def test_first_token_rejection_drops_k_to_min_at_once() -> None:
    pol = _policy(min_k=3, max_k=9)
    pol.update(_info(3, 3, _logits(0.95, 0.01, rows=4)))
    assert pol.next_shape(4).depth == 9
    pol.update(_info(9, 0, _logits(0.99, 0.001, rows=10)))  # confident, yet the first failed
    assert pol.next_shape(5).depth == 3
    assert pol.trace()["first_rejection_rate"] == 0.5


def test_begin_starts_a_request_fresh() -> None:
    old = _policy()
    old.update(_info(2, 2, _logits(0.95, 0.01, rows=3)))
    pol = old.begin()
    assert old.ema is not None  # the other request keeps its state
    assert (pol.next_shape(0).depth, pol.ema, pol.first_rejection_rate, pol.trace()) == (
        2,
        None,
        0.0,
        {},
    )


def test_trace_has_the_documented_fields() -> None:
    pol = _policy()
    pol.update(_info(2, 1, _logits(0.8, 0.1, rows=3)))
    fields = {"top1", "margin", "ema", "confidence", "next_k", "first_rejection_rate"}
    fields |= {"low", "high", "min_k"}  # the settings C and K are mapped with, for plots
    assert set(pol.trace()) == fields


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"min_k": 0}, "min_k"),
        ({"min_k": 4, "max_k": 3}, "max_k"),
        ({"low": 0.7, "high": 0.7}, "low < high"),
        ({"low": 0.8, "high": 0.2}, "low < high"),
        ({"high": math.nan}, "low < high"),
        ({"weights": (0.5, -0.1, 0.6)}, "weights"),
        ({"weights": (0.0, 0.0, 0.0)}, "positive sum"),
        ({"weights": (0.5, 0.5)}, "three numbers"),
        ({"ema_rate": 0.0}, "ema_rate"),
        ({"ema_rate": 1.5}, "ema_rate"),
    ],
)
def test_bad_dspark_settings_are_clear_errors(kwargs: dict, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        SpecConfig("dspark", **kwargs)


def test_ema_rate_of_one_is_allowed() -> None:
    assert SpecConfig("dspark", ema_rate=1.0).ema_rate == 1.0


# ----------------------------------------------------------------------------- sampling


def _bigram(seed: int, sharp: float) -> torch.Tensor:
    """A random bigram model: row i is the distribution of the token after token i, [V', V']."""
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(sharp * torch.randn(8, 8, generator=g), dim=-1)


def _speculative_sequences(
    p: torch.Tensor,
    q: torch.Tensor,
    n_seq: int,
    length: int,
    cheat: bool = False,
    own_confidence: bool = False,
    low: float = 0.2,
) -> tuple[torch.Tensor, set]:
    """The engine's loop over a bigram target p and bigram drafter q, K chosen by DSpark.

    Returns [n_seq, length] tokens after a fixed start token 0, and the draft lengths used.
    With `cheat` the draft is cut after it was drawn (before the first token with q > p): a
    draft length chosen by looking at the draft, which biases the output and must fail.
    With `own_confidence` the drafter also stops by the shape's `StepConfidence` on its own q
    row before each token (what a draft head does under DSpark): allowed, it never looks at
    the token it would draw nor at p.
    """
    gen = torch.Generator().manual_seed(1234)
    pol = DSparkPolicy(SpecConfig("dspark", min_k=1, max_k=4, low=low, high=low + 0.4))
    out = torch.empty(n_seq, length, dtype=torch.long)
    used: set[int] = set()
    for s in range(n_seq):
        pol.reset()
        seq = [0]
        while len(seq) <= length:
            shape = pol.next_shape(len(seq) - 1)
            k = shape.depth
            draft, q_rows = [], []
            for _ in range(k):
                row = q[(draft or seq)[-1]]
                if own_confidence and not shape.confidence.allows(row):
                    break
                draft.append(int(sample(row, gen)))
                q_rows.append(row)
            used.add((k, len(draft)) if own_confidence else k)
            if cheat:  # drop the draft from the first token the target likes less than q
                ctx = [seq[-1], *draft]
                cut = next((i for i, x in enumerate(draft) if q_rows[i][x] > p[ctx[i]][x]), k)
                draft, q_rows = draft[:cut], q_rows[:cut]
            ctx = [seq[-1], *draft]
            p_rows = p[torch.tensor(ctx)]  # [K + 1, V']
            q_k = torch.stack(q_rows) if q_rows else torch.empty(0, p.shape[1])  # [K, V']
            verdict = verify_sampling(torch.tensor(draft, dtype=torch.long), p_rows, q_k, gen)
            pol.update(RoundInfo(len(draft), verdict.accepted, len(seq), p_rows.log()))
            seq += verdict.tokens
        out[s] = torch.tensor(seq[1 : length + 1])
    return out, used


def _position_pvalue(seqs: torch.Tensor, p: torch.Tensor, position: int) -> float:
    """Fit of the token at `position` to p given the token before (start token 0 at 0)."""
    prev = seqs[:, position - 1] if position else torch.zeros(len(seqs), dtype=torch.long)
    stat, dof = 0.0, 0
    for c in prev.unique().tolist():
        counts = torch.bincount(seqs[prev == c, position], minlength=p.shape[1]).double()
        if counts.sum() >= 50:
            s, d = chi2_stat(counts, p[c].double())
            stat, dof = stat + s, dof + d
    return chi2_sf(stat, dof)


def test_sampling_with_dspark_variable_k_keeps_the_target_distribution() -> None:
    p, q = _bigram(1, 1.5), _bigram(2, 1.5)
    seqs, used = _speculative_sequences(p, q, n_seq=6000, length=4)
    assert used == {1, 2, 3, 4}  # K really varied
    for pos in range(4):
        assert _position_pvalue(seqs, p, pos) > 1e-3, pos


def test_a_drafter_stopping_by_its_own_confidence_keeps_the_target_distribution() -> None:
    """DSpark's rule applied to the drafter's own q before each token (a draft head's early
    stop) changes how much is drafted, never the distribution of the output."""
    p, q = _bigram(1, 1.5), _bigram(2, 3.0)  # a sharp q: some rows pass the rule, some not
    seqs, used = _speculative_sequences(p, q, 6000, 4, own_confidence=True, low=0.5)
    stops = {n for k, n in used if n < k}
    assert len(stops) >= 2 and 0 in stops  # the drafter really stopped early, at varied depths
    for pos in range(4):
        assert _position_pvalue(seqs, p, pos) > 1e-3, pos


def test_a_policy_that_peeks_at_the_draft_fails_the_same_test() -> None:
    p, q = _bigram(1, 1.5), _bigram(2, 1.5)
    seqs, _ = _speculative_sequences(p, q, n_seq=6000, length=4, cheat=True)
    assert min(_position_pvalue(seqs, p, pos) for pos in range(4)) < 1e-3


def test_extreme_thresholds_never_break_the_schedule() -> None:
    """Finite settings whose arithmetic overflows are refused (weights summing past float's
    range, high - low infinite); a range narrower than float's resolution still schedules."""
    for bad in ({"weights": (1.79e308, 1.79e308, 0.0)}, {"low": -1e308, "high": 1e308}):
        with pytest.raises(ConfigError):
            SpecConfig("dspark", **bad)
    policy = DSparkPolicy(SpecConfig("dspark", low=0.0, high=5e-324, min_k=2, max_k=8))
    assert [policy.schedule(c) for c in (0.0, 1e-300, 1.0)] == [2, 8, 8]
    assert policy.schedule(float("nan")) == 2
