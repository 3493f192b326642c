"""`scaletrain verify`: does this layout compute what one process computes?

It runs the first N steps of a config twice, with the same seed, data order and learning-rate
schedule: under the config's layout (its ranks started through our launcher) and under a
reference, which is one process, or, when the planner says the model does not fit one device,
the fewest ZeRO-3 ranks that fit (the output says so). Weights come from (seed, parameter
name) and data from (seed, step), so the two runs may differ only by the order in which
floating-point sums are taken. Every step's loss and gradient norm (before clipping) are
compared; the largest relative difference is held against a tolerance that depends on the
precision, and the verdict is PASS (exit 0) or FAIL (exit 1).

Why the gradient norm as well as the loss: AdamW is nearly blind to a uniformly scaled
gradient, and clipping hides a scale too, so a wrong normalisation can leave the losses
almost unchanged; the norm before clipping shows it at the first step.

Workers that sync every few steps (parallel.sync.mode = local_sgd or diloco) are compared with
their simulation: the N workers in one process, each a one-process run on its worker's share
of every step's batch, synced at the same steps by the same code (parallel/local_sgd.py) with
the average over the workers computed in the process. The loss compared is the global batch's
(the mean over the workers), the gradient norm the root mean square of the workers' norms.

What it costs: two short runs, one after the other, in a temporary folder that is removed
afterwards. No checkpoint is written and the config's run folder is never touched. Dropout is
switched off for both runs (its masks depend on the rank by design). One node only.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from scaletrain.config import (
    FaultToleranceConfig,
    JobConfig,
    ParallelConfig,
    flat_keys,
    from_dict,
    load_config,
    preference_reference,
)
from scaletrain.errors import ConfigError
from scaletrain.launch.ranks import quiet, read_spec
from scaletrain.layout import Layout

# Largest relative difference allowed, (loss, gradient norm), over the first CALIBRATED_STEPS
# steps of an honest layout against the reference. Measured on the CPU with gloo, 10 steps:
# 18 layouts of a 4-block micro model (DDP, ZeRO-1/2/3, HSDP, tp, tp+sp, pp gpipe / 1f1b /
# interleaved / zero-bubble, and their 4- and 8-rank compositions), and 2-rank layouts of the
# tiny preset (3.3M parameters). The largest differences seen:
#   32-true     loss 2.2e-7  grad norm 1.6e-6
#   tf32        loss 7.6e-6  grad norm 1.2e-5   (emulated on the micro model: nn.Linear operands
#                                                rounded to TF32's 10-bit mantissa; a CPU runs
#                                                tf32 as 32-true)
#   16-mixed    loss 3.0e-5  grad norm 5.0e-4   (steps both runs took; see `notes` for overflows)
#   bf16-mixed  loss 2.5e-4  grad norm 8.3e-3
#   bf16-true   loss 1.3e-3  grad norm 2.0e-2   (ZeRO-3; the other layouts 1.2e-4 and 9.8e-4)
# The gradient norm differs most at a step where it spikes. The tolerances keep a margin of
# 2.5x to 60x over these figures; what a precision cannot resolve, verify cannot see: one rank's
# gradient x 1.01 before the reduction (2 ranks) moves the norm by ~5e-3: caught at 32-true and
# tf32, not at 16 bits. Check a layout's logic at --precision.mode=32-true.
TOLERANCES: dict[str, tuple[float, float]] = {
    "32-true": (1e-5, 1e-4),
    "tf32": (1e-4, 1e-3),
    "16-mixed": (5e-4, 5e-3),
    "bf16-mixed": (5e-3, 5e-2),
    "bf16-true": (5e-3, 5e-2),
    # fp8 (emulated, ZeRO-3 with fp8 all-gather, 4 steps): loss 2.5e-4, grad norm 4.5e-2 (at a step
    # where the norm spikes: a 1e-7 difference moves a value across an e4m3 rounding boundary)
    "fp8": (5e-3, 1e-1),
}

# int8 pseudo-gradients: the layout's ranks quantize their shards, the simulation whole tensors,
# in chunks of local_sgd.CHUNK values with a scale each: other chunks, other rounding. Measured
# (micro model, 2 workers, tp 2 and ZeRO-3, 10 steps, a sync every 2 steps): loss 6.7e-6, grad
# norm 5.0e-6 at 32-true; the tolerance is the tf32 row's.
INT8_SYNC_TOLERANCE = (1e-4, 1e-3)

DEFAULT_STEPS = 10
CALIBRATED_STEPS = 10  # the run length the tolerances were measured over



@dataclass
class Reference:
    cfg: JobConfig
    layout: Layout  # cfg's, on its ranks (layout.world)
    why: str  # one line for the output

    @property
    def nproc(self) -> int:
        return self.layout.world


# An RL policy loss is 0 up to rounding at each round's first update (the ratio is 1 and a group's advantages sum
# to 0): its differences are relative to at least this much, a loss's typical size being that of an advantage
RL_LOSS_FLOOR = 1e-3


@dataclass
class StepDiff:
    step: int
    loss: tuple[float, float]  # (layout, reference)
    grad_norm: tuple[float, float]
    loss_floor: float = 0.0  # the loss's differences are relative to at least this (RL_LOSS_FLOOR)

    @property
    def loss_rel(self) -> float:
        value, reference = self.loss
        if self.loss_floor and math.isfinite(value) and math.isfinite(reference):
            return abs(value - reference) / max(abs(reference), self.loss_floor)
        return rel_diff(*self.loss)

    @property
    def grad_norm_rel(self) -> float:
        return rel_diff(*self.grad_norm)


def rel_diff(value: float, reference: float) -> float:
    """|value - reference| / |reference|; 0 for the same non-finite value (a step both runs
    skipped for an fp16 overflow), infinite when only one is finite or either is NaN."""
    if value == reference:
        return 0.0
    if not (math.isfinite(value) and math.isfinite(reference)) or reference == 0:
        return math.inf
    return abs(value - reference) / abs(reference)


# --------------------------------------------------------------------------------------------
# Setting up the two runs


def layout_world(par: ParallelConfig, nproc: int | None) -> int:
    """Ranks of the layout: --nproc, or the product of the config's axes."""
    if nproc is not None:
        if nproc < 1:
            raise ConfigError(f"--nproc must be at least 1, got {nproc}")
        return nproc
    if par.dp_shard == -1 and par.zero >= 1:
        raise ConfigError(f"parallel.zero={par.zero} shards over the dp_shard ranks, and parallel.dp_shard=-1 means "
                          "'all remaining ranks': say how many with --nproc N or parallel.dp_shard=N")
    return Layout.config_world(par)


