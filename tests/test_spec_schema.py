"""The one schema of SpecConfig's options: complete, converted the same way, and read the same
way by the CLI flags, the bench's spec strings and the server's `speculative` objects."""

from __future__ import annotations

import dataclasses

import pytest

from specfork.bench.specs import parse_strategy
from specfork.cli import build_parser
from specfork.cli.common import resolve_strategy, spec_from_args
from specfork.config import SpecConfig
from specfork.errors import ConfigError
from specfork.server.schemas import SPEC_KEYS
from specfork.spec_schema import (
    OPTIONS_BY_NAME,
    SPEC_OPTIONS,
    check_used,
    implied_strategy,
    option,
    spec_with,
)

# A value per option, as text, different from its default, and the strategy reading it.
SAMPLES = {
    "drafter": ("self", "speculative"),
    "k": ("3", "speculative"),
    "k_policy": ("heuristic", "speculative"),
    "self_layers": ("0-9", "speculative"),
    "skip_layers": ("10-19", "speculative"),
    "max_ngram": ("4", "speculative"),
    "min_ngram": ("2", "speculative"),
    "goodput": ("false", "speculative"),
    "payback": ("false", "dspark"),
    "cascade": ("true", "dspark"),
    "grammar_drafts": ("false", "spork"),
    "expected_length": ("99", "speculative"),
    "min_k": ("3", "dspark"),
    "max_k": ("9", "dspark"),
    "low": ("0.2", "dspark"),
    "high": ("0.8", "dspark"),
    "weights": ("0.5,0.25,0.25", "dspark"),
    "ema_rate": ("0.5", "dspark"),
    "margin_scale": ("2.5", "dspark"),
    "forks": ("3", "spork"),
    "depth": ("5", "spork"),
    "tree": ("dynamic", "spork"),
    "budget": ("30", "spork"),
    "tau": ("0.1", "spork"),
    "tau_max": ("0.3", "spork"),
    "target_acceptance": ("0.6", "spork"),
    "adapt": ("false", "spork"),
    "recycle_persist": ("true", "spork"),
    "recycle_prior": ("true", "spork"),
    "lossy_typical": ("true", "spork"),
    "typical_epsilon": ("0.2", "spork"),
    "typical_delta": ("0.5", "spork"),
}

# options of one drafter (the self drafter's layers) or drafter shape (a cascade's head)
DRAFTER_FOR = {"self_layers": "self", "skip_layers": "self", "cascade": "ngram+head"}


def test_every_specconfig_field_has_one_entry() -> None:
    fields = [f.name for f in dataclasses.fields(SpecConfig) if f.init and f.name != "strategy"]
    assert sorted(OPTIONS_BY_NAME) == sorted(fields)
    assert len(SPEC_OPTIONS) == len(OPTIONS_BY_NAME)
    assert set(SAMPLES) == set(fields)  # this test covers every option


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_each_option_reaches_the_config_from_every_front_end(name: str) -> None:
    """The same text gives the same SpecConfig from a flag, a bench spec and a JSON value."""
    text, strategy = SAMPLES[name]
    opt = option(name)
    value = opt.from_text(text)
    assert value != opt.default
    drafter = DRAFTER_FOR.get(name)  # the drafter an option goes with, if not the default
    extra = {"drafter": drafter} if drafter else {}
    from_json = spec_with(SpecConfig(), {"strategy": strategy, **extra, name: value})
    assert getattr(from_json, name) == value
    if name != "drafter":
        bench = parse_strategy(f"{strategy}{':' + drafter if drafter else ''}?{name}={text}")
        assert bench.spec == from_json
    if opt.cli:
        flags = [*_flag(opt, text), *(["--drafter", drafter] if drafter else [])]
        args = build_parser().parse_args(["generate", "--strategy", strategy, *flags])
        resolve_strategy(args)
        spec = spec_from_args(args, expected_length=from_json.expected_length)
        assert spec == from_json
    assert name in SPEC_KEYS


def _flag(opt, text: str) -> list[str]:
    if opt.kind is bool:
        return [opt.flag if opt.from_text(text) else f"--no-{opt.flag[2:]}"]
    return [opt.flag, text]


def test_text_conversion_errors_say_what_is_expected() -> None:
    with pytest.raises(ConfigError, match="must be an integer, got 'x'"):
        option("k").from_text("x")
    with pytest.raises(ConfigError, match="must be a number"):
        option("tau").from_text("high")
    with pytest.raises(ConfigError, match="true or false"):
        option("adapt").from_text("sometimes")
    assert option("self-layers").from_text("none") is None
    with pytest.raises(ConfigError, match="unknown option 'kk'; valid options: drafter, k,"):
        option("kk")


def test_an_option_the_strategy_does_not_read_is_an_error() -> None:
    check_used("spork", ["drafter", "goodput", "max_ngram", "forks"])  # all read by spork
    with pytest.raises(
        ConfigError, match="forks is an option of strategy spork; this one uses strategy dspark"
    ):
        check_used("dspark", ["forks"])
    with pytest.raises(ConfigError, match="k_policy is an option of strategy speculative"):
        check_used("dspark", ["k_policy"])
    with pytest.raises(ConfigError, match="needs a speculative strategy"):
        check_used("ar", ["drafter"])
    assert implied_strategy(["min_k", "drafter"]) == "dspark"
    assert implied_strategy(["drafter"]) == "speculative"
    assert implied_strategy([]) is None
    with pytest.raises(ConfigError, match="several strategies"):
        implied_strategy(["forks", "min_k"])


def test_a_new_strategy_gets_its_own_default_drafter() -> None:
    base = SpecConfig("speculative", "self")
    assert spec_with(base, {"strategy": "spork"}).drafter == "recycle"
    assert spec_with(base, {"k": 2}).drafter == "self"


def test_self_layers_go_with_the_self_drafter() -> None:
    """Layers given to a drafter that runs none would be silently unused: refused; a request
    that moves a self-drafting default to another drafter leaves its layers behind."""
    base = SpecConfig("speculative", "self", self_layers="0-5")
    with pytest.raises(ConfigError, match="self_layers chooses the layers of the self drafter"):
        SpecConfig("speculative", "ngram", self_layers="0-5")
    with pytest.raises(ConfigError, match=r"skip_layers .* drafter is 'recycle'.*recycle\+self"):
        SpecConfig("spork", skip_layers="3")
    assert spec_with(base, {"drafter": "ngram"}).self_layers is None
    assert spec_with(base, {"strategy": "spork"}).self_layers is None
    assert spec_with(base, {"strategy": "dspark", "drafter": "self"}).self_layers == "0-5"
    assert spec_with(base, {"k": 2}).self_layers == "0-5"
    with pytest.raises(ConfigError, match="self_layers"):
        spec_with(base, {"drafter": "ngram", "self_layers": "0-3"})
