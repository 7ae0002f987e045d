"""Draft trees as plain data: shapes → attention mask, positions, paths. No model calls.

A tree hangs below a *root*: the last committed token, already chosen but not yet in the
target's KV cache. The root is not a node; nodes are drafted tokens, stored in topological order
(a parent precedes its children) as two [N] int64 tensors, `tokens` and `parents` (-1 = the
root). Children of one parent are ordered by node index, which is the order verification tries
them in.

One target forward verifies the whole tree. Its input is [root, node_0, ..., node_{N-1}]: row
0 is the root, row i + 1 is node i, and the same indexing is used for the attention mask, the
positions and the target's logits (row r predicts the token after row r's token). After
verification the accepted path is compacted in the KV cache with `KVCache.keep(
cache_indices(path, start), start)`, where `start` is the cache slot the root was written to.

Medusa (`medusa/model/utils.py`) is the model for this file: small pure functions that turn a
tree description into what a forward pass needs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True, slots=True)
class Tree:
    """Drafted tokens and their parent links, validated on construction.

    `parents[i]` is -1 for a child of the root, else the index of an earlier node. Anything
    `torch.as_tensor` accepts (lists, tensors) is converted to int64 tensors.
    """

    tokens: torch.Tensor  # [N] int64
    parents: torch.Tensor  # [N] int64, -1 = the root
    is_chain: bool = field(default=False, init=False, compare=False)  # no branching at all

    def __post_init__(self) -> None:
        if _int_list(self.tokens) and _int_list(self.parents):  # a round's nodes, as built
            self._from_lists(self.tokens, self.parents)
            return
        tokens = torch.as_tensor(self.tokens)
        parents = torch.as_tensor(self.parents)
        for name, t in (("tokens", tokens), ("parents", parents)):
            if t.dim() != 1:
                raise ValueError(f"tree {name} must be 1-D, got shape {tuple(t.shape)}")
            if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
                raise ValueError(f"tree {name} must be integers, got {t.dtype}")
        if tokens.shape != parents.shape:
            raise ValueError(
                f"tree tokens and parents must have the same length, got {tokens.shape[0]} "
                f"tokens and {parents.shape[0]} parents"
            )
        tokens, parents = tokens.long(), parents.long()
        if tokens.numel() and int(tokens.min()) < 0:
            raise ValueError(f"tree tokens must be non-negative ids, got {tokens.tolist()}")
        links = parents.tolist()  # plain Python: trees are small, tensor ops cost more here
        self._set(tokens, parents, links)

    def _from_lists(self, tokens: list[int], links: list[int]) -> None:
        """Validated on the lists, then one tensor each (a few µs less than tensor checks,
        several times that right after a forward has flushed the caches)."""
        if len(tokens) != len(links):
            raise ValueError(
                f"tree tokens and parents must have the same length, got {len(tokens)} "
                f"tokens and {len(links)} parents"
            )
        if tokens and min(tokens) < 0:
            raise ValueError(f"tree tokens must be non-negative ids, got {tokens}")
        ids = torch.tensor(tokens, dtype=torch.long)  # [N]
        self._set(ids, torch.tensor(links, dtype=torch.long), links)

    def _set(self, tokens: torch.Tensor, parents: torch.Tensor, links: list[int]) -> None:
        """Check the parent links (topological order) and store the int64 tensors."""
        bad = next((i for i, parent in enumerate(links) if not -1 <= parent < i), None)
        if bad is not None:
            raise ValueError(
                f"tree node {bad} has parent {links[bad]}: a parent must be -1 (the root) or "
                f"an earlier node (topological order), parents = {links}"
            )
        object.__setattr__(self, "tokens", tokens)
        object.__setattr__(self, "parents", parents)
        object.__setattr__(self, "is_chain", all(p == i - 1 for i, p in enumerate(links)))

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Tree):
            return NotImplemented
        return torch.equal(self.tokens, other.tokens) and torch.equal(self.parents, other.parents)

    def __hash__(self) -> int:
        return hash((tuple(self.tokens.tolist()), tuple(self.parents.tolist())))


def _int_list(values: object) -> bool:
    """Whether `values` is a list of Python ints (bools excluded)."""
    return isinstance(values, list) and all(type(v) is int for v in values)


def chain(tokens: Sequence[int] | torch.Tensor) -> Tree:
    """A tree with no branching: token i is the child of token i - 1 (a plain draft).

    Valid by construction, so only the tokens are checked (a draft's hot path).
    """
    tokens = torch.as_tensor(tokens, dtype=torch.long)  # [K]
    if tokens.dim() != 1:
        raise ValueError(f"tree tokens must be 1-D, got shape {tuple(tokens.shape)}")
    if tokens.numel() and int(tokens.min()) < 0:
        raise ValueError(f"tree tokens must be non-negative ids, got {tokens.tolist()}")
    tree = object.__new__(Tree)
    object.__setattr__(tree, "tokens", tokens)
    object.__setattr__(tree, "parents", torch.arange(tokens.shape[0], device=tokens.device) - 1)
    object.__setattr__(tree, "is_chain", True)
    return tree


class TreeBuilder:
    """Grow a tree node by node; identical (parent, token) pairs can be merged (a trie).

    The same token twice under the same parent wastes verification when proposals are
    deterministic (the second copy is rejected for sure). Do NOT merge tokens that were drawn
    i.i.d. from q: lossless verification counts every draw (see `verify_tree`).
    """

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self._index: dict[tuple[int, int], int] = {}  # (parent, token) -> first such node

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, parent: int, token: int, merge: bool = True) -> int:
        """Index of a node `token` under `parent` (-1 = root): the existing one if `merge`."""
        if not -1 <= parent < len(self.tokens):
            raise ValueError(f"parent {parent} is not -1 or an existing node (0..{len(self) - 1})")
        key = (int(parent), int(token))
        if merge and key in self._index:
            return self._index[key]
        self.tokens.append(key[1])
        self.parents.append(key[0])
        self._index.setdefault(key, len(self.tokens) - 1)
        return len(self.tokens) - 1

    def add_path(self, tokens: Sequence[int], parent: int = -1, merge: bool = True) -> list[int]:
        """Add tokens as a chain below `parent`; returns the node index of each token."""
        out = []
        for token in tokens:
            parent = self.add(parent, int(token), merge)
            out.append(parent)
        return out

    def build(self) -> Tree:
        """The tree grown so far."""
        return Tree(self.tokens, self.parents)  # copied into tensors


def from_forks(
    first_tokens: Sequence[int] | torch.Tensor,
    continuations: Sequence[Sequence[int] | torch.Tensor],
    merge_prefixes: bool = False,
) -> Tree:
    """K forks below the root: fork k is first_tokens[k] followed by continuations[k].

    Forks are laid out one after the other (fork 0's nodes first). Forks that share a prefix
    are kept apart unless `merge_prefixes`, which builds a trie (right for deterministic
    proposals, wrong for i.i.d. sampled ones).
    """
    first = torch.as_tensor(first_tokens).tolist()
    if len(first) != len(continuations):
        raise ValueError(
            f"from_forks needs one continuation per first token, got {len(first)} first tokens "
            f"and {len(continuations)} continuations"
        )
    builder = TreeBuilder()
    for token, rest in zip(first, continuations, strict=True):
        rest = torch.as_tensor(rest, dtype=torch.long).tolist()
        builder.add_path([token, *rest], -1, merge_prefixes)
    return builder.build()


def node_scores(tree: Tree) -> torch.Tensor:
    """Rank prior [N] float64 of every node: the product of 1/(sibling rank + 1) on its path.

    Rank 0 is the best candidate (the first child by node index): a Zipf-like prior for "this
    is the continuation the target will choose".
    """
    return torch.tensor(rank_scores(tree.parents.tolist()), dtype=torch.float64)  # [N]


def rank_scores(parents: list[int]) -> list[float]:
    """`node_scores` of a tree given by its parents (topological order), as a list."""
    scores: list[float] = []
    ranks: dict[int, int] = {}  # parent -> children seen so far
    for parent in parents:
        rank = ranks.get(parent, 0)
        ranks[parent] = rank + 1
        scores.append((1.0 if parent < 0 else scores[parent]) / (rank + 1))
    return scores


def depths(tree: Tree) -> torch.Tensor:
    """Depth of every node [N] int64: 1 for the root's children (the root has depth 0)."""
    out = depth_list(tree.parents.tolist())
    return torch.tensor(out, dtype=torch.long, device=tree.parents.device)  # [N]


def depth_list(parents: list[int]) -> list[int]:
    """`depths` of nodes given as a plain list of parents (-1 = the root; topological)."""
    out: list[int] = []
    for parent in parents:
        out.append(1 if parent < 0 else out[parent] + 1)
    return out


def tree_mask(tree: Tree) -> torch.Tensor:
    """Attention mask [N + 1, N + 1] bool over the input [root, node_0, ..., node_{N-1}].

    Row i may attend to column j iff j is i or an ancestor of i (the root, row/column 0, is an
    ancestor of every node). Committed tokens in the cache are visible to every row; that part
    is the model's business.
    """
    n = len(tree) + 1
    rows = [[True] + [False] * (n - 1)]  # the root sees itself
    for i, parent in enumerate(tree.parents.tolist(), start=1):  # parents come first
        row = rows[parent + 1].copy()  # what its parent sees, and itself
        row[i] = True
        rows.append(row)
    # a round's few nodes: lists, then one tensor (torch ops per level cost ~3x as much)
    return torch.tensor(rows, dtype=torch.bool, device=tree.parents.device)  # [N + 1, N + 1]


def tree_positions(tree: Tree, start: int) -> torch.Tensor:
    """RoPE positions [N + 1] int64 of [root, nodes]: root at `start`, a node at start + depth."""
    zero = torch.zeros(1, dtype=torch.long, device=tree.parents.device)
    return start + torch.cat([zero, depths(tree)])  # [N + 1]


def children(tree: Tree) -> list[list[int]]:
    """Children of every row, N + 1 lists: [0] the root's, [i + 1] node i's, by node index."""
    out: list[list[int]] = [[] for _ in range(len(tree) + 1)]
    for i, parent in enumerate(tree.parents.tolist()):
        out[parent + 1].append(i)
    return out


def paths(tree: Tree) -> list[list[int]]:
    """Every root-to-leaf path as node indices, in depth-first order (children by index).

    The empty tree has one path, the empty one (the root is its only leaf).
    """
    kids = children(tree)
    out: list[list[int]] = []
    stack: list[list[int]] = [[]]
    while stack:
        path = stack.pop()
        below = kids[path[-1] + 1 if path else 0]
        if not below:
            out.append(path)
        stack.extend([*path, c] for c in reversed(below))  # first child on top
    return out


def path_to(tree: Tree, node: int) -> list[int]:
    """Node indices from the root's child down to `node` (-1, the root, gives [])."""
    parents = tree.parents.tolist()
    out = []
    while node >= 0:
        out.append(node)
        node = parents[node]
    return out[::-1]


def prune(tree: Tree, keep_mask: torch.Tensor) -> tuple[Tree, torch.Tensor]:
    """Keep the nodes of keep_mask [N] bool whose ancestors are all kept too.

    Returns the smaller tree (order preserved) and index_map [N] int64: the new index of each
    old node, -1 where it was dropped. Per-node rows follow with `q[index_map >= 0]` (q [N, V]);
    rows indexed like the verification input [N + 1, ...] with
    `x[torch.cat([torch.tensor([True]), index_map >= 0])]` (the root row is always kept).
    """
    keep = torch.as_tensor(keep_mask, dtype=torch.bool).tolist()
    if len(keep) != len(tree):
        raise ValueError(f"keep_mask has {len(keep)} entries for a tree of {len(tree)} nodes")
    pruned, index_map = prune_lists(tree.tokens.tolist(), tree.parents.tolist(), keep)
    device = tree.parents.device
    if device.type != "cpu":
        pruned = Tree(pruned.tokens.to(device), pruned.parents.to(device))
    return pruned, torch.tensor(index_map, dtype=torch.long, device=device)  # [N]


def prune_lists(tokens: list[int], parents: list[int], keep: list[bool]) -> tuple[Tree, list[int]]:
    """`prune` of a tree given as lists (a round's few nodes cost less so than as tensors):
    the smaller tree (on the CPU) and the new index of every node, -1 where it or an
    ancestor is not in `keep`."""
    index_map = [-1] * len(parents)
    new_parents: list[int] = []
    for i, parent in enumerate(parents):
        if keep[i] and (parent < 0 or index_map[parent] >= 0):
            index_map[i] = len(new_parents)
            new_parents.append(-1 if parent < 0 else index_map[parent])
    kept_tokens = [tokens[i] for i, j in enumerate(index_map) if j >= 0]
    return Tree(kept_tokens, new_parents), index_map


def cache_indices(path: Sequence[int], start: int) -> torch.Tensor:
    """KV-cache slots [1 + len(path)] of the root and an accepted path, for `KVCache.keep`.

    The verification forward wrote the root to slot `start` and node i to slot start + 1 + i.
    `cache.keep(cache_indices(path, start), start)` moves root + path into the contiguous slots
    [start, start + 1 + len(path)) and drops everything after them. A path's node indices
    increase (topological order), so the slots are ascending, as `keep` requires.
    """
    nodes = torch.as_tensor(list(path), dtype=torch.long)  # [A]
    return torch.cat([torch.tensor([start]), start + 1 + nodes])  # [1 + A]
