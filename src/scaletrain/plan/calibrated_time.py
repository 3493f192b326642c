"""Time per step on the machine at hand, from its calibration (`scaletrain.plan.calibrate`).

The same structure as the catalog's time model (`scaletrain.plan.time_model`), with every
figure measured here instead of taken from a datasheet:

    step = (compute + exposed pipeline sends) × (1 + bubble) + exposed data-parallel communication
           + optimizer step + the clip's all-reduce

all × the machine's slowdown since it was calibrated (`Calibration.slowdown`, from the pace probe).

* Compute, per pipeline rank (the busiest sets the pace): its blocks' measured forward and
  backward seconds at the layout's micro-batch, tp, sp and checkpointing (interpolated between
  measured micro-batch sizes), plus the rest (embedding, head and loss) on the last stage; every
  micro-batch. The tensor-parallel collectives were inside that measurement, as in training,
  so they are not added again.
* Pipeline: each micro-batch sends its activation forward and its gradient back across every
  chunk boundary (measured send/recv); the bubble is the schedule's (`scaletrain schedule`).
* Data parallel, with the measured collectives over the group: DDP all-reduces the fp32
  gradients bucket by bucket during the last micro-batch's backward; ZeRO 1-2 reduce-scatter
  them then (stage 2: every micro-batch) and all-gather the parameters after the step; ZeRO-3
  all-gathers every block for forward and again for backward and reduce-scatters its gradients,
  every micro-batch. The measured overlap says how much of that hides behind the compute it
  runs beside (on a CPU the collective and the compute share the cores).
* The optimizer's measured seconds per parameter, for the parameters this rank steps.
* A mixture of experts under expert parallelism (which the probes do not run): each MoE block's
  four all-to-alls per micro-batch (`time_model.ep_traffic`) with the measured all-to-all, and
  the routed experts' share of a block's measured seconds scaled by the busiest rank's load
  (`Workload.moe_imbalance`); the experts' gradients reduced over their own group.
* For a layout whose every rank is data or tensor parallel (no pipeline), the three items
  above give way to its engine's measured cost (`Calibration.engine`): per block and for the
  rest of the model, once per step and again per micro-batch (`engine_seconds`: measured at one
  and at two micro-batches, not assumed by engine). It is reported as the exposed data-parallel
  time, the optimizer step included.
"""

from __future__ import annotations

import math

from scaletrain.config import ParallelConfig
from scaletrain.model.flops import flops_per_token
from scaletrain.plan.calibrate import Calibration, engine_key, engine_probed, engine_reference_key, layout_key
from scaletrain.plan.params import dtypes_for, moe_block_split, rank_blocks, rank_params, stage_layers
from scaletrain.plan.spec import Cluster, Layout, Workload
from scaletrain.plan.time_model import (
    SYNC_BYTES,
    TimeBreakdown,
    cp_traffic,
    ep_traffic,
    expert_load,
    optimizer_seconds,
    schedule_bubble,
    state_groups,
)
from scaletrain.vocab import PEAK_KIND


