"""Activation memory per transformer layer, in closed form (see scaletrain.plan.memory_model for
the two accountings, Korthikanti et al.'s and scaletrain's own layer's), and how many
micro-batches' activations a pipeline schedule keeps in flight.
"""

from __future__ import annotations

from functools import lru_cache

from scaletrain.model.config import ModelConfig
from scaletrain.model.window import mean_key_span
from scaletrain.plan.params import Dtypes, dtypes_for, layer_params
from scaletrain.plan.spec import Layout, Workload
from scaletrain.vocab import AC_MODES, CP_METHODS, PP_SCHEDULES, is_multi_chunk, unknown


def korthikanti_layer_bytes(s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False,
                            recompute: str = "none") -> float:
    """Activation bytes of one GPT layer in 16-bit precision (Korthikanti et al. 2022, Table 2)."""
    if recompute == "full":
        return 2 * s * b * h / (t if sp else 1)
    if recompute == "selective":
        return 34 * s * b * h / t if sp else s * b * h * (10 + 24 / t)
    if sp:
        return s * b * h / t * (34 + 5 * a * s / h)
    return s * b * h * (10 + 24 / t + 5 * a * s / (h * t))


def layer_activation_bytes(cfg: ModelConfig, wl: Workload, b: int, tp: int, sp: bool, ac: str,
                           cp: int = 1, moe: bool = False, ep: int = 1) -> float:
    """Bytes one layer keeps for backward, per micro-batch of b sequences, on one rank: for
    scaletrain's layer (`_scaletrain_layer_bytes`) or, for another engine, Megatron's accounting
    (`_megatron_layer_bytes`). Context parallelism splits every sequence over cp ranks. `moe`:
    a mixture-of-experts block (its experts split over `ep` ranks) instead of a dense one."""
    if wl.engine != "scaletrain":
        return _megatron_layer_bytes(cfg, wl, b, tp, sp, ac, cp, moe, ep)
    return _scaletrain_layer_bytes(cfg, wl, b, tp, sp, ac, cp, moe, ep)


def expert_load(wl: Workload, ep: int) -> float:
    """The busiest rank's routed tokens over the mean: the workload's imbalance (max / mean
    tokens per expert) under expert parallelism; 1 in one rank's experts, which take every
    routed token of the rank whatever their split."""
    return wl.moe_imbalance if ep > 1 else 1.0


def attention_widths(cfg: ModelConfig) -> tuple[int, int, int]:
    """(query, key, value) widths per token of a layer's attention, all heads: n_heads x head_size for the
    queries, kv_heads x head_size for keys and values; latent attention's keys every head's nope + rope
    (head_size) and its values mla_v_dim each (value_dim)."""
    q = cfg.n_heads * cfg.head_size
    if cfg.mla_kv_rank:
        return q, q, cfg.n_heads * cfg.value_dim
    kv = cfg.kv_heads * cfg.head_size
    return q, kv, kv


def latent_bytes_per_token(cfg: ModelConfig, tp: int, c: float, selective: bool = False) -> float:
    """What latent attention (model/mla.py) saves per token beyond q, k, v and the output: the key/value
    compression's output (kv_rank + rope_dim, its norm's input), the normalised latent (the up-projection's
    input) and the norm's fp32 1/rms, the up-projection's output (heads x (nope + value): its value half
    is a view the kernel keeps), and with a query latent its compression's output, normalised copy and
    1/rms (in 16 bits, also the fp32 copy of its input each norm makes). The compressions are whole on every
    tp rank; the up-projection is split by heads. `selective` recomputation keeps the matmuls' outputs alone."""
    if not cfg.mla_kv_rank:
        return 0.0
    r, rope, qr = cfg.mla_kv_rank, cfg.mla_rope_dim, cfg.mla_q_rank
    up = cfg.n_heads * (cfg.head_size - rope + cfg.value_dim) / tp
    if selective:
        return (r + rope + up + qr) * c
    upcast = (r + qr) * 4 if c != 4 else 0.0
    return (r + rope + r + up + 2 * qr) * c + 4 * (2 if qr else 1) + upcast


