"""What each registry entry builds: a drafter from one source of a drafter string, a policy
for one strategy. Every builder of a kind has the same signature, so `registry` can name
them in a table and `build` call them without knowing which is which."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from specfork.catalog.sources import DraftSource
from specfork.config import SpecConfig
from specfork.drafters.base import Drafter
from specfork.drafters.model import ModelDrafter, parse_layers, step_weights
from specfork.drafters.ngram import NgramDrafter
from specfork.drafters.stores import DraftStores
from specfork.drafters.suffix import SuffixDrafter
from specfork.errors import ConfigError, ModelFormatError
from specfork.strategies.dspark import DSparkPolicy
from specfork.strategies.policies import DraftPolicy, make_policy
from specfork.strategies.spork import SporkPolicy

if TYPE_CHECKING:
    from specfork.loading.loader import LoadedModel

log = logging.getLogger(__name__)

# -- drafters: (source, spec, target, the Generator's shared stores) -> Drafter


def ngram_drafter(
    source: DraftSource, spec: SpecConfig, target: LoadedModel, stores: DraftStores
) -> Drafter:
    """Prompt lookup over the request's own history."""
    return NgramDrafter(spec.max_ngram, spec.min_ngram)


def suffix_drafter(
    source: DraftSource, spec: SpecConfig, target: LoadedModel, stores: DraftStores
) -> Drafter:
    """SuffixDecoding over the Generator's shared suffix index (every request's text)."""
    return SuffixDrafter(stores.suffix)


def self_drafter(
    source: DraftSource, spec: SpecConfig, target: LoadedModel, stores: DraftStores
) -> Drafter:
    """The target's own layers: `self_layers` (early exit; default the first half), or every
    layer but `skip_layers`."""
    layers = self_layers(spec, target.model.config.num_layers)
    return ModelDrafter(target.model, layers=layers, name="self")


def self_layers(spec: SpecConfig, n_layers: int) -> list[int]:
    """The layers a self drafter runs of a target with `n_layers` (ConfigError when `spec`
    names layers the target lacks)."""
    if spec.skip_layers:
        skipped = set(parse_layers(spec.skip_layers, n_layers))
        return [i for i in range(n_layers) if i not in skipped]
    return parse_layers(spec.self_layers or f"0-{max(0, n_layers // 2 - 1)}", n_layers)


def head_drafter(
    source: DraftSource, spec: SpecConfig, target: LoadedModel, stores: DraftStores
) -> Drafter:
    """A trained draft head (`specfork train-head`): at the source's PATH, or the one shipped
    for the target."""
    from specfork.drafters.head import HeadDrafter
    from specfork.drafters.meter import CostMeter
    from specfork.heads.fast import can_pack, on_kernels
    from specfork.heads.model import load_head
    from specfork.heads.packaged import packaged_head
    from specfork.models.cost import one_row_seconds

    folder = Path(source.path) if source.path else packaged_head(target)
    head = load_head(folder, target.model.config).to(target.model.device)  # beside its features
    cost = HeadDrafter.weights_cost(head, target.model)
    kernels = getattr(target.model, "kernels", None)  # a FastLM target runs on the kernels
    if kernels is not None and can_pack(head):
        embeddings = target.model.embed_rows(head.d2t)  # [Vd, D] for greedy chains in C++
        head = on_kernels(head, kernels, "q8", embeddings)  # int8: half bf16's traffic
    meter = CostMeter(one_row_seconds(target.model), floor=cost)
    return HeadDrafter(head, target.model, cost=cost, meter=meter)


def model_drafter(
    source: DraftSource, spec: SpecConfig, target: LoadedModel, stores: DraftStores
) -> Drafter:
    """A separate draft model at the source's PATH (a path, packaged name or Hub id; its
    tokenizer is not needed: it must share the target's)."""
    from specfork.loading.facts import check_draft_vocabulary
    from specfork.loading.loader import load_decoder
    from specfork.loading.registry import resolve_model

    path = resolve_model(source.path or "", progress=False)
    precision = target.model.precision
    if precision == "gguf" and path.is_dir():
        precision = "auto"  # a checkpoint folder has no GGUF blocks to keep
    try:
        draft = load_decoder(path, dtype=precision, device=target.model.device)
    except (ConfigError, ModelFormatError) as exc:  # quant types the kernels do not run
        if precision == "auto":
            raise
        log.info("the draft model runs at its own precision (not %s: %s)", precision, exc)
        draft = load_decoder(path, dtype="auto", device=target.model.device)
    check_draft_vocabulary(target.model.config, draft.config)
    cost = step_weights(draft) / step_weights(target.model)
    return ModelDrafter(draft, name="model", cost=cost)


# -- policies: (spec, drafter or None) -> DraftPolicy


def fixed_policy(spec: SpecConfig, drafter: Drafter | None) -> DraftPolicy:
    """speculative: a draft-length schedule (constant, heuristic, linear-decay)."""
    return make_policy(spec.k_policy, spec.k, spec.expected_length)


def dspark_policy(spec: SpecConfig, drafter: Drafter | None) -> DraftPolicy:
    """DSpark: K from the target's confidence every round."""
    return DSparkPolicy(spec)


def spork_policy(spec: SpecConfig, drafter: Drafter | None) -> DraftPolicy:
    """SPORK: tree shapes, priced by what the drafter's networks cost (0 without one)."""
    return SporkPolicy(spec, draft_cost=drafter.cost if drafter else 0.0)
