"""The strategies and drafter kinds specfork knows, as data: names, what each drafts, the flags
the rest of specfork reads, one-line descriptions for help texts.

No builders here (they load models and import drafters): `specfork.strategies.registry` pairs
every entry with them, and a test checks that both name the same strategies and kinds.
"""

from __future__ import annotations

from dataclasses import dataclass

from specfork.errors import ConfigError

SHAPES = ("none", "chain", "tree")  # what a strategy's round drafts
PATHS = ("none", "optional", "required")  # whether a drafter kind takes a PATH


@dataclass(frozen=True, slots=True)
class DrafterKind:
    """One drafter kind: a source in a drafter string (`name` or `name:PATH`).

    `chain`: it drafts chains (speculative, dspark), alone or joined by "+" with others;
    `tree`: it may be a source of SPORK's trees; `path`: "none", "optional" (`name` or
    `name:PATH`) or "required" (`name:PATH`); `help`: what it is, in a few words.
    """

    name: str
    chain: bool
    tree: bool
    path: str
    help: str

    def __post_init__(self) -> None:
        if not self.name.isidentifier() or self.path not in PATHS:
            raise ValueError(f"drafter kind {self.name!r}: bad name or path rule {self.path!r}")
        if not (self.chain or self.tree):
            raise ValueError(f"drafter kind {self.name!r} drafts neither chains nor trees")

    @property
    def usage(self) -> str:
        """How a user writes it: ngram, head[:PATH], model:PATH."""
        suffix = {"none": "", "optional": "[:PATH]", "required": ":PATH"}[self.path]
        return self.name + suffix


@dataclass(frozen=True, slots=True)
class StrategyKind:
    """One strategy.

    `shape`: what a round drafts ("none" for plain decoding, "chain" or "tree"; a tree
    strategy's drafts go through the tree gate); `default_drafter`: its drafter when none is
    given; `longest`: the `SpecConfig` field that bounds one round's draft (None: drafts
    nothing); `help`: one line for `--strategy`; `sized_by`: how it sizes drafts when not by
    k and k_policy ("" when it reads them).
    """

    name: str
    shape: str
    default_drafter: str
    longest: str | None
    help: str
    sized_by: str = ""

    def __post_init__(self) -> None:
        if not self.name.isidentifier() or self.shape not in SHAPES:
            raise ValueError(f"strategy {self.name!r}: bad name or shape {self.shape!r}")
        if (self.longest is None) != (self.shape == "none"):
            raise ValueError(f"strategy {self.name!r}: `longest` names a field iff it drafts")

    @property
    def drafts(self) -> bool:
        """Whether it drafts at all (every strategy but plain decoding)."""
        return self.shape != "none"

    @property
    def tree(self) -> bool:
        """Whether it drafts trees (and verifies them through the tree gate)."""
        return self.shape == "tree"

    def accepts(self, kind: DrafterKind) -> bool:
        """Whether `kind` may be one of its sources (plain decoding checks chain drafters)."""
        return kind.tree if self.tree else kind.chain


STRATEGY_KINDS = (
    StrategyKind("ar", "none", "ngram", None, "plain decoding (the default)"),
    StrategyKind("speculative", "chain", "ngram", "k", "draft, then verify in one pass"),
    StrategyKind(
        "dspark",
        "chain",
        "ngram",
        "max_k",
        "speculative with K chosen every round from the target's confidence",
        sized_by="it chooses K itself between min_k and max_k",
    ),
    StrategyKind(
        "spork",
        "tree",
        "recycle",
        "budget",
        "a tree of forks verified in one pass",
        sized_by="its trees are sized by forks, depth and budget",
    ),
)
DRAFTER_KINDS = (
    DrafterKind("recycle", False, True, "none", "Token Recycling: the target's past top picks"),
    DrafterKind("ngram", True, True, "none", "prompt lookup"),
    DrafterKind(
        "suffix", True, True, "none", "SuffixDecoding: a suffix index of this and earlier requests"
    ),
    DrafterKind("self", True, True, "none", "the target's own layers"),
    DrafterKind("head", True, True, "optional", "a trained draft head"),
    DrafterKind("model", True, True, "required", "a separate draft model"),
)
STRATEGY_NAMES = tuple(s.name for s in STRATEGY_KINDS)
CHAIN_DRAFTERS = tuple(d.usage for d in DRAFTER_KINDS if d.chain)  # ngram, self, head[:PATH], …
TREE_SOURCES = tuple(d.usage for d in DRAFTER_KINDS if d.tree)  # recycle, ngram, self, …


def strategy_kind(name: object) -> StrategyKind:
    """The strategy called `name`; ConfigError naming the valid ones."""
    for kind in STRATEGY_KINDS:
        if kind.name == name:
            return kind
    raise ConfigError(f"unknown strategy {name!r}; choose one of {', '.join(STRATEGY_NAMES)}")


def drafter_kind(name: str) -> DrafterKind | None:
    """The drafter kind called `name`, or None."""
    return next((kind for kind in DRAFTER_KINDS if kind.name == name), None)
