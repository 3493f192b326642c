"""A key/value cache for generating one token at a time: each block's keys and values of the
positions already seen are kept, so a new token costs the forward of one position, not of the
whole context. Plain PyTorch; `Transformer.forward(tokens, cache=...)` fills and reads it."""

from __future__ import annotations

import torch


class KVCache:
    """Keys and values of positions [0, length) for every block, in (B, kv_heads, max_len,
    head_dim) buffers allocated at the first write (their head count is whatever the block
    computes: a tensor-parallel shard holds its own heads)."""

    def __init__(self, max_len: int):
        self.max_len = max_len
        self.length = 0  # positions cached, in every block
        self._kv: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def reset(self) -> None:
        """Forget every position (the buffers are kept for reuse)."""
        self.length = 0

    def append(self, block: str, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store block `block`'s keys and values (B, kv_heads, T, head_dim) of positions
        [length, length + T); returns those of [0, length + T)."""
        B, H, T, D = k.shape
        end = self.length + T
        if end > self.max_len:
            raise ValueError(f"the cache holds {self.max_len} positions; {end} were asked for")
        if block not in self._kv or self._kv[block][0].shape[0] != B:
            self._kv[block] = (k.new_empty(B, H, self.max_len, D), v.new_empty(B, H, self.max_len, D))
        keys, values = self._kv[block]
        keys[:, :, self.length:end] = k
        values[:, :, self.length:end] = v
        return keys[:, :, :end], values[:, :, :end]

    def advance(self, steps: int) -> None:
        """Every block has stored `steps` more positions."""
        self.length += steps
