"""Token Recycling's adjacency table: draft trees from the target's own past top-k candidates.

Token Recycling (Luo et al. 2024) keeps, for every token id, the top-k tokens the target
predicted the last time it saw that token. Every verification forward yields such predictions
for every row of its input (`update`); the next draft is a tree grown by looking successors up
in the table (`build_forks`, `build_dynamic`) — no draft model, no training. Proposals are
deterministic, so they are verified with a one-hot q (`verify_tree_sampling` with q=None).

Memory: the table is [V, width] int32 (V = 49 152, width 8: 1.5 MB; V = 262 144: 8 MB).
"""

from __future__ import annotations

import heapq

import numpy as np
import torch

from specfork.kernels.logit_rows import put_top_k_ids
from specfork.tree import Tree, TreeBuilder

UNKNOWN = -1  # table entry: no candidate recorded


class RecycleTable:
    """For every token id, the target's top-`width` next tokens from the last time it was seen."""

    def __init__(
        self,
        vocab_size: int,
        width: int,
        device: torch.device | str = "cpu",
        prior: torch.Tensor | None = None,
    ) -> None:
        """`prior` [V, width]: the rows `reset` starts from (default: every row unknown)."""
        if not (isinstance(vocab_size, int) and vocab_size >= 1):
            raise ValueError(f"vocab_size must be a positive integer, got {vocab_size!r}")
        if not (isinstance(width, int) and 1 <= width <= vocab_size):
            raise ValueError(f"width must be an integer in 1..{vocab_size}, got {width!r}")
        self.vocab_size = vocab_size
        self.width = width
        # int32 halves the memory of int64; ids fit (vocabularies are < 2**31)
        self.table = torch.full((vocab_size, width), UNKNOWN, dtype=torch.int32, device=device)
        if prior is not None and prior.shape != self.table.shape:
            raise ValueError(
                f"a recycle prior must be [{vocab_size}, {width}], got {tuple(prior.shape)}"
            )
        self.prior = None if prior is None else prior.to(device=device, dtype=torch.int32)
        self.reset()

    @property
    def nbytes(self) -> int:
        return self.table.numel() * self.table.element_size()

    def reset(self) -> None:
        """Forget every candidate seen (back to the prior, if any)."""
        if self.prior is None:
            self.table.fill_(UNKNOWN)
        else:
            self.table.copy_(self.prior)

    def update(self, tokens: torch.Tensor, logits: torch.Tensor) -> None:
        """Record top-`width` successors: table[tokens[i]] = top-width ids of logits[i].

        tokens [T] are the input rows of a target forward and logits [T, V] its outputs (row i
        predicts what follows tokens[i]). The newest information wins: a token's row replaces
        the old one, and a token appearing several times in `tokens` keeps its last row.
        """
        tokens = torch.as_tensor(tokens, dtype=torch.long).to(self.table.device).flatten()  # [T]
        if logits.dim() != 2 or logits.shape != (tokens.shape[0], self.vocab_size):
            raise ValueError(
                f"logits must be [T, V] = [{tokens.shape[0]}, {self.vocab_size}], "
                f"got {tuple(logits.shape)}"
            )
        if tokens.numel() == 0:
            return
        ids = tokens.tolist()
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            raise ValueError(f"token ids must be in 0..{self.vocab_size - 1}, got {ids}")
        put_top_k_ids(self.table, tokens, logits)  # a token's last row wins

    def candidates(self, token: int, k: int | None = None) -> list[int]:
        """Up to k (default: width) known successors of `token`, best first; [] if unknown."""
        k = self.width if k is None else k
        if k < 0:
            raise ValueError(f"number of candidates must be >= 0, got {k}")
        row = self._rows[int(token), :k].tolist()
        return [t for t in row if t != UNKNOWN]

    @property
    def _rows(self) -> torch.Tensor | np.ndarray:
        """The table to read single entries from: on the CPU a NumPy view of it (the same
        memory; an entry costs ~0.1 µs where a tensor index is a torch op of µs)."""
        return self.table.numpy() if self.table.device.type == "cpu" else self.table

    def build_forks(self, root: int, forks: int, depth: int) -> Tree:
        """Up to `forks` forks below `root`, each up to `depth` tokens deep (a trie).

        Fork j starts with the root's j-th best successor and is extended `depth - 1` more
        tokens by following each token's top-1 successor; a fork stops early where the table
        knows no successor. Identical (parent, token) pairs are merged.
        """
        if forks < 0 or depth < 1:
            raise ValueError(f"need forks >= 0 and depth >= 1, got forks={forks}, depth={depth}")
        builder = TreeBuilder()
        top1 = self._rows[:, 0]  # [V] each token's best successor
        for first in self.candidates(root, forks):
            node = builder.add(-1, first)
            token = first
            for _ in range(depth - 1):
                token = int(top1[token])
                if token == UNKNOWN:
                    break
                node = builder.add(node, token)
        return builder.build()

    def build_dynamic(self, root: int, budget: int, max_depth: int, branch: int) -> Tree:
        """A best-first tree of up to `budget` nodes, at most `max_depth` deep.

        Score of a node: the product over its path of 1 / (rank + 1), rank being the token's
        position (0 = best) in its parent's table row — a rank-based prior for "this is the
        continuation the target will choose" (Zipf-like: the best candidate of a row counts 1,
        the second 1/2, ...). Starting from the root, the highest-scoring candidate not yet in
        the tree is added and its up to `branch` table successors become candidates, until
        `budget` nodes are placed or nothing is left. Scores only shrink along a path, so the
        result is the `budget` best-scoring nodes of the full candidate tree (ties broken by
        discovery order, parents first); node order is the order they were added, so siblings
        are tried best rank first. Siblings are distinct (duplicates in a row are skipped).
        """
        if budget < 0 or max_depth < 1 or branch < 1:
            raise ValueError(
                f"need budget >= 0, max_depth >= 1 and branch >= 1, got budget={budget}, "
                f"max_depth={max_depth}, branch={branch}"
            )
        builder = TreeBuilder()
        counter = 0  # heap tie-breaker: discovery order
        heap: list[tuple[float, int, int, int, int]] = []  # (-score, order, parent, token, depth)

        def push_children(parent: int, token: int, score: float, depth: int) -> None:
            nonlocal counter
            if depth > max_depth:
                return
            for rank, child in enumerate(dict.fromkeys(self.candidates(token, branch))):
                heapq.heappush(heap, (-score / (rank + 1), counter, parent, child, depth))
                counter += 1

        push_children(-1, int(root), 1.0, 1)
        while heap and len(builder) < budget:
            neg_score, _, parent, token, depth = heapq.heappop(heap)
            node = builder.add(parent, token)
            push_children(node, token, -neg_score, depth + 1)
        return builder.build()
