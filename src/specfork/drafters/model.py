"""Drafting with a model: a separate small model, or the target's own layers (self-draft).

Both run a model (`TargetModel`) autoregressively with their own KV cache, kept in step with the
target's through rollbacks. The self-drafter runs a subset of the target's layers (early exit
or layer skipping) through the same final norm and LM head — no copy of the weights.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specfork.config import SamplingParams
from specfork.drafters.base import (
    EMPTY_DRAFT,
    Draft,
    DraftShape,
    Feedback,
    StepConfidence,
    chain_draft,
)
from specfork.errors import ConfigError
from specfork.kernels.sample_rows import fast_draw, fast_probabilities
from specfork.kv_cache import KVCache
from specfork.models.target import TargetModel
from specfork.sampling import argmax
from specfork.tree import Tree, TreeBuilder, path_to


class ModelDrafter:
    """Proposes tokens by running `model` (all layers, or `layers`) one token at a time."""

    def __init__(
        self,
        model: TargetModel,
        *,
        layers: Sequence[int] | None = None,
        name: str = "model",
        max_len: int = 512,
        cost: float | None = None,
    ) -> None:
        """`cost`: target forwards one drafting step costs (default: the share of `model`'s
        own weights that `layers` run, right for self-drafting)."""
        n = model.config.num_layers
        if layers is not None:
            layers = sorted(set(layers))
            if not layers or layers[0] < 0 or layers[-1] >= n:
                raise ConfigError(f"draft layers must be a non-empty subset of 0-{n - 1}")
        self.model = model
        self.layers = layers
        self.name = name
        self.wants_logits = False
        self.hidden_layers: tuple[int, ...] = ()
        self.max_len = max_len
        self.cache: KVCache | None = None  # this drafter's own KV cache, made on first use
        self.cost = step_weights(model, layers) / step_weights(model) if cost is None else cost

    def begin(self, prompt_ids: list[int]) -> ModelDrafter:
        """A drafter for one request: the same model and layers, a KV cache of its own."""
        session = ModelDrafter(
            self.model, layers=self.layers, name=self.name, max_len=self.max_len, cost=self.cost
        )
        session._ensure_room(len(prompt_ids) + 256)
        return session

    def _ensure_room(self, length: int) -> None:
        """Make or grow the cache (doubling, up to the model's context) when `length` would
        not fit. A grown cache starts empty; the next `propose` catches up on the history."""
        limit = self.model.config.max_position
        size = 0 if self.cache is None else self.cache.max_len
        if size < min(length, limit):
            grown = max(length, 2 * size, self.max_len)
            self.cache = self.model.new_cache(min(grown, limit))

    def propose(
        self, history: list[int], shape: DraftShape, sampling: SamplingParams, rng: torch.Generator
    ) -> Draft:
        """A chain, or for a tree shape greedy forks / an EAGLE-2 tree (`propose_forks`,
        `propose_dynamic`) up to `shape.model_depth` deep, scored by cumulative draft q."""
        depth = shape.depth if shape.model_depth is None else min(shape.depth, shape.model_depth)
        if depth < 1:
            return EMPTY_DRAFT
        if shape.kind == "chain":
            return self._chain(history, depth, sampling, rng, shape.confidence)
        if shape.kind == "dynamic":
            tree, scores, n = self.propose_dynamic(history, shape.forks, depth)
        else:
            paths, probs, n = self.propose_forks(history, shape.forks, depth)
            builder = TreeBuilder()
            nodes = [node for path in paths for node in builder.add_path(path)]
            best = dict.fromkeys(nodes, 0.0)  # node -> best cumulative q (merged prefixes)
            for node, prob in zip(nodes, (q for qs in probs for q in qs), strict=True):
                best[node] = max(best[node], prob)
            tree, scores = builder.build(), [best[i] for i in range(len(best))]
        prior = torch.tensor(scores, dtype=torch.float64)  # [N]
        return Draft(tree, None, prior, n, self.name)

    def _chain(
        self,
        history: list[int],
        budget: int,
        sampling: SamplingParams,
        rng: torch.Generator,
        confidence: StepConfidence | None = None,
    ) -> Draft:
        """Catch up on the history not yet in the cache, then draft `budget` tokens (fewer
        where `confidence`, DSpark's rule on the draft's own distribution, stops it)."""
        self._ensure_room(len(history) + budget)
        assert self.cache is not None
        budget = min(budget, self.cache.max_len - len(history))
        if budget < 1:
            return EMPTY_DRAFT
        if self.cache.length >= len(history):  # need the last token's logits again
            self.cache.truncate(len(history) - 1)
        logits = self.model.extend(history[self.cache.length :], self.cache, layers=self.layers)
        forwards = 1
        tokens: list[int] = []
        qs: list[torch.Tensor] = []
        for i in range(budget):
            q = None if sampling.greedy else fast_probabilities(logits, sampling)  # [V]
            if confidence is not None and not confidence.allows(
                logits.float().softmax(-1) if q is None else q
            ):
                break
            if q is None:
                tokens.append(int(argmax(logits)))
            else:
                qs.append(q)
                tokens.append(fast_draw(q, sampling, rng, len(history) + i))
            if i + 1 < budget:
                logits = self.model.extend(tokens[-1:], self.cache, layers=self.layers)
                forwards += 1
        if not tokens:
            return Draft(EMPTY_DRAFT.tree, None, None, forwards, self.name)
        q = torch.stack(qs) if qs else None  # [K, V]
        return chain_draft(torch.tensor(tokens), q, forwards=forwards, source=self.name)

    def propose_forks(
        self, history: list[int], forks: int, depth: int
    ) -> tuple[list[list[int]], list[list[float]], int]:
        """`forks` forks up to `depth` tokens deep, and each token's cumulative probability.

        Fork j starts with the drafter's j-th most likely next token and is continued greedily;
        every depth step runs all forks' tokens so far as one batch over the shared prefix cache
        (a mask keeps each fork to the prefix and its own tokens), then drops them from the
        cache again — never K copies of the prefix. Returns (paths, cumulative q, forwards).
        """
        logits, prefix = self._catch_up(history, forks * depth)
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

    def propose_dynamic(
        self, history: list[int], branch: int, depth: int
    ) -> tuple[Tree, list[float], int]:
        """An EAGLE-2 tree up to `depth` deep, and each node's cumulative probability.

        Depth 1 holds the drafter's `branch` most likely next tokens. At each further depth the
        `branch` nodes of the newest level with the highest cumulative probability (the
        frontier) are expanded with their `branch` most likely children, all frontier paths
        drafted as one batch over the shared prefix cache: uncertain positions spread the
        frontier over several parents (breadth), confident ones keep extending one (depth).
        Every expanded child stays in the tree; the caller keeps the best nodes within its
        budget (a child never scores above its parent). Returns (tree, scores, forwards).
        """
        logits, prefix = self._catch_up(history, branch * depth)
        builder = TreeBuilder()
        scores: list[float] = []  # node -> cumulative q along its path
        top = logits.float().softmax(-1).topk(branch)  # [branch]
        level = [builder.add(-1, int(t)) for t in top.indices]
        scores.extend(float(q) for q in top.values)
        for _ in range(depth - 1):
            frontier = sorted(level, key=lambda n: -scores[n])[:branch]
            tree = builder.build()
            paths = [[int(tree.tokens[i]) for i in path_to(tree, n)] for n in frontier]
            top = self._fork_step(paths, prefix).float().softmax(-1).topk(branch)  # [F, branch]
            level = []
            for parent, tokens, qs in zip(frontier, top.indices, top.values, strict=True):
                for token, q in zip(tokens.tolist(), qs.tolist(), strict=True):
                    level.append(builder.add(parent, token))
                    scores.append(scores[parent] * q)
        return builder.build(), scores, depth

    def _catch_up(self, history: list[int], new_rows: int) -> tuple[torch.Tensor, int]:
        """Run the history not yet cached; the logits [V] after its last token, prefix length."""
        self._ensure_room(len(history) + new_rows + 1)
        assert self.cache is not None
        if self.cache.length >= len(history):  # need the last token's logits again
            self.cache.truncate(len(history) - 1)
        logits = self.model.extend(history[self.cache.length :], self.cache, layers=self.layers)
        return logits, self.cache.length

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

    def observe(self, feedback: Feedback) -> None:
        """Forget the cached draft past what the round committed; all of the round's draft
        when the round verified another source's tokens (from its root on: re-run later)."""
        if self.cache is None:
            return
        kept = feedback.committed
        if not feedback.own and not feedback.prompt:
            kept -= len(feedback.kept_rows)
        self.cache.truncate(max(0, min(self.cache.length, kept)))


def step_weights(model: TargetModel, layers: Sequence[int] | None = None) -> int:
    """Weights one token's forward multiplies by (see `TargetModel.step_weights`)."""
    return model.step_weights(layers)


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
            if first > last:
                part = part.strip()
                raise ConfigError(f"layer range {part!r} runs backwards: write {last}-{first}")
            layers.update(range(first, last + 1))
    except ValueError as exc:
        raise ConfigError(f"bad layer list {spec!r}; use e.g. 0-11 or 0,2,4-7") from exc
    if not layers:
        raise out_of_range
    return sorted(layers)
