"""Drafting with a trained head over the target's own features (`specfork.heads`).

The drafter asks the engine for the target's feature blocks (`hidden_layers`): every
verification forward and every prompt chunk hands them over in `Feedback.hidden`, so the head
never runs the target. Its own KV cache holds one row per committed position, filled teacher-
forced from those features; each round it catches up on the newly committed positions (one
small forward), then grows a chain or a tree, each node's row fed the head's output at its
parent. Draft rows are dropped from the cache after the proposal. The head's logits cover a
reduced draft vocabulary; `d2t` places them in the target's (other tokens get probability 0, so a
sampled q stays a true distribution and verification stays lossless). A greedy chain on the
kernels (`KernelHead.chain`) is one call: the same steps without a Python round trip each.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from specfork.config import SamplingParams
from specfork.drafters.base import EMPTY_DRAFT, Draft, DraftShape, Feedback, StepConfidence
from specfork.drafters.meter import CostMeter
from specfork.heads.fast import KernelHead
from specfork.heads.model import DraftHead
from specfork.kernels.sample_rows import fast_draw, fast_probabilities
from specfork.models.target import TargetModel
from specfork.tree import Tree


@dataclass
class _Grown:
    """The nodes drafted this round: parent, token, depth, cache slot and output per node;
    `root` is the head's output at the last committed position (the parent of depth 1)."""

    root: torch.Tensor
    prefix: int  # cache slots of committed positions; draft rows follow
    slot: dict[int, int] = field(default_factory=dict)
    parent: list[int] = field(default_factory=list)
    token: list[int] = field(default_factory=list)
    depth: list[int] = field(default_factory=list)
    score: list[float] = field(default_factory=list)
    outputs: list[torch.Tensor] = field(default_factory=list)  # g [D] per node

    def ancestors(self, node: int) -> list[int]:
        path = []
        while node >= 0:
            path.append(node)
            node = self.parent[node]
        return path

    def tree(self) -> Tree:
        return Tree(self.token, self.parent)


