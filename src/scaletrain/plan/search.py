"""Enumerate the layouts a cluster allows, keep those that fit, rank them by throughput.

A layout is a candidate when its ranks fill the cluster, tensor parallelism stays inside a
node (the cluster's rules, here), its global batch is the workload's, and the trainer can run
it: `Layout.errors` on the model and the sequence length — the one home of which tp, pp and cp
sizes a model allows (tp divides the heads and the vocabulary, and divides or is a multiple of
the key/value heads; every pipeline stage gets a layer, and the schedule can run the
micro-batches it gets; a tied embedding under any schedule but zero-bubble; cp cuts the
sequence into 2·cp chunks), and the ZeRO stages its ranks allow.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from functools import lru_cache

from scaletrain.errors import ConfigError
from scaletrain.fmt import seconds, size
from scaletrain.layout import tp_errors
from scaletrain.legality import job_errors
from scaletrain.model.config import ModelConfig
from scaletrain.plan import calibrated_time
from scaletrain.plan.memory_model import GiB, MemoryBreakdown, estimate_memory
from scaletrain.plan.spec import Cluster, Layout, Workload
from scaletrain.plan.time_model import TimeBreakdown, estimate_time
from scaletrain.vocab import AC_MODES, CP_METHODS, PP_SCHEDULES, ZERO_STAGES, is_multi_chunk


@dataclass
class Evaluated:
    layout: Layout
    memory: MemoryBreakdown
    time: TimeBreakdown
    capacity: int
    why_not: list[str] = field(default_factory=list)
    host_capacity: int = 0  # host memory per GPU (its share of the node's RAM) for offloaded states; 0 = unknown

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.capacity and self.host_fits

    @property
    def host_fits(self) -> bool:
        """What offloading moves to the host fits the GPU's share of its node's RAM (unknown RAM: not checked)."""
        return not self.memory.host or not self.host_capacity or self.memory.host <= self.host_capacity

    def to_dict(self) -> dict:
        return {"layout": self.layout.to_dict(), "describe": self.layout.describe(),
                "memory": self.memory.as_dict(), "fits": self.fits, "capacity": self.capacity,
                "host_capacity": self.host_capacity,
                "step_time_s": self.time.step_time_s, "tokens_per_s": self.time.tokens_per_s, "mfu": self.time.mfu,
                "time": self.time.as_dict(), "why_not": self.why_not}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layout_errors(cfg: ModelConfig, wl: Workload, cluster: Cluster, layout: Layout) -> list[str]:
    """Why a layout cannot run at all (empty when it can)."""
    e = []
    if layout.world != cluster.world:
        e.append(f"it uses {layout.world} ranks but the cluster has {cluster.world} GPUs")
    if layout.tp > cluster.gpus_per_node:
        e.append(f"tp {layout.tp} would cross nodes ({cluster.gpus_per_node} GPUs per node)")
    # the one legality check: the rules `train` applies to this layout, model and techniques
    e += job_errors(layout, cfg, wl.techniques, seq_len=wl.seq_len, engine=wl.engine)
    if layout.micro_batch % wl.rows_per_example:
        e.append(f"micro-batch {layout.micro_batch} sequences would split a preference pair (chosen and rejected "
                 "share a micro-batch): an even number of sequences")
    if layout.global_batch != wl.global_batch:
        e.append(f"micro-batch {layout.micro_batch} × accumulation {layout.grad_accum} × dp {layout.dp} "
                 f"≠ global batch {wl.global_batch}")
    return e


def _ep_sizes(cfg: ModelConfig, borrowed: int) -> list[int]:
    """The expert-parallel sizes the search tries: those dividing the experts and the ranks they
    borrow, a replica group's dp_shard × cp × tp (`Layout.errors` says which compose with the
    rest of the layout)."""
    return [ep for ep in _divisors(borrowed) if cfg.moe_experts % ep == 0] if cfg.moe_experts else [1]


def enumerate_layouts(cfg: ModelConfig, wl: Workload, cluster: Cluster, *, max_micro_batch: int = 16,
                      offload: bool = True, sync: dict | None = None) -> Iterator[Layout]:
    """The layouts of `cluster` that `Layout.errors` lets train `cfg` on the workload's
    sequences (and the cluster's rules of `layout_errors`), in the order they are built.
    `sync`: Layout's dp_sync settings (local SGD or DiLoCo) to try as well wherever there are
    several dp_replicate groups (the workers)."""
    for layout in _candidates(cfg, wl, cluster, max_micro_batch, offload, sync):
        if not layout_errors(cfg, wl, cluster, layout):
            yield layout


def _candidates(cfg, wl, cluster, max_micro_batch, offload, sync):
    """Every combination of the sizes that fill the cluster, its batch split every way; a size
    that `Layout.errors` refuses for the model alone (tp, pp, cp) prunes its subtree early."""
    # context parallelism when sequences are long enough to need it
    for cp in _divisors(cluster.world):
        if cp == 1 or (wl.seq_len >= 16384 and not Layout(cp=cp).errors(engine=wl.engine, seq_len=wl.seq_len)):
            yield from _layouts(cfg, wl, cluster, cp, max_micro_batch, offload, sync)


def _layouts(cfg, wl, cluster, cp, max_micro_batch, offload, sync=None):
    world = cluster.world // cp
    # each context-parallel method where its memory is modeled (scaletrain's engine; the time
    # model takes the K/V exchange as a ring for all three), ulysses where the heads divide
    methods = (Layout.cp_method,) if cp == 1 or wl.engine != "scaletrain" else CP_METHODS
    for tp in _divisors(world):
        if tp > cluster.gpus_per_node or tp_errors(cfg, tp):
            continue
        for pp in _divisors(world // tp):
            dp = world // (tp * pp)
            if wl.global_batch % dp:
                continue
            per_rank = wl.global_batch // dp
            for dp_replicate in _divisors(dp):
                dp_shard = dp // dp_replicate
                for zero in ZERO_STAGES:
                    # zero 0 replicates everything: one flat data-parallel group, unless the
                    # dp_replicate groups are workers that sync every few steps
                    syncs = ([{}] if zero or dp_replicate == 1 else []) + \
                        ([sync] if sync is not None and dp_replicate > 1 else [])
                    for mb in _divisors(per_rank):
                        if mb > max_micro_batch:
                            break
                        if mb % wl.rows_per_example:  # a preference pair's two sequences share a micro-batch
                            continue
                        accum = per_rank // mb
                        for schedule, virtual in _schedules(cfg, pp, accum):
                            for ac in AC_MODES:
                                for off in ((False, True) if (offload and zero == 3) else (False,)):
                                    for how in syncs:
                                        for method in methods:
                                            for ep in _ep_sizes(cfg, dp_shard * cp * tp):
                                                yield Layout(dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp,
                                                             pp=pp, cp=cp, cp_method=method, ep=ep, zero=zero,
                                                             sp=tp > 1, pp_schedule=schedule,
                                                             pp_virtual_stages=virtual, micro_batch=mb,
                                                             grad_accum=accum, activation_checkpointing=ac,
                                                             offload_optimizer=off, **how)


@lru_cache(maxsize=4096)
def _schedules(cfg: ModelConfig, pp: int, m: int) -> list[tuple[str, int]]:
    """The pipeline schedules that can run m micro-batches per step on pp stages of the model
    (the trainer's rules, Layout.errors), the interleaved ones with 2 chunks per rank."""
    if pp == 1:
        return [(Layout.pp_schedule, 1)]
    out = []
    for schedule in PP_SCHEDULES:
        virtual = 2 if is_multi_chunk(schedule) else 1
        if not Layout(pp=pp, pp_schedule=schedule, pp_virtual_stages=virtual, grad_accum=m).errors(cfg):
            out.append((schedule, virtual))
    return out


def step_time(cfg: ModelConfig, wl: Workload, layout: Layout, cluster: Cluster) -> TimeBreakdown:
    """The time model for `cluster`: its calibration where it has one (the machine at hand,
    measured), else the catalog's."""
    if cluster.calibration is not None:
        return calibrated_time.estimate(cfg, wl, layout, cluster)
    return estimate_time(cfg, wl, layout, cluster)


def evaluate(cfg: ModelConfig, wl: Workload, cluster: Cluster, layout: Layout, *, gpu: bool = True,
             activations: str = "formula", reserve_fraction: float | None = None) -> Evaluated:
    memory = estimate_memory(cfg, wl, layout, cluster, gpu=gpu, activations=activations)
    t = step_time(cfg, wl, layout, cluster)
    hw, n = cluster.hardware, cluster.gpus_per_node
    ev = Evaluated(layout, memory, t, hw.memory_bytes, host_capacity=hw.host_memory_bytes // n)
    if memory.total > hw.memory_bytes:
        ev.why_not.append(_why_it_does_not_fit(memory, hw.memory_bytes))
    if not ev.host_fits:
        ev.why_not.append(f"needs {memory.host / GiB:.1f} GiB of host memory per GPU for the offloaded model states "
                          f"({n * memory.host / GiB:.1f} GiB on a node of {n}) but the node has "
                          f"{hw.host_memory_bytes / GiB:.1f} GiB of RAM (hardware {hw.name}'s host_memory_GB)")
    return ev


def _why_it_does_not_fit(m: MemoryBreakdown, capacity: int) -> str:
    parts = sorted(((getattr(m, c), c) for c in MemoryBreakdown.COMPONENTS), reverse=True)
    top = ", ".join(f"{c.replace('_', ' ')} {v / GiB:.1f}" for v, c in parts[:3] if v > 0)
    stage = f" on pipeline rank {m.stage}" if m.stage else ""
    return (f"needs {m.total / GiB:.1f} GiB per rank{stage} but the device has {capacity / GiB:.1f} GiB "
            f"(largest: {top} GiB)")


def search(cfg: ModelConfig, wl: Workload, cluster: Cluster, *, top_k: int = 10, gpu: bool = True,
           activations: str = "formula", sync: dict | None = None) -> tuple[list[Evaluated], dict]:
    """All valid layouts ranked: those that fit first, by tokens/s; returns (ranked, stats).
    `sync`: local SGD / DiLoCo settings to try beside synchronous data parallelism."""
    t0 = time.perf_counter()
    results = [evaluate(cfg, wl, cluster, layout, gpu=gpu) for layout in enumerate_layouts(cfg, wl, cluster,
                                                                                              offload=gpu, sync=sync)]
    if not results:
        raise ConfigError(f"no layout of {cluster.world} GPUs divides the global batch of {wl.global_batch} "
                          f"and the model's heads/layers; change the global batch or the cluster")
    results.sort(key=rank_key)
    stats = {"layouts": len(results), "fit": sum(e.fits for e in results), "seconds": time.perf_counter() - t0}
    if activations == "traced":  # re-check the leaders with activations counted on the actual model
        leaders = [evaluate(cfg, wl, cluster, e.layout, gpu=gpu, activations="traced") for e in results[:top_k]]
        leaders.sort(key=rank_key)
        results = leaders + results[top_k:]
    return results, stats


def rank_key(e: Evaluated) -> tuple:
    """The planner's order: the layouts that fit, fastest first; then those that do not, leanest
    first (device and offloaded host memory together), so that when none fits the one closest
    to fitting leads."""
    if e.fits:
        return (0, -e.time.tokens_per_s, e.memory.total)
    return (1, e.memory.total + e.memory.host, -e.time.tokens_per_s)


SAVERS = (("adamw8bit", "8-bit AdamW (--optimizer adamw8bit)"), ("adafactor", "Adafactor (--optimizer adafactor)"))


def savers(best: Evaluated, cfg: ModelConfig, wl: Workload, cluster: Cluster, gpu: bool) -> list[str]:
    """When the leanest layout's model states alone exceed the device, the memory savers that
    change them — a smaller optimizer state, or ZeRO-3 with the states offloaded to host memory
    — each evaluated on that layout, with its figure and whether it would fit."""
    if best.memory.model_states + best.memory.host <= best.capacity:
        return []
    tried = [(words, evaluate(cfg, replace(wl, optimizer=name), cluster, best.layout, gpu=gpu))
             for name, words in SAVERS if name != wl.optimizer]
    lay = best.layout
    if not lay.offload_optimizer:
        off = replace(lay, zero=3, dp_shard=lay.dp, dp_replicate=1, offload_optimizer=True)
        if not layout_errors(cfg, wl, cluster, off):
            tried.append(("ZeRO-3 with offload (--zero 3 --offload)", evaluate(cfg, wl, cluster, off, gpu=gpu)))
    if not tried:
        return []
    words = [f"{name}: {size(e.memory.total)} per GPU" + (f" and {size(e.memory.host)} in host memory"
                                                           if e.memory.host else "")
             + (", fits" if e.fits else ", still too large") for name, e in tried]
    return [f"The model states alone ({size(best.memory.model_states + best.memory.host)} per GPU) exceed the "
            f"device's {size(best.capacity)}; memory savers on {lay.describe()}: " + "; ".join(words) + "."]


def explain(best: Evaluated, ranked: list[Evaluated], cfg: ModelConfig, wl: Workload, cluster: Cluster,
            gpu: bool = True) -> list[str]:
    """The winner's choices in plain words."""
    if not best.fits:
        return [f"No layout fits: the leanest ({best.layout.describe()}) {best.why_not[0]}. "
                "Use more GPUs, a shorter sequence, or a smaller global batch."] + savers(best, cfg, wl, cluster, gpu)
    lay, hw = best.layout, cluster.hardware
    lines = [f"Best: {lay.describe()} — {best.time.tokens_per_s:,.0f} tokens/s, MFU {100 * best.time.mfu:.1f}%, "
             f"{best.memory.total / GiB:.1f} of {hw.memory_bytes / GiB:.1f} GiB per GPU."]
    # why this zero stage
    if lay.dp > 1:
        others = {}
        for z in ZERO_STAGES:
            if z == lay.zero:
                continue
            alt = replace(lay, zero=z, dp_replicate=1 if z == 0 else lay.dp_replicate,
                          dp_shard=lay.dp if z == 0 else lay.dp_shard, offload_optimizer=False)
            if not layout_errors(cfg, wl, cluster, alt):
                others[z] = evaluate(cfg, wl, cluster, alt, gpu=gpu)
        lower = [z for z in others if z < lay.zero]
        if lower and all(not others[z].fits for z in lower):
            z = max(lower)
            lines.append(f"ZeRO-{lay.zero} because ZeRO-{z} would need {size(others[z].memory.total)} per GPU "
                         f"(model states alone {size(others[z].memory.model_states)}); sharding brings the "
                         f"model states to {size(best.memory.model_states)}"
                         + (f" on the GPU, with {size(best.memory.host)} per GPU offloaded to host memory."
                            if best.memory.host else "."))
        elif lower:
            z = max(z for z in lower if others[z].fits)
            o = others[z]
            if o.time.tokens_per_s >= best.time.tokens_per_s * 0.999:
                lines.append(f"ZeRO-{lay.zero}: ZeRO-{z} fits too and is as fast (its communication hides behind "
                             f"compute as well); ZeRO-{lay.zero} is chosen for its lower memory "
                             f"({size(best.memory.total)} vs {size(o.memory.total)}).")
            else:
                lines.append(f"ZeRO-{lay.zero}: ZeRO-{z} would also fit ({size(o.memory.total)}) but reaches "
                             f"{o.time.tokens_per_s:,.0f} tokens/s "
                             f"({100 * (o.time.tokens_per_s / best.time.tokens_per_s - 1):+.1f}%).")
        higher = [z for z in others if z > lay.zero and others[z].fits]
        if higher:
            z = min(higher)
            extra = others[z].time.dp_exposed_s - best.time.dp_exposed_s
            if others[z].memory.total < best.memory.total:
                lines.append(f"ZeRO-{z} would save memory ({size(others[z].memory.total)}) but its extra "
                             f"communication costs {seconds(max(extra, 0))} of exposed time per step.")
            else:  # sharding more saves nothing when its gathered buffers outweigh the shards
                lines.append(f"ZeRO-{z} would not lower the peak here ({size(others[z].memory.total)} against "
                             f"{size(best.memory.total)}).")
    if lay.tp > 1 and best.time.calibrated:
        lines.append(f"Tensor parallel {lay.tp}: its collectives and DTensor's dispatch were measured with the "
                     f"blocks' compute on this machine ({1e3 * best.time.compute_s:.0f} ms per step in all)"
                     + (" (sequence parallel splits the norms' activations too)." if lay.sp else "."))
    elif lay.tp > 1:
        lines.append(f"Tensor parallel {lay.tp} stays inside a node: its 4 collectives per layer run over "
                     f"NVLink/PCIe at {hw.intra_node_GBps:.0f} GB/s rather than the {hw.inter_node_GBps:.0f} GB/s "
                     f"network, costing {1e3 * best.time.tp_comm_s:.0f} ms per step"
                     + (" (sequence parallel splits the norms' activations too)." if lay.sp else "."))
    if lay.pp > 1:
        lines.append(f"Pipeline {lay.pp} ({lay.pp_schedule}) with {lay.grad_accum} micro-batches idles "
                     f"{100 * best.time.bubble_fraction:.1f}% of the busy time: {1e3 * best.time.bubble_s:.0f} ms "
                     f"per step.")
    if lay.activation_checkpointing != "none":
        lines.append(f"Activation checkpointing {lay.activation_checkpointing}: without it the activations "
                     "would not fit or the micro-batch would have to shrink."
                     if not _fits_without_ac(best, cfg, wl, cluster, gpu)
                     else f"Activation checkpointing {lay.activation_checkpointing} lets a larger micro-batch fit.")
    runner = next((e for e in ranked if e.fits and e.layout != lay), None)
    if runner is not None:
        diff = _differences(lay, runner.layout)
        lines.append(f"Runner-up: {runner.layout.describe()} at {runner.time.tokens_per_s:,.0f} tokens/s "
                     f"({100 * (runner.time.tokens_per_s / best.time.tokens_per_s - 1):+.1f}%); it changes "
                     f"{diff}.")
    if cluster.calibration is not None:
        lines.append(calibration_sources(cluster.calibration))
    return lines


def calibration_sources(cal) -> str:
    """Which figures came from this machine's calibration and which from the catalog, in words."""
    ar = cal.collectives.get("all_reduce")
    comms = (f"all-reduce {1e6 * ar[0]:.0f} µs + bus {ar[1] / 1e9:.2f} GB/s" if ar and ar[1] != float("inf")
             else "none (one rank)")
    return (f"Step times calibrated on this machine for {cal.ranks} rank(s) ({cal.machine.split('|')[0]}): compute "
            f"from timed forward/backward of this model's blocks, collectives measured ({comms}; overlap with compute "
            f"{100 * cal.overlap:.0f}%), optimizer step measured{_paced(cal)}; from the catalog: the device's peak "
            f"(for MFU) and links across nodes.")


def _paced(cal) -> str:
    if abs(cal.slowdown - 1) <= 0.01:
        return ""
    return f", all × {cal.slowdown:.2f} for the machine's pace now against the calibration's"


def _fits_without_ac(best: Evaluated, cfg, wl, cluster, gpu) -> bool:
    return evaluate(cfg, wl, cluster, replace(best.layout, activation_checkpointing="none"), gpu=gpu).fits


def _differences(a: Layout, b: Layout) -> str:
    names = {"dp_replicate": "dp replicate", "dp_shard": "dp shard", "tp": "tp", "pp": "pp", "zero": "zero stage",
             "cp": "cp", "ep": "ep", "sp": "sequence parallel", "pp_schedule": "schedule",
             "pp_virtual_stages": "virtual stages",
             "micro_batch": "micro-batch", "grad_accum": "accumulation", "activation_checkpointing": "checkpointing",
             "offload_optimizer": "offload"}
    out = [f"{names[k]} {getattr(a, k)} → {getattr(b, k)}" for k in names if getattr(a, k) != getattr(b, k)]
    return ", ".join(out) or "nothing"


# --------------------------------------------------------------------------------------------
# Workers in sites joined by a slow link: synchronous data parallelism against local SGD / DiLoCo

OVERTAKES = 1.05  # "overtakes": at least 5% more tokens/s


def slow_link(cluster: Cluster) -> bool:
    """The link between the sites gives a rank of the workers' ring less than the network inside
    a site gives a GPU: where syncing every few steps can pay."""
    if cluster.workers < 2 or not cluster.workers_link_GBps:
        return False
    return cluster.workers_link_GBps * cluster.workers / cluster.world < cluster.hardware.inter_node_GBps


def twins(layout: Layout, sync: dict, workers: int) -> tuple[Layout, Layout]:
    """(synchronous, syncing every few steps) versions of `layout`, the same otherwise; a flat
    DDP group becomes `workers` workers of DDP, and back."""
    if layout.outer is not None:
        local = layout
        step = replace(layout, dp_sync="step")
        if layout.zero == 0:  # DDP replicates over one flat group
            step = replace(step, dp_replicate=1, dp_shard=layout.dp)
        return step, local
    step = layout
    base = layout if layout.dp_replicate > 1 or layout.dp % workers else \
        replace(layout, dp_replicate=workers, dp_shard=layout.dp // workers)
    return step, replace(base, **sync)


def workers_comparison(cfg: ModelConfig, wl: Workload, cluster: Cluster, layout: Layout, sync: dict, *,
                       gpu: bool = True) -> list[str]:
    """Synchronous training against its local-SGD/DiLoCo twin on the link between the sites, and
    the link bandwidth below which the latter overtakes (OVERTAKES more tokens/s)."""
    step, local = twins(layout, sync, cluster.workers)
    if local.dp_replicate < 2 or layout_errors(cfg, wl, cluster, local) or layout_errors(cfg, wl, cluster, step):
        return []

    def speeds(gbps: float) -> tuple[float, float]:
        c = replace(cluster, workers_link_GBps=gbps)
        return (step_time(cfg, wl, step, c).tokens_per_s, step_time(cfg, wl, local, c).tokens_per_s)

    link = cluster.workers_link_GBps
    s, d = speeds(link)
    how = local.describe_sync()
    lines = [f"Workers: {cluster.workers} sites of {cluster.site} GPUs joined by {link:g} GB/s. Synchronous "
             f"({step.describe()}): {s:,.0f} tokens/s; {how} ({local.describe()}): {d:,.0f} tokens/s "
             f"({100 * (d / s - 1):+.1f}%)."]
    lo, hi = 1e-4, 1e5  # GB/s: the ratio falls as the link gets faster
    if speeds(hi)[1] >= OVERTAKES * speeds(hi)[0]:
        lines.append(f"{how} stays at least {100 * (OVERTAKES - 1):.0f}% ahead at any link speed.")
    elif speeds(lo)[1] < OVERTAKES * speeds(lo)[0]:
        lines.append(f"{how} never gains {100 * (OVERTAKES - 1):.0f}% here: synchronous training's communication "
                     "hides behind compute.")
    else:
        for _ in range(60):
            mid = (lo * hi) ** 0.5
            a, b = speeds(mid)
            lo, hi = (mid, hi) if b >= OVERTAKES * a else (lo, mid)
        lines.append(f"{how} overtakes synchronous training (at least {100 * (OVERTAKES - 1):.0f}% more tokens/s) "
                     f"below {lo:.3g} GB/s between the sites; above it the synchronous all-reduce hides behind "
                     "compute. Per token, syncing every few steps also costs quality (docs/benchmarks.md).")
    grid = sorted({link, *[10.0 ** e for e in range(-1, 4)]})
    lines.append("  link GB/s     synchronous tok/s     " + f"{how} tok/s")
    for gbps in grid:
        a, b = speeds(gbps)
        lines.append(f"  {gbps:>9g}  {a:>20,.0f}  {b:>20,.0f}{'  <- this link' if gbps == link else ''}")
    return lines
