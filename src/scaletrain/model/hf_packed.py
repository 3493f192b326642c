"""Experts packed as gpt-oss's checkpoints keep them (expert style "packed"): per layer one tensor
per kind, its matrices stored (in, out), the gate's and the up projection's output columns
interleaved (gate first in each pair), and their biases alike:

    mlp.experts.gate_up_proj       (experts, dim, 2·hidden)   columns 0::2 = w1ᵀ, 1::2 = w3ᵀ
    mlp.experts.gate_up_proj_bias  (experts, 2·hidden)        0::2 = b1, 1::2 = b3
    mlp.experts.down_proj          (experts, hidden, dim)     = w2ᵀ
    mlp.experts.down_proj_bias     (experts, dim)             = b2

Ours are stacked (experts, out, in) per matrix (model/moe.py). `PackedExperts` reads one of ours
from the file (only the experts a shard needs); `pack` writes a layer's back.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from scaletrain.model.hf_fused import read_part, shape_of

# ours -> (the file's tensor, the interleaved columns it takes: 0 gate, 1 up, None all of it)
SOURCES = {"w1": ("gate_up_proj", 0), "w3": ("gate_up_proj", 1), "w2": ("down_proj", None),
           "b1": ("gate_up_proj_bias", 0), "b3": ("gate_up_proj_bias", 1), "b2": ("down_proj_bias", None)}


def packed_key(layer: str, matrix: str) -> str:
    return f"model.layers.{layer}.mlp.experts.{SOURCES[matrix][0]}"


class PackedExperts:
    """Our `matrix` (w1, w2, w3, b1, b2, b3) of one layer, from its packed tensor."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], key: str, matrix: str, dtype: torch.dtype):
        self.tensors, self.keys, self.matrix, self.dtype = tensors, [key], matrix, dtype

    def shape(self) -> tuple[int, ...]:
        shape = tuple(shape_of(self.tensors, self.keys[0]))
        half = SOURCES[self.matrix][1] is not None
        if len(shape) == 2:  # a bias: (experts, out)
            return (shape[0], shape[1] // 2) if half else shape
        return (shape[0], shape[2] // 2 if half else shape[2], shape[1])  # (experts, out, in)

    def part(self, index: tuple) -> torch.Tensor:
        """self.full()[index], reading the file's rows of those experts only."""
        experts = index[0]
        t = read_part(self.tensors, self.keys[0], (experts,))
        column = SOURCES[self.matrix][1]
        if column is not None:
            t = t[..., column::2]
        if t.dim() == 3:
            t = t.transpose(1, 2)  # (in, out) -> (out, in)
        return t[(slice(None), *index[1:])].to(self.dtype).contiguous()

    def full(self) -> torch.Tensor:
        return self.part(tuple(slice(0, n) for n in self.shape()))


def pack(layer: str, ours: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One layer's packed tensors from our `ours` {w1, w2, w3, b1, b2, b3} (stacked, (experts, out, in))."""
    w1, w3 = ours["w1"].transpose(1, 2), ours["w3"].transpose(1, 2)  # (experts, dim, hidden)
    out = {packed_key(layer, "w1"): torch.stack((w1, w3), dim=-1).flatten(-2),
           packed_key(layer, "w2"): ours["w2"].transpose(1, 2)}
    if "b1" in ours:
        out[packed_key(layer, "b1")] = torch.stack((ours["b1"], ours["b3"]), dim=-1).flatten(-2)
        out[packed_key(layer, "b2")] = ours["b2"]
    return {k: v.contiguous() for k, v in out.items()}
