"""Sampling text from a trained model: temperature and top-k, a sliding context window.

`sample_text` runs on a model however it is sharded: every rank of a sharded model (FSDP,
tensor parallel) takes part in each forward and draws the same tokens from the same seed.
"""

from __future__ import annotations

from typing import Callable, ContextManager

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


class Interrupted(Exception):
    """A stop asked for while sampling (a signal): the sample is cut short."""


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


@torch.no_grad()
def sample_text(module: torch.nn.Module, tokenizer, prompt: str, new_tokens: int, *, window: int, seed: int,
                device: torch.device, autocast: Callable[[], ContextManager], all_ranks: bool,
                interrupted: Callable[[], bool]) -> str:
    """`prompt` and `new_tokens` sampled tokens, decoded. `all_ranks`: every rank of a group runs
    this (a sharded model), and they finish together; `interrupted()` true raises Interrupted
    before the next forward."""
    x = torch.tensor([tokenizer.encode(prompt) or [0]], device=device)
    gen = torch.Generator(device=device).manual_seed(seed)

    def logits_of(tokens):
        if interrupted():
            raise Interrupted()
        with autocast():
            logits = module(tokens)
        return logits.full_tensor() if isinstance(logits, DTensor) else logits  # vocabulary shards

    module.eval()
    out = generate(logits_of, x, new_tokens, window=window, generator=gen)
    module.train()
    if all_ranks:
        for m in module.modules():  # free what FSDP gathered for the forwards
            if hasattr(m, "reshard"):
                m.reshard()
        dist.barrier()  # and let every rank finish together
    return tokenizer.decode(out[0].tolist())
