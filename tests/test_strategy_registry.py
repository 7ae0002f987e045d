"""The registry of strategies and drafter kinds (`specfork.strategies.registry`, its data in
`specfork.catalog.kinds`): both tables name the same entries, every entry is offered by the
CLI's help and reached from the CLI flags, the bench's spec strings and the server's
`speculative` objects alike, and every one builds on a tiny model and decodes as plain
decoding does."""

from __future__ import annotations

from pathlib import Path

import pytest

from specfork import config
from specfork.bench.specs import parse_strategy
from specfork.catalog.kinds import DRAFTER_KINDS, STRATEGY_KINDS, DrafterKind, StrategyKind
from specfork.catalog.sources import DraftSource
from specfork.cli import build_parser
from specfork.cli.common import resolve_strategy, spec_from_args
from specfork.config import GenerationConfig, SpecConfig
from specfork.drafters.fallback import FallbackDrafter
from specfork.drafters.forks import ForkDrafter
from specfork.drafters.head import HeadDrafter
from specfork.drafters.model import ModelDrafter
from specfork.drafters.ngram import NgramDrafter
from specfork.drafters.suffix import SuffixDrafter
from specfork.engine.generator import Generator
from specfork.errors import ConfigError
from specfork.heads.model import DraftHead, HeadConfig, save_head
from specfork.loading.loader import LoadedModel, load_model
from specfork.models.cost import CostCurve
from specfork.spec_schema import OPTIONS_BY_NAME, spec_with
from specfork.strategies.build import build_strategy
from specfork.strategies.dspark import DSparkPolicy
from specfork.strategies.policies import ConstantK
from specfork.strategies.registry import (
    DRAFTERS,
    STRATEGIES,
    draft_nodes_bound,
    drafter_entry,
    strategy_entry,
)
from specfork.strategies.spork import SporkPolicy
from tiny_models import tiny_chat_llama

CURVE = CostCurve((1, 2, 4, 8, 16, 32), (1.0, 1.25, 1.5, 2.3, 3.9, 6.8))
DRAFTING = [s for s in STRATEGY_KINDS if s.drafts]
# every (drafting strategy, drafter kind) pair the catalog allows
PAIRS = [(s, k) for s in DRAFTING for k in DRAFTER_KINDS if s.accepts(k)]
PAIR_IDS = [f"{s.name}-{k.name}" for s, k in PAIRS]


def test_the_registry_and_the_catalog_name_the_same_entries() -> None:
    assert list(STRATEGIES) == [s.name for s in STRATEGY_KINDS] == list(config.STRATEGIES)
    assert list(DRAFTERS) == [k.name for k in DRAFTER_KINDS]
    for kind in STRATEGY_KINDS:
        entry = strategy_entry(kind.name)
        assert entry.kind is kind and (entry.policy is not None) == kind.drafts
        assert entry.tree_gate == kind.tree
    for kind in DRAFTER_KINDS:
        assert drafter_entry(kind.name).kind is kind
    chains = tuple(e.kind.usage for e in DRAFTERS.values() if e.kind.chain)
    trees = tuple(e.kind.usage for e in DRAFTERS.values() if e.kind.tree)
    assert chains == config.DRAFTERS == ("ngram", "suffix", "self", "head[:PATH]", "model:PATH")
    assert trees == config.SPORK_SOURCES == ("recycle", *config.DRAFTERS)
    assert config.STRATEGIES == ("ar", "speculative", "dspark", "spork")
    with pytest.raises(ConfigError, match="unknown strategy 'turbo'; choose one of ar, spec"):
        strategy_entry("turbo")
    with pytest.raises(ConfigError, match="unknown drafter kind 'eagle'"):
        drafter_entry("eagle")


def test_every_entry_is_in_the_cli_help(capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "2000")  # argparse wraps at the terminal's width
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert "--strategy {" + ",".join(STRATEGIES) + "}" in shown
    for entry in STRATEGIES.values():
        assert f"{entry.kind.name} = {entry.kind.help}" in shown
    drafter_help = OPTIONS_BY_NAME["drafter"].help
    assert " ".join(drafter_help.split()) in shown
    for entry in DRAFTERS.values():
        assert f"{entry.kind.usage} ({entry.kind.help})" in drafter_help


def _drafter_text(kind: DrafterKind) -> str:
    return f"{kind.name}:some/path" if kind.path == "required" else kind.name


@pytest.mark.parametrize(("strategy", "kind"), PAIRS, ids=PAIR_IDS)
def test_every_pair_is_reached_from_every_front_end(strategy: StrategyKind, kind) -> None:
    """The same drafter text gives the same SpecConfig from a flag, a bench spec and a request."""
    text = _drafter_text(kind)
    args = build_parser().parse_args(["generate", "--strategy", strategy.name, "--drafter", text])
    resolve_strategy(args)
    from_cli = spec_from_args(args, expected_length=SpecConfig().expected_length)
    from_bench = parse_strategy(f"{strategy.name}:{text}").spec
    from_server = spec_with(SpecConfig(), {"strategy": strategy.name, "drafter": text})
    assert from_cli == from_bench == from_server
    assert from_cli.sources == (
        DraftSource(kind.name, "some/path" if kind.path == "required" else None),
    )


