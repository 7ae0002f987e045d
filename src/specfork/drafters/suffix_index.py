"""SuffixDecoding's store (Oliaro et al. 2025): a bounded, thread-safe suffix trie over token
sequences — requests' prompts and outputs — that many requests share.

The trie holds every substring of length at most `depth` of every indexed sequence, with its
count (how many times it occurs). A context's longest suffix that occurs followed by something
is its match; the match's subtree says what followed it, and how often: a child's share of its
siblings' counts is the empirical probability of that next token.

Sequences are appended to as requests run (`open` with a prompt, `extend` with what the target
committed), so a request drafts from its own prompt and output and from every earlier one's.
Memory is bounded by a token budget (`SuffixLimits.max_tokens`): when it is exceeded the
oldest sequence loses tokens from its front (its whole sequence first, then the next oldest),
so nodes never exceed `max_tokens · depth`. Every method holds one lock: several threads may
insert and query at once.
"""

from __future__ import annotations

import heapq
import math
import threading
from collections import OrderedDict
from dataclasses import dataclass

from specfork.checks import is_int
from specfork.drafters.suffix_nodes import NONE, ROOT, Nodes
from specfork.errors import ConfigError


@dataclass(frozen=True, slots=True)
class SuffixLimits:
    """How much a `SuffixIndex` keeps: `max_tokens` indexed tokens over all sequences (the
    oldest trimmed first beyond it), substrings up to `depth` tokens (match + continuation)."""

    max_tokens: int = 32768
    depth: int = 24

    def __post_init__(self) -> None:
        for name in ("max_tokens", "depth"):
            value = getattr(self, name)
            if not is_int(value) or value < 2:
                raise ConfigError(f"suffix index {name} must be an integer >= 2, got {value!r}")


@dataclass(frozen=True, slots=True)
class Proposal:
    """Continuations of a context's match: nodes in topological order (`parents[i]` = -1 for a
    child of the root, else an earlier node), each with its score — the product of the
    empirical next-token probabilities along its path. `match` is the matched suffix's length
    (0: no match, no nodes)."""

    tokens: list[int]
    parents: list[int]
    scores: list[float]
    match: int


@dataclass(frozen=True, slots=True)
class Snapshot:
    """What a `SuffixIndex` held: its sequences (id, kept tokens), oldest first."""

    sequences: tuple[tuple[int, tuple[int, ...]], ...]
    next_id: int


class _Sequence:
    """One indexed sequence: its tokens from `first` on are indexed; `open` holds the deepest
    node of every path still shorter than the depth, oldest start first (they start at the
    last len(open) positions)."""

    __slots__ = ("first", "open", "tokens")

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.first = 0
        self.open: list[int] = []  # node ids

    @property
    def kept(self) -> int:
        return len(self.tokens) - self.first


