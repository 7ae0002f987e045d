"""Dequantization of GGUF tensor data into float32 torch tensors.

Each supported block type has one function that reads the tensor's raw bytes as a
``(n_blocks, type_size)`` uint8 tensor and writes the ``(n_blocks, block_size)`` float32 values
into a preallocated output. The block layouts follow ggml (``ggml-common.h`` / ``ggml-quants.c``)
exactly, and the float32 arithmetic is done in the same order as gguf-py's numpy reference
(``gguf/quants.py``), so the results are bit-identical to it. All work is vectorized over blocks;
large tensors go through in chunks of blocks, which bounds the temporary memory.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from specfork.errors import ModelFormatError

T = GGMLQuantizationType
_CHUNK_VALUES = 1 << 21  # values per step: bounds the temporaries (a few MB, in L3)


def _f16(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """Read the little-endian f16 at byte ``offset`` of every block as a (n, 1) float32 column."""
    return blocks[:, offset : offset + 2].contiguous().view(torch.float16).float()  # (n, 1)


def _fields(b: torch.Tensor, n_fields: int, width: int) -> torch.Tensor:
    """Split every byte of b (..., k) into its n_fields bit fields of width bits, lowest first.

    Returns a new contiguous (..., n_fields, k) uint8 tensor. (Each field is one contiguous op:
    torch is an order of magnitude slower at broadcasting a shift over a small inner dim.)
    """
    b = b.contiguous()  # (..., k)
    mask = (1 << width) - 1
    fields = [b & mask] + [(b >> (i * width)) & mask for i in range(1, n_fields)]
    return torch.stack(fields, dim=-2)  # (..., n_fields, k)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Split bytes (..., k) into (..., 2, k): the low nibbles first, then the high nibbles."""
    return _fields(qs, 2, 4)  # (..., 2, k)


# Byte j of _Q5_HIGH[v] is bit j of v moved to bit 4: the 5th bit of 8 consecutive Q5 quants.
_Q5_HIGH = torch.tensor(
    [sum(((v >> j) & 1) << (4 + 8 * j) for j in range(8)) for v in range(256)], dtype=torch.int64
).view(torch.uint8)  # (256 * 8,) as bytes: 256 rows of 8 bytes


def _q5_quants(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """5-bit quants of Q5_0/Q5_1 from the 32 high bits qh (n, 4) and the nibbles qs (n, 16)."""
    n = qs.shape[0]
    idx = qh.contiguous().view(-1).long()  # (n * 4,): one byte = 8 high bits
    hi = _Q5_HIGH.view(256, 8).index_select(0, idx).view(n, 32)  # (n, 32): bit j of LE uint32
    return _nibbles(qs).view(n, 32).bitwise_or_(hi)  # (n, 32)


def _scaled(out: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Write the integer quants q, converted to float32 and times scale (broadcast), into out."""
    return out.copy_(q).mul_(scale)


def _dequant_q8_0(blocks: torch.Tensor, out: torch.Tensor) -> None:
    """Q8_0: f16 d, 32 x int8 q; x = d * q."""
    d = _f16(blocks, 0)  # (n, 1)
    _scaled(out, blocks[:, 2:].view(torch.int8), d)  # (n, 32)


def _dequant_q4_0(blocks: torch.Tensor, out: torch.Tensor) -> None:
    """Q4_0: f16 d, 16 bytes of nibbles (low nibbles = x[0:16]); x = d * (q - 8)."""
    n = blocks.shape[0]
    d = _f16(blocks, 0)  # (n, 1)
    q = _nibbles(blocks[:, 2:]).view(n, 32).view(torch.int8).sub_(8)  # (n, 32)
    _scaled(out, q, d)  # (n, 32)


def _dequant_q4_1(blocks: torch.Tensor, out: torch.Tensor) -> None:
    """Q4_1: f16 d, f16 m, 16 bytes of nibbles; x = d * q + m."""
    n = blocks.shape[0]
    d, m = _f16(blocks, 0), _f16(blocks, 2)  # (n, 1) each
    q = _nibbles(blocks[:, 4:]).view(n, 32)  # (n, 32)
    _scaled(out, q, d).add_(m)  # (n, 32)


def _dequant_q5_0(blocks: torch.Tensor, out: torch.Tensor) -> None:
    """Q5_0: f16 d, uint32 high bits, 16 bytes of nibbles; x = d * (q - 16)."""
    d = _f16(blocks, 0)  # (n, 1)
    q = _q5_quants(blocks[:, 2:6], blocks[:, 6:]).view(torch.int8).sub_(16)  # (n, 32)
    _scaled(out, q, d)  # (n, 32)


def _dequant_q5_1(blocks: torch.Tensor, out: torch.Tensor) -> None:
    """Q5_1: f16 d, f16 m, uint32 high bits, 16 bytes of nibbles; x = d * q + m."""
    d, m = _f16(blocks, 0), _f16(blocks, 2)  # (n, 1) each
    q = _q5_quants(blocks[:, 4:8], blocks[:, 8:])  # (n, 32)
    _scaled(out, q, d).add_(m)  # (n, 32)


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpack the 12-byte 6-bit scales and mins of Q4_K/Q5_K into two (n, 8) uint8 tensors."""
    s = scales.contiguous().view(-1, 3, 4)  # (n, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]  # (n, 4) each
    sc = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), dim=-1)  # (n, 8)
    mn = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), dim=-1)  # (n, 8)
    return sc, mn


