"""Muon against AdamW at equal tokens: the loss curves, each optimizer at its best learning rate.

Every run is the same config (the demo's, configs/tiny.toml, unless --config says otherwise) on the same
tokens: same seed, data order, batch, steps, warm-up and cosine schedule; only optim.name and optim.lr
change. How the learning rate is tuned: each optimizer runs at every value of its grid (--lrs, or
--adamw-lrs and --muon-lrs apart) and is judged by its validation loss at the end (the demo's held-out
text); its best is its row in the table, and a best at an edge of its grid is flagged (widen the grid).
Muon runs with optim.muon.adjust_lr=match_rms_adamw (its default), so optim.lr means the same update size
for both. With --seeds S1 S2 ... each optimizer's best rate is run again at the other seeds (train.seed):
the mean and spread of the final validation loss are printed. Printed: each run's final validation loss;
the best of each; the tokens each best run needed to reach AdamW's best final training loss (the training
loss smoothed over 10 steps, first seed). With --plot FILE the best runs' training curves go into one
PNG. With --runs FILE each finished run is appended there and a run already in it is not run again:
invocations with different grids (--optimizers adamw, --optimizers muon) can share the work (in
parallel), and a last one with the whole grid prints the whole table.

    python benchmarks/muon_quality.py [--lrs 1e-3 3e-3 1e-2] [--adamw-lrs ...] [--muon-lrs ...]
        [--optimizers adamw muon] [--seeds 1234 1] [--steps 250] [--plot docs/muon-quality.png]
        [--runs FILE] [--config configs/tiny.toml] [--section.key=value ...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path


def run(config: str, extra: list[str], optimizer: str, lr: float, steps: int) -> dict:
    from scaletrain.config import load_config
    from scaletrain.errors import TrainingStopped
    from scaletrain.launch.ranks import flags, quiet
    from scaletrain.train.trainer import Trainer

    # quiet, but validated at the end (train.eval_every=steps)
    quiet_flags = flags({**quiet(tempfile.mkdtemp(prefix=f"muon-quality-{optimizer}-")), "train.eval_every": steps})
    cfg = load_config(config, [*extra, f"--optim.name={optimizer}", f"--optim.lr={lr}", f"--train.steps={steps}",
                               *quiet_flags])
    trainer = Trainer(cfg, stream=open(os.devnull, "w"))
    try:
        history = trainer.fit()["history"]
    except TrainingStopped as e:  # a diverged run is a result (the rate is too high), not the end of the grid
        return {"optimizer": optimizer, "lr": lr, "val_loss": float("inf"), "losses": [], "diverged": str(e),
                "tokens_per_step": trainer.step_tokens(0)}
    return {"optimizer": optimizer, "lr": lr, "val_loss": history[-1]["val_loss"],
            "losses": [r["loss"] for r in history], "tokens_per_step": trainer.step_tokens(0)}


def smoothed(losses: list[float], window: int = 10) -> list[float]:
    return [sum(losses[max(0, i - window + 1):i + 1]) / (i + 1 - max(0, i - window + 1)) for i in range(len(losses))]


class Runs:
    """Finished runs, read from and appended to --runs FILE (if given); a run is done once."""

    def __init__(self, args, extra: list[str]):
        self.args, self.extra = args, extra
        self.saved = Path(args.runs) if args.runs else None
        self.done: list[dict] = []

    def get(self, optimizer: str, lr: float, seed: int | None) -> dict:
        extra = [*self.extra, f"--train.seed={seed}"] if seed is not None else self.extra
        key = {"optimizer": optimizer, "lr": lr, "steps": self.args.steps, "extra": extra}
        if self.saved and self.saved.exists():  # (read again each time: another invocation may have run it)
            self.done = [json.loads(line) for line in self.saved.read_text().splitlines()]
        r = next((d for d in self.done if all(d.get(k) == v for k, v in key.items())), None)
        if r is None:
            r = {**key, **run(self.args.config, extra, optimizer, lr, self.args.steps)}
            self.done.append(r)
            if self.saved:
                with self.saved.open("a") as f:
                    f.write(json.dumps(r) + "\n")
        return r


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/tiny.toml")
    ap.add_argument("--lrs", type=float, nargs="+", default=[1e-3, 3e-3, 1e-2])
    ap.add_argument("--adamw-lrs", type=float, nargs="+", default=None, help="AdamW's grid (default: --lrs)")
    ap.add_argument("--muon-lrs", type=float, nargs="+", default=None, help="Muon's grid (default: --lrs)")
    ap.add_argument("--optimizers", nargs="+", default=["adamw", "muon"], choices=["adamw", "muon"])
    ap.add_argument("--seeds", type=int, nargs="+", default=None,
                    help="train.seed of the grid (the first) and of the best rate's reruns (the rest); "
                         "default: the config's seed, no reruns")
    ap.add_argument("--steps", type=int, default=250)
    ap.add_argument("--plot", default="")
    ap.add_argument("--runs", default="", help="JSON lines of finished runs: appended to, and not run again")
    args, extra = ap.parse_known_args(argv)
    runs = Runs(args, extra)
    seeds = args.seeds or [None]
    grids = {"adamw": args.adamw_lrs or args.lrs, "muon": args.muon_lrs or args.lrs}
    print(f"{'optimizer':<10}{'lr':>9}{'final val loss':>16}{'final train loss (10-step mean)':>33}")
    best = {}
    for optimizer in args.optimizers:
        grid = [runs.get(optimizer, lr, seeds[0]) for lr in grids[optimizer]]
        for r in grid:
            last = f"{smoothed(r['losses'])[-1]:>33.4f}" if r["losses"] else f"{'diverged':>33}"
            print(f"{optimizer:<10}{r['lr']:>9.0e}{r['val_loss']:>16.4f}{last}", flush=True)
        best[optimizer] = min(grid, key=lambda r: r["val_loss"])
        for seed in seeds[1:]:  # the best rate again at the other seeds
            runs.get(optimizer, best[optimizer]["lr"], seed)
    if len(best) < 2:
        return
    print()
    for o, r in best.items():
        lrs = sorted(grids[o])
        edge = "  (AT AN EDGE of the grid: widen it)" if r["lr"] in (lrs[0], lrs[-1]) else ""
        vals = [runs.get(o, r["lr"], s)["val_loss"] for s in seeds]
        spread = (f"; seeds {', '.join(str(s) for s in seeds)}: val {statistics.mean(vals):.4f} mean, "
                  f"{min(vals):.4f}-{max(vals):.4f}" if len(seeds) > 1 else "")
        print(f"best {o}: lr {r['lr']:.0e} (val {r['val_loss']:.4f}){spread}{edge}")
    target = smoothed(best["adamw"]["losses"])[-1]
    for o, r in best.items():
        curve = smoothed(r["losses"])
        step = next((i + 1 for i, x in enumerate(curve) if x <= target), None)
        reach = f"after {step * r['tokens_per_step']:,} tokens (step {step})" if step else "not in the run"
        print(f"{o}: AdamW's final training loss {target:.4f} reached {reach}")
    if args.plot:
        plot(args, best)


def plot(args, best: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for o, r in best.items():
        tokens = [(i + 1) * r["tokens_per_step"] for i in range(len(r["losses"]))]
        ax.plot(tokens, smoothed(r["losses"]), label=f"{o} (lr {r['lr']:.0e})")
    ax.set_xlabel("tokens")
    ax.set_ylabel("training loss (10-step mean)")
    ax.set_title(f"{args.config}: Muon vs AdamW at equal tokens")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.plot, dpi=100)
    print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
