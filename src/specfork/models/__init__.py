"""Decoder implementations, one module per architecture family."""

from specfork.config import ModelConfig
from specfork.models.base import DecoderLM
from specfork.models.gemma3 import Gemma3LM
from specfork.models.llama import LlamaLM

FAMILIES: dict[str, type[DecoderLM]] = {"llama": LlamaLM, "gemma3": Gemma3LM}


def build_model(cfg: ModelConfig) -> DecoderLM:
    """An uninitialised model of `cfg`'s architecture (weights are loaded afterwards)."""
    return FAMILIES[cfg.arch](cfg)


__all__ = ["DecoderLM", "Gemma3LM", "LlamaLM", "build_model"]
