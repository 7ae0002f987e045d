"""What results.json records about the machine, and the process's peak memory (Linux VmHWM)."""

from __future__ import annotations

import os
import platform
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from specfork import __version__
from specfork.host import cpu_name


def reset_peak_memory() -> bool:
    """Reset the process's VmHWM (Linux `clear_refs` 5); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_memory_mb() -> float | None:
    """The process's resident-set high-water mark (VmHWM) in MB, None off Linux."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def command_line(argv: Sequence[str] | None = None) -> str:
    """The command that started this process (its program named by its file name)."""
    argv = list(sys.argv if argv is None else argv)
    if argv:
        argv[0] = Path(argv[0]).name
    return shlex.join(argv)


def machine_info(
    dtype: str | None = None,
    device: str | None = None,
    backend: str | None = None,
    threads: int | None = None,
) -> dict[str, Any]:
    """What results.json records about the machine and software (dtype: the precision;
    threads: what the run computed with, default PyTorch's intra-op threads)."""
    try:
        import transformers

        tf_version: str | None = transformers.__version__
    except ImportError:
        tf_version = None
    return {
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
        "threads": threads if threads is not None else torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": tf_version,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "specfork": __version__,
        "dtype": dtype,
        "device": device,
        "backend": backend,
        "command": command_line(),
    }
