"""Sampling text from a trained model: temperature and top-k, a context window of the length
the model was trained on, and a key/value cache (scaletrain.model.kv_cache) so that each new
token costs the forward of one position.

With the cache, the prompt (its last `window` tokens) is encoded once and every new token is one
position more; when the context reaches `window`, its last half is encoded again and generation
goes on from there (each token still costs two positions at most, on average). Without it (a
compiled model, whose shapes would change every token) every token re-runs the last `window` tokens.

`sample_text` runs on a model however it is sharded: every rank of a sharded model (FSDP,
tensor parallel) takes part in each forward and draws the same tokens from the same seed; the
cache works there too (a tensor-parallel rank caches its own heads), as the number of forwards
follows from the prompt, the window and the tokens asked alone. Under sequence parallelism every
forward's length must split evenly over the tp ranks: `forward_logits` pads it at its end.
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
             generator: torch.Generator | None = None, cache: KVCache | None = None,
             on_token: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
    """Append `new_tokens` sampled tokens to tokens (B, T). `logits_of(tokens)` returns the
    logits (B, T, vocab); with `cache`, `logits_of(tokens, cache)` takes only the positions
    after those cached. The context is at most `window` tokens (use the training length:
    positions past it were never trained). With `on_token`, each new token (B, 1) goes to it as
    it is drawn and only the last `window` tokens are kept (returned): a stream of any length
    holds the memory of one window."""
    keep = window if on_token is not None else None

    def append(tokens, nxt):
        if on_token is not None:
            on_token(nxt)
        tokens = torch.cat([tokens, nxt], dim=1)
        return tokens[:, -keep:] if keep else tokens

    if cache is None:
        for _ in range(new_tokens):
            nxt = pick(logits_of(tokens[:, -window:])[:, -1, :], temperature, top_k, generator)
            tokens = append(tokens, nxt)
        return tokens
    cache.reset()
    logits = logits_of(tokens[:, -window:], cache)[:, -1, :]
    for i in range(new_tokens):
        nxt = pick(logits, temperature, top_k, generator)
        tokens = append(tokens, nxt)
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


def forward_logits(module: torch.nn.Module, tokens: torch.Tensor, cache: KVCache | None = None,
                   multiple: int = 1) -> torch.Tensor:
    """(B, T, V) the logits of tokens (B, T), whole (a tensor-parallel head's vocabulary shards gathered:
    every rank of the tp group calls this together). `multiple`: the forward's length is padded at its end
    to a multiple of it (sequence parallelism's shards are equal); under the causal mask no real position
    sees the padding, and the cache forgets it after."""
    T = tokens.shape[1]
    pad = -T % multiple
    if pad:
        tokens = torch.cat([tokens, tokens[:, -1:].expand(-1, pad)], dim=1)
    out = module(tokens) if cache is None else module(tokens, cache)
    out = out.full_tensor() if isinstance(out, DTensor) else out
    if pad and cache is not None:
        cache.rewind(pad)
    return out[:, :T]


@torch.no_grad()
def sample_text(module: torch.nn.Module, tokenizer, prompt: str, new_tokens: int, *, window: int, seed: int,
                device: torch.device, autocast: Callable[[], AbstractContextManager], all_ranks: bool,
                interrupted: Callable[[], bool], use_cache: bool = True, temperature: float = 0.8,
                top_k: int = 50, stream: Callable[[str], None] | None = None, length_multiple: int = 1) -> str:
    """`prompt` and `new_tokens` sampled tokens, decoded. `all_ranks`: every rank of a group runs
    this (a sharded model), and they finish together; `interrupted()` true raises Interrupted
    before the next forward. `use_cache`: generate with a KVCache (a model whose forward takes
    one). `stream`: the sampled text goes to it piece by piece as
    the tokens come (whole characters only), and what is returned is the prompt alone.
    `length_multiple`: every forward padded at its end to a multiple of it (sequence parallelism:
    the tp size; `forward_logits`), the context kept that much shorter so that the padding stays
    within the positions trained; a model with local attention then runs without the cache."""
    ids = tokenizer.encode(prompt)
    if not ids:  # there is nothing to continue: the model would start from an arbitrary token
        raise ValueError(f"the prompt {prompt!r} holds no token to continue from")
    x = torch.tensor([ids], device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    text = _TextStream(tokenizer, stream) if stream is not None else None

    def logits_of(tokens, cache=None):
        if interrupted():
            raise Interrupted()
        with autocast():
            return forward_logits(module, tokens, cache, length_multiple)  # (vocabulary shards gathered)

    module.eval()
    if length_multiple > 1:
        use_cache = use_cache and not any(getattr(m, "window", None) is not None for m in module.modules())
        window -= length_multiple - 1
    cache = KVCache(window + length_multiple - 1) if use_cache else None
    try:
        out = generate(logits_of, x, new_tokens, window=window, generator=gen, cache=cache, temperature=temperature,
                       top_k=top_k, on_token=text.add if text is not None else None)
    finally:
        if text is not None:
            text.flush()
    module.train()
    if all_ranks:
        for m in module.modules():  # free what FSDP gathered for the forwards
            if hasattr(m, "reshard"):
                m.reshard()
        dist.barrier()  # and let every rank finish together
    return prompt if text is not None else tokenizer.decode(out[0].tolist())


class _TextStream:
    """Sampled tokens to text as they come: a token can end inside a character (byte-level
    tokenizers), so the text is handed on up to its last whole character; the tokens of the
    rest wait for the next. Only the undecided tail is kept."""

    def __init__(self, tokenizer, out: Callable[[str], None]):
        self.tokenizer, self.out, self.pending = tokenizer, out, []

    def add(self, token: torch.Tensor) -> None:
        self.pending.append(int(token[0, 0]))
        text = self.tokenizer.decode(self.pending)
        if text and not text.endswith("\ufffd"):  # (a character still incomplete decodes to U+FFFD)
            self.out(text)
            self.pending = []
        elif len(self.pending) > 8:  # longer than any character: invalid bytes, not one being completed
            self.flush()

    def flush(self) -> None:
        if self.pending:
            self.out(self.tokenizer.decode(self.pending))
            self.pending = []
