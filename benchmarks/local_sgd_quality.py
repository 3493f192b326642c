"""What syncing every H steps costs in quality: validation loss of DDP, local SGD and DiLoCo.

The demo model (configs/tiny.toml) on N workers of one rank each (`parallel.dp_replicate = N`),
every run on the same tokens (the same global batch, steps, seed, data order and inner
optimizer): DDP (gradients every step), local SGD (weights averaged every H steps) and DiLoCo
(outer Nesterov SGD, lr 0.7, momentum 0.9) at each H, with fp32 and int8 pseudo-gradients,
whole or streamed (F fragments, each all-reduced in the background for τ steps), their workers'
inner learning rate scaled by each --inner-lr-scale (parallel.sync.inner_lr_scale; 0 = the
square-root rule for a worker's quarter of the batch: half DDP's lr). The
validation loss is measured at the end on the demo's held-out text (every worker on its share
of the validation windows with its own weights: after a sync of every fragment they are the same).
As in the DiLoCo paper (whose workers start from a model pretrained synchronously for 24k of
88k steps), every row starts from the same weights: `--pretrain-steps` P steps of DDP, exported
once (P = 0: every row from the random initialisation). All runs go through one group of processes;
each row is printed as it finishes and appended to OUT/rows.jsonl (`--out-dir OUT`), and a second
invocation with the same --out-dir runs only the rows not there yet.

    python benchmarks/local_sgd_quality.py [--nproc 4] [--pretrain-steps 100] [--steps 200]
        [--sync-every 10 50 100] [--inner-lr-scale 0 1] [--only NAME ...] [--out-dir DIR]
        [--section.key=value ...]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def rows(sync_every: list[int], fragments: int, delay: int, workers: int = 4, lr_scales: tuple[float, ...] = (0.0,),
         only: list[str] | None = None) -> list[tuple[str, dict]]:
    """The rows, DDP first: local SGD and DiLoCo at each H and inner lr scale (parallel.sync.inner_lr_scale;
    0 = the square-root rule, 1/sqrt(workers)), named with the factor unless it is 1; `only`: those
    names (and DDP)."""
    out = [("DDP", {"parallel.sync.mode": "step"})]
    for scale in lr_scales:
        factor = scale or workers ** -0.5
        lr = {"parallel.sync.inner_lr_scale": scale}
        tag = "" if factor == 1 else f" lr x{factor:.3g}"
        for h in sync_every:
            out.append((f"local_sgd H{h}{tag}", {"parallel.sync.mode": "local_sgd", "parallel.sync.every": h, **lr}))
        streamed = {"parallel.sync.fragments": fragments, "parallel.sync.delay": delay}
        for h in sync_every:
            for dtype in ("fp32", "int8"):
                for name, extra in (("", {}), (f" F{fragments} d{delay}", streamed)):
                    out.append((f"diloco H{h} {dtype}{name}{tag}", {
                        "parallel.sync.mode": "diloco", "parallel.sync.every": h, "parallel.sync.dtype": dtype,
                        **extra, **lr}))
    return [r for r in out if not only or r[0] == "DDP" or r[0] in only]


def rank_main(spec_path: str, out_path: str) -> int:
    """One rank: every row in turn (the `local_sgd_quality:rank_main` task of scaletrain.launch.worker;
    the spec holds this script's command line). The rows go to --out as they finish, not to
    `out_path`: a later invocation continues from them."""
    import torch.distributed as dist

    from scaletrain.config import load_config
    from scaletrain.launch.ranks import flags, quiet, read_spec
    from scaletrain.runtime import init_worker
    from scaletrain.train.trainer import Trainer

    args, extra = _parser().parse_known_args(read_spec(spec_path)["argv"])
    out = Path(args.out)
    done = {json.loads(line)["name"] for line in out.read_text().splitlines()} if out.exists() else set()
    start = out.parent / "pretrained.safetensors"
    todo = rows(args.sync_every, args.fragments, args.delay, args.nproc, args.inner_lr_scale, args.only)
    if args.pretrain_steps:
        if not start.exists():
            todo.insert(0, ("pretrain", {"parallel.sync.mode": "step", "checkpoint.save_final": "true"}))
        # the rows read other windows than the pretraining did (the data order follows the seed)
        extra = [*extra, f"--model.init_from={start}", "--train.seed=4321"]
    for name, overrides in todo:
        if name in done:
            continue
        pretrain = name == "pretrain"
        steps = args.pretrain_steps if pretrain else args.steps
        run_dir = Path(args.out).parent / name.replace(" ", "_")
        # quiet, but evaluated at the end and resumable: a checkpoint every 50 steps, the newest kept
        ours = {**quiet(run_dir), "parallel.dp_replicate": args.nproc, "train.steps": steps,
                "train.eval_every": steps, "checkpoint.every": 50, "checkpoint.resume": "auto",
                "checkpoint.keep": 1, **overrides}
        cfg = load_config(args.config, [*(e for e in extra
                                          if not (pretrain and e.startswith(("--model.init_from", "--train.seed")))),
                                        *flags(ours)])
        rt = init_worker(cfg)
        # a run cut short by an earlier invocation continues from its last checkpoint (bitwise), or
        # begins again if it had none
        if rt.rank == 0 and run_dir.exists() and not list((run_dir / "checkpoints").glob("step_*")):
            shutil.rmtree(run_dir)
        dist.barrier()
        t0 = time.perf_counter()
        result = Trainer(cfg, rt, stream=open(os.devnull, "w")).fit()
        if result["stopped_by"] is not None:
            raise RuntimeError(f"{name}: stopped by signal {result['stopped_by']} before the end")
        if pretrain:
            if rt.rank == 0:
                # in a process of its own: reading a checkpoint in this one would be a collective
                subprocess.run([sys.executable, "-m", "scaletrain", "export", str(run_dir), "--out", str(start)],
                               check=True, stdout=subprocess.DEVNULL)
            dist.barrier()
        if rt.rank == 0:
            last = result["history"][-1]
            row = {"name": name, "val_loss": last["val_loss"], "loss": last["loss"],
                   "seconds": time.perf_counter() - t0}
            with out.open("a") as f:
                f.write(json.dumps(row) + "\n")
            print(json.dumps(row), file=sys.stderr, flush=True)
        dist.barrier()
    return 0


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/tiny.toml")
    ap.add_argument("--nproc", type=int, default=4, help="workers (one rank each)")
    ap.add_argument("--pretrain-steps", type=int, default=100, help="DDP steps every row starts from (0: none)")
    ap.add_argument("--steps", type=int, default=200, help="steps of each row after the pretraining")
    ap.add_argument("--sync-every", type=int, nargs="+", default=[10, 50, 100])
    ap.add_argument("--fragments", type=int, default=4, help="fragments of the streamed rows")
    ap.add_argument("--delay", type=int, default=2, help="sync_delay of the streamed rows")
    ap.add_argument("--inner-lr-scale", type=float, nargs="+", default=[0.0],
                    help="the workers' parallel.sync.inner_lr_scale, a row of each (0: the square-root rule, "
                         "1/sqrt(workers); 1: DDP's lr)")
    ap.add_argument("--only", nargs="+", help="run only the rows of these names (and DDP)")
    ap.add_argument("--out-dir", help="where the runs and rows.jsonl go (default: a new temporary folder); rows "
                                       "already in its rows.jsonl are not run again")
    ap.add_argument("--out", help=argparse.SUPPRESS)
    return ap


def main(argv=None) -> None:
    args, extra = _parser().parse_known_args(argv)
    from scaletrain.launch.ranks import run_on_ranks

    folder = Path(args.out_dir) if args.out_dir else Path(tempfile.mkdtemp(prefix="lsgd-quality-"))
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / "rows.jsonl"
    forwarded = [f"--config={args.config}", f"--nproc={args.nproc}", f"--steps={args.steps}",
                 f"--pretrain-steps={args.pretrain_steps}", f"--fragments={args.fragments}", f"--delay={args.delay}",
                 f"--out={out}", "--inner-lr-scale", *map(str, args.inner_lr_scale),
                 *(["--only", *args.only] if args.only else []),
                 "--sync-every", *map(str, args.sync_every), *extra]
    run_on_ranks("local_sgd_quality:rank_main", {"argv": forwarded}, args.nproc,
                 pythonpath=(str(Path(__file__).resolve().parent),))
    results = [json.loads(line) for line in out.read_text().splitlines()]
    ddp = next(r["val_loss"] for r in results if r["name"] == "DDP")
    start = (f"from {args.pretrain_steps} steps of DDP, then " if args.pretrain_steps else "")
    print(f"config {args.config}, {args.nproc} workers of 1 rank, {start}{args.steps} steps, "
          "the same tokens in every row")
    print(f"{'run':<34}{'val loss':>10}{'vs DDP':>9}{'train loss':>12}{'time':>8}")
    for r in results:
        print(f"{r['name']:<34}{r['val_loss']:>10.4f}{100 * (r['val_loss'] / ddp - 1):>+8.1f}%{r['loss']:>12.4f}"
              f"{r['seconds']:>7.0f}s")


if __name__ == "__main__":
    main()
