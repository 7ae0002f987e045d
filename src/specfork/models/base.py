"""The decoder skeleton every family shares: embed → blocks → final norm, LM head apart.

`forward(tokens, positions, cache, mask=None, layers=None)` returns final-normed hidden states;
`logits(hidden)` applies the LM head. Positions and the attention mask are explicit arguments:
`mask` is a boolean [T, T] (or [B, T, T]) saying which of the T new tokens each new token may
see — a tree verifier passes its tree mask; `None` means causal. Every new token sees the whole
cached prefix (within the sliding window on sliding layers).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

from specfork.config import ModelConfig
from specfork.kv_cache import KVCache
from specfork.models import cost_cache
from specfork.models.cost import CostCurve
from specfork.models.layers import Linear, PackedRows, RMSNorm, Rotary
from specfork.threads import Threads, ThreadUse, apply_torch

if TYPE_CHECKING:
    from specfork.models.target import TargetModel

log = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class Segment:
    """One sequence's rows in a batched forward: tokens [T] at positions [T], appended to its
    own cache (from `cache.length` on), with a [T, T] mask (None: causal)."""

    tokens: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    cache: KVCache
    mask: torch.Tensor | None = None  # [T, T] bool

    def __post_init__(self) -> None:
        t = self.tokens.shape
        if self.tokens.dim() != 1 or not t[0] or self.positions.shape != t:
            raise ValueError(f"a segment needs tokens and positions [T], T > 0, not {tuple(t)}")
        if self.mask is not None and self.mask.shape != (t[0], t[0]):
            raise ValueError(f"a segment's mask must be [{t[0]}, {t[0]}]")


class Steps:
    """What every model builds on its forward: appending a chain of tokens to a cache, and
    the cost of a forward by rows (measured once per model, for the goodput gate)."""

    config: ModelConfig
    _cost: CostCurve | None = None
    #: Whether its CPU work runs on the OpenMP pool of the thread that loaded it (PyTorch's
    #: eager operators: run it from that thread), not on threads of its own (the kernels).
    bound_to_loading_thread: ClassVar[bool] = True

    def cost_curve(self, source: Path | None = None, folder: Path | None = None) -> CostCurve:
        """What a forward of R rows costs relative to one row, measured on first use — or read
        from `folder` where an earlier process on this machine stored the curve of the weights
        at `source` (`cost_cache`)."""
        if self._cost is None:
            if source is not None and folder is not None:
                self._cost = cost_cache.load_or_measure(self, source, folder)
            else:
                self._cost = CostCurve.measure(self)
            rows = dict(zip(self._cost.rows, (round(c, 2) for c in self._cost.cost), strict=True))
            log.info("forward cost by rows (in one-row forwards): %s", rows)
        return self._cost

    def set_threads(self, threads: Threads) -> None:
        """Compute with `threads` (process-wide: PyTorch's intra-op threads)."""
        apply_torch(threads)

    def thread_use(self) -> ThreadUse:
        """The threads' counters now (the eager path counts no regions)."""
        return ThreadUse(threads=torch.get_num_threads())

    def extend(
        self: TargetModel,
        ids: Sequence[int],
        cache: KVCache,
        *,
        layers: Sequence[int] | None = None,
        chunk: int = 512,
        last_only: bool = True,
    ) -> torch.Tensor:
        """Append a chain of tokens to the cache (positions = slots, in chunks of `chunk`).

        Returns float32 logits of the last token [V], or of every token [T, V].
        """
        dev = self.device
        tokens = torch.tensor(ids, device=dev)  # [T]
        outs = []
        for i in range(0, len(ids), chunk):
            piece = tokens[i : i + chunk]  # [C]
            positions = torch.arange(cache.length, cache.length + len(piece), device=dev)  # [C]
            hidden = self(piece[None], positions, cache, layers=layers)[0]  # [C, D]
            outs.append(hidden[-1:] if last_only else hidden)
        hidden = outs[-1][-1] if last_only else torch.cat(outs)  # [D] or [T, D]
        return self.logits(hidden)

    def extend_capturing(
        self: TargetModel,
        ids: Sequence[int],
        cache: KVCache,
        capture: Sequence[int],
        last_only: bool = False,
        rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Append a chain of tokens in one forward: logits [T, V] of every token ([1, V], the
        last, with `last_only`; [R, V] of the indices `rows` [R] when given) and the outputs
        [C, T, D] of the blocks in `capture` (None if empty)."""
        dev = self.device
        tokens = torch.tensor(ids, device=dev)  # [T]
        positions = torch.arange(cache.length, cache.length + len(ids), device=dev)  # [T]
        hidden, captured = self.forward_capturing(tokens[None], positions, cache, capture=capture)
        if rows is not None:
            return self.logits(hidden[0, rows]), captured  # [R, V]
        return self.logits(hidden[0, -1:] if last_only else hidden[0]), captured  # [1 or T, V]


class DecoderLM(Steps, nn.Module):
    """Base class; subclasses build `self.blocks` and may override `embed`."""

    unit_offset_norm = False
    block_norms: ClassVar[dict[str, str]] = {}  # transformers' norm names in a block → ours

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.blocks = nn.ModuleList()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps, self.unit_offset_norm)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = Rotary(cfg.rope, cfg.head_dim)
        self.rotary_local = Rotary(cfg.rope_local, cfg.head_dim) if cfg.rope_local else None

    # -- pieces subclasses may change -------------------------------------------------------
    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(tokens)  # [B, T, D]

    # -- the forward pass ---------------------------------------------------------------------
    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        mask: torch.Tensor | None = None,
        layers: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """Run tokens [B, T] at positions [T] through `layers` (default all); hidden [B, T, D].

        The new keys/values are written to cache slots [cache.length, cache.length + T) and
        the cache grows by T. `layers` runs a subset (early exit / layer skipping): the layers
        not run leave their cache slots unwritten.
        """
        return self.forward_capturing(tokens, positions, cache, mask, layers)[0]

    def forward_capturing(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        mask: torch.Tensor | None = None,
        layers: Sequence[int] | None = None,
        capture: Sequence[int] = (),
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`forward`, and the outputs [C, B * T, D] (float32) of the blocks in `capture`, in
        that order (None if `capture` is empty): what draft heads learn from."""
        run = range(len(self.blocks)) if layers is None else layers
        if any(i not in run for i in capture):
            raise ValueError(f"captured layers {list(capture)} must be among those run")
        start = cache.reserve(positions)
        masks = self._masks(cache, start, positions, mask)
        h, captured = self._run(tokens, positions, run, capture, cache, start, masks)
        cache.commit_pending()
        return h, captured

    def _run(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        run: Sequence[int],
        capture: Sequence[int],
        cache: KVCache | PackedRows,
        start: int,
        masks: dict[str, torch.Tensor | None],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Embed tokens [B, T], run the blocks in `run` (each given `cache`, `start` and its
        layer type's mask), final norm: hidden [B, T, D] and the captured blocks [C, B*T, D]."""
        ropes = self._ropes(positions)
        states: dict[int, torch.Tensor] = {}
        with self._kernels_for(tokens.numel()):
            h = self.embed(tokens)  # [B, T, D]
            for i in run:
                kind = self.config.layer_type(i)
                h = self.blocks[i](h, ropes[kind], cache, start, masks[kind])
                if i in capture:
                    states[i] = h.reshape(-1, h.shape[-1]).float()  # [B * T, D]
            h = self.norm(h)
        captured = torch.stack([states[i] for i in capture]) if capture else None  # [C, BT, D]
        return h, captured

    def forward_batch(
        self, segments: Sequence[Segment], capture: Sequence[int] = ()
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Several sequences in one step: hidden states [T, D] of all their rows (segment
        order) and the outputs [C, T, D] of the blocks in `capture` (None if none). The rows
        are packed into [1, T, D] and go through every linear, norm and rotary together (one
        weight pass and one kernel launch for all of them); each segment's rows attend to its
        own cache only. A single segment runs as `forward_capturing` does alone."""
        if len(segments) != len({id(s.cache) for s in segments}):
            raise ValueError("two segments of a batch share a cache")
        if len(segments) == 1:
            seg = segments[0]
            h, c = self.forward_capturing(
                seg.tokens[None], seg.positions, seg.cache, seg.mask, capture=capture
            )  # [1, T, D], [C, T, D] or None
            return h[0], c
        packed = self._pack(segments)  # the spans' own masks travel with it
        tokens = torch.cat([s.tokens for s in segments])[None]  # [1, T]
        positions = torch.cat([s.positions for s in segments])  # [T]: rotary per row
        run, no_masks = range(len(self.blocks)), {"full": None, "sliding": None}
        h, captured = self._run(tokens, positions, run, capture, packed, 0, no_masks)
        for seg in segments:
            seg.cache.commit_pending()
        return h[0], captured  # [T, D], [C, T, D] or None

    def _pack(self, segments: Sequence[Segment]) -> PackedRows:
        """Reserve each segment's cache slots; the spans, first slots and masks of its rows."""
        spans, starts, masks, at = [], [], [], 0
        for seg in segments:
            start = seg.cache.reserve(seg.positions)
            spans.append((at, at + len(seg.tokens)))
            starts.append(start)
            masks.append(self._masks(seg.cache, start, seg.positions, seg.mask))
            at += len(seg.tokens)
        caches = tuple(s.cache for s in segments)
        return PackedRows(tuple(spans), caches, tuple(starts), tuple(masks))

    def embed_rows(self, tokens: torch.Tensor) -> torch.Tensor:
        """Input embeddings [T, D] (float32) of tokens [T], as the forward's first step."""
        return self.embed(tokens[None])[0].float()

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM head: hidden [..., D] → float32 logits [..., V]."""
        with self._kernels_for(hidden.numel() // hidden.shape[-1]):
            out = self.lm_head(hidden).float()
        cap = self.config.final_logit_softcapping
        return torch.tanh(out / cap) * cap if cap else out

    def _ropes(self, positions: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        dtype = self.embed_tokens.weight.dtype
        full = self.rotary(positions, dtype)
        local = self.rotary_local(positions, dtype) if self.rotary_local else full
        return {"full": full, "sliding": local}

    def _masks(
        self, cache: KVCache, start: int, positions: torch.Tensor, mask: torch.Tensor | None
    ) -> dict[str, torch.Tensor | None]:
        """Boolean attention masks [.., T, start + T] (True = may attend) per layer type."""
        t = positions.shape[-1]
        full = None
        if mask is not None or t > 1:
            block = mask if mask is not None else _causal(t, positions.device)  # [(B,) T, T]
            prefix = torch.ones(*block.shape[:-1], start, dtype=torch.bool, device=block.device)
            full = torch.cat((prefix, block.bool()), dim=-1)  # [(B,) T, S]
            if full.dim() == 3:
                full = full[:, None]  # [B, 1, T, S]
        window = self.config.sliding_window
        if window is None or start + t <= window:  # every key is inside every window
            return {"full": full, "sliding": full}
        key_pos = cache.positions[: start + t]  # [S]
        near = (positions[:, None] - key_pos[None, :]) < window  # [T, S]
        sliding = near if full is None else full & near
        return {"full": full, "sliding": sliding}

    # -- CPU kernel choices (measured in docs/benchmarks.md) ----------------------------------
    def _kernels_for(self, rows: int) -> AbstractContextManager[None]:
        """One-row bf16 products on the CPU run faster in ATen's own GEMV than in oneDNN.

        oneDNN stays on for several rows (verification, prefill), where it is much faster.
        The switch is process-wide while a forward runs; one engine thread owns the model.
        """
        cpu_bf16 = self.device.type == "cpu" and self.dtype == torch.bfloat16
        return _onednn_disabled() if cpu_bf16 and rows == 1 else nullcontext()

    def use_column_major_weights(self) -> None:
        """Store every linear weight [out, in] column-major (its transpose contiguous).

        In fp32 on the CPU this makes a one-row product a contiguous GEMV (faster at one row,
        a little slower at 4-8 rows; docs/benchmarks.md).
        """
        for module in self.modules():
            if isinstance(module, nn.Linear):
                w = module.weight
                module.weight = nn.Parameter(w.t().contiguous().t(), requires_grad=False)
        if self.config.tie_embeddings:
            self.embed_tokens.weight = self.lm_head.weight

    def use_packed_weights(self) -> bool:
        """Pack every linear weight for oneDNN (faster CPU bf16 multi-row products).

        Returns False (and changes nothing) where oneDNN's bf16 kernels are not available.
        """
        cpu = self.device.type == "cpu"
        if not (cpu and torch.backends.mkldnn.is_available() and _onednn_bf16_supported()):
            return False
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack()
        return True

    # -- weights ----------------------------------------------------------------------------
    def load_weights(self, own: dict[str, torch.Tensor], assign: bool = False) -> None:
        """Load weights named as this module names them; `assign` adopts the tensors as is."""
        missing, unexpected = self.load_state_dict(own, strict=False, assign=assign)
        missing = [m for m in missing if not (m == "lm_head.weight" and self.config.tie_embeddings)]
        if missing or unexpected:
            raise KeyError(
                f"checkpoint mismatch: missing {missing[:8]}, unexpected {unexpected[:8]}"
            )
        if self.config.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def from_hf_names(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Rename transformers' weights to ours, fusing q/k/v and gate/up."""
        out: dict[str, torch.Tensor] = {}
        rename = {
            "model.embed_tokens.weight": "embed_tokens.weight",
            "model.norm.weight": "norm.weight",
        }
        for name, value in tensors.items():
            if name in rename:
                out[rename[name]] = value
            elif name == "lm_head.weight" and not self.config.tie_embeddings:
                out[name] = value
        for i in range(self.config.num_layers):
            out.update(self._block_from_hf(tensors, f"model.layers.{i}.", f"blocks.{i}."))
        return out

    def _block_from_hf(
        self, t: dict[str, torch.Tensor], src: str, dst: str
    ) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        a = f"{src}self_attn."
        for kind in ("weight", "bias"):
            parts = [t.get(f"{a}{p}_proj.{kind}") for p in "qkv"]
            if all(p is not None for p in parts):
                out[f"{dst}attn.qkv.{kind}"] = torch.cat(parts, dim=0)
            if f"{a}o_proj.{kind}" in t:
                out[f"{dst}attn.o.{kind}"] = t[f"{a}o_proj.{kind}"]
            m = f"{src}mlp."
            if f"{m}gate_proj.{kind}" in t:
                gate_up = (t[f"{m}gate_proj.{kind}"], t[f"{m}up_proj.{kind}"])
                out[f"{dst}mlp.gate_up.{kind}"] = torch.cat(gate_up, dim=0)
                out[f"{dst}mlp.down.{kind}"] = t[f"{m}down_proj.{kind}"]
        for norm in ("q_norm", "k_norm"):
            if f"{a}{norm}.weight" in t:
                out[f"{dst}attn.{norm}.weight"] = t[f"{a}{norm}.weight"]
        for hf_name, own in self.block_norms.items():
            if f"{src}{hf_name}.weight" in t:
                out[f"{dst}{own}.weight"] = t[f"{src}{hf_name}.weight"]
        return out

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def describe(self) -> str:
        """Precision, device and backend, as outputs and benchmark rows state them."""
        return f"{self.precision}, {self.device.type}, eager PyTorch"

    #: Whether a row's logits are independent of the other rows of its forward. Not here:
    #: PyTorch's one-row and multi-row products (and attention paths) round differently.
    batch_invariant = False

    @property
    def precision(self) -> str:
        """The weights' precision as specfork names it (float32, bfloat16, float16)."""
        return str(self.dtype).removeprefix("torch.")

    def step_weights(self, layers: Sequence[int] | None = None) -> int:
        """Weights one token's forward multiplies by: the blocks run (default all) and the LM
        head (the embedding is a lookup); a proxy for the cost of a decoding step."""
        blocks = range(len(self.blocks)) if layers is None else layers
        run = sum(p.numel() for i in blocks for p in self.blocks[i].parameters())
        return run + self.lm_head.weight.numel()

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def new_cache(self, max_len: int, batch: int = 1) -> KVCache:
        """A KV cache sized for this model."""
        c = self.config
        return KVCache(
            c.num_layers,
            c.num_kv_heads,
            c.head_dim,
            max_len,
            batch=batch,
            dtype=self.dtype,
            device=self.device,
        )


def _onednn_bf16_supported() -> bool:
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(check()) if check is not None else False


@contextmanager
def _onednn_disabled() -> Iterator[None]:
    saved = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = False
    try:
        yield
    finally:
        torch.backends.mkldnn.enabled = saved


def _causal(t: int, device: torch.device) -> torch.Tensor:
    return torch.ones(t, t, dtype=torch.bool, device=device).tril()  # [T, T]
