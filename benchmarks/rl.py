"""Does RL learn? GRPO, Dr. GRPO and DAPO side by side on a verifiable task, from a model briefly supervised on it.

The task (scaletrain.bench.rl_task, --task): "reverse" ("abc<" -> "cba": random lowercase words of --letters
letters) or "sum" ("a+b=" -> the sum). A byte-level model (model.preset=tiny unless overridden) is first trained
on the task as plain text for --sft-steps steps: it knows the format, not yet the task. From that checkpoint each
algorithm trains --steps RL steps on the same prompts in the same order (same seed, batch, schedule), rewarded 1
for an exact answer (rewards.answer_match), completions ending at a newline; every --every steps the held-out
prompts (another seed's) are answered greedily and scored: the held-out reward. Per row: the held-out reward at
each evaluation, the first step it reaches --target, the wall time split between sampling and training.

    nice python benchmarks/rl.py [--task reverse] [--letters 2,3] [--sft-steps 165] [--steps 100] [--every 10]
        [--batch 64] [--group 8] [--lr 1.5e-4] [--eval-temperature 0] [--algorithms grpo,dr_grpo,dapo]
        [--plot docs/images/rl-curves.png] [--section.key=value ...]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import tempfile
import time

LABELS = {"grpo": "GRPO", "dr_grpo": "Dr. GRPO", "dapo": "DAPO"}
QUIET = {"train.sample_tokens": 0, "log.progress": "off", "log.summary": False, "log.tensorboard": False,
         "train.device": "cpu"}


def _run(overrides: dict, extra: list[str]) -> tuple[object, dict, float]:
    from scaletrain.config import load_config
    from scaletrain.train.trainer import Trainer

    cfg = load_config(None, [*(f"--{k}={v}" for k, v in {**QUIET, **overrides}.items()), *extra])
    t0 = time.perf_counter()
    with open(os.devnull, "w") as null, contextlib.redirect_stderr(null), contextlib.redirect_stdout(null):
        trainer = Trainer(cfg)
        first = trainer.evaluate() if overrides.get("train.objective") == "rl" else None
        result = trainer.fit()
    return first, result, time.perf_counter() - t0


def _shape(args) -> dict:
    """The task's size: the words' lengths (reverse)."""
    low, _, high = args.letters.partition(",")
    return {"letters": (int(low), int(high or low))} if args.task == "reverse" else {}


def supervised(args, folder: str, extra: list[str]) -> str:
    """The warm-up: the task's examples as text, trained --sft-steps steps; returns its export."""
    from scaletrain.bench import rl_task
    from scaletrain.data.prepare import prepare
    from scaletrain.trained.export import export_safetensors

    text = rl_task.sft_text(os.path.join(folder, "sft.txt"), rl_task.examples(args.task, 4000, seed=1, **_shape(args)))
    prepare([text], os.path.join(folder, "data"))
    run = os.path.join(folder, "sft")
    _, result, _ = _run({"model.preset": "tiny", "data.path": os.path.join(folder, "data"), "data.seq_len": 32,
          "train.steps": args.sft_steps, "train.global_batch": 32, "optim.lr": 1e-3, "optim.warmup_steps": 20,
          "checkpoint.save_final": True, "log.run_dir": run}, extra)
    out = os.path.join(folder, "sft.safetensors")
    export_safetensors(result["checkpoint"], out)
    return out


