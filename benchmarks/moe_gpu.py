"""MFU of a mixture of experts on one GPU, with learned routing, bf16-mixed and torch.compile.

Published MoE throughput is usually measured with the router forced to an even load; here the
router learns (the expert bias balances it, DeepSeek-V3's way), so the figure includes what an
uneven load costs. Rows, all GPT-2 small's shape (configs/gpt2-124m.toml: 12 blocks x 768,
sequence 1,024, bf16-mixed, compiled) on the same tokens, with the same active matmul
parameters per token:

* dense: GPT-2 small's MLP of 3,072;
* 8 experts of 1,536, top 2 (Mixtral's shape of routing);
* 64 experts of 384, top 8 (fine-grained, OLMoE / DeepSeek-style).

Each row trains `--steps` steps of one micro-batch (`--micro` x 1,024 tokens) through
scaletrain's Trainer and reports the median over the steps after `--skip` (compilation,
autotuning) of MFU -- model FLOPs of the *active* parameters (6 N_active + attention) against the
GPU's bf16 peak --, tokens/s, and the worst layer's load imbalance (max / mean tokens per expert).

    python benchmarks/moe_gpu.py [--steps 40] [--skip 15] [--micro 12] [--rows dense,moe8] [--section.key=value ...]

Not run yet: no GPU was available in the session that wrote it (see docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile

ROWS = {
    "dense": ("dense MLP 3072", {}),
    "moe8": ("8 experts x 1536, top 2", {"model.moe_experts": 8, "model.moe_top_k": 2, "model.moe_hidden": 1536}),
    "moe64": ("64 experts x 384, top 8", {"model.moe_experts": 64, "model.moe_top_k": 8, "model.moe_hidden": 384}),
}


def run_row(args, extra: list[str], overrides: dict) -> tuple[object, list[dict]]:
    from scaletrain.config import load_config
    from scaletrain.launch.ranks import flags, quiet
    from scaletrain.train.trainer import Trainer

    base = {"train.steps": args.steps, "train.global_batch": args.micro, "train.micro_batch": args.micro,
            "data.path": "", "data.num_workers": 0, "train.compile": True, "precision.mode": "bf16-mixed",
            "train.device": "cuda", "optim.warmup_steps": 5}
    cfg = load_config(args.config, [*flags(base), *flags(overrides), *extra,
                                    *flags(quiet(tempfile.mkdtemp(prefix="moe-gpu-")))])
    with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull):
        trainer = Trainer(cfg, stream=devnull)
        trainer.fit()
    return trainer, trainer.metrics.history


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/gpt2-124m.toml")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--skip", type=int, default=15, help="first steps left out (compilation, autotuning)")
    ap.add_argument("--micro", type=int, default=12, help="sequences per step (one micro-batch)")
    ap.add_argument("--rows", default="dense,moe8,moe64", help=f"of {', '.join(ROWS)}")
    args, extra = ap.parse_known_args(argv)
    if args.skip >= args.steps:
        raise SystemExit(f"--skip {args.skip} leaves no step of --steps {args.steps} to measure")
    import torch

    from scaletrain.model.flops import matmul_params

    print(f"torch {torch.__version__}, "
          f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA device'}; config {args.config}, "
          f"{args.micro} sequences per step (bf16-mixed and compiled unless overridden: {' '.join(extra) or 'none'}), "
          f"median of steps {args.skip + 1}-{args.steps}")
    print(f"{'row':<26}{'params':>9}{'active':>9}{'MFU':>7}{'tokens/s':>11}{'step':>9}{'imbalance':>10}{'loss':>8}")
    for name in [r.strip() for r in args.rows.split(",") if r.strip()]:
        label, overrides = ROWS[name]
        trainer, rows = run_row(args, extra, overrides)
        steady = [r for r in rows if r["step"] > args.skip]
        imb = [r["moe_imbalance"] for r in steady if "moe_imbalance" in r]
        mfu = [r["mfu"] for r in steady if r.get("mfu") is not None]  # (n/a where a step beat the peak)
        print(f"{label:<26}{trainer.pm.num_params / 1e6:>8.1f}M{matmul_params(trainer.cfg.model) / 1e6:>8.1f}M"
              + (f"{100 * statistics.median(mfu):>6.1f}%" if mfu else f"{'n/a':>7}") +
              f"{statistics.median(r['tokens_per_s'] for r in steady):>11,.0f}"
              f"{1e3 * statistics.median(r['step_time_s'] for r in steady):>7.1f}ms"
              f"{statistics.median(imb) if imb else float('nan'):>10.2f}{rows[-1]['loss']:>8.3f}", flush=True)
        del trainer
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
