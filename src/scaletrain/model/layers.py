"""The small layers every attention shares: RMSNorm and the rotary rotation (model/transformer.py's
attention and model/mla.py's latent attention both use them)."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, unit_offset: bool = False):
        """`unit_offset` (Gemma): scale by (1 + weight), so a weight of zeros is the identity."""
        super().__init__()
        self.eps, self.unit_offset = eps, unit_offset
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # normalise in fp32 even under autocast: the mean of squares loses bits in bf16
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:  # (Gemma scales in fp32, then rounds)
            return (y * (1.0 + self.weight.float())).type_as(x)
        return y.type_as(x) * self.weight


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[2i], x[2i+1]) of x: (B, T, H, head_dim) by the angle of their position; with
    tables narrower than the head (partial rotary) only its first 2 * cos.shape[-1] coordinates.
    Tables of (T', rotary_dim/2) hold positions 0, 1, ...; tables of (B, T, rotary_dim/2) each
    sequence's own (positions that restart per document)."""
    T, r = x.shape[1], 2 * cos.shape[-1]
    if cos.dim() == 2:
        cos, sin = cos[:T, None, :], sin[:T, None, :]  # (T, 1, rotary_dim/2), broadcast over heads
    else:
        cos, sin = cos[:, :T, None, :], sin[:, :T, None, :]  # (B, T, 1, rotary_dim/2)
    x1, x2 = x[..., :r].float().unflatten(-1, (-1, 2)).unbind(-1)
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2).type_as(x)
    return out if r == x.shape[-1] else torch.cat((out, x[..., r:]), dim=-1)
