"""Drawing a token from logits: temperature, then top-k, then top-p, then a draw from what is left.

The order is Hugging Face's and vLLM's: top-p keeps, of what top-k kept (renormalised), the fewest most
likely tokens whose probabilities add up to at least top_p. The log-probability kept for the trainer is
of the FULL distribution at the temperature (`full_logprobs`), before any filtering, as TRL computes it.

Each completion draws from a generator of its own, seeded by (seed, prompt, completion) alone: how the
completions are batched, and what else is in the batch, do not change its draws.
"""

from __future__ import annotations

import torch

_MASK64 = (1 << 64) - 1


def _mix(x: int) -> int:
    """splitmix64's finaliser: neighbouring inputs give unrelated 64-bit outputs."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def completion_seed(seed: int, prompt: int, completion: int) -> int:
    """The seed of completion `completion` of prompt `prompt` (a 63-bit integer)."""
    return _mix(_mix(_mix(seed & _MASK64) ^ prompt) ^ completion) >> 1


def completion_generator(seed: int, prompt: int, completion: int, device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(completion_seed(seed, prompt, completion))


def scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """(B, V) logits in fp32 divided by the temperature: what both the sampler and the trainer use."""
    return logits.float() / temperature


def full_logprobs(scaled_logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """(B,) log-probability of each row's token under the whole distribution (no filtering)."""
    return torch.log_softmax(scaled_logits, dim=-1).gather(-1, tokens[:, None])[:, 0]


def filtered_probs(scaled_logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """(B, V) the probabilities tokens are drawn with: 0 for those top-k or top-p leave out, the rest
    renormalised. Ties at the k-th value are all kept, as Hugging Face's top-k keeps them."""
    logits = scaled_logits
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        ordered, order = torch.sort(probs, dim=-1, descending=True)
        before = ordered.cumsum(-1) - ordered  # the mass of the tokens more likely than each
        drop_sorted = before >= top_p  # (the most likely token always stays: nothing is before it)
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def draw(probs: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """(B,) one token per row of probs (B, V), row b from generators[b]."""
    return torch.cat([torch.multinomial(p, 1, generator=g) for p, g in zip(probs, generators, strict=True)])
