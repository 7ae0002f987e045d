"""Token Recycling's adjacency table: updates, candidates, fork trees and best-first trees."""

from __future__ import annotations

import pytest
import torch

from specfork.drafters.recycle import RecycleTable
from specfork.tree import children, depths, path_to

pytestmark = pytest.mark.usefixtures("one_thread")

V = 20


def ranking(*ids: int, vocab: int = V) -> torch.Tensor:
    """Logits [V] whose top tokens are `ids`, in that order."""
    logits = torch.zeros(vocab)
    logits[list(ids)] = torch.arange(len(ids), 0, -1, dtype=torch.float32) + 10
    return logits


def learn(table: RecycleTable, successors: dict[int, tuple[int, ...]]) -> None:
    """Teach `table` that token t is followed by successors[t] (best first)."""
    tokens = torch.tensor(list(successors))
    logits = torch.stack([ranking(*s, vocab=table.vocab_size) for s in successors.values()])
    table.update(tokens, logits)


def test_new_table_knows_nothing():
    table = RecycleTable(V, 3)
    assert table.table.shape == (V, 3) and table.table.dtype == torch.int32
    assert (table.table == -1).all()
    assert table.candidates(4) == []
    assert table.nbytes == V * 3 * 4
    assert RecycleTable(49152, 8).nbytes == 49152 * 8 * 4  # 1.5 MB


@pytest.mark.parametrize(("vocab", "width"), [(0, 1), (10, 0), (10, 11), (10, 2.0)])
def test_invalid_sizes(vocab, width):
    with pytest.raises(ValueError):
        RecycleTable(vocab, width)


def test_update_and_candidates():
    table = RecycleTable(V, 3)
    learn(table, {4: (7, 2, 9, 1), 5: (3, 4, 6)})
    assert table.candidates(4) == [7, 2, 9]  # only the top `width` are kept
    assert table.candidates(4, 2) == [7, 2]
    assert table.candidates(4, 0) == []
    assert table.candidates(5) == [3, 4, 6]
    assert table.candidates(6) == []
    assert table.table[4].tolist() == [7, 2, 9]


def test_most_recent_update_wins():
    table = RecycleTable(V, 2)
    learn(table, {4: (7, 2)})
    learn(table, {4: (1, 3), 8: (8, 8 - 1)})
    assert table.candidates(4) == [1, 3]
    assert table.candidates(8) == [8, 7]
    table.reset()
    assert table.candidates(4) == []


def test_a_token_repeated_in_one_update_keeps_its_last_row():
    table = RecycleTable(V, 2)
    tokens = torch.tensor([3, 5, 3, 6, 3])
    rows = [ranking(1, 2), ranking(9, 8), ranking(11, 12), ranking(0, 1), ranking(14, 15)]
    logits = torch.stack(rows)
    table.update(tokens, logits)
    assert table.candidates(3) == [14, 15]
    assert table.candidates(5) == [9, 8]
    assert table.candidates(6) == [0, 1]


def test_update_matches_a_sequential_reference():
    g = torch.Generator().manual_seed(0)
    vocab, width = 50, 4
    table = RecycleTable(vocab, width)
    reference = torch.full((vocab, width), -1, dtype=torch.long)
    for _ in range(20):
        tokens = torch.randint(0, 8, (30,), generator=g)  # many repeats
        logits = torch.randn(30, vocab, generator=g)
        table.update(tokens, logits)
        for t, row in zip(tokens.tolist(), logits, strict=True):
            reference[t] = row.topk(width).indices
        assert torch.equal(table.table.long(), reference)


def test_update_validates_its_inputs():
    table = RecycleTable(V, 2)
    with pytest.raises(ValueError, match="logits must be"):
        table.update(torch.tensor([1, 2]), torch.zeros(3, V))
    with pytest.raises(ValueError, match="logits must be"):
        table.update(torch.tensor([1]), torch.zeros(1, V + 1))
    with pytest.raises(ValueError, match="token ids"):
        table.update(torch.tensor([V]), torch.zeros(1, V))
    table.update(torch.zeros(0, dtype=torch.long), torch.zeros(0, V))  # nothing to learn
    assert (table.table == -1).all()
    with pytest.raises(ValueError):
        table.candidates(1, -1)


# --------------------------------------------------------------------------------- forks


