"""The drafter and policy a `SpecConfig` asks for, built through the registry: the strategy's
policy builder, one drafter per source of its parsed drafter (several chain sources: a
`FallbackDrafter` asking them in order, or with `cascade` a `CascadeDrafter`; a tree strategy's
sources: SPORK's `ForkDrafter`).
Drafters that learn across requests (the suffix index) draw on the `DraftStores` given: the
Generator's own, so that all its strategies and requests share them."""

from __future__ import annotations

from typing import TYPE_CHECKING

from specfork.catalog.sources import DraftSource
from specfork.config import SpecConfig
from specfork.drafters.base import Drafter
from specfork.drafters.cascade import CascadeDrafter
from specfork.drafters.fallback import FallbackDrafter
from specfork.drafters.forks import RECYCLE_WIDTH, ForkDrafter
from specfork.drafters.recycle_prior import PRIOR_CONTEXT, load_or_compute
from specfork.drafters.stores import DraftStores
from specfork.host import cache_dir
from specfork.strategies.policies import DraftPolicy
from specfork.strategies.registry import drafter_entry, strategy_entry

if TYPE_CHECKING:
    from specfork.loading.loader import LoadedModel


def build_strategy(
    spec: SpecConfig,
    target: LoadedModel,
    with_drafter: bool = True,
    stores: DraftStores | None = None,
) -> tuple[Drafter | None, DraftPolicy | None]:
    """The drafter and policy that `spec` asks for (None, None for plain decoding; no drafter
    when `with_drafter` is false: the caller brings its own), drawing on `stores` (None: new
    ones of its own)."""
    entry = strategy_entry(spec.strategy)
    if entry.policy is None:
        return None, None
    drafter: Drafter | None = None
    if with_drafter:
        build = build_fork_drafter if entry.kind.tree else build_drafter
        drafter = build(spec, target, stores or DraftStores())
    return drafter, entry.policy(spec, drafter)


def build_drafter(spec: SpecConfig, target: LoadedModel, stores: DraftStores) -> Drafter:
    """A chain drafter for `target` from `spec.sources` (several: a `FallbackDrafter` asking
    them in order)."""
    drafters = [build_source(source, spec, target, stores) for source in spec.sources]
    if spec.cascade:  # SpecConfig checked: free sources, then a head
        free = drafters[:-1]
        proposer = free[0] if len(free) == 1 else FallbackDrafter(free)
        return CascadeDrafter(proposer, drafters[-1])  # type: ignore[arg-type]
    return drafters[0] if len(drafters) == 1 else FallbackDrafter(drafters)


def build_fork_drafter(spec: SpecConfig, target: LoadedModel, stores: DraftStores) -> ForkDrafter:
    """SPORK's tree drafter: the recycle table (if a source) and the other sources' drafters,
    by their names in the drafter string."""
    chains = {
        str(s): build_source(s, spec, target, stores) for s in spec.sources if s.kind != "recycle"
    }
    recycle = spec.drafts_with("recycle")
    prior = None
    if recycle and spec.recycle_prior:
        context = target.tokenizer.encode(PRIOR_CONTEXT)
        folder = cache_dir() / "recycle"
        prior = load_or_compute(target.model, RECYCLE_WIDTH, context, target.path, folder)
    vocab = target.model.config.vocab_size
    return ForkDrafter(
        vocab, recycle=recycle, chains=chains, persist=spec.recycle_persist, prior=prior
    )


def build_source(
    source: DraftSource, spec: SpecConfig, target: LoadedModel, stores: DraftStores
) -> Drafter:
    """The drafter of one source, by its kind's builder in the registry."""
    build = drafter_entry(source.kind).build
    if build is None:
        raise ValueError(f"{source} is no drafter of its own (SPORK's fork drafter holds it)")
    return build(source, spec, target, stores)
