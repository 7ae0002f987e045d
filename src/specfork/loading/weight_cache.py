"""On-disk cache of converted GGUF weights.

Reading a GGUF header (its vocabulary arrays) and dequantizing every tensor takes seconds; the
result — our own fused weights in the run dtype plus the ModelConfig — is saved once as a
safetensors file, so later loads of the same unchanged file map it back in a fraction of that.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from specfork.atomic import atomic_file
from specfork.config import ModelConfig

log = logging.getLogger(__name__)

FORMAT = 1  # bump when the saved layout or the conversion changes
Converted = tuple[ModelConfig, dict[str, torch.Tensor]]


def source_digest(source: Path, *parts: object) -> str:
    """A short digest of a file's identity (path, size, mtime) and `parts`: it changes when the
    file does, so anything derived from the file can be cached under it."""
    st = source.stat()
    key = "|".join(str(x) for x in (source.resolve(), st.st_size, st.st_mtime_ns, *parts))
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def cache_file(folder: Path, source: Path, dtype: torch.dtype) -> Path:
    """Where the converted weights of `source` in `dtype` live (changes with the file)."""
    digest = source_digest(source, dtype, FORMAT)
    return folder / f"{source.stem}-{str(dtype).removeprefix('torch.')}-{digest}.safetensors"


def read(path: Path) -> Converted | None:
    """The cached config and weights at `path`, or None when absent or unreadable."""
    if not path.exists():
        return None
    try:
        with safe_open(path, framework="pt") as f:
            cfg = ModelConfig.from_dict(json.loads(f.metadata()["config"]))
        tensors = load_file(path)
    except (SafetensorError, OSError, KeyError, ValueError, TypeError) as exc:
        log.warning("ignoring unreadable weight cache %s: %s", path, exc)
        return None
    log.info("loaded converted weights from %s", path)
    return cfg, tensors


def write(path: Path, cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> None:
    """Save converted weights atomically; a failure to write only logs a warning."""
    contiguous = {k: v.contiguous() for k, v in tensors.items()}
    try:
        with atomic_file(path) as tmp:
            save_file(contiguous, tmp, metadata={"config": json.dumps(cfg.to_dict())})
    except OSError as exc:
        log.warning("cannot cache converted weights at %s (%s)", path, exc)
