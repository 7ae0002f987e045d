"""The kernels' attention over a KV cache (`attention_rows`, what every forward runs) against a
float64 reference: head sizes that take the vector paths and those that do not, float32,
float16 and bfloat16 caches, contexts of several 128-slot chunks with a partial block of keys
at the end, chains of up to 24 rows and tree rows whose slots are not contiguous. A row's
output does not depend on the rows beside it, bit for bit, and the lower instruction sets
compute what the best one does."""

from __future__ import annotations

import pytest
import torch

from isa_run import run_under, skip_unless_lower
from specfork.kernels import load_kernels

K = load_kernels()
pytestmark = pytest.mark.skipif(K is None, reason="the kernels cannot be built here")

HEADS, HEADS_KV = 6, 2


def _cache(slots: int, head_dim: int, dtype: torch.dtype, seed: int) -> tuple:
    """Keys and values [H_kv, slots, D] of `dtype` (random, some large enough to matter)."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(HEADS_KV, slots, head_dim, generator=g) * 1.5
    v = torch.randn(HEADS_KV, slots, head_dim, generator=g)
    return k.to(dtype), v.to(dtype)


def _lists(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's ascending slots as the kernel's (idx, off)."""
    off = [0]
    for r in rows:
        off.append(off[-1] + len(r))
    return torch.tensor([s for r in rows for s in r], dtype=torch.int32), torch.tensor(off)


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: list[list[int]]):
    """softmax(q k^T * scale) v in float64, per row over its slots: [R, H, D]."""
    scale = q.shape[-1] ** -0.5
    out = torch.empty(q.shape, dtype=torch.float64)
    kd, vd = k.double(), v.double()
    for r, slots in enumerate(rows):
        s = torch.tensor(slots)
        for h in range(HEADS):
            g = h // (HEADS // HEADS_KV)
            p = torch.softmax(kd[g, s] @ q[r, h].double() * scale, dim=0)  # [n]
            out[r, h] = p @ vd[g, s]
    return out


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: list[list[int]]):
    idx, off = _lists(rows)
    return K.attention_rows(q, k, v, idx, off, q.shape[-1] ** -0.5)


def _chain(context: int, n: int) -> list[list[int]]:
    """n rows after `context` cached slots, each seeing the prefix and the rows up to itself."""
    return [list(range(context + r + 1)) for r in range(n)]


def _tree(context: int) -> list[list[int]]:
    """A root and two interleaved branches in slot order (root, a1, b1, a2, b2, a3, b3)."""
    prefix = list(range(context))
    root, a, b = context, [context + 1, context + 3, context + 5], [context + 2, context + 4]
    rows = [[*prefix, root]]
    rows += [[*prefix, root, *a[: i + 1]] for i in range(3)]
    rows += [[*prefix, root, *b[: i + 1]] for i in range(2)]
    return rows


CHAINS = [(4, 1), (4, 6), (300, 1), (300, 3), (300, 8), (290, 24)]  # (context, rows)


@pytest.mark.parametrize("head_dim", [16, 24, 48, 64, 128, 160, 192, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("context", "n"), CHAINS)
def test_a_chain_attends_as_the_float64_reference(head_dim, dtype, context, n) -> None:
    k, v = _cache(context + n + 3, head_dim, dtype, seed=head_dim + n)
    q = torch.randn(n, HEADS, head_dim, generator=torch.Generator().manual_seed(context))
    rows = _chain(context, n)
    got = _attend(q, k, v, rows)
    assert torch.allclose(got.double(), _reference(q, k, v, rows), rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("head_dim", [48, 64, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("context", [7, 137, 400])
def test_tree_rows_attend_as_the_reference_and_as_the_chain(head_dim, dtype, context) -> None:
    k, v = _cache(context + 8, head_dim, dtype, seed=context)
    rows = _tree(context)
    q = torch.randn(len(rows), HEADS, head_dim, generator=torch.Generator().manual_seed(1))
    got = _attend(q, k, v, rows)
    assert torch.allclose(got.double(), _reference(q, k, v, rows), rtol=1e-4, atol=2e-5)
    # branch a as a chain of its own (its slots contiguous): the same bits
    for i in (0, 1, 2, 3):
        alone = _attend(q[i : i + 1], k, v, [rows[i]])
        assert torch.equal(alone[0], got[i]), i


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [48, 64, 128])
def test_a_rows_output_does_not_depend_on_the_rows_beside_it(dtype, head_dim) -> None:
    context, n = 333, 24
    k, v = _cache(context + n, head_dim, dtype, seed=3)
    q = torch.randn(n, HEADS, head_dim, generator=torch.Generator().manual_seed(4))
    rows = _chain(context, n)
    together = _attend(q, k, v, rows)
    for count in (1, 2, 5, 7, 13):
        part = _attend(q[:count], k, v, rows[:count])
        assert torch.equal(part, together[:count]), count
    for r in (0, 9, 23):
        assert torch.equal(_attend(q[r : r + 1], k, v, [rows[r]])[0], together[r]), r


def test_bad_inputs_are_refused() -> None:
    k, v = _cache(10, 64, torch.bfloat16, seed=0)
    q = torch.randn(2, HEADS, 64)
    with pytest.raises(ValueError, match="ascending"):
        K.attention_rows(q, k, v, *_lists([[0, 1], [1, 1]]), 0.125)
    with pytest.raises(ValueError, match="ascending"):
        K.attention_rows(q, k, v, *_lists([[0, 10], [1]]), 0.125)
    with pytest.raises(ValueError, match="at least one"):
        K.attention_rows(q, k, v, *_lists([[0], []]), 0.125)
    with pytest.raises(ValueError, match="shapes"):
        K.attention_rows(torch.randn(2, HEADS, 32), k, v, *_lists([[0], [1]]), 0.125)


ISA_SCRIPT = """
import sys, torch
from specfork.kernels import load_kernels
K = load_kernels()
assert K.isa().startswith(sys.argv[2])
args = torch.load(sys.argv[1])
torch.save([K.attention_rows(*a) for a in args], sys.argv[1] + ".out")
"""


@pytest.mark.parametrize("isa", ["generic", "avx2"])
def test_every_instruction_set_computes_the_same(tmp_path, isa: str) -> None:
    skip_unless_lower(K, isa)
    cases = []
    for head_dim, dtype, rows in [
        (64, torch.bfloat16, _chain(300, 8)),
        (48, torch.float16, _chain(140, 3)),
        (64, torch.float32, _tree(200)),
    ]:
        k, v = _cache(310, head_dim, dtype, seed=head_dim)
        q = torch.randn(len(rows), HEADS, head_dim, generator=torch.Generator().manual_seed(2))
        cases.append((q, k, v, *_lists(rows), head_dim**-0.5))
    lower = run_under(isa, ISA_SCRIPT, cases, tmp_path)
    for args, got in zip(cases, lower, strict=True):
        assert torch.allclose(got, K.attention_rows(*args), rtol=1e-5, atol=1e-6)
