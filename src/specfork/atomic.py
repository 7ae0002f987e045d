"""Files that appear whole or not at all: written next to their target, then renamed.

Every cache specfork writes (converted weights, tokenizers, the recycle prior) goes through
`atomic_file`, so an interrupted write never leaves a half-written file where a later run would
read it. `exclusive` keeps two processes from making the same large thing at once (a model
download, a kernel build): the second waits and then finds the first one's result.
"""

from __future__ import annotations

import fcntl
import logging
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from specfork.errors import ConfigError

log = logging.getLogger(__name__)


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


@contextmanager
def exclusive(lock: Path) -> Iterator[None]:
    """Hold an exclusive `flock` on the file `lock` (created, with its folder, if needed) for
    the block; another process holding it is waited for. Raises OSError when `lock` cannot be
    opened."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    with lock.open("a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another specfork process that holds %s", lock)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def write_text(path: Path, text: str) -> None:
    """Write `text` (UTF-8) to `path` atomically."""
    with atomic_file(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def output_folder(path: Path, flag: str) -> Path:
    """`path` made (parents included) as a folder to write into, or a ConfigError naming `flag`
    and the reason (a file in the way, no permission, a read-only or virtual file system)."""
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{flag} {path} is a file; give a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise ConfigError(
            f"{flag} {path} cannot be written ({reason}); choose a folder you can write to"
        ) from None
    return path
