"""Drafting with a model: a separate small model, or the target's own layers (self-draft).

Both run a `DecoderLM` autoregressively with their own KV cache, kept in step with the
target's through rollbacks. The self-drafter runs a subset of the target's layers (early exit
or layer skipping) through the same final norm and LM head — no copy of the weights.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specfork.cache import KVCache
from specfork.config import SamplingParams
from specfork.drafters.base import Draft
from specfork.errors import ConfigError
from specfork.models.base import DecoderLM
from specfork.sampling import probabilities, sample


class ModelDrafter:
    """Proposes tokens by running `model` (all layers, or `layers`) one token at a time."""

    def __init__(
        self,
        model: DecoderLM,
        *,
        layers: Sequence[int] | None = None,
        name: str = "model",
        max_len: int = 512,
    ) -> None:
        n = model.config.num_layers
        if layers is not None:
            layers = sorted(set(layers))
            if not layers or layers[0] < 0 or layers[-1] >= n:
                raise ConfigError(f"draft layers must be a non-empty subset of 0-{n - 1}")
        self.model = model
        self.layers = layers
        self.name = name
        self.cache: KVCache = model.new_cache(max_len)

    def begin(self, prompt_ids: list[int]) -> None:
        self.cache.reset()
        self._ensure_room(len(prompt_ids) + 256)

    def _ensure_room(self, length: int) -> None:
        """Grow the cache (doubling, up to the model's context) when `length` would not fit.

        A grown cache starts empty; the next `propose` catches up on the whole history once.
        """
        limit = self.model.config.max_position
        if self.cache.max_len < min(length, limit):
            self.cache = self.model.new_cache(min(max(length, 2 * self.cache.max_len), limit))

    def propose(
        self, history: list[int], budget: int, sampling: SamplingParams, rng: torch.Generator
    ) -> Draft:
        """Catch up on the history not yet in the cache, then draft `budget` tokens."""
        self._ensure_room(len(history) + budget)
        budget = min(budget, self.cache.max_len - len(history))
        if budget < 1:
            return Draft(torch.empty(0, dtype=torch.long))
        if self.cache.length >= len(history):  # need the last token's logits again
            self.cache.truncate(len(history) - 1)
        logits = self.model.extend(history[self.cache.length :], self.cache, layers=self.layers)
        tokens: list[int] = []
        qs: list[torch.Tensor] = []
        for i in range(budget):
            if sampling.greedy:
                tokens.append(int(logits.argmax()))
            else:
                q = probabilities(logits, sampling)  # [V]
                qs.append(q)
                tokens.append(int(sample(q, rng)))
            if i + 1 < budget:
                logits = self.model.extend(tokens[-1:], self.cache, layers=self.layers)
        return Draft(
            tokens=torch.tensor(tokens, device=self.model.device),
            q=torch.stack(qs) if qs else None,  # [K, V]
            forwards=budget,
        )

    def propose_forks(
        self, history: list[int], forks: int, depth: int
    ) -> tuple[list[list[int]], list[list[float]], int]:
        """`forks` forks up to `depth` tokens deep, and each token's cumulative probability.

        Fork j starts with the drafter's j-th most likely next token and is continued greedily;
        every depth step runs all forks' tokens so far as one batch over the shared prefix cache
        (a mask keeps each fork to the prefix and its own tokens), then drops them from the
        cache again — never K copies of the prefix. Returns (paths, cumulative q, forwards).
        """
        self._ensure_room(len(history) + forks * depth + 1)
        if self.cache.length >= len(history):  # need the last token's logits again
            self.cache.truncate(len(history) - 1)
        logits = self.model.extend(history[self.cache.length :], self.cache, layers=self.layers)
        prefix = self.cache.length
        top = logits.float().softmax(-1).topk(forks)  # K best first tokens and their q
        paths = [[int(t)] for t in top.indices]
        probs = [[float(q)] for q in top.values]
        for _ in range(depth - 1):
            logits = self._fork_step(paths, prefix)  # [K, V]
            q = logits.float().softmax(-1).max(-1)  # greedy continuation of every fork
            for j, token in enumerate(q.indices.tolist()):
                paths[j].append(token)
                probs[j].append(probs[j][-1] * float(q.values[j]))
        return paths, probs, depth

    def _fork_step(self, paths: list[list[int]], prefix: int) -> torch.Tensor:
        """Logits [K, V] after each fork's last token (forks batched over the prefix cache)."""
        dev = self.model.device
        fork = torch.tensor([j for j, p in enumerate(paths) for _ in p], device=dev)  # [T]
        step = torch.tensor([i for p in paths for i in range(len(p))], device=dev)  # [T]
        tokens = torch.tensor([t for p in paths for t in p], device=dev)  # [T]
        mask = (fork[:, None] == fork[None, :]) & (step[None, :] <= step[:, None])  # [T, T]
        hidden = self.model(tokens[None], prefix + step, self.cache, mask=mask, layers=self.layers)
        self.cache.truncate(prefix)
        last = torch.tensor([sum(len(p) for p in paths[: j + 1]) - 1 for j in range(len(paths))])
        return self.model.logits(hidden[0, last.to(dev)])  # [K, V]

    def rollback(self, length: int) -> None:
        self.cache.truncate(min(self.cache.length, length))


def parse_layers(spec: str, num_layers: int) -> list[int]:
    """'0-11' / '0,2,4-7' → sorted layer indices, validated against the model's layer count."""
    if not isinstance(spec, str):
        raise ConfigError(f"a layer list must be a string such as 0-11, got {spec!r}")
    layers: set[int] = set()
    out_of_range = ConfigError(
        f"layers {spec!r} out of range; this model has layers 0-{num_layers - 1}"
    )
    try:
        for part in spec.split(","):
            lo, _, hi = part.strip().partition("-")
            first, last = int(lo), int(hi or lo)
            if first < 0 or last >= num_layers:  # checked before a huge range is built
                raise out_of_range
            layers.update(range(first, last + 1))
    except ValueError as exc:
        raise ConfigError(f"bad layer list {spec!r}; use e.g. 0-11 or 0,2,4-7") from exc
    if not layers:
        raise out_of_range
    return sorted(layers)