def _megatron_layer_bytes(cfg: ModelConfig, wl: Workload, b: int, tp: int, sp: bool, ac: str, cp: int,
                          moe: bool = False, ep: int = 1) -> float:
    """Korthikanti et al. 2022, section 4.1, generalised to grouped-query attention and SwiGLU.
    In 16-bit, per token: the two norms' inputs (2h each), the QKV and first MLP matmuls' inputs
    (2h each), q and k (2(q + kv)), v (2kv), the output projection's input (2q), the MLP's
    inner activations (2f per matrix of width f, twice for GELU's input and output, three times
    for SwiGLU's two inputs and product), one dropout mask byte per hidden element for each
    residual dropout, and for eager attention the softmax output and its dropout mask
    (2 + 1 bytes × heads × s). For GPT (h = q = kv, f = 4h, dropout) this is their
    sbh(34 + 5as/h). Tensor parallelism divides what is split by heads or by f; sequence
    parallelism divides the rest too. Selective recomputation drops the s × s terms; full
    recomputation keeps the layer's input. A mixture of experts (Megatron-Core's, experts not
    split by tp: each rank routes its own tokens, sequence shards under sp) keeps per token the
    router's fp32 scores, and per routed token (top_k of them, × the busiest rank's load under
    ep) the dispatched input and output and the experts' inner activations."""
    d = dtypes_for(wl)
    s, h, a = wl.seq_len / cp, cfg.dim, cfg.n_heads
    (q, k, v), f = attention_widths(cfg), cfg.hidden_dim
    c = d.compute
    rest = 1 / tp if sp else 1.0  # the norms, dropouts and matmul inputs outside the tp split
    if ac == "full":
        return b * s * h * d.residual * rest
    masks = 2 * h if cfg.dropout > 0 else 0
    outside = (2 * h * d.residual + 2 * h * c + masks) * rest
    n_ffn = 3 if cfg.gated else 2
    o = cfg.n_heads * cfg.value_dim  # the attention's output: every query head's, at the values' width
    inside = (q + k + v + o) * c + n_ffn * f * c  # q, k, v, wo's input; the MLP's inner tensors
    inside = inside / tp + latent_bytes_per_token(cfg, tp, c)
    if moe:
        routed = cfg.moe_top_k * expert_load(wl, ep) * (n_ffn * cfg.expert_hidden + 2 * h) * c
        shared = n_ffn * cfg.shared_hidden * c
        inside += (routed + shared + cfg.moe_experts * 4) * (1 / tp if sp else 1.0) - n_ffn * f * c / tp
    scores = 0.0
    if wl.attention == "eager" and ac != "selective":
        # softmax output, and with dropout its mask and dropped output (keys span the sequence, or a window's tiles)
        scores = a / tp * mean_key_span(cfg, wl.seq_len, kernel=True) * ((2 * c + 1) if cfg.dropout > 0 else c)
    elif wl.attention == "flash":
        scores = a / tp * 4  # log-sum-exp
    return b * s * (outside + inside + scores)


def _scaletrain_layer_bytes(cfg: ModelConfig, wl: Workload, b: int, tp: int, sp: bool, ac: str, cp: int,
                           moe: bool = False, ep: int = 1) -> float:
    """What each operation of scaletrain's layer saves for backward (checked against a count of
    the real layer's saved tensors, `scaletrain.plan.trace`; a mixture of experts' against the
    real layer's in tests/test_planner_moe.py)."""
    d = Dtypes.of(wl.precision)
    s, h, a = wl.seq_len / cp, cfg.dim, cfg.n_heads
    (q, k, v), f = attention_widths(cfg), cfg.hidden_dim
    s_loc = s / tp if sp else s  # the residual stream's tokens on this rank
    x = b * s_loc * h * d.residual  # the layer's input (the previous layer's output)
    if ac == "full":
        return x
    qkv = b * s * ((q + k + v) / tp * d.compute + latent_bytes_per_token(cfg, tp, d.compute, ac == "selective"))
    o = cfg.n_heads * cfg.value_dim  # the attention's output: every query head's, at the values' width
    attn_out = b * s * o / tp * d.compute
    lse = b * a / tp * s * 4
    if wl.attention == "eager" and ac != "selective":
        # materialized scores: the softmax output (selective recomputation recomputes them), over the
        # sequence's keys or a window's tiles
        lse = b * a / tp * s * mean_key_span(cfg, wl.seq_len, kernel=True) * d.compute
    n_ffn = 3 if cfg.gated else 2
    if ac == "selective":  # matmul and attention outputs; element-wise ops are recomputed
        mm_out = 2 * b * s * h * d.compute  # wo and w2 outputs (before their reduction)
        ffn = (n_ffn - 1) * b * s * f / tp * d.compute
        if moe:  # the grouped matmuls are recomputed; the router's and the shared experts' matmuls kept
            n, shared = b * s / tp, cfg.shared_hidden  # the tokens this rank routes
            mm_out = b * s * h * d.compute + n * cfg.moe_experts * d.compute
            ffn = n * ((n_ffn - 1) * shared + h) * d.compute if shared else 0.0
        return x + qkv + attn_out + lse + mm_out + ffn
    if ac != "none":
        raise unknown("activation checkpointing", ac, AC_MODES)
    # the residual stream is kept by the norms that read it — except our RMSNorm on a
    # low-precision stream, which keeps only the fp32 copy it makes (counted in norm_extra)
    if not _norm_keeps_input(cfg, d):
        x = 0.0
    # the attention half: the normalized input of q, k and v (autocast casts the input once per
    # matmul — it caches only the casts of weights — so q, k and v each keep a copy), the norm's
    # extra and the residual branch's dropout mask
    attn_in = (3 if d.autocast else 1) * b * s * h * d.compute
    norm_extra = _norm_extra(cfg, d, b, s_loc)
    mask = b * s_loc * h if cfg.dropout > 0 else 0.0  # nn.Dropout's bool mask
    # context parallelism keeps only this rank's tokens (ring and allgather keep their own K/V,
    # not the other ranks': they gather or pass them round again in backward); ring and
    # allgather keep their output in fp32 beside the compute-dtype copy the output projection keeps
    cp_out = b * s * o / tp * (4 - d.compute) if cp > 1 else 0.0
    half = moe_half_bytes(cfg, wl, b, tp, sp, cp, ep) if moe else mlp_half_bytes(cfg, wl, b, tp, sp, cp)
    return x + attn_in + norm_extra + mask + qkv + attn_out + lse + cp_out + half