class SuffixIndex:
    """The shared suffix trie (see the module docstring)."""

    def __init__(self, limits: SuffixLimits | None = None) -> None:
        self.limits = limits or SuffixLimits()
        self._lock = threading.Lock()
        self._clear()

    def _clear(self) -> None:
        self._nodes = Nodes()
        self._sequences: OrderedDict[int, _Sequence] = OrderedDict()  # oldest first
        self._tokens = 0  # indexed tokens over all sequences
        self._next_id = 0

    # -- writing ----------------------------------------------------------------------------
    def open(self, tokens: list[int]) -> int:
        """A new sequence (the newest) holding `tokens`; its id for `extend`."""
        with self._lock:
            seq_id = self._next_id
            self._next_id += 1
            self._append(seq_id, tokens)
            return seq_id

    def extend(self, seq_id: int, tokens: list[int]) -> None:
        """Append `tokens` to sequence `seq_id` (one that was trimmed away entirely starts
        again as the newest sequence)."""
        with self._lock:
            self._append(seq_id, tokens)

    def _append(self, seq_id: int, tokens: list[int]) -> None:
        seq = self._sequences.get(seq_id)
        if seq is None:
            seq = self._sequences[seq_id] = _Sequence()
        for token in tokens:
            self._push(seq, int(token))
        self._fit()

    def _push(self, seq: _Sequence, token: int) -> None:
        """Index `token` at the end of `seq`: every open path grows by it, one path starts.

        The lookups that find a child are inlined (`Nodes.get`'s two cases) and a missing child
        is added without looking again: 7.7 → 7.2 µs a token on two Zen 5 cores, paid for every
        prompt token before the first output token and for every accepted one."""
        seq.tokens.append(token)
        nodes, paths = self._nodes, seq.open
        count, only, inline, more = nodes.count, nodes.only, nodes.token, nodes.more
        paths.append(ROOT)  # the path that starts here
        for i, node in enumerate(paths):
            child = only[node]
            if child == NONE or inline[node] != token:
                kids = more.get(node) if child == NONE else None
                child = kids.get(token, NONE) if kids is not None else NONE
                if child == NONE:
                    child = nodes.add(node, token)
            paths[i] = child
            count[child] += 1
        if len(paths) >= self.limits.depth:
            paths.pop(0)  # the oldest path is full: `depth` tokens
        self._tokens += 1

    def _fit(self) -> None:
        """Trim the oldest sequences' fronts until the budget holds."""
        while self._tokens > self.limits.max_tokens:
            seq_id, seq = next(iter(self._sequences.items()))
            self._trim_front(seq)
            if seq.kept == 0:
                del self._sequences[seq_id]

    def _trim_front(self, seq: _Sequence) -> None:
        """Forget the first indexed token of `seq`: the path of substrings starting there."""
        start = seq.first
        nodes, node = self._nodes, ROOT
        for token in seq.tokens[start : start + self.limits.depth]:
            child = nodes.get(node, token)
            assert child != NONE
            nodes.count[child] -= 1
            if nodes.count[child] == 0:  # only this path passed through it: drop its subtree
                nodes.remove(node, token)
                break
            node = child
        if seq.open and len(seq.tokens) - len(seq.open) == start:
            seq.open.pop(0)  # that path was still open
        seq.first += 1
        self._tokens -= 1
        if seq.first > 1024 and seq.first * 2 > len(seq.tokens):  # drop the trimmed tokens
            shift = seq.first
            seq.tokens = seq.tokens[shift:]
            seq.first = 0

    # -- reading ----------------------------------------------------------------------------
    def propose(
        self,
        context: list[int],
        *,
        max_match: int,
        max_nodes: int,
        max_depth: int,
        spec_factor: float,
        min_prob: float,
        chain: bool,
    ) -> Proposal:
        """Continuations of the longest suffix of `context` (at most `max_match` tokens) that
        occurs followed by something: a chain along the most frequent child, or (`chain`
        false) the `max_nodes` most probable nodes best-first. Paths are at most
        min(`max_depth`, ⌈`spec_factor` · match⌉) deep; nodes scoring below `min_prob` are
        left out."""
        with self._lock:
            match, node = self._match(context, min(max_match, self.limits.depth - 1))
            if node == NONE:
                return Proposal([], [], [], 0)
            depth = min(max_depth, max(1, math.ceil(spec_factor * match)))
            if chain:
                return _best_path(self._nodes, node, min(depth, max_nodes), min_prob, match)
            return _best_first(self._nodes, node, max_nodes, depth, min_prob, match)

    def _match(self, context: list[int], longest: int) -> tuple[int, int]:
        """The longest m <= `longest` whose last-m-token node has children, and that node
        (binary search: a suffix of a continued substring is continued too)."""
        low, high, found = 1, min(longest, len(context)), NONE
        while low <= high:
            mid = (low + high) // 2
            node = self._walk(context[len(context) - mid :])
            if node != NONE and self._nodes.continued(node):
                low, found = mid + 1, node
            else:
                high = mid - 1
        return (high, found) if found != NONE else (0, NONE)

    def _walk(self, tokens: list[int]) -> int:
        """The node of `tokens`' substring, or NONE."""
        node = ROOT
        for token in tokens:
            node = self._nodes.get(node, token)
            if node == NONE:
                return NONE
        return node

    def count(self, tokens: list[int]) -> int:
        """How often `tokens` (at most `depth` of them) occurs in the indexed sequences."""
        with self._lock:
            node = self._walk(tokens)
            return 0 if node == NONE else self._nodes.count[node]

    @property
    def tokens(self) -> int:
        """Tokens indexed over all sequences (at most `limits.max_tokens`)."""
        with self._lock:
            return self._tokens

    def sequences(self) -> list[list[int]]:
        """The indexed tokens of every sequence, oldest first."""
        with self._lock:
            return [s.tokens[s.first :] for s in self._sequences.values()]

    def nodes(self) -> int:
        """Trie nodes (the root excluded): at most `tokens · depth`."""
        with self._lock:
            stack, total = [ROOT], -1
            while stack:
                node = stack.pop()
                total += 1
                stack.extend(child for _, child in self._nodes.items(node))
            return total

    # -- snapshots --------------------------------------------------------------------------
    def snapshot(self) -> Snapshot:
        """What the index holds now (to `restore` later)."""
        with self._lock:
            held = tuple((i, tuple(s.tokens[s.first :])) for i, s in self._sequences.items())
            return Snapshot(held, self._next_id)

    def restore(self, snapshot: Snapshot) -> None:
        """Hold exactly what `snapshot` held (later sequences forgotten, trimmed ones back)."""
        with self._lock:
            self._clear()
            for seq_id, tokens in snapshot.sequences:
                self._append(seq_id, list(tokens))
            self._next_id = snapshot.next_id

    def clear(self) -> None:
        """Forget every sequence."""
        with self._lock:
            self._clear()


