"""FastLM: a decoder whose whole forward runs in specfork's compiled CPU kernels.

It computes what `DecoderLM` computes (same interface: `forward(tokens, positions, cache,
mask=None, layers=None)`, `logits`, `extend`, `new_cache`) in one call per forward, over weights
packed for the kernels: a GGUF's own Q4-Q8 blocks (the K-quants included) (precision "gguf":
int8 activations, as llama.cpp computes), or bf16 / fp32 weights. Every kernel is batch-invariant:
a row's logits do not depend on the other rows of its forward, so plain decoding, a verified
chain and a verified tree give a token bitwise the same logits (csrc/common.h).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType

import torch

from specfork.config import ModelConfig
from specfork.kv_cache import KVCache
from specfork.models.base import DecoderLM, Segment, Steps
from specfork.models.layers import rope_inv_freq
from specfork.threads import Threads, ThreadUse

log = logging.getLogger(__name__)

#: KV cache dtype per precision (fp16 keys/values like llama.cpp for GGUF weights).
CACHE_DTYPES = {"gguf": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass(frozen=True)
class LayerWeights:
    """One block's packed weights (lists: parts whose outputs are concatenated) and norms."""

    qkv: list
    o: list
    gate_up: list
    down: list
    norms: dict[str, torch.Tensor]  # float32 multipliers (Gemma's 1 + w already applied)


