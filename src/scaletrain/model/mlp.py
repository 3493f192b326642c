"""The dense feed-forward block: GELU (GPT-2; exact GELU for GPT-NeoX), or gated: SwiGLU (Llama),
GeGLU (Gemma). Its own module because both the
transformer's blocks and a mixture of experts' shared experts use it."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from scaletrain.model.config import ModelConfig


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, hidden: int = 0):
        """`hidden`: the width, if not the config's (a mixture's shared experts)."""
        super().__init__()
        hidden = hidden or cfg.hidden_dim
        self.activation = cfg.activation
        self.w1 = nn.Linear(cfg.dim, hidden, bias=cfg.bias)  # the gate, in a gated MLP
        self.w3 = nn.Linear(cfg.dim, hidden, bias=cfg.bias) if cfg.gated else None
        self.w2 = nn.Linear(hidden, cfg.dim, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.activation == "swiglu":
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        if self.activation == "geglu":
            return self.w2(F.gelu(self.w1(x), approximate="tanh") * self.w3(x))
        return self.w2(F.gelu(self.w1(x), approximate="none" if self.activation == "gelu_exact" else "tanh"))
