"""The dense feed-forward block: GELU (GPT-2) or SwiGLU (Llama). Its own module because both the
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
        self.swiglu = cfg.activation == "swiglu"
        self.w1 = nn.Linear(cfg.dim, hidden, bias=cfg.bias)
        self.w3 = nn.Linear(cfg.dim, hidden, bias=cfg.bias) if self.swiglu else None
        self.w2 = nn.Linear(hidden, cfg.dim, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        return self.w2(F.gelu(self.w1(x), approximate="tanh"))