def isolated(cfg: JobConfig, run_dir: Path, steps: int) -> JobConfig:
    """The config as verify runs it: N steps of a quiet run (`scaletrain.launch.ranks.quiet`: a private
    folder, logging every step, no checkpoints, no resuming, no sample), without dropout. Muon's Newton-Schulz
    runs in fp32: in bf16 (its default) a layout's other summation order moves a value across a bf16 rounding
    now and then, and the grad norm drifts by ~1e-4 within 5 steps (measured, ZeRO-1 on 2 ranks), above the
    32-true tolerance; the exchange itself is the same in both dtypes (tests/optim/test_muon.py checks it in
    bf16 bit for bit)."""
    muon = {"optim.muon.ns_dtype": "fp32"} if cfg.optim.name == "muon" else {}
    return cfg.replace(**{**quiet(run_dir), "train.steps": steps, "model.dropout": 0.0, **muon})


def reference(cfg: JobConfig, layout: Layout, why: str) -> Reference:
    """The same run under `layout` (one process, or ZeRO-3 over its ranks), every other parallel
    setting at its default: the config is built from the layout's values, so the two agree."""
    sections = {"parallel": dataclasses.asdict(ParallelConfig()),  # [parallel.sync] with it
                "fault_tolerance": dataclasses.asdict(FaultToleranceConfig())}
    defaults = {k: v for k, v in flat_keys(sections).items() if k != "parallel.timeout_s"}
    values = {**defaults, **layout.config_overrides()}
    return Reference(cfg.replace(**values), layout, why)


