"""Attention sinks (gpt-oss): each query head has a learned logit s_h that joins the softmax's
denominator as one more key whose value is zero,

    weights_j = exp(score_j) / (exp(s_h) + sum_k exp(score_k)),   output = sum_j weights_j v_j,

so a query may give most of its weight to nothing. The sink is per head, not per key: however
the keys are cut (the window's tiles, packed documents' masks, context parallelism's blocks), it
enters each query's denominator exactly once. Two ways to add it, one per kind of attention path:

* `sink_attention`: the scores as matmuls (as transformers' eager attention computes them), the
  sink's column appended before the softmax and dropped after it. Plain, windowed, soft-capped,
  packed-document and cached attention all reach it through Attention's one kernel.
* `fold_sink` / `sink_gradient`: a path that keeps an output normalised over the keys it saw and
  its log-sum-exp L (context parallelism's ring and all-gather) merges the sink once, at the end:
  out · exp(L - L'), L' = logaddexp(L, s). With p_sink = exp(s - L'), the sink's gradient is
  -sum over queries of p_sink · rowsum(dO ⊙ out), as for any key whose value is zero.

Costs: one extra column per score row; the matmul path (no fused kernel takes the sink) holds each
tile's scores, as soft-capped attention already does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor,
                   mask: torch.Tensor | None, causal: bool, *, scale: float | None = None, softcap: float = 0.0,
                   dropout: float = 0.0) -> torch.Tensor:
    """softmax over [q kᵀ · scale, s] with the sink's column dropped, times v: q (B, H, T, D), k and v
    (B, Hkv, S, D) with Hkv dividing H, sinks (H,), mask (…, T, S) bool of the keys each query sees
    (None: causality when `causal`, else all). `softcap` caps the scores (never the sink)."""
    if k.shape[1] != q.shape[1]:  # grouped-query: each K/V head serves q_heads / kv_heads query heads
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    scores = (q @ k.transpose(-2, -1)).float() * (scale or q.shape[-1] ** -0.5)  # (B, H, T, S)
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    T, S = scores.shape[-2:]
    if mask is None and causal:  # query i sees keys up to S - T + i
        mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(diagonal=S - T)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    weights = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]  # the sink's share dropped
    return F.dropout(weights.type_as(q), dropout) @ v


def fold_sink(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An attention output normalised over its keys, out (B, H, T, D), with their log-sum-exp
    (B, H, T, 1), as the output with the sink in the denominator, and the log-sum-exp with it."""
    with_sink = torch.logaddexp(lse, sinks.float().view(1, -1, 1, 1))
    return out * torch.exp(lse - with_sink), with_sink


def sink_gradient(sinks: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """d loss / d sinks (H,): lse (B, H, T, 1) the log-sum-exp with the sink, delta (B, H, T, 1)
    = rowsum(dO ⊙ out) of the output with the sink."""
    p_sink = torch.exp(sinks.float().view(1, -1, 1, 1) - lse)
    return -(p_sink * delta).sum(dim=(0, 2, 3)).to(sinks.dtype)
