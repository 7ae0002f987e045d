"""Bit-exactness of specfork's GGUF dequantization against gguf-py's numpy reference.

Every supported type is checked on random blocks (random bytes whose f16 scale fields are replaced
by random finite f16 values) and, where ``gguf.quants.quantize`` implements the type, on real
quantized random floats. The comparison is on the float32 bit patterns, so it is exact: both sides
do the same float32 operations in the same order (a product with a broadcast scale, then an add
or a subtract), and IEEE 754 makes each of those correctly rounded.
"""

from __future__ import annotations

import struct
import warnings
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from specfork.bench.random_gguf import F16_FIELDS  # each block type's fp16 scale fields
from specfork.errors import ModelFormatError
from specfork.loading import dequant
from specfork.loading.dequant import SUPPORTED_TYPES, check_supported, dequantize
from specfork.loading.registry import resolve_model

T = GGMLQuantizationType
ALL_TYPES = sorted(SUPPORTED_TYPES)
BLOCK_TYPES = [t for t in ALL_TYPES if t not in (T.F32, T.F16, T.BF16)]
# Worst round-trip error of quantize + dequantize, relative to the largest |x| of a row.
ROUNDTRIP_TOL = {T.F32: 0.0, T.F16: 1e-3, T.BF16: 4e-3, T.Q8_0: 0.01}
ROUNDTRIP_TOL |= {T.Q5_0: 0.07, T.Q5_1: 0.07, T.Q4_0: 0.13, T.Q4_1: 0.13}
REAL_MODELS = ["gemma3-270m", "smollm2-135m-instruct"]  # packaged: fetched on first use


def _quantizable(qtype: GGMLQuantizationType) -> bool:
    """Whether gguf.quants.quantize implements qtype."""
    try:
        gguf.quants.quantize(np.zeros((1, 256), dtype=np.float32), qtype)
    except NotImplementedError:
        return False
    return True


def _random_f16(rng: np.random.Generator, size: int) -> np.ndarray:
    """Random finite f16 values from random bit patterns (subnormals and negatives included)."""
    bits = rng.integers(0, 1 << 16, size=size, dtype=np.uint16)
    non_finite = (bits & 0x7C00) == 0x7C00
    bits[non_finite] &= np.uint16(0xBFFF)  # clear the top exponent bit: finite
    return bits.view(np.float16)


