"""Model FLOPs per token, the numerator of MFU.

Training a decoder costs about 6 FLOPs per matmul parameter per token (2 forward, 4 backward;
Kaplan et al. 2020, section 2.1) plus the attention scores and their weighted sum, which grow
with the sequence: 12 * n_layers * dim * seq_len per token (PaLM, Chowdhery et al. 2022,
appendix B). Like PaLM we do not halve the attention term for the causal mask, and we count
recomputation nowhere: MFU measures useful work, so activation checkpointing lowers it.
"""

from __future__ import annotations

from scaletrain.model.config import ModelConfig


def block_matmul_params(cfg: ModelConfig, tp: int = 1) -> int:
    """Parameters of one transformer block that multiply activations — wq, wk, wv, wo and the
    MLP's two (GELU) or three (SwiGLU) matrices — on one of `tp` tensor-parallel ranks (each
    matrix is split over them). Norms and biases are negligible and left out. The one count of
    a block's matmul work: FLOPs per token, the pipeline's balanced split by compute and the
    planner's memory and time all read it."""
    d, kv, q = cfg.dim, cfg.kv_heads * cfg.head_size, cfg.n_heads * cfg.head_size
    attn = d * q + 2 * d * kv + q * d  # wq, wk, wv, wo
    mlp = (3 if cfg.activation == "swiglu" else 2) * d * cfg.hidden_dim
    return (attn + mlp) // tp


def matmul_params(cfg: ModelConfig) -> int:
    """Parameters that multiply activations: the blocks' linear layers and the output head.
    The input embedding is a lookup (no FLOPs)."""
    return cfg.n_layers * block_matmul_params(cfg) + cfg.dim * cfg.vocab_size


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Forward + backward FLOPs per trained token."""
    # the scores and their weighted sum run at the heads' width, n_heads * head_size (= dim unless set apart)
    return 6.0 * matmul_params(cfg) + 12.0 * cfg.n_layers * cfg.n_heads * cfg.head_size * seq_len
