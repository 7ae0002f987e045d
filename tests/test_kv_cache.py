"""KV cache: slot writes, truncate, keep (tree compaction), capacity errors."""

import pytest
import torch

from specfork.errors import PromptError
from specfork.kv_cache import KVCache


def _fill(cache: KVCache, n: int) -> None:
    pos = torch.arange(cache.length, cache.length + n)
    start = cache.reserve(pos)
    for layer in range(cache.k.shape[0]):
        k = pos.float().view(1, 1, n, 1).expand(cache.batch, cache.k.shape[2], n, 4) + layer * 1000
        cache.write(layer, start, k, -k)
    cache.commit_pending()


def test_write_returns_prefix_and_new():
    cache = KVCache(2, 2, 4, 16)
    _fill(cache, 5)
    _fill(cache, 3)
    assert cache.length == 8
    assert cache.k[1, 0, 0, :8, 0].tolist() == [1000 + i for i in range(8)]
    assert cache.positions[:8].tolist() == list(range(8))


def test_truncate_rolls_back_and_rewrites():
    cache = KVCache(1, 2, 4, 16)
    _fill(cache, 6)
    cache.truncate(4)
    assert cache.length == 4
    _fill(cache, 2)
    assert cache.k[0, 0, 0, :6, 0].tolist() == [0, 1, 2, 3, 4, 5]
    with pytest.raises(ValueError):
        cache.truncate(7)


def test_keep_compacts_selected_slots():
    cache = KVCache(2, 2, 4, 16, batch=2)
    _fill(cache, 10)
    cache.keep([4, 6, 9])
    assert cache.length == 7
    assert cache.k[0, 1, 0, 4:7, 0].tolist() == [4, 6, 9]
    assert cache.v[1, 0, 1, 4:7, 0].tolist() == [-1004, -1006, -1009]
    assert cache.positions[4:7].tolist() == [4, 6, 9]
    assert cache.k[0, 0, 0, :4, 0].tolist() == [0, 1, 2, 3]  # prefix untouched


def test_keep_with_explicit_start():
    cache = KVCache(1, 1, 4, 16)
    _fill(cache, 8)
    cache.keep([5, 7], start=3)
    assert cache.length == 5
    assert cache.k[0, 0, 0, 3:5, 0].tolist() == [5, 7]


def test_keep_moves_only_what_is_out_of_place_and_checks_bounds():
    cache = KVCache(1, 1, 4, 16)
    _fill(cache, 10)
    cache.keep([3, 4, 5, 8, 9], start=3)  # 3..5 in place already; 8, 9 move down
    assert cache.length == 8
    assert cache.k[0, 0, 0, :8, 0].tolist() == [0, 1, 2, 3, 4, 5, 8, 9]
    assert cache.positions[:8].tolist() == [0, 1, 2, 3, 4, 5, 8, 9]
    cache.keep([2, 3], start=2)  # all in place: only the length moves
    assert cache.length == 4 and cache.k[0, 0, 0, :4, 0].tolist() == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="outside length"):
        cache.keep([3, 4], start=3)
    with pytest.raises(ValueError, match="at least one slot"):
        cache.keep([])


def test_capacity_error_names_the_problem():
    cache = KVCache(1, 1, 4, 8)
    _fill(cache, 6)
    with pytest.raises(PromptError, match="context length reached"):
        cache.reserve(torch.arange(6, 9))
    assert cache.length == 6
