"""What a run asks of a model, checked before the model loads.

A load reads hundreds of megabytes; a mistake that the model's facts (`loading.facts`: its
config and chat template, read from a GGUF's cached header) already show — a draft head made
for another model or none shipped for it, a draft model with another vocabulary, self-drafting
layers the model lacks — is reported first. `open_model` resolves a model, runs these checks
and the caller's own, then loads it; every check raises the same error its builder would after
loading.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from specfork.catalog.sources import DraftSource
from specfork.config import SpecConfig
from specfork.heads.model import read_head_config
from specfork.heads.packaged import packaged_head
from specfork.loading.facts import ModelFacts, check_draft_vocabulary, config_of, model_facts
from specfork.loading.loader import LoadedModel, load_model
from specfork.loading.registry import resolve_model
from specfork.strategies.builders import self_layers

SourceCheck = Callable[[DraftSource, SpecConfig, ModelFacts], None]
Loader = Callable[..., LoadedModel]


def _head(source: DraftSource, spec: SpecConfig, target: ModelFacts) -> None:
    """A head at PATH, or the one shipped for the target, exists and was made for it."""
    folder = Path(source.path) if source.path else packaged_head(target.path)
    read_head_config(folder, target.config)


def _model(source: DraftSource, spec: SpecConfig, target: ModelFacts) -> None:
    """A draft model resolves (fetched if it must be) and shares the target's vocabulary."""
    draft = config_of(resolve_model(source.path or "", progress=False))
    check_draft_vocabulary(target.config, draft)


def _self(source: DraftSource, spec: SpecConfig, target: ModelFacts) -> None:
    """The layers a self drafter runs exist in the target."""
    self_layers(spec, target.config.num_layers)


#: the drafter kinds whose sources can be checked before loading, and their checks (the other
#: kinds need nothing of the model)
SOURCE_CHECKS: dict[str, SourceCheck] = {"head": _head, "model": _model, "self": _self}


def check_sources(spec: SpecConfig, target: ModelFacts) -> None:
    """Check each of `spec`'s drafter sources against the target's facts."""
    for source in spec.sources:
        check = SOURCE_CHECKS.get(source.kind)
        if check is not None:
            check(source, spec, target)


def open_model(
    name_or_path: str,
    spec: SpecConfig | None = None,
    *,
    check: Callable[[ModelFacts], None] | None = None,
    load: Loader = load_model,
    progress: bool = True,
    **options: Any,
) -> LoadedModel:
    """Resolve `name_or_path` (`registry.resolve_model`), check `spec`'s drafter sources and
    `check` (the caller's own, e.g. chat mode) against the model's facts, then `load` it with
    `options` (`load_model`'s keywords). Nothing is loaded when a check fails."""
    path = resolve_model(name_or_path, progress=progress)
    facts = model_facts(path)
    if spec is not None:
        check_sources(spec, facts)
    if check is not None:
        check(facts)
    return load(path, progress=progress, **options)
