"""A GGUF file's tokenizer: converted once with transformers, then cached on disk.

A GGUF file carries no ``tokenizer.json``. The first conversion of a file has transformers
build the tokenizer from its metadata (slow: seconds, it imports transformers); the result is
written to a cache folder (``tokenizer.json`` plus a sidecar of what generation needs), keyed
by the file's real path, size and modification time and the tool versions, so later loads read
only the cache with the ``tokenizers`` library.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import struct
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as BackendTokenizer

from specfork.atomic import write_text
from specfork.errors import ModelFormatError

logger = logging.getLogger(__name__)

#: Bumped whenever the cache layout or the meaning of a sidecar field changes.
CACHE_FORMAT = 1
TOKENIZER_FILE = "tokenizer.json"
SIDECAR_FILE = "specfork_tokenizer.json"
_GGUF_EOS_KEYS = (
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.eot_token_id",
    "tokenizer.ggml.eom_token_id",
)
#: GGUF architectures whose name is also transformers' model type (see `_tokenizer_type`).
_ARCHITECTURE_IS_MODEL_TYPE = ("qwen2", "qwen3", "gemma3")


def gguf_cache_key(path: Path) -> str:
    """A cheap key that changes when the file changes: real path, size, mtime, tool versions."""
    stat = path.stat()
    parts = [
        str(CACHE_FORMAT),
        os.path.realpath(path),
        str(stat.st_size),
        str(stat.st_mtime_ns),
        _package_version("tokenizers"),
        _package_version("transformers"),
    ]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:24]


def _package_version(name: str) -> str:
    """An installed package's version, read from its metadata (no import)."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "none"


def read_cache_entry(entry: Path) -> tuple[BackendTokenizer, dict[str, Any]] | None:
    """The backend and sidecar cached in ``entry``; None if missing or damaged."""
    sidecar_file = entry / SIDECAR_FILE
    if not sidecar_file.is_file():
        return None
    try:
        sidecar = json.loads(sidecar_file.read_text(encoding="utf-8"))
        backend = BackendTokenizer.from_file(str(entry / TOKENIZER_FILE))
    except Exception as error:  # a damaged cache is rebuilt, never fatal
        logger.warning("Ignoring the damaged tokenizer cache %s: %s", entry, error)
        return None
    if not isinstance(sidecar, dict) or sidecar.get("format") != CACHE_FORMAT:
        logger.warning("Ignoring the tokenizer cache %s of another format", entry)
        return None
    return backend, sidecar


def write_cache_entry(entry: Path, backend: BackendTokenizer, sidecar: Mapping[str, Any]) -> None:
    """Write ``tokenizer.json`` then the sidecar, each atomically; the sidecar marks completion."""
    write_text(entry / TOKENIZER_FILE, backend.to_str())
    write_text(entry / SIDECAR_FILE, json.dumps(dict(sidecar), ensure_ascii=False, indent=1))


def convert_gguf(path: Path) -> tuple[BackendTokenizer, dict[str, Any]]:
    """Build the tokenizer of a GGUF file with transformers: the backend and the `Tokenizer`
    fields the file's metadata gives (bos_id, eos_ids, chat_template, template_tokens, source)."""
    metadata = read_gguf_metadata(path)
    _require_tokenizer_metadata(path, metadata)
    hf_tokenizer = _transformers_gguf_tokenizer(path, metadata)
    backend = hf_tokenizer.backend_tokenizer
    if backend.get_vocab_size(with_added_tokens=True) != metadata["tokenizer.ggml.tokens"]:
        logger.warning("transformers' tokenizer of %s has a different vocabulary size", path)
    eos_ids = [metadata[key] for key in _GGUF_EOS_KEYS if isinstance(metadata.get(key), int)]
    fields = {
        "bos_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_ids": eos_ids,
        "chat_template": metadata.get("tokenizer.chat_template"),
        "template_tokens": {k: str(v) for k, v in hf_tokenizer.special_tokens_map.items()},
        "source": os.path.realpath(path),
    }
    return backend, fields


