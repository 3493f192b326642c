"""Context parallelism: memory per rank as the sequence is split over cp ranks.

For each cp size (1, then 2 and 4 on their own groups of ranks) and each method (ring,
allgather, ulysses), one micro-batch of one long sequence: the activations its forward keeps
for backward (measured from live tensors, `scaletrain.memory.saved_activation_bytes`), the
peak of a whole steady training step (on CPU every tensor storage counted by
`scaletrain.measure.LiveMemory`; on CUDA the allocator's peak) and the step time; the largest
over ranks. Beside the peak, the planner's total for the same layout (`scaletrain.measure.planned`,
on CPU: no runtime workspaces) and its ratio to the measured peak.

    python benchmarks/context_parallel.py [--seq-len 4096] [--cp 1,2,4] [--config configs/tiny.toml] \\
        [--section.key=value ...]
"""

from __future__ import annotations

import argparse
import importlib.util
import tempfile
from pathlib import Path

from scaletrain.config import load_config
from scaletrain.launch.ranks import quiet
from scaletrain.measure import measure_layouts, planned
from scaletrain.vocab import CP_METHODS

MiB = 2**20

# benchmarks/planner.py's CPU: this machine as hardware the planner knows
_spec = importlib.util.spec_from_file_location("planner_bench", Path(__file__).with_name("planner.py"))
planner_bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(planner_bench)


def overrides_for(seq_len: int, cp: int, method: str, extra: dict) -> dict:
    return {"data.seq_len": seq_len, "model.max_seq_len": seq_len, "train.micro_batch": 1, "train.global_batch": 1,
            "train.grad_accum": 1, "parallel.cp": cp, "parallel.cp_method": method,
            **quiet(tempfile.mkdtemp(prefix="cp-bench-")), **extra}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/tiny.toml")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--cp", default="1,2,4", help="cp sizes, comma-separated (each on its own group of ranks)")
    ap.add_argument("--methods", default=",".join(CP_METHODS))
    args, rest = ap.parse_known_args(argv)
    extra = dict(r.removeprefix("--").split("=", 1) for r in rest)
    methods = args.methods.split(",")
    print(f"{args.config}, one sequence of {args.seq_len} tokens per step, {' '.join(rest) or 'no overrides'}; "
          "largest over ranks")
    print(f"{'layout':<18}{'activations':>14}{'x of cp 1':>11}{'step peak':>12}{'x of cp 1':>11}{'step time':>11}"
          f"{'planner':>12}{'/ peak':>8}")
    base = None
    for cp in (int(c) for c in args.cp.split(",")):
        names = ["(one process)"] if cp == 1 else [f"cp {cp} {m}" for m in methods]
        jobs = [overrides_for(args.seq_len, cp, "ring" if cp == 1 else m, extra)
                for m in (["ring"] if cp == 1 else methods)]
        for name, job, rows in zip(names, jobs, measure_layouts(jobs, cp, steps=1, config=args.config)):
            act = max(r["activations"] for r in rows)
            peak = max(r["peak"] for r in rows)
            step = max(r["step_time_s"] for r in rows)
            total = planned(load_config(args.config, job), cp, planner_bench.CPU).memory.total
            base = base or (act, peak)
            print(f"{name:<18}{act / MiB:>11.1f}MiB{act / base[0]:>11.2f}{peak / MiB:>9.1f}MiB"
                  f"{peak / base[1]:>11.2f}{step:>10.2f}s{total / MiB:>9.1f}MiB{total / peak:>8.2f}", flush=True)


if __name__ == "__main__":
    main()
