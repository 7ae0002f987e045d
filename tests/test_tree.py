"""Tree shapes: validation, masks, positions, paths, children, tries, pruning, cache slots."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specfork.kv_cache import KVCache
from specfork.tree import (
    Tree,
    TreeBuilder,
    cache_indices,
    chain,
    children,
    depths,
    from_forks,
    path_to,
    paths,
    prune,
    tree_mask,
    tree_positions,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def mask_of(rows: list[str]) -> torch.Tensor:
    """A boolean matrix from rows of '1'/'.' characters."""
    return torch.tensor([[c == "1" for c in row] for row in rows])


# ---------------------------------------------------------------------- hand-checked trees


def test_chain():
    tree = chain([7, 8, 9])
    assert tree.parents.tolist() == [-1, 0, 1]
    assert len(tree) == 3
    assert depths(tree).tolist() == [1, 2, 3]
    assert tree_positions(tree, 10).tolist() == [10, 11, 12, 13]
    assert paths(tree) == [[0, 1, 2]]
    assert children(tree) == [[0], [1], [2], []]
    expected = mask_of(["1...", "11..", "111.", "1111"])
    assert torch.equal(tree_mask(tree), expected)  # a chain's mask is causal
    assert torch.equal(tree_mask(tree), torch.ones(4, 4, dtype=torch.bool).tril())


def test_star():
    tree = Tree(torch.tensor([4, 5, 6, 7]), torch.tensor([-1, -1, -1, -1]))
    assert depths(tree).tolist() == [1, 1, 1, 1]
    assert tree_positions(tree, 3).tolist() == [3, 4, 4, 4, 4]
    assert paths(tree) == [[0], [1], [2], [3]]
    assert children(tree) == [[0, 1, 2, 3], [], [], [], []]
    expected = mask_of(["1....", "11...", "1.1..", "1..1.", "1...1"])
    assert torch.equal(tree_mask(tree), expected)


def test_uneven_depths():
    #   root ─ 0 ─ 2 ─ 4
    #        │   └ 3
    #        └ 1 ─ 5
    tree = Tree(torch.tensor([10, 11, 12, 13, 14, 15]), torch.tensor([-1, -1, 0, 0, 2, 1]))
    assert depths(tree).tolist() == [1, 1, 2, 2, 3, 2]
    assert tree_positions(tree, 0).tolist() == [0, 1, 1, 2, 2, 3, 2]
    assert paths(tree) == [[0, 2, 4], [0, 3], [1, 5]]
    assert children(tree) == [[0, 1], [2, 3], [5], [4], [], [], []]
    expected = mask_of(
        [
            "1......",  # root
            "11.....",  # node 0
            "1.1....",  # node 1
            "11.1...",  # node 2: root, 0
            "11..1..",  # node 3: root, 0
            "11.1.1.",  # node 4: root, 0, 2
            "1.1...1",  # node 5: root, 1
        ]
    )
    assert torch.equal(tree_mask(tree), expected)
    assert path_to(tree, 4) == [0, 2, 4]
    assert path_to(tree, -1) == []


def test_paths_follow_children_order_not_index_order():
    tree = Tree(torch.tensor([1, 2, 3, 4]), torch.tensor([-1, -1, 1, 0]))  # node 3 under 0
    assert paths(tree) == [[0, 3], [1, 2]]


def test_empty_tree():
    tree = chain([])
    assert len(tree) == 0
    assert depths(tree).tolist() == []
    assert tree_positions(tree, 5).tolist() == [5]
    assert paths(tree) == [[]]
    assert children(tree) == [[]]
    assert torch.equal(tree_mask(tree), torch.ones(1, 1, dtype=torch.bool))


def test_inputs_are_converted_to_int64_tensors():
    tree = Tree([3, 4], [-1, 0])
    assert tree.tokens.dtype == tree.parents.dtype == torch.long
    tree = Tree(torch.tensor([3, 4], dtype=torch.int32), torch.tensor([-1, 0], dtype=torch.int32))
    assert tree.tokens.dtype == tree.parents.dtype == torch.long
    with pytest.raises(AttributeError):
        tree.tokens = torch.tensor([1, 2])  # frozen


def test_equality_and_hash_compare_contents():
    assert Tree([3, 4], [-1, 0]) == chain([3, 4])
    assert Tree([3, 4], [-1, -1]) != chain([3, 4])
    assert Tree([3, 5], [-1, 0]) != chain([3, 4])
    assert len({Tree([3, 4], [-1, 0]), chain([3, 4]), chain([])}) == 2


@pytest.mark.parametrize(
    ("tokens", "parents", "message"),
    [
        ([1, 2, 3], [-1, 1, 0], "node 1 has parent 1"),  # parent == own index
        ([1, 2, 3], [-1, 2, 0], "node 1 has parent 2"),  # parent after the node
        ([1, 2], [0, -1], "node 0 has parent 0"),
        ([1, 2], [-1, -2], "node 1 has parent -2"),  # below -1
        ([1, 2, 3], [-1, 0], "same length"),
        ([[1, 2]], [[-1, 0]], "1-D"),
        ([1.0, 2.0], [-1, 0], "integers"),
        ([1, -4], [-1, 0], "non-negative"),
    ],
)
def test_invalid_trees_are_rejected(tokens, parents, message):
    with pytest.raises(ValueError, match=message):
        Tree(torch.tensor(tokens), torch.tensor(parents))


# ------------------------------------------------------------------------- forks and tries


def test_from_forks_keeps_forks_apart_by_default():
    tree = from_forks([5, 5, 6], [[1, 2], [1, 3], []])
    assert tree.tokens.tolist() == [5, 1, 2, 5, 1, 3, 6]
    assert tree.parents.tolist() == [-1, 0, 1, -1, 3, 4, -1]
    assert paths(tree) == [[0, 1, 2], [3, 4, 5], [6]]


def test_from_forks_merges_shared_prefixes_into_a_trie():
    tree = from_forks([5, 5, 6], [[1, 2], [1, 3], []], merge_prefixes=True)
    #   root ─ 5 ─ 1 ─ 2
    #        │       └ 3
    #        └ 6
    assert tree.tokens.tolist() == [5, 1, 2, 3, 6]
    assert tree.parents.tolist() == [-1, 0, 1, 1, -1]
    assert [tree.tokens[p].tolist() for p in paths(tree)] == [[5, 1, 2], [5, 1, 3], [6]]


def test_from_forks_needs_one_continuation_per_fork():
    with pytest.raises(ValueError, match="one continuation per first token"):
        from_forks([1, 2], [[3]])


def test_tree_builder_trie():
    builder = TreeBuilder()
    assert builder.add_path([1, 2, 3]) == [0, 1, 2]
    assert builder.add_path([1, 2, 4]) == [0, 1, 3]  # shared prefix 1, 2 reused
    assert builder.add_path([2, 4]) == [4, 5]
    assert builder.add_path([4], parent=4) == [5]
    assert builder.add(0, 2, merge=False) == 6  # an explicit duplicate of node 1
    assert builder.add(0, 2) == 1  # merging finds the first copy
    assert len(builder) == 7
    tree = builder.build()
    assert tree.tokens.tolist() == [1, 2, 3, 4, 2, 4, 2]
    assert tree.parents.tolist() == [-1, 0, 1, 1, -1, 4, 0]
    with pytest.raises(ValueError, match="parent 9"):
        builder.add(9, 1)


# -------------------------------------------------------------------------------- pruning


def test_prune_drops_descendants_of_dropped_nodes():
    tree = Tree(torch.tensor([10, 11, 12, 13, 14, 15]), torch.tensor([-1, -1, 0, 0, 2, 1]))
    keep = torch.tensor([True, True, False, True, True, True])  # node 4 is under dropped 2
    pruned, index_map = prune(tree, keep)
    assert index_map.tolist() == [0, 1, -1, 2, -1, 3]
    assert pruned.tokens.tolist() == [10, 11, 13, 15]
    assert pruned.parents.tolist() == [-1, -1, 0, 1]
    q = torch.arange(6.0)[:, None]  # [N, 1] per-node rows follow the map
    assert q[index_map >= 0].flatten().tolist() == [0.0, 1.0, 3.0, 5.0]


def test_prune_everything_and_nothing():
    tree = chain([1, 2, 3])
    pruned, index_map = prune(tree, torch.tensor([False, True, True]))
    assert len(pruned) == 0 and index_map.tolist() == [-1, -1, -1]
    pruned, index_map = prune(tree, torch.ones(3, dtype=torch.bool))
    assert torch.equal(pruned.tokens, tree.tokens) and index_map.tolist() == [0, 1, 2]
    with pytest.raises(ValueError, match="keep_mask"):
        prune(tree, torch.ones(2, dtype=torch.bool))


# ----------------------------------------------------------------------------- cache slots


def test_cache_indices():
    assert cache_indices([0, 2, 4], 7).tolist() == [7, 8, 10, 12]
    assert cache_indices([], 7).tolist() == [7]


def test_cache_indices_compact_an_accepted_path_with_keep():
    """Write [root, nodes] after 3 committed slots, keep root + path [0, 2, 4]."""
    tree = Tree(torch.tensor([10, 11, 12, 13, 14, 15]), torch.tensor([-1, -1, 0, 0, 2, 1]))
    cache = KVCache(num_layers=1, num_kv_heads=1, head_dim=1, max_len=16)
    start = 3
    values = torch.arange(start + 1 + len(tree), dtype=torch.float32)  # slot i holds i
    positions = torch.cat([torch.arange(start), tree_positions(tree, start)])
    cache.reserve(positions)
    cache.write(0, 0, values.view(1, 1, -1, 1), values.view(1, 1, -1, 1))
    cache.commit_pending()
    path = [0, 2, 4]
    cache.keep(cache_indices(path, start), start)
    assert cache.length == start + 1 + len(path)
    assert cache.k[0, 0, 0, : cache.length, 0].tolist() == [0, 1, 2, 3, 4, 6, 8]
    assert cache.positions[: cache.length].tolist() == [0, 1, 2, 3, 4, 5, 6]  # contiguous


# ------------------------------------------------------------------------------- properties


@st.composite
def trees(draw) -> Tree:
    n = draw(st.integers(0, 24))
    parents = [draw(st.integers(-1, i - 1)) for i in range(n)]
    tokens = draw(st.lists(st.integers(0, 50), min_size=n, max_size=n))
    return Tree(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long))


@settings(max_examples=150, deadline=None)
@given(tree=trees(), start=st.integers(0, 100))
def test_tree_properties(tree: Tree, start: int):
    n = len(tree)
    depth = depths(tree)
    mask = tree_mask(tree)
    kids = children(tree)
    all_paths = paths(tree)
    parents = tree.parents.tolist()
    # mask: the root row sees only itself; row i + 1 sees exactly its depth + 1 rows
    assert mask.shape == (n + 1, n + 1) and mask.dtype == torch.bool
    assert mask[0].tolist() == [True] + [False] * n
    assert torch.equal(mask.sum(1)[1:], depth + 1)
    assert mask.diagonal().all() and mask[:, 0].all()
    assert not mask.triu(1).any()  # topological order: ancestors come first
    for i in range(n):  # the mask row is exactly {i} ∪ ancestors(i) ∪ {root}
        seen = {0, *[a + 1 for a in path_to(tree, i)]}
        assert set(mask[i + 1].nonzero().flatten().tolist()) == seen
    # positions
    assert torch.equal(tree_positions(tree, start), torch.cat([torch.tensor([0]), depth]) + start)
    # children
    assert len(kids) == n + 1
    assert sorted(c for row in kids for c in row) == list(range(n))
    for row, below in enumerate(kids):
        assert below == sorted(below)
        assert all(parents[c] == row - 1 for c in below)
    # paths: root to leaf, every node covered, one path per leaf
    leaves = [i for i in range(n) if not kids[i + 1]]
    assert sorted(p[-1] for p in all_paths if p) == leaves
    assert len(all_paths) == max(len(leaves), 1)
    assert {i for p in all_paths for i in p} == set(range(n))
    for p in all_paths:
        if p:
            assert not kids[p[-1] + 1]  # ends at a leaf
            assert p == path_to(tree, p[-1])  # starts at a child of the root, parent links
            assert len(p) == int(depth[p[-1]])
        idx = cache_indices(p, start)
        assert idx[0] == start and bool((idx[1:] > idx[:-1]).all())  # ascending for keep
    # a prune that keeps everything is the identity
    pruned, index_map = prune(tree, torch.ones(n, dtype=torch.bool))
    assert torch.equal(pruned.parents, tree.parents) and index_map.tolist() == list(range(n))


@settings(max_examples=100, deadline=None)
@given(tree=trees(), data=st.data())
def test_prune_properties(tree: Tree, data):
    n = len(tree)
    keep = data.draw(st.lists(st.booleans(), min_size=n, max_size=n))
    keep = torch.tensor(keep, dtype=torch.bool)
    pruned, index_map = prune(tree, keep)
    parents = tree.parents.tolist()
    for i in range(n):
        ancestors_kept = all(keep[a] for a in path_to(tree, i))
        assert (index_map[i] >= 0) == ancestors_kept
        if index_map[i] >= 0:
            j = int(index_map[i])
            assert pruned.tokens[j] == tree.tokens[i]
            expected_parent = -1 if parents[i] < 0 else int(index_map[parents[i]])
            assert int(pruned.parents[j]) == expected_parent


@settings(max_examples=60, deadline=None)
@given(forks=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=4), max_size=6))
def test_trie_merging_keeps_every_fork_and_no_duplicate_siblings(forks):
    tree = from_forks([f[0] for f in forks], [f[1:] for f in forks], merge_prefixes=True)
    tokens = tree.tokens.tolist()
    as_paths = {tuple(tokens[i] for i in path_to(tree, node)) for node in range(len(tree))}
    assert all(tuple(f) in as_paths for f in forks)  # every fork is a root-to-node path
    prefixes = {tuple(f[:k]) for f in forks for k in range(1, len(f) + 1)}
    assert len(tree) == len(prefixes)  # one node per distinct prefix
    plain = from_forks([f[0] for f in forks], [f[1:] for f in forks])
    assert len(plain) == sum(len(f) for f in forks)


def test_a_tree_knows_whether_it_is_a_chain() -> None:
    assert chain([4, 5, 6]).is_chain and chain([]).is_chain
    assert not Tree([1, 2], [-1, -1]).is_chain  # two forks
    assert not Tree([1, 2, 3], [-1, 0, 0]).is_chain  # a branch below the first node
    assert Tree([1, 2], [-1, 0]) == chain([1, 2])  # the flag is derived, not compared
