"""Time per step: compute, communication, what overlaps, and the pipeline bubble.

    step = (compute + tensor-parallel collectives + exposed pipeline sends) × (1 + bubble)
           + exposed data-parallel communication + optimizer step

* Compute, per pipeline rank (the busiest sets the pace): the layers' matmuls at the hardware's
  efficiency (`Hardware.efficiency`, calibrated, see docs/planner.md) lowered for small shapes
  (× x/(x + 128) for the b·s/cp rows and the h/t columns), with --fp8 those the trainer's layer
  rule converts (quant/layers.py: precision.fp8_min_dim's default) at the fp8 peak; attention at
  the kernel's efficiency; element-wise work as memory traffic at HBM speed (fused by
  torch.compile or the engine's kernels); plus what checkpointing recomputes.
* Collectives move ring volumes (all-reduce 2(n-1)/n of the buffer, all-gather and
  reduce-scatter (n-1)/n) at `LINK_EFFICIENCY` of the links the group crosses: NVLink (or
  PCIe) inside a node; across nodes the NICs of the group's members in a node, one ring each.
  Inside a node a measured bus bandwidth replaces that figure where one is given
  (`Hardware.bus_GBps`, from `scaletrain bench comms --json` through `plan --comms FILE`).
* ZeRO-3 gathers layer by layer: a ring latency per collective besides the bandwidth term.
* Data-parallel communication overlaps with backward (DDP, ZeRO-1/2: only the last
  micro-batch's backward, when gradients are reduced) or with all of forward and backward
  (ZeRO-3 prefetch), up to `OVERLAP` of that compute; the rest is exposed.
* Tensor-parallel collectives sit on the critical path: four per layer per micro-batch (ring
  volumes of an all-reduce of the layer's activations, or its all-gather and reduce-scatter
  under sp). scaletrain's mixture-of-experts block has attention's two; its MoE half none
  under sp (each rank routes the sequence shard it holds), and without sp one all-gather of the
  output forward and one of the input's gradient backward (each rank routes a slice of the
  replicated input); and once per step the router's and shared experts' gradients summed over
  tp (`SequenceShardedMoEStep`).
* A mixture of experts: a rank routes its share of its tokens (`routed_share`: under
  scaletrain's tp each rank its own sequence shard, with or without sp); the router's and
  shared experts' matmuls on those, the routed experts' (top_k per token) at the efficiency of
  their groups' rows (tokens × top_k / experts, over the ep ranks' tokens); under expert
  parallelism four all-to-alls per MoE block and micro-batch (dispatch and combine, forward and
  backward; two more when full checkpointing recomputes the forward), each moving the routed
  tokens × top_k × dim in the compute dtype × (ep-1)/ep over the ep group (neighbouring
  ranks: tp first, then cp, then dp_shard), on the critical path. The busiest ep rank computes
  and receives `Workload.moe_imbalance` (max / mean load) times the mean; the routed experts'
  gradients are reduced and stepped over their own group (`expert_shard_ranks`).
* The bubble fraction comes from the schedule's simulated timeline (`scaletrain schedule`).
* The optimizer step reads and writes every state byte once, at the device's memory bandwidth.
* Workers in sites joined by a slow link (`Cluster.workers`, `workers_link_GBps`): a ring that
  crosses it gets link × ring members / world of it (the rings of every other rank cross too).
  Synchronous data parallelism sends its replicate (or flat DDP) all-reduce over it every step;
  local SGD and DiLoCo (`Layout.dp_sync`) reduce gradients inside a worker every step and send
  each rank's pseudo-gradient (2(R-1)/R of its shard, in sync_dtype) once every sync_every = H
  steps, one fragment of F at a time, each overlapped with sync_delay = τ inner steps: exposed
  per step F · max(0, t_fragment − τ · step) / H.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

from scaletrain.model.config import ModelConfig
from scaletrain.model.flops import block_matmul_params, flops_per_token, ns_flops
from scaletrain.model.window import mean_key_span
from scaletrain.plan.calibrate import bus_factor
from scaletrain.plan.params import (
    Dtypes,
    ParamCounts,
    block_of_kind,
    dtypes_for,
    engine_of,
    expert_params,
    expert_shard_ranks,
    moe_block_split,
    rank_blocks,
    rank_params,
)
from scaletrain.plan.spec import Cluster, Layout, Workload
from scaletrain.quant.layers import fp8_share
from scaletrain.vocab import PEAK_KIND

DEFAULT_EFFICIENCY = 0.6  # for hardware whose catalog entry gives none (Hardware.efficiency)
MATMUL_HALF = 128  # a matmul dimension of this size halves the rate (small-GEMM tiles, wave quantization)
# attention FLOPs are counted PaLM's way, without halving for the causal mask; memory-efficient
# kernels skip the masked half at about 70% of the matmul rate, so they reach 1.4x the matmul
# efficiency on counted FLOPs; materialized scores (eager) run at half of it
ATTENTION_EFFICIENCY = {"flash": 1.4, "eager": 0.5}
HBM_EFFICIENCY = 0.8  # memory-bound kernels reach this share of the HBM bandwidth
# eager PyTorch runs our RMSNorm as a chain of kernels, each reading and writing
# the tensor (RMSNorm: upcast, square, mean, rsqrt, two multiplies, downcast): about 4x the
# traffic of one fused kernel. torch.compile, and engines with fused kernels (Megatron's
# fused LayerNorm, bias-GELU and softmax; DeepSpeed's), pay the fused traffic
UNFUSED_TRAFFIC = 4.0
FP8_EFFICIENCY = 0.6  # float8 matmuls reach this share of the bf16 matmul efficiency (scaling, casts)
LINK_EFFICIENCY = 0.75  # bus bandwidth a collective reaches, over the link's nominal figure
HOP_LATENCY_S = {"intra": 3e-6, "inter": 6e-6}  # one ring step of a collective
OVERLAP = 0.8  # the share of the overlappable compute that communication can hide behind
PIPELINE_SEND_EXPOSED = 0.2  # point-to-point activation sends are mostly hidden by compute
SELECTIVE_RECOMPUTE = 0.03  # selective checkpointing recomputes element-wise ops: a few % of compute
OFFLOAD_PCIE_GBPS = 25.0  # host <-> device copies per GPU with optimizer offload
OFFLOAD_HOST_GBPS = 50.0  # host memory bandwidth for the optimizer step, per GPU


def hardware_efficiency(hw) -> float:
    return hw.efficiency or DEFAULT_EFFICIENCY


@dataclass
class TimeBreakdown:
    compute_s: float
    tp_comm_s: float
    pp_comm_s: float
    dp_comm_s: float  # total data-parallel communication time
    dp_exposed_s: float  # the part not hidden by compute
    bubble_s: float
    optimizer_s: float
    step_time_s: float
    tokens_per_s: float
    mfu: float
    model_flops: float
    hardware_flops: float
    bubble_fraction: float
    cp_comm_s: float = 0.0  # exposed context-parallel exchange (cp_traffic)
    reference_s: float = 0.0  # a preference run's reference forward (model, adapters): in step_time_s
    rollout_s: float = 0.0  # an RL run's share of a round's sampling, and its forward before the update (plan.rl)
    ep_comm_s: float = 0.0  # expert parallelism's all-to-alls (ep_traffic), on the critical path
    calibrated: bool = False  # from this machine's calibration (tp collectives inside compute_s), not the catalog

    def as_dict(self) -> dict[str, float]:
        return dict(vars(self))


@lru_cache(maxsize=4096)
def schedule_bubble(schedule: str, pp: int, micro_batches: int, virtual: int) -> float:
    """Idle over busy time per rank, in closed form (the simulated timelines reproduce them
    exactly: tests/test_timeline.py)."""
    from scaletrain.plan.timeline import theory

    return theory(schedule, pp, micro_batches, virtual)


def intra_node_bus_GBps(hw) -> float:
    """The bus bandwidth collectives reach inside a node: measured (`scaletrain bench comms`,
    `plan --comms FILE`) where given, else LINK_EFFICIENCY of the link's nominal figure."""
    return hw.bus_GBps or hw.intra_node_GBps * LINK_EFFICIENCY


