"""Prefix cache: keys and values of token prefixes that earlier requests computed, reused.

A radix tree over token ids: each node holds the keys/values of its edge's tokens (every
layer), so a path from the root spells a cached prefix. A new request copies the KV of its
longest cached prefix into its own cache and prefills only the rest; a request stores its
prompt once prefilled and its whole history when it ends (the next turn of a chat starts with
it). Copies, not shared slots: a request owns its cache, and eviction never touches what a
running request holds. Least-recently-used leaves are evicted while the tree holds more than
its byte budget.

The KV of a token depends only on the tokens before it; on batch-invariant steps (specfork's
kernels) it is bitwise the same however it was computed — prompt chunk, verified chain or
tree — so a request's output does not depend on a cache hit. Prompt positions equal slots.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specfork.checks import is_int
from specfork.errors import ConfigError
from specfork.kv_cache import KVCache


@dataclass(eq=False)
class _Node:
    """An edge of the tree: its tokens and their keys/values [L, Hkv, n, D]."""

    tokens: list[int]
    k: torch.Tensor | None  # None at the root
    v: torch.Tensor | None
    parent: _Node | None
    children: dict[int, _Node] = field(default_factory=dict)  # by first token
    used: int = 0  # the tree's clock at the last lookup or store through this node

    @property
    def nbytes(self) -> int:
        return 0 if self.k is None or self.v is None else self.k.nbytes + self.v.nbytes


@dataclass
class PrefixStats:
    """What the cache did: lookups, hits, prompt tokens asked and served."""

    lookups: int = 0
    hits: int = 0
    tokens: int = 0  # prompt tokens looked up
    hit_tokens: int = 0  # of them, served from the cache
    evicted: int = 0  # nodes evicted

    @property
    def hit_rate(self) -> float:
        """Share of looked-up prompt tokens served from the cache."""
        return self.hit_tokens / self.tokens if self.tokens else 0.0


class PrefixCache:
    """A radix tree of cached prefixes under `capacity_bytes` of keys and values."""

    def __init__(self, capacity_bytes: int, min_tokens: int = 1) -> None:
        if not is_int(capacity_bytes):
            raise ConfigError(f"the prefix cache size must be an integer, got {capacity_bytes!r}")
        if capacity_bytes < 1:
            raise ConfigError(f"the prefix cache size must be >= 1 byte, got {capacity_bytes}")
        self.capacity = capacity_bytes
        self.min_tokens = min_tokens  # shorter hits are not worth a copy
        self.root = _Node([], None, None, None)
        self.nbytes = 0
        self.stats = PrefixStats()
        self._clock = 0

    # -- lookups --------------------------------------------------------------------------------
    def load(self, ids: list[int], cache: KVCache) -> int:
        """Copy the KV of the longest cached prefix of `ids` (at most all but the last token:
        its logits are needed) into the empty `cache`; the number of tokens copied."""
        if cache.length:
            raise ValueError("load() fills an empty cache")
        self._clock += 1
        path, n = self._match(ids[:-1])
        self.stats.lookups += 1
        self.stats.tokens += len(ids)
        if n < self.min_tokens:
            return 0
        at = 0
        for node, take in path:
            node.used = self._clock
            assert node.k is not None and node.v is not None
            cache.k[:, 0, :, at : at + take] = node.k[:, :, :take]
            cache.v[:, 0, :, at : at + take] = node.v[:, :, :take]
            at += take
        cache.positions[:n] = torch.arange(n, device=cache.positions.device)
        cache.length = n
        self.stats.hits += 1
        self.stats.hit_tokens += n
        return n

    def _match(self, ids: list[int]) -> tuple[list[tuple[_Node, int]], int]:
        """The nodes along the longest cached prefix of `ids`, with how many of each node's
        tokens match, and the prefix's length."""
        node, n, path = self.root, 0, []
        while n < len(ids) and ids[n] in node.children:
            child = node.children[ids[n]]
            m = _common(child.tokens, ids, n)
            path.append((child, m))
            n += m
            if m < len(child.tokens):
                break
            node = child
        return path, n

    # -- stores ---------------------------------------------------------------------------------
    def store(self, ids: list[int], cache: KVCache) -> None:
        """Cache the KV of `ids`, held in slots [0, len(ids)) of `cache` (only the tokens not
        cached yet are copied), then evict down to the budget."""
        if len(ids) > cache.length:
            raise ValueError(f"the cache holds {cache.length} tokens, not the {len(ids)} given")
        self._clock += 1
        node, n = self.root, 0
        while n < len(ids):
            child = node.children.get(ids[n])
            if child is None:
                self._add(node, ids[n:], cache, n)
                break
            m = _common(child.tokens, ids, n)
            if m < len(child.tokens):
                child = self._split(child, m)
            child.used = self._clock
            node, n = child, n + m
        self._evict()

    def _add(self, parent: _Node, tokens: list[int], cache: KVCache, start: int) -> None:
        end = start + len(tokens)
        k = cache.k[:, 0, :, start:end].clone()  # [L, Hkv, n, D]
        v = cache.v[:, 0, :, start:end].clone()  # [L, Hkv, n, D]
        node = _Node(list(tokens), k, v, parent, used=self._clock)
        parent.children[tokens[0]] = node
        self.nbytes += node.nbytes

    def _split(self, node: _Node, m: int) -> _Node:
        """Cut `node`'s edge after m tokens; returns the new upper node."""
        assert node.k is not None and node.v is not None and node.parent is not None
        upper = _Node(
            node.tokens[:m],
            node.k[:, :, :m].clone(),
            node.v[:, :, :m].clone(),
            node.parent,
            used=node.used,
        )
        node.parent.children[node.tokens[0]] = upper
        self.nbytes -= node.nbytes
        node.tokens = node.tokens[m:]
        node.k, node.v = node.k[:, :, m:].clone(), node.v[:, :, m:].clone()
        node.parent = upper
        upper.children[node.tokens[0]] = node
        self.nbytes += upper.nbytes + node.nbytes
        return upper

    def _evict(self) -> None:
        """Drop least-recently-used leaves while over the budget."""
        while self.nbytes > self.capacity:
            leaf = min(self._leaves(), key=lambda n: n.used, default=None)
            if leaf is None or leaf.parent is None:
                return
            del leaf.parent.children[leaf.tokens[0]]
            self.nbytes -= leaf.nbytes
            self.stats.evicted += 1

    def _leaves(self) -> list[_Node]:
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            else:
                out.append(node)
        return out

    @property
    def tokens(self) -> int:
        """Tokens held (over all edges)."""
        total, stack = 0, list(self.root.children.values())
        while stack:
            node = stack.pop()
            total += len(node.tokens)
            stack.extend(node.children.values())
        return total


def _common(edge: list[int], ids: list[int], at: int) -> int:
    """How many tokens of `edge` equal ids[at:]."""
    n = 0
    while n < len(edge) and at + n < len(ids) and edge[n] == ids[at + n]:
        n += 1
    return n
