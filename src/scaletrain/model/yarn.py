"""YaRN rotary scaling (Peng et al. 2023), as DeepSeek-V3 and gpt-oss use it: the pairs that turn
many times over the original context keep their speed, those that turn few times are divided by
the factor, a linear ramp between; and the rotated coordinates are multiplied by an attention
factor (so the rotary part of each score by its square); gpt-oss leaves the ramp's bounds
fractional (rope_truncate=false) and takes the plain factor 1 + 0.1 ln(factor). Latent attention (model/mla.py) also
multiplies its softmax scale by `softmax_mscale`, as DeepSeek does."""

from __future__ import annotations

import math

import torch

from scaletrain.model.config import ModelConfig


def mscale(factor: float, m: float = 1.0) -> float:
    """YaRN's magnitude correction 1 + 0.1 m ln(factor) (1 for a factor of at most 1)."""
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


def attention_factor(cfg: ModelConfig) -> float:
    """What the rotated coordinates are multiplied by (1 without YaRN)."""
    if cfg.rope_scaling != "yarn":
        return 1.0
    if cfg.rope_mscale and cfg.rope_mscale_all_dim:
        return mscale(cfg.rope_factor, cfg.rope_mscale) / mscale(cfg.rope_factor, cfg.rope_mscale_all_dim)
    return mscale(cfg.rope_factor)


def softmax_mscale(cfg: ModelConfig) -> float:
    """Latent attention's factor on its softmax scale: mscale(factor, mscale_all_dim)^2 (1 without it)."""
    if cfg.rope_scaling != "yarn" or not cfg.rope_mscale_all_dim:
        return 1.0
    return mscale(cfg.rope_factor, cfg.rope_mscale_all_dim) ** 2


def yarn_frequencies(cfg: ModelConfig, freq: torch.Tensor) -> torch.Tensor:
    """The unscaled frequencies `freq` (rotary_dim/2,) as YaRN stretches them."""
    d, base, original = cfg.rotary_dim, cfg.rope_theta, cfg.rope_original_max_seq_len

    def pair(rotations: float) -> float:  # the pair index that turns `rotations` times over the original context
        return d * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = pair(cfg.rope_beta_fast), pair(cfg.rope_beta_slow)
    if cfg.rope_truncate:  # whole pairs (transformers' default truncate=True); gpt-oss keeps the fractions
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001  # (a ramp of zero width)
    ramp = ((torch.arange(d // 2, dtype=torch.float32, device=freq.device) - low) / (high - low)).clamp(0, 1)
    return freq / cfg.rope_factor * ramp + freq * (1 - ramp)  # ramp 0: keep the speed, 1: divide it