def test_build_forks_shape():
    table = RecycleTable(V, 3)
    successors = {0: (1, 2, 3), 1: (4, 5, 6), 4: (7, 8, 9), 7: (10, 11, 12), 2: (13, 14, 15)}
    learn(table, {**successors, 3: (16, 17, 18)})
    tree = table.build_forks(0, forks=3, depth=3)
    #   0 ─ 1 ─ 4 ─ 7
    #     ├ 2 ─ 13     (13 unknown: the fork stops)
    #     └ 3 ─ 16
    assert tree.tokens.tolist() == [1, 4, 7, 2, 13, 3, 16]
    assert tree.parents.tolist() == [-1, 0, 1, -1, 3, -1, 5]
    assert children(tree)[0] == [0, 3, 5]  # forks in rank order
    assert int(depths(tree).max()) == 3
    assert table.build_forks(0, forks=2, depth=1).tokens.tolist() == [1, 2]
    assert len(table.build_forks(19, forks=3, depth=4)) == 0  # unknown root: empty tree
    assert len(table.build_forks(0, forks=0, depth=4)) == 0
    with pytest.raises(ValueError):
        table.build_forks(0, forks=2, depth=0)


def test_build_forks_merges_identical_prefixes():
    table = RecycleTable(V, 3)
    learn(table, {5: (6, 7, 8), 6: (9,), 9: (1,)})
    table.table[0] = torch.tensor([5, 5, 6], dtype=torch.int32)  # a row with a repeat
    tree = table.build_forks(0, forks=3, depth=3)
    #   0 ─ 5 ─ 6 ─ 9   (the second 5-fork is the same path: merged)
    #     └ 6 ─ 9 ─ 1
    assert tree.tokens.tolist() == [5, 6, 9, 6, 9, 1]
    assert tree.parents.tolist() == [-1, 0, 1, -1, 3, 4]


# ------------------------------------------------------------------------ best-first trees


def score(table: RecycleTable, root: int, tokens: list[int]) -> float:
    """Product of 1 / (rank + 1) along a path of tokens below `root`."""
    s, prev = 1.0, root
    for t in tokens:
        s /= table.candidates(prev).index(t) + 1
        prev = t
    return s


def test_build_dynamic_hand_checked():
    table = RecycleTable(V, 3)
    learn(table, {0: (1, 2, 3), 1: (4, 5, 6), 2: (7, 8, 9), 4: (10, 11, 12)})
    tree = table.build_dynamic(0, budget=5, max_depth=3, branch=2)
    # scores: 1: 1, 4: 1, 10: 1, then 2, 5, 11 and 7 (below 2) all 1/2; ties go by discovery
    # order: 2 (found with 1), then 5 (found with 4)
    assert tree.tokens.tolist() == [1, 4, 10, 2, 5]
    assert tree.parents.tolist() == [-1, 0, 1, -1, 0]
    tree = table.build_dynamic(0, budget=10, max_depth=1, branch=3)
    assert tree.tokens.tolist() == [1, 2, 3] and (tree.parents == -1).all()
    assert len(table.build_dynamic(0, budget=0, max_depth=3, branch=2)) == 0
    assert len(table.build_dynamic(19, budget=8, max_depth=3, branch=2)) == 0
    for bad in [(-1, 3, 2), (4, 0, 2), (4, 3, 0)]:
        with pytest.raises(ValueError):
            table.build_dynamic(0, *bad)


@pytest.mark.parametrize("seed", range(6))
def test_build_dynamic_respects_budget_depth_branch_and_picks_the_best_nodes(seed: int):
    g = torch.Generator().manual_seed(seed)
    vocab, width = 12, 4
    table = RecycleTable(vocab, width)
    known = torch.randperm(vocab, generator=g)[:9]  # some tokens stay unknown
    table.update(known, torch.randn(9, vocab, generator=g))
    root = int(known[0])
    budget, max_depth, branch = 2 + seed * 3, 1 + seed % 4, 1 + seed % 3
    tree = table.build_dynamic(root, budget, max_depth, branch)
    tokens = tree.tokens.tolist()
    assert len(tree) <= budget
    assert len(tree) == 0 or int(depths(tree).max()) <= max_depth
    kids = children(tree)
    for row, below in enumerate(kids):
        parent_token = root if row == 0 else tokens[row - 1]
        child_tokens = [tokens[c] for c in below]
        assert len(child_tokens) <= branch
        assert len(set(child_tokens)) == len(child_tokens)  # distinct siblings
        allowed = table.candidates(parent_token, branch)
        ranks = [allowed.index(t) for t in child_tokens]
        assert ranks == sorted(ranks)  # siblings are tried best rank first
    scores = [score(table, root, [tokens[i] for i in path_to(tree, n)]) for n in range(len(tree))]
    assert scores == sorted(scores, reverse=True)  # nodes in best-first order
    # brute force: every node of the full candidate tree, best `budget` scores
    everything, frontier = [], [(root, 1.0, 0)]
    while frontier:
        token, s, d = frontier.pop()
        if d == max_depth:
            continue
        for rank, child in enumerate(table.candidates(token, branch)):
            everything.append(s / (rank + 1))
            frontier.append((child, s / (rank + 1), d + 1))
    best = sorted(everything, reverse=True)[:budget]
    assert scores == pytest.approx(best)
