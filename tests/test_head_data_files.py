"""Head training data read from memory-mapped shards (`head_data.load_data`), without a model:
the stored samples give the rows that were written, a training window reads only its rows, and
broken shards are refused by name."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from specfork.errors import ConfigError
from specfork.tools.head_data import StoredSample, _write_shard, load_data, sample_rows
from specfork.tools.head_train import _last, _window


def _records(lengths: list[int], seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        {
            "tokens": torch.randint(0, 1000, (t,), generator=g, dtype=torch.int32),  # [T]
            "features": torch.randn(t, 12, generator=g).half(),  # [T, C·D]
            "top_index": torch.randint(0, 1000, (t, 4), generator=g, dtype=torch.int32),
            "top_logp": torch.randn(t, 4, generator=g).half(),  # [T, k]
        }
        for t in lengths
    ]


def _folder(tmp_path: Path, shards: list[list[int]]) -> tuple[Path, list[dict]]:
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "meta.json").write_text(json.dumps({"feature_layers": [0, 1]}))
    written = []
    for i, lengths in enumerate(shards):
        records = _records(lengths, seed=i)
        _write_shard(folder / f"shard-{i:05d}.safetensors", records)
        written += records
    return folder, written


def test_stored_samples_hold_what_was_written(tmp_path: Path) -> None:
    folder, written = _folder(tmp_path, [[5, 9, 3], [7]])
    meta, samples = load_data(folder)
    assert meta == {"feature_layers": [0, 1]} and len(samples) == 4
    assert all(isinstance(s, StoredSample) for s in samples)
    for got, want in zip(samples, written, strict=True):
        assert set(got) == set(want) and len(got) == 4
        for key in want:
            assert torch.equal(got[key], want[key]), key
    with pytest.raises(KeyError):
        samples[0]["offsets"]


def test_windows_read_the_same_rows_as_in_memory_samples(tmp_path: Path) -> None:
    folder, written = _folder(tmp_path, [[40, 12], [25, 3, 30]])
    _, stored = load_data(folder)
    for s, w in zip(stored, written, strict=True):
        for a, b in ((0, 4), (3, 11), (-2, 5), (8, 99)):
            got, want = sample_rows(s, a, b), sample_rows(w, max(0, a), b)
            assert all(torch.equal(got[k], want[k]) for k in want), (a, b)
        got, want = _last(s, 8), _last(w, 8)
        assert all(torch.equal(got[k], want[k]) for k in want)
    a, b = random.Random(3), random.Random(3)
    for _ in range(20):  # the same random windows either way: training does not change
        got, want = _window(stored, 10, a), _window(written, 10, b)
        assert all(torch.equal(got[k], want[k]) for k in want)


def test_broken_shards_are_refused_by_name(tmp_path: Path) -> None:
    folder, _ = _folder(tmp_path, [[5, 6], [4]])
    path = folder / "shard-00001.safetensors"
    path.write_bytes(path.read_bytes()[:100])  # cut short
    with pytest.raises(ConfigError, match=r"shard-00001.safetensors is corrupt.*delete it"):
        load_data(folder)
    from safetensors.torch import save_file

    rows = _records([6])[0]
    rows["offsets"] = torch.tensor([0, 6])
    rows["top_logp"] = rows["top_logp"][:5]  # a tensor with a row missing
    save_file(rows, str(path))
    with pytest.raises(ConfigError, match=r"shard-00001.*do not match the offsets"):
        load_data(folder)
    del rows["top_logp"]
    save_file(rows, str(path))
    with pytest.raises(ConfigError, match=r"shard-00001.*missing top_logp"):
        load_data(folder)


def test_a_folder_without_data_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="holds no head data"):
        load_data(tmp_path)
    (tmp_path / "meta.json").write_text("{}")
    with pytest.raises(ConfigError, match="holds no samples yet"):
        load_data(tmp_path)
