"""Weights laid out for the kernels (csrc/gemm.h describes each layout).

A weight [n, k] becomes tiles of 16 output rows, each a run of blocks of 32 inputs. GGUF's
Q4_0, Q4_1 and Q8_0 blocks are re-laid out bit for bit (the model llama.cpp runs); float
weights are stored as bf16 or fp32. Every function returns a flat uint8 tensor.
"""

from __future__ import annotations

from enum import IntEnum

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

TILE, BLOCK = 16, 32


class Kind(IntEnum):
    """The kernels' weight kinds (`Kind` in csrc/gemm.h)."""

    Q4 = 0
    Q8 = 1
    BF16 = 2
    F32 = 3


#: GGUF block types the kernels run as they are, and the kind each becomes.
GGUF_KINDS = {
    GGMLQuantizationType.Q4_0: Kind.Q4,
    GGMLQuantizationType.Q4_1: Kind.Q4,
    GGMLQuantizationType.Q8_0: Kind.Q8,
}


def _pad_rows(t: torch.Tensor, fill: int | float = 0) -> torch.Tensor:
    """Pad dim 0 to a multiple of 16 (the padded outputs are computed and never stored)."""
    extra = -t.shape[0] % TILE
    if not extra:
        return t
    return torch.cat((t, t.new_full((extra, *t.shape[1:]), fill)))


def pack_float(w: torch.Tensor, kind: Kind) -> torch.Tensor:
    """A float weight [n, k] (k a multiple of 32) as BF16 or F32 tiles."""
    k = w.shape[1]
    if k % BLOCK:
        raise ValueError(f"input size {k} is not a multiple of {BLOCK}")
    w = _pad_rows(w.detach().float())
    tiles, nb = w.shape[0] // TILE, k // BLOCK
    if kind == Kind.F32:
        t = w.view(tiles, TILE, nb, BLOCK).permute(0, 2, 3, 1)  # [tiles, nb, 32 inputs, 16 cols]
        return t.contiguous().view(-1).view(torch.uint8)
    if kind == Kind.BF16:
        t = w.to(torch.bfloat16).view(tiles, TILE, nb, BLOCK // 2, 2)
        t = t.permute(0, 2, 3, 1, 4)  # [tiles, nb, 16 pairs, 16 cols, 2]
        return t.contiguous().view(-1).view(torch.uint8)
    raise ValueError(f"pack_float makes BF16 or F32 tiles, not {kind!r}")


def _tiles(x: torch.Tensor, tiles: int, nb: int) -> torch.Tensor:
    """Per-(row, block) values [n_pad, nb, ...] → [tiles, nb, 16 rows, ...]."""
    return x.view(tiles, TILE, nb, *x.shape[2:]).transpose(1, 2)


def pack_q4(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """4-bit codes [n, k] (0-15) with value d*q + m, d and m float16 [n, k/32], as Q4 tiles."""
    k = codes.shape[1]
    codes, d, m = _pad_rows(codes), _pad_rows(d), _pad_rows(m)
    tiles, nb = codes.shape[0] // TILE, k // BLOCK
    q = codes.view(-1, nb, 4, 2, 4)  # [n, nb, vector i, low/high nibble, j]
    byte = q[:, :, :, 0] | (q[:, :, :, 1] << 4)  # [n, nb, 4, 4]: inputs 8i+j and 8i+4+j
    nibbles = _tiles(byte, tiles, nb).permute(0, 1, 3, 2, 4)  # [tiles, nb, 4, 16 cols, 4]
    scales = torch.stack((_tiles(d, tiles, nb), _tiles(m, tiles, nb)), dim=2)  # [t, nb, 2, 16]
    scale_bytes = scales.contiguous().view(torch.uint8).view(tiles, nb, 64)
    return torch.cat((nibbles.reshape(tiles, nb, 256), scale_bytes), dim=-1).view(-1)


def pack_q8(codes: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """int8 codes [n, k] with value d*q, d float16 [n, k/32], as Q8 tiles (codes + 128)."""
    k = codes.shape[1]
    codes, d = _pad_rows(codes), _pad_rows(d)
    tiles, nb = codes.shape[0] // TILE, k // BLOCK
    u = (codes.to(torch.int16) + 128).to(torch.uint8).view(-1, nb, 8, 4)  # [n, nb, g, j]
    vectors = _tiles(u, tiles, nb).permute(0, 1, 3, 2, 4)  # [tiles, nb, 8, 16 cols, 4]
    scales = _tiles(d, tiles, nb).contiguous().view(torch.uint8).view(tiles, nb, 32)
    return torch.cat((vectors.reshape(tiles, nb, 512), scales), dim=-1).view(-1)


def pack_gguf(
    raw: torch.Tensor, kind: GGMLQuantizationType, n: int, k: int
) -> tuple[Kind, torch.Tensor]:
    """GGUF blocks (the tensor's raw bytes) of a weight [n, k] as kernel tiles, bit for bit."""
    block_size, type_size = GGML_QUANT_SIZES[kind]
    blocks = raw.reshape(-1).view(torch.uint8).view(n, k // block_size, type_size)
    f16 = lambda at: blocks[..., at : at + 2].contiguous().view(torch.float16)[..., 0]  # noqa: E731
    if kind == GGMLQuantizationType.Q8_0:
        return Kind.Q8, pack_q8(blocks[..., 2:].contiguous().view(torch.int8).view(n, k), f16(0))
    if kind in (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1):
        head = 2 if kind == GGMLQuantizationType.Q4_0 else 4
        qs = blocks[..., head:]  # [n, nb, 16]: low nibbles are inputs 0-15, high ones 16-31
        codes = torch.cat((qs & 0x0F, qs >> 4), dim=-1).view(n, k)
        d = f16(0)
        m = (-8.0 * d.float()).half() if kind == GGMLQuantizationType.Q4_0 else f16(2)
        return Kind.Q4, pack_q4(codes, d, m)
    raise ValueError(f"GGUF type {kind.name} has no kernel layout")
