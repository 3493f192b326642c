"""Predicted against measured: real steps of a layout on the devices at hand.

Measured on each rank: model states (parameters with any master copies or ZeRO shards,
gradients, optimizer state) from live tensors during the first step; the activations one
micro-batch's forward keeps for backward; and the peak — the most memory the rank held at once
during a whole training step (forward, backward, gradient reductions, optimizer step). On CUDA
the peak is the caching allocator's; on CPU, where no allocator keeps statistics, `LiveMemory`
counts every tensor storage from the trainer's construction on. The figures are the largest
over ranks.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
import weakref
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from scaletrain.launch.ranks import quiet, read_spec, run_on_ranks, write_result
from scaletrain.plan.memory_model import GiB


class LiveMemory(TorchDispatchMode):
    """The bytes of all tensor storages alive in this process, and the most alive at once.

    Every storage an operation returns (a factory, a computation, a collective's output, a
    DTensor's local shard) is counted from that operation until the storage is freed — a
    finalizer on the storage takes it off. A storage resized in place (FSDP frees the gathered
    parameters that way, and gathers them back into the same storage) is counted at its new
    size. The live sum is read after every operation, when its outputs and inputs are both alive,
    so `peak` is the true maximum of the storages counted.

    Not counted: storages made before the tracker started or outside operations (`from_numpy`),
    scratch memory inside one operation (a kernel's workspace, what a DTensor operation or a
    collective allocates and frees before returning), the Python heap, and what an allocator
    caches beyond the bytes in use.
    """

    def __init__(self):
        super().__init__()
        self.sizes: dict[int, int] = {}  # storage id -> bytes as last seen
        self.live = 0
        self.peak = 0
        self._resize = None

    def count(self, t) -> None:
        from scaletrain.memory import holding_tensors

        if not isinstance(t, torch.Tensor):
            return
        for held in holding_tensors(t):  # a DTensor's memory is its local shard
            if held.device.type != "meta":
                self._note(held.untyped_storage())

    def _note(self, storage) -> None:
        key, n = storage._cdata, storage.nbytes()
        old = self.sizes.get(key)
        if old is None:
            weakref.finalize(storage, self._freed, key)
        self.sizes[key] = n
        self.live += n - (old or 0)
        self.peak = max(self.peak, self.live)

    def _freed(self, key: int) -> None:
        self.live -= self.sizes.pop(key, 0)

    def reset_peak(self) -> None:
        self.peak = self.live

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            self.count(t)
        return out

    def __enter__(self):
        resize, tracker = torch.UntypedStorage.resize_, self

        def counted_resize(storage, n):
            out = resize(storage, n)
            if storage._cdata in tracker.sizes:
                tracker._note(storage)
            return out

        self._resize = resize
        torch.UntypedStorage.resize_ = counted_resize
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._resize
        return super().__exit__(*exc)


def measure_run(cfg, runtime=None, steps: int = 1, memory: bool = True) -> dict:
    """Build a trainer for `cfg` and measure it (every rank calls this); on CPU the peak counts
    every storage from the trainer's construction on (`LiveMemory`). `memory=False` times the
    steps alone (no memory figures: they are None)."""
    from scaletrain.runtime import pick_device
    from scaletrain.train.trainer import Trainer

    live = LiveMemory() if memory and pick_device(cfg.train.device).type != "cuda" else None
    with live if live is not None else _nothing():
        trainer = Trainer(cfg, runtime, stream=open(os.devnull, "w"))
    return measure(trainer, steps, live, memory=memory)


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def measure(trainer, steps: int = 2, live: LiveMemory | None = None, memory: bool = True) -> dict:
    """Run a few real steps and measure (every rank calls this); `steps` are timed (0: none, the
    memory figures alone). On CPU the peak needs a `LiveMemory` that saw the trainer built
    (`measure_run`); without one it is None. `memory=False`: two warm-up steps, then the timed ones."""
    batches = trainer.batches()
    cuda = trainer.rt.device.type == "cuda"
    if not memory:
        trainer.train_step(batches)
        trainer.train_step(batches)
        return {"peak": None, "activations": None, "step_time_s": _timed_steps(trainer, batches, steps)}
    with live if live is not None else _nothing():
        trainer.train_step(batches)  # also measures the model states
        trainer.train_step(batches)  # DDP rebuilds its buckets in the second forward: not activations
        activations = activation_bytes(trainer, batches)
        if cuda:
            torch.cuda.synchronize(trainer.rt.device)
            torch.cuda.reset_peak_memory_stats(trainer.rt.device)
        elif live is not None:
            live.reset_peak()
        trainer.train_step(batches)  # a steady step: every state exists, nothing is created once
        if cuda:
            torch.cuda.synchronize(trainer.rt.device)
            peak = torch.cuda.max_memory_allocated(trainer.rt.device)
        else:
            peak = live.peak if live is not None else None
    # timed outside the tracker (it costs a Python call per operation)
    return {**trainer.meter.state_bytes, "activations": activations, "peak": peak,
            "step_time_s": _timed_steps(trainer, batches, steps)}


def _timed_steps(trainer, batches, steps: int) -> float | None:
    """The median seconds of `steps` training steps (None for 0 steps: memory alone)."""
    if steps == 0:
        return None
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        trainer.train_step(batches)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def predicted_components(ev, cfg, wl, layout, gpu: bool = False) -> dict:
    """The planner's figures in the measured components' terms: per-micro-batch activations,
    and as the peak the total that decides "fits" (on a GPU less the runtime's workspaces,
    which live outside the caching allocator)."""
    from scaletrain.plan.activations import in_flight
    from scaletrain.plan.memory_model import RUNTIME_BYTES_GPU

    m = ev.memory
    flight = (max(in_flight(layout.pp_schedule, layout.pp, layout.grad_accum, layout.pp_virtual_stages))
              if layout.pp > 1 else 1)
    return {"params": m.params + m.master, "grads": m.grads, "optimizer": m.optimizer,
            "activations": m.activations / flight + m.logits_loss,
            "peak": m.total - (RUNTIME_BYTES_GPU if gpu else 0), "step_time_s": ev.time.step_time_s}


def planned(cfg, ranks: int, hardware, gpu: bool = False):
    """The planner's evaluation of the layout `cfg` (a JobConfig giving train.micro_batch and
    train.global_batch) runs on `ranks` local processes."""
    from scaletrain.plan import plan

    par = cfg.parallel
    layout = {"zero": par.zero, "tp": par.tp, "pp": par.pp, "sp": par.sp, "micro_batch": cfg.train.micro_batch,
              "ac": cfg.memory.activation_checkpointing}
    if par.pp > 1:
        layout.update(schedule=par.pp_schedule, virtual=par.pp_virtual_stages)
    if par.cp > 1:
        layout.update(cp=par.cp, cp_method=par.cp_method)
    r = plan(cfg.model, hardware=hardware, nodes=1, gpus_per_node=ranks, seq_len=cfg.data.seq_len,
             global_batch=cfg.train.global_batch, precision=cfg.precision.mode, optimizer=cfg.optim.name,
             layout=layout, gpu=gpu, adapter=cfg.adapter.kind, adapter_rank=cfg.adapter.rank,
             adapter_targets=cfg.adapter.targets, base_dtype=cfg.adapter.base_dtype)
    return r["layouts"][0]


def measure_layouts(overrides: list[dict], nproc: int, steps: int = 1, config: str | None = None,
                    memory: bool = True, rounds: int = 1) -> list[list[dict]]:
    """Measure each set of overrides ({"section.key": value} on `config`, or on the defaults)
    on `nproc` local ranks, all in one group of processes; per set, one row per rank
    (`memory=False`: step times alone). With `rounds` > 1 every set is measured once per round,
    the sets in turn, and each keeps its median round (the faster of the middle two for an even
    count): a machine that slows down for a while slows every set alike rather than the one
    measured then, and one round that found the cores free does not decide either (the
    calibration's probes keep their median call too)."""
    if nproc == 1:
        from scaletrain.config import load_config

        return _median_round([[[measure_run(load_config(config, o), steps=steps, memory=memory)] for o in overrides]
                         for _ in range(rounds)])
    return run_on_ranks("measure", {"config": config, "jobs": overrides, "steps": steps, "memory": memory,
                                    "rounds": rounds}, nproc)


def calibration(model_cfg, probes: list[dict], optimizers: list[tuple[str, str]], ranks: int,
                device_type: str = "cpu", note=None):
    """This machine's calibration for `ranks` ranks (`scaletrain.plan.calibrate`), with a compute
    probe for each of `probes` ({"precision", "seq_len", "micro_batch", "tp", "sp", "ac", "cp"})
    and a step of each of `optimizers` ((name, precision)): read from the cache, what is missing
    measured in one group of `ranks` processes (said to `note`, with the seconds it took)."""
    from dataclasses import asdict

    from scaletrain.plan import calibrate

    cal = calibrate.load(device_type, ranks)
    compute, steps = calibrate.missing(cal, model_cfg, probes, optimizers)
    pace = pace_seconds()
    if cal is not None and not compute and not steps:
        return paced(cal, pace, note)
    t0 = time.perf_counter()
    got = run_on_ranks("calibrate", {"model": asdict(model_cfg), "probes": compute, "optimizers": steps,
                                     "collectives": cal is None, "device": device_type}, ranks)
    cal = paced(calibrate.merge(cal, got, device_type, ranks, pace), pace, note)
    if note is not None:
        busy = _busy(ranks)
        if busy:
            note(f"{busy} while calibrating: its figures may be slow; delete {calibrate.cache_file()} to measure "
                 "again when it is quiet")
        engines = sum(1 for p in compute if p.get("engine"))
        what = [f"{len(compute) - engines} compute probe(s)", f"{engines} engine probe(s)"]
        what += ["collectives and overlap"] if got["collectives"] else []
        what += [f"{len(steps)} optimizer step(s)"] if steps else []
        note(f"calibrated this machine for {ranks} rank(s): {', '.join(what)} in {time.perf_counter() - t0:.0f} s "
             f"(cached in {calibrate.cache_file()})")
    return cal


PACE_REPS = 7  # timed calls of the pace probe (the median is kept), after one warm-up
PACE_MATMULS = 200  # per call: long enough to span the time slices of a shared core (~15 ms idle here)


def pace_seconds(reps: int = PACE_REPS) -> float:
    """The seconds one thread of this process takes for a fixed piece of work (`PACE_MATMULS`
    192 × 192 matmuls): the machine's speed now, as far as what else runs on it
    slows a calibration's probes and a layout's steps alike. The median of `reps` calls."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a = torch.randn(192, 192, generator=torch.Generator().manual_seed(0))
        times = []
        for i in range(reps + 1):
            t0 = time.perf_counter()
            for _ in range(PACE_MATMULS):
                a @ a
            if i:
                times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    return statistics.median(times)


def paced(cal, pace: float, note=None):
    """`cal` scaled to the machine's pace now (`Calibration.slowdown`), said to `note` when it moved
    by more than 10%."""
    cal.slowdown = pace / cal.pace if cal.pace and pace else 1.0
    if note is not None and abs(cal.slowdown - 1) > 0.1:
        way = "slower" if cal.slowdown > 1 else "faster"
        note(f"this machine runs {cal.slowdown:.2f}x as long now as when it was calibrated (a fixed piece of work "
             f"took {1e3 * pace:.0f} ms, then {1e3 * cal.pace:.0f} ms: {way}); the calibrated step times are "
             "scaled by it")
    return cal


MEASURE_START_S = 4.0  # a measured layout's own cost besides its timed steps: building it, warm-up steps


def measured_best(cfg, ranked: list, world: int, budget_s: float, note=None):
    """Time real steps of the best predicted layouts that fit — as many as about `budget_s`
    seconds allow, at least two — and return the fastest measured one's evaluation."""
    fitting = [ev for ev in ranked if ev.fits]
    each = [MEASURE_START_S + 5 * ev.time.step_time_s for ev in fitting]
    k = 0
    while k < len(fitting) and (k < 2 or sum(each[:k + 1]) <= budget_s):
        k += 1
    if k < 2:
        return fitting[0]
    path = Path(tempfile.mkdtemp(prefix="scaletrain-auto-")) / "config.json"
    path.write_text(json.dumps(cfg.replace(**{"parallel.layout": "manual", "parallel.auto_measure_s": 0}).to_dict()))
    rows, took = measure_evaluations(path.as_posix(), fitting[:k], world, {"parallel.pp_microbatches": 0},
                                     steps=3, memory=False)
    fastest = min(range(k), key=lambda i: rows[i]["measured_s"])
    if note is not None:
        timed = "; ".join(f"{r['layout']} {r['measured_s'] * 1e3:.0f} ms (predicted {r['predicted_s'] * 1e3:.0f})"
                          for r in rows)
        note(f"parallel.auto_measure_s={budget_s:g}: timed the {k} best predicted layouts in {took:.0f} s: {timed}")
    return fitting[fastest]


def _busy(ranks: int) -> str | None:
    """Words saying the machine had more to run than its cores beside the calibration's own
    `ranks` (the last minute's load average), or None (or where the OS does not say)."""
    from scaletrain.hardware import cpu_cores

    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return None
    cores = cpu_cores()
    if load - ranks <= cores / 2:
        return None
    return f"the machine was busy (load average {load:.1f} on {cores} cores, {ranks} of it the calibration's)"


def measure_rank(spec: str, out: str) -> int:
    """One rank of measure_layouts (the `measure` task of scaletrain.launch.worker)."""
    import torch.distributed as dist

    from scaletrain.config import load_config
    from scaletrain.runtime import init_worker

    job = read_spec(spec)
    rounds = []
    for k in range(job.get("rounds", 1)):
        results = []
        for overrides in job["jobs"]:
            if k and overrides.get("log.run_dir"):  # a run folder of its own: the last round's trainer holds its lock
                overrides = {**overrides, "log.run_dir": f"{overrides['log.run_dir']}-{k}"}
            cfg = load_config(job["config"], overrides)
            rt = init_worker(cfg)
            rows = [None] * rt.world_size
            dist.all_gather_object(rows, measure_run(cfg, rt, steps=job["steps"], memory=job.get("memory", True)))
            results.append(rows)
            dist.barrier()
        rounds.append(results)
    if dist.get_rank() == 0:
        write_result(out, _median_round(rounds))
    return 0


def _median_round(rounds: list[list[list[dict]]]) -> list[list[dict]]:
    """Per set, the rows of its median round by step time (the slowest rank's decides; the faster
    of the middle two for an even count; a round whose steps were not timed counts as 0)."""
    def slowest(rows):
        return max(r["step_time_s"] or 0.0 for r in rows)

    return [sorted(runs, key=slowest)[(len(runs) - 1) // 2] for runs in zip(*rounds)]


def run_layout(config: str, layout, nproc: int, overrides: dict | None = None) -> list[dict]:
    """Measure `layout` with the model and data of `config` (and `overrides`, {"section.key": value})
    on `nproc` local ranks."""
    overrides = {**(overrides or {}), **layout.config_overrides(), **quiet(tempfile.mkdtemp(prefix="plan-measure-"))}
    return measure_layouts([overrides], nproc, steps=2, config=config)[0]


def measure_and_print(config: str, result: dict, nproc: int, overrides: dict | None = None) -> int:
    """Run real steps of the plan's first layout here and print its prediction beside what they
    measured. The prediction is the plan's own evaluation (`result`, which the plan's table
    printed, calibrated or not): planning the layout again here could give a second figure."""
    from scaletrain.config import load_config
    from scaletrain.runtime import pick_device

    ev = result["layouts"][0]
    layout, hw = ev.layout, result["cluster"].hardware
    device = pick_device(load_config(config, overrides or {}).train.device)
    predicted = predicted_components(ev, result["cfg"], result["workload"], layout, gpu=device.type == "cuda")
    rows = run_layout(config, layout, nproc, overrides)
    source = "calibrated on this machine" if ev.time.calibrated else "the catalog's time model"
    print(f"\nmeasured on {nproc} × {hw.name} ({layout.describe()}), largest over ranks; predicted: the plan above "
          f"({source}):")
    print(f"{'component':<22}{'predicted':>14}{'measured':>14}{'ratio':>8}")
    for key in ("params", "grads", "optimizer", "activations", "peak", "step_time_s"):
        values = [r[key] for r in rows if r.get(key) is not None]
        if not values:
            print(f"{key:<22}{_fmt(key, predicted[key]):>14}{'(n/a)':>14}")
            continue
        got = max(values)
        ratio = predicted[key] / got if got else float("nan")
        print(f"{key:<22}{_fmt(key, predicted[key]):>14}{_fmt(key, got):>14}{ratio:>8.2f}")
    return 0


def kendall_tau(a: list[float], b: list[float]) -> float:
    """Kendall's tau-a between two orders of the same items (1: the same order, -1: reversed)."""
    n, score = len(a), 0
    for i in range(n):
        for j in range(i + 1, n):
            x, y = a[i] - a[j], b[i] - b[j]
            score += (x * y > 0) - (x * y < 0)
    return score / (n * (n - 1) / 2) if n > 1 else 1.0


def measure_evaluations(config: str | None, evaluations: list, nproc: int, overrides: dict | None = None,
                        steps: int = 3, memory: bool = True, rounds: int = 1) -> tuple[list[dict], float]:
    """Real steps of each of the planner's layouts (`evaluations`, in its order) on `nproc` local
    ranks, in one group of processes: (one row per layout, in that order; seconds it all took)."""
    jobs = []
    for ev in evaluations:
        jobs.append({**(overrides or {}), **ev.layout.config_overrides(),
                     **quiet(tempfile.mkdtemp(prefix="plan-measure-"))})
    t0 = time.perf_counter()
    measured = measure_layouts(jobs, nproc, steps=steps, config=config, memory=memory, rounds=rounds)
    rows = []
    for i, (ev, ranks) in enumerate(zip(evaluations, measured)):
        peaks = [r["peak"] for r in ranks if r.get("peak") is not None]
        rows.append({"predicted_rank": i + 1, "layout": ev.layout.describe(),
                     "predicted_s": ev.time.step_time_s, "measured_s": max(r["step_time_s"] for r in ranks),
                     "predicted_peak": ev.memory.total, "measured_peak": max(peaks) if peaks else None})
    return rows, time.perf_counter() - t0


def print_ranking(rows: list[dict], out=print) -> dict:
    """`rows` (measure_evaluations') re-ranked by measured step time, the prediction beside each,
    then Kendall's tau between the two orders and whether the predicted best is the measured
    best; returns {"tau", "ratios": (lowest, highest) predicted/measured, "best_gap": the
    predicted best's measured step over the measured best's}."""
    order = sorted(rows, key=lambda r: r["predicted_s"])
    rows = [{**r, "predicted_rank": order.index(r) + 1} for r in sorted(rows, key=lambda r: r["measured_s"])]
    memory = any(r["measured_peak"] is not None for r in rows)
    out(f"{'#':>3} {'predicted #':>11}  {'layout':<44}{'predicted':>11}{'measured':>11}{'ratio':>7}"
        + (f"{'peak pred.':>12}{'measured':>11}" if memory else ""))
    for k, r in enumerate(rows, 1):
        line = (f"{k:>3} {r['predicted_rank']:>11}  {r['layout']:<44}{_fmt('step_time_s', r['predicted_s']):>11}"
                f"{_fmt('step_time_s', r['measured_s']):>11}{r['predicted_s'] / r['measured_s']:>7.2f}")
        if memory:
            peak = _fmt("peak", r["measured_peak"]) if r["measured_peak"] is not None else "n/a"
            line += f"{_fmt('peak', r['predicted_peak']):>12}{peak:>11}"
        out(line)
    ratios = [r["predicted_s"] / r["measured_s"] for r in rows]
    tau = kendall_tau([r["predicted_s"] for r in rows], [r["measured_s"] for r in rows])
    first = next(r for r in rows if r["predicted_rank"] == 1)
    gap = first["measured_s"] / rows[0]["measured_s"]
    if len(rows) > 1:
        verdict = ("the predicted best is the measured best" if first is rows[0] else
                   f"the measured best was predicted #{rows[0]['predicted_rank']}; the predicted best measured "
                   f"{gap:.2f}x its step time")
        out(f"Kendall's tau between the predicted and the measured order: {tau:+.2f}; predicted/measured "
            f"{min(ratios):.2f}-{max(ratios):.2f}; {verdict}.")
    return {"tau": tau, "ratios": (min(ratios), max(ratios)), "best_gap": gap}


def measure_top(config: str, evaluations: list, nproc: int, overrides: dict | None = None,
                steps: int = 3, out=print) -> list[dict]:
    """Real steps of each of the planner's best layouts (`evaluations`, in its order) on `nproc`
    local ranks, in one group of processes; printed re-ranked by the measured step time, the
    prediction beside it. Returns one row per layout, fastest measured first."""
    rows, took = measure_evaluations(config, evaluations, nproc, overrides, steps)
    out(f"\nmeasured: the {len(rows)} best predicted layouts, {steps} timed step(s) each (median; the slowest "
        f"rank) on {nproc} local rank(s), {took:.0f} s in all; fastest measured first:")
    print_ranking(rows, out)
    return sorted(rows, key=lambda r: r["measured_s"])


def _fmt(key: str, v: float) -> str:
    return f"{v * 1e3:.0f} ms" if key == "step_time_s" else f"{v / 2**20:.1f} MiB" if v < GiB else f"{v / GiB:.2f} GiB"


def activation_bytes(trainer, batches) -> int | None:
    """Bytes one micro-batch's forward keeps for backward on this rank (measured from live
    tensors); None under pipelining, where a micro-batch's forward spans the schedule."""
    from scaletrain.memory import saved_activation_bytes

    if trainer.pm.micro_schedule is not None:
        return None
    inputs, targets = (x.to(trainer.rt.device) for x in next(batches))  # this rank's share, cut by the loader

    def forward():
        with trainer.precision.autocast():
            logits = trainer.model(inputs)
        return trainer.token_loss(logits, targets) * trainer.loss_factor()

    with trainer.pm.dp.micro_step(last=True), trainer.pm.loss_context():
        held = saved_activation_bytes(trainer.pm.dp.module, forward)
    trainer.pm.dp.finish_gradients()
    trainer.pm.dp.zero_grad(trainer.optimizer)
    if trainer.pm.master:
        trainer.pm.master.grads_to_master()
        trainer.optimizer.zero_grad(set_to_none=True)
    return held