class HeadDrafter:
    """Proposes chains and trees with a `DraftHead` over the target `model`'s features."""

    def __init__(
        self,
        head: DraftHead | KernelHead,
        model: TargetModel,
        name: str = "head",
        cost: float | None = None,
        meter: CostMeter | None = None,
    ) -> None:
        """`cost`: target forwards per drafted token (default: by weights); `meter`, when
        given, measures it from the proposals instead (shared by every request's drafter)."""
        self.head = head
        self.model = model  # for its input embeddings only
        self.device = model.device  # the head runs where the target's features are
        self.name = name
        self.wants_logits = False
        self.hidden_layers: tuple[int, ...] = tuple(head.config.feature_layers)
        self.static_cost = self.weights_cost(head, model) if cost is None else cost
        self.meter = meter
        d = head.config.hidden_size
        dev = self.device
        self.features = torch.zeros(0, len(self.hidden_layers) * d, device=dev)  # [pos, C·D]
        self.known = 0  # positions whose features arrived
        c = head.config
        self.keys = torch.zeros(1, c.num_kv_heads, 0, c.head_dim, device=dev)  # [1, Hkv, S, hd]
        self.values = torch.zeros_like(self.keys)
        self.cached = 0  # positions in the head's cache (teacher forced)

    @staticmethod
    def weights_cost(head: DraftHead | KernelHead, model: TargetModel) -> float:
        """Target forwards one head step costs, by weights multiplied."""
        return head.weight_count / model.step_weights()

    @property
    def cost(self) -> float:
        """Target forwards one drafted token costs: measured when there is a meter."""
        return self.meter.cost if self.meter is not None else self.static_cost

    def begin(self, prompt_ids: list[int]) -> HeadDrafter:
        """A drafter of its own for one request (features and cache), sharing the head and the
        meter."""
        return HeadDrafter(self.head, self.model, self.name, self.static_cost, self.meter)

    # -- learning what the target computed --------------------------------------------------------
    def observe(self, feedback: Feedback) -> None:
        """Keep the features of the rows that became history; forget everything past
        `committed`."""
        self.known = min(self.known, feedback.committed)
        self.cached = min(self.cached, feedback.committed)
        if feedback.hidden is None:
            return
        kept = feedback.kept_rows
        first = feedback.committed - len(kept)
        states = feedback.hidden[:, kept].float()  # [C, R, D]
        self._grow_features(feedback.committed)
        self.features[first : feedback.committed] = states.permute(1, 0, 2).flatten(1)  # [R, CD]
        if first <= self.known:  # no gap: every position up to `committed` is known
            self.known = feedback.committed
        self.cached = min(self.cached, first)

    def _grow_features(self, length: int) -> None:
        size, width = self.features.shape
        if size < length:
            grown = torch.zeros(max(length, 2 * size, 256), width, device=self.device)  # [P, CD]
            grown[:size] = self.features
            self.features = grown

    # -- proposing ---------------------------------------------------------------------------------
    def propose(
        self, history: list[int], shape: DraftShape, sampling: SamplingParams, rng: torch.Generator
    ) -> Draft:
        """A chain, K greedy forks, or an EAGLE-2 dynamic tree (by `shape.kind`), scored by
        the head's cumulative probabilities."""
        depth = shape.depth if shape.model_depth is None else min(shape.depth, shape.model_depth)
        if depth < 1 or self.known < len(history) - 1:
            return EMPTY_DRAFT  # the target's features of the history are not all here
        return self._drafted(
            history, lambda grown: self._grow(grown, shape, depth, sampling, rng, len(history))
        )

    def _drafted(self, history: list[int], grow: Callable[[_Grown], torch.Tensor | None]) -> Draft:
        """The draft `grow` makes below the head's output at the end of `history` (it returns
        the nodes' q [N, V] or None), its drafting timed by the meter; the draft rows leave
        the head's cache afterwards."""
        with torch.inference_mode():
            grown = _Grown(self._catch_up(history), self.cached)
            start = self.meter.clock() if self.meter is not None else 0.0  # drafting only
            try:
                q = grow(grown)
            finally:
                self.cached = grown.prefix  # the draft rows leave the cache
        if self.meter is not None:
            self.meter.observe(self.meter.clock() - start, len(grown.token))
        if not grown.token:
            return EMPTY_DRAFT
        scores = torch.tensor(grown.score, dtype=torch.float64)  # [N]
        return Draft(grown.tree(), q, scores, max(grown.depth), self.name)

    def _grow(
        self,
        grown: _Grown,
        shape: DraftShape,
        depth: int,
        sampling: SamplingParams,
        rng: torch.Generator,
        start: int,
    ) -> torch.Tensor | None:
        """Grow `grown` within the shape (its first token at sequence position `start`); the
        q [N, V] of a sampled chain (else None)."""
        if shape.kind == "chain" and self._chains(sampling):
            self._fast_chain(grown, [], 0.0, depth, shape.confidence)
            return None
        logits = self.head.logits(grown.root[None])  # [1, Vd]
        if shape.kind == "chain":
            return self._chain(grown, logits, depth, sampling, rng, shape.confidence, start)
        branch = max(1, shape.forks)
        frontier = self._add(grown, [-1], logits, branch)
        for _ in range(depth - 1):
            if shape.kind == "dynamic":
                frontier = sorted(frontier, key=lambda n: -grown.score[n])[:branch]
                logits = self._expand(grown, frontier)
                frontier = self._add(grown, frontier, logits, branch)
            else:  # forks: every fork continues greedily
                logits = self._expand(grown, frontier)
                frontier = self._add(grown, frontier, logits, 1)
        return None

    def _chain(
        self,
        grown: _Grown,
        logits: torch.Tensor,
        depth: int,
        sampling: SamplingParams,
        rng: torch.Generator,
        confidence: StepConfidence | None,
        start: int,
        node: int = -1,
    ) -> torch.Tensor | None:
        """A chain of at most `depth` tokens below `node` (-1: the root; `logits` are the
        head's at it) from sequence position `start`, stopped where `confidence` says so
        (DSpark)."""
        qs = []
        for i in range(depth):
            q = None if sampling.greedy else self._target_probs(logits, sampling)  # [V]
            if confidence is not None:
                probs = q if q is not None else logits[0].softmax(-1)  # [V] or [Vd]
                if not confidence.allows(probs):
                    break
            if q is None:
                node = self._add(grown, [node], logits, 1)[0]
            else:
                qs.append(q)  # [V]
                token = fast_draw(q, sampling, rng, start + i)
                score = (grown.score[node] if node >= 0 else 1.0) * float(q[token])
                node = self._push(grown, node, token, score)
            if i + 1 < depth:
                logits = self._expand(grown, [node])
        return torch.stack(qs) if qs else None

    # -- checking another source's chain (a cascade's second stage) -----------------------------
    def check(
        self,
        history: list[int],
        tokens: list[int],
        shape: DraftShape,
        sampling: SamplingParams,
        rng: torch.Generator,
        keep: float,
    ) -> Draft | None:
        """`tokens`, a chain another source proposed after `history`, kept while the head gives
        each token at least `keep` times the probability of its own most likely token (an
        unsure head keeps what it is given; one sure of another token cuts), cut before the
        first it does not, then extended by the head's own chain (`shape.confidence` may stop
        it; at most `shape.model_depth` tokens) up to `shape.depth` tokens in all. A kept
        token was chosen by a deterministic rule, so its q is one-hot; an extension token's q
        is the head's. None when the head lacks the target's features of the history (it
        cannot check)."""
        if self.known < len(history) - 1:
            return None
        most = shape.depth if shape.model_depth is None else shape.model_depth  # head's own
        depth = min(shape.depth, len(tokens) + most)
        if depth < 1:
            return EMPTY_DRAFT
        return self._drafted(
            history,
            lambda grown: self._check_and_extend(
                grown, tokens, depth, shape, sampling, rng, keep, history
            ),
        )

    def _check_and_extend(
        self,
        grown: _Grown,
        tokens: list[int],
        depth: int,
        shape: DraftShape,
        sampling: SamplingParams,
        rng: torch.Generator,
        keep: float,
        history: list[int],
    ) -> torch.Tensor | None:
        """Grow `grown` as `check` says; the q [N, V] of the chain when its extension was
        sampled (the kept tokens' rows one-hot), else None."""
        forced = self._draft_ids(tokens[:depth], keep) if self._chains(sampling) else None
        if forced is not None:
            self._fast_chain(grown, forced, keep, depth, shape.confidence)
            return None
        logits = self.head.logits(grown.root[None])  # [1, Vd]
        node = -1
        for i, token in enumerate(tokens[:depth]):
            probs = self._target_probs(logits, sampling)  # [V]
            p = float(probs[token])
            if p < keep * float(probs.max()):
                break
            node = self._push(grown, node, token, (grown.score[node] if node >= 0 else 1.0) * p)
            if i + 1 < depth:
                logits = self._expand(grown, [node])
        kept = len(grown.token)
        extension = depth - kept  # within the head's own share (`check` bounded depth)
        if extension < 1:
            return None
        at = len(history) + kept  # the extension's first sequence position
        q = self._chain(grown, logits, extension, sampling, rng, shape.confidence, at, node)
        if q is None:
            return None
        one_hot = torch.zeros(kept, q.shape[-1], device=q.device)  # [kept, V]
        one_hot[torch.arange(kept), torch.tensor(grown.token[:kept])] = 1.0
        return torch.cat([one_hot, q])  # [N, V]

    def _chains(self, sampling: SamplingParams) -> bool:
        """Whether a greedy chain runs as one kernel call (`KernelHead.chain`)."""
        return sampling.greedy and isinstance(self.head, KernelHead) and self.head.chains

    def _draft_ids(self, tokens: list[int], keep: float) -> list[int] | None:
        """`tokens` as draft-vocabulary ids, up to the first outside it (which `keep` > 0 cuts:
        the head gives it probability 0); None when keep <= 0 would keep one (the kernel's
        chain cannot embed it)."""
        assert isinstance(self.head, KernelHead)  # asked only where `_chains` holds
        ids = self.head.t2d[torch.tensor(tokens, dtype=torch.int64)].tolist()
        if -1 not in ids:
            return ids
        return ids[: ids.index(-1)] if keep > 0 else None

    def _fast_chain(
        self,
        grown: _Grown,
        forced: list[int],
        keep: float,
        depth: int,
        confidence: StepConfidence | None,
    ) -> None:
        """A greedy chain below the root in one kernel call: the `forced` draft ids kept while
        the head gives each `keep` times its favourite's probability, then its own argmax (see
        `KernelHead.chain`); the nodes go to `grown`."""
        assert isinstance(self.head, KernelHead)
        self._ensure_slots(grown.prefix + depth)
        rule = confidence.coefficients() if confidence is not None else ()
        ids, probs = self.head.chain(
            grown.root,
            torch.tensor(forced, dtype=torch.int64),
            keep,
            depth,
            rule,
            (self.keys, self.values),
            grown.prefix,
        )  # [n], [n]
        node = -1
        for token, p in zip(self.head.d2t[ids].tolist(), probs.tolist(), strict=True):
            node = self._push(grown, node, token, (grown.score[node] if node >= 0 else 1.0) * p)

    def _target_probs(self, logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
        """The head's distribution [V] over the target's vocabulary from draft logits [1, Vd]
        (after the request's sampling transforms when it samples)."""
        full = self._to_target(logits)[0]  # [V]
        return full.softmax(-1) if sampling.greedy else fast_probabilities(full, sampling)

    def _add(self, grown: _Grown, parents: list[int], logits: torch.Tensor, k: int) -> list[int]:
        """Each parent's k most likely children (draft logits [P, Vd]); the new nodes."""
        top = logits.softmax(-1).topk(min(k, logits.shape[-1]), dim=-1)  # [P, k]
        tokens = self.head.d2t[top.indices]  # [P, k] target ids
        nodes = []
        rows = zip(parents, tokens.tolist(), top.values.tolist(), strict=True)
        for parent, tokens, qs in rows:
            base = grown.score[parent] if parent >= 0 else 1.0
            for token, q in zip(tokens, qs, strict=True):
                nodes.append(self._push(grown, parent, token, base * q))
        return nodes

    @staticmethod
    def _push(grown: _Grown, parent: int, token: int, score: float) -> int:
        grown.parent.append(parent)
        grown.token.append(token)
        grown.depth.append(1 if parent < 0 else grown.depth[parent] + 1)
        grown.score.append(score)
        grown.outputs.append(torch.empty(0))  # filled when the node is expanded
        return len(grown.token) - 1

    # -- the head's forwards ----------------------------------------------------------------
    def _catch_up(self, history: list[int]) -> torch.Tensor:
        """Run the head teacher-forced over the committed positions it has not cached (at
        least the last); returns its output g [D] at the last one."""
        last = len(history) - 2  # the last position the target ran (history[-1] is the root)
        start = min(self.cached, max(last, 0))
        ids = torch.tensor(history[start + 1 : last + 2], device=self.device)  # [T] next tokens
        embeds = self.model.embed_rows(ids).to(self.head.dtype)  # [T, D]
        feats = self.head.fuse(self.features[start : last + 1])  # [T, D]
        positions = torch.arange(start, last + 1, device=self.device)  # [T]
        g = self._rows(embeds, feats, positions, start, None)  # [T, D]
        self.cached = last + 1
        return g[-1]

    def _expand(self, grown: _Grown, nodes: list[int]) -> torch.Tensor:
        """Run the rows of `nodes` (fed their parents' outputs); their draft logits [N, Vd]."""
        parents = [grown.parent[n] for n in nodes]
        feats = torch.stack([grown.root if p < 0 else grown.outputs[p] for p in parents])  # [N, D]
        tokens = torch.tensor([grown.token[n] for n in nodes], device=self.device)  # [N]
        embeds = self.model.embed_rows(tokens)
        embeds = embeds.to(self.head.dtype)  # [N, D]
        prefix, start = grown.prefix, self.cached
        at = [prefix + grown.depth[n] - 1 for n in nodes]  # each node's sequence position
        positions = torch.tensor(at, device=self.device)  # [N]
        grown.slot.update({n: start + i for i, n in enumerate(nodes)})
        mask = torch.zeros(len(nodes), start + len(nodes), dtype=torch.bool)  # [N, S]
        mask[:, :prefix] = True  # the committed positions
        seen = [(row, grown.slot[a]) for row, n in enumerate(nodes) for a in grown.ancestors(n)]
        rows, slots = zip(*seen, strict=True)  # each node sees itself and its drafted ancestors
        mask[list(rows), list(slots)] = True  # one indexed write, not one per element
        mask = mask.to(self.device)  # built on the host: one copy, not one per element
        g = self._rows(embeds, feats, positions, start, mask)  # [N, D]
        self.cached = start + len(nodes)
        for row, n in enumerate(nodes):
            grown.outputs[n] = g[row]
        return self.head.logits(g)  # [N, Vd]

    def _rows(
        self,
        embeds: torch.Tensor,
        feats: torch.Tensor,
        positions: torch.Tensor,
        start: int,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """Rows (embeds, feats [T, D]) written to cache slots [start, start + T); outputs
        g [T, D]. `mask` [T, S] (None: causal over the cache)."""
        self._ensure_slots(start + len(positions))
        return self.head.rows(embeds, feats, positions, (self.keys, self.values), start, mask)

    def _ensure_slots(self, length: int) -> None:
        size = self.keys.shape[2]
        if size < length:
            grown = max(length, 2 * size, 256)
            shape = (*self.keys.shape[:2], grown, self.keys.shape[3])
            keys = self.keys.new_zeros(shape)  # [1, Hkv, S, hd]
            values = self.values.new_zeros(shape)
            keys[:, :, :size], values[:, :, :size] = self.keys, self.values
            self.keys, self.values = keys, values

    def _to_target(self, draft: torch.Tensor) -> torch.Tensor:
        """Draft logits [N, Vd] placed in the target's vocabulary [N, V] (-inf elsewhere)."""
        shape = (draft.shape[0], self.head.config.target_vocab)
        full = torch.full(shape, float("-inf"), device=draft.device)  # [N, V]
        full[:, self.head.d2t] = draft
        return full
