"""YaRN rotary scaling (Peng et al. 2023; gpt-oss, DeepSeek-V3): each rotary pair's speed is
blended between its own (pairs that turn many times over the original context: beta_fast or more)
and its speed divided by the factor (pairs that turn fewer than beta_slow times), linearly in the
pair's index between the two; and q and k are each scaled by 0.1·ln(factor) + 1, which sharpens
the softmax as the context grows. Read by the rotary tables (model/transformer.py)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from scaletrain.model.config import ModelConfig

if TYPE_CHECKING:
    import torch


def _pair_of(rotations: float, dim: int, base: float, original: int) -> float:
    """The (fractional) pair index whose wavelength fits `rotations` times in `original` positions."""
    return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))


def yarn_frequencies(freq: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """freq (rotary_dim // 2,) theta^(-2i/d) -> YaRN's blend of freq and freq / rope_factor."""
    import torch

    dim, base = cfg.rotary_dim, cfg.rope_theta
    low = _pair_of(cfg.rope_beta_fast, dim, base, cfg.rope_original_max_seq_len)
    high = _pair_of(cfg.rope_beta_slow, dim, base, cfg.rope_original_max_seq_len)
    if cfg.rope_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # (a ramp of zero width)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=freq.device) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: the pair keeps its speed (fast pairs, low index), 0: divided by the factor
    return freq / cfg.rope_factor * (1 - keep) + freq * keep


def yarn_attention_factor(cfg: ModelConfig) -> float:
    """The factor on q and k (so on the scores, squared): 0.1·ln(rope_factor) + 1."""
    return 1.0 if cfg.rope_factor <= 1 else 0.1 * math.log(cfg.rope_factor) + 1.0
