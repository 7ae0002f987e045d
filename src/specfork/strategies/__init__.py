"""Strategies: a drafter and a draft-length policy plugged into the engine's one loop.

"ar" is plain decoding (no drafter). "speculative" drafts chains with one of the drafters and
verifies them losslessly (see `specfork.verify`).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from specfork.config import SpecConfig
from specfork.drafters.base import Drafter
from specfork.drafters.fallback import FallbackDrafter
from specfork.drafters.forks import RECYCLE_WIDTH, ForkDrafter
from specfork.drafters.model import ModelDrafter, parse_layers, step_weights
from specfork.drafters.ngram import NgramDrafter
from specfork.drafters.recycle_prior import PRIOR_CONTEXT, load_or_compute
from specfork.errors import ConfigError, ModelFormatError
from specfork.host import cache_dir
from specfork.strategies.dspark import DSparkPolicy
from specfork.strategies.policies import DraftPolicy, make_policy
from specfork.strategies.spork import SporkPolicy

if TYPE_CHECKING:
    from specfork.loading.loader import LoadedModel

log = logging.getLogger(__name__)


def build_strategy(
    spec: SpecConfig, target: LoadedModel, with_drafter: bool = True
) -> tuple[Drafter | None, DraftPolicy | None]:
    """The drafter and policy that `spec` asks for (None, None for plain decoding)."""
    if spec.strategy == "ar":
        return None, None
    if spec.strategy == "spork":
        forks = build_fork_drafter(spec, target) if with_drafter else None
        return forks, SporkPolicy(spec, draft_cost=forks.cost if forks else 0.0)
    if spec.strategy == "dspark":
        policy: DraftPolicy = DSparkPolicy(spec)
    else:
        policy = make_policy(spec.k_policy, spec.k, spec.expected_length)
    return (build_drafter(spec, target) if with_drafter else None), policy


def draft_nodes_bound(spec: SpecConfig) -> tuple[int, str]:
    """The most tokens `spec` may draft in one round (what a drafter grows; a gate may verify
    fewer), with how that follows from the settings: the work a request can cause per round."""
    if spec.strategy == "ar":
        return 0, "plain decoding drafts nothing"
    if spec.strategy == "speculative":
        return spec.k, f"k={spec.k}"
    if spec.strategy == "dspark":
        return spec.max_k, f"max_k={spec.max_k}"
    grow = 2 if spec.adapt else 1  # SporkPolicy adapts forks and depth up to twice the setting
    forks, depth = grow * spec.forks, grow * spec.depth
    how = f"forks {forks} × depth {depth}" + (" (adapt doubles both)" if spec.adapt else "")
    if spec.tree == "dynamic":
        return max(spec.budget, forks * depth), f"budget {spec.budget}, {how}"
    return forks * depth, how


def build_fork_drafter(spec: SpecConfig, target: LoadedModel) -> ForkDrafter:
    """SPORK's tree drafter from the "+"-joined sources of `spec.drafter`."""
    sources = spec.drafter.split("+")
    chains = {
        name: build_drafter(dataclasses.replace(spec, drafter=name), target)
        for name in dict.fromkeys(sources)
        if name != "recycle"
    }
    vocab = target.model.config.vocab_size
    recycle = "recycle" in sources
    prior = None
    if recycle and spec.recycle_prior:
        context = target.tokenizer.encode(PRIOR_CONTEXT)
        folder = cache_dir() / "recycle"
        prior = load_or_compute(target.model, RECYCLE_WIDTH, context, target.path, folder)
    return ForkDrafter(
        vocab, recycle=recycle, chains=chains, persist=spec.recycle_persist, prior=prior
    )


def build_drafter(spec: SpecConfig, target: LoadedModel) -> Drafter:
    """A chain drafter for `target` as `spec.drafter` names it (several joined by "+": a
    `FallbackDrafter` asking them in order)."""
    if "+" in spec.drafter:
        names = spec.drafter.split("+")
        return FallbackDrafter(
            [build_drafter(dataclasses.replace(spec, drafter=n), target) for n in names]
        )
    model = target.model
    n_layers = model.config.num_layers
    if spec.drafter == "ngram":
        return NgramDrafter(spec.max_ngram, spec.min_ngram)
    if spec.drafter == "self":
        if spec.skip_layers:
            skipped = set(parse_layers(spec.skip_layers, n_layers))
            layers = [i for i in range(n_layers) if i not in skipped]
        else:
            layers = parse_layers(spec.self_layers or f"0-{max(0, n_layers // 2 - 1)}", n_layers)
        return ModelDrafter(model, layers=layers, name="self")
    if spec.drafter == "head" or spec.drafter.startswith("head:"):
        return _draft_head(spec.drafter.removeprefix("head").removeprefix(":"), target)
    return _draft_model(spec.drafter.removeprefix("model:"), target)


def _draft_head(path: str, target: LoadedModel) -> Drafter:
    """A trained draft head (`specfork train-head`): at `path`, or the one shipped for the
    target."""
    from specfork.drafters.head import HeadDrafter
    from specfork.drafters.meter import CostMeter
    from specfork.heads.fast import can_pack, on_kernels
    from specfork.heads.model import load_head
    from specfork.heads.packaged import packaged_head
    from specfork.models.cost import one_row_seconds

    folder = Path(path) if path else packaged_head(target)
    head = load_head(folder, target.model.config).to(target.model.device)  # beside its features
    cost = HeadDrafter.weights_cost(head, target.model)
    kernels = getattr(target.model, "kernels", None)  # a FastLM target runs on the kernels
    if kernels is not None and can_pack(head):
        head = on_kernels(head, kernels, "q8")  # int8 blocks: half bf16's traffic, same drafts
    meter = CostMeter(one_row_seconds(target.model), floor=cost)
    return HeadDrafter(head, target.model, cost=cost, meter=meter)


def _draft_model(name_or_path: str, target: LoadedModel) -> Drafter:
    """A separate draft model (its tokenizer is not needed: it must share the target's)."""
    from specfork.loading.loader import load_decoder
    from specfork.loading.registry import resolve_model

    path = resolve_model(name_or_path, progress=False)
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
    v_target, v_draft = target.model.config.vocab_size, draft.config.vocab_size
    if v_target != v_draft:
        raise ConfigError(
            f"the draft model's vocabulary ({v_draft} tokens) differs from the target's "
            f"({v_target} tokens); a draft model must share the target's tokenizer"
        )
    cost = step_weights(draft) / step_weights(target.model)
    return ModelDrafter(draft, name="model", cost=cost)