def mlp_half_bytes(cfg: ModelConfig, wl: Workload, b: int, tp: int, sp: bool, cp: int) -> float:
    """What scaletrain's layer keeps for its MLP half, without checkpointing: the residual
    between attention and MLP (kept by the norm that reads it), the norm's extra, the
    normalized input of the MLP's column-parallel matmuls (one copy per matmul under autocast),
    the MLP's inner tensors and the branch's dropout mask. Backward frees it before it reaches
    the layer's attention."""
    d = Dtypes.of(wl.precision)
    s, h, f = wl.seq_len / cp, cfg.dim, cfg.hidden_dim
    s_loc = s / tp if sp else s
    n_ffn = 3 if cfg.gated else 2
    residual = b * s_loc * h * d.residual if _norm_keeps_input(cfg, d) else 0.0
    mlp_in = ((n_ffn - 1) if d.autocast else 1) * b * s * h * d.compute
    ffn = (2 if cfg.activation == "gelu" else 4) * b * s * f / tp * d.compute
    mask = b * s_loc * h if cfg.dropout > 0 else 0.0
    return residual + _norm_extra(cfg, d, b, s_loc) + mlp_in + ffn + mask


def moe_half_bytes(cfg: ModelConfig, wl: Workload, b: int, tp: int, sp: bool, cp: int, ep: int = 1) -> float:
    """`mlp_half_bytes` of a mixture-of-experts block (`scaletrain.model.moe.MoE`), for the n
    tokens a rank routes and the n·k routed copies of them (top_k each; under expert parallelism
    the busiest rank's experts take `expert_load` times the mean). Under tp every rank routes its
    own sequence shard, 1/tp of its cp chunk's tokens, with or without sp (without, the block
    slices the replicated input into a contiguous copy before the MoE and all-gathers the output
    after it, neither saving anything for backward: parallel/tensor_parallel.py); the residual,
    the norm's tensors and the dropout mask are the residual stream's, replicated without sp:

    * per token: the router's input (fp32 in every mode; autocast makes a compute-dtype copy per
      shared-expert matrix), its fp32 scores (softmax or sigmoid output), the logits and
      log-sum-exp for the z-loss, another softmax for the Switch loss;
    * per routed token: the chosen experts, the grouping order and the token index (int64), the
      routing weight in the compute dtype (and before renormalisation in fp32); the grouped
      input, the experts' inner tensors (SwiGLU: both matmul outputs, the SiLU and the
      product; GELU: its input and output), their output (kept by the weighting) and the
      weighted output (kept by the index_add that sums it back per token);
    * under ep (`scaletrain.parallel.expert_parallel.dispatch`), the grouped input and inner
      tensors are those of the tokens arriving on this rank, with two int64 indices each (the
      order that groups the arrivals by local expert, and its inverse that puts the outputs
      back in arrival order); the output the weighting keeps is the reverse all-to-all's, of the
      n·k rows this rank sent (the exchanges save nothing else: their backward is the opposite
      exchange of the gradient);
    * the shared experts' MLP's inner tensors, the residual, the norm's extra and the dropout mask.
    """
    d = Dtypes.of(wl.precision)
    s, h, c = wl.seq_len / cp, cfg.dim, d.compute
    s_loc = s / tp if sp else s  # the residual stream's tokens on this rank
    n = b * s / tp  # the tokens this rank routes
    E, k, he = cfg.moe_experts, cfg.moe_top_k, cfg.expert_hidden
    n_ffn = 3 if cfg.gated else 2
    shared = cfg.shared_hidden
    residual = b * s_loc * h * d.residual if _norm_keeps_input(cfg, d) else 0.0
    # the router's input is fp32 in every mode (the block's input itself when that is fp32, else an
    # fp32 copy); under autocast each shared-expert matrix makes its own compute-dtype copy, without
    # it a compute-dtype input is kept by them as it is
    fp32_input = d.autocast or c == 4
    shared_copies = ((n_ffn - 1) if d.autocast else (0 if fp32_input else 1)) if shared else 0
    router = n * E * 4 + (n * E * 4 + n * 4 if cfg.moe_z_loss else 0.0) + (n * E * 4 if cfg.moe_aux_loss else 0.0)
    routing = n * k * (3 * 8 + c + (4 if cfg.moe_renorm else 0)) + (n * 4 if cfg.moe_renorm else 0.0)
    arrived = n * k * expert_load(wl, ep)
    inner = (2 if cfg.activation == "gelu" else 4) * he * c
    experts = arrived * (h * c + inner + (2 * 8 if ep > 1 else 0)) + 2 * n * k * h * c
    shared_ffn = (2 if cfg.activation == "gelu" else 4) * n * shared * c
    mask = b * s_loc * h if cfg.dropout > 0 else 0.0
    inputs = residual + _norm_extra(cfg, d, b, s_loc) + n * h * 4 + shared_copies * n * h * c
    return inputs + router + routing + experts + shared_ffn + mask


