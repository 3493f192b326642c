"""Bytes each rank sends between workers: DDP every step, local SGD and DiLoCo every H steps.

N workers of one rank each (`parallel.dp_replicate = N`): DDP (`parallel.sync.mode = step`) all-reduces
the gradients every step; local SGD and DiLoCo send each rank's pseudo-gradient once every H
steps, as fp32, bf16 or int8 with a scale per chunk. Bytes sent are *counted*: each rank reads
the kernel's count of bytes it wrote (`wchar` in /proc/self/io, socket sends included) before
and after every step, over a whole number of sync periods from the first step (a delayed sync
is waited for at the end). Per row: the mean bytes per step, its ratio to DDP's and the ratio
the theory gives (1/H fp32, 1/2H bf16, 1/4H int8), and the largest step (the peak volume of
one sync, DDP's or a fragment's) against the whole model's sync (÷ F with F fragments).

    python benchmarks/local_sgd.py [--nproc 2] [--config configs/tiny.toml] [--section.key=value ...]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

from data_parallel import _wchar  # the kernel's count of bytes this process wrote (benchmarks/)

# (name, overrides, measured steps): the same model and batch in every row
ROWS = [
    ("DDP", {"parallel.sync.mode": "step"}, 10),
    ("local_sgd H10", {"parallel.sync.mode": "local_sgd", "parallel.sync.every": 10}, 50),
    ("local_sgd H50", {"parallel.sync.mode": "local_sgd", "parallel.sync.every": 50}, 50),
    *[(f"diloco H{h} {dt}", {"parallel.sync.mode": "diloco", "parallel.sync.every": h, "parallel.sync.dtype": dt}, 50)
      for h in (10, 50) for dt in ("fp32", "bf16", "int8")],
    ("diloco H50 F2", {"parallel.sync.mode": "diloco", "parallel.sync.every": 50, "parallel.sync.fragments": 2}, 50),
    ("diloco H50 F4", {"parallel.sync.mode": "diloco", "parallel.sync.every": 50, "parallel.sync.fragments": 4}, 50),
    ("diloco H50 F4 d5", {"parallel.sync.mode": "diloco", "parallel.sync.every": 50, "parallel.sync.fragments": 4,
                          "parallel.sync.delay": 5}, 50),
    ("diloco H50 F4 d5 int8", {"parallel.sync.mode": "diloco", "parallel.sync.every": 50, "parallel.sync.fragments": 4,
                               "parallel.sync.delay": 5, "parallel.sync.dtype": "int8"}, 50),
]
BYTES = {"fp32": 4, "bf16": 2, "int8": 1}


def _config(args, extra: list[str], overrides: dict, run_dir: str):
    from scaletrain.config import load_config
    from scaletrain.launch.ranks import flags, quiet

    base = [*extra, f"--parallel.dp_replicate={args.nproc}", *flags(quiet(run_dir))]
    return load_config(args.config, base + flags(overrides))


def rank_main(spec_path: str, out_path: str) -> int:
    """One rank: every row in turn; rank 0 writes the figures (the `local_sgd:rank_main` task of
    scaletrain.launch.worker; the spec holds this script's command line)."""
    import torch.distributed as dist

    from scaletrain.launch.ranks import read_spec, write_result
    from scaletrain.parallel.local_sgd import LocalSGD
    from scaletrain.runtime import init_worker
    from scaletrain.train.trainer import Trainer

    args, extra = _parser().parse_known_args(read_spec(spec_path)["argv"])
    out = []
    for name, overrides, steps in ROWS:
        cfg = _config(args, extra, overrides, tempfile.mkdtemp(prefix="lsgd-bench-"))
        rt = init_worker(cfg)
        trainer = Trainer(cfg, rt, stream=open(os.devnull, "w"))
        batches = trainer.batches()
        local_sgd = trainer.hooks.find(LocalSGD)  # None for the DDP row
        per_step = []
        dist.barrier()
        for _ in range(steps):
            before = _wchar()
            trainer.train_step(batches)
            if local_sgd is not None and _ == steps - 1:
                for sync in local_sgd.outer.in_flight:  # a delayed sync started in the window
                    sync.result()
            per_step.append(_wchar() - before)
        every = [None] * rt.world_size
        dist.all_gather_object(every, per_step)
        out.append({"name": name, "overrides": overrides, "per_step": every, "num_params": trainer.pm.num_params})
        del trainer, batches
    if rt.rank == 0:
        write_result(out_path, out)
    return 0


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/tiny.toml")
    ap.add_argument("--nproc", type=int, default=2, help="workers (one rank each)")
    return ap


def main(argv=None) -> None:
    args, extra = _parser().parse_known_args(argv)
    from scaletrain.launch.ranks import run_on_ranks

    forwarded = [f"--config={args.config}", f"--nproc={args.nproc}", *extra]
    rows = run_on_ranks("local_sgd:rank_main", {"argv": forwarded}, args.nproc,
                        pythonpath=(str(Path(__file__).resolve().parent),))
    n, psi = args.nproc, rows[0]["num_params"]
    ddp = statistics.mean(statistics.mean(r) for r in rows[0]["per_step"])
    whole = 2 * (n - 1) / n * psi * 4  # one all-reduce of every fp32 value (a ring's volume)
    print(f"config {args.config}: {psi / 1e6:.2f}M params, {n} workers of 1 rank (gloo), bytes written per rank "
          f"(kernel wchar); theory for one fp32 all-reduce of the model 2Ψ(N-1)/N x 4 B = {whole / 2**20:.2f} MiB")
    print(f"{'row':<24}{'steps':>6}{'sent/rank/step':>16}{'vs DDP':>9}{'theory':>9}{'ratio':>7}"
          f"{'largest step':>14}{'vs model':>10}")
    for row in rows:
        o = row["overrides"]
        sent = statistics.mean(statistics.mean(r) for r in row["per_step"])
        peak = max(max(r) for r in row["per_step"])
        if o["parallel.sync.mode"] == "step":
            theory, expect_peak = 1.0, 1.0
        else:
            theory = BYTES[o.get("parallel.sync.dtype", "fp32")] / 4 / o["parallel.sync.every"]
            expect_peak = BYTES[o.get("parallel.sync.dtype", "fp32")] / 4 / o.get("parallel.sync.fragments", 1)
        steps = len(row["per_step"][0])
        print(f"{row['name']:<24}{steps:>6}{sent / 2**10:>13.1f}KiB{sent / ddp:>9.4f}{theory:>9.4f}"
              f"{sent / ddp / theory:>7.3f}{peak / 2**20:>11.2f}MiB{peak / whole:>6.3f} (÷{1 / expect_peak:g})")


if __name__ == "__main__":
    main()