def estimate(cfg, wl: Workload, layout: Layout, cluster: Cluster,
             bucket_mb: float = ParallelConfig.bucket_mb) -> TimeBreakdown:
    from scaletrain.parallel.pipeline import stage_indices

    cal: Calibration = cluster.calibration
    d = dtypes_for(wl)
    m = layout.grad_accum
    block, rest = cal.block(layout_key(cfg, wl, layout), layout.micro_batch)
    counts = [sum(c) for c in stage_layers(cfg, layout)]  # layers per pipeline rank
    moe_counts = [rank_blocks(cfg, layout, r)[1] for r in range(layout.pp)]
    load = expert_load(wl, layout)
    if load > 1 and cfg.moe_experts:  # the busiest ep rank's routed experts run `load` times the mean
        attention, whole, routed = moe_block_split(cfg)
        block *= 1 + (load - 1) * routed / (attention + whole + routed) * cfg.moe_blocks / cfg.n_layers
    last = layout.num_stages - 1
    per_rank = []
    for r in range(layout.pp):
        stages = stage_indices(layout.pp_schedule, r, layout.pp, layout.pp_virtual_stages) if layout.pp > 1 else [0]
        per_rank.append(counts[r] * block + (rest if last in stages else 0.0))
    compute = m * max(per_rank)

    pp_comm, bubble = 0.0, 0.0
    act = layout.micro_batch * wl.seq_len / layout.cp * cfg.dim * d.compute
    if layout.pp > 1:
        sent = act / (layout.tp if layout.sp else 1)
        pp_comm = 2 * m * layout.chunks_per_rank * cal.collective_s("send_recv", sent, 2)
        bubble = schedule_bubble(layout.pp_schedule, layout.pp, m, layout.pp_virtual_stages)
    cp_comm = 0.0
    if layout.cp > 1:  # each method's exchange, priced by the measured collectives
        cp_comm = m * max(counts) * sum(cal.collective_s(op, buffer, 2 if op == "send_recv" else layout.cp, calls)
                                        * exposed for op, buffer, calls, exposed in cp_traffic(cfg, wl, layout))

    ep_comm = 0.0
    if layout.ep > 1 and max(moe_counts):
        buffer, calls = ep_traffic(cfg, wl, layout)
        ep_comm = m * max(moe_counts) * cal.collective_s("all_to_all", buffer * load, layout.ep, calls)

    held = max((rank_params(cfg, layout, r) for r in range(layout.pp)), key=lambda c: c.total)
    engine = cal.engine.get(engine_key(cfg, wl, layout)) if engine_probed(layout) else None
    if engine is not None:  # measured with the trainer: reductions, hooks, optimizer step, clipping
        n = max(counts)
        exposed = engine_seconds(engine, n, m)
        if (ref := _engine_reference(cal, cfg, wl, layout, engine)) is not None:
            # the trainer's own steps whole (the engine plus the bare steps timed beside them), less the
            # bare compute at the probe's micro-batch as the compute probes measured it: the layout's
            # compute above comes from the same probes, so where its micro-batch and checkpointing are the
            # probe's the step is the trainer's measured step, not a sum of figures from two sessions
            trained = exposed + m * (n * engine["plain_block"] + engine["plain_rest"])
            exposed = trained - m * (n * ref[0] + ref[1])
        dp_comm = dp_exposed = max(0.0, exposed)
        optimizer = clip = 0.0
    else:
        dp_comm = dp_exposed = 0.0
        left = compute  # the compute the groups' reductions may still hide behind
        key = f"{wl.optimizer}|{wl.precision}"
        optimizer = 0.0
        for group, part in state_groups(layout, held, wl.engine):  # a mixture's routed experts: over their own group
            c, e = data_parallel(cal, wl, group, part.total, left, max(counts), bucket_mb)
            hides = cal.overlap * (1.0 if layout.zero == 3 else 2 / 3 / m)  # of the compute, as data_parallel's
            left = max(0.0, left - (c - e) / hides) if hides > 0 else left
            dp_comm, dp_exposed = dp_comm + c, dp_exposed + e
            n_shard = group.shard_ranks(wl.engine)
            stepped = part.total / n_shard if group.zero >= 1 and n_shard > 1 else part.total
            optimizer += (cal.optimizer[key] * stepped if key in cal.optimizer
                          else optimizer_seconds(wl, group, cluster.hardware, part.total))
        clip = cal.collective_s("all_reduce", 4, layout.world)  # the global gradient norm

    k = cal.slowdown  # the machine's pace now against the calibration's: every figure alike
    compute, pp_comm, cp_comm, ep_comm = compute * k, pp_comm * k, cp_comm * k, ep_comm * k
    dp_comm, dp_exposed, optimizer, clip = dp_comm * k, dp_exposed * k, optimizer * k, clip * k
    busy = compute + pp_comm + cp_comm + ep_comm
    step = busy * (1.0 + bubble) + dp_exposed + optimizer + clip
    model_flops = flops_per_token(cfg, wl.seq_len) * wl.tokens
    peak = cluster.hardware.peak_flops(PEAK_KIND[wl.precision])
    return TimeBreakdown(
        compute_s=compute, tp_comm_s=0.0, cp_comm_s=cp_comm, ep_comm_s=ep_comm, pp_comm_s=pp_comm, dp_comm_s=dp_comm,
        dp_exposed_s=dp_exposed, bubble_s=busy * bubble, optimizer_s=optimizer + clip, step_time_s=step,
        tokens_per_s=wl.tokens / step, mfu=model_flops / (step * peak * layout.world), model_flops=model_flops,
        hardware_flops=model_flops, bubble_fraction=bubble, calibrated=True)


