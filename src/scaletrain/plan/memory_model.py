"""Memory per rank, component by component, in closed form.

Model states follow the ZeRO paper (Rajbhandari et al. 2020, section 5): with Ψ parameters on
a rank, p/g/m/o bytes per parameter for parameters, gradients, fp32 master weights and optimizer
state, and N ranks sharding them, stage 1 divides o and m by N, stage 2 also g, stage 3 also p.

Activations per transformer layer come from two sources:

* `korthikanti_layer_bytes`: the textbook GPT layer of Korthikanti et al. 2022 ("Reducing
  Activation Recomputation in Large Transformer Models", section 4 and Table 2):
  sbh(34 + 5as/h) bytes in 16-bit, sbh(10 + 24/t + 5as/(ht)) with tensor parallelism,
  sbh/t(34 + 5as/h) with sequence parallelism as well, 34sbh/t (or sbh(10 + 24/t) without
  sequence parallelism) with selective recomputation, 2sbh with full recomputation.
* `layer_activation_bytes`: the same accounting for scaletrain's own layer, tensor by tensor:
  what each of its operations saves for backward (memory-efficient attention keeps q, k, v, its
  output and a log-sum-exp instead of the s×s scores; no dropout masks; DTensor keeps the
  all-gathered input of a column-parallel matmul under sequence parallelism; autocast keeps the
  low-precision copy of each weight). `scaletrain.plan.trace` checks it by counting the saved
  tensors of the real layer under fake tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import NamedTuple

from scaletrain.config import ParallelConfig
from scaletrain.model.config import ModelConfig
from scaletrain.model.flops import block_matmul_params
from scaletrain.plan.spec import Cluster, Layout, Workload
from scaletrain.vocab import (AC_MODES, CP_METHODS, OPTIMIZERS, PLAN_ENGINES, PP_SCHEDULES, PRECISIONS, is_multi_chunk,
                              unknown)

GiB = 2**30


@dataclass(frozen=True)
class Dtypes:
    param: int  # bytes of a stored parameter
    grad: int
    master: int  # fp32 master copy (bf16-true)
    compute: int  # matmul inputs and outputs
    residual: int  # the residual stream and norm inputs
    autocast: bool  # fp32 weights cast to the compute dtype for every forward

    @classmethod
    def of(cls, precision: str) -> "Dtypes":
        return _dtypes_of(cls, precision)


@lru_cache(maxsize=None)
def _dtypes_of(cls, precision: str) -> Dtypes:
    """Dtypes.of, cached: the search asks for every layout it evaluates."""
    if precision in ("32-true", "tf32"):
        return cls(4, 4, 0, 4, 4, False)
    if precision in ("16-mixed", "bf16-mixed", "fp8"):  # fp8: bf16-mixed's weights (its fp8 copies are transient)
        return cls(4, 4, 0, 2, 4, True)
    if precision == "bf16-true":
        return cls(2, 2, 4, 2, 2, False)
    raise unknown("precision", precision, PRECISIONS)


@dataclass(frozen=True)
class Engine:
    """What a training engine keeps, where engines differ (the planner predicts for scaletrain
    by default; the others are how published runs were trained, to hold the planner against
    them). With 16-bit precision the engines below store 16-bit parameters beside fp32 masters."""

    name: str
    grad_bytes: int  # gradients of 16-bit parameters: 4 = fp32 main-grad buffer, 2 = 16-bit
    sp_saves_sharded: bool  # sequence parallel: the norm output a column-parallel matmul saves
    #                         stays in sequence shards (gathered again in backward)
    single_rail_zero3: bool  # ZeRO-3 collectives reach one NIC per GPU (no multi-rail channels)


ENGINES = {
    # our trainer: autocast over fp32 weights (bf16-mixed), DTensor keeps the gathered input
    "scaletrain": Engine("scaletrain", 4, False, False),
    # Megatron-LM (Narayanan et al. 2021, Korthikanti et al. 2022): fp16/bf16 weights, fp32
    # main gradients, fp32 masters and Adam; sequence parallel saves sharded inputs
    "megatron": Engine("megatron", 4, True, False),
    # DeepSpeed ZeRO (Rajbhandari et al. 2020): 2 + 2 + 12 bytes per parameter. Its ZeRO-3 of
    # 2021 gathered parameter by parameter: across nodes it reached one NIC per GPU (fitted on
    # Narayanan et al. 2021's ZeRO-3 comparison, see docs/planner.md)
    "deepspeed": Engine("deepspeed", 2, True, True),
}


def engine_of(name: str) -> Engine:
    if name not in ENGINES:
        raise unknown("engine", name, PLAN_ENGINES)
    return ENGINES[name]


@lru_cache(maxsize=256)
def dtypes_for(wl: Workload) -> Dtypes:
    """The bytes each state takes under the workload's precision and engine."""
    d = Dtypes.of(wl.precision)
    e = engine_of(wl.engine)
    if e.name == "scaletrain" or d.compute == 4:
        return d
    return Dtypes(2, e.grad_bytes, 4, 2, 2, False)  # 16-bit weights and stream, fp32 masters