def _k_affine(blocks: torch.Tensor, q: torch.Tensor, out: torch.Tensor) -> None:
    """Write x = d * sc * q - dmin * m for Q4_K/Q5_K, given the (n, 8, 32) quants q."""
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)  # (n, 1) each
    sc, mn = _k_scale_min(blocks[:, 4:16])  # (n, 8) each
    dl = (d * sc.float()).unsqueeze(-1)  # (n, 8, 1)
    ml = (dmin * mn.float()).unsqueeze(-1)  # (n, 8, 1)
    _scaled(out.view(-1, 8, 32), q, dl).sub_(ml)  # (n, 8, 32)


def _dequant_q4_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    """Q4_K: f16 d, f16 dmin, 12 bytes of scales/mins, 4 x 32 bytes of nibbles."""
    n = blocks.shape[0]
    q = _nibbles(blocks[:, 16:].view(n, 4, 32)).view(n, 8, 32)  # (n, 8, 32)
    _k_affine(blocks, q, out)  # (n, 256)


def _dequant_q5_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    """Q5_K: as Q4_K plus 32 bytes of high bits (bit i of byte l belongs to sub-block i)."""
    n = blocks.shape[0]
    hi = _fields(blocks[:, 16:48], 8, 1).bitwise_left_shift_(4)  # (n, 8, 32)
    q = _nibbles(blocks[:, 48:].view(n, 4, 32)).view(n, 8, 32).bitwise_or_(hi)  # (n, 8, 32)
    _k_affine(blocks, q, out)  # (n, 256)


def _dequant_q6_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    """Q6_K: 128 bytes low nibbles, 64 bytes 2-bit highs, 16 x int8 scales, f16 d."""
    n = blocks.shape[0]
    qh = _fields(blocks[:, 128:192].view(n, 2, 32), 4, 2).view(n, 8, 32)  # (n, 8, 32)
    ql = _nibbles(blocks[:, :128].view(n, 2, 64)).view(n, 8, 32)  # (n, 8, 32)
    q = ql.bitwise_or_(qh.bitwise_left_shift_(4)).view(torch.int8).sub_(32)  # (n, 8, 32)
    d = _f16(blocks, 208)  # (n, 1)
    dl = (d * blocks[:, 192:208].view(torch.int8).float()).unsqueeze(-1)  # (n, 16, 1)
    _scaled(out.view(n, 16, 16), q.view(n, 16, 16), dl)  # (n, 16, 16)


def _dequant_q2_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    """Q2_K: 16 bytes of 4-bit scale/min pairs, 64 bytes of 2-bit quants, f16 d, f16 dmin."""
    n = blocks.shape[0]
    scales = blocks[:, :16]  # (n, 16)
    d, dmin = _f16(blocks, 80), _f16(blocks, 82)  # (n, 1) each
    dl = (d * (scales & 0x0F).float()).unsqueeze(-1)  # (n, 16, 1)
    ml = (dmin * (scales >> 4).float()).unsqueeze(-1)  # (n, 16, 1)
    q = _fields(blocks[:, 16:80].view(n, 2, 32), 4, 2).view(n, 16, 16)  # (n, 16, 16)
    _scaled(out.view(n, 16, 16), q, dl).sub_(ml)  # (n, 16, 16)


def _dequant_q3_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    """Q3_K: 32 bytes high-bit mask, 64 bytes 2-bit quants, 12 bytes 6-bit scales, f16 d."""
    n = blocks.shape[0]
    lo = _fields(blocks[:, 96:104], 2, 4).view(n, 16)  # (n, 16): low 4 bits of the scales
    hi = _fields(blocks[:, 104:108], 4, 2).view(n, 16)  # (n, 16): high 2 bits of the scales
    sc = lo.bitwise_or_(hi.bitwise_left_shift_(4)).view(torch.int8).sub_(32)  # (n, 16)
    dl = (_f16(blocks, 108) * sc.float()).unsqueeze(-1)  # (n, 16, 1)
    ql = _fields(blocks[:, 32:96].view(n, 2, 32), 4, 2).view(n, 16, 16)  # (n, 16, 16)
    hm = _fields(blocks[:, :32], 8, 1).view(n, 16, 16)  # (n, 16, 16): 0 means "subtract 4"
    q = ql.view(torch.int8).sub_(hm.bitwise_xor_(1).bitwise_left_shift_(2).view(torch.int8))
    _scaled(out.view(n, 16, 16), q, dl)  # (n, 16, 16)


