"""Quality of a tiny mixture of experts on the demo data, against the dense demo model, and of
the expert bias against no balancing at all.

Every row trains the demo config (configs/tiny.toml: 4 blocks x 256 wide, byte-level, on
CPython's documentation; its learning rate and warm-up) on the same tokens (same seed, same
batches, same schedule), shortened for a 2-core CPU; only the feed-forward layers differ:

* dense: the demo model, a GELU MLP of 1,024 per block;
* the MoE rows: 8 experts of 512, each token routed to 2 of them: the same active matmul
  parameters per token as the dense MLP (2 x 512 = 1,024; plus an 8-wide router), 4x its total;
* softmax scores (the default until issue 47 point 15; benchmarks/moe_first_steps.py compares the
  sigmoid scores of today's defaults), routing balanced by the expert bias (DeepSeek-V3's rate 1e-3
  and a faster 1e-2),
  by the Switch auxiliary loss (0.01, no bias), or not at all (moe_bias_rate=0).

Per row: total and active parameters, the final training and validation loss, and the load
imbalance of the worst MoE layer (max / mean tokens per expert; 1 = even, top_k = 2 of 8 experts
caps it at 8 / 2 = 4, every token on the same 2 experts: a collapsed router) at the first logged
step, its mean over the logged steps, its largest, and its mean over the last quarter; then
each layer's mean over the last quarter (layers 0, 1, ...). A row
whose run diverged (scaletrain's divergence check stops it) shows its last logged step and why.

`--per-step` then prints the worst layer's imbalance at every logged step, the rows side by side
(with `--every 1`, every step: the first steps, where a router collapses, compared row by row).

    nice python benchmarks/moe_quality.py [--steps 100] [--batch 16] [--rows dense,none,bias] [--every 5]
        [--per-step] [--section.key=value ...]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
import time

# softmax scores: the default until issue 47 point 15, with which the figures in docs/benchmarks.md were taken
MOE = {"model.moe_experts": 8, "model.moe_top_k": 2, "model.moe_hidden": 512, "model.moe_score": "softmax"}
ROWS = {
    "dense": ("dense (demo model)", {}),
    "none": ("MoE, no balancing", {**MOE, "model.moe_bias_rate": 0.0}),
    "bias": ("MoE, expert bias 1e-3", {**MOE, "model.moe_bias_rate": 1e-3}),
    "bias2": ("MoE, expert bias 1e-2", {**MOE, "model.moe_bias_rate": 1e-2}),
    "aux": ("MoE, Switch aux loss 0.01", {**MOE, "model.moe_bias_rate": 0.0, "model.moe_aux_loss": 0.01}),
}


def train_row(args, extra: list[str], overrides: dict) -> dict:
    from scaletrain.config import load_config
    from scaletrain.errors import TrainingStopped
    from scaletrain.launch.ranks import flags, quiet
    from scaletrain.model.flops import matmul_params
    from scaletrain.train.trainer import Trainer

    run_dir = tempfile.mkdtemp(prefix="moe-quality-")
    base = {"train.steps": args.steps, "train.global_batch": args.batch, "train.eval_every": args.steps,
            "log.every": args.every, "train.sample_tokens": 0}
    cfg = load_config(args.config, [*extra, *flags(quiet(run_dir)), *flags({**base, **overrides})])
    t0 = time.perf_counter()
    stopped = None
    with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull):  # the log and the summary
        trainer = Trainer(cfg, stream=devnull)
        try:
            trainer.fit()
        except TrainingStopped as e:  # a diverged run is a result too: its rows so far, and why it stopped
            stopped = str(e)
    return {"params": trainer.pm.num_params, "active": matmul_params(cfg.model), "rows": trainer.metrics.history,
            "seconds": time.perf_counter() - t0, "stopped": stopped}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/tiny.toml")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batch", type=int, default=16, help="train.global_batch (the demo's is 32)")
    ap.add_argument("--rows", default="dense,none,bias", help=f"of {', '.join(ROWS)}")
    ap.add_argument("--every", type=int, default=5, help="log.every: the steps between metrics rows")
    ap.add_argument("--per-step", action="store_true", help="then the imbalance at each logged step, side by side")
    args, extra = ap.parse_known_args(argv)
    names = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = [n for n in names if n not in ROWS]
    if unknown:
        raise SystemExit(f"unknown row(s) {', '.join(unknown)}; known: {', '.join(ROWS)}")
    print(f"config {args.config}, {args.steps} steps of {args.batch} x seq_len, same tokens in every row "
          f"({' '.join(extra) or 'no overrides'})")
    head = (f"{'row':<28}{'params':>8}{'active':>8}{'train loss':>11}{'val loss':>9}"
            f"{'imbalance: first':>17}{'mean':>6}{'max':>6}{'last 1/4':>9}{'time':>7}  each layer, last 1/4")
    print(head)
    per_step = {}
    for name in names:
        label, overrides = ROWS[name]
        r = train_row(args, extra, overrides)
        rows = r["rows"]
        per_step[name] = {row["step"]: row["moe_imbalance"] for row in rows if "moe_imbalance" in row}
        last = rows[-1]
        imb = [row["moe_imbalance"] for row in rows if "moe_imbalance" in row]
        tail = imb[-max(len(imb) // 4, 1):]
        layers = sorted({k for row in rows for k in row if k.startswith("moe_imbalance/")})
        per_layer = " ".join(f"{statistics.mean(row[k] for row in rows[-len(tail):]):.2f}" for k in layers)
        figures = (f"{imb[0]:>17.2f}{statistics.mean(imb):>6.2f}{max(imb):>6.2f}{statistics.mean(tail):>9.2f}"
                   if imb else f"{'-':>17}{'-':>6}{'-':>6}{'-':>9}")
        print(f"{label:<28}{r['params'] / 1e6:>7.2f}M{r['active'] / 1e6:>7.2f}M{last['loss']:>11.4f}"
              f"{last.get('val_loss', float('nan')):>9.4f}{figures}{r['seconds']:>6.0f}s  {per_layer}", flush=True)
        if r["stopped"]:
            print(f"  {label} stopped at step {last['step']} (the last logged row above): {r['stopped']}", flush=True)
    if args.per_step:
        print_per_step({n: v for n, v in per_step.items() if v})


def print_per_step(per_step: dict[str, dict[int, float]]) -> None:
    """The worst layer's imbalance at each logged step, one column per row (4.00: collapsed)."""
    print(f"\nimbalance per step (worst layer; {', '.join(f'{n}: {ROWS[n][0]}' for n in per_step)})")
    print(f"{'step':>5}" + "".join(f"{n:>8}" for n in per_step))
    for step in sorted({s for v in per_step.values() for s in v}):
        print(f"{step:>5}" + "".join(f"{v[step]:>8.2f}" if step in v else f"{'-':>8}" for v in per_step.values()))


if __name__ == "__main__":
    main()
