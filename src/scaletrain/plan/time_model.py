"""Time per step: compute, communication, what overlaps, and the pipeline bubble.

    step = (compute + tensor-parallel collectives + exposed pipeline sends) × (1 + bubble)
           + exposed data-parallel communication + optimizer step

* Compute: the step's hardware FLOPs (model FLOPs, plus the recomputed forward under full
  activation checkpointing) split evenly over the ranks, at an achievable fraction of the
  device's dense peak. That fraction is `EFFICIENCY[device]` (calibrated on published runs, see
  `CALIBRATION` and docs/planner.md), lowered for small matmuls: × bs/(bs + 256) for b·s tokens
  per micro-batch and × (h/t)/(h/t + 128) for the hidden width each tensor-parallel rank sees.
* Collectives move ring volumes (all-reduce 2(n-1)/n of the buffer, all-gather and
  reduce-scatter (n-1)/n) at `LINK_EFFICIENCY` of the links the group crosses: NVLink (or
  PCIe) inside a node; across nodes the NICs of the group's members in a node, one ring each.
  Inside a node a measured bus bandwidth replaces that figure where one is given
  (`Hardware.bus_GBps`, from `scaletrain bench comms --json` through `plan --comms FILE`).
* Data-parallel communication overlaps with backward (DDP, ZeRO-1/2: only the last
  micro-batch's backward, when gradients are reduced) or with all of forward and backward
  (ZeRO-3 prefetch), up to `OVERLAP` of that compute; the rest is exposed.
* Tensor-parallel collectives sit on the critical path: four per layer per micro-batch.
* The bubble fraction comes from the schedule's simulated timeline (`scaletrain schedule`).
* The optimizer step reads and writes every state byte once, at the device's memory bandwidth.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from scaletrain.config import ModelConfig
from scaletrain.model.flops import flops_per_token
from scaletrain.plan.memory_model import Dtypes, rank_params
from scaletrain.plan.spec import Cluster, Layout, Workload

# Achievable fraction of dense peak for a large transformer step (calibrated, see CALIBRATION)
EFFICIENCY = {"V100-32GB": 0.45, "A100-40GB": 0.62, "A100-80GB": 0.62, "H100-SXM": 0.40, "H100-PCIe": 0.40,
              "H200": 0.40, "B200": 0.40, "RTX-3090": 0.55, "RTX-4090": 0.55,
              # a CPU's peak is itself measured by a matmul probe, so most of it is reachable
              "CPU": 0.8}
DEFAULT_EFFICIENCY = 0.5
LINK_EFFICIENCY = 0.75  # bus bandwidth a collective reaches, over the link's nominal figure
OVERLAP = 0.8  # the share of the overlappable compute that communication can hide behind
PIPELINE_SEND_EXPOSED = 0.2  # point-to-point activation sends are mostly hidden by compute
SELECTIVE_RECOMPUTE = 0.03  # selective checkpointing recomputes element-wise ops: a few % of compute
OFFLOAD_PCIE_GBPS = 25.0  # host <-> device copies per GPU with optimizer offload
OFFLOAD_HOST_GBPS = 50.0  # host memory bandwidth for the optimizer step, per GPU

# Published measurements the efficiencies were fitted to (and checked against)
CALIBRATION = [
    dict(source="torchtitan docs/performance.md, Llama 3 8B, FSDP, 64 × A100-80GB",
         model="llama-8b", hardware="A100-80GB", nodes=8, gpus_per_node=8, seq_len=8192, micro_batch=1,
         zero=3, ac="selective", precision="bf16-mixed", measured_tokens_per_s_per_gpu=2973, measured_mfu=0.582),
    dict(source="torchtitan docs/performance.md, Llama 3 70B, FSDP, 64 × A100-80GB",
         model="llama-70b", hardware="A100-80GB", nodes=8, gpus_per_node=8, seq_len=8192, micro_batch=1,
         zero=3, ac="full", precision="bf16-mixed", measured_tokens_per_s_per_gpu=331, measured_mfu=0.517),
    dict(source="torchtitan docs/performance.md, Llama 3.1 8B, FSDP, 8 × H100 (500 W), no compile",
         model="llama-8b", hardware="H100-SXM", nodes=1, gpus_per_node=8, seq_len=8192, micro_batch=2,
         zero=3, ac="selective", precision="bf16-mixed", measured_tokens_per_s_per_gpu=5762, measured_mfu=None,
         measured_memory_gib=82.4),
]


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

    def as_dict(self) -> dict[str, float]:
        return dict(vars(self))


@lru_cache(maxsize=4096)
def schedule_bubble(schedule: str, pp: int, micro_batches: int, virtual: int) -> float:
    """Idle over busy time per rank, in closed form (the simulated timelines reproduce them
    exactly: tests/test_timeline.py)."""
    from scaletrain.parallel.timeline import theory

    return theory(schedule, pp, micro_batches, virtual)


def intra_node_bus_GBps(hw) -> float:
    """The bus bandwidth collectives reach inside a node: measured (`scaletrain bench comms`,
    `plan --comms FILE`) where given, else LINK_EFFICIENCY of the link's nominal figure."""
    return hw.bus_GBps or hw.intra_node_GBps * LINK_EFFICIENCY


