"""The planner's own figures: how fast it searches, and how close it comes to real runs.

1. Search speed: layouts enumerated and evaluated per second for a few clusters.
2. Accuracy: real scaletrain steps on this machine's CPU in many layouts. Per rank (largest over
   ranks): the planner's total — what decides "fits" — beside the peak of live tensor storages
   during a whole training step (`scaletrain.measure.LiveMemory`), and each memory
   component's prediction beside the bytes measured from live tensors (activations are one
   micro-batch's; pipelines report model states only).

    python benchmarks/planner.py [--skip-accuracy]
"""

from __future__ import annotations

import argparse
import tempfile
import time

from scaletrain.hardware import Hardware
from scaletrain.launch.ranks import QUIET
from scaletrain.plan import plan

BASE = {"model.n_layers": 4, "model.tie_embeddings": False, "model.dim": 128, "data.seq_len": 64,
        "model.max_seq_len": 64, "train.global_batch": 8, "train.micro_batch": 4, "train.steps": 3,
        "model.n_heads": 4, "train.device": "cpu", **QUIET}  # each layout adds a log.run_dir of its own
LAYOUTS = [  # (name, ranks, overrides)
    ("fp32 adamw", 1, {}),
    ("ac selective", 1, {"memory.activation_checkpointing": "selective"}),
    ("ac full", 1, {"memory.activation_checkpointing": "full"}),
    ("bf16-mixed", 1, {"precision.mode": "bf16-mixed"}),
    ("bf16-true", 1, {"precision.mode": "bf16-true"}),
    ("sgd", 1, {"optim.name": "sgd"}),
    ("zero 0", 2, {"parallel.zero": 0}),
    ("zero 1", 2, {"parallel.zero": 1}),
    ("zero 2", 2, {"parallel.zero": 2}),
    ("zero 2 accum", 2, {"parallel.zero": 2, "train.micro_batch": 2}),  # 2 micro-steps: still sharded gradients
    ("zero 3", 2, {"parallel.zero": 3}),
    ("zero 3 bf16 selective", 2, {"parallel.zero": 3, "precision.mode": "bf16-mixed",
                                  "memory.activation_checkpointing": "selective"}),
    ("tp 2", 2, {"parallel.tp": 2}),
    ("tp 2 + sp, sgd", 2, {"parallel.tp": 2, "parallel.sp": True, "optim.name": "sgd"}),
    ("pp 2", 2, {"parallel.pp": 2}),
    ("zero 2 bf16-true", 2, {"parallel.zero": 2, "precision.mode": "bf16-true"}),
]
CPU = Hardware("CPU", 24, {"fp32": 0.2, "tf32": 0.2, "bf16": 0.2, "fp16": 0.2}, 20, 5, 1)


def search_speed() -> None:
    print("search speed")
    for model, hw, nodes, seq, gb in (("llama-8b", "H100-SXM", 1, 8192, 64), ("llama-8b", "A100-40GB", 2, 8192, 64),
                                      ("llama-70b", "H100-SXM", 8, 8192, 512), ("llama-8b", "H100-SXM", 8, 8192, 512)):
        t0 = time.perf_counter()
        r = plan(model, hardware=hw, nodes=nodes, gpus_per_node=8, seq_len=seq, global_batch=gb, top_k=1)
        s = r["stats"]
        print(f"  {model} on {nodes}x8 {hw}: {s['layouts']:,} layouts ({s['fit']:,} fit) searched in "
              f"{s['seconds']:.2f} s ({s['layouts'] / s['seconds']:,.0f}/s); "
              f"whole call {time.perf_counter() - t0:.2f} s")


def accuracy() -> list[dict]:
    """Each layout's measured rows beside the planner's figures; prints the table."""
    from scaletrain.config import load_config
    from scaletrain.launch.ranks import quiet
    from scaletrain.measure import measure_layouts, planned, predicted_components

    jobs = [(name, ranks, {**BASE, **extra, **quiet(tempfile.mkdtemp(prefix="plan-acc-"))})
            for name, ranks, extra in LAYOUTS]
    measured = {}
    for ranks in sorted({r for _, r, _ in jobs}):  # one group of processes per rank count
        mine = [j for j in jobs if j[1] == ranks]
        for (name, _, _), rows in zip(mine, measure_layouts([o for _, _, o in mine], ranks)):
            measured[name] = rows
    print("\naccuracy, per rank (largest over ranks): the planner's total (what decides fits, its 5% reserve\n"
          "included) against the peak of live tensor storages during a real step; then model states\n"
          "and one micro-batch's saved activations, predicted/measured (pipelines: model states only)")
    print(f"{'layout':<24}{'ranks':>6}{'total':>11}{'peak':>11}{'ratio':>7}  "
          f"{'params':>7}{'grads':>7}{'optim':>7}{'acts':>7}")
    table = []
    for name, ranks, overrides in jobs:
        rows = measured[name]
        ev = planned(load_config(None, overrides), ranks, CPU)
        p = predicted_components(ev, None, None, ev.layout)
        peak = max(r["peak"] for r in rows)
        ratios = []
        for key in ("params", "grads", "optimizer", "activations"):
            got = [r[key] for r in rows if r.get(key) is not None]
            ratios.append(f"{p[key] / max(got):.2f}" if got else "n/a")
        table.append({"layout": name, "ranks": ranks, "total": ev.memory.total, "peak": peak})
        print(f"{name:<24}{ranks:>6}{ev.memory.total / 2**20:>7.2f} MiB{peak / 2**20:>7.2f} MiB"
              f"{ev.memory.total / peak:>7.3f}  " + "".join(f"{c:>7}" for c in ratios), flush=True)
    worst = max(table, key=lambda r: abs(r["total"] / r["peak"] - 1))
    print(f"largest gap: {worst['layout']}, total/peak {worst['total'] / worst['peak']:.3f}")
    return table


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--skip-accuracy", action="store_true")
    args = ap.parse_args()
    search_speed()
    if not args.skip_accuracy:
        accuracy()
