"""Model FLOPs per token, the numerator of MFU.

Training a decoder costs about 6 FLOPs per matmul parameter per token (2 forward, 4 backward;
Kaplan et al. 2020, section 2.1) plus the attention scores and their weighted sum, which grow
with the sequence: 12 * n_layers * dim * seq_len per token (PaLM, Chowdhery et al. 2022,
appendix B). Like PaLM we do not halve the attention term for the causal mask, and we count
recomputation nowhere: MFU measures useful work, so activation checkpointing lowers it. A block
with a window (sliding or chunked) counts the window's keys in place of seq_len.

A linear-attention block (model/deltanet.py) has no scores over the sequence: its chunked delta
rule costs, per token and value head, with C = min(linear_chunk, seq_len) the chunk's positions,
2·C·dk (q·k) + 2·C·dk (k·k) + C·(dk + dv) (the triangular solve) + 2·C·dv (the weighted sum) in
the chunk, and 3 × 2·dk·dv for the state (read by the writes, read by the queries, written), plus
2 per convolution tap and channel; 3× that forward for training, as the attention term counts.
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
    if index is None and cfg.linear_heads:  # the mean of blocks whose attention differs
        return round(sum(block_matmul_params(cfg, tp, i) for i in range(cfg.n_layers)) / cfg.n_layers)
    d = cfg.dim
    whole, attn = attention_matmul_params(cfg, index)
    per_mlp = 3 if cfg.gated else 2
    dense = per_mlp * d * cfg.hidden_dim
    if not cfg.moe_experts:
        return whole + (attn + dense) // tp
    # the router (and the shared experts' gate), the top_k experts, the shared experts
    moe = d * (cfg.moe_experts + cfg.moe_shared_gate) + per_mlp * d * (cfg.expert_hidden * cfg.moe_top_k
                                                                        + cfg.shared_hidden)
    if index is not None:
        return whole + ((attn + dense) // tp if not cfg.is_moe_block(index) else attn // tp + moe)
    blocks = cfg.moe_blocks
    return round(whole + attn / tp + (blocks * moe + (cfg.n_layers - blocks) * dense / tp) / cfg.n_layers)


def attention_matmul_params(cfg: ModelConfig, index: int | None = None) -> tuple[int, int]:
    """A block's attention matrices as (those whole on every tensor-parallel rank, those split by
    heads): wq, wk, wv, wo all split (wq twice as wide with model.attn_gate); latent attention
    (model/mla.py) keeps its compressions (wq_a, wkv_a) whole and splits the up-projections (wq or
    wq_b, wkv_b) and wo; block `index`, if a linear-attention one, its projections, all split."""
    d, H, hd = cfg.dim, cfg.n_heads, cfg.head_size
    if index is not None and cfg.is_linear_block(index):
        return 0, linear_attention_params(cfg)
    if not cfg.mla_kv_rank:
        kv, q = cfg.kv_heads * hd, H * hd
        return 0, d * q * (2 if cfg.attn_gate else 1) + 2 * d * kv + q * d  # wq, wk, wv, wo
    r, rope, v = cfg.mla_kv_rank, cfg.mla_rope_dim, cfg.value_dim
    whole = d * (r + rope) + d * cfg.mla_q_rank  # wkv_a, wq_a
    split = (cfg.mla_q_rank or d) * H * hd + r * H * (hd - rope + v) + H * v * d  # wq_b (or wq), wkv_b, wo
    return whole, split


def linear_attention_params(cfg: ModelConfig) -> int:
    """A linear-attention block's matmul parameters: in_qkvz, in_ba and out (model/deltanet.py)."""
    d, hk, hv, dk, dv = cfg.dim, cfg.linear_heads, cfg.linear_v_heads, cfg.linear_head_dim, cfg.linear_v_dim
    return d * (2 * hk * dk + 2 * hv * dv) + d * 2 * hv + hv * dv * d


def linear_attention_flops(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token of one linear-attention block beside its matmul parameters: the
    chunked delta rule and the convolution (see the module's docstring)."""
    hv, dk, dv, c = cfg.linear_v_heads, cfg.linear_head_dim, cfg.linear_v_dim, min(seq_len, cfg.linear_chunk)
    channels = 2 * cfg.linear_heads * dk + hv * dv
    return 3.0 * (hv * (c * (5 * dk + 3 * dv) + 6 * dk * dv) + 2 * cfg.linear_conv * channels)


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
    linear_blocks = sum(cfg.is_linear_block(i) for i in range(cfg.n_layers)) if cfg.linear_heads else 0
    full = [i for i in range(cfg.n_layers + cfg.mtp_depth)  # (with MTP's blocks, full attention)
            if i >= cfg.n_layers or not cfg.is_linear_block(i)]
    keys = sum(key_span(cfg, seq_len, i) for i in full)
    linear = linear_blocks * linear_attention_flops(cfg, seq_len) if linear_blocks else 0.0
    # (latent attention: the scores at the query/key width, the weighted sum at the value width)
    return 6.0 * matmul_params(cfg) + 6.0 * cfg.n_heads * (cfg.head_size + cfg.value_dim) * keys + linear


def ns_flops(rows: int, cols: int, steps: int = 1) -> float:
    """FLOPs of Muon's Newton-Schulz on a rows x cols matrix (scaletrain.optim.muon), per iteration times
    `steps`: with m the shorter side and n the longer, X X' (2m²n), its square (2m³), the product with X
    (2m²n)."""
    m, n = min(rows, cols), max(rows, cols)
    return steps * (4.0 * m * m * n + 2.0 * m ** 3)
