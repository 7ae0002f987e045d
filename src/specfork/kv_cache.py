"""Static, preallocated KV cache indexed by slot.

Slots are filled left to right: a forward over T new tokens writes slots [length, length + T).
Each slot also remembers the RoPE position of its token (for sliding-window masks and trees,
where a slot index and a position differ). Rolling back rejected drafts is `truncate(n)`, which
only moves `length`; an accepted tree path is compacted with `keep(indices)`.
"""

from __future__ import annotations

import torch

from specfork.errors import PromptError


class KVCache:
    """Keys and values of every layer for `batch` rows and up to `max_len` slots."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        max_len: int,
        *,
        batch: int = 1,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (num_layers, batch, num_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [L, B, Hkv, S, D]
        self.v = torch.zeros(shape, dtype=dtype, device=device)  # [L, B, Hkv, S, D]
        self.positions = torch.zeros(max_len, dtype=torch.long, device=device)  # [S]
        self.max_len = max_len
        self.length = 0
        self._pending = 0

    @property
    def batch(self) -> int:
        return self.k.shape[1]

    def reserve(self, positions: torch.Tensor) -> int:
        """Claim slots for len(positions) new tokens; returns the first slot.

        Called by the model at the start of a forward. The slots become part of the cache
        (`length` moves) only when the forward finishes and calls `commit_pending`.
        """
        n = positions.shape[-1]
        if self.length + n > self.max_len:
            raise PromptError(
                f"context length reached: {self.length} cached + {n} new tokens exceed the "
                f"cache size of {self.max_len}; shorten the prompt or lower max_new_tokens"
            )
        self.positions[self.length : self.length + n] = positions
        self._pending = n
        return self.length

    def commit_pending(self) -> None:
        """Make the slots claimed by `reserve` part of the cache."""
        self.length += self._pending
        self._pending = 0

    def drop_pending(self) -> None:
        """Forget the slots claimed by `reserve` (a forward that failed)."""
        self._pending = 0

    def write(
        self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store new keys/values [B, Hkv, T, D] at `start`; return all keys/values up to them."""
        end = start + k.shape[2]
        self.k[layer, :, :, start:end] = k
        self.v[layer, :, :, start:end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]  # [B, Hkv, end, D]

    def truncate(self, n: int) -> None:
        """Forget every slot from `n` on (rejected drafts cost nothing to roll back)."""
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {n}")
        self.length = n

    def keep(self, indices: torch.Tensor | list[int], start: int | None = None) -> None:
        """Copy the slots `indices` (ascending) into contiguous slots from `start` on.

        `start` defaults to the first index. Slots after the kept ones are dropped. Used to
        compact an accepted tree path: its nodes are scattered among rejected siblings. Only
        the slots not already in place are copied (an accepted first child often is).
        """
        kept = torch.as_tensor(indices, dtype=torch.long).tolist()  # [N]
        if len(kept) == 0:
            raise ValueError("keep() needs at least one slot; use truncate(n) to drop slots")
        first = kept[0] if start is None else start
        if max(kept) >= self.length or first > min(kept):
            raise ValueError(f"keep({kept}, start={first}) outside length {self.length}")
        moved = next((i for i, slot in enumerate(kept) if slot != first + i), len(kept))
        if moved < len(kept):  # ascending slots: every later one moves too
            idx = torch.tensor(kept[moved:], device=self.k.device)  # [M]
            dest = slice(first + moved, first + len(kept))
            self.k[:, :, :, dest] = self.k[:, :, :, idx]
            self.v[:, :, :, dest] = self.v[:, :, :, idx]
            self.positions[dest] = self.positions[idx]
        self.length = first + len(kept)

    def reset(self) -> None:
        self.length = 0
        self._pending = 0
