"""Multi-head latent attention (DeepSeek-V2 and V3), in plain PyTorch: model.mla_kv_rank > 0.

Keys and values are not projected from the residual stream head by head; each token's stream is
first compressed into one small latent (width mla_kv_rank, normalised), from which an
up-projection brings every head's key part and value back. The rotation cannot pass through
that up-projection (it would have to turn the latent, which has no heads), so it is decoupled:
each query head has a rotated part of its own (mla_rope_dim wide) beside its unrotated one, and
the key's rotated part is one vector per token, projected from the stream beside the latent and
shared by all heads. A query head's score is then q_nope·k_nope + q_rot·k_rot, divided by
sqrt(head_dim) (times YaRN's mscale² when the rotary scaling says so).

    x ─ wkv_a ─┬─ latent (kv_rank) ─ kv_a_norm ─ wkv_b ─> per head [k_nope | v]
               └─ k_rot (rope_dim, one for all heads) ─ rotate ───> per head [.. | k_rot]
    x ─ wq  (or wq_a ─ q_a_norm ─ wq_b: the queries' own latent) ─> per head [q_nope | q_rot ─ rotate]

Generation caches what the keys and values are brought up from: the latent and the rotated
shared key, (kv_rank + rope_dim) numbers a token a block, where ordinary attention caches
2 × n_heads × head_dim. Under tensor parallelism the compressions (wq_a, q_a_norm, wkv_a,
kv_a_norm) are replicated, the up-projections wq / wq_b and wkv_b split by heads (column-
parallel) and wo row-parallel; the shared rotated key feeds every rank's heads, so its gradient
is a sum over the ranks (`shared_key`, which tensor parallelism replaces on the instance).
Context parallelism replaces `attend`, as Attention's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from scaletrain.model.config import ModelConfig
from scaletrain.model.kv_cache import KVCache
from scaletrain.model.layers import RMSNorm, apply_rope
from scaletrain.model.window import causal_allows
from scaletrain.model.yarn import softmax_mscale

# the latents' norms use their own epsilon, not the model's (DeepSeek's q_a_layernorm, kv_a_layernorm)
LATENT_EPS = 1e-6


class LatentAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.window = None  # (no local attention: what context parallelism and the cache ask)
        self.head_dim, self.rope_dim, self.v_dim = cfg.head_size, cfg.mla_rope_dim, cfg.value_dim
        self.nope_dim, self.kv_rank = cfg.head_size - cfg.mla_rope_dim, cfg.mla_kv_rank
        self.dropout = cfg.dropout
        self.scale = cfg.head_size ** -0.5 * softmax_mscale(cfg)
        H, d = cfg.n_heads, cfg.dim
        if cfg.mla_q_rank:  # the queries' own latent
            self.wq_a = nn.Linear(d, cfg.mla_q_rank, bias=False)
            self.q_a_norm = RMSNorm(cfg.mla_q_rank, LATENT_EPS)
            self.wq_b = nn.Linear(cfg.mla_q_rank, H * self.head_dim, bias=False)
        else:
            self.wq = nn.Linear(d, H * self.head_dim, bias=False)
        self.wkv_a = nn.Linear(d, self.kv_rank + self.rope_dim, bias=False)
        self.kv_a_norm = RMSNorm(self.kv_rank, LATENT_EPS)
        self.wkv_b = nn.Linear(self.kv_rank, H * (self.nope_dim + self.v_dim), bias=False)
        self.wo = nn.Linear(H * self.v_dim, d, bias=False)

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, T, dim) -> (B, T, heads, head_dim): each head's [unrotated | rotated] query, unturned."""
        q = self.wq_b(self.q_a_norm(self.wq_a(x))) if hasattr(self, "wq_a") else self.wq(x)
        return q.view(*x.shape[:2], -1, self.head_dim)  # -1: a tensor-parallel rank's own heads

    def shared_key(self, k_rot: torch.Tensor) -> torch.Tensor:
        """The rotated key part every head reads (B, T, rope_dim), as it is. Tensor parallelism
        replaces this on the instance with one whose backward sums the gradient over its ranks."""
        return k_rot

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                cache: tuple[KVCache, str] | None = None, *, mask: torch.Tensor | None = None) -> torch.Tensor:
        """As Attention.forward: `cache` (generation) holds the latents of the positions before x's;
        `mask` (B, 1, T, T) bool the keys each query sees (packed documents)."""
        q = self.queries(x)
        q_nope, q_rot = q.split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_rot = self.wkv_a(x).split([self.kv_rank, self.rope_dim], dim=-1)
        latent = self.kv_a_norm(latent)  # (B, T, kv_rank)
        q_rot = apply_rope(q_rot, *rope)
        k_rot = apply_rope(self.shared_key(k_rot).unsqueeze(2), *rope).squeeze(2)  # (B, T, rope_dim)
        q = torch.cat((q_nope, q_rot), dim=-1).transpose(1, 2)  # (B, heads, T, head_dim)
        if cache is not None:
            return self._cached(q, latent, k_rot, *cache)
        k, v = self.expand(latent, k_rot)
        y = self.attend(q, k, v, mask, mask is None)  # (B, heads, T, v_dim)
        return self.wo(y.transpose(1, 2).flatten(2))

    def expand(self, latent: torch.Tensor, k_rot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Latents (B, S, kv_rank) and rotated shared keys (B, S, rope_dim) -> keys (B, heads, S,
        head_dim) and values (B, heads, S, v_dim): the up-projection of each head's parts."""
        B, S, _ = latent.shape
        kv = self.wkv_b(latent).view(B, S, -1, self.nope_dim + self.v_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        k = torch.cat((k_nope, k_rot.unsqueeze(2).expand(-1, -1, k_nope.shape[2], -1)), dim=-1)
        return k.transpose(1, 2), v.transpose(1, 2)

    def _cached(self, q: torch.Tensor, latent: torch.Tensor, k_rot: torch.Tensor, cache: KVCache,
                block: str) -> torch.Tensor:
        """Generation: keep the new positions' latents and rotated keys (as the cache's one-head
        "keys" and "values"), then bring every cached position's keys and values up from them."""
        past, T = cache.length, q.shape[2]
        latents, keys, _ = cache.append(block, latent.unsqueeze(1), k_rot.unsqueeze(1))  # (B, 1, S, ...)
        k, v = self.expand(latents.squeeze(1), keys.squeeze(1))
        allowed = None if T == 1 else causal_allows(None, torch.arange(past, past + T, device=q.device),
                                                    torch.arange(k.shape[2], device=q.device))
        y = self._kernel(q, k, v, allowed, False)
        return self.wo(y.transpose(1, 2).flatten(2))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
               causal: bool) -> torch.Tensor:
        """softmax(q kᵀ · scale) v over the keys `mask` (or causality) allows; the values narrower
        than the queries and keys. A method of its own, as Attention's (context parallelism)."""
        return self._kernel(q, k, v, mask, causal)

    def _kernel(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                causal: bool) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=self.scale,
                                              dropout_p=self.dropout if self.training else 0.0)
