"""What a rank holds of the model: its parameters (by pipeline stage and tensor-parallel shard),
the bytes each takes in a precision mode, and the optimizer state per parameter. The engines the
planner models and their habits are defined here (`ENGINES`). Read by the memory and time models.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache, lru_cache
from typing import NamedTuple

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
    or replicated over it, the mixtures' routed experts it holds (`expert`, already divided by
    ep: ZeRO shards them over their own group, `expert_shard_ranks`), and the matrices
    (rows, cols) for factored optimizers (the experts' in `expert_matrices`)."""

    sharded: int
    replicated: int
    matmul: int  # of which feed matmuls (for autocast copies and FLOPs)
    matrices: tuple[tuple[int, int], ...] = ()
    expert: int = 0
    expert_matrices: tuple[tuple[int, int], ...] = ()
    n_outer: int = 0  # the last n_outer of `matrices` are the embeddings and the output head (Muon leaves them)

    @property
    def total(self) -> int:
        return self.sharded + self.replicated + self.expert

    @property
    def hidden_matrices(self) -> tuple[tuple[int, int], ...]:
        """The hidden matrices (the blocks', each expert's): what Muon steps."""
        return self.matrices[:len(self.matrices) - self.n_outer] + self.expert_matrices

    @property
    def hidden(self) -> int:
        return sum(r * c for r, c in self.hidden_matrices)

    def parts(self) -> tuple[ParamCounts, ParamCounts]:
        """(everything but the routed experts, the routed experts): sharded by ZeRO over
        different groups under expert parallelism."""
        return (ParamCounts(self.sharded, self.replicated, self.matmul, self.matrices, n_outer=self.n_outer),
                ParamCounts(0, 0, 0, self.expert_matrices, self.expert))


def expert_shard_ranks(layout: Layout, engine: str = "scaletrain") -> int:
    """Ranks each routed expert's model states are sharded over by ZeRO. Without expert
    parallelism the experts are parameters like the others (`Layout.shard_ranks`; replicated
    over tp: experts are not split by it). With ep, every engine here splits them over ep ranks
    borrowed from the dp_shard × cp × tp ranks of a replica group (scaletrain's
    `Layout.build_expert_mesh`, as torchtitan's dp2ep), each holding E/ep experts, which the
    other dp_shard × cp × tp / ep ranks of the group hold alike and shard (scaletrain's
    experts' own engine, `scaletrain.parallel.expert_parallel.expert_engine`); the
    dp_replicate groups hold copies of those shards."""
    if layout.ep == 1:
        return layout.shard_ranks(engine)
    return max(1, layout.expert_shard_ranks)


def expert_params(cfg: ModelConfig) -> int:
    """Parameters of one routed expert: its MLP's two (GELU) or three (SwiGLU) matrices, no bias."""
    return (3 if cfg.gated else 2) * cfg.dim * cfg.expert_hidden


def expert_bias_params(cfg: ModelConfig) -> int:
    """The biases of one routed expert (gpt-oss, model.moe_bias): one per output of each matrix."""
    return ((2 if cfg.gated else 1) * cfg.expert_hidden + cfg.dim) if cfg.moe_bias else 0


def moe_block_split(cfg: ModelConfig) -> tuple[int, int, int]:
    """A mixture-of-experts block's active matmul parameters (`block_matmul_params`, no tp) as
    (attention, router + shared experts, the top_k routed experts a token visits): tp splits
    the first, ep the last."""
    active = block_matmul_params(cfg, 1, block_of_kind(cfg, True))
    n_ffn = 3 if cfg.gated else 2
    whole = (cfg.moe_experts + cfg.moe_shared_gate) * cfg.dim + n_ffn * cfg.dim * cfg.shared_hidden
    routed = cfg.moe_top_k * expert_params(cfg)
    return active - whole - routed, whole, routed


def total_and_active(cfg: ModelConfig) -> tuple[int, int]:
    """(every parameter, those a token's forward multiplies by) of the model: the active count
    is `model.flops.matmul_params` (a mixture's router, top_k and shared experts) — the MFU's
    numerator — the total counts every expert and the embedding too."""
    from scaletrain.model.flops import matmul_params
    from scaletrain.model.transformer import count_params

    return count_params(cfg), matmul_params(cfg)


class BlockParams(NamedTuple):
    """One block's parameters on a rank (`layer_params`)."""

    sharded: int  # split by tp (already divided)
    replicated: int  # whole on every tp rank
    matmul: int  # of which multiply activations: autocast casts them (a mixture: all its experts here)
    matrices: tuple  # (rows, cols) of the matrices but the routed experts'
    expert: int = 0  # the routed experts this rank holds (E / ep of them)
    expert_matrices: tuple = ()


