"""Llama 4's attention parts beside the chunked window (model/window.py): blocks without rotary
positions, a query temperature in those blocks, and a q/k norm without a weight in the others.

  no-rope blocks   every model.nope_every-th block (counting from 1) leaves queries and keys
                   unturned; with model.attn_chunk they are the global blocks, the others chunked.
  temperature      in the no-rope blocks the query at position p is multiplied by
                   1 + attn_temperature * log(1 + floor((p + 1) / attn_temperature_floor)):
                   1 up to the first step, then growing slowly, so that attention over a long
                   context stays sharp without positions (transformers' attn_temperature_tuning).
  L2 q/k norm      in the rotary blocks, each head of the rotated queries and keys divided by its
                   root mean square (eps model.norm_eps), no weight (transformers' use_qk_norm).

The temperature is a per-position table like the rotary ones (`temperature_table`): it is sliced
for the cached positions, indexed by the documents' own positions, and cut to a context-parallel
rank's positions alike, and reaches a no-rope block in the place of its rotary tables (`QueryScale`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from scaletrain.model.config import ModelConfig


class QueryScale(NamedTuple):
    """What a no-rope block with a temperature gets where a rotary block gets its (cos, sin) tables:
    the factor of each position's queries, (T',) from the first position on or (B, T) per sequence."""

    scale: torch.Tensor

    def apply(self, q: torch.Tensor) -> torch.Tensor:
        """q (B, T, H, head_dim), each position's heads times its factor (in fp32, then rounded)."""
        T = q.shape[1]
        s = self.scale[:T, None, None] if self.scale.dim() == 1 else self.scale[:, :T, None, None]
        return (q * s).type_as(q)


def temperature_table(cfg: ModelConfig, device=None) -> torch.Tensor:
    """(max_seq_len,) fp32: the query factor of each position of a no-rope block."""
    p = torch.arange(cfg.max_seq_len, device=device, dtype=torch.float32)
    return torch.log1p(torch.floor((p + 1.0) / cfg.attn_temperature_floor)) * cfg.attn_temperature + 1.0


def l2_heads(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x (..., head_dim) over its root mean square, computed in fp32 and rounded back: an RMSNorm
    without a weight."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).type_as(x)