def choose_reference(cfg: JobConfig, world: int, device, device_memory_gib: float | None) -> Reference:
    """One process if the planner says it fits one device; else the fewest ranks (at most the
    layout's) that fit with ZeRO-3, with full activation checkpointing if need be."""
    from scaletrain.hardware import local_hardware
    from scaletrain.plan.memory_model import GiB
    from scaletrain.plan.search import evaluate
    from scaletrain.plan.spec import Cluster, Workload

    # the caller has resolved the layout's batch into cfg.train
    g, m, ac = cfg.train.global_batch, cfg.train.micro_batch, cfg.memory.activation_checkpointing
    hw = local_hardware(device)
    if device_memory_gib is not None:
        if device_memory_gib <= 0:
            raise ConfigError(f"--device-memory must be positive (GiB), got {device_memory_gib:g}")
        hw = dataclasses.replace(hw, memory_GB=device_memory_gib * GiB / 1e9)
    rows = 2 if cfg.train.objective == "preference" else 1  # a preference pair: two sequences
    wl = Workload(seq_len=cfg.data.seq_len, global_batch=g * rows, precision=cfg.precision.mode,
                  optimizer=cfg.optim.name, objective=cfg.train.objective, reference=preference_reference(cfg))
    gpu = device.type == "cuda"
    # the same global batch in micro-batches of the same size: accumulation makes up for the ranks
    one_process = Layout(micro_batch=m, grad_accum=g // m, activation_checkpointing=ac)
    one = evaluate(cfg.model, wl, Cluster(hw, 1, 1), in_sequences(one_process, rows), gpu=gpu)
    cap, need = _size(hw.memory_bytes), _size(one.memory.total)
    if one.fits:
        return reference(cfg, one_process, f"1 process (the planner puts it at {need} of the device's {cap})")
    for n in range(2, world + 1):
        if g % n:
            continue
        mb = max(d for d in range(1, min(m, g // n) + 1) if (g // n) % d == 0)
        for ac_n in dict.fromkeys((ac, "full")):
            lay = Layout(dp_shard=n, zero=3, micro_batch=mb, grad_accum=g // n // mb, activation_checkpointing=ac_n)
            ev = evaluate(cfg.model, wl, Cluster(hw, 1, n), in_sequences(lay, rows), gpu=gpu)
            if ev.fits:
                return reference(cfg, lay, f"ZeRO-3 over {n} ranks ({lay.describe()}, {_size(ev.memory.total)} per "
                                           f"rank), the simplest layout that fits: one process does not (the planner "
                                           f"puts it at {need}, the device has {cap})")
    raise ConfigError(f"no reference fits: one process needs {need} (the device has {cap}) "
                      f"and ZeRO-3 over up to {world} ranks does not fit either; verify a smaller model of the same "
                      "shape (fewer layers), or give --device-memory if the planner's figure is wrong")


def in_sequences(layout: Layout, rows: int) -> Layout:
    """A layout whose micro-batch counts examples as the planner counts sequences (a preference pair: 2)."""
    return dataclasses.replace(layout, micro_batch=layout.micro_batch * rows)


def _size(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def same_layout(a: Layout, b: Layout) -> bool:
    keys = ("dp_replicate", "tp", "pp", "zero")
    return a.world == b.world and all(getattr(a, k) == getattr(b, k) for k in keys)


def simulate_workers(cfg: JobConfig, layout: Layout, total_steps: int, run_dir: Path) -> list[dict]:
    """The reference of a layout whose workers (dp_replicate groups) sync every few steps: each
    worker a one-process trainer reading exactly its dp_shard ranks' windows of every step (one
    micro-batch of dp_shard × micro_batch per accumulation step), the workers stepped in turn and
    synced by the same OuterSync as the layout's, with the average over the workers computed here
    (the same encoding and sums). Returns one row per step: the mean loss over the workers and the
    root mean square of their gradient norms, as the layout's run reports them."""
    from scaletrain.data.loader import StepSampler, build_loader
    from scaletrain.optim import set_lr
    from scaletrain.parallel.local_sgd import LocalSGD
    from scaletrain.parallel.replica_average import SimulatedWorkers
    from scaletrain.runtime import single_process
    from scaletrain.schedule import BatchSchedule, TrainSchedule
    from scaletrain.train.trainer import Trainer

    workers, g = layout.dp_replicate, layout.global_batch
    one = Layout(micro_batch=layout.dp_shard * layout.micro_batch, grad_accum=layout.grad_accum,
                 activation_checkpointing=layout.activation_checkpointing)
    shared = SimulatedWorkers(workers, layout.sync_dtype)
    steps = cfg.train.steps
    # each worker's learning rate is the whole run's, at the global batch, times the workers' inner
    # scale (as every rank of the layout's)
    schedule = TrainSchedule.for_job(cfg, BatchSchedule(g, cfg.data.seq_len, g), total_steps)
    runs = []
    for w in range(workers):
        wcfg = isolated(reference(cfg, one, "").cfg, run_dir / f"worker{w}", steps)
        trainer = Trainer(wcfg, single_process(wcfg, one), stream=open(os.devnull, "w"), schedule=schedule)
        sampler = StepSampler(len(trainer.data.dataset), g, one.micro_batch, one.grad_accum, dp_rank=w, dp_size=workers,
                              seed=cfg.train.seed)
        batches = iter(build_loader(trainer.data.dataset, sampler, num_workers=0, pin_memory=False, prefetch_factor=2))
        # the same hook as a layout rank's, averaging through the simulated workers
        sync = LocalSGD.for_run(trainer.pm.optim_params, layout, cfg.parallel, n_blocks=cfg.model.n_layers,
                                comm=shared.member(w))
        runs.append((trainer, batches, sync.outer))
    rows = []
    for step in range(steps):
        losses, norms = [], []
        for trainer, batches, _ in runs:
            set_lr(trainer.optimizer, trainer.schedule.lr(step))
            loss, grad_norm, _, _ = trainer.train_step(batches)
            losses.append(float(loss))
            norms.append(float(grad_norm))
        for _, _, outer in runs:  # every worker starts its sync before any waits for the average
            outer.begin()
        for trainer, _, outer in runs:
            if outer.finish():
                trainer.refresh_weights()
        rows.append({"step": step + 1, "loss": sum(losses) / workers,
                     "grad_norm": math.sqrt(sum(n * n for n in norms) / workers)})
    for trainer, _, _ in runs:
        trainer.folder.release()
    return rows


# --------------------------------------------------------------------------------------------
# Running


def _trainer(cfg: JobConfig, runtime, total_steps: int):
    """A quiet trainer that follows the learning-rate schedule of the whole run, not of N steps."""
    from scaletrain.schedule import TrainSchedule
    from scaletrain.train.trainer import Trainer

    schedule = TrainSchedule.for_job(cfg, runtime.for_config(cfg).layout.batch_schedule(cfg.data.seq_len),
                                      total_steps)
    return Trainer(cfg, runtime, stream=open(os.devnull, "w"), schedule=schedule)


def run(cfg: JobConfig, layout: Layout, total_steps: int, role: str, hook: str | None = None,
        pythonpath: Sequence[str] = ()) -> tuple[int, list[dict]]:
    """Train `cfg` in `layout` (cfg's) on its ranks (one: in this process); returns (exit code,
    metrics rows). `hook`: see `verify`'s layout_hook."""
    from scaletrain.runtime import single_process

    nproc = layout.world
    if nproc == 1:
        trainer = _trainer(cfg, single_process(cfg, layout), total_steps)
        if hook:
            _call_hook(hook, trainer)
        result = trainer.fit()
        return (0 if result["stopped_by"] is None else 128 + int(result["stopped_by"])), result["history"]
    from scaletrain.launch.ranks import RanksFailed, run_on_ranks

    try:
        run_on_ranks("verify", {"config": cfg.to_dict(), "layout": layout.to_dict(), "total_steps": total_steps,
                                "role": role, "hook": hook}, nproc, pythonpath=pythonpath)
        code = 0
    except RanksFailed as e:
        code = e.code
    metrics = Path(cfg.log.run_dir) / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] if metrics.exists() else []
    return code, rows


def compare(layout_rows: list[dict], reference_rows: list[dict], loss_floor: float = 0.0) -> list[StepDiff]:
    ref = {r["step"]: r for r in reference_rows}
    return [StepDiff(r["step"], (r["loss"], ref[r["step"]]["loss"]), (r["grad_norm"], ref[r["step"]]["grad_norm"]),
                     loss_floor) for r in layout_rows if r["step"] in ref]


def table(diffs: list[StepDiff]) -> str:
    head = (f"{'step':>5}  {'loss (layout)':>14}  {'loss (reference)':>16}  {'rel diff':>8}  "
            f"{'grad norm (layout)':>18}  {'grad norm (reference)':>21}  {'rel diff':>8}")
    lines = [head, "-" * len(head)]
    for d in diffs:
        lines.append(f"{d.step:>5}  {d.loss[0]:>14.7f}  {d.loss[1]:>16.7f}  {d.loss_rel:>8.1e}  "
                     f"{d.grad_norm[0]:>18.7f}  {d.grad_norm[1]:>21.7f}  {d.grad_norm_rel:>8.1e}")
    return "\n".join(lines)


def verdict(diffs: list[StepDiff], steps: int, precision: str, sync_dtype: str = "fp32") -> tuple[bool, str]:
    tol_loss, tol_norm = TOLERANCES[precision]
    why = f"precision {precision}"
    if sync_dtype == "int8":
        tol_loss, tol_norm = max(tol_loss, INT8_SYNC_TOLERANCE[0]), max(tol_norm, INT8_SYNC_TOLERANCE[1])
        why += ", int8 pseudo-gradients quantized in other chunks by the layout and the simulation"
    tolerance = f"tolerance loss {tol_loss:.0e}, grad norm {tol_norm:.0e} ({why})"
    if [d.step for d in diffs] != list(range(1, steps + 1)):
        return False, (f"the two runs have steps {[d.step for d in diffs]} in common, not 1 to {steps}; "
                       f"{tolerance}: FAIL")
    worst_loss = max(diffs, key=lambda d: d.loss_rel)
    worst_norm = max(diffs, key=lambda d: d.grad_norm_rel)
    ok = worst_loss.loss_rel <= tol_loss and worst_norm.grad_norm_rel <= tol_norm
    # where it starts going wrong (the largest difference may come later, or tie between steps)
    first = next((d.step for d in diffs if d.loss_rel > tol_loss or d.grad_norm_rel > tol_norm), None)
    return ok, (f"largest relative difference: loss {worst_loss.loss_rel:.1e} at step {worst_loss.step}, grad norm "
                f"{worst_norm.grad_norm_rel:.1e} at step {worst_norm.step}; {tolerance}"
                f"{f'; first step over it: {first}' if first else ''}: {'PASS' if ok else 'FAIL'}")


def notes(diffs: list[StepDiff], steps: int) -> list[str]:
    """What a reader needs to judge the verdict: a step skipped by one run only (from there on
    the two train different weights), and a run longer than the tolerances were measured on."""
    out = []
    for d in diffs:
        skipped = [not math.isfinite(v) for v in d.grad_norm]
        if skipped[0] != skipped[1]:
            which, other = ("layout", "reference") if skipped[0] else ("reference", "layout")
            out.append(f"note: step {d.step}: the {which} skipped the step (non-finite gradients, e.g. an fp16 "
                       f"overflow of the loss scale) and the {other} did not; from there on they train different "
                       "weights")
            break
    if steps > CALIBRATED_STEPS:
        out.append(f"note: the tolerances were measured over {CALIBRATED_STEPS} steps; rounding differences grow "
                   "over longer runs (fast during a loss spike), so a difference that appears only late is weak "
                   "evidence of a fault")
    return out


def verify(config: str | None, overrides: Sequence[str], *, steps: int = DEFAULT_STEPS, nproc: int | None = None,
           device_memory_gib: float | None = None, out: IO[str] | None = None, layout_hook: str | None = None,
           hook_path: Sequence[str] = ()) -> int:
    """Run the layout and the reference, print the comparison; 0 on PASS, 1 on FAIL.

    `layout_hook`: "module:function" (importable, from `hook_path` too), called on every rank of
    the layout run (never the reference's) with its Trainer before it trains — to instrument
    the run, or, as scaletrain's tests do, to plant a known bug and watch verify FAIL."""
    from scaletrain.legality import Techniques, check_job
    from scaletrain.plan.auto import resolve
    from scaletrain.runtime import pick_device

    out = out or sys.stdout
    if steps < 1:
        raise ConfigError(f"--steps must be at least 1, got {steps}")
    from scaletrain.config import DEMO_CONFIG

    cfg = load_config(config or DEMO_CONFIG, overrides)  # without one, the built-in config `train` runs
    total_steps = max(cfg.train.steps, steps)
    world = layout_world(cfg.parallel, nproc)
    device = pick_device(cfg.train.device, 0, world)  # refuses a CUDA layout with too few GPUs
    cfg, layout = resolve(cfg, world, device)
    # the one legality check, said once (not by every rank), of what the layout runs: under RL it replays the
    # rollouts the reference records (below), so a layout that cannot sample (pp, cp) still verifies
    tech = Techniques.of(cfg, device_type=device.type)
    check_job(layout, cfg.model, dataclasses.replace(tech, rl_samples=False), seq_len=cfg.data.seq_len)
    if world == 1:
        raise ConfigError("the layout is one process, which is what verify compares against; give a parallel "
                          "layout (--parallel.tp=2, --parallel.pp=2, ...) or --nproc N for data parallelism")
    # resolve the batch once for both runs: the layout's micro-batch, the same global batch (the
    # layout stays the config's: these are the values it was derived to)
    cfg = cfg.replace(**{"train.global_batch": layout.global_batch, "train.micro_batch": layout.micro_batch,
                         "train.grad_accum": layout.grad_accum, "parallel.pp_microbatches": 0})
    outer = layout.outer  # workers that sync every few steps: simulated in one process
    if outer is not None and layout.batch_rampup:
        raise ConfigError("verify simulates workers that sync every few steps at a fixed batch; drop "
                          "train.batch_rampup to verify the layout (the ramp is checked on its own layouts)")
    if outer is not None:
        ref = Reference(cfg, layout, f"{layout.dp_replicate} workers simulated in one process, each a one-process "
                                     f"run on its worker's share of every step's batch, synced as the layout syncs "
                                     f"({layout.describe_sync()})")
    else:
        ref = choose_reference(cfg, world, device, device_memory_gib)
    if outer is None and same_layout(layout, ref.layout):
        raise ConfigError(f"the layout ({layout.describe_ranks()}) is itself the simplest layout that fits, "
                          "so there is no simpler reference to compare it with; "
                          "give --device-memory if the planner is wrong")

    tmp = Path(tempfile.mkdtemp(prefix="scaletrain-verify-"))
    try:
        layout_cfg = isolated(cfg, tmp / "layout", steps)
        ref_cfg = isolated(ref.cfg, tmp / "reference", steps)
        records = cfg.train.objective == "rl" and not cfg.rl.rollouts
        if records:  # RL: the reference samples and records its rollouts, the layout trains on the same
            layout_cfg, ref_cfg = _replaying(layout_cfg, ref_cfg, ref, tmp / "rollouts.jsonl")
        dropout = f" (model.dropout={cfg.model.dropout:g} in the config)" if cfg.model.dropout else ""
        print(f"scaletrain verify: {config or 'the built-in config'}, {steps} step(s) of {cfg.train.steps}, "
              f"precision {cfg.precision.mode}, device {device.type}, dropout off{dropout}"
              f"{', Muon Newton-Schulz in fp32' if cfg.optim.name == 'muon' else ''}", file=out)
        print(f"layout:    {layout.explain()}", file=out)
        print(f"reference: {ref.why}{'; it samples the rollouts, which the layout replays' if records else ''}",
              file=out, flush=True)
        t0 = time.perf_counter()
        reference_result = None
        if records:  # the reference first: the rollouts it samples are what the layout replays
            reference_result = _reference_run(ref_cfg, ref, layout, total_steps, tmp, outer, out)
            if reference_result[0]:
                return reference_result[0]
        t1 = time.perf_counter()
        code, layout_rows = run(layout_cfg, layout, total_steps, "layout", layout_hook, hook_path)
        t2 = time.perf_counter()
        if code == 2:  # a user error, reported by the launcher in one line
            return 2
        if code:
            print(f"the layout run stopped with exit code {code} after {len(layout_rows)} step(s) (its error is "
                  "above): FAIL", file=out)
            return 1
        if reference_result is None:
            reference_result = _reference_run(ref_cfg, ref, layout, total_steps, tmp, outer, out)
            if reference_result[0]:
                return reference_result[0]
        ref_rows = reference_result[1]
        ref_seconds = (t1 - t0) + (time.perf_counter() - t2)
        diffs = compare(layout_rows, ref_rows, RL_LOSS_FLOOR if cfg.train.objective == "rl" else 0.0)
        print(f"(layout run {t2 - t1:.1f} s, reference run {ref_seconds:.1f} s)\n", file=out)
        print(table(diffs), file=out)
        ok, summary = verdict(diffs, steps, cfg.precision.mode, outer.dtype if outer else "fp32")
        for line in notes(diffs, steps):
            print(line, file=out)
        print(summary, file=out, flush=True)
        return 0 if ok else 1
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _replaying(layout_cfg: JobConfig, ref_cfg: JobConfig, ref: Reference, record: Path) -> tuple[JobConfig, JobConfig]:
    """RL: the reference records the rollouts it samples to `record`, the layout replays them (rl.record,
    rl.rollouts): both train on the same completions, which sampling on another layout would not draw alike."""
    if ref.nproc > 1:
        raise ConfigError(f"verify of an RL run records the reference's rollouts, and its reference needs {ref.nproc} "
                          "ranks (rl.record writes one process's); record them yourself in a run that fits and give "
                          "them with rl.rollouts")
    record.touch()
    return (layout_cfg.replace(**{"rl.rollouts": str(record)}), ref_cfg.replace(**{"rl.record": str(record)}))


def _reference_run(ref_cfg: JobConfig, ref: Reference, layout: Layout, total_steps: int, tmp: Path, outer,
                   out: IO[str]) -> tuple[int, list[dict]]:
    """The reference's rows (simulated workers, or a run on its ranks); a non-zero code if it failed (said)."""
    if outer is not None:
        return 0, simulate_workers(ref_cfg, layout, total_steps, tmp / "reference")
    code, rows = run(ref_cfg, ref.layout, total_steps, "reference")
    if code == 2:
        return 2, rows
    if code:
        print(f"the reference run stopped with exit code {code} after {len(rows)} step(s) (its error is above); "
              "nothing to compare with", file=out)
        return 1, rows
    return 0, rows


# --------------------------------------------------------------------------------------------
# A rank of a run


def run_rank(spec_path: str, out_path: str | None = None) -> int:
    """One rank of a run started by `run` (the `verify` task of scaletrain.launch.worker). It writes no
    result (`out_path`): its metrics are in the run folder, as far as it got."""
    from scaletrain import runtime

    spec = read_spec(spec_path)
    cfg, rt = runtime.prepare_worker(from_dict(spec["config"]), Layout(**spec["layout"]))
    trainer = _trainer(cfg, rt, spec["total_steps"])
    if spec.get("hook"):
        _call_hook(spec["hook"], trainer)
    result = trainer.fit()
    return 0 if result["stopped_by"] is None else 128 + int(result["stopped_by"])


def _call_hook(hook: str, trainer) -> None:
    """`module:function`, called with a layout rank's Trainer before it trains."""
    import importlib

    module, _, name = hook.partition(":")
    getattr(importlib.import_module(module), name)(trainer)
