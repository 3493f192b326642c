"""A key/value cache for generating one token at a time: each block's keys and values of the
positions already seen are kept, so a new token costs the forward of one position, not of the
whole context. Plain PyTorch; `Transformer.forward(tokens, cache=...)` fills and reads it.

A block with a window (model/window.py) keeps only the keys its window can still reach: at most
size - 1 positions of a sliding window (and those of the current chunk of a chunked one), so its
memory is bounded by the window, not by the context.

A linear-attention block (model/deltanet.py) keeps no keys: its convolution's last inputs and its
state, of a fixed size (`linear_state`, `keep_linear_state`). Its state cannot be rewound."""

from __future__ import annotations

import torch

from scaletrain.model.window import Window


class KVCache:
    """Keys and values of positions [0, length) for every block, in (B, kv_heads, max_len,
    head_dim) buffers allocated at the first write (their head count is whatever the block
    computes: a tensor-parallel shard holds its own heads); a windowed block's, of the positions
    [first, length) its window still reaches, in tensors of that many positions."""

    def __init__(self, max_len: int):
        self.max_len = max_len
        self.length = 0  # positions cached, in every block
        self._kv: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._first: dict[str, int] = {}  # a windowed block's first position kept
        self._linear: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # a linear block's (conv inputs, state)

    def reset(self) -> None:
        """Forget every position (the buffers are kept for reuse)."""
        self.length = 0
        self._linear.clear()
        for block in self._first:
            self._first[block] = 0
            self._kv[block] = tuple(t[:, :, :0] for t in self._kv[block])

    def append(self, block: str, k: torch.Tensor, v: torch.Tensor,
               window: Window | None = None) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Store block `block`'s keys and values (B, kv_heads, T, head_dim) of positions
        [length, length + T); returns (keys, values, first): those of [first, length + T), where
        first is 0 without a window and the first position the new queries' window reaches with one."""
        B, H, T, D = k.shape
        end = self.length + T
        if end > self.max_len:
            raise ValueError(f"the cache holds {self.max_len} positions; {end} were asked for")
        if window is not None:
            return self._append_windowed(block, k, v, window)
        if block not in self._kv or self._kv[block][0].shape[0] != B:
            # (values may be narrower than keys: latent attention keeps its latent and rotated key here)
            self._kv[block] = (k.new_empty(B, H, self.max_len, D), v.new_empty(B, H, self.max_len, v.shape[-1]))
        keys, values = self._kv[block]
        keys[:, :, self.length:end] = k
        values[:, :, self.length:end] = v
        return keys[:, :, :end], values[:, :, :end], 0

    def _append_windowed(self, block: str, k: torch.Tensor, v: torch.Tensor,
                         window: Window) -> tuple[torch.Tensor, torch.Tensor, int]:
        first = self._first.get(block, 0)
        if block in self._kv and self.length and self._kv[block][0].shape[0] == k.shape[0]:
            keys, values = (torch.cat((old, new), dim=2) for old, new in zip(self._kv[block], (k, v)))
        else:
            keys, values, first = k, v, self.length
        # the new queries' keys, from the first their window reaches
        start = window.first_key(self.length) - first
        keys, values, first = keys[:, :, start:], values[:, :, start:], first + start
        # kept for the next ones: what a query after these can still see
        drop = window.first_key(self.length + k.shape[2]) - first
        self._kv[block] = (keys[:, :, drop:], values[:, :, drop:])
        self._first[block] = first + drop
        return keys, values, first

    def linear_state(self, block: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A linear-attention block's (last convolution inputs, state) after the cached positions;
        None before the first."""
        return self._linear.get(block) if self.length else None

    def keep_linear_state(self, block: str, conv: torch.Tensor, state: torch.Tensor) -> None:
        """Keep block `block`'s convolution inputs (B, channels, taps - 1) and state (B, heads, dk, dv)."""
        self._linear[block] = (conv, state)

    def positions_held(self, block: str) -> int:
        """How many positions block `block` keeps (its buffer's length)."""
        return self._kv[block][0].shape[2]

    def advance(self, steps: int) -> None:
        """Every block has stored `steps` more positions."""
        self.length += steps

    def rewind(self, steps: int) -> None:
        """Forget the last `steps` positions (padding run through the model after the real ones: what it
        stored is overwritten by the next positions). A block with a window may have dropped keys for
        them already: not supported there."""
        if self._first:
            raise ValueError("a cache of blocks with a window cannot rewind: their dropped keys are gone")
        if self._linear and steps:
            raise ValueError("a cache of linear-attention blocks cannot rewind: their state has taken in the "
                             "positions already")
        if not 0 <= steps <= self.length:
            raise ValueError(f"cannot rewind {steps} of {self.length} positions")
        self.length -= steps
