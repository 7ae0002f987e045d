"""Acceptance rates that a strategy's requests hand on to the next ones.

A goodput gate (`strategies.goodput`) learns, per request, how often each kind of draft node is
accepted, starting from a prior of 0.5. A request of 64 tokens spends its first rounds
learning: a SPORK tree on a long prompt sent ~0.8 nodes a round and had 4 of 46 accepted, each
node an extra row of attention over 3k cached tokens, and ran at 0.86× plain decoding.

A `RateMemory` keeps the counts of every request of one strategy (on one Generator) that came
before, decayed so that it follows a change of workload: a key's counts are halved whenever
its trials pass `cap`. A new request's gate starts from them scaled down to at most
`seed_weight` trials a key, so that its own rounds outweigh the memory after a few
observations. Rates only (hits and trials per key); no tokens are kept.

Thread-safe: the requests of a batch, or of several server threads, share one memory.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable

CAP = 64.0  # trials a key keeps before its counts are halved (adapts over ~this many)
SEED_WEIGHT = 8.0  # trials of memory a new request's gate starts from, at most, per key
MAX_STRATEGIES = 32  # memories a RateBook keeps (the least recently used are dropped)

Counts = dict[Hashable, tuple[float, float]]  # key -> (hits, trials)


class RateMemory:
    """Hits and trials per key, shared by the requests of one strategy (see the module doc)."""

    def __init__(self, cap: float = CAP, seed_weight: float = SEED_WEIGHT) -> None:
        if not cap > 0 or not seed_weight >= 0:
            raise ValueError(f"cap must be > 0 and seed_weight >= 0, got {cap}, {seed_weight}")
        self.cap = cap
        self.seed_weight = seed_weight
        self._counts: dict[Hashable, list[float]] = {}
        self._lock = threading.Lock()

    def add(self, key: Hashable, hit: bool) -> None:
        """One trial of `key`, a hit or not."""
        self.add_many([(key, hit)])

    def add_many(self, trials: list[tuple[Hashable, bool]]) -> None:
        """Several trials (key, hit), under one lock."""
        with self._lock:
            for key, hit in trials:
                counts = self._counts.setdefault(key, [0.0, 0.0])
                counts[0] += 1.0 if hit else 0.0
                counts[1] += 1.0
                if counts[1] > self.cap:
                    counts[0] /= 2
                    counts[1] /= 2

    def seed(self) -> Counts:
        """What a new request starts from: every key's counts, scaled to at most
        `seed_weight` trials (the rate unchanged)."""
        with self._lock:
            out: Counts = {}
            for key, (hits, trials) in self._counts.items():
                scale = min(1.0, self.seed_weight / trials) if trials else 0.0
                out[key] = (hits * scale, trials * scale)
            return out

    def snapshot(self) -> Counts:
        """Everything held now (to `restore` later)."""
        with self._lock:
            return {key: (h, t) for key, (h, t) in self._counts.items()}

    def restore(self, snapshot: Counts) -> None:
        """Hold exactly what `snapshot` held."""
        with self._lock:
            self._counts = {key: [h, t] for key, (h, t) in snapshot.items()}


class RateBook:
    """One `RateMemory` per strategy (any hashable key: a Generator uses its SpecConfig), the
    `max_strategies` most recently used kept. `shared=False`: none, every request's gate
    learns from that request alone (a request's draft lengths then never depend on others)."""

    def __init__(self, max_strategies: int = MAX_STRATEGIES, shared: bool = True) -> None:
        if max_strategies < 1:
            raise ValueError(f"max_strategies must be >= 1, got {max_strategies}")
        self.max_strategies = max_strategies
        self.shared = shared
        self._memories: OrderedDict[Hashable, RateMemory] = OrderedDict()
        self._lock = threading.Lock()

    def memory(self, strategy: Hashable) -> RateMemory | None:
        """The memory of `strategy` (a new one the first time; None when not shared)."""
        if not self.shared:
            return None
        with self._lock:
            memory = self._memories.get(strategy)
            if memory is None:
                memory = self._memories[strategy] = RateMemory()
                while len(self._memories) > self.max_strategies:
                    self._memories.popitem(last=False)
            self._memories.move_to_end(strategy)
            return memory