def rl_row(args, folder: str, weights: str, algorithm: str, extra: list[str]) -> dict:
    from scaletrain.bench import rl_task

    prompts = rl_task.write_prompts(os.path.join(folder, "prompts.jsonl"),
                                    rl_task.examples(args.task, 2000, seed=2, **_shape(args)))
    held = rl_task.write_prompts(os.path.join(folder, "held.jsonl"),
                                 rl_task.examples(args.task, args.held, seed=3, **_shape(args)))
    run = os.path.join(folder, algorithm)
    first, result, seconds = _run({
        "model.preset": "tiny", "model.init_from": weights, "data.path": os.path.join(folder, "data"),
        "data.seq_len": 32, "train.objective": "rl", "rl.algorithm": algorithm, "rl.prompts": prompts,
        "rl.eval_prompts": held, "rl.eval_temperature": args.eval_temperature, "rl.rewards": "answer_match",
        "rl.reward_args": json.dumps({"answer_match": {"extractor": rl_task.EXTRACTOR[args.task]}}),
        "rl.stop": "\\n", "rl.max_new_tokens": 8, "rl.group_size": args.group, "rl.temperature": 1.0,
        "train.steps": args.steps, "train.global_batch": args.batch, "train.eval_every": args.every,
        "optim.lr": args.lr, "optim.warmup_steps": 1, "log.every": args.every, "checkpoint.save_final": False,
        "log.run_dir": run}, extra)
    curve = [(0, first["val_reward"])] + [(r["step"], r["val_reward"]) for r in result["history"] if "val_reward" in r]
    rows = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
    sampling = sum(r.get("time/generation_s", 0.0) * args.every for r in rows)
    return {"curve": curve, "reached": next((s for s, v in curve if v >= args.target), None), "seconds": seconds,
            "sampling_s": sampling, "train_reward": rows[-1].get("reward")}


def plot(rows: list[tuple[str, dict]], path: str, task: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for algorithm, r in rows:
        steps, rewards = zip(*r["curve"])
        ax.plot(steps, rewards, marker="o", label=LABELS.get(algorithm, algorithm))
    ax.set_xlabel("RL step")
    ax.set_ylabel("held-out reward")
    ax.set_ylim(0, 1)
    ax.set_title(f"RL on the {task} task after a brief supervised warm-up")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", default="reverse")
    p.add_argument("--sft-steps", type=int, default=165)
    p.add_argument("--letters", default="2,3", help="reverse: the words' shortest and longest lengths")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--batch", type=int, default=64, help="completions per step")
    p.add_argument("--group", type=int, default=8, help="completions per prompt")
    p.add_argument("--held", type=int, default=100, help="held-out prompts")
    p.add_argument("--lr", type=float, default=1.5e-4)
    p.add_argument("--target", type=float, default=0.8)
    p.add_argument("--eval-temperature", type=float, default=0.0, help="0: greedy held-out answers; else sampled")
    p.add_argument("--algorithms", default="grpo,dr_grpo,dapo")
    p.add_argument("--plot", default="")
    args, extra = p.parse_known_args()
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    rows = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        weights = supervised(args, tmp, extra)
        print(f"supervised warm-up: {args.sft_steps} steps, {time.perf_counter() - t0:.0f} s", flush=True)
        for algorithm in args.algorithms.split(","):
            r = rl_row(args, tmp, weights, algorithm, extra)
            rows.append((algorithm, r))
            print(f"{LABELS.get(algorithm, algorithm)}: " + ", ".join(f"{s}: {v:.2f}" for s, v in r["curve"]),
                  flush=True)
    steps = [s for s, _ in rows[0][1]["curve"]]
    print()
    print("| algorithm | " + " | ".join(f"step {s}" for s in steps) +
          f" | first step >= {args.target:g} | wall time | of it sampling |")
    print("|---|" + "---|" * len(steps) + "---|---|---|")
    for algorithm, r in rows:
        rewards = " | ".join(f"{v:.2f}" for _, v in r["curve"])
        reached = "-" if r["reached"] is None else str(r["reached"])
        print(f"| {LABELS.get(algorithm, algorithm)} | {rewards} | {reached} | {r['seconds']:.0f} s | "
              f"{r['sampling_s']:.0f} s |")
    if args.plot:
        plot(rows, args.plot, args.task)
        print(f"\nplot: {args.plot}")


if __name__ == "__main__":
    main()
