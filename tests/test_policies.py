"""Draft-length policies (constant, heuristic, linear decay), make_policy and SpecConfig checks."""

import pytest

from specfork.config import SpecConfig
from specfork.errors import ConfigError
from specfork.strategies.policies import (
    POLICIES,
    ConstantK,
    HeuristicK,
    LinearDecayK,
    RoundInfo,
    make_policy,
)


def round_info(drafted: int, accepted: int, generated: int = 0) -> RoundInfo:
    return RoundInfo(drafted=drafted, accepted=accepted, generated=generated)


# ---------------------------------------------------------------------------------- ConstantK


def test_constant_k_never_changes():
    policy = ConstantK(4)
    assert policy.name == "constant"
    for generated, info in enumerate([round_info(4, 4), round_info(4, 0), round_info(0, 0)]):
        assert policy.next_shape(generated * 10).depth == 4
        policy.update(info)
    assert policy.begin() is policy  # no state: every request shares it
    assert policy.next_shape(1000).depth == 4


# --------------------------------------------------------------------------------- HeuristicK


def test_heuristic_plus_two_after_full_acceptance_minus_one_otherwise():
    policy = HeuristicK(3, k_max=10)
    assert policy.name == "heuristic"
    assert policy.next_shape(0).depth == 3
    policy.update(round_info(3, 3))  # fully accepted: +2
    assert policy.next_shape(4).depth == 5
    policy.update(round_info(5, 4))  # one rejected: -1
    assert policy.next_shape(9).depth == 4
    policy.update(round_info(4, 0))  # all rejected: also just -1
    assert policy.next_shape(10).depth == 3


def test_heuristic_bounds():
    policy = HeuristicK(2, k_max=5)
    ks = []
    for _ in range(4):  # always fully accepted: 2 -> 4 -> 5 (capped) -> 5
        k = policy.next_shape(0).depth
        policy.update(round_info(k, k))
        ks.append(policy.next_shape(0).depth)
    assert ks == [4, 5, 5, 5]
    ks = []
    for _ in range(7):  # always rejected: 5 -> 4 -> ... -> 1, never below 1
        k = policy.next_shape(0).depth
        policy.update(round_info(k, 0))
        ks.append(policy.next_shape(0).depth)
    assert ks == [4, 3, 2, 1, 1, 1, 1]


def test_heuristic_default_k_max_is_twice_k():
    policy = HeuristicK(3)
    for _ in range(5):
        k = policy.next_shape(0).depth
        policy.update(round_info(k, k))
    assert policy.next_shape(0).depth == 6


def test_heuristic_empty_draft_rounds_do_not_change_k():
    policy = HeuristicK(3, k_max=8)
    policy.update(round_info(0, 0))  # 0 == 0 would otherwise count as "fully accepted"
    assert policy.next_shape(1).depth == 3
    policy.update(round_info(3, 1))
    assert policy.next_shape(2).depth == 2
    policy.update(round_info(0, 0))
    assert policy.next_shape(3).depth == 2


def test_heuristic_begin_gives_a_request_the_start():
    policy = HeuristicK(3, k_max=8)
    policy.update(round_info(3, 3))
    assert policy.next_shape(0).depth == 5
    fresh = policy.begin()
    assert fresh.next_shape(0).depth == 3 and fresh.k_max == 8
    assert policy.next_shape(0).depth == 5  # another request's state is untouched


def test_heuristic_start_above_k_max_is_clamped_or_rejected():
    try:
        policy = HeuristicK(5, k_max=3)
    except ConfigError:
        return  # rejecting an inconsistent configuration is also acceptable
    assert 1 <= policy.next_shape(0).depth <= 3


def test_heuristic_k_max_zero_is_rejected():
    with pytest.raises(ConfigError):
        HeuristicK(3, k_max=0)


@pytest.mark.parametrize(("k", "k_max"), [(0, None), (-1, None), (2, -1), (1.5, None), (True, 3)])
def test_heuristic_invalid_arguments(k, k_max):
    with pytest.raises(ConfigError):
        HeuristicK(k, k_max=k_max)


