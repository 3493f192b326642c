"""Tensor and pipeline parallelism side by side: step time and per-rank memory.

Runs the config on one process, then each layout on its own group of ranks (gloo on CPU,
NCCL on GPUs), in one invocation:

    tp 2, tp 2 + sequence parallel, tp 4;  pp 2 with gpipe, 1f1b, interleaved-1f1b (v=2) and
    zero-bubble (v=2);  pp 4 with 1f1b;  tp 2 × pp 2

Per rank it reports the model states (parameters + gradients + AdamW state, measured from the
live tensors) and the step's peak memory above the resting state (the CUDA allocator's peak, or
on CPU the peak of the allocations the profiler records during one step: activations,
gradients, communication buffers), the largest over ranks.

    python benchmarks/model_parallel.py [--steps 6] [--config configs/tiny.toml] [--section.key=value ...]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

# (name, ranks, overrides)
LAYOUTS = [
    ("tp 2", 2, {"parallel.tp": 2}),
    ("tp 2 + sp", 2, {"parallel.tp": 2, "parallel.sp": True}),
    ("pp 2 gpipe", 2, {"parallel.pp": 2, "parallel.pp_schedule": "gpipe"}),
    ("pp 2 1f1b", 2, {"parallel.pp": 2, "parallel.pp_schedule": "1f1b"}),
    ("pp 2 interleaved", 2, {"parallel.pp": 2, "parallel.pp_schedule": "interleaved-1f1b",
                             "parallel.pp_virtual_stages": 2}),
    ("pp 2 zero-bubble", 2, {"parallel.pp": 2, "parallel.pp_schedule": "zero-bubble",
                             "parallel.pp_virtual_stages": 2}),
    ("tp 4", 4, {"parallel.tp": 4}),
    ("pp 4 1f1b", 4, {"parallel.pp": 4, "parallel.pp_schedule": "1f1b"}),
    ("tp 2 x pp 2", 4, {"parallel.tp": 2, "parallel.pp": 2}),
]
# the whole batch goes through the pipeline as 8 micro-batches; untied embeddings (pipelining)
COMMON = {"model.tie_embeddings": False, "model.n_layers": 8, "train.grad_accum": 8}


def _config(args, extra, overrides: dict, run_dir: str):
    from scaletrain.config import load_config
    from scaletrain.launch.ranks import flags, quiet

    return load_config(args.config, [*extra, *flags({**COMMON, **overrides, **quiet(run_dir)})])


def _measure(trainer, steps: int, sync=None) -> dict:
    from scaletrain.memory import peak_allocated_bytes

    batches = trainer.batches()
    trainer.train_step(batches)  # warm-up (and the model-state measurement)
    peak = peak_allocated_bytes(lambda: trainer.train_step(batches), trainer.rt.device)
    if sync:
        sync()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        trainer.train_step(batches)
        if sync:
            sync()
        times.append(time.perf_counter() - t0)
    return {"step_s": statistics.median(times), "states": sum(trainer.meter.state_bytes.values()), "peak": peak}


def rank_main(spec_path: str, out_path: str) -> int:
    """One rank of a layout (the `model_parallel:rank_main` task of scaletrain.launch.worker; the spec
    holds this script's command line)."""
    import torch.distributed as dist

    from scaletrain.launch.ranks import read_spec, write_result
    from scaletrain.runtime import init_worker
    from scaletrain.train.trainer import Trainer

    args, extra = _parser().parse_known_args(read_spec(spec_path)["argv"])
    name, _, overrides = LAYOUTS[args.layout]
    cfg = _config(args, extra, overrides, tempfile.mkdtemp(prefix="mp-"))
    rt = init_worker(cfg)
    row = _measure(Trainer(cfg, rt, stream=open(os.devnull, "w")), args.steps, sync=dist.barrier)
    rows = [None] * rt.world_size
    dist.all_gather_object(rows, row)
    if rt.rank == 0:
        write_result(out_path, {"name": name, "ranks": rows})
    return 0


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/tiny.toml")
    ap.add_argument("--steps", type=int, default=6, help="timed steps per layout")
    ap.add_argument("--layout", type=int, help=argparse.SUPPRESS)
    return ap


def main(argv=None) -> None:
    args, extra = _parser().parse_known_args(argv)

    from scaletrain.launch.ranks import run_on_ranks
    from scaletrain.train.trainer import Trainer

    cfg = _config(args, extra, {}, tempfile.mkdtemp(prefix="mp-single-"))
    trainer = Trainer(cfg, stream=open(os.devnull, "w"))
    single = _measure(trainer, args.steps)
    b = trainer.layout
    common = ", ".join(f"{k}={v}" for k, v in COMMON.items())
    print(f"config {args.config} with {common}: {trainer.pm.num_params / 1e6:.2f}M "
          f"params, global batch {b.global_batch} x {cfg.data.seq_len} in {b.grad_accum} micro-batches, fp32, "
          f"{args.steps} timed steps, {trainer.rt.device.type}")
    print(f"{'layout':<18}{'ranks':>6}{'step (median)':>15}{'vs 1 proc':>11}{'states/rank':>14}{'peak/rank':>12}")
    print(f"{'1 process':<18}{1:>6}{single['step_s'] * 1e3:>13.0f}ms{1.0:>11.2f}"
          f"{single['states'] / 2**20:>11.1f}MiB{single['peak'] / 2**20:>9.1f}MiB")
    for i, (name, ranks, _) in enumerate(LAYOUTS):
        forwarded = [f"--config={args.config}", f"--steps={args.steps}", f"--layout={i}", *extra]
        rows = run_on_ranks("model_parallel:rank_main", {"argv": forwarded}, ranks,
                            pythonpath=(str(Path(__file__).resolve().parent),))["ranks"]
        step = max(r["step_s"] for r in rows)
        print(f"{name:<18}{ranks:>6}{step * 1e3:>13.0f}ms{step / single['step_s']:>11.2f}"
              f"{max(r['states'] for r in rows) / 2**20:>11.1f}MiB{max(r['peak'] for r in rows) / 2**20:>9.1f}MiB",
              flush=True)


if __name__ == "__main__":
    main()
