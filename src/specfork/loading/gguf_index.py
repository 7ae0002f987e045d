"""A GGUF file's header, parsed once by gguf-py and kept in the cache folder.

gguf-py's reader parses every metadata field when it opens a file, the vocabulary's strings
one by one: 17 s of a Gemma 3 load (262k tokens), 3.4 s of SmolLM2's. What loading needs of
the header is small: the scalar metadata (the architecture's numbers, the chat template, the
special ids), each array's length, and the tensor table (name, block type, shape, and where
and how gguf-py views each tensor's bytes). `GGUFIndex` holds exactly that. `load_index` reads
it from the cache folder (`weights/*-index-*`, keyed by the file's identity, this module's code
and gguf-py's version, naming its source like the weight caches) or opens the file with gguf-py
once and saves what it found; tensors are views of the memory-mapped file, as gguf-py's are.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import gguf
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from specfork.atomic import atomic_file
from specfork.errors import ModelFormatError
from specfork.host import source_digest
from specfork.loading.weight_cache import remove_stale

log = logging.getLogger(__name__)

FORMAT = 1  # bump when the saved layout changes
SMALL_ARRAY = 64  # metadata arrays up to this length are kept whole; longer ones by length only


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One row of a GGUF's tensor table, and how gguf-py views the tensor's bytes."""

    name: str
    tensor_type: gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF order (the fastest-varying dimension first), as gguf-py's
    offset: int  # the tensor's first byte in the file
    dtype: str  # the numpy type of gguf-py's view ("<f4"; "|u1" for blocks)
    view: tuple[int, ...]  # that view's shape

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.view, dtype=np.int64)) * np.dtype(self.dtype).itemsize

    def to_json(self) -> list[Any]:
        return [self.name, int(self.tensor_type), self.shape, self.offset, self.dtype, self.view]

    @classmethod
    def from_json(cls, row: list[Any]) -> TensorEntry:
        name, kind, shape, offset, dtype, view = row
        return cls(
            str(name),
            gguf.GGMLQuantizationType(kind),
            tuple(int(d) for d in shape),
            int(offset),
            str(np.dtype(dtype).str),
            tuple(int(d) for d in view),
        )


class MappedTensor(NamedTuple):
    """A tensor of the memory-mapped file (the fields of gguf-py's `ReaderTensor` loading
    reads)."""

    name: str
    tensor_type: gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF order
    data: np.ndarray  # gguf-py's view of the bytes (read-only)


class GGUFIndex:
    """What loading reads of a GGUF header: metadata values, array lengths, the tensor table."""

    def __init__(
        self,
        path: Path,
        metadata: dict[str, Any],
        lengths: dict[str, int],
        entries: tuple[TensorEntry, ...],
    ) -> None:
        self.path = path
        self.metadata = metadata  # scalars, strings and arrays of up to SMALL_ARRAY items
        self.lengths = lengths  # every array's length
        self.entries = entries

    def value(self, key: str, default: object = None) -> object:
        """The value of metadata `key`, or `default` (a long array is not kept: see `length`)."""
        return self.metadata.get(key, default)

    def length(self, key: str) -> int:
        """How many items the metadata array `key` holds (0 when there is none)."""
        return self.lengths.get(key, 0)

    @functools.cached_property
    def names(self) -> frozenset[str]:
        return frozenset(e.name for e in self.entries)

    @functools.cached_property
    def tensors(self) -> list[MappedTensor]:
        """Every tensor as a view of the file, mapped read-only on first use."""
        mapped = np.memmap(self.path, mode="r")
        out = []
        for e in self.entries:
            data = mapped[e.offset : e.offset + e.nbytes].view(np.dtype(e.dtype)).reshape(e.view)
            out.append(MappedTensor(e.name, e.tensor_type, e.shape, data))
        return out

    @classmethod
    def from_reader(cls, reader: gguf.GGUFReader, path: Path) -> GGUFIndex:
        """The index of a file gguf-py has opened."""
        metadata: dict[str, Any] = {}
        lengths: dict[str, int] = {}
        for key, field in reader.fields.items():
            if field.types[:1] == [gguf.GGUFValueType.ARRAY]:
                lengths[key] = len(field.data)
                if len(field.data) > SMALL_ARRAY:
                    continue
            try:
                metadata[key] = field.contents()
            except (UnicodeDecodeError, ValueError) as exc:
                log.debug("%s: metadata %s is not readable (%s); left out", path.name, key, exc)
        entries = tuple(
            TensorEntry(
                t.name,
                gguf.GGMLQuantizationType(t.tensor_type),
                tuple(int(d) for d in t.shape),
                int(t.data_offset),
                t.data.dtype.str,
                tuple(int(d) for d in t.data.shape),
            )
            for t in reader.tensors
        )
        return cls(path, metadata, lengths, entries)

    def to_json(self) -> str:
        rows = [e.to_json() for e in self.entries]
        return json.dumps({"metadata": self.metadata, "lengths": self.lengths, "tensors": rows})

    @classmethod
    def from_json(cls, text: str, path: Path) -> GGUFIndex:
        """An index saved by `to_json`; ValueError (or KeyError, TypeError) when it is not one,
        or when a tensor lies past the end of the file at `path`."""
        data = json.loads(text)
        metadata, lengths = dict(data["metadata"]), dict(data["lengths"])
        entries = tuple(TensorEntry.from_json(row) for row in data["tensors"])
        size = path.stat().st_size
        if any(e.offset < 0 or e.offset + e.nbytes > size for e in entries):
            raise ValueError(f"a tensor lies outside the {size:,} bytes of {path.name}")
        lengths = {str(k): int(v) for k, v in lengths.items()}
        return cls(path, {str(k): v for k, v in metadata.items()}, lengths, entries)


