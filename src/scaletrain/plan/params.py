"""What a rank holds of the model: its parameters (by pipeline stage and tensor-parallel shard),
the bytes each takes in a precision mode, and the optimizer state per parameter. The engines the
planner models and their habits are defined here (`ENGINES`). Read by the memory and time models.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache, lru_cache

from scaletrain.model.config import ModelConfig
from scaletrain.model.flops import block_matmul_params
from scaletrain.plan.spec import Layout, Workload
from scaletrain.vocab import OPTIMIZERS, PLAN_ENGINES, PRECISIONS, unknown


@dataclass(frozen=True)
class Dtypes:
    param: int  # bytes of a stored parameter
    grad: int
    master: int  # fp32 master copy (bf16-true)
    compute: int  # matmul inputs and outputs
    residual: int  # the residual stream and norm inputs
    autocast: bool  # fp32 weights cast to the compute dtype for every forward

    @classmethod
    def of(cls, precision: str) -> Dtypes:
        return _dtypes_of(cls, precision)


@cache
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
def layer_params(cfg: ModelConfig, tp: int) -> tuple[int, int, int, tuple]:
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
    return _stage_layers(cfg.n_layers, layout.pp, layout.pp_virtual_stages, layout.pp_schedule,
                         head_cost_in_blocks(cfg))


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
    s, r, mm, mats = layer_params(cfg, tp)
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