def block_of_kind(cfg: ModelConfig, moe: bool, linear: bool | None = None) -> int | None:
    """A block of the kind asked (a mixture of experts or not; with `linear`, a linear-attention
    block or a full-attention one), for `block_matmul_params`."""
    return next((i for i in range(cfg.n_layers) if cfg.is_moe_block(i) == moe
                 and (linear is None or cfg.is_linear_block(i) == linear)), None)


def linear_matrices(cfg: ModelConfig, tp: int) -> tuple:
    """A linear-attention block's matrices on a tp rank (model/deltanet.py): in_qkvz, in_ba, out,
    split by heads."""
    h, hk, hv, dk, dv = cfg.dim, cfg.linear_heads // tp, cfg.linear_v_heads // tp, cfg.linear_head_dim, \
        cfg.linear_v_dim
    return ((2 * hk * dk + 2 * hv * dv, h), (2 * hv, h), (h, hv * dv))


def linear_state_params(cfg: ModelConfig) -> int:
    """A linear-attention block's parameters replicated over tp: the convolution (every channel's
    taps), A_log and dt_bias (one per value head) and the gated norm's weight (a head's width)."""
    channels = 2 * cfg.linear_heads * cfg.linear_head_dim + cfg.linear_v_heads * cfg.linear_v_dim
    return channels * cfg.linear_conv + 2 * cfg.linear_v_heads + cfg.linear_v_dim


