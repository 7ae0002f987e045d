"""Weights laid out for the kernels (csrc/gemm.h describes each layout).

A weight [n, k] becomes tiles of 16 output rows, each a run of blocks of 32 inputs. GGUF's
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K blocks are re-laid out bit for bit (the model
llama.cpp runs: every weight's value is the one `gguf` dequantizes); float weights are stored
as bf16 or fp32. Every function returns a flat uint8 tensor.
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
    Q4F = 4  # Q4 with float32 scales and mins (a K-quant sub-block's are exact only there)
    Q8H = 5  # Q8 with a float32 scale per 16 inputs
    Q8A = 6  # unsigned 7-bit codes in Q8's layout with Q4F's float32 scales and mins


#: GGUF block types the kernels run as they are, and the kind each becomes.
GGUF_KINDS = {
    GGMLQuantizationType.Q4_0: Kind.Q4,
    GGMLQuantizationType.Q4_1: Kind.Q4,
    GGMLQuantizationType.Q5_0: Kind.Q8,  # 5-bit codes minus 16 are int8 codes
    GGMLQuantizationType.Q5_1: Kind.Q8A,
    GGMLQuantizationType.Q8_0: Kind.Q8,
    GGMLQuantizationType.Q4_K: Kind.Q4F,
    GGMLQuantizationType.Q5_K: Kind.Q8A,
    GGMLQuantizationType.Q6_K: Kind.Q8H,  # 6-bit codes minus 32, a scale per 16
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
    """4-bit codes [n, k] (0-15) with value d*q + m, d and m [n, k/32], as Q4 tiles (d and m
    float16) or Q4F tiles (float32)."""
    if d.dtype != m.dtype or d.dtype not in (torch.float16, torch.float32):
        raise ValueError(f"Q4 scales are float16 or float32 alike, not {d.dtype} and {m.dtype}")
    k = codes.shape[1]
    codes, d, m = _pad_rows(codes), _pad_rows(d), _pad_rows(m)
    tiles, nb = codes.shape[0] // TILE, k // BLOCK
    q = codes.view(-1, nb, 4, 2, 4)  # [n, nb, vector i, low/high nibble, j]
    byte = q[:, :, :, 0] | (q[:, :, :, 1] << 4)  # [n, nb, 4, 4]: inputs 8i+j and 8i+4+j
    nibbles = _tiles(byte, tiles, nb).permute(0, 1, 3, 2, 4)  # [tiles, nb, 4, 16 cols, 4]
    return _with_scales(nibbles.reshape(tiles, nb, 256), _tiles(d, tiles, nb), _tiles(m, tiles, nb))


def _byte_vectors(stored: torch.Tensor) -> torch.Tensor:
    """Code bytes [n, k] (as the tiles store them) in Q8's layout: [tiles, nb, 512]."""
    stored = _pad_rows(stored)
    tiles, nb = stored.shape[0] // TILE, stored.shape[1] // BLOCK
    vectors = _tiles(stored.view(-1, nb, 8, 4), tiles, nb)  # [tiles, nb, 16 cols, g, j]
    return vectors.permute(0, 1, 3, 2, 4).reshape(tiles, nb, 512)  # [tiles, nb, g, 16 cols, j]


def _with_scales(vectors: torch.Tensor, *scales: torch.Tensor) -> torch.Tensor:
    """Code vectors [tiles, nb, B] followed in each block by the scale rows [tiles, nb, ...]."""
    tiles, nb = vectors.shape[:2]
    rows = [s.contiguous().view(torch.uint8).view(tiles, nb, -1) for s in scales]
    return torch.cat((vectors, *rows), dim=-1).view(-1)


