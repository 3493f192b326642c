"""The planner's own figures: how fast it searches, and how close it comes to real runs.

1. Search speed: layouts enumerated and evaluated per second for a few clusters.
2. Accuracy: real scaletrain steps on this machine's CPU in many layouts, the planner's per-rank
   prediction of each memory component beside the bytes measured from live tensors (largest
   over ranks; activations are one micro-batch's; pipelines report model states only).

    python benchmarks/planner.py [--skip-accuracy]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from scaletrain.plan import plan
from scaletrain.plan.hardware import Hardware

BASE = {"model.n_layers": 4, "model.tie_embeddings": False, "model.dim": 128, "data.seq_len": 64,
        "model.max_seq_len": 64, "train.global_batch": 8, "train.micro_batch": 4, "train.steps": 3,
        "model.n_heads": 4, "log.tensorboard": False, "log.progress": "off", "checkpoint.save_final": False,
        "train.sample_tokens": 0, "train.device": "cpu"}
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
              f"{s['seconds']:.2f} s ({s['layouts'] / s['seconds']:,.0f}/s); whole call {time.perf_counter() - t0:.2f} s")


def accuracy() -> None:
    from scaletrain.config import load_config
    from scaletrain.layout import Layout
    from scaletrain.plan.measure import measure, predicted_components
    from scaletrain.train.trainer import Trainer

    print("\naccuracy: predicted / measured per rank (model states, and one micro-batch's activations)")
    print(f"{'layout':<24}{'params':>22}{'grads':>22}{'optimizer':>22}{'activations':>22}")
    for name, ranks, extra in LAYOUTS:
        overrides = {**BASE, **extra, "log.run_dir": tempfile.mkdtemp(prefix="plan-acc-")}
        cfg = load_config(None, overrides)
        if ranks == 1:
            rows = [measure(Trainer(cfg, stream=open(os.devnull, "w")), steps=1)]
        else:
            rows = _measure_group(overrides, ranks)
        par = cfg.parallel
        batch = Layout.from_config(cfg, ranks)
        lay = {"zero": par.zero, "tp": par.tp, "pp": par.pp, "sp": par.sp, "micro_batch": batch.micro_batch,
               "ac": cfg.memory.activation_checkpointing}
        r = plan(cfg.model, hardware=CPU, nodes=1, gpus_per_node=ranks, seq_len=cfg.data.seq_len,
                 global_batch=batch.global_batch, precision=cfg.precision.mode, optimizer=cfg.optim.name, layout=lay,
                 gpu=False)
        p = predicted_components(r["layouts"][0], r["cfg"], r["workload"], r["layouts"][0].layout)
        cells = []
        for key in ("params", "grads", "optimizer", "activations"):
            got = [row[key] for row in rows if row.get(key) is not None]
            cells.append(f"{p[key] / 2**20:.2f}/{max(got) / 2**20:.2f} MiB ({p[key] / max(got):.2f})" if got else "n/a")
        print(f"{name:<24}" + "".join(f"{c:>22}" for c in cells), flush=True)


def _measure_group(overrides: dict, ranks: int) -> list[dict]:
    from scaletrain.parallel.launch import launch

    out = Path(tempfile.mkdtemp(prefix="plan-acc-out-")) / "rows.json"
    code = launch([json.dumps(overrides), out.as_posix()], nproc=ranks, program=(str(Path(__file__).resolve()),))
    if code:
        sys.exit(code)
    return json.loads(out.read_text())


def _worker(overrides: str, out: str) -> None:
    import torch.distributed as dist

    from scaletrain.config import load_config
    from scaletrain.parallel.launch import exit_worker, init_worker
    from scaletrain.plan.measure import measure
    from scaletrain.train.trainer import Trainer

    cfg = load_config(None, json.loads(overrides))
    rt = init_worker(cfg)
    rows = [None] * rt.world_size
    dist.all_gather_object(rows, measure(Trainer(cfg, rt, stream=open(os.devnull, "w")), steps=1))
    if rt.rank == 0:
        Path(out).write_text(json.dumps(rows))
    exit_worker(0)


if __name__ == "__main__":
    if "RANK" in os.environ:
        _worker(sys.argv[1], sys.argv[2])
    else:
        ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
        ap.add_argument("--skip-accuracy", action="store_true")
        args = ap.parse_args()
        search_speed()
        if not args.skip_accuracy:
            accuracy()