@lru_cache(maxsize=1024)
def layer_params(cfg: ModelConfig, tp: int, moe: bool = False, ep: int = 1, linear: bool = False) -> BlockParams:
    """A block's parameters on one of `tp` tensor-parallel ranks: a dense block, or with `moe`
    a mixture of experts (its router and shared experts whole on every tp rank, its routed
    experts split over `ep` ranks); with `linear`, a linear-attention block (model.linear_heads)."""
    h, kv, f = cfg.dim, cfg.kv_heads * cfg.head_size, cfg.hidden_dim
    q = cfg.n_heads * cfg.head_size  # = h unless head_dim is set apart
    n_ffn = 3 if cfg.gated else 2
    # the K/V width on a rank: kv / tp, or, with fewer K/V heads than tp, the one head its
    # query heads read (replicated on tp / kv_heads ranks, as the engine holds it)
    kv_rank = kv // tp if cfg.kv_heads >= tp else cfg.head_size
    replicated_kv = 0 if linear else 2 * h * kv_rank - 2 * h * kv // tp  # wk and wv beyond their 1/tp share
    index = block_of_kind(cfg, moe, linear if cfg.linear_heads else None) \
        if cfg.moe_experts or cfg.linear_heads else None
    active = block_matmul_params(cfg, tp, index)  # the one count of a block's matmul work (model/flops.py)
    gate = 2 if cfg.attn_gate else 1  # (the gated attention's wq: a query and a gate a head)
    attn_mats = ((gate * q // tp, h), (kv_rank, h), (kv_rank, h), (h, q // tp)) if not cfg.mla_kv_rank else \
        latent_matrices(cfg, tp)
    norms = 4 if cfg.norm_placement == "both" else 2  # pre- and/or post-norms of the two sub-blocks
    replicated = norms * (2 if cfg.norm == "layernorm" and cfg.bias else 1) * h
    replicated += cfg.mla_kv_rank + cfg.mla_q_rank  # latent attention's norms of its latents
    # q/k norms: one weight of head_size each (Qwen3), replicated; or one over the whole projection
    # (OLMo 2, OLMoE), split over tp like the projection's rows
    projection_norms = (q // tp + kv_rank) if cfg.qk_norm and cfg.qk_norm_scope == "projection" else 0
    if cfg.qk_norm and cfg.qk_norm_scope == "head" and not linear:
        replicated += 2 * cfg.head_size
    sinks = cfg.n_heads // tp if cfg.attn_sinks else 0  # one per query head, split like them (gpt-oss)
    if linear:  # its projections in place of attention's; its convolution and per-head scalars replicated
        attn_mats, replicated = linear_matrices(cfg, tp), replicated + linear_state_params(cfg)
    if moe:
        E, he = cfg.moe_experts, cfg.expert_hidden
        shared = cfg.shared_hidden
        # the active count is attention's share (split by tp), the router and the shared
        # experts (and their gate; whole on every tp rank) and top_k routed experts; a rank holds E / ep
        whole = (E + cfg.moe_shared_gate) * h + n_ffn * h * shared
        attention = active - whole - cfg.moe_top_k * expert_params(cfg) + replicated_kv
        sharded = attention + projection_norms + sinks
        if cfg.moe_bias:
            replicated += E  # the router's
        if cfg.bias:
            sharded += q // tp + 2 * kv_rank  # column-parallel biases
            replicated += h + ((n_ffn - 1) * shared + h if shared else 0)  # wo's, the shared MLP's
        elif cfg.qkv_bias:
            sharded += q // tp + 2 * kv_rank
        local = E // ep
        experts = local * expert_params(cfg)
        held = experts + local * expert_bias_params(cfg)
        mats = attn_mats + ((E, h),) + (((shared, h),) * (n_ffn - 1) + ((h, shared),) if shared else ())
        expert_mats = (((he, h),) * (n_ffn - 1) + ((h, he),)) * local
        return BlockParams(sharded, replicated + whole, attention + whole + experts, mats, held, expert_mats)
    matmul = active + replicated_kv
    sharded = matmul + projection_norms + sinks
    if cfg.bias:
        sharded += (q + (n_ffn - 1) * f) // tp + 2 * kv_rank  # column-parallel biases
        replicated += 2 * h  # row-parallel biases (wo, w2)
    elif cfg.qkv_bias:
        sharded += q // tp + 2 * kv_rank
    mats = attn_mats + ((f // tp, h),) * (n_ffn - 1) + ((h, f // tp),)
    return BlockParams(sharded, replicated, matmul, mats)


def latent_matrices(cfg: ModelConfig, tp: int) -> tuple:
    """Latent attention's matrices on a tp rank (model/mla.py): the compressions whole, the
    up-projections and wo split by heads."""
    h, H, hd, r, v = cfg.dim, cfg.n_heads // tp, cfg.head_size, cfg.mla_kv_rank, cfg.value_dim
    q = ((cfg.mla_q_rank, h), (H * hd, cfg.mla_q_rank)) if cfg.mla_q_rank else ((H * hd, h),)
    return (*q, (r + cfg.mla_rope_dim, h), (H * (hd - cfg.mla_rope_dim + v), r), (h, H * v))


def latent_cache_bytes(cfg: ModelConfig, batch: int, positions: int, bytes_per_value: int = 2) -> int:
    """The generation cache of `batch` sequences of `positions` tokens: latent attention keeps each
    block's latent and rotated shared key (kv_rank + rope_dim a token); ordinary attention its
    keys and values (2 x kv_heads x head_dim); a linear-attention block (model/deltanet.py) its
    state (value heads x dk x dv, in fp32) and its convolution's last (taps - 1) inputs, whatever
    the positions."""
    width = cfg.mla_kv_rank + cfg.mla_rope_dim if cfg.mla_kv_rank else 2 * cfg.kv_heads * cfg.head_size
    linear = sum(cfg.is_linear_block(i) for i in range(cfg.n_layers))
    channels = 2 * cfg.linear_heads * cfg.linear_head_dim + cfg.linear_v_heads * cfg.linear_v_dim
    state = batch * (cfg.linear_v_heads * cfg.linear_head_dim * cfg.linear_v_dim * 4
                     + channels * (cfg.linear_conv - 1) * bytes_per_value)
    return (cfg.n_layers - linear) * batch * positions * width * bytes_per_value + linear * state


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


def rank_blocks(cfg: ModelConfig, layout: Layout, pp_rank: int) -> tuple[int, int]:
    """(dense blocks, mixture-of-experts blocks) that pipeline rank `pp_rank` holds."""
    return _rank_blocks(cfg, layout.pp, layout.pp_virtual_stages, layout.pp_schedule, pp_rank)


@lru_cache(maxsize=4096)
def _rank_blocks(cfg: ModelConfig, pp: int, virtual: int, schedule: str, pp_rank: int) -> tuple[int, int]:
    if not cfg.moe_experts:
        return sum(stage_layers(cfg, Layout(pp=pp, pp_virtual_stages=virtual, pp_schedule=schedule))[pp_rank]), 0
    if pp == 1:
        return cfg.n_layers - cfg.moe_blocks, cfg.moe_blocks
    blocks = _rank_block_ids(cfg, pp, virtual, schedule, pp_rank)
    moe = sum(cfg.is_moe_block(i) for i in blocks)
    return len(blocks) - moe, moe


def _rank_kinds(cfg: ModelConfig, pp: int, virtual: int, schedule: str, pp_rank: int) -> dict[tuple, int]:
    """{(mixture of experts, linear attention): blocks of that kind} that pipeline rank `pp_rank` holds."""
    if not cfg.linear_heads:
        dense, moe = _rank_blocks(cfg, pp, virtual, schedule, pp_rank)
        return {(False, False): dense, (True, False): moe}
    kinds: dict[tuple, int] = {}
    for i in _rank_block_ids(cfg, pp, virtual, schedule, pp_rank):
        kind = (cfg.is_moe_block(i), cfg.is_linear_block(i))
        kinds[kind] = kinds.get(kind, 0) + 1
    return kinds


def _rank_block_ids(cfg: ModelConfig, pp: int, virtual: int, schedule: str, pp_rank: int) -> list[int]:
    """The blocks pipeline rank `pp_rank` holds, as the trainer splits them."""
    from scaletrain.parallel.pipeline import balanced_split_counts, head_cost_in_blocks, stage_indices

    if pp == 1:
        return list(range(cfg.n_layers))
    counts = balanced_split_counts(cfg.n_layers, pp * virtual, head_cost_in_blocks(cfg))
    starts = [sum(counts[:s]) for s in range(len(counts))]
    return [i for s in stage_indices(schedule, pp_rank, pp, virtual) for i in range(starts[s], starts[s] + counts[s])]


def rank_params(cfg: ModelConfig, layout: Layout, pp_rank: int) -> ParamCounts:
    return _rank_params(cfg, layout.tp, layout.pp, layout.pp_virtual_stages, layout.pp_schedule, pp_rank, layout.ep)


@lru_cache(maxsize=16384)
def _rank_params(cfg: ModelConfig, tp: int, pp: int, virtual: int, schedule: str, pp_rank: int,
                 ep: int = 1) -> ParamCounts:
    from scaletrain.parallel.pipeline import stage_indices

    layout = Layout(tp=tp, pp=pp, pp_virtual_stages=virtual, pp_schedule=schedule)
    sharded = replicated = matmul = expert = 0
    matrices, expert_matrices = [], []
    for (moe, linear), n in _rank_kinds(cfg, pp, virtual, schedule, pp_rank).items():
        if n:
            b = layer_params(cfg, tp, moe, ep, linear)
            sharded, replicated, matmul = sharded + n * b.sharded, replicated + n * b.replicated, matmul + n * b.matmul
            expert += n * b.expert
            matrices += list(b.matrices) * n
            expert_matrices += list(b.expert_matrices) * n
    stages = stage_indices(layout.pp_schedule, pp_rank, layout.pp, layout.pp_virtual_stages) if layout.pp > 1 else [0]
    last = layout.num_stages - 1
    h, V = cfg.dim, cfg.vocab_size
    outer = len(matrices)  # the matrices from here on are the embeddings and the head
    if 0 in stages:
        sharded += V * h // tp
        matrices.append((V // tp, h))
        if cfg.position == "learned":
            replicated += cfg.max_seq_len * h
            matrices.append((cfg.max_seq_len, h))
    if last in stages:
        replicated += h * (2 if cfg.norm == "layernorm" and cfg.bias else 1)
        matmul += V * h // tp
        for j in range(cfg.mtp_depth):  # multi-token prediction's depths: a block each, eh_proj and three norms
            b = layer_params(cfg, tp, cfg.is_moe_block(cfg.n_layers + j), ep)
            sharded, matmul, expert = sharded + b.sharded, matmul + b.matmul + 2 * h * h, expert + b.expert
            replicated += b.replicated + 2 * h * h + 3 * h * (2 if cfg.norm == "layernorm" and cfg.bias else 1)
            matrices[outer:outer] = [*b.matrices, (h, 2 * h)]  # (hidden matrices, before the embeddings and head)
            outer += len(b.matrices) + 1
            expert_matrices += list(b.expert_matrices)
        if not (cfg.tie_embeddings and layout.pp == 1):
            sharded += V * h // tp
            matrices.append((V // tp, h))
    return ParamCounts(sharded, replicated, matmul, tuple(matrices), expert, tuple(expert_matrices),
                       len(matrices) - outer)


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
    if optimizer == "muon":
        # one momentum buffer for the hidden matrices, AdamW's two moments for the rest
        return 4.0 * counts.hidden + 8.0 * (counts.total - counts.hidden)
    raise unknown("optimizer", optimizer, OPTIMIZERS)
