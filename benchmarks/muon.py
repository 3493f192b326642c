"""Muon against AdamW on each layout: the step time, and the bytes Muon's whole-matrix exchange sends.

For one process and for each layout on N ranks (gloo on CPU, NCCL on GPUs) the config trains under
optim.name=adamw and optim.name=muon, in interleaved rounds (a few steps of one, then of the other,
alternating which goes first), so machine noise hits both alike. Printed per layout:

* the median step time of each and their ratio (Muon's overhead: Newton-Schulz, and the exchange);
* the bytes the exchange sends per rank per step, two ways: counted where it hands them to the
  all-to-all (optim/whole.py: to other ranks only), and the kernel's count of bytes the rank wrote
  (`wchar` in /proc/self/io, socket sends included) under Muon minus under AdamW, on CPU;
* theory: each hidden matrix of M values whose matrix axes have n ranks (one axis, or ZeRO's and tp's
  together: n = dp_shard x tp) moves M(n-1)/n there and the same back, in optim.muon.ns_dtype (2 bytes
  in bf16), so 2M(n-1)/n over the n ranks: per rank 2(n-1)/n^2 of the exchanged values, summed over
  the matrices.

The layouts: ZeRO-1, 2 and 3 and tp over every rank; with --nproc 4 or more (even), ZeRO-1 and ZeRO-3
over half the ranks times tp 2 too. --layouts picks some of them by name.

    python benchmarks/muon.py [--nproc 2] [--steps 3] [--rounds 4] [--layouts "zero 3" ...]
        [--config configs/tiny.toml] [--KEY=VALUE ...]

On a GPU machine: `--train.device=cuda --nproc 8` (NCCL); the wchar column is then blank.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

LAYOUTS = {"zero 1": ["--parallel.zero=1"], "zero 2": ["--parallel.zero=2"], "zero 3": ["--parallel.zero=3"],
           "tp": ["--parallel.tp=-1"],  # tp = every rank (-1 is filled in with nproc below)
           # two matrix axes (-2: half the ranks), on 4 or more
           "zero 1 x tp 2": ["--parallel.zero=1", "--parallel.dp_shard=-2", "--parallel.tp=2"],
           "zero 3 x tp 2": ["--parallel.zero=3", "--parallel.dp_shard=-2", "--parallel.tp=2"]}


def layouts(args) -> dict[str, list[str]]:
    """The layouts this run measures (--layouts, of those its --nproc can run), their flags filled in."""
    chosen = {name: flags_ for name, flags_ in LAYOUTS.items() if not args.layouts or name in args.layouts}
    if args.nproc < 4 or args.nproc % 2:
        chosen = {name: flags_ for name, flags_ in chosen.items() if "x tp" not in name}
    return {name: [f.replace("=-1", f"={args.nproc}").replace("=-2", f"={args.nproc // 2}") for f in flags_]
            for name, flags_ in chosen.items()}


def _wchar() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("wchar:"):
            return int(line.split()[1])
    return 0


def _trainer(args, extra: list[str], optimizer: str, distributed: bool):
    from scaletrain.config import load_config
    from scaletrain.launch.ranks import flags, quiet
    from scaletrain.runtime import init_worker
    from scaletrain.train.trainer import Trainer

    run_dir = tempfile.mkdtemp(prefix=f"muon-bench-{optimizer}-")
    cfg = load_config(args.config, [*extra, f"--optim.name={optimizer}", *flags(quiet(run_dir))])
    return Trainer(cfg, init_worker(cfg) if distributed else None, stream=open(os.devnull, "w"))


def _steps(trainer, batches, n: int, sync) -> tuple[list[float], int]:
    times, sent0 = [], _wchar()
    for _ in range(n):
        sync()
        t0 = time.perf_counter()
        trainer.train_step(batches)
        sync()
        times.append(time.perf_counter() - t0)
    return times, _wchar() - sent0


def compare(args, extra: list[str], sync=None) -> dict:
    """Both optimizers on this config, interleaved; the figures of this rank (`sync`: a barrier, on ranks)."""
    trainers = {name: _trainer(args, extra, name, sync is not None) for name in ("adamw", "muon")}
    sync = sync or (lambda: None)
    batches = {name: t.batches() for name, t in trainers.items()}
    for name, t in trainers.items():  # warm-up
        _steps(t, batches[name], 2, sync)
    times = {name: [] for name in trainers}
    wrote = {name: 0 for name in trainers}
    whole = trainers["muon"].optimizer.whole
    counted0 = whole.sent_bytes
    for r in range(args.rounds):
        for name in (("adamw", "muon") if r % 2 == 0 else ("muon", "adamw")):
            t, w = _steps(trainers[name], batches[name], args.steps, sync)
            times[name] += t
            wrote[name] += w
    steps = args.rounds * args.steps
    return {"adamw_s": statistics.median(times["adamw"]), "muon_s": statistics.median(times["muon"]),
            "counted": (whole.sent_bytes - counted0) / steps, "wchar": (wrote["muon"] - wrote["adamw"]) / steps,
            "theory": theory_bytes(trainers["muon"].optimizer), "device": trainers["muon"].rt.device.type}


def theory_bytes(optimizer) -> float:
    """Per rank per step: 2(n-1)/n^2 of each exchanged matrix's whole values (n: the ranks of its matrix axes,
    one or two), in the exchange's dtype."""
    import math

    from scaletrain.optim.whole import _matrix_axes

    size = optimizer.whole.dtype.itemsize
    total = 0.0
    for p in optimizer.param_groups[0]["params"]:
        if axes := _matrix_axes(p):
            n = math.prod(p.device_mesh.size(a) for a in axes)
            total += 2 * (n - 1) / n ** 2 * p.numel() * size
    return total


