"""kernels.logit_rows: the kernels' top-k and log-sum-exp of logits rows against PyTorch's."""

from __future__ import annotations

import pytest
import torch

from isa_run import run_under, skip_unless_lower
from specfork.kernels import load_kernels
from specfork.kernels import logit_rows as logit_rows_module
from specfork.kernels.logit_rows import logsumexp, put_top_k_ids, top2_probabilities, top_k_ids

K = load_kernels()
needs_kernels = pytest.mark.skipif(K is None, reason="the kernels cannot be built here")


@needs_kernels
@pytest.mark.parametrize(("rows", "vocab"), [(1, 7), (6, 49152), (3, 1000), (5, 33)])
@pytest.mark.parametrize("k", [1, 2, 7])
def test_the_kernel_picks_what_torch_topk_picks(rows: int, vocab: int, k: int) -> None:
    x = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(rows * vocab + k))
    got = top_k_ids(x, k)
    assert got.dtype == torch.int64 and got.shape == (rows, k)
    assert torch.equal(got, x.topk(k, dim=-1).indices)


@needs_kernels
def test_equal_values_keep_index_order_and_nan_is_never_chosen() -> None:
    x = torch.zeros(3, 40)
    x[0, 30] = 1.0
    x[1, :] = float("nan")
    x[1, 17] = 2.0
    x[1, 5] = 2.0
    x[2] = torch.arange(40.0)  # ascending: every value replaces the smallest kept
    assert top_k_ids(x, 3)[0].tolist() == [30, 0, 1]
    assert top_k_ids(x, 2)[1].tolist() == [5, 17]
    assert top_k_ids(x, 4)[2].tolist() == [39, 38, 37, 36]


@needs_kernels
def test_non_contiguous_rows_and_other_dtypes() -> None:
    x = torch.randn(8, 300)
    assert torch.equal(top_k_ids(x[::2], 5), x[::2].topk(5, dim=-1).indices)
    half = x.to(torch.bfloat16)  # not float32: torch.topk answers
    assert torch.equal(top_k_ids(half, 5), half.topk(5, dim=-1).indices)


@needs_kernels
@pytest.mark.parametrize(
    ("rows", "vocab", "spread"), [(1, 5, 1.0), (4, 49152, 3.0), (3, 1001, 60.0)]
)
def test_logsumexp_matches_torch(rows: int, vocab: int, spread: float) -> None:
    x = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(vocab)) * spread
    got = logsumexp(x)
    assert got.dtype == torch.float32 and got.shape == (rows,)
    assert torch.allclose(got, torch.logsumexp(x, dim=-1), rtol=1e-6, atol=1e-5)
    x[0, : vocab - 1] = float("-inf")  # one finite entry: its own value
    assert float(logsumexp(x)[0]) == pytest.approx(float(x[0, -1]), abs=1e-6)
    x[0] = float("-inf")
    assert float(logsumexp(x)[0]) == float("-inf")


def _put(tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A [50, 4] table (all -1) after put_top_k_ids of `tokens`' rows of random logits."""
    logits = torch.randn(len(tokens), 300, generator=torch.Generator().manual_seed(len(tokens)))
    table = torch.full((50, 4), -1, dtype=torch.int32)
    put_top_k_ids(table, torch.tensor(tokens), logits)
    return table, logits


@pytest.mark.parametrize("kernels", [True, False])
def test_put_top_k_ids_writes_each_tokens_last_row(monkeypatch, kernels: bool) -> None:
    """Rows in order, a repeated token keeps its later row; other entries are untouched; the
    kernels' one call and PyTorch's indexed write agree."""
    if kernels and K is None:
        pytest.skip("the kernels cannot be built here")
    if not kernels:
        monkeypatch.setattr(logit_rows_module, "loaded_kernels", lambda: None)
    table, logits = _put([3, 9, 3, 7, 9])
    expected = torch.full((50, 4), -1, dtype=torch.int32)
    for row, token in ((2, 3), (4, 9), (3, 7)):
        expected[token] = logits[row].topk(4).indices.to(torch.int32)
    assert torch.equal(table, expected)


def test_k_out_of_range_is_refused() -> None:
    with pytest.raises(ValueError, match=r"k must be in 1\.\.10"):
        top_k_ids(torch.zeros(2, 10), 11)
    with pytest.raises(ValueError, match=r"k must be in 1\.\.10"):
        top_k_ids(torch.zeros(2, 10), 0)


@needs_kernels
@pytest.mark.parametrize(("rows", "vocab"), [(1, 49152), (3, 2), (4, 1001)])
def test_top2_probabilities_are_the_softmaxs_two_best(rows: int, vocab: int) -> None:
    x = 5 * torch.randn(rows, vocab, generator=torch.Generator().manual_seed(rows + vocab))
    want = x.softmax(-1).topk(2, dim=-1).values  # [R, 2]
    assert torch.allclose(top2_probabilities(x), want, rtol=1e-5, atol=1e-8)


def test_without_loaded_kernels_torch_answers(monkeypatch) -> None:
    monkeypatch.setattr(logit_rows_module, "loaded_kernels", lambda: None)
    x = torch.randn(4, 100)
    want = x.softmax(-1).topk(2, dim=-1).values
    assert torch.allclose(top2_probabilities(x), want, rtol=1e-5, atol=1e-8)
    assert torch.equal(top_k_ids(x, 6), x.topk(6, dim=-1).indices)
    assert torch.equal(logsumexp(x), torch.logsumexp(x, dim=-1))


ISA_SCRIPT = """
import sys, torch
from specfork.kernels import load_kernels
from specfork.kernels.logit_rows import logsumexp, put_top_k_ids, top_k_ids
assert load_kernels().isa().startswith(sys.argv[2])
x = torch.load(sys.argv[1])
torch.save((top_k_ids(x, 8), logsumexp(x)), sys.argv[1] + ".out")
"""


@needs_kernels
@pytest.mark.parametrize("isa", ["generic", "avx2"])
def test_every_instruction_set_computes_the_same(tmp_path, isa: str) -> None:
    skip_unless_lower(K, isa)
    x = torch.randn(5, 5003)
    x[2, 100:200] = 3.0  # ties across a vector boundary
    ids, lse = run_under(isa, ISA_SCRIPT, x, tmp_path)
    assert torch.equal(ids, top_k_ids(x, 8))  # the same ids; the sums' order differs by ISA
    assert torch.allclose(lse, logsumexp(x), rtol=1e-6, atol=1e-5)
