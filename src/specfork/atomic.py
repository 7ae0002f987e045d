"""Files that appear whole or not at all: written next to their target, then renamed.

Every cache specfork writes (converted weights, tokenizers, the recycle prior) goes through
`atomic_file`, so an interrupted write never leaves a half-written file where a later run would
read it.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_file(path: Path, mode: int = 0o644) -> Iterator[Path]:
    """A temporary path next to `path` to write; renamed onto `path` when the block succeeds,
    deleted when it fails (the error propagates). The parent folder is created."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        os.chmod(tmp, mode)  # mkstemp makes it private; caches are not secret
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_text(path: Path, text: str) -> None:
    """Write `text` (UTF-8) to `path` atomically."""
    with atomic_file(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