def pack_q8(codes: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """int8 codes [n, k] with value d*q, d float16 [n, k/32], as Q8 tiles (codes + 128)."""
    vectors = _byte_vectors((codes.to(torch.int16) + 128).to(torch.uint8))
    tiles, nb = vectors.shape[:2]
    return _with_scales(vectors, _tiles(_pad_rows(d), tiles, nb))


def pack_q8a(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Unsigned codes [n, k] (0-127) with value d*q + m, d and m float32 [n, k/32], as Q8A
    tiles: the codes as stored bytes in Q8's layout, then Q4F's scales and mins."""
    if int(codes.max()) > 127:
        raise ValueError("Q8A codes run 0-127")
    vectors = _byte_vectors(codes.to(torch.uint8))
    tiles, nb = vectors.shape[:2]
    scale = lambda x: _tiles(_pad_rows(x.float()), tiles, nb)  # noqa: E731
    return _with_scales(vectors, scale(d), scale(m))


def pack_q8h(codes: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """int8 codes [n, k] with value d*q, d float32 [n, k/16] (a scale per 16 inputs), as Q8H
    tiles: Q8's codes, then the scales of every block's first halves, then its second's."""
    vectors = _byte_vectors((codes.to(torch.int16) + 128).to(torch.uint8))
    tiles, nb = vectors.shape[:2]
    halves = _tiles(_pad_rows(d.float()).view(-1, nb, 2), tiles, nb)  # [tiles, nb, 16, 2]
    return _with_scales(vectors, halves.transpose(2, 3))


def _k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's 12 bytes of 6-bit scales and mins [..., 12] as two [..., 8] (ggml's layout)."""
    s = scales.contiguous().view(*scales.shape[:-1], 3, 4)  # uint8: every step fits
    d, m, md = s[..., 0, :], s[..., 1, :], s[..., 2, :]
    sc = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), dim=-1)
    mn = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), dim=-1)
    return sc, mn


def _pack_q5_0(blocks: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Q5_0 blocks [n, nb, 22] (d, 32 high bits, 16 bytes of low nibbles) as Q8 tiles."""
    qs = blocks[..., 6:22]
    low = torch.cat((qs & 0x0F, qs >> 4), dim=-1)  # inputs 0-15, then 16-31
    # bit j of the little-endian word at bytes 2-5 is input j's fifth bit
    codes = (_five_bits(low, blocks[..., 2:6], torch.arange(32)).to(torch.int8) - 16).view(n, k)
    d = blocks[..., 0:2].contiguous().view(torch.float16)[..., 0]
    return pack_q8(codes, d)


def _pack_q4_k(blocks: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Q4_K super-blocks [n, nb, 144] (d, dmin, 12 bytes of scales, 128 of nibbles) as Q4F
    tiles: sub-block j's value d*sc[j]*q - dmin*m[j] with its scale and min in float32."""
    f16 = lambda at: blocks[..., at : at + 2].contiguous().view(torch.float16).float()  # noqa: E731
    sc, mn = _k_scales(blocks[..., 4:16])  # [n, nb, 8]
    d = f16(0) * sc.float()  # [n, nb, 8]: exact (an fp16 times a 6-bit integer)
    m = -(f16(2) * mn.float())
    qs = blocks[..., 16:].contiguous().view(n, -1, 4, 1, 32)  # chunk i: sub-blocks 2i, 2i+1
    codes = torch.cat((qs & 0x0F, qs >> 4), dim=3).view(n, k)
    return pack_q4(codes, d.view(n, -1), m.view(n, -1))


def _five_bits(low: torch.Tensor, high: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """5-bit codes from their low nibbles and a byte field whose bit `bits[j]` is code j's
    fifth bit (uint8 arithmetic)."""
    top = (high[..., bits // 8] >> (bits % 8).to(torch.uint8)) & 1
    return low | (top << 4)


def _pack_q5_1(blocks: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Q5_1 blocks [n, nb, 24] (d, m, 32 high bits, 16 bytes of low nibbles) as Q8A tiles."""
    qs = blocks[..., 8:24]
    low = torch.cat((qs & 0x0F, qs >> 4), dim=-1)  # inputs 0-15, then 16-31
    codes = _five_bits(low, blocks[..., 4:8], torch.arange(32)).view(n, k)
    f16 = lambda at: blocks[..., at : at + 2].contiguous().view(torch.float16)[..., 0].float()  # noqa: E731
    return pack_q8a(codes, f16(0), f16(2))


def _pack_q5_k(blocks: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Q5_K super-blocks [n, nb, 176] (d, dmin, 12 bytes of scales, 32 of high bits, 128 of
    nibbles) as Q8A tiles: sub-block j's value d*sc[j]*q - dmin*m[j], q's fifth bit bit j of
    the high byte of its position."""
    f16 = lambda at: blocks[..., at : at + 2].contiguous().view(torch.float16).float()  # noqa: E731
    sc, mn = _k_scales(blocks[..., 4:16])  # [n, nb, 8]
    qs = blocks[..., 48:].contiguous().view(n, -1, 4, 1, 32)
    low = torch.cat((qs & 0x0F, qs >> 4), dim=3).view(n, -1, 8, 32)
    qh = blocks[..., 16:48].contiguous().view(n, -1, 1, 32)
    top = torch.cat([(qh >> j) & 1 for j in range(8)], dim=2)  # [n, nb, 8, 32]: bit j, sub-block j
    codes = (low | (top << 4)).view(n, k)
    d, m = f16(0) * sc.float(), -(f16(2) * mn.float())  # exact, as in Q4_K
    return pack_q8a(codes, d.view(n, -1), m.view(n, -1))


def _pack_q6_k(blocks: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Q6_K super-blocks [n, nb, 210] (128 bytes of low nibbles, 64 of high bit pairs, 16
    int8 scales, d) as Q8H tiles: value d*scale[i]*(q - 32) for the 16 inputs of scale i."""
    ql = blocks[..., :128].contiguous().view(n, -1, 2, 1, 64)
    low = torch.cat((ql & 0x0F, ql >> 4), dim=3).view(n, -1, 8, 32)
    qh = blocks[..., 128:192].contiguous().view(n, -1, 2, 1, 32)
    high = torch.cat([(qh >> s) & 3 for s in (0, 2, 4, 6)], dim=3).view(n, -1, 8, 32)
    codes = ((low | (high << 4)).to(torch.int8) - 32).view(n, k)  # in -32..31 (uint8 math)
    scales = blocks[..., 192:208].contiguous().view(torch.int8).float()  # [n, nb, 16]
    d = blocks[..., 208:210].contiguous().view(torch.float16).float()  # [n, nb, 1]
    return pack_q8h(codes, (d * scales).view(n, -1))


def pack_gguf(
    raw: torch.Tensor, kind: GGMLQuantizationType, n: int, k: int
) -> tuple[Kind, torch.Tensor]:
    """GGUF blocks (the tensor's raw bytes) of a weight [n, k] as kernel tiles, bit for bit."""
    if kind not in GGUF_KINDS:
        raise ValueError(f"GGUF type {kind.name} has no kernel layout")
    block_size, type_size = GGML_QUANT_SIZES[kind]
    blocks = raw.reshape(-1).view(torch.uint8).view(n, k // block_size, type_size)
    f16 = lambda at: blocks[..., at : at + 2].contiguous().view(torch.float16)[..., 0]  # noqa: E731
    if kind == GGMLQuantizationType.Q8_0:
        return Kind.Q8, pack_q8(blocks[..., 2:].contiguous().view(torch.int8).view(n, k), f16(0))
    if kind == GGMLQuantizationType.Q5_0:
        return Kind.Q8, _pack_q5_0(blocks, n, k)
    if kind == GGMLQuantizationType.Q5_1:
        return Kind.Q8A, _pack_q5_1(blocks, n, k)
    if kind == GGMLQuantizationType.Q4_K:
        return Kind.Q4F, _pack_q4_k(blocks, n, k)
    if kind == GGMLQuantizationType.Q5_K:
        return Kind.Q8A, _pack_q5_k(blocks, n, k)
    if kind == GGMLQuantizationType.Q6_K:
        return Kind.Q8H, _pack_q6_k(blocks, n, k)
    head = 2 if kind == GGMLQuantizationType.Q4_0 else 4
    qs = blocks[..., head:]  # [n, nb, 16]: low nibbles are inputs 0-15, high ones 16-31
    codes = torch.cat((qs & 0x0F, qs >> 4), dim=-1).view(n, k)
    d = f16(0)
    m = (-8.0 * d.float()).half() if kind == GGMLQuantizationType.Q4_0 else f16(2)
    return Kind.Q4, pack_q4(codes, d, m)