def test_plain_decoding_draws_nothing_and_bounds_follow_the_settings() -> None:
    assert draft_nodes_bound(SpecConfig()) == (0, "plain decoding drafts nothing")
    assert draft_nodes_bound(SpecConfig("speculative", k=3)) == (3, "k=3")
    assert draft_nodes_bound(SpecConfig("dspark", max_k=7)) == (7, "max_k=7")
    forks = SpecConfig("spork", forks=2, depth=3, adapt=False)
    assert draft_nodes_bound(forks) == (6, "forks 2 × depth 3")
    dynamic = SpecConfig("spork", forks=2, depth=3, budget=40, tree="dynamic")
    assert draft_nodes_bound(dynamic) == (40, "budget 40, forks 4 × depth 6 (adapt doubles both)")


# ------------------------------------------------------------------- building on a tiny model


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny target, a tiny draft model sharing its vocabulary, and a draft head for it."""
    root = tmp_path_factory.mktemp("registry")
    return {
        "target": tiny_chat_llama(root / "target", chat=False, seed=11),
        "model": tiny_chat_llama(root / "draft", chat=False, seed=12),
        "head": root / "head",
    }


@pytest.fixture(scope="module")
def tiny(folders: dict[str, Path], one_thread) -> LoadedModel:
    loaded = load_model(str(folders["target"]), dtype="float32", device="cpu", progress=False)
    cfg = loaded.model.config
    save_head(DraftHead(HeadConfig.for_target(cfg, draft_vocab=cfg.vocab_size)), folders["head"])
    return loaded


def _spec(strategy: StrategyKind, kind: DrafterKind, folders: dict[str, Path]) -> SpecConfig:
    """Every draft verified as drafted (no goodput gate); DSpark's threshold 0 lets even a
    random network's chains through."""
    drafter = f"{kind.name}:{folders[kind.name]}" if kind.path != "none" else kind.name
    extra = {"low": 0.0} if strategy.name == "dspark" else {}
    return SpecConfig(strategy.name, drafter, goodput=False, **extra)


DRAFTER_TYPES = {
    "ngram": NgramDrafter,
    "suffix": SuffixDrafter,
    "self": ModelDrafter,
    "head": HeadDrafter,
    "model": ModelDrafter,
}
POLICY_TYPES = {"speculative": ConstantK, "dspark": DSparkPolicy, "spork": SporkPolicy}


@pytest.mark.parametrize(("strategy", "kind"), PAIRS, ids=PAIR_IDS)
def test_every_pair_builds_and_decodes_as_plain_decoding(
    tiny: LoadedModel, folders: dict[str, Path], strategy: StrategyKind, kind: DrafterKind
) -> None:
    spec = _spec(strategy, kind, folders)
    drafter, policy = build_strategy(spec, tiny)
    assert isinstance(policy, POLICY_TYPES[strategy.name])
    if strategy.tree:
        assert isinstance(drafter, ForkDrafter)
        assert (drafter.table is not None) == (kind.name == "recycle")
        chains = [] if kind.name == "recycle" else [str(spec.sources[0])]
        assert list(drafter.chains) == chains
        built = next(iter(drafter.chains.values()), None)
    else:
        built = drafter
    if kind.name != "recycle":
        assert isinstance(built, DRAFTER_TYPES[kind.name])
    config_ = GenerationConfig(max_new_tokens=12, ignore_eos=True)
    prompt = "abc abc abc abc"
    plain = Generator(tiny, cost_curve=CURVE).generate(prompt, config=config_)
    result = Generator(tiny, spec=spec, cost_curve=CURVE).generate(prompt, config=config_)
    assert result.token_ids == plain.token_ids
    assert result.stats.drafted > 0  # the strategy really drafted


def test_chain_sources_build_a_fallback_and_plain_builds_nothing(
    tiny: LoadedModel, folders: dict[str, Path]
) -> None:
    spec = SpecConfig("speculative", f"ngram+model:{folders['model']}")
    drafter, _ = build_strategy(spec, tiny)
    assert isinstance(drafter, FallbackDrafter)
    assert [type(s) for s in drafter.sources] == [NgramDrafter, ModelDrafter]
    assert build_strategy(SpecConfig(), tiny) == (None, None)
    drafter, policy = build_strategy(SpecConfig("spork"), tiny, with_drafter=False)
    assert drafter is None and isinstance(policy, SporkPolicy)


def test_a_head_without_a_path_is_the_one_shipped_for_the_target(tiny: LoadedModel) -> None:
    with pytest.raises(ConfigError, match="no draft head ships for target"):
        build_strategy(SpecConfig("speculative", "head"), tiny)