def _random_data(qtype: GGMLQuantizationType, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random tensor data of qtype as GGUFReader returns it: (rows, cols) or (rows, row_bytes)."""
    rng = np.random.default_rng(seed)
    if qtype == T.F32:
        return rng.standard_normal((rows, cols), dtype=np.float32) * 100
    if qtype == T.F16:
        return _random_f16(rng, rows * cols).reshape(rows, cols)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    n_blocks = rows * cols // block_size
    blocks = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    for offset in F16_FIELDS.get(qtype, ()):
        blocks[:, offset : offset + 2] = _random_f16(rng, n_blocks).view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)  # BF16 keeps its random NaN/inf bit patterns on purpose


def _assert_bit_equal(ours: torch.Tensor, ref: np.ndarray) -> None:
    """ours and ref hold the same float32 values, bit for bit (NaN payloads and -0.0 included)."""
    assert ours.dtype == torch.float32
    assert tuple(ours.shape) == ref.shape
    ours_bits = ours.numpy().view(np.uint32)
    ref_bits = np.ascontiguousarray(ref, dtype=np.float32).view(np.uint32)
    mismatch = np.flatnonzero(ours_bits != ref_bits)
    assert mismatch.size == 0, (
        f"{mismatch.size} of {ref.size} values differ; first at flat index {mismatch[0]}: "
        f"{ours.reshape(-1)[mismatch[0]].item()!r} != {ref.reshape(-1)[mismatch[0]]!r}"
    )


@pytest.fixture(params=[False, True], ids=["default_chunks", "tiny_chunks"])
def chunking(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run a test with the default chunk size and with one that leaves a partial last chunk."""
    if request.param:
        monkeypatch.setattr(dequant, "_CHUNK_VALUES", 700)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
@pytest.mark.usefixtures("chunking")
def test_random_blocks_match_reference(qtype: GGMLQuantizationType) -> None:
    rows, cols = 7, 3 * 256
    data = _random_data(qtype, rows, cols, seed=int(qtype))
    ours = dequantize(data, qtype, (rows, cols))
    _assert_bit_equal(ours, gguf.quants.dequantize(data, qtype))
    assert torch.count_nonzero(ours) > ours.numel() // 2  # not a degenerate all-zero output


def test_random_data_is_not_degenerate() -> None:
    """Guards the random test: the scales really vary and BF16 really contains NaNs."""
    q6 = _random_data(T.Q6_K, 7, 768, seed=0).reshape(-1, 210)
    assert len(np.unique(q6[:, 208:210].copy().view(np.float16))) > 10
    assert np.isnan(gguf.quants.dequantize(_random_data(T.BF16, 7, 768, 1), T.BF16)).any()


@pytest.mark.parametrize("qtype", [t for t in ALL_TYPES if _quantizable(t)], ids=lambda t: t.name)
def test_quantized_floats_match_reference(qtype: GGMLQuantizationType) -> None:
    rng = np.random.default_rng(int(qtype))
    x = rng.standard_normal((5, 512), dtype=np.float32) * rng.uniform(0.01, 10, (5, 1))
    x = x.astype(np.float32)
    data = gguf.quants.quantize(x, qtype)
    ours = dequantize(data, qtype, x.shape)
    _assert_bit_equal(ours, gguf.quants.dequantize(data, qtype))
    err = np.abs(ours.numpy() - x).max(axis=1) / np.abs(x).max(axis=1)
    assert (err <= ROUNDTRIP_TOL[qtype]).all(), err


def test_block_layout_by_hand() -> None:
    """One Q4_0 block built by hand: element i < 16 is the low nibble of byte i, then the highs."""
    block = np.zeros(18, dtype=np.uint8)
    block[0:2] = np.array([0.5], dtype=np.float16).view(np.uint8)
    block[2:] = np.arange(16, dtype=np.uint8) | (np.arange(15, -1, -1, dtype=np.uint8) << 4)
    ours = dequantize(block, T.Q4_0, (32,))
    want = np.concatenate([np.arange(16), np.arange(15, -1, -1)]).astype(np.float32) - 8
    assert ours.tolist() == (want * 0.5).tolist()


@pytest.mark.parametrize("qtype", [T.F32, T.Q8_0, T.Q4_K], ids=lambda t: t.name)
def test_shape_dtype_and_no_aliasing(qtype: GGMLQuantizationType) -> None:
    data = _random_data(qtype, 6, 512, seed=3)
    data.setflags(write=False)  # like a GGUFReader memmap
    before = data.copy()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "non-writable array" warning leaks out
        ours = dequantize(data, qtype, (2, 3, 512))
    assert ours.shape == (2, 3, 512)
    assert ours.dtype == torch.float32
    assert ours.is_contiguous()
    ours.fill_(0)  # the result is writable and does not share memory with the input
    assert np.array_equal(data, before)
    assert ours.abs().sum() == 0


def test_unsupported_type_names_the_type() -> None:
    data = np.zeros(GGML_QUANT_SIZES[T.IQ2_XXS][1], dtype=np.uint8)
    with pytest.raises(ModelFormatError, match=r"'blk\.0\.attn_q\.weight'.*IQ2_XXS.*Q4_K"):
        dequantize(data, T.IQ2_XXS, (256,), name="blk.0.attn_q.weight")
    with pytest.raises(ModelFormatError, match=r"IQ2_XXS.*Re-quantize"):
        check_supported(T.IQ2_XXS, "w")
    with pytest.raises(ModelFormatError, match="#9999"):
        check_supported(9999, "w")
    assert check_supported(int(T.Q6_K), "w") is T.Q6_K


def test_supported_types() -> None:
    want = {T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K}
    assert want <= SUPPORTED_TYPES
    assert T.IQ2_XXS not in SUPPORTED_TYPES


def test_row_not_multiple_of_block_is_rejected() -> None:
    data = np.zeros(3 * 34, dtype=np.uint8)
    with pytest.raises(ModelFormatError, match=r"'w'.*rows of 48 values.*Q8_0 block size 32"):
        dequantize(data, T.Q8_0, (2, 48), name="w")


def test_byte_count_mismatch_is_rejected() -> None:
    data = np.zeros(3 * 34, dtype=np.uint8)
    with pytest.raises(ModelFormatError, match=r"needs 136 bytes but has 102"):
        dequantize(data, T.Q8_0, (2, 64), name="w")


# Byte widths of the fixed-size GGUF metadata value types (u8 ... f64, by type id).
_KV_WIDTH = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def _gguf_tensors(
    path: Path,
) -> list[tuple[str, GGMLQuantizationType, tuple[int, ...], np.ndarray]]:
    """(name, type, torch-order shape, data as GGUFReader gives it) for every tensor of a file.

    A minimal GGUF v2/v3 parser: gguf.GGUFReader needs ~5 s on Gemma's 262k-token vocabulary.
    """
    blob = np.memmap(path, mode="r", dtype=np.uint8)
    pos = 24
    magic, _, n_tensors, n_kv = struct.unpack_from("<4sIQQ", blob, 0)
    assert magic == b"GGUF"

    def skip_value(value_type: int) -> None:
        nonlocal pos
        if value_type in _KV_WIDTH:
            pos += _KV_WIDTH[value_type]
        elif value_type == 8:  # string
            pos += 8 + struct.unpack_from("<Q", blob, pos)[0]
        else:  # array
            element_type, count = struct.unpack_from("<IQ", blob, pos)
            pos += 12
            if element_type in _KV_WIDTH:
                pos += count * _KV_WIDTH[element_type]
            else:
                for _ in range(count):
                    skip_value(element_type)

    def read_str() -> str:
        nonlocal pos
        (length,) = struct.unpack_from("<Q", blob, pos)
        pos += 8 + length
        return bytes(blob[pos - length : pos]).decode()

    alignment = 32
    for _ in range(n_kv):
        key = read_str()
        (value_type,) = struct.unpack_from("<I", blob, pos)
        pos += 4
        if key == "general.alignment":
            (alignment,) = struct.unpack_from("<I", blob, pos)
        skip_value(value_type)
    infos = []
    for _ in range(n_tensors):
        name = read_str()
        (n_dims,) = struct.unpack_from("<I", blob, pos)
        dims = struct.unpack_from(f"<{n_dims}Q", blob, pos + 4)
        qtype, offset = struct.unpack_from("<IQ", blob, pos + 4 + 8 * n_dims)
        pos += 4 + 8 * n_dims + 12
        infos.append((name, T(qtype), tuple(reversed(dims)), offset))
    data_start = -(-pos // alignment) * alignment
    tensors = []
    for name, qtype, shape, offset in infos:
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        start = data_start + offset
        raw = blob[start : start + int(np.prod(shape)) // block_size * type_size]
        if qtype in (T.F32, T.F16):
            data = raw.view(np.float32 if qtype == T.F32 else np.float16).reshape(shape)
        else:
            data = raw.reshape(*shape[:-1], -1)
        tensors.append((name, qtype, shape, data))
    assert start + raw.size == blob.size  # the last tensor ends the file: the offsets are right
    return tensors


@pytest.mark.slow
def test_real_files_match_reference() -> None:
    """Every tensor of two real models; the reference runs on a sample of rows to stay fast."""
    rng = np.random.default_rng(0)
    seen: set[GGMLQuantizationType] = set()
    for path in (resolve_model(name, progress=False) for name in REAL_MODELS):
        for name, qtype, shape, data in _gguf_tensors(path):
            ours = dequantize(data, qtype, shape, name=name)
            assert torch.isfinite(ours).all(), name
            rows = data.reshape(-1, data.shape[-1])  # (n_rows, row_items)
            pick = np.unique(np.r_[0, rows.shape[0] - 1, rng.integers(0, rows.shape[0], 64)])
            ref = gguf.quants.dequantize(rows[pick], qtype)
            _assert_bit_equal(ours.reshape(-1, shape[-1])[pick], ref)
            seen.add(qtype)
    assert {T.F32, T.Q8_0, T.Q5_0, T.Q4_K, T.Q6_K, T.Q4_1} <= seen
