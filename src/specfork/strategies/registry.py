"""Every strategy and drafter kind with what differs between them, in two tables.

The data (names, shapes, flags, descriptions) is `specfork.catalog.kinds`, which `config`,
`spec_schema` and the front ends read; here each entry gets what only this layer can hold:
a strategy its draft-size bound and policy builder, a drafter kind its builder. A new
drafter is one module in `drafters/`, one `DrafterKind` in the catalog and one entry here
(with its builder in `builders`); tests check that the tables name the same kinds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from specfork.catalog.kinds import DrafterKind, StrategyKind, drafter_kind, strategy_kind
from specfork.catalog.sources import DraftSource
from specfork.config import SpecConfig
from specfork.drafters.base import Drafter
from specfork.drafters.stores import DraftStores
from specfork.errors import ConfigError
from specfork.strategies import bound, builders
from specfork.strategies.policies import DraftPolicy

if TYPE_CHECKING:
    from specfork.loading.loader import LoadedModel

Bound = Callable[[SpecConfig], tuple[int, str]]
PolicyBuilder = Callable[[SpecConfig, Drafter | None], DraftPolicy]
DrafterBuilder = Callable[[DraftSource, SpecConfig, "LoadedModel", DraftStores], Drafter]


@dataclass(frozen=True, slots=True)
class StrategyEntry:
    """A strategy: its data (`kind`: drafts, chain or tree, tree gate, accepted sources), the
    most tokens it drafts a round (`bound`), and its policy builder (None: plain decoding)."""

    kind: StrategyKind
    bound: Bound
    policy: PolicyBuilder | None

    def __post_init__(self) -> None:
        if (self.policy is None) == self.kind.drafts:
            raise ValueError(f"strategy {self.kind.name}: a policy iff it drafts")

    @property
    def tree_gate(self) -> bool:
        """Whether its drafts go through the tree gate (`goodput.TreeGate`) or the chain one."""
        return self.kind.tree


@dataclass(frozen=True, slots=True)
class DrafterEntry:
    """A drafter kind: its data (`kind`: chains and/or trees, PATH, help) and its builder (None
    for recycle: SPORK's fork drafter keeps that table itself)."""

    kind: DrafterKind
    build: DrafterBuilder | None

    def __post_init__(self) -> None:
        if self.kind.chain and self.build is None:
            raise ValueError(f"drafter {self.kind.name}: a chain drafter needs a builder")


def _strategy(name: str, bound_of: Bound, policy: PolicyBuilder | None) -> StrategyEntry:
    return StrategyEntry(strategy_kind(name), bound_of, policy)


def _drafter(name: str, build: DrafterBuilder | None) -> DrafterEntry:
    kind = drafter_kind(name)
    if kind is None:
        raise ValueError(f"drafter kind {name!r} is not in catalog.kinds.DRAFTER_KINDS")
    return DrafterEntry(kind, build)


STRATEGIES: dict[str, StrategyEntry] = {
    e.kind.name: e
    for e in (
        _strategy("ar", bound.no_draft_bound, None),
        _strategy("speculative", bound.chain_bound, builders.fixed_policy),
        _strategy("dspark", bound.chain_bound, builders.dspark_policy),
        _strategy("spork", bound.tree_bound, builders.spork_policy),
    )
}
DRAFTERS: dict[str, DrafterEntry] = {
    e.kind.name: e
    for e in (
        _drafter("recycle", None),
        _drafter("ngram", builders.ngram_drafter),
        _drafter("suffix", builders.suffix_drafter),
        _drafter("self", builders.self_drafter),
        _drafter("head", builders.head_drafter),
        _drafter("model", builders.model_drafter),
    )
}


def strategy_entry(name: str) -> StrategyEntry:
    """The entry of strategy `name`; ConfigError naming the valid ones."""
    return STRATEGIES[strategy_kind(name).name]


def drafter_entry(kind: str) -> DrafterEntry:
    """The entry of drafter kind `kind` (one of a parsed source's kinds)."""
    found = DRAFTERS.get(kind)
    if found is None:
        raise ConfigError(f"unknown drafter kind {kind!r}; known: {', '.join(DRAFTERS)}")
    return found


def draft_nodes_bound(spec: SpecConfig) -> tuple[int, str]:
    """The most tokens `spec` may draft in one round (what a drafter grows; a gate may verify
    fewer), with how that follows from the settings: the work a request can cause per round."""
    return strategy_entry(spec.strategy).bound(spec)
