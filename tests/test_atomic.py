"""Atomic files: whole or absent, never half-written."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from specfork.atomic import atomic_file, exclusive, write_text


def test_a_written_file_appears_whole(tmp_path: Path) -> None:
    target = tmp_path / "sub" / "file.json"
    write_text(target, "{}")
    assert target.read_text() == "{}"
    assert stat.S_IMODE(target.stat().st_mode) == 0o644
    assert [p.name for p in target.parent.iterdir()] == ["file.json"]
    write_text(target, '{"a": 1}')  # replaces
    assert target.read_text() == '{"a": 1}'


def test_a_failed_write_leaves_nothing_and_keeps_the_old_file(tmp_path: Path) -> None:
    target = tmp_path / "file.bin"
    with pytest.raises(OSError, match="disk full"), atomic_file(target) as tmp:
        tmp.write_bytes(b"half")
        raise OSError("disk full")
    assert list(tmp_path.iterdir()) == []
    target.write_bytes(b"old")
    with pytest.raises(KeyboardInterrupt), atomic_file(target) as tmp:
        tmp.write_bytes(b"new, interrupted")
        raise KeyboardInterrupt
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["file.bin"]


def test_an_exclusive_lock_keeps_out_other_holders_until_released(tmp_path: Path) -> None:
    """`exclusive` is a real `flock`: another open of the same file (as another process
    makes) cannot take it while the block runs, and can once the block has ended."""
    import fcntl

    lock = tmp_path / "sub" / "thing.lock"

    def try_lock() -> bool:
        with lock.open("a") as other:
            try:
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            fcntl.flock(other, fcntl.LOCK_UN)
            return True

    with exclusive(lock):
        assert lock.is_file() and not try_lock()
    assert try_lock()