# --------------------------------------------------------------------------------------------
# Parameters


@dataclass(frozen=True)
class ParamCounts:
    """Parameters of one rank: split by tensor parallelism (`sharded`, already divided by tp)
    or replicated over it, and the matrices (rows, cols) for factored optimizers."""

    sharded: int
    replicated: int
    matmul: int  # of which feed matmuls (for autocast copies and FLOPs)
    matrices: tuple[tuple[int, int], ...] = ()

    @property
    def total(self) -> int:
        return self.sharded + self.replicated


@lru_cache(maxsize=1024)
def _layer_params(cfg: ModelConfig, tp: int) -> tuple[int, int, int, tuple]:
    h, kv, f = cfg.dim, cfg.kv_heads * cfg.head_size, cfg.hidden_dim
    q = cfg.n_heads * cfg.head_size  # = h unless head_dim is set apart
    n_ffn = 3 if cfg.activation == "swiglu" else 2
    # the K/V width on a rank: kv / tp, or, with fewer K/V heads than tp, the one head its
    # query heads read (replicated on tp / kv_heads ranks, as the engine holds it)
    kv_rank = kv // tp if cfg.kv_heads >= tp else cfg.head_size
    replicated_kv = 2 * h * kv_rank - 2 * h * kv // tp  # wk and wv beyond their 1/tp share
    matmul = block_matmul_params(cfg, tp) + replicated_kv
    sharded = matmul
    replicated = (4 if cfg.norm == "layernorm" and cfg.bias else 2) * h
    if cfg.bias:
        sharded += (q + (n_ffn - 1) * f) // tp + 2 * kv_rank  # column-parallel biases
        replicated += 2 * h  # row-parallel biases (wo, w2)
    elif cfg.qkv_bias:
        sharded += q // tp + 2 * kv_rank
    if cfg.qk_norm:
        replicated += 2 * cfg.head_size
    mats = ((q // tp, h), (kv_rank, h), (kv_rank, h), (h, q // tp)) + \
           ((f // tp, h),) * (n_ffn - 1) + ((h, f // tp),)
    return sharded, replicated, matmul, mats


def stage_layers(cfg: ModelConfig, layout: Layout) -> list[list[int]]:
    """Layer counts of each pp rank's chunks (balanced as the trainer splits them)."""
    from scaletrain.parallel.pipeline import head_cost_in_blocks

    if layout.pp == 1:
        return [[cfg.n_layers]]
    return _stage_layers(cfg.n_layers, layout.pp, layout.pp_virtual_stages, layout.pp_schedule, head_cost_in_blocks(cfg))


@lru_cache(maxsize=4096)
def _stage_layers(n_layers: int, pp: int, virtual: int, schedule: str, head_cost: float) -> list[list[int]]:
    from scaletrain.parallel.pipeline import balanced_split_counts, stage_indices

    counts = balanced_split_counts(n_layers, pp * virtual, head_cost)
    return [[counts[s] for s in stage_indices(schedule, r, pp, virtual)] for r in range(pp)]


def rank_params(cfg: ModelConfig, layout: Layout, pp_rank: int) -> ParamCounts:
    return _rank_params(cfg, layout.tp, layout.pp, layout.pp_virtual_stages, layout.pp_schedule, pp_rank)


@lru_cache(maxsize=16384)
def _rank_params(cfg: ModelConfig, tp: int, pp: int, virtual: int, schedule: str, pp_rank: int) -> ParamCounts:
    from scaletrain.parallel.pipeline import stage_indices

    layout = Layout(tp=tp, pp=pp, pp_virtual_stages=virtual, pp_schedule=schedule)
    layers = sum(stage_layers(cfg, layout)[pp_rank])
    s, r, mm, mats = _layer_params(cfg, tp)
    sharded, replicated, matmul = s * layers, r * layers, mm * layers
    matrices = list(mats) * layers
    stages = stage_indices(layout.pp_schedule, pp_rank, layout.pp, layout.pp_virtual_stages) if layout.pp > 1 else [0]
    last = layout.num_stages - 1
    h, V = cfg.dim, cfg.vocab_size
    if 0 in stages:
        sharded += V * h // tp
        matrices.append((V // tp, h))
        if cfg.position == "learned":
            replicated += cfg.max_seq_len * h
            matrices.append((cfg.max_seq_len, h))
    if last in stages:
        replicated += h * (2 if cfg.norm == "layernorm" and cfg.bias else 1)
        matmul += V * h // tp
        if not (cfg.tie_embeddings and layout.pp == 1):
            sharded += V * h // tp
            matrices.append((V // tp, h))
    return ParamCounts(sharded, replicated, matmul, tuple(matrices))


def optimizer_bytes(optimizer: str, counts: ParamCounts) -> float:
    """Optimizer state of these parameters (fp32 states)."""
    if optimizer == "adamw":
        return 8.0 * counts.total
    if optimizer == "sgd":
        return 4.0 * counts.total
    if optimizer == "adamw8bit":
        # torchao: 8-bit moments in blocks of 256 with an fp32 scale each, for tensors of at least
        # 4096 elements; smaller ones keep fp32 moments
        big = sum(r * c for r, c in counts.matrices if r * c >= 4096)
        return big * (2 + 8 / 256) + (counts.total - big) * 8.0
    if optimizer == "adafactor":
        # factored second moment of each matrix (a row and a column vector), full for vectors
        in_matrices = sum(r * c for r, c in counts.matrices)
        return 4.0 * sum(r + c for r, c in counts.matrices) + 4.0 * max(0, counts.total - in_matrices)
    raise unknown("optimizer", optimizer, OPTIMIZERS)


# --------------------------------------------------------------------------------------------
# Activations


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
                           cp: int = 1) -> float:
    """Bytes one layer keeps for backward, per micro-batch of b sequences, on one rank: for
    scaletrain's layer (`_scaletrain_layer_bytes`) or, for another engine, Megatron's accounting
    (`_megatron_layer_bytes`). Context parallelism splits every sequence over cp ranks."""
    if wl.engine != "scaletrain":
        return _megatron_layer_bytes(cfg, wl, b, tp, sp, ac, cp)
    return _scaletrain_layer_bytes(cfg, wl, b, tp, sp, ac, cp)


def _megatron_layer_bytes(cfg: ModelConfig, wl: Workload, b: int, tp: int, sp: bool, ac: str, cp: int) -> float:
    """Korthikanti et al. 2022, section 4.1, generalised to grouped-query attention and SwiGLU.
    In 16-bit, per token: the two norms' inputs (2h each), the QKV and first MLP matmuls' inputs
    (2h each), q and k (2(q + kv)), v (2kv), the output projection's input (2q), the MLP's
    inner activations (2f per matrix of width f, twice for GELU's input and output, three times
    for SwiGLU's two inputs and product), one dropout mask byte per hidden element for each
    residual dropout, and for eager attention the softmax output and its dropout mask
    (2 + 1 bytes × heads × s). For GPT (h = q = kv, f = 4h, dropout) this is their
    sbh(34 + 5as/h). Tensor parallelism divides what is split by heads or by f; sequence
    parallelism divides the rest too. Selective recomputation drops the s × s terms; full
    recomputation keeps the layer's input."""
    d = dtypes_for(wl)
    s, h, a = wl.seq_len / cp, cfg.dim, cfg.n_heads
    kv, f, q = cfg.kv_heads * cfg.head_size, cfg.hidden_dim, cfg.n_heads * cfg.head_size
    c = d.compute
    rest = 1 / tp if sp else 1.0  # the norms, dropouts and matmul inputs outside the tp split
    if ac == "full":
        return b * s * h * d.residual * rest
    masks = 2 * h if cfg.dropout > 0 else 0
    outside = (2 * h * d.residual + 2 * h * c + masks) * rest
    n_ffn = 3 if cfg.activation == "swiglu" else 2
    inside = (2 * q + 2 * kv) * c + n_ffn * f * c  # q, k, v, wo's input; the MLP's inner tensors
    inside /= tp
    scores = 0.0
    if wl.attention == "eager" and ac != "selective":
        # softmax output, and with dropout its mask and dropped output (keys span the sequence)
        scores = a / tp * wl.seq_len * ((2 * c + 1) if cfg.dropout > 0 else c)
    elif wl.attention == "flash":
        scores = a / tp * 4  # log-sum-exp
    return b * s * (outside + inside + scores)


def _scaletrain_layer_bytes(cfg: ModelConfig, wl: Workload, b: int, tp: int, sp: bool, ac: str, cp: int) -> float:
    """What each operation of scaletrain's layer saves for backward (checked against a count of
    the real layer's saved tensors, `scaletrain.plan.trace`)."""
    d = Dtypes.of(wl.precision)
    s, h, a = wl.seq_len / cp, cfg.dim, cfg.n_heads
    kv, f, q = cfg.kv_heads * cfg.head_size, cfg.hidden_dim, cfg.n_heads * cfg.head_size
    s_loc = s / tp if sp else s  # the residual stream's tokens on this rank
    x = b * s_loc * h * d.residual  # the layer's input (the previous layer's output)
    if ac == "full":
        return x
    qkv = b * s * (q + 2 * kv) / tp * d.compute
    attn_out = b * s * q / tp * d.compute
    lse = b * a / tp * s * 4
    if wl.attention == "eager" and ac != "selective":
        # materialized scores: the softmax output (selective recomputation recomputes them)
        lse = b * a / tp * s * wl.seq_len * d.compute
    n_ffn = 3 if cfg.activation == "swiglu" else 2
    if ac == "selective":  # matmul and attention outputs; element-wise ops are recomputed
        mm_out = 2 * b * s * h * d.compute  # wo and w2 outputs (before their reduction)
        ffn = (n_ffn - 1) * b * s * f / tp * d.compute
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
    cp_out = b * s * q / tp * (4 - d.compute) if cp > 1 else 0.0
    return x + attn_in + norm_extra + mask + qkv + attn_out + lse + cp_out + _mlp_half_bytes(cfg, wl, b, tp, sp, cp)


def _mlp_half_bytes(cfg: ModelConfig, wl: Workload, b: int, tp: int, sp: bool, cp: int) -> float:
    """What scaletrain's layer keeps for its MLP half, without checkpointing: the residual
    between attention and MLP (kept by the norm that reads it), the norm's extra, the
    normalized input of the MLP's column-parallel matmuls (one copy per matmul under autocast),
    the MLP's inner tensors and the branch's dropout mask. Backward frees it before it reaches
    the layer's attention."""
    d = Dtypes.of(wl.precision)
    s, h, f = wl.seq_len / cp, cfg.dim, cfg.hidden_dim
    s_loc = s / tp if sp else s
    n_ffn = 3 if cfg.activation == "swiglu" else 2
    residual = b * s_loc * h * d.residual if _norm_keeps_input(cfg, d) else 0.0
    mlp_in = ((n_ffn - 1) if d.autocast else 1) * b * s * h * d.compute
    ffn = (2 if cfg.activation == "gelu" else 4) * b * s * f / tp * d.compute
    mask = b * s_loc * h if cfg.dropout > 0 else 0.0
    return residual + _norm_extra(cfg, d, b, s_loc) + mlp_in + ffn + mask


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
                             keeps_fp32: bool = False, cp: int = 1) -> tuple[float, float]:
    """(per layer, head + loss) from the closed form, autocast weight copies included; the
    same split as `scaletrain.plan.trace.traced_activation_bytes`."""
    per_layer = layer_activation_bytes(cfg, wl, b, tp, sp, ac, cp) + \
        weight_copy_bytes(wl, _layer_params(cfg, tp)[2], ac, keeps_fp32)
    # the head is never checkpointed: its weight copy stays whatever the layers do
    head = head_activation_bytes(cfg, wl, b, tp, sp, cp) + \
        weight_copy_bytes(wl, cfg.vocab_size * cfg.dim // tp, "none", keeps_fp32)
    return per_layer, head


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


# --------------------------------------------------------------------------------------------
# The whole rank


def model_state_bytes(params: float, d: Dtypes, optimizer_bytes_per_param: float, zero: int,
                      n: int) -> tuple[float, float, float, float]:
    """(parameters, gradients, master weights, optimizer state) per rank for `params` parameters
    sharded over n ranks at ZeRO stage `zero` (Rajbhandari et al. 2020, section 5.1)."""
    return (params * d.param / (n if zero >= 3 else 1),
            params * d.grad / (n if zero >= 2 else 1),
            params * d.master / (n if zero >= 1 else 1),
            params * optimizer_bytes_per_param / (n if zero >= 1 else 1))


@dataclass
class MemoryBreakdown:
    params: float = 0.0
    grads: float = 0.0
    master: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0
    logits_loss: float = 0.0
    comm_buffers: float = 0.0
    reserve: float = 0.0
    host: float = 0.0  # offloaded to host memory (not counted against the device)
    stage: int = 0  # the pipeline rank this breakdown is for (the worst)
    notes: list[str] = field(default_factory=list)
    # the most alive at once, reserve aside, where not every component is alive at the same
    # time (scaletrain's engine, `_peak`); None: the components' sum
    peak: float | None = None

    COMPONENTS = ("params", "grads", "master", "optimizer", "activations", "logits_loss", "comm_buffers", "reserve")

    @property
    def model_states(self) -> float:
        return self.params + self.grads + self.master + self.optimizer

    @property
    def total(self) -> float:
        if self.peak is not None:
            return self.peak + self.reserve
        return sum(getattr(self, c) for c in self.COMPONENTS)

    def as_dict(self) -> dict[str, int]:
        return {c: int(getattr(self, c)) for c in self.COMPONENTS} | {"total": int(self.total), "host": int(self.host)}


RESERVE_FRACTION = 0.05  # caching-allocator fragmentation, stated in the report
RUNTIME_BYTES_GPU = 1.0 * GiB  # CUDA context, NCCL and cuBLAS workspaces


def estimate_memory(cfg: ModelConfig, wl: Workload, layout: Layout, cluster: Cluster | None = None, *,
                    bucket_mb: float = ParallelConfig.bucket_mb, gpu: bool = True,
                    activations: str = "formula") -> MemoryBreakdown:
    """Per-rank memory of `layout`, for its worst pipeline rank: the first (most micro-batches
    in flight, the embedding), the last (the head and loss) or the one with the most layers."""
    worst = None
    layers = [sum(c) for c in stage_layers(cfg, layout)]
    for pp_rank in sorted({0, layout.pp - 1, layers.index(max(layers))}):
        m = _rank_memory(cfg, wl, layout, pp_rank, bucket_mb, gpu, activations)
        if worst is None or m.total > worst.total:
            worst = m
    return worst


def _rank_memory(cfg, wl, layout: Layout, pp_rank: int, bucket_mb: float, gpu: bool, activations: str):
    d = dtypes_for(wl)
    ours = wl.engine == "scaletrain"
    counts = rank_params(cfg, layout, pp_rank)
    sh = sharding(wl, layout)
    extra_grads = 0.0
    if ours and layout.tp > 1 and not sh.fsdp_like and sh.grad_zero < 2 and pp_rank == 0:
        # the vocabulary-parallel embedding's gradient arrives replicated (DTensor's embedding
        # backward), full size on every tensor-parallel rank, in the parameters' dtype
        extra_grads = cfg.vocab_size * cfg.dim * (1 - 1 / layout.tp) * d.grad
    out = model_state_memory(counts, wl, layout, extra_grads=extra_grads, sh=sh)
    out.stage = pp_rank

    # activations: per micro-batch on this rank's layers, times the micro-batches in flight
    layers = sum(stage_layers(cfg, layout)[pp_rank])
    from scaletrain.parallel.pipeline import stage_indices

    stages = stage_indices(layout.pp_schedule, pp_rank, layout.pp, layout.pp_virtual_stages) if layout.pp > 1 else [0]
    last = layout.num_stages - 1
    flight = in_flight(layout.pp_schedule, layout.pp, layout.grad_accum, layout.pp_virtual_stages)[pp_rank]
    if activations == "traced":
        if not ours or layout.cp > 1:
            raise ValueError("traced activations count scaletrain's own layer (engine scaletrain, cp 1)")
        from scaletrain.plan.trace import traced_activation_bytes

        per_layer, head = traced_activation_bytes(cfg, wl, layout.micro_batch, layout.tp, layout.sp, layout.activation_checkpointing)
    elif activations == "formula":
        per_layer, head = formula_activation_bytes(cfg, wl, layout.micro_batch, layout.tp, layout.sp, layout.activation_checkpointing,
                                                   sh.fsdp_like, layout.cp)
    else:
        raise ValueError(f"unknown activation source {activations!r}")
    out.activations = per_layer * layers * flight
    if 0 in stages and activations == "formula":
        out.activations += first_layer_extra_bytes(cfg, wl, layout.micro_batch, layout.tp, layout.sp,
                                                   layout.activation_checkpointing, layout.cp) * flight
    if last in stages:
        # the head's activations live from the last forward of a micro-batch to its backward:
        # one micro-batch at a time on the last stage
        out.logits_loss = head

    block = _layer_params(cfg, layout.tp)
    recompute = 0.0
    if ours and layout.activation_checkpointing != "none":  # backward rebuilds one layer's activations at a time
        full = formula_activation_bytes(cfg, wl, layout.micro_batch, layout.tp, layout.sp, "none", sh.fsdp_like)[0]
        recompute = full - formula_activation_bytes(cfg, wl, layout.micro_batch, layout.tp, layout.sp,
                                                    layout.activation_checkpointing, sh.fsdp_like)[0]
    moments = None
    if ours and activations == "formula" and last in stages:
        moments = backward_moments(cfg, wl, layout, d, per_layer)
    # FSDP gathers block by block; the root (embedding and head) stays gathered
    root = (cfg.vocab_size * cfg.dim // layout.tp) * (1 if cfg.tie_embeddings else 2)
    return buffers_and_peak(out, counts, wl, layout, block_params=block[0] + block[1], root_params=root,
                            recompute=recompute, moments=moments, bucket_mb=bucket_mb, gpu=gpu, sh=sh)


class BackwardMoments(NamedTuple):
    """Backward's moments on the last pipeline stage, for scaletrain's engine (`backward_moments`)."""

    attention: float  # the last layer's attention backward: the bytes beyond every activation in flight
    grads_at_attention: float  # the gradients made by then (without accumulation)
    grads_at_start: float  # the gradients the head's backward makes
    first_layer: float  # the activations of one layer (the first, whose backward ends the pass)


def backward_moments(cfg: ModelConfig, wl: Workload, layout: Layout, d: Dtypes, per_layer: float) -> BackwardMoments:
    """In the last layer's attention backward, `attention_backward_bytes` are held while what the
    layer's MLP half and its output projection's input kept is freed; the gradients made by
    then are the head's (a tied embedding's share: its gradient's buffer) and the final norm's,
    and the last layer's MLP matrices and norm. `per_layer`: one layer's activations."""
    b, tp, sp, cp = layout.micro_batch, layout.tp, layout.sp, layout.cp
    scratch = attention_backward_bytes(cfg, wl, b, tp, cp, layout.cp_method)
    wo_in = b * wl.seq_len / cp * cfg.n_heads * cfg.head_size / tp * d.compute
    freed = _mlp_half_bytes(cfg, wl, b, tp, sp, cp) + wo_in
    n_ffn = 3 if cfg.activation == "swiglu" else 2
    head = (cfg.vocab_size * cfg.dim / tp + cfg.dim) * d.grad
    mlp = (n_ffn * cfg.dim * cfg.hidden_dim / tp + cfg.dim) * d.grad
    return BackwardMoments(scratch - freed, head + mlp, head, per_layer)


@dataclass(frozen=True)
class Sharding:
    """How a layout's data-parallel engine holds the model states of a rank."""

    n: int  # ranks each state is sharded over: Layout.shard_ranks of the engine
    zero: int  # the ZeRO stage in effect (0 with nothing to shard over)
    grad_zero: int  # the stage the gradients' peak follows (ZeRO-2 under pipelining holds them whole: 1)
    fsdp_like: bool  # scaletrain's FSDP (zero 3) or FSDP-based replication (zero 0 under tp)


def sharding(wl: Workload, layout: Layout) -> Sharding:
    n = layout.shard_ranks(wl.engine)  # the engine's ZeRO group (cp ranks: in the others', not scaletrain's)
    zero = layout.zero if n > 1 else 0
    # scaletrain's FSDP (zero 3) and FSDP-based replication (zero 0 with tp) keep fp32 weights
    # (the masters) and cast into compute-dtype buffers of their own
    fsdp_like = wl.engine == "scaletrain" and layout.step_dp > 1 and (zero == 3 or (zero == 0 and layout.tp > 1))
    # the ZeRO-2 engine reduce-scatters every micro-step's gradients into the shards, with or
    # without accumulation; only under pipelining, where the schedule runs every micro-batch's
    # backward before the one reduction, does it hold full gradients: its peak is then ZeRO-1's
    grad_zero = 1 if zero == 2 and layout.grad_accum > 1 and layout.pp > 1 else zero
    return Sharding(n, zero, grad_zero, fsdp_like)


def model_state_memory(counts: ParamCounts, wl: Workload, layout: Layout, *, extra_grads: float = 0.0,
                       sh: Sharding | None = None) -> MemoryBreakdown:
    """Parameters, gradients, master weights and optimizer state of a rank holding `counts`
    (`extra_grads`: gradient bytes beside them), as the layout's engine shards them
    (`sh`: `sharding(wl, layout)`, if at hand), and what offloading moves to the host."""
    d = dtypes_for(wl)
    sh = sh or sharding(wl, layout)
    n, zero, grad_zero = sh.n, sh.zero, sh.grad_zero
    out = MemoryBreakdown()
    P = counts.total
    # FSDP-like engines store fp32 parameters (the masters) and gradients
    dtypes = Dtypes(4, 4, 0, d.compute, d.residual, False) if sh.fsdp_like else d
    out.params, _, out.master, out.optimizer = model_state_bytes(
        P, dtypes, optimizer_bytes(wl.optimizer, counts) / P if P else 0.0, zero, n)
    out.grads = model_state_bytes(P, dtypes, 0.0, grad_zero, n)[1]
    if wl.engine == "scaletrain" and d.master and not sh.fsdp_like:
        # bf16-true keeps fp32 gradients for its fp32 masters: at step time the bf16 gradients
        # have been moved into them (one process, DDP), reduce-scattered into fp32 shards
        # (ZeRO-2), or sit beside the fp32 shards (ZeRO-1, and ZeRO-2 while accumulating)
        out.grads = {0: P * 4, 1: P * d.grad + P * 4 / n, 2: P * 4 / n}[grad_zero]
    out.grads += extra_grads
    if layout.local_sync:  # the outer weights (fp32) and DiLoCo's outer momentum, of the rank's shard
        out.optimizer += P / (n if zero >= 1 else 1) * (8 if layout.dp_sync == "diloco" else 4)
        out.notes.append(f"{layout.dp_sync}: the outer weights{' and momentum' if layout.dp_sync == 'diloco' else ''} "
                         "count as optimizer state")
    if layout.offload_optimizer and zero == 3:
        out.host = out.params + out.grads + out.optimizer
        out.params = out.grads = out.optimizer = 0.0
        out.notes.append("parameters, gradients and optimizer state live in host memory (offload)")
    return out


def buffers_and_peak(out: MemoryBreakdown, counts: ParamCounts, wl: Workload, layout: Layout, *, block_params: float,
                     root_params: float, recompute: float = 0.0, moments: BackwardMoments | None = None,
                     bucket_mb: float = ParallelConfig.bucket_mb, gpu: bool = True,
                     sh: Sharding | None = None) -> MemoryBreakdown:
    """Complete `out` (model states and activations filled in) with the communication buffers,
    scaletrain's peak and the reserve. FSDP gathers units of `block_params` parameters, the
    root's `root_params` stay gathered; `recompute`: the bytes checkpointing rebuilds at once;
    `moments`: backward's moments on the last stage (`backward_moments`)."""
    d = dtypes_for(wl)
    ours = wl.engine == "scaletrain"
    sh = sh or sharding(wl, layout)
    n, zero, grad_zero, fsdp_like = sh.n, sh.zero, sh.grad_zero, sh.fsdp_like
    P = counts.total
    bucket = min(bucket_mb * 2**20, P * 4)
    if n > 1 and zero in (1, 2):
        # ZeRO-1/2 engine: at most two gradient buckets in flight (never more than the
        # gradients themselves), each with its flat send buffer and (gloo) receive buffer, in
        # the reduction dtype
        out.comm_buffers = 2 * min(2 * bucket, P * 4)
    elif fsdp_like:
        c = d.compute if d.compute < 4 else 4
        # two blocks gathered (current + prefetched), the root kept gathered, one block's
        # unsharded fp32 gradients waiting for their reduce-scatter
        out.comm_buffers = (2 * block_params + root_params) * c + block_params * 4
    elif zero == 3:  # another engine's ZeRO-3: two blocks gathered, one block's gradients
        out.comm_buffers = 2 * block_params * d.compute + block_params * d.grad
    if ours:
        grads_in_backward = out.grads
        if d.master and not fsdp_like:  # bf16-true: fp32 gradients exist at step time only
            grads_in_backward = P * d.grad / (n if grad_zero >= 2 else 1) + (out.grads - min(out.grads, P * 4))
        out.peak = _peak(out, layout, zero, n, fsdp_like, grads_in_backward, recompute, bucket, P * 4, moments)
    out.reserve = RESERVE_FRACTION * (out.peak if out.peak is not None else
                                      out.model_states + out.activations + out.logits_loss + out.comm_buffers)
    if gpu:
        out.reserve += RUNTIME_BYTES_GPU
    return out


def _peak(m: MemoryBreakdown, layout: Layout, zero: int, n: int, fsdp_like: bool, grads_in_backward: float,
          recompute: float, bucket: float, grad_bytes: float, moments: BackwardMoments | None = None) -> float:
    """The most scaletrain's engine holds at once: parameters, masters and optimizer state
    always, plus the larger of two moments.

    * Backward: every activation in flight, with the head's (whose backward runs first) or,
      after it, the layer being recomputed; the gradients as backward keeps them (bf16-true:
      in bf16). Where `moments` are known and each gradient is made once in the step (one
      micro-batch, no pipelining, no data-parallel engine holding buffers of its own), the
      activations fall as the gradients grow: the largest is at one end — the start (every
      activation, the head's gradients) or the end (every gradient, the first layer's
      activations). FSDP's gathered blocks
      are in use then; its persistent gradients, like ZeRO-2's without accumulation, are 1/n
      shards that the reduce-scatters create as backward frees the activations, so they are
      not there yet.
    * The last layer's attention in backward (where context parallelism's ring and allgather
      recompute their score tiles): every activation in flight but the layer's MLP half, with
      the attention's backward buffers (`moments.attention`: their excess over the MLP half),
      and the gradients made by then (all of them when earlier micro-batches made them).
    * The end of backward and the optimizer step: the gradients at their largest.

    ZeRO-1/2 buckets are sent once their gradients are complete, by when backward has freed
    the activations of the layers they hold: with k of the G gradient bytes' buckets of size B
    sent, (1 - kB/G) of the activations remain beside at most two buckets' send and receive
    buffers."""
    states = m.params + m.master + m.optimizer
    acts = m.activations + max(m.logits_loss, recompute)
    sharded_by_reduction = fsdp_like or (zero == 2 and layout.grad_accum == 1)
    grads = 0.0 if sharded_by_reduction else grads_in_backward
    gathered = m.comm_buffers if fsdp_like else 0.0
    backward = grads + acts + gathered
    if moments is not None:
        once = layout.grad_accum == 1 and layout.pp == 1 and layout.dp == 1
        if once:
            backward = max(min(grads, moments.grads_at_start) + acts,
                           grads + moments.first_layer + recompute) + gathered
        made = min(grads, moments.grads_at_attention) if once else grads
        backward = max(backward, made + m.activations + recompute + moments.attention + gathered)
    if n > 1 and zero in (1, 2):
        for k in (1, 2):
            if k * bucket <= grad_bytes:
                backward = max(backward, grads + m.activations * (1 - k * bucket / grad_bytes) +
                               2 * min(k, 2) * bucket)
    step = m.grads + (m.comm_buffers if fsdp_like else 0.0)
    return states + max(backward, step)


def module_memory(counts: ParamCounts, wl: Workload, layout: Layout, activations: float, *, gpu: bool = True,
                  bucket_mb: float = ParallelConfig.bucket_mb) -> MemoryBreakdown:
    """Per-rank memory of a model known only by its parameters and the activations traced on
    it (an arbitrary nn.Module, data parallel only): model states, buffers, peak and reserve
    as for any model under the layout's engine. FSDP's unit is the whole module (its blocks
    are unknown here): it is gathered whole."""
    out = model_state_memory(counts, wl, layout)
    out.activations = activations
    return buffers_and_peak(out, counts, wl, layout, block_params=0, root_params=counts.total, bucket_mb=bucket_mb,
                            gpu=gpu)
