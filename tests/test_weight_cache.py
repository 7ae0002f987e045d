"""The converted-weight cache (`loading.weight_cache`): read back as written, and a new file
replaces what was converted before from the same source in the same dtype, keeping the rest."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from specfork.config import ModelConfig
from specfork.loading import weight_cache

CFG = ModelConfig("llama", 64, 32, 64, 2, 4, 2, 8, max_position=64)


def _write(folder: Path, source: Path, dtype: torch.dtype, value: float) -> Path:
    path = weight_cache.cache_file(folder, source, dtype)
    weight_cache.write(path, CFG, {"w": torch.full((2, 3), value, dtype=dtype)}, source)
    return path


def _touch_later(path: Path) -> None:
    later = time.time() + 10
    os.utime(path, (later, later))  # the file changed: its cache key changes


def test_read_back_as_written(tmp_path: Path) -> None:
    source = tmp_path / "model.gguf"
    source.write_bytes(b"weights")
    path = _write(tmp_path / "cache", source, torch.float32, 1.5)
    cfg, tensors = weight_cache.read(path)
    assert cfg == CFG and torch.equal(tensors["w"], torch.full((2, 3), 1.5))
    assert weight_cache.source_of(path) == str(source.resolve())
    assert weight_cache.read(tmp_path / "cache" / "absent.safetensors") is None


def test_a_new_conversion_replaces_the_stale_one_only(tmp_path: Path) -> None:
    folder = tmp_path / "cache"
    source, twin = tmp_path / "model.gguf", tmp_path / "elsewhere" / "model.gguf"
    twin.parent.mkdir()
    for f in (source, twin):
        f.write_bytes(b"weights")
    old = _write(folder, source, torch.float32, 1.0)
    other_dtype = _write(folder, source, torch.bfloat16, 1.0)
    twins = _write(folder, twin, torch.float32, 1.0)  # a same-named file elsewhere
    unnamed = folder / "model-float32-0123456789abcdef.safetensors"  # names no source
    unnamed.write_bytes(old.read_bytes().replace(b"source", b"origin"))
    assert weight_cache.source_of(unnamed) is None

    _touch_later(source)
    new = _write(folder, source, torch.float32, 2.0)
    assert new != old and new.exists() and not old.exists()
    assert other_dtype.exists() and twins.exists() and unnamed.exists()
    assert torch.equal(weight_cache.read(new)[1]["w"], torch.full((2, 3), 2.0))
    assert len(list(folder.glob("*.safetensors"))) == 4
