"""The drafter mini-language (`specfork.catalog.sources`): a drafter string parsed once into
`DraftSource`s that write themselves back, every mistake a one-line ConfigError naming what is
valid, and `SpecConfig` holding the parsed sources without changing how it compares."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from specfork.catalog.kinds import DRAFTER_KINDS, STRATEGY_KINDS, strategy_kind
from specfork.catalog.sources import DraftSource, join_sources, parse_drafter
from specfork.config import SpecConfig
from specfork.errors import ConfigError

CHAIN = strategy_kind("speculative")
TREE = strategy_kind("spork")


@pytest.mark.parametrize(
    ("text", "strategy", "sources"),
    [
        ("ngram", CHAIN, [DraftSource("ngram")]),
        ("self", strategy_kind("dspark"), [DraftSource("self")]),
        ("head", CHAIN, [DraftSource("head")]),
        ("head:/heads/h1", CHAIN, [DraftSource("head", "/heads/h1")]),
        ("model:org/draft:Q4_0", CHAIN, [DraftSource("model", "org/draft:Q4_0")]),
        ("ngram+head", CHAIN, [DraftSource("ngram"), DraftSource("head")]),
        ("recycle", TREE, [DraftSource("recycle")]),
        ("recycle+ngram", TREE, [DraftSource("recycle"), DraftSource("ngram")]),
        ("ngram+recycle", TREE, [DraftSource("ngram"), DraftSource("recycle")]),  # order kept
        ("recycle+suffix", TREE, [DraftSource("recycle"), DraftSource("suffix")]),
        ("ngram+suffix", CHAIN, [DraftSource("ngram"), DraftSource("suffix")]),
        ("model:a+model:b", CHAIN, [DraftSource("model", "a"), DraftSource("model", "b")]),
        ("head:a+head", TREE, [DraftSource("head", "a"), DraftSource("head")]),
        ("ngram", strategy_kind("ar"), [DraftSource("ngram")]),  # plain checks chain drafters
    ],
)
def test_drafter_strings_parse_and_write_back(text, strategy, sources) -> None:
    parsed = parse_drafter(text, strategy)
    assert parsed == tuple(sources)
    assert join_sources(parsed) == text == "+".join(str(s) for s in parsed)


def test_head_with_an_empty_path_is_the_shipped_head() -> None:
    assert parse_drafter("head:", CHAIN) == (DraftSource("head"),)
    assert str(DraftSource("head")) == "head"


CHAIN_CHOICES = (
    "choose one of ngram, suffix, self, head[:PATH], model:PATH, or several joined by '+' and "
    "asked in order (e.g. ngram+head)"
)
TREE_CHOICES = (
    "use one or more of recycle, ngram, suffix, self, head[:PATH], model:PATH joined by '+', "
    "e.g. recycle+ngram"
)


@pytest.mark.parametrize(
    ("text", "strategy", "message"),
    [
        ("eagle", CHAIN, f"unknown drafter 'eagle'; {CHAIN_CHOICES}"),
        ("Model:x", CHAIN, f"unknown drafter 'Model:x'; {CHAIN_CHOICES}"),
        ("", CHAIN, f"unknown drafter ''; {CHAIN_CHOICES}"),
        ("ngram+", CHAIN, f"unknown drafter ''; {CHAIN_CHOICES}"),
        ("model", CHAIN, "drafter 'model': model is written model:PATH (needs a PATH)"),
        ("model:", CHAIN, "drafter 'model:': model is written model:PATH (needs a PATH)"),
        ("ngram:x", CHAIN, "drafter 'ngram:x': ngram is written ngram (takes no PATH)"),
        ("suffix:x", CHAIN, "drafter 'suffix:x': suffix is written suffix (takes no PATH)"),
        (
            "recycle+suffix:/a",
            TREE,
            "drafter 'suffix:/a': suffix is written suffix (takes no PATH)",
        ),
        (
            "recycle",
            CHAIN,
            f"unknown drafter 'recycle'; {CHAIN_CHOICES} (recycle drafts trees: strategy spork)",
        ),
        (
            "ngram+recycle",
            strategy_kind("ar"),
            f"unknown drafter 'recycle'; {CHAIN_CHOICES} (recycle drafts trees: strategy spork)",
        ),
        ("recycle+bogus", TREE, f"unknown spork drafter 'bogus'; {TREE_CHOICES}"),
        ("+", TREE, f"unknown spork drafter ''; {TREE_CHOICES}"),
        ("recycle:x", TREE, "drafter 'recycle:x': recycle is written recycle (takes no PATH)"),
        ("ngram+ngram", CHAIN, "drafter 'ngram+ngram' names a source twice; name each once"),
        (
            "recycle+ngram+recycle",
            TREE,
            "drafter 'recycle+ngram+recycle' names a source twice; name each once",
        ),
        ("head+head:", CHAIN, "drafter 'head+head:' names a source twice; name each once"),
        ("model:a+model:a", TREE, "drafter 'model:a+model:a' names a source twice; name each once"),
        (3, CHAIN, "drafter must be a string such as 'ngram', got 3"),
        (["ngram"], TREE, "drafter must be a string such as 'ngram', got ['ngram']"),
        (None, CHAIN, "drafter must be a string such as 'ngram', got None"),
    ],
)
def test_every_mistake_says_what_is_valid(text, strategy, message) -> None:
    with pytest.raises(ConfigError) as err:
        parse_drafter(text, strategy)
    assert str(err.value) == message


@pytest.mark.parametrize(
    ("kind", "path", "words"),
    [
        ("eagle", None, "unknown drafter kind 'eagle'"),
        (3, None, "unknown drafter kind 3"),
        ("model", None, "drafter 'model' is written model:PATH, got path None"),
        ("ngram", "x", "drafter 'ngram' is written ngram, got path 'x'"),
        ("recycle", "x", "drafter 'recycle' is written recycle, got path 'x'"),
        ("model", "", "non-empty string"),
        ("head", "a+b", r"without '\+'"),
        ("head", 3, "non-empty string"),
    ],
)
def test_a_source_is_validated_on_construction(kind, path, words) -> None:
    with pytest.raises(ConfigError, match=words):
        DraftSource(kind, path)


def test_a_source_is_a_frozen_value() -> None:
    assert DraftSource("head", "a") == DraftSource("head", "a") != DraftSource("head")
    assert len({DraftSource("ngram"), DraftSource("ngram")}) == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        DraftSource("ngram").kind = "self"  # type: ignore[misc]


def _source_of(kind) -> st.SearchStrategy[DraftSource]:
    paths = st.text(
        st.characters(exclude_characters="+", exclude_categories=("Cs",)), min_size=1, max_size=12
    )
    path = {"none": st.none(), "optional": st.none() | paths, "required": paths}[kind.path]
    return path.map(lambda p: DraftSource(kind.name, p))


@st.composite
def _drafter(draw: st.DrawFn) -> tuple[str, tuple[DraftSource, ...]]:
    strategy = draw(st.sampled_from([s for s in STRATEGY_KINDS if s.drafts]))
    kinds = [k for k in DRAFTER_KINDS if strategy.accepts(k)]
    one = st.sampled_from(kinds).flatmap(_source_of)
    sources = draw(st.lists(one, min_size=1, max_size=5, unique=True))
    return strategy.name, tuple(sources)


@given(_drafter())
def test_any_valid_combination_round_trips(drawn) -> None:
    """Sources of the kinds a strategy accepts, each once, any order, any PATH without '+':
    written and parsed back, as the parser and as SpecConfig see them."""
    strategy, sources = drawn
    text = join_sources(sources)
    assert parse_drafter(text, strategy_kind(strategy)) == sources
    spec = SpecConfig(strategy, text)
    assert spec.sources == sources and spec.drafter == text


def test_spec_config_holds_the_parsed_sources_without_comparing_them() -> None:
    spec = SpecConfig("spork", "recycle+ngram", recycle_persist=True)
    assert spec.sources == (DraftSource("recycle"), DraftSource("ngram"))
    assert spec.drafts_with("recycle") and not spec.drafts_with("self")
    twin = SpecConfig("spork", "recycle+ngram", recycle_persist=True)
    assert spec == twin and hash(spec) == hash(twin) and {spec: 1}[twin] == 1
    assert "sources" not in repr(spec)
    assert dataclasses.replace(spec, drafter="ngram").sources == (DraftSource("ngram"),)
    options = spec.to_dict()
    assert "_sources" not in options and options["drafter"] == "recycle+ngram"
    assert SpecConfig(**options) == spec
    assert SpecConfig().sources == (DraftSource("ngram"),)  # the default drafter, parsed
    assert SpecConfig("spork").sources == (DraftSource("recycle"),)


def test_strategy_properties_follow_the_catalog() -> None:
    assert [SpecConfig(s.name).drafts for s in STRATEGY_KINDS] == [False, True, True, True]
    assert SpecConfig("ar").draft_k == 0
    assert SpecConfig("speculative", k=3).draft_k == 3
    assert SpecConfig("dspark", max_k=9).draft_k == 9
    assert SpecConfig("spork", budget=30).draft_k == 30
    assert SpecConfig("spork").strategy_kind.tree and not SpecConfig("dspark").strategy_kind.tree


def test_layers_need_the_self_drafter_among_the_sources() -> None:
    SpecConfig("spork", "recycle+self", self_layers="0-1")
    SpecConfig("speculative", "ngram+self", skip_layers="1")
    with pytest.raises(
        ConfigError,
        match=r"self_layers .* drafter is 'ngram\+head'; use drafter "
        r"self, or leave self_layers out",
    ):
        SpecConfig("speculative", "ngram+head", self_layers="0-1")
    with pytest.raises(ConfigError, match=r"or add it: e.g. recycle\+self"):
        SpecConfig("spork", "recycle+ngram", skip_layers="1")
