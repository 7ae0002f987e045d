"""The target model as the rest of specfork sees it: one declared interface.

`DecoderLM` (eager PyTorch: CUDA, float16, wherever the kernels are off) and `FastLM` (the whole
forward in specfork's compiled CPU kernels) both follow it; the engine, the cost curve, the
drafters, the bench and the server are typed against it and use nothing else of a model.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from specfork.config import ModelConfig
    from specfork.kv_cache import KVCache
    from specfork.models.base import Segment
    from specfork.models.cost import CostCurve
    from specfork.threads import Threads, ThreadUse


class TargetModel(Protocol):
    """A decoder that runs chains and trees of new tokens over its KV cache."""

    config: ModelConfig
    #: a row's logits never depend on the other rows of its forward (exact speculation)
    batch_invariant: bool
    #: its CPU work runs on the OpenMP pool of the thread that loaded it (the eager path)
    bound_to_loading_thread: bool

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype:
        """The KV cache's dtype."""
        ...

    @property
    def precision(self) -> str:
        """As outputs name it: gguf, bfloat16, float32, float16."""
        ...

    def describe(self) -> str:
        """Precision, device and backend, as outputs and benchmark rows state them."""
        ...

    def __call__(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        mask: torch.Tensor | None = None,
        layers: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """Final-normed hidden states [B, T, D] of tokens [B, T] at positions [T]."""
        ...

    def forward_capturing(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        mask: torch.Tensor | None = None,
        layers: Sequence[int] | None = None,
        capture: Sequence[int] = (),
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The forward, and the outputs [C, T, D] of the blocks in `capture` (None if none)."""
        ...

    def forward_batch(
        self, segments: Sequence[Segment], capture: Sequence[int] = ()
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Several sequences in one forward: hidden states [T, D] in segment order."""
        ...

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits [..., V] of hidden states [..., D]."""
        ...

    def extend(
        self,
        ids: Sequence[int],
        cache: KVCache,
        *,
        layers: Sequence[int] | None = None,
        chunk: int = 512,
        last_only: bool = True,
    ) -> torch.Tensor:
        """Append a chain of tokens to the cache: logits [V] of the last, or [T, V]."""
        ...

    def extend_capturing(
        self,
        ids: Sequence[int],
        cache: KVCache,
        capture: Sequence[int],
        last_only: bool = False,
        rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Append a chain in one forward, with the captured blocks' outputs."""
        ...

    def new_cache(self, max_len: int, batch: int = 1) -> KVCache: ...

    def step_weights(self, layers: Sequence[int] | None = None) -> int:
        """Weights one token's forward multiplies by (a proxy for a step's cost)."""
        ...

    def cost_curve(self, source: Path | None = None, folder: Path | None = None) -> CostCurve:
        """What a forward of R rows costs relative to one row (measured once)."""
        ...

    def set_threads(self, threads: Threads) -> None: ...

    def thread_use(self) -> ThreadUse: ...