def rank_main(spec_path: str, out_path: str) -> int:
    """One rank: every layout in turn; rank 0 writes the figures (the `muon:rank_main` task)."""
    import torch.distributed as dist

    from scaletrain.launch.ranks import read_spec, write_result

    args, extra = _parser().parse_known_args(read_spec(spec_path)["argv"])
    rows = {}
    for name, flags_ in layouts(args).items():
        row = compare(args, [*extra, *flags_], sync=dist.barrier)
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, row)
        rows[name] = every
    if dist.get_rank() == 0:
        write_result(out_path, rows)
    return 0


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/tiny.toml")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3, help="steps of each optimizer per round")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--layouts", nargs="+", default=None, choices=list(LAYOUTS), help="default: every one --nproc runs")
    return ap


def main(argv=None) -> None:
    args, extra = _parser().parse_known_args(argv)
    from scaletrain.launch.ranks import run_on_ranks

    single = compare(args, extra)
    forwarded = [f"--config={args.config}", f"--steps={args.steps}", f"--rounds={args.rounds}",
                 f"--nproc={args.nproc}", *(["--layouts", *args.layouts] if args.layouts else []), *extra]
    rows = {}  # (--nproc 1: one process only, as on a machine with one GPU)
    if args.nproc > 1:
        rows = run_on_ranks("muon:rank_main", {"argv": forwarded}, args.nproc,
                            pythonpath=(str(Path(__file__).parent),))
    print(f"config {args.config} {' '.join(extra)}: {args.rounds} rounds x {args.steps} steps of each optimizer, "
          f"N = {args.nproc} ranks ({single['device']}); bytes per rank per step, mean over ranks")
    print(f"{'layout':<12}{'adamw step':>12}{'muon step':>12}{'ratio':>7}{'counted':>12}{'wchar diff':>12}"
          f"{'theory':>12}{'counted/theory':>16}")

    def line(name, ranks):
        a, m = max(r["adamw_s"] for r in ranks), max(r["muon_s"] for r in ranks)
        counted, theory = (statistics.mean(r[k] for r in ranks) for k in ("counted", "theory"))
        wchar = f"{statistics.mean(r['wchar'] for r in ranks) / 1e3:>10.1f}kB" if single["device"] == "cpu" else ""
        ratio = f"{counted / theory:>16.4f}" if theory else f"{'-':>16}"
        print(f"{name:<12}{a * 1e3:>10.1f}ms{m * 1e3:>10.1f}ms{m / a:>7.2f}{counted / 1e3:>10.1f}kB{wchar:>12}"
              f"{theory / 1e3:>10.1f}kB{ratio}")

    line("1 process", [single])
    for name, ranks in rows.items():
        line(name, ranks)


if __name__ == "__main__":
    main()
