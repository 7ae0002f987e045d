"""The recycle prior: every token's one-token prediction of the target, cached per model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from specfork.config import ModelConfig, SamplingParams
from specfork.drafters.base import DraftShape
from specfork.drafters.forks import ForkDrafter
from specfork.drafters.recycle import UNKNOWN, RecycleTable
from specfork.drafters.recycle_prior import compute_prior, load_or_compute, prior_file
from specfork.models.llama import LlamaLM

V, W = 96, 4


@pytest.fixture(scope="module")
def tiny() -> LlamaLM:
    cfg = ModelConfig("llama", V, 32, 64, 2, 4, 2, 8, max_position=64)
    torch.manual_seed(0)
    model = LlamaLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model.eval()


def _expected_row(model: LlamaLM, context: list[int], token: int) -> list[int]:
    with torch.inference_mode():
        logits = model.extend([*context, token], model.new_cache(16))
    return logits.topk(W).indices.tolist()


def test_rows_are_the_models_top_k_after_context_and_token(tiny: LlamaLM) -> None:
    """The batched star forward (diagonal mask, one shared position) equals one forward per
    id; ids past `ids` stay unknown."""
    context = [3, 7]
    prior = compute_prior(tiny, W, context, ids=70, chunk=32)  # chunks 32 + 32 + 6
    assert prior.shape == (V, W) and prior.dtype == torch.int32
    for token in (0, 31, 32, 63, 64, 69):
        assert prior[token].tolist() == _expected_row(tiny, context, token)
    assert (prior[70:] == UNKNOWN).all()
    assert compute_prior(tiny, W, [], ids=V)[5].tolist() == _expected_row(tiny, [], 5)


def test_prior_is_computed_once_per_weight_file(tiny: LlamaLM, tmp_path: Path) -> None:
    source = tmp_path / "weights.gguf"
    source.write_bytes(b"weights")
    folder = tmp_path / "cache"
    first = load_or_compute(tiny, W, [1], source, folder)
    saved = prior_file(folder, source, W)
    assert saved.exists()
    save_file({"prior": torch.zeros(V, W, dtype=torch.int32)}, saved)  # what is on disk is used
    assert (load_or_compute(tiny, W, [1], source, folder) == 0).all()
    saved.write_bytes(b"not a tensor")  # unreadable: recomputed and rewritten
    assert torch.equal(load_or_compute(tiny, W, [1], source, folder), first)
    source.write_bytes(b"other weights")  # a changed file is another model
    assert prior_file(folder, source, W) != saved
    assert torch.equal(load_or_compute(tiny, W, [1], None, folder), first)  # no file: no cache


def test_table_starts_from_the_prior_and_observations_win() -> None:
    prior = torch.full((V, W), UNKNOWN, dtype=torch.int32)
    prior[5] = torch.tensor([9, 8, 7, 6])
    table = RecycleTable(V, W, prior=prior)
    assert table.candidates(5) == [9, 8, 7, 6] and table.candidates(6) == []
    logits = torch.zeros(1, V)
    logits[0, 40] = 1.0
    table.update(torch.tensor([5]), logits)
    assert table.candidates(5, 1) == [40]
    table.reset()  # the next request starts from the prior again
    assert table.candidates(5) == [9, 8, 7, 6]
    with pytest.raises(ValueError, match=r"recycle prior must be \[96, 4\]"):
        RecycleTable(V, W, prior=torch.zeros(V, W + 1, dtype=torch.int32))


def test_a_root_never_seen_still_gets_forks_from_the_prior() -> None:
    prior = torch.full((V, 8), UNKNOWN, dtype=torch.int32)
    prior[11] = torch.tensor([12, 13, 14, 15, 16, 17, 18, 19])
    prior[12] = torch.tensor([20, 21, 22, 23, 24, 25, 26, 27])
    drafter = ForkDrafter(V, recycle=True, chains={}, prior=prior).begin([1, 2])
    shape = DraftShape(2, "forks", forks=2, budget=24)
    tree = drafter.propose([1, 2, 11], shape, SamplingParams(), torch.Generator()).tree
    assert tree.tokens.tolist() == [12, 20, 13] and tree.parents.tolist() == [-1, 0, -1]
    empty = ForkDrafter(V, recycle=True, chains={}).begin([1, 2])
    assert len(empty.propose([1, 2, 11], shape, SamplingParams(), torch.Generator())) == 0
