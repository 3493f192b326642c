"""Model FLOPs per token, the numerator of MFU.

Training a decoder costs about 6 FLOPs per matmul parameter per token (2 forward, 4 backward;
Kaplan et al. 2020, section 2.1) plus the attention scores and their weighted sum, which grow
with the sequence: 12 * n_layers * dim * seq_len per token (PaLM, Chowdhery et al. 2022,
appendix B). Like PaLM we do not halve the attention term for the causal mask, and we count
recomputation nowhere: MFU measures useful work, so activation checkpointing lowers it. A block
with a window (sliding or chunked) counts the window's keys in place of seq_len.
"""

from __future__ import annotations

from scaletrain.model.config import ModelConfig
from scaletrain.model.window import key_span


def block_matmul_params(cfg: ModelConfig, tp: int = 1, index: int | None = None) -> int:
    """Parameters of one transformer block that multiply each token's activations — wq, wk, wv,
    wo and the MLP's two (GELU) or three (SwiGLU) matrices — on one of `tp` tensor-parallel ranks
    (each matrix is split over them). Norms and biases are negligible and left out. The one count
    of a block's matmul work: FLOPs per token, the pipeline's balanced split by compute and the
    planner's memory and time all read it.

    A mixture-of-experts block (`index`: which block; None = the average block) counts its
    *active* parameters: the router, the top_k experts each token visits and the shared experts,
    never all experts. The experts are not split by tp."""
    d = cfg.dim
    whole, attn = attention_matmul_params(cfg)
    per_mlp = 3 if cfg.gated else 2
    dense = per_mlp * d * cfg.hidden_dim
    if not cfg.moe_experts:
        return whole + (attn + dense) // tp
    moe = d * cfg.moe_experts + per_mlp * d * cfg.expert_hidden * (cfg.moe_top_k + cfg.moe_shared_experts)
    if index is not None:
        return whole + ((attn + dense) // tp if not cfg.is_moe_block(index) else attn // tp + moe)
    blocks = cfg.moe_blocks
    return round(whole + attn / tp + (blocks * moe + (cfg.n_layers - blocks) * dense / tp) / cfg.n_layers)


def attention_matmul_params(cfg: ModelConfig) -> tuple[int, int]:
    """A block's attention matrices as (those whole on every tensor-parallel rank, those split by
    heads): wq, wk, wv, wo all split; latent attention (model/mla.py) keeps its compressions
    (wq_a, wkv_a) whole and splits the up-projections (wq or wq_b, wkv_b) and wo."""
    d, H, hd = cfg.dim, cfg.n_heads, cfg.head_size
    if not cfg.mla_kv_rank:
        kv, q = cfg.kv_heads * hd, H * hd
        return 0, d * q + 2 * d * kv + q * d  # wq, wk, wv, wo
    r, rope, v = cfg.mla_kv_rank, cfg.mla_rope_dim, cfg.value_dim
    whole = d * (r + rope) + d * cfg.mla_q_rank  # wkv_a, wq_a
    split = (cfg.mla_q_rank or d) * H * hd + r * H * (hd - rope + v) + H * v * d  # wq_b (or wq), wkv_b, wo
    return whole, split


def matmul_params(cfg: ModelConfig) -> int:
    """Parameters that multiply each token's activations: the blocks' linear layers (a mixture's
    active ones) and the output head. The input embedding is a lookup (no FLOPs). Multi-token
    prediction (model/mtp.py) adds, per depth, its block, eh_proj (2 dim x dim) and the head again."""
    d = cfg.dim
    mtp = sum(block_matmul_params(cfg, index=cfg.n_layers + j) + 2 * d * d + d * cfg.vocab_size
              for j in range(cfg.mtp_depth))
    return sum(block_matmul_params(cfg, index=i) for i in range(cfg.n_layers)) + d * cfg.vocab_size + mtp


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Forward + backward FLOPs per trained token: 6 per active matmul parameter plus attention
    (MFU of a mixture of experts counts the experts a token visits, never all of them)."""
    # the scores and their weighted sum run at the heads' width, n_heads * head_size (= dim unless set
    # apart), over the keys a query sees: the sequence, or a local block's window (model/window.py)
    keys = sum(key_span(cfg, seq_len, i) for i in range(cfg.n_layers + cfg.mtp_depth))  # (with MTP's blocks)
    # (latent attention: the scores at the query/key width, the weighted sum at the value width)
    return 6.0 * matmul_params(cfg) + 6.0 * cfg.n_heads * (cfg.head_size + cfg.value_dim) * keys


def ns_flops(rows: int, cols: int, steps: int = 1) -> float:
    """FLOPs of Muon's Newton-Schulz on a rows x cols matrix (scaletrain.optim.muon), per iteration times
    `steps`: with m the shorter side and n the longer, X X' (2m²n), its square (2m³), the product with X
    (2m²n)."""
    m, n = min(rows, cols), max(rows, cols)
    return steps * (4.0 * m * m * n + 2.0 * m ** 3)
