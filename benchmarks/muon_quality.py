"""Muon against AdamW at equal tokens: the loss curves, each optimizer at its best learning rate.

Every run is the same config (the demo's, configs/tiny.toml, unless --config says otherwise) on the same
tokens: same seed, data order, batch, steps, warm-up and cosine schedule; only optim.name and optim.lr
change. How the learning rate is tuned: each optimizer runs at every --lrs value and is judged by its
validation loss at the end (the demo's held-out text); its best is its row in the table. Muon runs with
optim.muon.adjust_lr=match_rms_adamw (its default), so optim.lr means the same update size for both and
one grid serves both. Printed: each run's final validation loss; the best of each; the tokens each best
run needed to reach AdamW's best final training loss (the training loss smoothed over 10 steps). With
--plot FILE the best runs' training curves go into one PNG. With --runs FILE each finished run is appended
there and a run already in it is not run again: invocations with different --lrs can share the work (in
parallel), and a last one with every --lrs prints the whole table.

    python benchmarks/muon_quality.py [--lrs 1e-3 3e-3 1e-2] [--steps 250] [--plot docs/muon-quality.png]
        [--runs FILE] [--config configs/tiny.toml] [--section.key=value ...]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path


def run(config: str, extra: list[str], optimizer: str, lr: float, steps: int) -> dict:
    from scaletrain.config import load_config
    from scaletrain.launch.ranks import flags, quiet
    from scaletrain.train.trainer import Trainer

    # quiet, but validated at the end (train.eval_every=steps)
    quiet_flags = flags({**quiet(tempfile.mkdtemp(prefix=f"muon-quality-{optimizer}-")), "train.eval_every": steps})
    cfg = load_config(config, [*extra, f"--optim.name={optimizer}", f"--optim.lr={lr}", f"--train.steps={steps}",
                               *quiet_flags])
    trainer = Trainer(cfg, stream=open(os.devnull, "w"))
    history = trainer.fit()["history"]
    return {"optimizer": optimizer, "lr": lr, "val_loss": history[-1]["val_loss"],
            "losses": [r["loss"] for r in history], "tokens_per_step": trainer.step_tokens(0)}


def smoothed(losses: list[float], window: int = 10) -> list[float]:
    return [sum(losses[max(0, i - window + 1):i + 1]) / (i + 1 - max(0, i - window + 1)) for i in range(len(losses))]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/tiny.toml")
    ap.add_argument("--lrs", type=float, nargs="+", default=[1e-3, 3e-3, 1e-2])
    ap.add_argument("--steps", type=int, default=250)
    ap.add_argument("--plot", default="")
    ap.add_argument("--runs", default="", help="JSON lines of finished runs: appended to, and not run again")
    args, extra = ap.parse_known_args(argv)
    saved = Path(args.runs) if args.runs else None
    done = [json.loads(line) for line in saved.read_text().splitlines()] if saved and saved.exists() else []
    runs = []
    print(f"{'optimizer':<10}{'lr':>9}{'final val loss':>16}{'final train loss (10-step mean)':>33}")
    for optimizer in ("adamw", "muon"):
        for lr in args.lrs:
            key = {"optimizer": optimizer, "lr": lr, "steps": args.steps, "extra": extra}
            r = next((d for d in done if all(d.get(k) == v for k, v in key.items())), None)
            if r is None:
                r = {**key, **run(args.config, extra, optimizer, lr, args.steps)}
                if saved:
                    with saved.open("a") as f:
                        f.write(json.dumps(r) + "\n")
            runs.append(r)
            print(f"{optimizer:<10}{lr:>9.0e}{r['val_loss']:>16.4f}{smoothed(r['losses'])[-1]:>33.4f}", flush=True)
    best = {o: min((r for r in runs if r["optimizer"] == o), key=lambda r: r["val_loss"]) for o in ("adamw", "muon")}
    target = smoothed(best["adamw"]["losses"])[-1]
    print(f"\nbest: AdamW lr {best['adamw']['lr']:.0e} (val {best['adamw']['val_loss']:.4f}), "
          f"Muon lr {best['muon']['lr']:.0e} (val {best['muon']['val_loss']:.4f})")
    for o, r in best.items():
        curve = smoothed(r["losses"])
        step = next((i + 1 for i, x in enumerate(curve) if x <= target), None)
        reach = f"after {step * r['tokens_per_step']:,} tokens (step {step})" if step else "not in the run"
        print(f"{o}: AdamW's final training loss {target:.4f} reached {reach}")
    if args.plot:
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
