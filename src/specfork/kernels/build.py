"""Build specfork's CPU kernels (csrc/) once per machine and load them.

The kernels are a PyTorch C++ extension compiled on first use with the machine's C++ compiler
(30-90 s on two cores) and kept in specfork's cache folder, one folder per key: the
sources, PyTorch's version, the compiler, the Python ABI, the CPU's instruction sets and
specfork's version. A kernel built for other instruction sets is never loaded: a key of its own
keeps it apart, and the code picks its instruction set at run time. A build happens in a
temporary folder that is renamed into place only once it is complete, so an interrupted build
leaves nothing that could be loaded; a cached artifact whose checksum does not match is rebuilt.

Without a C++ compiler (or with SPECFORK_KERNELS=0) `load_kernels` returns None after one log
line, and models run on the eager PyTorch path.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

import torch

from specfork.atomic import exclusive
from specfork.host import cache_dir
from specfork.host import cpu_flags as host_cpu_flags
from specfork.steps import long_step

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = (
    "common.cpp",
    "pool.cpp",
    "gemm.cpp",
    "gemm_avx2.cpp",
    "attention.cpp",
    "rowops.cpp",
    "logit_rows.cpp",
    "sample_rows.cpp",
    "head.cpp",
    "model.cpp",
)
CFLAGS = ("-O3", "-fno-math-errno")
LDFLAGS: tuple[str, ...] = ()  # the kernels run on their own threads (csrc/pool.h), not OpenMP
CPU_FLAGS = (
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512dq",
    "avx512_vnni",
    "avx512_bf16",
    "amx_tile",
    "asimd",
    "sve",
)
READY = "READY"  # a built folder's marker: the sha256 of its library
BUILD_TIME = "30-90 s on two cores"  # measured: 35-50 s idle, 86 s beside another job


class KernelsUnavailable(RuntimeError):
    """The kernels cannot be built or loaded here (the reason is the message)."""


def compiler() -> str | None:
    """The C++ compiler PyTorch's extension builder will use, if there is one."""
    return shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")


def cpu_flags() -> tuple[str, ...]:
    """The instruction sets of this CPU that the kernels may use (part of the artifact key)."""
    words = host_cpu_flags()
    return (platform.machine(), *(f for f in CPU_FLAGS if f in words))


def artifact_key(cxx: str) -> str:
    """Hex digest naming one build: sources, torch, compiler, Python, CPU, specfork."""
    from specfork import __version__

    h = hashlib.sha256()
    for path in sorted(CSRC.iterdir()):
        if path.suffix in (".cpp", ".h"):
            h.update(path.name.encode() + b"\0" + path.read_bytes())
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=False)
    for part in (
        torch.__version__,
        version.stdout.splitlines()[:1],
        sys.version,
        CFLAGS,
        LDFLAGS,
        cpu_flags(),
        __version__,
    ):
        h.update(repr(part).encode())
    return h.hexdigest()[:16]


def module_name(key: str) -> str:
    """The module name of the build `key` (what cache keys built on the kernels hold)."""
    return f"specfork_kernels_{key}"


def load_kernels() -> ModuleType | None:
    """The compiled kernels (built on first use), or None where they cannot run."""
    return kernel_status()[0]


def loaded_kernels() -> ModuleType | None:
    """The kernels if this process has loaded them already (a model runs on them), else None:
    never starts a build (helpers that merely run faster on the kernels ask this)."""
    return kernel_status()[0] if kernel_status.cache_info().currsize else None


@functools.cache
def kernel_status() -> tuple[ModuleType | None, str]:
    """(the kernels or None, why they are not available: "" when they are)."""
    if os.environ.get("SPECFORK_KERNELS", "1").lower() in ("0", "off", "false", "no"):
        log.info("SPECFORK_KERNELS is off: the eager PyTorch path runs")
        return None, "SPECFORK_KERNELS is off"
    try:
        return _load_or_build(), ""
    except KernelsUnavailable as exc:
        log.warning("%s; the eager PyTorch path runs (slower)", exc)
        return None, str(exc)


def _load_or_build() -> ModuleType:
    cxx = compiler()
    if cxx is None:
        raise KernelsUnavailable("no C++ compiler to build the kernels (install g++ or set CXX)")
    key = artifact_key(cxx)
    name = module_name(key)
    folder = cache_dir() / "kernels" / key
    library = folder / f"{name}.so"
    module = _load_built(name, folder, library)
    if module is not None:
        return module
    try:  # two processes starting together build once: the second waits, then loads
        with exclusive(folder.with_name(f".{key}.lock")):
            module = _load_built(name, folder, library)
            if module is not None:
                log.info("another process has just built the kernels in %s", folder)
                return module
            shutil.rmtree(folder, ignore_errors=True)
            return _build(name, folder, cxx)
    except OSError as exc:  # the cache folder cannot be written: building there fails too
        raise KernelsUnavailable(f"cannot write the kernels' build to {folder} ({exc})") from exc


def _load_built(name: str, folder: Path, library: Path) -> ModuleType | None:
    """The build in `folder` if it is complete and loads, else None."""
    if not _intact(folder, library):
        return None
    try:
        return _import(name, library)
    except ImportError as exc:
        log.warning("cached kernels in %s do not load (%s); rebuilding", folder, exc)
        return None


def _intact(folder: Path, library: Path) -> bool:
    marker = folder / READY
    if not (marker.is_file() and library.is_file()):
        return False
    return marker.read_text().strip() == _sha256(library)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _import(name: str, library: Path) -> ModuleType:
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, library)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {library}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module
    return module


def _build(name: str, folder: Path, cxx: str) -> ModuleType:
    """Compile into a temporary folder, then move it into place (never half-written)."""
    from torch.utils import cpp_extension

    folder.parent.mkdir(parents=True, exist_ok=True)
    _put_ninja_on_path()
    t0 = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        os.environ.setdefault("CXX", cxx)
        with long_step(log, "compiling specfork's CPU kernels, once per machine", BUILD_TIME):
            module = cpp_extension.load(
                name=name,
                sources=[str(CSRC / s) for s in SOURCES],
                extra_cflags=list(CFLAGS),
                extra_ldflags=list(LDFLAGS),
                build_directory=str(tmp),
                verbose=False,
            )
        built = tmp / f"{name}.so"
        (tmp / READY).write_text(_sha256(built))
        try:
            tmp.rename(folder)
        except OSError:  # another process finished the same build first
            shutil.rmtree(tmp, ignore_errors=True)
    except (RuntimeError, OSError, subprocess.CalledProcessError) as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        log.debug("kernel build output:\n%s", exc)
        first = next((ln for ln in str(exc).splitlines() if "error" in ln), str(exc)[:200])
        raise KernelsUnavailable(f"building the kernels failed ({first.strip()})") from exc
    log.info("kernels compiled in %.0f s (cached in %s)", time.perf_counter() - t0, folder)
    return module


def _put_ninja_on_path() -> None:
    """PyTorch's builder runs `ninja`; the `ninja` package's binary is not on PATH in a venv
    that was not activated."""
    try:
        import ninja

        bin_dir = str(ninja.BIN_DIR)
    except (ImportError, AttributeError):
        bin_dir = str(Path(sys.executable).parent)
    path = os.environ.get("PATH", "")
    if bin_dir not in path.split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + path
