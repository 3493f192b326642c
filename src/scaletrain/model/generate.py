"""Sampling text from a trained model: temperature and top-k, a sliding context window."""

from __future__ import annotations

from typing import Callable

import torch


@torch.no_grad()
def generate(logits_of: Callable[[torch.Tensor], torch.Tensor], tokens: torch.Tensor, new_tokens: int, *,
             window: int, temperature: float = 0.8, top_k: int = 50,
             generator: torch.Generator | None = None) -> torch.Tensor:
    """Append `new_tokens` sampled tokens to tokens (B, T). `logits_of(tokens)` returns the
    logits (B, T, vocab); the context slides at `window` tokens (use the training length:
    positions past it were never trained)."""
    for _ in range(new_tokens):
        logits = logits_of(tokens[:, -window:])[:, -1, :].float() / max(temperature, 1e-5)
        if top_k:
            kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        nxt = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)
        tokens = torch.cat([tokens, nxt], dim=1)
    return tokens