def attention_backward_bytes(cfg: ModelConfig, wl: Workload, b: int, tp: int, cp: int = 1,
                             cp_method: str = Layout.cp_method) -> float:
    """The most one layer's attention holds at once in backward beyond the activations it saved,
    per micro-batch of b sequences, on one rank (scaletrain's attention; T = seq_len / cp this
    rank's tokens, H = n_heads / tp heads, q = H × head_size, kv the K/V width):

    * one process, and ulysses (PyTorch's fused kernel on H/cp heads over the whole sequence,
      the same bytes): the output's gradient arriving and the dq, dk, dv the kernel returns,
      b·T·(2q + 2kv) in the compute dtype (ulysses copies K/V to every head when cp does not
      divide the K/V heads);
    * ring and allgather (`scaletrain.parallel.context_parallel`), whose backward recomputes the
      scores TILE query rows at a time against a block of keys (ring: one rank's T keys per
      step; allgather: all seq_len keys at once): fp32 score tiles of b·H·TILE·keys — four with
      more than one tile per block (the previous tile's probabilities and score gradient, and
      the new scores with the scaled matmul they are masked from), three with one (probabilities,
      dO·vᵀ and its difference from rowsum(dO ⊙ O)) — the bool causal mask of the queries
      against the block's keys, and with more than one tile that tile's negated mask; the K/V
      held (ring: one block, allgather: the whole sequence's), copied to q's heads under
      grouped-query attention; fp32 dq, and per block fp32 dk, dv with q's heads (ring: also
      the block's dK/dV accumulator that travels with it); the output's gradient (and its fp32
      copy, and fp32 copies of K/V, in 16-bit) and rowsum(dO ⊙ O). Allgather's other moment,
      the reduce-scatter of dK/dV, holds the whole sequence's dk, dv, their stack and its
      contiguous copy instead of the tiles.
    """
    if cp == 1 or cp_method == "ulysses":
        c, T = Dtypes.of(wl.precision).compute, wl.seq_len / cp
        q = cfg.n_heads / tp * cfg.head_size
        kv = q if cp > 1 and (cfg.kv_heads // tp) % cp else cfg.kv_heads / tp * cfg.head_size
        return b * T * (2 * q + 2 * kv) * c
    return _tiled_backward_bytes(cfg, wl, b, tp, cp, cp_method)


def _tiled_backward_bytes(cfg: ModelConfig, wl: Workload, b: int, tp: int, cp: int, cp_method: str) -> float:
    """attention_backward_bytes of ring and allgather (at any cp: one rank is one block)."""
    from scaletrain.parallel.context_parallel import TILE

    d = Dtypes.of(wl.precision)
    c, T, S = d.compute, wl.seq_len / cp, wl.seq_len
    H, kv_heads = cfg.n_heads / tp, cfg.kv_heads / tp
    q = H * cfg.head_size
    if cp_method not in ("ring", "allgather"):
        raise unknown("context-parallel method", cp_method, CP_METHODS)
    kv = kv_heads * cfg.head_size
    keys = T if cp_method == "ring" else S
    rows = min(TILE, T)
    several = T > TILE
    tiles = (4 if several else 3) * b * H * rows * keys * 4
    masks = T * keys + (rows * keys if several else 0.0)
    held = 2 * b * keys * kv * c + (2 * b * keys * q * c if kv != q else 0.0)
    upcast = (2 * b * keys * q + b * T * q) * 4 if c != 4 else 0.0
    d_out = b * T * q * c + b * H * T * 4  # the output's gradient and rowsum(dO ⊙ O)
    d_q = b * T * q * 4
    d_kv = 2 * b * keys * q * 4 + (2 * b * T * kv * 4 if cp_method == "ring" else 0.0)
    worst = tiles
    if cp_method == "allgather":  # dK/dV folded to the K/V heads, stacked, made contiguous to reduce-scatter
        worst = max(tiles, 2 * (2 * b * S * kv * 4) + 2 * b * T * kv * 4)
    return worst + masks + held + upcast + d_out + d_q + d_kv


def head_activation_bytes(cfg: ModelConfig, wl: Workload, b: int, tp: int, sp: bool, cp: int = 1) -> float:
    """Final norm, output head and loss of the last stage, per micro-batch."""
    d = dtypes_for(wl)
    s, h = wl.seq_len / cp, cfg.dim
    s_loc = s / tp if sp else s
    last_out = b * s_loc * h * d.residual if _norm_keeps_input(cfg, d) else 0.0
    head_in = b * s * h * d.compute
    log_probs = b * s * cfg.vocab_size / tp * 4  # fp32 log-softmax (on vocabulary shards)
    return last_out + _norm_extra(cfg, d, b, s_loc) + head_in + log_probs


def _norm_keeps_input(cfg: ModelConfig, d: Dtypes) -> bool:
    return cfg.norm == "layernorm" or d.residual == 4


def _norm_extra(cfg: ModelConfig, d: Dtypes, b: int, s_loc: float) -> float:
    """What a norm keeps besides its input: LayerNorm its mean and 1/std; our RMSNorm its
    1/rms, its normalized input (before the weight) and, when the residual stream is not
    fp32, the fp32 copy of its input it normalizes."""
    if cfg.norm == "layernorm":
        return 2 * b * s_loc * 4
    upcast = b * s_loc * cfg.dim * 4 if d.residual != 4 else 0.0
    return b * s_loc * (cfg.dim * d.residual + 4) + upcast


def first_layer_extra_bytes(cfg: ModelConfig, wl: Workload, b: int, tp: int, sp: bool, ac: str,
                            cp: int = 1) -> float:
    """With sequence parallelism and checkpointing, scaletrain's first layer keeps its input as
    it arrives — replicated, before it is split into sequence shards."""
    if not sp or ac == "none" or tp == 1 or wl.engine != "scaletrain":
        return 0.0
    return b * wl.seq_len / cp * cfg.dim * Dtypes.of(wl.precision).residual * (1 - 1 / tp)


def weight_copy_bytes(wl: Workload, matmul_params: int, ac: str, keeps_fp32: bool) -> float:
    """Autocast casts each fp32 weight to the compute dtype in forward and keeps the copy for
    backward (unless checkpointing recomputes the forward; FSDP casts into its own buffers)."""
    d = dtypes_for(wl)
    if not d.autocast or ac != "none" or keeps_fp32:
        return 0.0
    return matmul_params * d.compute


def formula_activation_bytes(cfg: ModelConfig, wl: Workload, b: int, tp: int, sp: bool, ac: str,
                             keeps_fp32: bool = False, cp: int = 1, moe: bool = False,
                             ep: int = 1) -> tuple[float, float]:
    """(per layer, head + loss) from the closed form, autocast weight copies included (a
    mixture's: its router, shared experts and the routed experts on this rank, which the
    grouped matmul casts); the same split as `scaletrain.plan.trace.traced_activation_bytes`.
    `moe`: the layer is a mixture-of-experts block."""
    params = layer_params(cfg, tp, moe, ep)
    per_layer = layer_activation_bytes(cfg, wl, b, tp, sp, ac, cp, moe, ep) + \
        weight_copy_bytes(wl, params.matmul, ac, keeps_fp32)
    if keeps_fp32 and ep > 1:  # FSDP leaves expert parallelism's experts alone: autocast casts them
        per_layer += weight_copy_bytes(wl, params.expert, ac, False)
    # the head is never checkpointed: its weight copy stays whatever the layers do
    head = head_activation_bytes(cfg, wl, b, tp, sp, cp) + \
        weight_copy_bytes(wl, cfg.vocab_size * cfg.dim // tp, "none", keeps_fp32)
    return per_layer, head + mtp_activation_bytes(cfg, wl, b, tp, sp, keeps_fp32, cp, ep)


def mtp_activation_bytes(cfg: ModelConfig, wl: Workload, b: int, tp: int, sp: bool, keeps_fp32: bool = False,
                         cp: int = 1, ep: int = 1) -> float:
    """Multi-token prediction's depths (model/mtp.py), never checkpointed, beside the head: each keeps its
    block's activations and weight copies, the normalised embedding and hidden state (their norms' extras),
    the concatenation eh_proj reads and its weight copy, its block output's norm, its share of the head's
    input and its fp32 log-probabilities."""
    if not cfg.mtp_depth:
        return 0.0
    d = dtypes_for(wl)
    s, h = wl.seq_len / cp, cfg.dim
    total = 0.0
    for j in range(cfg.mtp_depth):
        moe = cfg.is_moe_block(cfg.n_layers + j)
        params = layer_params(cfg, tp, moe, ep)
        block = layer_activation_bytes(cfg, wl, b, tp, sp, "none", cp, moe, ep) + \
            weight_copy_bytes(wl, params.matmul, "none", keeps_fp32)
        norms_in = 3 * b * s * h * d.residual if _norm_keeps_input(cfg, d) else 0.0  # enorm, hnorm, head_norm
        projection = b * s * 2 * h * d.compute + weight_copy_bytes(wl, 2 * h * h, "none", keeps_fp32)
        head = b * s * h * d.compute + b * s * cfg.vocab_size / tp * 4
        total += block + norms_in + 3 * _norm_extra(cfg, d, b, s) + projection + head
    return total


@lru_cache(maxsize=4096)
def in_flight(schedule: str, pp: int, micro_batches: int, virtual: int) -> tuple[float, ...]:
    """Per pp rank: the most micro-batches (in units of the rank's whole share of layers) whose
    forward ran and whose activations are still needed. Closed forms of what the schedules'
    orders give (`in_flight_from_orders`, checked equal in the tests)."""
    m, p, v = micro_batches, pp, virtual
    if pp == 1:
        return (1.0,)
    if schedule == "gpipe":
        return tuple(float(m) for _ in range(p))
    if schedule == "1f1b":
        return tuple(float(min(p - r, m)) for r in range(p))
    if schedule == "interleaved-1f1b":  # the warm-up forwards, plus the one in flight
        return tuple(min((p - r - 1) * 2 + (v - 1) * p + 1, m * v) / v for r in range(p))
    if schedule == "zero-bubble":
        if m >= 2 * p - 1:  # ZB-V's steady state holds 2p chunk-forwards: p micro-batches
            return tuple(float(p) for _ in range(p))
        return in_flight_from_orders(schedule, pp, micro_batches, virtual)  # few micro-batches: count
    raise unknown("pipeline schedule", schedule, PP_SCHEDULES)


def in_flight_from_orders(schedule: str, pp: int, micro_batches: int, virtual: int) -> tuple[float, ...]:
    """The same count from the operation orders `scaletrain schedule` draws."""
    from scaletrain.plan.timeline import rank_orders

    if pp == 1:
        return (1.0,)
    orders, _ = rank_orders(schedule, pp, micro_batches, virtual)
    chunks = virtual if is_multi_chunk(schedule) else 1
    release = "W" if schedule == "zero-bubble" else "B"  # the last use of a chunk's activations
    out = []
    for order in orders:
        live = peak = 0
        for op in order:
            live += 1 if op.kind == "F" else -1 if op.kind == release else 0
            peak = max(peak, live)
        out.append(peak / chunks)
    return tuple(out)