_BLOCK_DEQUANT: dict[GGMLQuantizationType, Callable[[torch.Tensor, torch.Tensor], None]] = {
    T.Q8_0: _dequant_q8_0,
    T.Q4_0: _dequant_q4_0,
    T.Q4_1: _dequant_q4_1,
    T.Q5_0: _dequant_q5_0,
    T.Q5_1: _dequant_q5_1,
    T.Q2_K: _dequant_q2_k,
    T.Q3_K: _dequant_q3_k,
    T.Q4_K: _dequant_q4_k,
    T.Q5_K: _dequant_q5_k,
    T.Q6_K: _dequant_q6_k,
}

SUPPORTED_TYPES: frozenset[GGMLQuantizationType] = frozenset(
    {T.F32, T.F16, T.BF16, *_BLOCK_DEQUANT}
)
_SUPPORTED_NAMES = ", ".join(t.name for t in sorted(SUPPORTED_TYPES))


def check_supported(qtype: GGMLQuantizationType | int, tensor_name: str) -> GGMLQuantizationType:
    """Return qtype as a GGMLQuantizationType, or raise ModelFormatError if it is not supported."""
    try:
        qtype = GGMLQuantizationType(qtype)
    except ValueError:
        type_name = f"#{int(qtype)} (unknown to the installed gguf package)"
    else:
        if qtype in SUPPORTED_TYPES:
            return qtype
        type_name = qtype.name
    raise ModelFormatError(
        f"GGUF tensor {tensor_name!r} has type {type_name}, which specfork does not support; "
        f"supported: {_SUPPORTED_NAMES}. Re-quantize the model with one of them."
    )


def _raw_bytes(data: np.ndarray) -> torch.Tensor:
    """View the bytes of data (any dtype, e.g. a read-only memmap) as a flat uint8 tensor.

    No copy is made when data is C-contiguous. The tensor may alias read-only memory; it is only
    ever read, so torch's warning about non-writable arrays is silenced.
    """
    flat = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(flat)


def _empty(numel: int) -> torch.Tensor:
    """A new flat float32 tensor, allocated by numpy (which asks for transparent huge pages).

    Faulting in a fresh multi-GB output dominates dequantization otherwise: with huge pages it is
    several times faster than with torch's allocator on Linux.
    """
    return torch.from_numpy(np.empty(numel, dtype=np.float32))


def _dequant_blocks(raw: torch.Tensor, qtype: GGMLQuantizationType, out: torch.Tensor) -> None:
    """Decode the blocks of raw (flat uint8) into out (flat float32), a chunk at a time."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    blocks = raw.view(-1, type_size)  # (n_blocks, type_size)
    out = out.view(-1, block_size)  # (n_blocks, block_size)
    fn = _BLOCK_DEQUANT[qtype]
    step = max(1, _CHUNK_VALUES // block_size)
    for start in range(0, blocks.shape[0], step):
        fn(blocks[start : start + step], out[start : start + step])


def dequantize(
    data: np.ndarray,
    qtype: GGMLQuantizationType,
    shape: tuple[int, ...],
    *,
    name: str = "<unnamed>",
) -> torch.Tensor:
    """Dequantize raw GGUF tensor data into a new contiguous float32 tensor.

    Args:
        data: the tensor's data as ``GGUFReader(...).tensors[i].data`` gives it (any dtype and
            shape; only its bytes are used, without a copy when it is contiguous).
        qtype: the tensor's ggml type.
        shape: the torch-order shape (reversed GGUF dims: rows first, the contiguous dim last).
        name: the tensor's name, used in error messages.

    Raises:
        ModelFormatError: for an unsupported type, a row length that is not a multiple of the
            type's block size, or a byte count that does not match the shape.
    """
    qtype = check_supported(qtype, name)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    shape = tuple(int(s) for s in shape)
    row = shape[-1] if shape else 1
    if row % block_size:
        raise ModelFormatError(
            f"GGUF tensor {name!r} of type {qtype.name} has rows of {row} values, which is not a "
            f"multiple of the {qtype.name} block size {block_size}; the file is corrupt."
        )
    numel = math.prod(shape)
    raw = _raw_bytes(data)
    if raw.numel() != numel // block_size * type_size:
        raise ModelFormatError(
            f"GGUF tensor {name!r} of type {qtype.name} and shape {shape} needs "
            f"{numel // block_size * type_size} bytes but has {raw.numel()}; the file is corrupt."
        )
    out = _empty(numel)
    if qtype == T.F32:
        out.copy_(raw.view(torch.float32))  # the only copy: never alias the file's memory
    elif qtype == T.F16:
        out.copy_(raw.view(torch.float16))
    elif qtype == T.BF16:
        out.view(torch.int32).copy_(raw.view(torch.int16)).bitwise_left_shift_(16)  # keeps NaNs
    else:
        _dequant_blocks(raw, qtype, out)
    return out.view(shape)