class FastLM(Steps):
    """A decoder run by the compiled kernels; build it with `from_decoder` or `from_layers`."""

    def __init__(
        self,
        kernels: ModuleType,
        core: object,
        cfg: ModelConfig,
        precision: str,
        weights: dict[str, int],
        detail: str = "",
    ) -> None:
        self.kernels = kernels
        self.core = core  # csrc/model.cpp FastModel
        self.config = cfg
        self.precision = precision
        self.detail = detail  # e.g. the GGUF block types
        self._weights = weights  # weights per layer and of the LM head (for step_weights)
        self._adaptive = False  # whether the kernels' pool backs off while the cores are busy

    precision: str  # gguf, bfloat16 or float32
    #: a row's logits never depend on the other rows of its forward (csrc/common.h)
    batch_invariant = True
    #: the kernels run on their own thread pool, from whichever thread calls them
    bound_to_loading_thread = False

    def describe(self) -> str:
        """Precision, device and backend, as outputs and benchmark rows state them."""
        detail = f" {self.detail}" if self.detail else ""
        return f"{self.precision}{detail}, cpu, kernels {self.kernels.isa()}"

    def set_threads(self, threads: Threads) -> None:
        """Compute with `threads` in the kernels' pool, which runs fewer while other jobs keep
        the cores busy when the setting is adaptive; PyTorch's own operators (sampling and
        drafting bookkeeping on this path: small) run on one thread, because a second pool
        spinning on the same cores slowed SPORK by 10-30% and made the kernels' pool back off
        (both settings process-wide; `specfork.threads.torch_threads` lends PyTorch more)."""
        torch.set_num_threads(1)
        self.kernels.set_threads(threads.count, threads.adaptive)
        self._adaptive = threads.adaptive

    def thread_use(self) -> ThreadUse:
        """The kernels' thread pool counters now (kernels/csrc/pool.h)."""
        regions, reduced, windows, busy = self.kernels.thread_counts()
        return ThreadUse(self.kernels.threads(), self._adaptive, regions, reduced, windows, busy)

    # -- the model interface ----------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def dtype(self) -> torch.dtype:
        """The KV cache's dtype (activations are float32 inside the kernels)."""
        return CACHE_DTYPES[self.precision]

    def __call__(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        mask: torch.Tensor | None = None,
        layers: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """Hidden states [1, T, D] (float32) of tokens [1, T] at positions [T]."""
        return self.forward_capturing(tokens, positions, cache, mask, layers)[0]

    forward = __call__

    def forward_capturing(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        mask: torch.Tensor | None = None,
        layers: Sequence[int] | None = None,
        capture: Sequence[int] = (),
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`forward`, and the outputs [C, T, D] of the blocks in `capture` (None if none)."""
        if tokens.dim() != 2 or tokens.shape[0] != 1:
            raise ValueError(f"FastLM runs one sequence: tokens [1, T], not {tuple(tokens.shape)}")
        if mask is not None and mask.dim() != 2:
            raise ValueError("FastLM takes a [T, T] mask")
        run = range(self.config.num_layers) if layers is None else layers
        if any(i not in run for i in capture):
            raise ValueError(f"captured layers {list(capture)} must be among those run")
        captured = None
        if capture:
            t, d = tokens.shape[1], self.config.hidden_size
            captured = torch.empty(len(capture), t, d, dtype=torch.float32)  # [C, T, D]
        start = cache.reserve(positions)
        hidden = self.core.forward(
            tokens[0],
            positions,
            mask,
            cache.k,
            cache.v,
            cache.positions,
            start,
            None if layers is None else list(layers),
            list(capture),
            captured,
        )
        cache.commit_pending()
        return hidden[None], captured  # [1, T, D], [C, T, D]

    def forward_batch(
        self, segments: Sequence[Segment], capture: Sequence[int] = ()
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Several sequences in one forward of the kernels: the linear layers run once over
        all rows, each segment's rows attend to their own cache. Hidden states [T, D] (segment
        order) and the outputs [C, T, D] of the blocks in `capture` (None if none); each row
        bitwise what its sequence gets alone (the kernels are batch-invariant)."""
        if not segments:
            raise ValueError("forward_batch needs at least one segment")
        if len(segments) != len({id(s.cache) for s in segments}):
            raise ValueError("two segments of a batch share a cache")
        if len(segments) == 1:  # (a lone request's round: nothing to pack)
            tokens, positions = segments[0].tokens, segments[0].positions  # [T], [T]
        else:
            tokens = torch.cat([s.tokens for s in segments])  # [T]
            positions = torch.cat([s.positions for s in segments])  # [T]
        captured = None
        if capture:
            captured = torch.empty(len(capture), len(tokens), self.config.hidden_size)  # [C, T, D]
        starts = [s.cache.reserve(s.positions) for s in segments]
        no_mask = torch.empty(0, dtype=torch.bool)
        try:
            hidden = self.core.forward_batch(
                tokens,
                positions,
                [len(s.tokens) for s in segments],
                [no_mask if s.mask is None else s.mask for s in segments],
                [s.cache.k for s in segments],
                [s.cache.v for s in segments],
                [s.cache.positions for s in segments],
                starts,
                None,
                list(capture),
                captured,
            )
        except BaseException:
            for s in segments:
                s.cache.drop_pending()
            raise
        for s in segments:
            s.cache.commit_pending()
        return hidden, captured  # [T, D], [C, T, D]

    def embed_rows(self, tokens: torch.Tensor) -> torch.Tensor:
        """Input embeddings [T, D] (float32) of tokens [T], as the forward's first step."""
        return self.core.embed_tokens(tokens)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM head: hidden [..., D] → float32 logits [..., V]."""
        shape = hidden.shape[:-1]
        return self.core.logits(hidden.reshape(-1, hidden.shape[-1])).view(*shape, -1)

    def new_cache(self, max_len: int, batch: int = 1) -> KVCache:
        c = self.config
        if batch != 1:
            raise ValueError("FastLM caches hold one sequence")
        return KVCache(c.num_layers, c.num_kv_heads, c.head_dim, max_len, dtype=self.dtype)

    def step_weights(self, layers: Sequence[int] | None = None) -> int:
        blocks = range(self.config.num_layers) if layers is None else layers
        return sum(self._weights["layer"] for _ in blocks) + self._weights["head"]

    # -- building -------------------------------------------------------------------------------
    @classmethod
    def from_layers(
        cls,
        kernels: ModuleType,
        cfg: ModelConfig,
        precision: str,
        embedding: object,
        head: list,
        final_norm: torch.Tensor,
        layers: list[LayerWeights],
        detail: str = "",
    ) -> FastLM:
        """Assemble packed weights (kernels.Packed objects) into a model."""
        scalar = cfg.query_pre_attn_scalar or cfg.head_dim
        core = kernels.FastModel(
            cfg.hidden_size,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.intermediate_size,
            cfg.rms_eps,
            cfg.hidden_act == "gelu_tanh",
            cfg.embedding_scale,
            cfg.sliding_window or -1,
            scalar**-0.5,
            cfg.final_logit_softcapping or 0.0,
        )
        inv_freq, scaling = rope_inv_freq(cfg.rope, cfg.head_dim)
        core.set_rope("full", inv_freq, scaling)
        if cfg.rope_local is not None:
            inv_freq, scaling = rope_inv_freq(cfg.rope_local, cfg.head_dim)
            core.set_rope("sliding", inv_freq, scaling)
        core.set_embedding(embedding)
        core.set_head(head, final_norm.float())
        for i, lw in enumerate(layers):
            sliding = cfg.layer_type(i) == "sliding"
            core.add_layer(lw.qkv, lw.o, lw.gate_up, lw.down, lw.norms, sliding)
        per_layer = sum(
            p.n * p.k for p in (*layers[0].qkv, *layers[0].o, *layers[0].gate_up, *layers[0].down)
        )
        weights = {"layer": per_layer, "head": sum(p.n * p.k for p in head)}
        return cls(kernels, core, cfg, precision, weights, detail)

    @classmethod
    def from_decoder(cls, kernels: ModuleType, model: DecoderLM, precision: str) -> FastLM:
        """The kernels' model of an eager one, weights packed as bf16 or fp32."""
        from specfork.kernels.pack import Kind, pack_float

        kind = Kind.BF16 if precision == "bfloat16" else Kind.F32

        def packed(linear: torch.nn.Linear) -> object:
            w = linear.weight.detach()
            bias = None if linear.bias is None else linear.bias.detach().float()
            return kernels.Packed(int(kind), w.shape[0], w.shape[1], pack_float(w, kind), bias)

        def norm(module: torch.nn.Module | None) -> torch.Tensor | None:
            if module is None:
                return None
            w = module.weight.detach().float()
            return 1.0 + w if module.unit_offset else w

        cfg = model.config
        layers = []
        for block in model.blocks:
            names = ("attn_norm", "post_attn_norm", "mlp_norm", "post_mlp_norm")
            norms = {n: norm(getattr(block, n, None)) for n in names}
            norms.update(q_norm=norm(block.attn.q_norm), k_norm=norm(block.attn.k_norm))
            layers.append(
                LayerWeights(
                    [packed(block.attn.qkv)],
                    [packed(block.attn.o)],
                    [packed(block.mlp.gate_up)],
                    [packed(block.mlp.down)],
                    {k: v for k, v in norms.items() if v is not None},
                )
            )
        head = packed(model.lm_head)
        if cfg.tie_embeddings:
            embedding = head
        else:
            table = model.embed_tokens.weight.detach()
            embedding = kernels.Packed(
                int(kind), table.shape[0], table.shape[1], pack_float(table, kind), None
            )
        return cls.from_layers(kernels, cfg, precision, embedding, [head], norm(model.norm), layers)


def fits_kernels(cfg: ModelConfig) -> str | None:
    """Why `cfg` cannot run on the kernels, or None if it can."""
    sizes = (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim)
    if any(s % 32 for s in sizes):
        return "hidden, FFN and attention sizes must be multiples of 32"
    return None