def open_gguf(path: Path) -> gguf.GGUFReader:
    """Open a GGUF file with gguf-py, turning read errors into a clear ModelFormatError."""
    try:
        return gguf.GGUFReader(path)
    except OSError as exc:
        raise ModelFormatError(f"{path} is not a readable GGUF file: {exc}") from exc
    except (ValueError, IndexError) as exc:
        version = _gguf_version(path)
        if version in (2, 3):  # a GGUF this reader knows whose parts it cannot find: cut short
            raise ModelFormatError(
                f"{path} is not a readable GGUF file: it ends before the data its header "
                f"describes ({path.stat().st_size:,} bytes), as when a download or copy is cut "
                f"short, or it is corrupt; fetch or copy it again (the reader said: {exc})"
            ) from exc
        raise ModelFormatError(f"{path} is not a readable GGUF file: {exc}") from exc


def _gguf_version(path: Path) -> int | None:
    """The version a GGUF file's header gives (None: not a GGUF file, or no version)."""
    with open(path, "rb") as f:
        head = f.read(8)
    if len(head) < 8 or head[:4] != b"GGUF":
        return None
    return int.from_bytes(head[4:], "little")


def index_file(folder: Path, source: Path) -> Path:
    """Where the index of the GGUF at `source` lives (changes with the file, this module's code
    and gguf-py's version)."""
    code = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()
    digest = source_digest(source, FORMAT, code, importlib.metadata.version("gguf"))
    return folder / f"{source.stem}-index-{digest}.safetensors"


def read_index(path: Path, source: Path) -> GGUFIndex | None:
    """The index saved at `path` for the GGUF at `source`, or None when absent or unreadable
    (a damaged entry is logged and parsed again, never fatal)."""
    if not path.exists():
        return None
    try:
        with safe_open(path, framework="pt") as f:
            index = GGUFIndex.from_json((f.metadata() or {})["index"], source)
    except (SafetensorError, OSError, KeyError, ValueError, TypeError) as exc:
        log.warning("ignoring the unreadable GGUF index %s: %s", path, exc)
        return None
    log.debug("read the GGUF index of %s from %s", source.name, path)
    return index


def write_index(path: Path, index: GGUFIndex, source: Path) -> None:
    """Save `index` atomically, then delete those saved before from the same `source`; a
    failure to write only logs a warning (the file is parsed again next time)."""
    meta = {"index": index.to_json(), "source": str(source.resolve())}
    try:
        with atomic_file(path) as tmp:
            save_file({}, tmp, metadata=meta)
    except (OSError, ValueError) as exc:
        log.warning("cannot cache the GGUF index at %s (%s)", path, exc)
        return
    remove_stale(path, source)


def load_index(path: Path, folder: Path | None = None) -> GGUFIndex:
    """The index of the GGUF at `path`: from `folder` (the cache) when saved there before, else
    parsed with gguf-py (and saved there when `folder` is given)."""
    stored_at = index_file(folder, path) if folder is not None else None
    index = read_index(stored_at, path) if stored_at is not None else None
    if index is not None:
        return index
    started = time.perf_counter()
    index = GGUFIndex.from_reader(open_gguf(path), path)
    log.info("parsed the GGUF header of %s in %.1f s", path.name, time.perf_counter() - started)
    if stored_at is not None:
        write_index(stored_at, index, path)
    return index
