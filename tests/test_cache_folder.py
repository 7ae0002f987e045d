"""`specfork cache` and `loading.cache_folder`: what the cache folder holds, which entries are
stale (and why), and that pruning or clearing removes those and nothing else."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from cli_run import run_cli
from specfork.config import ModelConfig
from specfork.kernels.build import module_name
from specfork.loading import cache_folder, weight_cache
from specfork.loading.packed_cache import packed_file_for

CFG = ModelConfig("llama", 64, 32, 64, 2, 4, 2, 8, max_position=64)
KEY = "0123456789abcdef"  # this installation's kernel build, as the tests pretend


def _age(path: Path, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then))


def _converted(folder: Path, source: Path) -> Path:
    path = weight_cache.cache_file(folder / "weights", source, torch.float32)
    weight_cache.write(path, CFG, {"w": torch.ones(2)}, source)
    return path


def _packed(folder: Path, source: Path, key: str) -> Path:
    path = packed_file_for(folder / "weights", source, module_name(key))
    save_file({"w": torch.ones(2)}, str(path), metadata={"source": str(source.resolve())})
    return path


def _fill(tmp_path: Path) -> tuple[Path, dict[str, Path], set[str]]:
    """A cache folder with one entry of each kind; (folder, entries by name, stale names)."""
    folder, sources = tmp_path / "cache", tmp_path / "sources"
    for part in ("models", "weights", "kernels", "cost"):
        (folder / part).mkdir(parents=True)
    sources.mkdir()
    names = ("kept", "changed", "gone", "eager")
    kept, changed, gone, eager = (sources / f"{n}.gguf" for n in names)
    for f in (kept, changed, gone, eager):
        f.write_bytes(b"gguf")
    e = {
        "model": folder / "models" / "model.gguf",
        "converted": _converted(folder, kept),  # its packed weights are there: unused
        "eager_only": _converted(folder, eager),  # no packed weights: the eager path's
        "packed": _packed(folder, kept, KEY),
        "packed_other_build": _packed(folder, changed, "fedcba9876543210"),
        "changed": _converted(folder, changed),
        "gone": _converted(folder, gone),
        "unnamed": folder / "weights" / "old-float32-0000000000000000.safetensors",
        "build": folder / "kernels" / KEY,
        "old_build": folder / "kernels" / "1111111111111111",
        "fresh_tmp": folder / "kernels" / f".{KEY}-abc",
        "left_tmp": folder / "weights" / ".x.safetensors.abc.partial",
        "curve": folder / "cost" / "kept-cost-1.json",
        "old_curve": folder / "cost" / "kept-cost-2.json",
    }
    e["model"].write_bytes(b"m" * 100)
    save_file({"w": torch.ones(2)}, str(e["unnamed"]))
    for name in ("build", "old_build", "fresh_tmp"):
        e[name].mkdir()
        (e[name] / "lib.so").write_bytes(b"x" * 10)
    for name in ("left_tmp", "curve", "old_curve"):
        e[name].write_text("{}")
    _age(e["left_tmp"], 2 * 3600)
    _age(e["old_curve"], 8 * 86400)
    later = time.time() + 10
    os.utime(changed, (later, later))  # its converted weights are no longer its key's
    gone.unlink()
    (folder / "notes.txt").write_text("not specfork's")  # outside the known parts
    for lock in (folder / "models" / "model.gguf.lock", folder / "kernels" / f".{KEY}.lock"):
        lock.write_text("")  # atomic.exclusive's lock files: not entries, even when old
        _age(lock, 2 * 3600)
    stale = {
        "converted",
        "packed_other_build",
        "changed",
        "gone",
        "unnamed",
        "old_build",
        "left_tmp",
        "old_curve",
    }
    return folder, e, stale


def test_entries_say_what_is_stale_and_why(tmp_path: Path) -> None:
    folder, e, stale = _fill(tmp_path)
    found = {x.path: x for x in cache_folder.entries(folder, KEY)}
    assert set(found) == set(e.values())  # notes.txt is not the cache's
    assert {n for n, p in e.items() if found[p].stale} == stale
    why = {n: found[e[n]].stale for n in stale}
    assert why["gone"].startswith("its source") and why["gone"].endswith("gone.gguf is gone")
    assert "changed since" in why["changed"] and "changed since" in why["packed_other_build"]
    assert "names no source" in why["unnamed"] and "other sources" in why["old_build"]
    assert "interrupted" in why["left_tmp"] and "older than 7 days" in why["old_curve"]
    assert why["converted"] == cache_folder.UNUSED_COPY
    assert cache_folder.model_of(found[e["converted"]]) == "kept.gguf"
    assert cache_folder.model_of(found[e["model"]]) == ""
    assert found[e["model"]].size == 100 and found[e["build"]].size == 10
    unknown = {x.path for x in cache_folder.entries(folder, None) if x.stale}
    assert e["old_build"] not in unknown and e["packed"] not in unknown  # no key: builds kept
    assert e["converted"] not in unknown  # no kernels here: the eager path reads it


def test_prune_removes_the_stale_entries_only(tmp_path: Path) -> None:
    folder, e, stale = _fill(tmp_path)
    removed = cache_folder.prune(cache_folder.entries(folder, KEY))
    assert {x.path for x in removed} == {e[n] for n in stale}
    assert {n for n, p in e.items() if p.exists()} == set(e) - stale
    assert not any(x.stale for x in cache_folder.entries(folder, KEY))


def test_clear_removes_every_entry_but_nothing_else(tmp_path: Path) -> None:
    folder, e, _ = _fill(tmp_path)
    removed = cache_folder.clear(cache_folder.entries(folder, KEY))
    assert {x.path for x in removed} == set(e.values())
    assert not any(p.exists() for p in e.values())
    assert (folder / "notes.txt").read_text() == "not specfork's"
    assert (folder / "kernels" / f".{KEY}.lock").is_file()


def test_the_command(tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    folder, e, _ = _fill(tmp_path)
    monkeypatch.setenv("SPECFORK_CACHE_DIR", str(folder))
    code, out, _ = run_cli(capsys, ["cache", "--json"])
    doc = json.loads(out)
    assert code == 0 and doc["folder"] == str(folder) and "removed" not in doc
    assert {x["path"] for x in doc["entries"]} == {str(p) for p in e.values()}
    assert all(p.exists() for p in e.values())  # listing removes nothing
    code, out, _ = run_cli(capsys, ["cache"])
    assert code == 0 and "specfork cache --prune" in out and "names no source" in out
    code, out, _ = run_cli(capsys, ["cache", "--prune"])
    assert code == 0 and f"entries removed from {folder}" in out
    assert "is gone" in out  # each removal says why
    code, out, _ = run_cli(capsys, ["cache"])
    assert code == 0 and "Nothing is stale." in out
    code, out, _ = run_cli(capsys, ["cache", "--clear", "--json"])
    assert code == 0 and json.loads(out)["freed_bytes"] > 100
    assert (folder / "notes.txt").exists()
    code, out, _ = run_cli(capsys, ["cache"])
    assert code == 0 and "is empty" in out
    with pytest.raises(SystemExit) as exc:
        run_cli(capsys, ["cache", "--prune", "--clear"])
    assert exc.value.code == 2 and "not allowed with argument" in capsys.readouterr().err


def test_a_cache_folder_that_is_a_file_is_an_error(
    tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    file = tmp_path / "cache"
    file.write_text("not a folder")
    monkeypatch.setenv("SPECFORK_CACHE_DIR", str(file))
    code, out, err = run_cli(capsys, ["cache"])
    assert code == 2 and out == "" and "is a file, not a folder" in err  # it said "empty"
    assert file.read_text() == "not a folder"
