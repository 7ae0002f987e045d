"""Running a script under a lower instruction set than this CPU's best (`SPECFORK_ISA`), for
the tests that check every code path of a kernel computes what the best one does."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch


def skip_unless_lower(kernels: ModuleType, isa: str) -> None:
    """Skip where `isa` is not a path below this CPU's best (it is then the reference)."""
    if isa == "avx2" and not kernels.isa().startswith("avx512"):
        pytest.skip("the AVX2 path is this CPU's best (or absent): the reference itself")
    if not kernels.isa().startswith(("avx512", "avx2")):
        pytest.skip("this CPU runs the portable path alone")


def run_under(isa: str, script: str, x: torch.Tensor, folder: Path) -> object:
    """Run `script` (argv: the saved input, the ISA) with the kernels on `isa`, on input `x`;
    what it saved at its input's path + ".out"."""
    path = folder / "x.pt"
    torch.save(x, path)
    env = {**os.environ, "SPECFORK_ISA": isa}
    subprocess.run([sys.executable, "-c", script, str(path), isa], env=env, check=True, timeout=600)
    return torch.load(str(path) + ".out")