def _group_link_GBps(cluster: Cluster, stride: int, size: int) -> float:
    """Bus bandwidth per GPU of a collective over `size` ranks `stride` apart (ranks fill nodes
    in order). Inside a node: NVLink (or PCIe). Across nodes NCCL runs one ring per NIC, so the
    group's members in a node share their NICs: min(NVLink, members per node × NIC)."""
    hw = cluster.hardware
    if size <= 1:
        return float("inf")
    if stride * size <= cluster.gpus_per_node:
        return intra_node_bus_GBps(hw)
    per_node = max(1, min(size, cluster.gpus_per_node // stride))
    return min(intra_node_bus_GBps(hw), per_node * hw.inter_node_GBps * LINK_EFFICIENCY)


def efficiency(cluster: Cluster, layout: Layout, cfg: ModelConfig, seq_len: int) -> float:
    base = EFFICIENCY.get(cluster.hardware.name, DEFAULT_EFFICIENCY)
    tokens = layout.micro_batch * seq_len
    width = cfg.dim / layout.tp
    return base * tokens / (tokens + 256) * width / (width + 128)


def estimate_time(cfg: ModelConfig, wl: Workload, layout: Layout, cluster: Cluster) -> TimeBreakdown:
    from scaletrain.plan.memory_model import stage_layers

    hw = cluster.hardware
    d = Dtypes.of(wl.precision)
    dtype_key = {"32-true": "fp32", "tf32": "tf32", "16-mixed": "fp16", "bf16-mixed": "bf16",
                 "bf16-true": "bf16"}[wl.precision]
    peak = hw.peak_flops(dtype_key)
    tokens = wl.tokens
    model_flops = flops_per_token(cfg, wl.seq_len) * tokens
    layer_share = 1.0 - 6.0 * cfg.dim * cfg.vocab_size / (flops_per_token(cfg, wl.seq_len))  # not the head
    recompute = {"none": 0.0, "full": layer_share / 3.0, "selective": 0.0}[layout.ac]
    hardware_flops = model_flops * (1.0 + recompute)
    world = layout.world

    # the busiest pipeline rank sets the pace: scale by its share of the layers
    counts = [sum(c) for c in stage_layers(cfg, layout)]
    imbalance = max(counts) * layout.pp / cfg.n_layers if layout.pp > 1 else 1.0
    eta = efficiency(cluster, layout, cfg, wl.seq_len)
    compute = hardware_flops / world / (peak * eta) * imbalance
    if layout.ac == "selective":
        compute *= 1.0 + SELECTIVE_RECOMPUTE

    m = layout.grad_accum  # micro-batches per step on each data-parallel rank
    act = layout.micro_batch * wl.seq_len * cfg.dim * d.compute  # one micro-batch's hidden states
    # tensor parallel: an all-reduce (or all-gather + reduce-scatter) of the activations after
    # attention and after the MLP, forward and backward, in every layer of this rank
    tp_bw = _group_link_GBps(cluster, 1, layout.tp) * 1e9
    layers_here = max(counts)
    tp_comm = 0.0
    if layout.tp > 1:
        per_collective = 2 * (layout.tp - 1) / layout.tp * act / tp_bw
        tp_comm = 4 * layers_here * m * per_collective + 2 * m * per_collective  # + embedding/head

    # pipeline: activations sent forward and gradients back, per micro-batch and chunk boundary
    pp_comm = 0.0
    bubble = 0.0
    if layout.pp > 1:
        pp_bw = _group_link_GBps(cluster, layout.tp * layout.dp, layout.pp) * 1e9
        chunks = layout.virtual if layout.schedule in ("interleaved-1f1b", "zero-bubble") else 1
        sent = act / (layout.tp if layout.sp else 1)
        pp_comm = 2 * m * chunks * sent / pp_bw * PIPELINE_SEND_EXPOSED
        bubble = schedule_bubble(layout.schedule, layout.pp, m, layout.virtual)

    # data parallel
    dp_comm = dp_exposed = 0.0
    if layout.dp > 1:
        params = max(rank_params(cfg, layout, r).total for r in range(layout.pp))
        n_shard = layout.dp_shard
        shard_bw = _group_link_GBps(cluster, layout.tp, n_shard) * 1e9
        rep_bw = _group_link_GBps(cluster, layout.tp * n_shard, layout.dp_replicate) * 1e9
        ring = (n_shard - 1) / max(n_shard, 1)
        grad_b = 4  # gradients are reduced in fp32
        gather_b = d.compute if layout.zero == 3 else d.param
        if layout.zero == 0:
            n = layout.dp
            dp_comm = 2 * (n - 1) / n * params * grad_b / _group_link_GBps(cluster, layout.tp, n) / 1e9
            hidden_by = compute / m * 2 / 3  # the last micro-batch's backward
        elif layout.zero in (1, 2):
            dp_comm = ring * params * (grad_b + gather_b) / shard_bw
            hidden_by = compute / m * 2 / 3
        else:  # FSDP: gather for forward and backward, reduce-scatter, every micro-batch
            dp_comm = m * ring * params * (2 * gather_b + grad_b) / shard_bw
            hidden_by = compute
        if layout.dp_replicate > 1 and layout.zero >= 1:
            shard_params = params / n_shard
            r = layout.dp_replicate
            dp_comm += 2 * (r - 1) / r * shard_params * grad_b / rep_bw * (m if layout.zero == 3 else 1)
        dp_exposed = max(0.0, dp_comm - OVERLAP * hidden_by)

    # optimizer step: read params, grads, states; write params, states
    opt_params = max(rank_params(cfg, layout, r).total for r in range(layout.pp))
    if layout.dp > 1 and layout.zero >= 1:
        opt_params /= layout.dp_shard
    state_b = {"adamw": 8, "sgd": 4, "adafactor": 0.1, "adamw8bit": 2}[wl.optimizer]
    touched = opt_params * (2 * max(d.param, 4) + 4 + 2 * state_b + (8 if d.master else 0))
    if layout.offload:
        optimizer = touched / (OFFLOAD_HOST_GBPS * 1e9) + opt_params * 8 / (OFFLOAD_PCIE_GBPS * 1e9)
    else:
        optimizer = touched / (hw.memory_GBps * 0.8 * 1e9)

    busy = compute + tp_comm + pp_comm
    step = busy * (1.0 + bubble) + dp_exposed + optimizer
    return TimeBreakdown(
        compute_s=compute, tp_comm_s=tp_comm, pp_comm_s=pp_comm, dp_comm_s=dp_comm, dp_exposed_s=dp_exposed,
        bubble_s=busy * bubble, optimizer_s=optimizer, step_time_s=step, tokens_per_s=tokens / step,
        mfu=model_flops / (step * peak * world), model_flops=model_flops, hardware_flops=hardware_flops,
        bubble_fraction=bubble)