def _require_tokenizer_metadata(path: Path, metadata: Mapping[str, Any]) -> None:
    """Raise :class:`ModelFormatError` unless the file describes a tokenizer."""
    missing = [
        key for key in ("tokenizer.ggml.model", "tokenizer.ggml.tokens") if key not in metadata
    ]
    if missing:
        raise ModelFormatError(
            f"GGUF file {path} has no tokenizer: its metadata lacks {', '.join(missing)}."
        )


def _transformers_gguf_tokenizer(path: Path, metadata: Mapping[str, Any]) -> Any:
    """transformers' fast tokenizer for the file, loaded from a folder holding only the file.

    The file is linked into an empty temporary folder so that tokenizer files lying next to it
    (a Hugging Face snapshot, say) cannot mix into the conversion.
    """
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory(prefix="specfork-gguf-") as folder:
        link = Path(folder) / path.name
        tokenizer_type = _tokenizer_type(metadata)
        try:
            link.symlink_to(path.resolve())
        except OSError:  # no symlinks here (some Windows setups): use the file's own folder,
            folder, link = str(path.parent), path  # where a tokenizer_config.json may name
            tokenizer_type = None  # the class: let transformers choose as it always does
        known = {"tokenizer_type": tokenizer_type} if tokenizer_type else {}
        try:
            return AutoTokenizer.from_pretrained(folder, gguf_file=link.name, **known)
        except Exception as error:  # transformers raises many types for files it cannot convert
            kind = metadata.get("tokenizer.ggml.model")
            raise ModelFormatError(
                f"transformers cannot build the tokenizer (tokenizer.ggml.model={kind!r}) of "
                f"GGUF file {path}: {error}"
            ) from error


def _tokenizer_type(metadata: Mapping[str, Any]) -> str | None:
    """The tokenizer type to name to ``AutoTokenizer``, or None to let it find the type itself.

    Finding it, transformers rebuilds the model's whole config from the file with gguf-py's
    reader, which walks every metadata array element by element (~20 s for Gemma 3's 262k-token
    vocabulary) only to learn the model type. Where the file's architecture *is* that model type
    (qwen2, qwen3, gemma3: no renaming on transformers' side), naming it skips the walk and
    picks the same tokenizer class. Llama files keep the slow path: transformers has no "llama"
    tokenizer type, and may read a llama file as a Mistral one.
    """
    architecture = metadata.get("general.architecture")
    if architecture not in _ARCHITECTURE_IS_MODEL_TYPE:
        return None
    try:
        from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES
    except ImportError:
        return None
    return architecture if architecture in TOKENIZER_MAPPING_NAMES else None


def read_gguf_metadata(path: Path) -> dict[str, Any]:
    """A GGUF file's metadata; string arrays (the vocabulary, the merges) appear as their length.

    Uses transformers' header reader, which skips the big arrays, when it exists; otherwise
    ``gguf.GGUFReader`` (much slower on large vocabularies).
    """
    try:
        from transformers.integrations.gguf.reader import read_gguf_metadata as fast_reader
    except ImportError:
        fast_reader = None
    try:
        if fast_reader is not None:
            return fast_reader(str(path))[0]
        return _read_metadata_with_gguf(path)
    except (OSError, ValueError, KeyError, IndexError, struct.error, UnicodeDecodeError) as error:
        raise ModelFormatError(f"Cannot read the GGUF metadata of {path}: {error}") from error


def _read_metadata_with_gguf(path: Path) -> dict[str, Any]:
    """Metadata via ``gguf.GGUFReader``: scalars as values, string arrays as their length."""
    from gguf import GGUFReader, GGUFValueType

    metadata: dict[str, Any] = {}
    for key, field in GGUFReader(path).fields.items():
        if field.types[:1] == [GGUFValueType.ARRAY] and field.types[-1] == GGUFValueType.STRING:
            metadata[key] = len(field.data)
        else:
            metadata[key] = field.contents()
    return metadata
