"""The dense feed-forward block: GELU (GPT-2; exact GELU for GPT-NeoX), or gated: SwiGLU (Llama),
GeGLU (Gemma), gpt-oss's clamped SwiGLU. Its own module because both the
transformer's blocks and a mixture of experts' shared experts use it."""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from scaletrain.model.config import ModelConfig


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's gate: g * sigmoid(alpha * g) with g clamped above at `limit`, times (up + 1) with up
    clamped to [-limit, limit] (the clamps bound the activations an outlier token can make)."""
    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return gate * torch.sigmoid(alpha * gate) * (up + 1)


def glu_of(cfg: ModelConfig):
    """The gated activation of cfg, (gate, up) -> hidden, or None for an ungated MLP."""
    if cfg.activation == "swiglu":
        return lambda gate, up: F.silu(gate) * up
    if cfg.activation == "geglu":
        return lambda gate, up: F.gelu(gate, approximate="tanh") * up
    if cfg.activation == "swiglu_clamped":
        return partial(clamped_swiglu, alpha=cfg.swiglu_alpha, limit=cfg.swiglu_limit)
    return None


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, hidden: int = 0):
        """`hidden`: the width, if not the config's (a mixture's shared experts)."""
        super().__init__()
        hidden = hidden or cfg.hidden_dim
        self.activation = cfg.activation
        self.glu = glu_of(cfg)
        self.w1 = nn.Linear(cfg.dim, hidden, bias=cfg.bias)  # the gate, in a gated MLP
        self.w3 = nn.Linear(cfg.dim, hidden, bias=cfg.bias) if cfg.gated else None
        self.w2 = nn.Linear(hidden, cfg.dim, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.glu is not None:
            return self.w2(self.glu(self.w1(x), self.w3(x)))
        return self.w2(F.gelu(self.w1(x), approximate="none" if self.activation == "gelu_exact" else "tanh"))
