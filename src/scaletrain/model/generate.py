"""Sampling text from a trained model: temperature and top-k, a context window of the length
the model was trained on, and a key/value cache (scaletrain.model.kv_cache) so that each new
token costs the forward of one position.

With the cache, the prompt (its last `window` tokens) is encoded once and every new token is one
position more; when the context reaches `window`, its last half is encoded again and generation
goes on from there (each token still costs two positions at most, on average). Without it (a
model sharded over ranks) every token re-runs the last `window` tokens.

`sample_text` runs on a model however it is sharded: every rank of a sharded model (FSDP,
tensor parallel) takes part in each forward and draws the same tokens from the same seed.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from scaletrain.model.kv_cache import KVCache


class Interrupted(Exception):
    """A stop asked for while sampling (a signal): the sample is cut short."""


@torch.no_grad()
def generate(logits_of: Callable[..., torch.Tensor], tokens: torch.Tensor, new_tokens: int, *,
             window: int, temperature: float = 0.8, top_k: int = 50,
             generator: torch.Generator | None = None, cache: KVCache | None = None) -> torch.Tensor:
    """Append `new_tokens` sampled tokens to tokens (B, T). `logits_of(tokens)` returns the
    logits (B, T, vocab); with `cache`, `logits_of(tokens, cache)` takes only the positions
    after those cached. The context is at most `window` tokens (use the training length:
    positions past it were never trained)."""
    if cache is None:
        for _ in range(new_tokens):
            nxt = pick(logits_of(tokens[:, -window:])[:, -1, :], temperature, top_k, generator)
            tokens = torch.cat([tokens, nxt], dim=1)
        return tokens
    cache.reset()
    logits = logits_of(tokens[:, -window:], cache)[:, -1, :]
    for i in range(new_tokens):
        nxt = pick(logits, temperature, top_k, generator)
        tokens = torch.cat([tokens, nxt], dim=1)
        if i == new_tokens - 1:
            break
        if cache.length >= window:  # full: the last half of the window again, then on from there
            cache.reset()
            logits = logits_of(tokens[:, -max(1, window // 2):], cache)[:, -1, :]
        else:
            logits = logits_of(nxt, cache)[:, -1, :]
    return tokens


def pick(logits: torch.Tensor, temperature: float, top_k: int, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of logits (B, vocab): temperature, then the top k, then a draw."""
    logits = logits.float() / max(temperature, 1e-5)
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)


@torch.no_grad()
def sample_text(module: torch.nn.Module, tokenizer, prompt: str, new_tokens: int, *, window: int, seed: int,
                device: torch.device, autocast: Callable[[], AbstractContextManager], all_ranks: bool,
                interrupted: Callable[[], bool], use_cache: bool = True, temperature: float = 0.8,
                top_k: int = 50) -> str:
    """`prompt` and `new_tokens` sampled tokens, decoded. `all_ranks`: every rank of a group runs
    this (a sharded model), and they finish together; `interrupted()` true raises Interrupted
    before the next forward. `use_cache`: generate with a KVCache (a model whose forward takes
    one; a sharded model never does)."""
    x = torch.tensor([tokenizer.encode(prompt) or [0]], device=device)
    gen = torch.Generator(device=device).manual_seed(seed)

    def logits_of(tokens, *cache):
        if interrupted():
            raise Interrupted()
        with autocast():
            logits = module(tokens, *cache)
        return logits.full_tensor() if isinstance(logits, DTensor) else logits  # vocabulary shards

    module.eval()
    cache = KVCache(window) if use_cache and not all_ranks else None
    out = generate(logits_of, x, new_tokens, window=window, generator=gen, cache=cache, temperature=temperature,
                   top_k=top_k)
    module.train()
    if all_ranks:
        for m in module.modules():  # free what FSDP gathered for the forwards
            if hasattr(m, "reshard"):
                m.reshard()
        dist.barrier()  # and let every rank finish together
    return tokenizer.decode(out[0].tolist())