def _engine_reference(cal: Calibration, cfg, wl: Workload, layout: Layout, engine: dict) -> tuple[float, float] | None:
    """(a block's, the rest's) bare forward and backward seconds at the engine probe's micro-batch
    without checkpointing, from the compute probes; None for a calibration that lacks them."""
    key = engine_reference_key(cfg, wl, layout)
    if "plain_block" not in engine or "micro_batch" not in engine or key not in cal.compute:
        return None
    return cal.block(key, int(engine["micro_batch"]))


def engine_seconds(engine: dict[str, float], blocks: int, micro_batches: int) -> float:
    """A step's engine cost (`bench.calibrate.engine_parts`) on a rank of `blocks` blocks that runs
    `micro_batches` micro-batches: what recurs per micro-batch (the trainer's work on each; ZeRO-2's
    reduce-scatters, FSDP's gathers) that many times, the rest once. (A calibration made before the
    probe told them apart has no per-micro-batch part.)"""
    once = blocks * engine["block"] + engine["rest"]
    return once + micro_batches * (blocks * engine.get("block_micro", 0.0) + engine.get("rest_micro", 0.0))


def data_parallel(cal: Calibration, wl: Workload, layout: Layout, params: float, compute: float, units: int,
                  bucket_mb: float) -> tuple[float, float]:
    """(data-parallel communication, the part of it not hidden) per step, with the measured
    collectives and overlap. The dp groups shard over `Layout.shard_ranks` (scaletrain's: the
    dp_shard ranks); the cp ranks then sum their gradients (their shards), exposed."""
    d = dtypes_for(wl)
    m = layout.grad_accum
    n_shard = layout.shard_ranks(wl.engine)
    cp_sum = 0.0
    if layout.cp > 1:  # the Trainer's sum over the cp ranks after backward
        cp_sum = cal.collective_s("all_reduce", params * 4 / (n_shard if layout.zero >= 1 else 1), layout.cp)
    if layout.dp == 1:
        return cp_sum, cp_sum
    r = layout.step_replicas  # local SGD: the replicas sync below, every H steps
    grad_bytes = params * 4  # scaletrain reduces gradients in fp32
    buckets = max(1, math.ceil(grad_bytes / (bucket_mb * 2**20)))
    backward = compute / m * 2 / 3  # the last micro-batch's backward, where gradients are reduced
    if layout.zero == 0:
        comm = cal.collective_s("all_reduce", grad_bytes, n_shard * r, calls=buckets)
        exposed = comm - min(comm, cal.overlap * backward)
    elif layout.zero in (1, 2):
        scatters = m if layout.zero == 2 and layout.pp == 1 else 1
        reduce = cal.collective_s("reduce_scatter", grad_bytes, n_shard, calls=buckets) * scatters
        gather = cal.collective_s("all_gather", params * max(d.param, 4), n_shard, calls=buckets)
        if r > 1:
            reduce += cal.collective_s("all_reduce", grad_bytes / n_shard, r, calls=buckets) * scatters
        comm = reduce + gather
        exposed = reduce - min(reduce, cal.overlap * backward * scatters) + gather  # the gather follows the step
    else:  # FSDP: every block gathered for forward and for backward, its gradients reduce-scattered
        gather = 2 * cal.collective_s("all_gather", params * d.compute, n_shard, calls=units + 1)
        reduce = cal.collective_s("reduce_scatter", grad_bytes, n_shard, calls=units + 1)
        if r > 1:
            reduce += cal.collective_s("all_reduce", grad_bytes / n_shard, r, calls=units + 1)
        comm = m * (gather + reduce)
        exposed = comm - min(comm, cal.overlap * compute)
    if (sync := layout.outer) is not None:  # the workers' outer all-reduce, once every sync.every steps
        shard = params / n_shard if layout.zero >= 1 else params
        outer = cal.collective_s("all_reduce", shard * SYNC_BYTES[sync.dtype], sync.workers)
        comm += outer / sync.every
        exposed += outer / sync.every
    return comm + cp_sum, exposed + cp_sum
