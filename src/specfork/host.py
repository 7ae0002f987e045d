"""This machine, as specfork's caches know it: where they live, what identifies a file, and
what the CPU is (its name and instruction sets).

The ground floor: every layer that keeps something in the cache folder (kernel builds, packed
and converted weights, cost curves, tokenizers, recycle priors) or keys it by the processor
reads these, so none of them has to reach into another layer for it.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
from pathlib import Path


def cache_dir() -> Path:
    """Return specfork's cache folder (not created here).

    ``$SPECFORK_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/specfork`` if that is an absolute
    path, else ``~/.cache/specfork``.
    """
    override = os.environ.get("SPECFORK_CACHE_DIR")
    if override:
        return Path(override).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg and Path(xdg).is_absolute():
        return Path(xdg) / "specfork"
    return Path.home() / ".cache" / "specfork"


def source_digest(source: Path, *parts: object) -> str:
    """A short digest of a file's identity (path, size, mtime) and `parts`: it changes when the
    file does, so anything derived from the file can be cached under it."""
    st = source.stat()
    key = "|".join(str(x) for x in (source.resolve(), st.st_size, st.st_mtime_ns, *parts))
    return hashlib.sha256(key.encode()).hexdigest()[:16]


@functools.cache
def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def cpu_name() -> str:
    """The CPU model from /proc/cpuinfo (platform.processor() elsewhere)."""
    for line in _cpuinfo().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as /proc/cpuinfo names them (x86 `flags`, Arm `Features`);
    empty where it is not readable."""
    for line in _cpuinfo().splitlines():
        if line.startswith(("flags", "Features")):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()
