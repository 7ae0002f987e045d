"""Optional dependencies: the pip extra that installs each, and the error that names it.

Features that need a package outside the core install import it through :func:`require`, so
that a missing package is one line naming the feature, the package and the command:
``hf:ar needs accelerate: pip install 'specfork[bench]'``. pyproject.toml's extras list the
same packages (a test checks that they agree).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType

from specfork.errors import ConfigError


@dataclass(frozen=True)
class Extra:
    """An optional import: its module, the distribution that provides it, and the extra."""

    module: str
    package: str
    extra: str

    @property
    def command(self) -> str:
        return f"pip install 'specfork[{self.extra}]'"


#: Every optional import, by module name.
EXTRAS = {
    e.module: e
    for e in (
        Extra("accelerate", "accelerate", "bench"),  # transformers loading a GGUF (hf: baselines)
        Extra("httpx", "httpx", "bench"),  # HTTP baselines (OpenAI-compatible servers)
        Extra("llama_cpp", "llama-cpp-python", "llamacpp"),  # llamacpp: baselines
    )
}


class MissingDependencyError(ConfigError):
    """An optional package a feature needs is not installed; the message says how to get it."""

    def __init__(self, feature: str, extra: Extra, reason: str = "") -> None:
        self.feature, self.extra = feature, extra
        why = f" ({reason})" if reason else ""
        super().__init__(f"{feature} needs {extra.package}{why}: {extra.command}")


def require(module: str, feature: str) -> ModuleType:
    """Import ``module`` (one of :data:`EXTRAS`) for ``feature``, or raise
    :class:`MissingDependencyError` naming the pip command that installs it."""
    extra = EXTRAS[module]
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        missing = getattr(exc, "name", None) in (None, module.split(".")[0])
        raise MissingDependencyError(feature, extra, "" if missing else str(exc)) from exc
