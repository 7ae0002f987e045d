"""The packaged model packed for the kernels and kept on disk (`loading.packed_cache`): a later
load reads it back without parsing the GGUF, runs the same logits, and a damaged, stale or
foreign cache file is never used."""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path

import pytest
import torch

from specfork.kernels import load_kernels
from specfork.loading import fast
from specfork.loading.loader import load_model
from specfork.loading.packed_cache import packed_file
from specfork.loading.registry import DEFAULT_MODEL, resolve_model
from specfork.models.fast import FastLM

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(load_kernels() is None, reason="the kernels are not available here"),
]
IDS = torch.tensor([[1, 504, 3575, 282, 4649, 314, 3575]])  # [1, 7]


def _logits(model: FastLM) -> torch.Tensor:
    with torch.inference_mode():
        hidden = model(IDS, torch.arange(IDS.shape[1]), model.new_cache(16))  # [1, 7, D]
        return model.logits(hidden[0])  # [7, V]


@pytest.fixture(scope="module")
def gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the default model's GGUF (its identity, the cache key, is changed below)."""
    path = tmp_path_factory.mktemp("model") / "model.gguf"
    shutil.copy(resolve_model(DEFAULT_MODEL, progress=False), path)
    return path


def test_a_packed_model_is_read_back_with_the_same_logits(
    gguf: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    kernels = load_kernels()
    parsed = fast.load_gguf_fast(gguf, kernels, folder=tmp_path)
    assert fast.is_packed(gguf, kernels, tmp_path)
    with caplog.at_level(logging.INFO, logger="specfork.loading.packed_cache"):
        stored = fast.load_gguf_fast(gguf, kernels, folder=tmp_path)
    assert any("loaded the packed model" in r.message for r in caplog.records)
    assert stored.config == parsed.config and stored.describe() == parsed.describe()
    assert torch.equal(_logits(stored), _logits(parsed))


def test_a_damaged_file_is_packed_again(
    gguf: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    kernels = load_kernels()
    reference = _logits(fast.load_gguf_fast(gguf, kernels))
    path = packed_file(tmp_path, gguf, kernels)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\x10\x00\x00\x00not a safetensors file")
    with caplog.at_level(logging.WARNING, logger="specfork.loading.packed_cache"):
        model = fast.load_gguf_fast(gguf, kernels, folder=tmp_path)
    assert "unreadable packed model" in caplog.text
    assert torch.equal(_logits(model), reference)
    assert path.stat().st_size > 1_000_000  # written afresh
    assert torch.equal(_logits(fast.load_gguf_fast(gguf, kernels, folder=tmp_path)), reference)


def test_the_key_follows_the_file_and_the_kernels(gguf: Path, tmp_path: Path) -> None:
    kernels = load_kernels()
    before = packed_file(tmp_path, gguf, kernels)
    os.utime(gguf, (time.time() + 5, time.time() + 5))  # the file changed
    assert packed_file(tmp_path, gguf, kernels) != before


def test_load_model_keeps_the_packed_model_in_the_cache_folder(
    gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SPECFORK_CACHE_DIR", str(tmp_path))
    first = load_model(gguf, progress=False)
    assert first.model.describe().startswith("gguf ")
    (stored,) = (tmp_path / "weights").glob("model-packed-*.safetensors")
    (index,) = (tmp_path / "weights").glob("model-index-*.safetensors")  # the GGUF's header
    again = load_model(gguf, progress=False)
    assert torch.equal(_logits(again.model), _logits(first.model))
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == [index.name, stored.name]
    bf16 = load_model(gguf, dtype="bfloat16", progress=False)  # another precision: its own pack
    assert bf16.model.describe().startswith("bfloat16")
    (_packed_bf16,) = (tmp_path / "weights").glob("model-packed_bfloat16-*.safetensors")
    bf16_again = load_model(gguf, dtype="bfloat16", progress=False)
    assert torch.equal(_logits(bf16_again.model), _logits(bf16.model))
    assert len(list((tmp_path / "weights").iterdir())) == 3


def test_a_new_pack_replaces_the_old_one_of_the_same_file(gguf: Path, tmp_path: Path) -> None:
    """A changed file (or a new kernel build) packs afresh and removes what was packed before
    from that file; a file of the same name elsewhere keeps its own."""
    kernels = load_kernels()
    twin = tmp_path / "elsewhere" / gguf.name
    twin.parent.mkdir()
    shutil.copy(gguf, twin)
    fast.load_gguf_fast(twin, kernels, folder=tmp_path)
    fast.load_gguf_fast(gguf, kernels, folder=tmp_path)
    old = packed_file(tmp_path, gguf, kernels)
    os.utime(gguf, (time.time() + 10, time.time() + 10))  # the file changed
    fast.load_gguf_fast(gguf, kernels, folder=tmp_path)
    new = packed_file(tmp_path, gguf, kernels)
    assert new != old and new.exists() and not old.exists()
    assert packed_file(tmp_path, twin, kernels).exists()
    assert len(list(tmp_path.glob("*-packed-*.safetensors"))) == 2
