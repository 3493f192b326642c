"""ZeRO stages side by side: step time and the bytes each rank really sends per step.

Runs the config on one process, then every `parallel.zero` stage on N ranks (gloo on CPU,
NCCL on GPUs), all in one invocation. Bytes sent are *counted*: each rank reads the kernel's
count of bytes it wrote (`wchar` in /proc/self/io, which includes socket sends) before and
after the timed steps. The theory column is what a bandwidth-optimal ring sends per rank for Ψ
fp32 parameters: 2Ψ(N-1)/N values for zero 0-2 (all-reduce, or reduce-scatter + all-gather),
3Ψ(N-1)/N for zero 3 (parameters are all-gathered for forward and again for backward).
It also prints each rank's model-state bytes (parameters + gradients + AdamW state, measured
from the live tensors during the first step; the largest over ranks) beside the ZeRO paper's
16Ψ, 8Ψ + 8Ψ/N, 4Ψ + 12Ψ/N and 16Ψ/N.

    python benchmarks/data_parallel.py [--nproc 2] [--steps 10] [--config configs/tiny.toml] [--section.key=value ...]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

STAGES = (0, 1, 2, 3)


def _wchar() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("wchar:"):
            return int(line.split()[1])
    raise RuntimeError("no wchar in /proc/self/io")


def _timed_steps(trainer, steps: int, warmup: int = 2, sync=None) -> tuple[list[float], int]:
    batches = trainer.batches()
    for _ in range(warmup):
        trainer.train_step(batches)
    times = []
    if sync:
        sync()
    sent0 = _wchar()
    for _ in range(steps):
        t0 = time.perf_counter()
        trainer.train_step(batches)
        if sync:
            sync()
        times.append(time.perf_counter() - t0)
    return times, (_wchar() - sent0) // steps


def _config(args, extra: list[str], run_dir: str, zero: int | None):
    from scaletrain.config import load_config
    from scaletrain.launch.ranks import flags, quiet

    overrides = [*extra, *flags(quiet(run_dir))]
    if zero is not None:
        overrides.append(f"--parallel.zero={zero}")
    return load_config(args.config, overrides)


def rank_main(spec_path: str, out_path: str) -> int:
    """One rank: every zero stage in turn; rank 0 writes the figures (the `data_parallel:rank_main`
    task of scaletrain.launch.worker; the spec holds this script's command line)."""
    import torch.distributed as dist

    from scaletrain.launch.ranks import read_spec, write_result
    from scaletrain.runtime import init_worker
    from scaletrain.train.trainer import Trainer

    args, extra = _parser().parse_known_args(read_spec(spec_path)["argv"])
    rows = []
    for zero in STAGES:
        cfg = _config(args, extra, tempfile.mkdtemp(prefix=f"dp-z{zero}-"), zero)
        rt = init_worker(cfg)
        trainer = Trainer(cfg, rt, stream=open(os.devnull, "w"))
        times, sent = _timed_steps(trainer, args.steps, sync=dist.barrier)
        every = [None] * rt.world_size
        dist.all_gather_object(every, sent)
        states = [None] * rt.world_size
        dist.all_gather_object(states, sum(trainer.meter.state_bytes.values()))
        rows.append({"zero": zero, "step_s": statistics.median(times), "sent": every, "states": states,
                     "num_params": trainer.pm.num_params})
        del trainer
    if rt.rank == 0:
        write_result(out_path, rows)
    return 0


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/tiny.toml")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10, help="timed steps per layout")
    return ap


def main(argv=None) -> None:
    args, extra = _parser().parse_known_args(argv)

    from scaletrain.launch.ranks import run_on_ranks
    from scaletrain.train.trainer import Trainer

    cfg = _config(args, extra, tempfile.mkdtemp(prefix="dp-single-"), None)
    single = Trainer(cfg, stream=open(os.devnull, "w"))
    times, _ = _timed_steps(single, args.steps)
    single_s = statistics.median(times)

    forwarded = [f"--config={args.config}", f"--steps={args.steps}", f"--nproc={args.nproc}", *extra]
    rows = run_on_ranks("data_parallel:rank_main", {"argv": forwarded}, args.nproc,
                        pythonpath=(str(Path(__file__).resolve().parent),))
    n, psi = args.nproc, rows[0]["num_params"]
    b = single.layout
    print(f"config {args.config}: {psi / 1e6:.2f}M params, global batch {b.global_batch} x {cfg.data.seq_len}, "
          f"fp32, {args.steps} timed steps, N = {n} ranks ({single.rt.device.type})")
    print(f"{'layout':<14}{'step (median)':>15}{'vs 1 proc':>10}{'sent/rank/step':>16}{'theory':>11}{'ratio':>7}"
          f"{'states/rank':>13}{'paper':>10}{'ratio':>7}")
    print(f"{'1 process':<14}{single_s * 1e3:>13.0f}ms{1.0:>10.2f}{'-':>16}{'-':>11}{'-':>7}"
          f"{'-':>13}{'16Ψ':>10}{'-':>7}")
    for row in rows:
        z = row["zero"]
        theory = (3 if z == 3 else 2) * psi * 4 * (n - 1) / n
        sent = statistics.mean(row["sent"])
        paper = {0: 16 * psi, 1: 8 * psi + 8 * psi / n, 2: 4 * psi + 12 * psi / n, 3: 16 * psi / n}[z]
        states = max(row["states"])
        name = {0: "zero 0 (DDP)", 1: "zero 1", 2: "zero 2", 3: "zero 3 (FSDP)"}[z]
        print(f"{name:<14}{row['step_s'] * 1e3:>13.0f}ms{row['step_s'] / single_s:>10.2f}"
              f"{sent / 2**20:>13.2f}MiB{theory / 2**20:>8.2f}MiB{sent / theory:>7.2f}"
              f"{states / 2**20:>10.2f}MiB{paper / 2**20:>7.2f}MiB{states / paper:>7.2f}")


if __name__ == "__main__":
    main()