# ------------------------------------------------------------------------------ LinearDecayK


@pytest.mark.parametrize(
    ("k_max", "expected", "generated", "k"),
    [
        (8, 100, 0, 8),
        (8, 100, 25, 6),
        (8, 100, 50, 4),
        (8, 100, 90, 1),  # round(0.8) = 1
        (8, 100, 94, 1),  # round(0.48) = 0 -> floor of 1
        (8, 100, 100, 1),  # T reached
        (8, 100, 250, 1),  # past T: negative -> 1
        (5, 10, 3, 4),  # round(3.5) = 4
        (6, 7, 2, 4),  # round(4.2857) = 4
        (1, 10, 0, 1),
    ],
)
def test_linear_decay_values(k_max, expected, generated, k):
    policy = LinearDecayK(k_max, expected)
    assert policy.name == "linear-decay"
    assert policy.next_shape(generated).depth == k


def test_linear_decay_matches_formula_and_is_monotone():
    k_max, total = 7, 37
    policy = LinearDecayK(k_max, total)
    ks = [policy.next_shape(t).depth for t in range(0, 60)]
    assert ks == [max(1, round(k_max * (1 - t / total))) for t in range(0, 60)]
    assert ks == sorted(ks, reverse=True)  # non-increasing
    assert ks[0] == k_max and ks[-1] == 1
    policy.update(round_info(7, 7, generated=7))  # history does not matter
    assert policy.begin().next_shape(10).depth == ks[10]


@pytest.mark.parametrize(("k_max", "expected"), [(0, 10), (3, 0), (-2, 10), (3, -1), (2.0, 10)])
def test_linear_decay_invalid_arguments(k_max, expected):
    with pytest.raises(ConfigError):
        LinearDecayK(k_max, expected)


# ------------------------------------------------------------------------------- make_policy


@pytest.mark.parametrize(
    ("name", "cls"),
    [("constant", ConstantK), ("heuristic", HeuristicK), ("linear-decay", LinearDecayK)],
)
def test_make_policy_by_name(name, cls):
    policy = make_policy(name, 4, 100)
    assert isinstance(policy, cls)
    assert policy.name == name
    assert policy.next_shape(0).depth == 4
    assert name in POLICIES


@pytest.mark.parametrize("name", ["", "Constant", "adaptive", "linear_decay"])
def test_make_policy_unknown_name(name):
    with pytest.raises(ConfigError, match="unknown draft-length policy"):
        make_policy(name, 4, 100)


@pytest.mark.parametrize("name", POLICIES)
@pytest.mark.parametrize("k", [0, -3])
def test_make_policy_k_below_one(name, k):
    with pytest.raises(ConfigError):
        make_policy(name, k, 100)


# -------------------------------------------------------------------------------- SpecConfig


def test_spec_config_defaults_and_valid_values():
    spec = SpecConfig()
    assert (spec.strategy, spec.drafter, spec.k, spec.k_policy) == ("ar", "ngram", 16, "constant")
    assert (spec.min_k, spec.max_k) == (2, 16)
    SpecConfig(strategy="speculative", drafter="self", k=1, self_layers="0-11")
    SpecConfig(strategy="speculative", drafter="self", skip_layers="3,5")
    SpecConfig(strategy="speculative", drafter="model:/some/path")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"strategy": "tree"}, "unknown strategy"),
        ({"strategy": ""}, "unknown strategy"),
        ({"drafter": "eagle"}, "unknown drafter"),
        ({"drafter": "Model:x"}, "unknown drafter"),
        ({"k": 0}, "k"),
        ({"k": -1}, "k"),
        ({"k": 2.0}, "k"),
        ({"k": True}, "k"),
        ({"drafter": "self", "self_layers": "0-11", "skip_layers": "3"}, "not both"),
    ],
)
def test_spec_config_validation_errors(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        SpecConfig(**kwargs)
