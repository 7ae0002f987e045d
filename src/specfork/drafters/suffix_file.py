"""The suffix index kept between processes (`--suffix-persist`): its sequences, oldest first,
in one file per weight file under the cache folder's `suffix/` (token ids belong to that
model's tokenizer, so the file's name carries the weight file's identity).

A file is read back by indexing its sequences again (`SuffixIndex.restore`: ~70 µs a token,
about 2 s for a full index of 32,768 tokens); a missing, unreadable or other-format file is an
empty start (logged), never an error. Writes are atomic (`atomic_file`).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from specfork.atomic import atomic_file
from specfork.drafters.suffix_index import Snapshot, SuffixIndex
from specfork.host import source_digest

log = logging.getLogger(__name__)

FORMAT = "1"  # bump when the file's layout changes


def index_file(folder: Path, source: Path) -> Path:
    """Where the index of the model whose weights are at `source` is kept."""
    return folder / f"{source.stem}-suffix-{source_digest(source, FORMAT)}.safetensors"


def save_index(index: SuffixIndex, path: Path) -> bool:
    """Write what `index` holds to `path`; False (and a warning) when it cannot be written."""
    held = index.snapshot()
    tokens = [t for _, seq in held.sequences for t in seq]
    lengths = [len(seq) for _, seq in held.sequences]
    tensors = {
        "tokens": torch.tensor(tokens, dtype=torch.int64),  # [N] every sequence, one after another
        "lengths": torch.tensor(lengths, dtype=torch.int64),  # [S] each sequence's tokens
    }
    try:
        with atomic_file(path) as tmp:
            save_file(tensors, tmp, metadata={"format": FORMAT})
    except OSError as exc:
        log.warning("cannot save the suffix index to %s (%s)", path, exc)
        return False
    return True


def load_index(index: SuffixIndex, path: Path) -> bool:
    """Make `index` hold the sequences kept at `path` (the newest within its budget); False,
    leaving `index` as it was, when there is no readable file of this format."""
    if not path.exists():
        return False
    try:
        with safe_open(str(path), framework="pt") as f:
            if (f.metadata() or {}).get("format") != FORMAT:
                log.warning("ignoring the suffix index %s: another format", path)
                return False
            tokens, lengths = f.get_tensor("tokens").tolist(), f.get_tensor("lengths").tolist()
    except (SafetensorError, OSError) as exc:
        log.warning("ignoring the unreadable suffix index %s (%s)", path, exc)
        return False
    if sum(lengths) != len(tokens) or min(lengths, default=1) < 1:
        log.warning("ignoring the suffix index %s: its lengths do not add up", path)
        return False
    sequences, start = [], 0
    for i, n in enumerate(lengths):
        sequences.append((i, tuple(tokens[start : start + n])))
        start += n
    index.restore(Snapshot(tuple(sequences), len(lengths)))
    return True
