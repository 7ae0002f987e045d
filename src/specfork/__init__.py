"""specfork: lossless speculative decoding in plain PyTorch.

The public API is imported lazily so that `import specfork` (and the CLI's start) stays fast.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "GenerationConfig": "specfork.config",
    "SamplingParams": "specfork.config",
    "Constraint": "specfork.constraint",
    "ModelConfig": "specfork.config",
    "Generator": "specfork.engine.generator",
    "GenerationResult": "specfork.engine.lifecycle",
    "load_model": "specfork.loading.loader",
    "LoadedModel": "specfork.loading.loader",
    "SpecforkError": "specfork.errors",
}

__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'specfork' has no attribute {name!r}")
