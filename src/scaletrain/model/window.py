"""Local attention: a query sees only the keys near it, in one of two ways (the masks transformers
builds, masking_utils' sliding_window_overlay and chunked_overlay, on top of causality):

  sliding  query i sees keys j with i - size < j <= i: the window counts the query itself
           (Mistral, Qwen2, Phi-3, Gemma 2 and 3: model.sliding_window)
  chunked  the sequence is cut into chunks of `size` tokens from position 0, and query i sees the
           keys j <= i of its own chunk (Llama 4's chunked attention: model.attn_chunk)

Positions are those of the window of tokens (0 at its first token), also for packed documents,
whose own mask is and-ed with this one.

The kernel (`local_attention`): queries in tiles of `size` rows, each tile against only the keys
its rows may see (a sliding tile: at most 2·size - 1 keys; a chunked one: its chunk), through the
same attention as the whole sequence (scaled_dot_product_attention with a boolean mask, or the
soft-capped matmuls). Scores, FLOPs and memory then grow as seq_len × size, not seq_len².
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from scaletrain.model.config import ModelConfig

if TYPE_CHECKING:  # (torch is imported where the kernel runs: reading a config, or the FLOPs, must not load it)
    import torch

    Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, bool], torch.Tensor]


@dataclass(frozen=True)
class Window:
    size: int  # tokens a query sees at most (its own included)
    chunked: bool = False  # chunks from position 0, rather than a window sliding with the query

    def allows(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """(Tq, Tk) bool: whether the query at each of `q_pos` sees the key at each of `k_pos`
        (causal and near: the one rule every attention path asks)."""
        q, k = q_pos[:, None], k_pos[None, :]
        near = (q // self.size == k // self.size) if self.chunked else (q - k < self.size)
        return (k <= q) & near

    def first_key(self, q_pos: int) -> int:
        """The earliest key position that a query at `q_pos`, or any later one, may see."""
        if self.chunked:
            return q_pos // self.size * self.size
        return max(0, q_pos - self.size + 1)


def block_window(cfg: ModelConfig, index: int) -> Window | None:
    """The window of block `index`: None for a block that attends to the whole sequence (no window
    in the model, or a global block of model.global_every)."""
    if cfg.global_every and not cfg.is_local_block(index):
        return None
    if cfg.sliding_window:
        return Window(cfg.sliding_window)
    if cfg.attn_chunk:
        return Window(cfg.attn_chunk, chunked=True)
    return None


def causal_allows(window: Window | None, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """(Tq, Tk) bool: causal, and within `window` if there is one."""
    if window is None:
        return k_pos[None, :] <= q_pos[:, None]
    return window.allows(q_pos, k_pos)


def local_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: Window, mask: torch.Tensor | None,
                    kernel: Kernel) -> torch.Tensor:
    """Causal attention within `window` of q (B, H, T, D) over k, v (B, Hkv, T, D) of the same T
    positions 0..T-1, and-ed with `mask` (B, 1, T, T) bool if given (packed documents).
    `kernel(q, k, v, mask, causal)` computes attention over the keys it is given; it is called once
    per tile of `window.size` query rows, with the keys the tile's rows may see."""
    import torch

    T = q.shape[2]
    assert k.shape[2] == T, "local attention takes the keys of the queries' own positions"
    if T <= window.size:  # no query reaches past the window: plain causal attention
        return kernel(q, k, v, mask, mask is None)
    positions = torch.arange(T, device=q.device)
    out = []
    for start in range(0, T, window.size):
        stop = min(T, start + window.size)
        first = window.first_key(start)  # (a chunked tile is its chunk: first == start)
        allowed = window.allows(positions[start:stop], positions[first:stop])  # (tile, keys)
        if mask is not None:
            allowed = mask[:, :, start:stop, first:stop] & allowed
        out.append(kernel(q[:, :, start:stop], k[:, :, first:stop], v[:, :, first:stop], allowed, False))
    return torch.cat(out, dim=2)  # (B, H, T, D)


def key_span(cfg: ModelConfig, seq_len: int, index: int, *, kernel: bool = False) -> int:
    """The keys each query of block `index` is counted against, in sequences of `seq_len`: the whole
    sequence (causal attention counted unhalved, as PaLM counts its FLOPs), or the window's size;
    with `kernel`, the keys the tiled kernel scores and keeps (a sliding tile's rows see up to
    2·size - 1 keys together; a chunked tile, its chunk). A linear-attention block (model/deltanet.py)
    scores the keys of its delta rule's chunk, the rest reaching it through its state."""
    if cfg.is_linear_block(index):
        return min(seq_len, cfg.linear_chunk)
    window = block_window(cfg, index)
    if window is None or seq_len <= window.size:
        return seq_len
    return min(seq_len, 2 * window.size - 1) if kernel and not window.chunked else window.size


def mean_key_span(cfg: ModelConfig, seq_len: int, *, kernel: bool = False) -> float:
    """key_span averaged over the model's blocks (the planner's layers are alike)."""
    return sum(key_span(cfg, seq_len, i, kernel=kernel) for i in range(cfg.n_layers)) / cfg.n_layers