def _shares(nodes: Nodes, node: int) -> list[tuple[float, int, int]]:
    """(probability, token, child) of `node`'s children, most probable first (ties: lower
    token id): a child's count over its siblings' total."""
    count = nodes.count
    children = nodes.items(node)
    total = sum(count[c] for _, c in children)
    ranked = sorted(children, key=lambda item: (-count[item[1]], item[0]))
    return [(count[c] / total, token, c) for token, c in ranked]


def _best_path(nodes: Nodes, node: int, depth: int, min_prob: float, match: int) -> Proposal:
    tokens: list[int] = []
    scores: list[float] = []
    score = 1.0
    while len(tokens) < depth and nodes.continued(node):
        prob, token, node = _shares(nodes, node)[0]
        score *= prob
        if score < min_prob:
            break
        tokens.append(token)
        scores.append(score)
    return Proposal(tokens, list(range(-1, len(tokens) - 1)), scores, match)


def _best_first(
    nodes: Nodes, node: int, max_nodes: int, depth: int, min_prob: float, match: int
) -> Proposal:
    tokens: list[int] = []
    parents: list[int] = []
    scores: list[float] = []
    order = 0  # ties: the earlier pushed first, so the result is deterministic
    heap: list[tuple[float, int, int, int, int, int]] = []  # -score, order, level, parent, …

    def push(below: int, parent: int, level: int, score: float) -> None:
        nonlocal order
        for prob, token, child in _shares(nodes, below):
            heapq.heappush(heap, (-score * prob, order, level, parent, token, child))
            order += 1

    push(node, -1, 1, 1.0)
    while heap and len(tokens) < max_nodes:
        neg, _, level, parent, token, child = heapq.heappop(heap)
        if -neg < min_prob:
            break
        tokens.append(token)
        parents.append(parent)
        scores.append(-neg)
        if level < depth:
            push(child, len(tokens) - 1, level + 1, -neg)
    return Proposal(tokens, parents, scores, match)
