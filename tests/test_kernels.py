"""specfork's compiled CPU kernels (src/specfork/kernels): layouts, arithmetic, batch invariance.

The kernels are built once per machine (kernels/build.py); every test here needs them, so a
machine without a C++ compiler skips this module with the reason. Batch invariance is checked
bitwise: a row's output must not depend on how many rows share the call or where it sits.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants

from specfork.bench.random_gguf import random_blocks
from specfork.kernels import load_kernels
from specfork.kernels.pack import Kind, pack_float, pack_gguf, pack_q4, pack_q8
from specfork.loading.dequant import dequantize

K = load_kernels()
pytestmark = pytest.mark.skipif(K is None, reason="the kernels cannot be built here")

GGUF_TYPES = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K)


K_QUANTS = (T.Q4_K, T.Q5_K, T.Q6_K)


def cols(which: T | Kind, k: int) -> int:
    """k, or the next multiple of 256 for a K-quant (its super-blocks hold 256 inputs)."""
    return -(-k // 256) * 256 if which in K_QUANTS else k


def gguf_blob(qtype: T, n: int, k: int, seed: int = 0) -> tuple[int, torch.Tensor, torch.Tensor]:
    """A random weight [n, k] in qtype's blocks (quantized by gguf-py where it can): its kind,
    packed bytes and float values (gguf-py's dequantization)."""
    if qtype in K_QUANTS:  # gguf-py cannot quantize these: random blocks, wide scales
        raw = random_blocks(qtype, n, k, np.random.default_rng(seed), scale=(1e-3, 2e-2))
    else:
        w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.1
        raw = quants.quantize(w, qtype)  # [n, bytes per row]
    kind, data = pack_gguf(torch.from_numpy(raw.copy()), qtype, n, k)
    return int(kind), data, dequantize(raw, qtype, (n, k))


def gguf_weight(qtype: T, n: int, k: int, seed: int = 0) -> tuple[object, torch.Tensor]:
    kind, data, ref = gguf_blob(qtype, n, k, seed)
    return K.Packed(kind, n, k, data), ref


def float_weight(kind: Kind, n: int, k: int, seed: int = 0) -> tuple[object, torch.Tensor]:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.1
    bias = torch.randn(n, generator=torch.Generator().manual_seed(seed + 1))
    exact = w.bfloat16().float() if kind == Kind.BF16 else w
    return K.Packed(int(kind), n, k, pack_float(w, kind), bias), exact


def int8_rows(x: torch.Tensor) -> torch.Tensor:
    """x with every block of 32 quantized to int8 as the kernels do (llama.cpp's Q8 rows)."""
    b = x.view(x.shape[0], -1, 32)
    scale = b.abs().amax(-1, keepdim=True) / 127
    q = torch.where(scale > 0, torch.round(b / scale), torch.zeros_like(b)).clamp(-127, 127)
    return (q * scale).view_as(x)


@pytest.mark.parametrize("qtype", GGUF_TYPES, ids=lambda t: t.name)
def test_gguf_blocks_are_kept_bit_for_bit(qtype: T) -> None:
    packed, ref = gguf_weight(qtype, 40, cols(qtype, 96))  # 40 rows: the last tile is padded
    assert torch.equal(K.unpack(packed), ref)


@pytest.mark.parametrize("kind", (Kind.BF16, Kind.F32), ids=lambda k: k.name)
def test_float_layouts_round_trip(kind: Kind) -> None:
    packed, ref = float_weight(kind, 33, 64)
    assert torch.equal(K.unpack(packed), ref)


@pytest.mark.parametrize("qtype", GGUF_TYPES, ids=lambda t: t.name)
def test_quantized_products(qtype: T) -> None:
    """y = int8(x) W^T with exact integer block sums: float64 reference within 1e-5."""
    k = cols(qtype, 128)
    packed, w = gguf_weight(qtype, 70, k, seed=3)
    x = torch.randn(9, k)
    ref = int8_rows(x).double() @ w.double().T
    got = K.packed_linear(packed, x).double()
    assert (got - ref).abs().max() < 1e-5 * ref.abs().max()
    assert (got - x.double() @ w.double().T).abs().max() > 1e-4  # activations really are int8


@pytest.mark.parametrize("kind", (Kind.BF16, Kind.F32), ids=lambda k: k.name)
def test_float_products(kind: Kind) -> None:
    packed, w = float_weight(kind, 50, 96, seed=4)
    x = torch.randn(7, 96)
    xr = x.bfloat16().float() if kind == Kind.BF16 else x
    bias = torch.randn(50, generator=torch.Generator().manual_seed(5))
    ref = xr.double() @ w.double().T + bias.double()
    assert (K.packed_linear(packed, x).double() - ref).abs().max() < 1e-5 * ref.abs().max()


ALL_KINDS = [*GGUF_TYPES, Kind.BF16, Kind.F32]


def any_weight(which: T | Kind, n: int, k: int) -> object:
    return (gguf_weight(which, n, k) if isinstance(which, T) else float_weight(which, n, k))[0]


@pytest.mark.parametrize("which", ALL_KINDS, ids=lambda t: t.name)
def test_rows_are_batch_invariant(which: T | Kind) -> None:
    """Every row count 1-33 and any row order give each row bitwise the same output."""
    k = cols(which, 160)
    packed = any_weight(which, 48, k)
    x = torch.randn(33, k)
    full = K.packed_linear(packed, x)
    for rows in range(1, 34):
        assert torch.equal(K.packed_linear(packed, x[:rows]), full[:rows]), rows
    order = torch.randperm(33, generator=torch.Generator().manual_seed(0))
    assert torch.equal(K.packed_linear(packed, x[order]), full[order])
    for i in (0, 5, 32):
        assert torch.equal(K.packed_linear(packed, x[i : i + 1]), full[i : i + 1])


@pytest.mark.parametrize("which", ALL_KINDS, ids=lambda t: t.name)
def test_thread_count_does_not_change_results(which: T | Kind) -> None:
    """The kernels' own pool (csrc/pool.h) at 1, 2 and 3 threads, fixed or adaptive."""
    k = cols(which, 96)
    packed = any_weight(which, 64, k)
    x = torch.randn(6, k)
    before = K.threads()
    try:
        K.set_threads(1, False)
        one = K.packed_linear(packed, x)
        for threads, adaptive in ((2, False), (3, True)):
            K.set_threads(threads, adaptive)
            assert torch.equal(K.packed_linear(packed, x), one), threads
    finally:
        K.set_threads(before, False)


GENERIC_SCRIPT = """
import os, sys, torch
from specfork.kernels import load_kernels
K = load_kernels()
assert K.isa().startswith(os.environ["SPECFORK_ISA"]) and "amx" not in K.isa(), K.isa()
data = torch.load(sys.argv[1])
outs = [K.packed_linear(K.Packed(kind, n, k, blob), x) for kind, n, k, blob, x in data]
torch.save(outs, sys.argv[2])
"""


def _cpu_has(flag: str) -> bool:
    try:
        return f" {flag}" in open("/proc/cpuinfo").read()
    except OSError:
        return False


@pytest.mark.parametrize("isa", ["generic", "avx2", "avx512"])
def test_lower_isas_compute_the_same_integer_and_fp32_products(tmp_path, isa: str) -> None:
    """The portable C++ path, the AVX2 path (CPUs without AVX-512) and, on CPUs with AMX, the
    AVX-512 path without tiles agree bitwise with this CPU's best path for the quantized and
    fp32 kinds (37 rows: AMX takes groups of 16, AVX-512 passes of up to 8 rows, AVX2 of up to
    4): the integer block sums are exact and the float steps are the same. On a CPU whose best
    path is AVX2, the portable path is checked against it."""
    best = K.isa()
    if isa == "avx512" and not best.endswith("-amx"):
        pytest.skip("no AMX here: the AVX-512 path is the reference itself")
    if isa == "avx2" and not best.startswith("avx512"):
        pytest.skip("the AVX2 path is this CPU's best: it is the reference itself")
    if not best.startswith(("avx512", "avx2")):
        pytest.skip("this CPU runs the portable path alone")
    cases, expected = [], []
    blobs = [(*gguf_blob(qtype, 40, cols(qtype, 96))[:2], cols(qtype, 96)) for qtype in GGUF_TYPES]
    blobs.append((int(Kind.F32), pack_float(torch.randn(40, 96), Kind.F32), 96))
    for kind, blob, k in blobs:
        x = torch.randn(37, k)
        cases.append((kind, 40, k, blob, x))
        expected.append(K.packed_linear(K.Packed(kind, 40, k, blob), x))
    torch.save(cases, tmp_path / "in.pt")
    env = {**os.environ, "SPECFORK_ISA": isa}
    subprocess.run(
        [sys.executable, "-c", GENERIC_SCRIPT, str(tmp_path / "in.pt"), str(tmp_path / "out.pt")],
        env=env,
        check=True,
        timeout=600,
    )
    for got, want in zip(torch.load(tmp_path / "out.pt"), expected, strict=True):
        assert torch.equal(got, want)


def test_bad_packed_weights_are_refused() -> None:
    with pytest.raises(ValueError, match="multiple of 32"):
        K.Packed(int(Kind.F32), 16, 20, torch.zeros(16 * 20 * 4, dtype=torch.uint8))
    with pytest.raises(ValueError, match="wrong size"):
        K.Packed(int(Kind.Q4), 16, 32, torch.zeros(100, dtype=torch.uint8))
    with pytest.raises(ValueError, match="unknown weight kind"):
        K.Packed(9, 16, 32, torch.zeros(320, dtype=torch.uint8))


def test_q4_layout_matches_the_documented_nibble_order() -> None:
    """Input 8i+j of column c in the low nibble of byte 4c+j of vector i, 8i+4+j in the high."""
    codes = torch.zeros(16, 32, dtype=torch.uint8)
    codes[3, 13] = 9  # column 3, input 13 = 8*1 + 4 + 1: vector 1, byte 4*3+1, high nibble
    ones = torch.ones(16, 1, dtype=torch.float16)
    data = pack_q4(codes, ones, torch.zeros_like(ones))
    assert data[64 * 1 + 4 * 3 + 1] == 9 << 4 and int(data[:256].sum()) == 9 << 4
    q8 = pack_q8(torch.zeros(16, 32, dtype=torch.int8), ones)
    assert bool((q8[:512] == 128).all())


AVX2_MODEL_SCRIPT = """
import sys, torch
from specfork.loading.loader import load_model
loaded = load_model("smollm2-135m-instruct", kernels=True, progress=False)
assert loaded.model.kernels.isa() == "avx2", loaded.model.kernels.isa()
m = loaded.model
ids = loaded.tokenizer.encode("The quick brown fox jumps over the lazy dog.")
chain = list(range(500, 508))
cache = m.new_cache(len(ids) + 16)
with torch.inference_mode():
    m.extend(ids, cache)
    steps = torch.stack([m.extend([t], cache) for t in chain])
    cache.truncate(len(ids))
    block = m.extend(chain, cache, last_only=False)
torch.save({"steps": steps, "block": block}, sys.argv[1])
"""


@pytest.mark.slow
def test_the_avx2_path_is_batch_invariant_on_the_real_model(tmp_path) -> None:
    if not _cpu_has("avx2"):
        pytest.skip("no AVX2 here")
    out = tmp_path / "avx2.pt"
    env = {**os.environ, "SPECFORK_ISA": "avx2"}
    subprocess.run(
        [sys.executable, "-c", AVX2_MODEL_SCRIPT, str(out)], env=env, check=True, timeout=900
    )
    got = torch.load(out)
    assert torch.equal(got["steps"], got["block"])  # 8 one-row steps == one 8-row forward


# -- building and caching the kernels (kernels/build.py), without compiling anything ----------


def test_the_artifact_key_covers_cpu_torch_and_compiler(monkeypatch) -> None:
    from specfork.kernels import build

    cxx = build.compiler() or "c++"
    key = build.artifact_key(cxx)
    assert key == build.artifact_key(cxx)
    monkeypatch.setattr(build, "cpu_flags", lambda: ("x86_64", "avx2"))  # another CPU
    assert build.artifact_key(cxx) != key
    monkeypatch.undo()
    monkeypatch.setattr(torch, "__version__", "9.9.9")  # another torch
    assert build.artifact_key(cxx) != key


def test_a_cached_library_is_checked_before_it_is_loaded(tmp_path) -> None:
    from specfork.kernels import build

    library = tmp_path / "lib.so"
    library.write_bytes(b"\x7fELF not really")
    assert not build._intact(tmp_path, library)  # no marker: an interrupted build
    (tmp_path / build.READY).write_text(build._sha256(library))
    assert build._intact(tmp_path, library)
    library.write_bytes(b"\x7fELF changed")  # corrupted after the build
    assert not build._intact(tmp_path, library)


def test_without_a_compiler_the_reason_is_given(monkeypatch) -> None:
    from specfork.kernels import build

    monkeypatch.setattr(build, "compiler", lambda: None)
    with pytest.raises(build.KernelsUnavailable, match="no C\\+\\+ compiler"):
        build._load_or_build()


def test_a_failed_build_leaves_nothing_behind(monkeypatch, tmp_path) -> None:
    from torch.utils import cpp_extension

    from specfork.kernels import build

    def broken(**kwargs):
        (Path(kwargs["build_directory"]) / "half-written.o").write_bytes(b"")
        raise RuntimeError("error: compiler died")

    monkeypatch.setattr(cpp_extension, "load", broken)
    folder = tmp_path / "kernels" / "somekey"
    with pytest.raises(build.KernelsUnavailable, match="compiler died"):
        build._build("specfork_kernels_test", folder, "c++")
    assert not folder.exists() and list((tmp_path / "kernels").iterdir()) == []


def test_a_build_another_process_finished_while_this_one_waited_is_loaded(
    monkeypatch, tmp_path
) -> None:
    """Two processes starting on a fresh machine build once: the one that waited for the
    build lock looks again under the lock and loads what the other built."""
    import shutil

    from torch.utils import cpp_extension

    from specfork.host import cache_dir
    from specfork.kernels import build

    built = load_kernels()
    if built is None:
        pytest.skip("no kernels on this machine")
    key = build.artifact_key(build.compiler())
    # the finished build (the loaded library's own folder is a temporary one, renamed since,
    # where this process built the kernels itself)
    finished = cache_dir() / "kernels" / key
    monkeypatch.setenv("SPECFORK_CACHE_DIR", str(tmp_path))
    shutil.copytree(finished, tmp_path / "kernels" / key)
    looks = []

    def finished_while_waiting(folder: Path, library: Path) -> bool:
        looks.append(folder)  # the first look (no lock) misses; the other process then finishes
        return len(looks) > 1 and (folder / build.READY).is_file()

    def must_not_build(**kwargs):
        raise AssertionError("built again although another process had just built it")

    monkeypatch.setattr(build, "_intact", finished_while_waiting)
    monkeypatch.setattr(cpp_extension, "load", must_not_build)
    assert build._load_or_build() is built
    assert len(looks) == 2 and (tmp_path / "kernels" / f".{key}.lock").is_file()