def _group_link_GBps(cluster: Cluster, stride: int, size: int, single_rail: bool = False) -> float:
    """Bus bandwidth per GPU of a collective over `size` ranks `stride` apart (ranks fill nodes
    in order). Inside a node: NVLink (or PCIe). Across nodes NCCL runs one ring per NIC, so the
    group's members in a node share their NICs: min(NVLink, members per node × NIC) — or one
    NIC per GPU for an engine whose collectives use one rail (`single_rail`)."""
    hw = cluster.hardware
    if size <= 1:
        return float("inf")
    if stride * size <= cluster.gpus_per_node:
        return intra_node_bus_GBps(hw)
    per_node = 1 if single_rail else max(1, min(size, cluster.gpus_per_node // stride))
    bw = min(intra_node_bus_GBps(hw), per_node * hw.inter_node_GBps * LINK_EFFICIENCY)
    if cluster.workers > 1 and cluster.workers_link_GBps and stride * size > cluster.site:  # crosses the sites
        bw = min(bw, cluster.workers_link_GBps * LINK_EFFICIENCY * size / cluster.world)
    return bw


def _ring_latency(cluster: Cluster, stride: int, size: int) -> float:
    """Seconds of latency in one ring collective: a hop per member."""
    if size <= 1:
        return 0.0
    hop = HOP_LATENCY_S["intra" if stride * size <= cluster.gpus_per_node else "inter"]
    return (size - 1) * hop


def _shape_factor(x: float) -> float:
    return x / (x + MATMUL_HALF)


def efficiency(cluster: Cluster, layout: Layout, cfg: ModelConfig, seq_len: int) -> float:
    """The fraction of dense peak this layout's layer matmuls reach: the hardware's, lowered
    for short token counts (b·s/cp rows) and narrow tensor-parallel shards (h/t columns)."""
    tokens = layout.micro_batch * seq_len / layout.cp
    return hardware_efficiency(cluster.hardware) * _shape_factor(tokens) * _shape_factor(cfg.dim / layout.tp)


def _elementwise_bytes_per_token(cfg: ModelConfig, d: Dtypes, tp: int, sp: bool) -> float:
    """Memory traffic of one layer's element-wise work per token, forward and backward (3x the
    forward's reads and writes): norms, residual adds, the MLP's activation, rotary, dropout."""
    r, c, h = d.residual, d.compute, cfg.dim
    q, kv, f = cfg.n_heads * cfg.head_size, cfg.kv_heads * cfg.head_size, cfg.hidden_dim
    outside = 1 / tp if sp else 1.0
    n_ffn = 3 if cfg.gated else 2
    fwd = 2 * h * (r + c) * outside + 2 * 3 * h * r * outside + n_ffn * f * c / tp
    if cfg.position == "rope":
        fwd += 2 * 2 * (q + kv) * c / tp
    if cfg.dropout > 0:
        fwd += 2 * h * (2 * c + 1) * outside
    return 3 * fwd


def cp_traffic(cfg: ModelConfig, wl: Workload, layout: Layout) -> list[tuple[str, float, int, float]]:
    """One layer's context-parallel exchange for one micro-batch, forward and backward, as
    (collective, buffer bytes as `scaletrain bench comms` counts them, calls, the share on the
    critical path):

    * ring: every rank's K/V block passed round the ring (cp − 1 sends) in forward, and in
      backward again with its dK/dV accumulator: mostly hidden behind the attention blocks it
      feeds (PIPELINE_SEND_EXPOSED);
    * allgather: K/V gathered from every rank before attention, gathered again for backward, and
      dK/dV reduce-scattered back: collectives on the critical path;
    * ulysses: all-to-alls of q, k, v (sequence shards to head shards) and of the output back,
      forward and backward: on the critical path.
    """
    d = dtypes_for(wl)
    rows = layout.micro_batch * wl.seq_len / layout.cp
    kv = rows * 2 * cfg.kv_heads * cfg.head_size / layout.tp * d.compute  # this rank's K and V
    q = rows * cfg.n_heads * cfg.head_size / layout.tp * d.compute
    n = layout.cp
    if layout.cp_method == "allgather":
        return [("all_gather", n * kv, 2, 1.0), ("reduce_scatter", n * kv, 1, 1.0)]
    if layout.cp_method == "ulysses":
        return [("all_to_all", q + kv + q, 2, 1.0)]
    return [("send_recv", kv, 3 * (n - 1), PIPELINE_SEND_EXPOSED)]


def routed_share(wl: Workload, layout: Layout) -> int:
    """Over how many ranks a data-parallel rank's tokens are routed through a mixture of experts,
    each rank routing its share: scaletrain's cp × tp (`Layout.token_ranks`: under tp each rank
    routes its own sequence shard, with or without sp, parallel/tensor_parallel.py); for the
    engines compared against, cp, times tp under sp (without it each tp rank routes them all)."""
    if wl.engine == "scaletrain":
        return layout.token_ranks
    return layout.cp * (layout.tp if layout.sp else 1)


def ep_traffic(cfg: ModelConfig, wl: Workload, layout: Layout) -> tuple[float, int]:
    """One MoE block's expert-parallel exchange for one micro-batch: (the bytes one all-to-all
    carries from a rank, as `scaletrain bench comms` counts its buffer: the rank's routed
    tokens (`routed_share`) × top_k × dim in the compute dtype; the calls: dispatch and
    combine, forward and backward, and again in the forward that full checkpointing recomputes)."""
    tokens = layout.micro_batch * wl.seq_len / routed_share(wl, layout)
    buffer = tokens * cfg.moe_top_k * cfg.dim * dtypes_for(wl).compute
    return buffer, 4 + (2 if layout.activation_checkpointing == "full" else 0)


def tp_collectives(wl: Workload, layout: Layout, dense: int, moe: int) -> float:
    """Tensor-parallel collectives of `dense` and `moe` blocks for one micro-batch, in all-reduces
    of one micro-batch's activations (an all-gather or a reduce-scatter is half of one): a
    block's attention and MLP halves each reduce forward and backward (under sp each gathers
    and scatters). scaletrain's MoE half is not split by tp: under sp it routes the shard it
    holds (none), without sp it slices the replicated input and gathers its output forward, and
    gathers the input's gradient backward (one)."""
    if wl.engine != "scaletrain":
        return 4.0 * (dense + moe)
    return 4.0 * dense + (2.0 if layout.sp else 3.0) * moe


def expert_load(wl: Workload, layout: Layout) -> float:
    """The busiest rank's routed work over the mean: the imbalance under ep (1 without: a rank
    runs every routed token of its own whatever the experts' split)."""
    return wl.moe_imbalance if layout.ep > 1 else 1.0


def compute_seconds(cfg: ModelConfig, wl: Workload, layout: Layout, cluster: Cluster, layers: int,
                    head: bool, moe_layers: int | None = None) -> float:
    """Seconds of compute of one rank for one step: its layers' (and head's) matmuls at the
    shape-dependent efficiency, attention at the kernel's, element-wise work at HBM speed.
    `moe_layers`: how many of the layers are mixtures of experts (None: the model's share)."""
    hw = cluster.hardware
    d = dtypes_for(wl)
    peak = hw.peak_flops(PEAK_KIND[wl.precision])
    tokens = layout.micro_batch * wl.seq_len / layout.cp * layout.grad_accum  # this rank's, per step
    eta = efficiency(cluster, layout, cfg, wl.seq_len)
    if moe_layers is None:
        moe_layers = round(layers * cfg.moe_blocks / cfg.n_layers)
    dense_layers = layers - moe_layers
    linear = 6.0 * block_matmul_params(cfg, 1, block_of_kind(cfg, False) if cfg.moe_experts else None) * \
        dense_layers * tokens / layout.tp
    routed_s = 0.0
    if moe_layers:  # attention split by tp; router, shared and routed experts on the rank's tokens
        attention, whole, routed = moe_block_split(cfg)
        moe_tokens = tokens * layout.cp / routed_share(wl, layout)  # the tokens this rank routes
        linear += 6.0 * moe_layers * (attention * tokens / layout.tp + whole * moe_tokens)
        rows = moe_tokens / layout.grad_accum * layout.ep * cfg.moe_top_k / cfg.moe_experts  # an expert's group
        eta_e = hardware_efficiency(hw) * _shape_factor(rows) * _shape_factor(min(cfg.dim, cfg.expert_hidden))
        routed_s = 6.0 * moe_layers * routed * moe_tokens * expert_load(wl, layout) / (peak * eta_e)
    # the keys each query is scored against: the sequence, or the tiles of a window (model/window.py)
    attn = 12.0 * cfg.n_heads * cfg.head_size * mean_key_span(cfg, wl.seq_len, kernel=True) * layers * tokens / \
        layout.tp
    head_flops = 6.0 * cfg.dim * cfg.vocab_size * tokens / layout.tp if head else 0.0
    if wl.fp8:
        if "fp8" not in hw.peak_tflops:
            from scaletrain.errors import ConfigError

            raise ConfigError(f"hardware {hw.name} has no fp8 peak in the catalog; plan without fp8")
        share = fp8_share(cfg)  # the trainer's rule (quant/layers.py): small linears stay bf16
        linear_s = linear * share / (hw.peak_flops("fp8") * eta * FP8_EFFICIENCY) + \
            linear * (1 - share) / (peak * eta)
    else:
        linear_s = linear / (peak * eta)
    attn_s = attn / (peak * hardware_efficiency(hw) * ATTENTION_EFFICIENCY[wl.attention])
    head_s = head_flops / (peak * hardware_efficiency(hw) * _shape_factor(tokens / layout.grad_accum))
    traffic = _elementwise_bytes_per_token(cfg, d, layout.tp, layout.sp) * layers * tokens
    if moe_layers:  # a mixture's routed copies (gathered, weighted, added back) and its experts' activation
        n_ffn = 3 if cfg.gated else 2
        routed_fwd = cfg.moe_top_k * expert_load(wl, layout) * (n_ffn * cfg.expert_hidden + 4 * cfg.dim) * d.compute
        traffic += 3 * moe_layers * (moe_tokens * routed_fwd - tokens * n_ffn * cfg.hidden_dim * d.compute / layout.tp)
    if head:  # the loss: fp32 logits written, softmax read and written, forward and backward
        traffic += 4 * 4 * cfg.vocab_size / layout.tp * tokens
    if not wl.compile and wl.engine == "scaletrain" and cfg.norm == "rmsnorm":  # LayerNorm is one kernel
        traffic *= UNFUSED_TRAFFIC
    memory_s = traffic / (hw.memory_GBps * 1e9 * HBM_EFFICIENCY)
    layer_s = linear_s + attn_s + routed_s
    recompute = {"none": 0.0, "full": layer_s / 3.0 + memory_s / 3.0,
                 "selective": SELECTIVE_RECOMPUTE * (layer_s + memory_s)}[layout.activation_checkpointing]
    return layer_s + head_s + memory_s + recompute


def estimate_time(cfg: ModelConfig, wl: Workload, layout: Layout, cluster: Cluster) -> TimeBreakdown:
    from scaletrain.parallel.pipeline import stage_indices
    from scaletrain.plan.params import stage_layers

    hw = cluster.hardware
    d = dtypes_for(wl)
    peak = hw.peak_flops(PEAK_KIND[wl.precision])
    tokens = wl.tokens
    model_flops = flops_per_token(cfg, wl.seq_len) * tokens
    layer_share = 1.0 - 6.0 * cfg.dim * cfg.vocab_size / (flops_per_token(cfg, wl.seq_len))  # not the head
    recompute = {"none": 0.0, "full": layer_share / 3.0, "selective": 0.0}[layout.activation_checkpointing]
    hardware_flops = model_flops * (1.0 + recompute)
    world = layout.world

    # the busiest pipeline rank sets the pace
    counts = [sum(c) for c in stage_layers(cfg, layout)]
    moe_counts = [rank_blocks(cfg, layout, r)[1] for r in range(layout.pp)]
    last = layout.num_stages - 1
    ranks = {(counts[r], last in (stage_indices(layout.pp_schedule, r, layout.pp, layout.pp_virtual_stages)
                                  if layout.pp > 1 else [0]), moe_counts[r]) for r in range(layout.pp)}  # distinct
    compute = max(compute_seconds(cfg, wl, layout, cluster, layers, head, moe) for layers, head, moe in ranks)

    m = layout.grad_accum  # micro-batches per step on each data-parallel rank
    act = layout.micro_batch * wl.seq_len / layout.cp * cfg.dim * d.compute  # one micro-batch's hidden states
    # tensor parallel: an all-reduce (or all-gather + reduce-scatter) of the activations after
    # attention and after the MLP, forward and backward, in every layer of this rank
    # (`tp_collectives`: fewer in scaletrain's MoE blocks), and the MoE weights' gradient sum
    tp_bw = _group_link_GBps(cluster, 1, layout.tp) * 1e9
    layers_here = max(counts)
    tp_comm = 0.0
    if layout.tp > 1:
        per_collective = 2 * (layout.tp - 1) / layout.tp * act / tp_bw
        collectives = max(tp_collectives(wl, layout, counts[r] - moe_counts[r], moe_counts[r])
                          for r in range(layout.pp))
        tp_comm = collectives * m * per_collective + 2 * m * per_collective  # + embedding/head
        if wl.engine == "scaletrain" and max(moe_counts):  # SequenceShardedMoEStep, once per step
            # the router's and shared experts' gradients, and the routed experts' unless ep holds them
            summed = moe_block_split(cfg)[1] + (cfg.moe_experts * expert_params(cfg) if layout.ep == 1 else 0)
            tp_comm += 2 * (layout.tp - 1) / layout.tp * summed * max(moe_counts) * d.grad / tp_bw

    # context parallel: each layer's exchange of keys and values (or, under ulysses, of every
    # projection) per micro-batch, forward and backward (`cp_traffic`)
    cp_comm = 0.0
    if layout.cp > 1:
        cp_bw = _group_link_GBps(cluster, layout.stride("cp"), layout.cp) * 1e9
        cp_comm = sum(calls * buffer * bus_factor(op, layout.cp) / cp_bw * exposed
                      for op, buffer, calls, exposed in cp_traffic(cfg, wl, layout)) * layers_here * m

    # pipeline: activations sent forward and gradients back, per micro-batch and chunk boundary
    pp_comm = 0.0
    bubble = 0.0
    if layout.pp > 1:
        pp_bw = _group_link_GBps(cluster, layout.stride("pp"), layout.pp) * 1e9
        chunks = layout.chunks_per_rank
        sent = act / (layout.tp if layout.sp else 1)
        pp_comm = 2 * m * chunks * sent / pp_bw * PIPELINE_SEND_EXPOSED
        bubble = schedule_bubble(layout.pp_schedule, layout.pp, m, layout.pp_virtual_stages)

    # expert parallel: each MoE block's all-to-alls per micro-batch (`ep_traffic`), the busiest
    # rank receiving `expert_load` times the mean
    ep_comm = 0.0
    if layout.ep > 1 and max(moe_counts):
        ep_bw = _group_link_GBps(cluster, 1, layout.ep) * 1e9
        buffer, calls = ep_traffic(cfg, wl, layout)
        one = buffer * bus_factor("all_to_all", layout.ep) * expert_load(wl, layout) / ep_bw + \
            _ring_latency(cluster, 1, layout.ep)
        ep_comm = m * max(moe_counts) * calls * one

    # the fullest rank's parameters; a mixture's routed experts reduce and step over their own group
    held = max((rank_params(cfg, layout, r) for r in range(layout.pp)), key=lambda c: c.total)
    dp_comm, dp_exposed = model_states_seconds(wl, layout, cluster, held, compute, max(counts))
    optimizer = sum(optimizer_seconds(wl, lay, hw, part.total)
                    for lay, part in state_groups(layout, held, wl.engine))
    if wl.optimizer == "muon":  # Newton-Schulz and its owners' gathers, on the fullest pipeline rank
        optimizer += max(sum(muon_seconds(cfg, layout, cluster, r)) for r in range(layout.pp))

    busy = compute + tp_comm + cp_comm + pp_comm + ep_comm
    step = busy * (1.0 + bubble) + dp_exposed + optimizer
    reference = 0.0
    if wl.reference in ("model", "adapters"):  # the reference's forward: a third of a forward and backward's work
        reference = busy * (1.0 + bubble) / 3.0 + (dp_comm / 3.0 if layout.zero == 3 else 0.0)  # ZeRO-3: its gathers
        step += reference
        hardware_flops += model_flops / 3.0
    rollout = 0.0
    if wl.objective == "rl":
        rollout = _rollout_seconds(cfg, wl, layout, cluster, compute, busy * (1.0 + bubble), dp_comm, held)
        step += rollout
    return TimeBreakdown(
        compute_s=compute, tp_comm_s=tp_comm, cp_comm_s=cp_comm, ep_comm_s=ep_comm, pp_comm_s=pp_comm,
        dp_comm_s=dp_comm, dp_exposed_s=dp_exposed, bubble_s=busy * bubble, optimizer_s=optimizer, step_time_s=step,
        tokens_per_s=tokens / step, mfu=model_flops / (step * peak * world), model_flops=model_flops,
        hardware_flops=hardware_flops, bubble_fraction=bubble, reference_s=reference, rollout_s=rollout)


def _rollout_seconds(cfg, wl: Workload, layout: Layout, cluster: Cluster, compute: float, busy: float,
                     dp_comm: float, held: ParamCounts) -> float:
    """An RL step's share of its round's sampling (scaletrain.plan.rl), and the forward that gives the sampling
    policy's log-probs before an update (rl.updates > 1, or an importance-sampling correction)."""
    from scaletrain.plan.rl import generation_seconds

    d = dtypes_for(wl)
    gather = 0.0
    if layout.zero == 3:  # every forward gathers the weights again: a third of the step's dp traffic, a token's
        gather = dp_comm / 3.0
    tp_latency = _ring_latency(cluster, 1, layout.tp)
    round_s = generation_seconds(cfg, wl, layout, cluster, compute, held.total * d.compute, gather, tp_latency)
    old = busy / 3.0 + (dp_comm / 3.0 if layout.zero == 3 else 0.0) if wl.rl_old_pass else 0.0
    return round_s / wl.rl_updates + old


def state_groups(layout: Layout, counts: ParamCounts, engine: str = "scaletrain") -> list[tuple[Layout, ParamCounts]]:
    """The rank's parameters by the data-parallel group that reduces and steps them, each with a
    layout whose data-parallel axes are that group's: all of them under `layout`, or under expert
    parallelism the routed experts apart, over the ranks that hold the same experts
    (`expert_shard_ranks` of them, ep apart in the mesh; the data-parallel replicas beside).
    scaletrain's experts' engine is ZeRO-1/2 at most: under zero 3 it reduce-scatters their
    gradients and gathers the stepped weights once, never per micro-batch (FSDP leaves them out)."""
    dense, experts = counts.parts()
    if layout.ep == 1 or not experts.total:
        return [(layout, counts)]
    zero = layout.expert_zero if engine == "scaletrain" else layout.zero
    group = replace(layout, dp_shard=expert_shard_ranks(layout, engine), tp=layout.ep, cp=1, ep=1, sp=False,
                    zero=zero)
    return [(layout, dense), (group, experts)]


def model_states_seconds(wl: Workload, layout: Layout, cluster: Cluster, counts: ParamCounts, compute: float,
                         units: int) -> tuple[float, float]:
    """`data_parallel_seconds` of each of the rank's `state_groups`: the second hides behind
    what the first left of the compute it overlaps with."""
    comm = exposed = 0.0
    for group, part in state_groups(layout, counts, wl.engine):
        c, e = data_parallel_seconds(wl, group, cluster, part.total, compute, units)
        window = OVERLAP * compute * (1.0 if layout.zero == 3 else 2 / 3 / layout.grad_accum)
        if window > 0:  # the overlap the first used is gone for the next
            compute *= max(0.0, 1.0 - (c - e) / window)
        comm, exposed = comm + c, exposed + e
    return comm, exposed


def data_parallel_seconds(wl: Workload, layout: Layout, cluster: Cluster, params: float, compute: float,
                          units: int) -> tuple[float, float]:
    """(data-parallel communication, the part of it not hidden) per step of a rank holding
    `params` parameters whose compute takes `compute` seconds; ZeRO-3 gathers `units` blocks
    one by one (a ring latency each). ZeRO shards over `Layout.shard_ranks` of the engine:
    scaletrain's over the dp_shard ranks, whose context-parallel copies then sum their
    gradients (their shards) after backward, on the critical path; the other engines over the
    dp_shard × cp ranks, which hold the same weights."""
    if layout.outer is not None:  # every step inside a worker; between the workers every H steps
        inner = replace(layout, dp_replicate=1, dp_sync="step")
        comm, exposed = data_parallel_seconds(wl, inner, cluster, params, compute, units)
        outer, outer_exposed = outer_sync_seconds(layout, cluster, params, step_s=compute + exposed,
                                                  engine=wl.engine)
        return comm + outer, exposed + outer_exposed
    d = dtypes_for(wl)
    engine = engine_of(wl.engine)
    m = layout.grad_accum
    n_shard = layout.shard_ranks(wl.engine)
    ours = engine.name == "scaletrain"
    grad_b = 4 if ours else d.grad  # the dtype gradients are reduced in
    cp_sum = 0.0
    if ours and layout.cp > 1:  # the Trainer's sum over the cp ranks, once per step
        summed = params / n_shard if layout.zero >= 1 else params
        cp_bw = _group_link_GBps(cluster, layout.stride("cp"), layout.cp) * 1e9
        cp_sum = 2 * (layout.cp - 1) / layout.cp * summed * grad_b / cp_bw
    if layout.dp * (1 if ours else layout.cp) == 1:
        return cp_sum, cp_sum
    # the reducing group's members sit a dp_shard stride apart in scaletrain's mesh (its dp groups leave
    # the cp axis out), a cp stride apart for the engines that shard over dp_shard × cp; the dp_replicate
    # groups a dp_replicate stride apart
    stride = layout.stride("dp_shard" if ours else "cp")
    across = layout.stride("dp_replicate")
    single = engine.single_rail_zero3 and layout.zero == 3
    shard_bw = _group_link_GBps(cluster, stride, n_shard, single) * 1e9
    rep_bw = _group_link_GBps(cluster, across, layout.dp_replicate) * 1e9
    latency = _ring_latency(cluster, stride, n_shard)
    ring = (n_shard - 1) / max(n_shard, 1)
    gather_b = d.compute if layout.zero == 3 else d.param
    if layout.zero == 0:
        n = n_shard * layout.dp_replicate
        dp_comm = 2 * (n - 1) / n * params * grad_b / _group_link_GBps(cluster, stride, n) / 1e9
        hidden_by = compute / m * 2 / 3  # the last micro-batch's backward
    elif layout.zero in (1, 2):
        dp_comm = ring * params * (grad_b + gather_b) / shard_bw
        hidden_by = compute / m * 2 / 3
    else:  # FSDP: gather for forward and backward, reduce-scatter, every micro-batch, layer by layer
        dp_comm = m * (ring * params * (2 * gather_b + grad_b) / shard_bw + 3 * units * latency)
        hidden_by = compute
    if layout.dp_replicate > 1 and layout.zero >= 1:
        shard_params = params / n_shard
        r = layout.dp_replicate
        dp_comm += 2 * (r - 1) / r * shard_params * grad_b / rep_bw * (m if layout.zero == 3 else 1)
    return dp_comm + cp_sum, max(0.0, dp_comm - OVERLAP * hidden_by) + cp_sum


SYNC_BYTES = {"fp32": 4, "bf16": 2, "int8": 1 + 4 / 2048}  # per value on the wire (int8: a scale per chunk)


def outer_sync_seconds(layout: Layout, cluster: Cluster, params: float, step_s: float,
                       engine: str = "scaletrain") -> tuple[float, float]:
    """(the workers' sync per step, the part of it not hidden) for local SGD and DiLoCo: each
    rank's pseudo-gradient (its shard under ZeRO, `Layout.shard_ranks` of `engine`)
    reduce-scattered and all-gathered over the dp_replicate ranks once every H steps, in F
    fragments, each overlapped with τ inner steps of `step_s` seconds."""
    sync = layout.outer
    r = sync.workers
    n_shard = layout.shard_ranks(engine)
    shard = params / n_shard if layout.zero >= 1 else params
    across = layout.stride("dp_replicate")  # the dp_replicate ranks' distance in the mesh
    bw = _group_link_GBps(cluster, across, r) * 1e9
    whole = 2 * (r - 1) / r * shard * SYNC_BYTES[sync.dtype] / bw + 2 * _ring_latency(cluster, across, r)
    fragment = whole / sync.fragments
    exposed = sync.fragments * max(0.0, fragment - sync.delay * step_s)
    return whole / sync.every, exposed / sync.every


MUON_NS_STEPS, MUON_NS_BYTES = 5, 2  # the planner assumes optim.muon's defaults: 5 iterations in bf16


def muon_seconds(cfg: ModelConfig, layout: Layout, cluster: Cluster, pp_rank: int) -> tuple[float, float]:
    """(Newton-Schulz compute, its exchange) per step on a rank of pipeline rank `pp_rank` (optim/whole.py):
    each hidden matrix whole on an owner among the n ranks that shard it (ZeRO's dp_shard, tp, or both: n =
    dp_shard x tp), which runs its iterations; pieces there and back, 2(n-1)/n of its values over the n
    ranks. Experts are whole on their ranks (ZeRO splits them between experts)."""
    from scaletrain.plan.params import expert_shard_ranks

    whole = rank_params(cfg, replace(layout, tp=1), pp_rank)
    dense = whole.matrices[:len(whole.matrices) - whole.n_outer]
    flops = sum(ns_flops(r, c, MUON_NS_STEPS) for r, c in dense)
    values = sum(r * c for r, c in dense)
    shard = layout.dp_shard if layout.zero >= 1 else 1
    n = shard * layout.tp
    # the group's ranks: tp's alone, dp_shard's alone, or both (cp's ranks between them, when cp > 1)
    stride = layout.stride("tp") if shard == 1 else layout.stride("dp_shard") * shard // n
    moved, owners = 2 * values * (n - 1) / n / n, n
    experts = sum(ns_flops(r, c, MUON_NS_STEPS) for r, c in whole.expert_matrices)
    if layout.zero >= 1:
        experts /= expert_shard_ranks(layout)
    hw = cluster.hardware
    compute = (flops / owners + experts) / (hw.peak_flops("bf16") * hardware_efficiency(hw))
    if n == 1:
        return compute, 0.0
    bw = _group_link_GBps(cluster, stride, n) * 1e9
    return compute, moved * MUON_NS_BYTES / bw + 2 * _ring_latency(cluster, stride, n)


def optimizer_seconds(wl: Workload, layout: Layout, hw, params: float) -> float:
    """The optimizer step: read parameters, gradients and states, write parameters and states
    (on the host with offload, after copying the gradients there)."""
    d = dtypes_for(wl)
    opt_params = params
    n_shard = layout.shard_ranks(wl.engine)  # what the engine shards: never the cp ranks in scaletrain's
    if layout.zero >= 1 and n_shard > 1:
        opt_params /= n_shard
    state_b = {"adamw": 8, "sgd": 4, "adafactor": 0.1, "adamw8bit": 2, "muon": 4}[wl.optimizer]  # (muon: its matrices')
    touched = opt_params * (2 * max(d.param, 4) + 4 + 2 * state_b + (8 if d.master else 0))
    if (sync := layout.outer) is not None:  # the outer step every H steps: weights, outer weights, momentum
        touched += opt_params * 4 * 6 / sync.every
    if layout.offload_optimizer:
        return touched / (OFFLOAD_HOST_GBPS * 1e9) + opt_params * 8 / (OFFLOAD_PCIE_GBPS * 1e9)
    return touched / (hw.memory_GBps * 0.8 * 1e9)


def estimate_module_time(n_params: int, wl: Workload, layout: Layout, cluster: Cluster) -> TimeBreakdown:
    """The step of a model known only by its parameter count (an arbitrary nn.Module, data
    parallel only): its FLOPs taken as 6N per token at the hardware's efficiency, the
    data-parallel communication and the optimizer step as for any layout (FSDP gathers the
    whole module as one unit: its blocks are unknown here)."""
    hw = cluster.hardware
    peak = hw.peak_flops(PEAK_KIND[wl.precision])
    flops = 6.0 * n_params * wl.tokens
    compute = flops / layout.world / (peak * hardware_efficiency(hw))
    dp_comm, dp_exposed = data_parallel_seconds(wl, layout, cluster, n_params, compute, 1)
    optimizer = optimizer_seconds(wl, layout, hw, n_params)
    step = compute + dp_exposed + optimizer
    return TimeBreakdown(
        compute_s=compute, tp_comm_s=0.0, pp_comm_s=0.0, dp_comm_s=dp_comm, dp_exposed_s=dp_exposed, bubble_s=0.0,
        optimizer_s=optimizer, step_time_s=step, tokens_per_s=wl.tokens / step,
        mfu=flops / (step * peak * layout.world), model_flops=flops, hardware_flops=flops, bubble_fraction=0.0)
