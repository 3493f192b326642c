"""Does preference training learn? DPO, SimPO and ORPO side by side on a task whose answer we know.

The task (scaletrain.bench.preference_task): each prompt states a kind of characters ("digits: ", "vowels: ",
"capitals: "); the chosen completion follows it, the rejected one breaks it, everywhere ("plain") or at one
position of eight ("subtle": the pair differs in one token). The demo-sized model (model.preset=tiny, 3.3M
parameters, byte-level) starts from random weights, so the rule is learnt from the pairs alone. Every row
trains the same pairs in the same order (same seed, batch, schedule); only the loss differs, each at TRL's
defaults (beta 0.1; SimPO's gamma 0.5; ORPO's lambda = beta 0.1 plus its NLL of the chosen). Per row: the
held-out preference accuracy (the share of held-out pairs whose chosen earns the higher reward: beta times the
log-ratio to the reference for DPO, beta times the mean token log-prob for SimPO and ORPO) at each
evaluation, the step it first reaches 90%, the final held-out loss and margin, and the wall time.

At step 0 the policy is the reference: every DPO reward is 0, a tie, counted as not preferred (0%);
SimPO's and ORPO's rewards already differ at random (about 50%).

    nice python benchmarks/preference.py [--steps 60] [--batch 16] [--every 10] [--tasks plain,subtle]
        [--losses sigmoid,simpo,orpo] [--section.key=value ...]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
import time

LABELS = {"sigmoid": "DPO", "simpo": "SimPO", "orpo": "ORPO", "ipo": "IPO", "hinge": "hinge", "robust": "robust DPO"}


def prepare_task(folder: str, subtle: bool, pairs: int) -> str:
    from scaletrain.bench.preference_task import write_rule_pairs
    from scaletrain.data.prepare import prepare

    os.makedirs(folder, exist_ok=True)
    rows = write_rule_pairs(os.path.join(folder, "rows.jsonl"), pairs, seed=11, subtle=subtle)
    prepare([rows], os.path.join(folder, "data"), preference="pairs", val_fraction=0.1)
    return os.path.join(folder, "data")


def train_row(args, data: str, loss: str, run_dir: str, extra: list[str]) -> dict:
    from scaletrain.config import load_config
    from scaletrain.train.trainer import Trainer

    overrides = {"model.preset": "tiny", "data.path": data, "data.seq_len": 32, "train.objective": "preference",
                 "preference.loss": loss, "train.steps": args.steps, "train.global_batch": args.batch,
                 "train.eval_every": args.every, "train.eval_batches": 0, "train.sample_tokens": 0,
                 "optim.lr": args.lr, "optim.warmup_steps": max(1, args.steps // 10), "log.every": args.every,
                 "log.progress": "off", "log.summary": False, "log.tensorboard": False,
                 "checkpoint.save_final": False, "log.run_dir": run_dir, "train.device": "cpu"}
    cfg = load_config(None, [*(f"--{k}={v}" for k, v in overrides.items()), *extra])
    t0 = time.perf_counter()
    with open(os.devnull, "w") as null, contextlib.redirect_stderr(null), contextlib.redirect_stdout(null):
        trainer = Trainer(cfg)
        first = trainer.evaluate()  # step 0: the policy is the reference
        history = trainer.fit()["history"]
    seconds = time.perf_counter() - t0
    evaluated = [(0, first)] + [(r["step"], r) for r in history if "val_loss" in r]
    curve = [(step, r["val_rewards/accuracies"]) for step, r in evaluated]
    reached = next((step for step, acc in curve if acc >= 0.9), None)
    last = evaluated[-1][1]
    return {"curve": curve, "reached": reached, "val_loss": last["val_loss"],
            "margin": last["val_rewards/margins"], "seconds": seconds}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch", type=int, default=16, help="pairs per step")
    p.add_argument("--every", type=int, default=10, help="evaluate the held-out pairs every this many steps")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--pairs", type=int, default=1200, help="pairs generated per task (10% held out)")
    p.add_argument("--tasks", default="plain,subtle")
    p.add_argument("--losses", default="sigmoid,simpo,orpo")
    args, extra = p.parse_known_args()
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for task in args.tasks.split(","):
            data = prepare_task(os.path.join(tmp, task), task == "subtle", args.pairs)
            for loss in args.losses.split(","):
                r = train_row(args, data, loss, os.path.join(tmp, task, loss), extra)
                rows.append((task, loss, r))
                print(f"{task} {LABELS.get(loss, loss)}: " + ", ".join(f"{s}: {100 * a:.0f}%" for s, a in r["curve"]),
                      flush=True)
    steps = [s for s, _ in rows[0][2]["curve"]]
    print()
    print("| task | loss | " + " | ".join(f"acc. step {s}" for s in steps) +
          " | first step >= 90% | held-out loss | held-out margin | wall time |")
    print("|---|---|" + "---|" * len(steps) + "---|---|---|---|")
    for task, loss, r in rows:
        accs = " | ".join(f"{100 * a:.1f}%" for _, a in r["curve"])
        reached = "-" if r["reached"] is None else str(r["reached"])
        print(f"| {task} | {LABELS.get(loss, loss)} | {accs} | {reached} | {r['val_loss']:.4f} | "
              f"{r['margin']:.3f} | {r['seconds']:.0f} s |")


if __name__ == "__main__":
    main()
