"""What a model is before its weights load: its architecture and whether it has a chat
template, read from a GGUF's header (cached: `gguf_index`) or a folder's config files.

Checks that need only these (a draft head made for another model, a draft model with another
vocabulary, chat mode without a template) run on them before a load, so a mistake is reported
in a second instead of after the weights are read.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from specfork.config import ModelConfig
from specfork.errors import ConfigError
from specfork.host import cache_dir
from specfork.loading import gguf as gguf_loader
from specfork.loading import safetensors as st_loader
from specfork.loading.gguf_index import load_index
from specfork.loading.tokenizer import folder_chat_template

CHAT_TEMPLATE_KEY = "tokenizer.chat_template"  # where a GGUF keeps its chat template


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """A model's file or folder, its config, and whether its tokenizer has a chat template."""

    path: Path
    config: ModelConfig
    has_chat_template: bool


def config_of(path: Path) -> ModelConfig:
    """The ModelConfig of a .gguf file or a checkpoint folder, read without the weights."""
    if path.is_dir():
        return st_loader.config_from_hf(st_loader.read_config(path))
    return gguf_loader.config_from_gguf(load_index(path, cache_dir() / "weights"), path)


def model_facts(path: Path) -> ModelFacts:
    """The facts of the model at `path` (a resolved .gguf file or checkpoint folder)."""
    if path.is_dir():
        return ModelFacts(path, config_of(path), folder_chat_template(path) is not None)
    index = load_index(path, cache_dir() / "weights")
    config = gguf_loader.config_from_gguf(index, path)
    return ModelFacts(path, config, isinstance(index.value(CHAT_TEMPLATE_KEY), str))


def check_draft_vocabulary(target: ModelConfig, draft: ModelConfig) -> None:
    """ConfigError unless a draft model's vocabulary is the target's (it must share the target's
    tokenizer: its token ids are the target's)."""
    if target.vocab_size != draft.vocab_size:
        raise ConfigError(
            f"the draft model's vocabulary ({draft.vocab_size} tokens) differs from the "
            f"target's ({target.vocab_size} tokens); a draft model must share the target's "
            "tokenizer"
        )
