"""On-disk cache of converted GGUF weights.

Reading a GGUF header (its vocabulary arrays) and dequantizing every tensor takes seconds; the
result — our own fused weights in the run dtype plus the ModelConfig — is saved once as a
safetensors file, so later loads of the same unchanged file map it back in a fraction of that.
Each file names its source path in its metadata, and a new file replaces those converted before
from the same source in the same dtype (an edited GGUF, an older FORMAT), so upgrades leave no
stale copies behind.
"""

from __future__ import annotations

import glob
import json
import logging
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from specfork.atomic import atomic_file
from specfork.config import ModelConfig
from specfork.host import source_digest

log = logging.getLogger(__name__)

FORMAT = 1  # bump when the saved layout or the conversion changes
Converted = tuple[ModelConfig, dict[str, torch.Tensor]]


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


def write(path: Path, cfg: ModelConfig, tensors: dict[str, torch.Tensor], source: Path) -> None:
    """Save converted weights atomically, then delete those converted before from the same
    `source` in the same dtype; a failure to write only logs a warning."""
    contiguous = {k: v.contiguous() for k, v in tensors.items()}
    meta = {"config": json.dumps(cfg.to_dict()), "source": str(source.resolve())}
    try:
        with atomic_file(path) as tmp:
            save_file(contiguous, tmp, metadata=meta)
    except OSError as exc:
        log.warning("cannot cache converted weights at %s (%s)", path, exc)
        return
    remove_stale(path, source)


def remove_stale(path: Path, source: Path) -> None:
    """Delete the files beside `path` that differ from it only in their digest (its name up to
    the last "-": the same source stem and kind) and name the same `source` in their metadata:
    what was cached before from that file (it changed, or the format did). A file of a
    same-named source elsewhere, or one that names none, is kept."""
    origin = str(source.resolve())
    pattern = f"{glob.escape(path.name.rsplit('-', 1)[0])}-*{path.suffix}"
    for other in path.parent.glob(pattern):
        if other != path and source_of(other) == origin:
            log.info("removing %s, cached before from the same file", other)
            try:
                other.unlink(missing_ok=True)
            except OSError as exc:  # another user's file, a read-only folder: keep it
                log.warning("cannot remove the stale cache file %s (%s)", other, exc)


def source_of(path: Path) -> str | None:
    """The source path a cache file names in its metadata (None: unreadable, or none)."""
    try:
        with safe_open(path, framework="pt") as f:
            return (f.metadata() or {}).get("source")
    except (SafetensorError, OSError):
        return None
