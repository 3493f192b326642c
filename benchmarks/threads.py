"""Intra-op threads on a shared machine: torch's default against scaletrain's choice, quiet and loaded.

Each cell is `scaletrain train` on the demo config (dense) and on its mixture-of-experts variant
(8 experts of 512, 2 per token, batch 16), a fresh process of --steps steps; steps/s is the
median of the per-step rates after the first two steps (the start-up is left out). The machine
is measured quiet (nothing started by this script) and loaded (one busy loop per core this
process may use, like other work on a shared machine, running until the load average shows
it); the variants run interleaved, their order rotated each round, so outside work hits them
alike.

Variants (--variants, comma-separated):

    default     torch's own settings: OMP_NUM_THREADS = the cores, libgomp's default wait
                (GOMP_SPINCOUNT=300000 is its documented default; set, scaletrain leaves it)
    chosen      nothing set: what scaletrain chooses (scaletrain.threads)
    N           OMP_NUM_THREADS=N
    N/passive   OMP_NUM_THREADS=N OMP_WAIT_POLICY=PASSIVE

    python benchmarks/threads.py [--steps 12] [--rounds 2] [--variants default,chosen]
                                 [--models dense,moe] [--loads quiet,loaded]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODELS = {"dense": (["--train.global_batch=32"], 32),
          "moe": (["--model.moe_experts=8", "--model.moe_top_k=2", "--model.moe_hidden=512",
                   "--train.global_batch=16"], 16)}
THREAD_VARS = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME", "MKL_NUM_THREADS")
STEP = re.compile(r"^step (\d+)/\d+ .*?  ([\d.]+)(k?) tok/s", re.M)


def cores() -> int:
    return len(os.sched_getaffinity(0))


def variant_env(name: str) -> dict[str, str]:
    if name == "chosen":
        return {}
    if name == "default":
        return {"OMP_NUM_THREADS": str(cores()), "GOMP_SPINCOUNT": "300000"}
    threads, _, policy = name.partition("/")
    env = {"OMP_NUM_THREADS": str(int(threads))}
    if policy:
        env["OMP_WAIT_POLICY"] = policy.upper()
    return env


def steps_per_s(model: str, variant: str, steps: int) -> tuple[float, str]:
    """(steps/s of one fresh `scaletrain train`, the threads line it logged, if any)."""
    extra, batch = MODELS[model]
    env = {k: v for k, v in os.environ.items() if k not in THREAD_VARS}
    env.update(variant_env(variant))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "src"), env.get("PYTHONPATH")]))
    with tempfile.TemporaryDirectory(prefix="threads-bench-") as run_dir:
        r = subprocess.run([sys.executable, "-m", "scaletrain", "train", "--config", str(REPO / "configs/tiny.toml"),
                            *extra, f"--train.steps={steps}", "--optim.warmup_steps=2", "--train.eval_every=0",
                            "--train.sample_tokens=0", "--log.every=1", f"--log.run_dir={run_dir}/run"],
                           env=env, cwd=REPO, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"{model} {variant}: exit {r.returncode}\n{r.stderr[-2000:]}")
    rates = [float(m[2]) * (1000 if m[3] else 1) for m in STEP.finditer(r.stderr) if int(m[1]) > 2]
    threads = next((line for line in r.stderr.splitlines() if line.startswith("threads:")), "")
    return statistics.median(rates) / (batch * 128), threads


@contextlib.contextmanager
def load(kind: str):
    """`loaded`: one busy loop per core, for the block's duration, started before it until the
    1-minute load average shows them (at most 2 min): work that was there before the job."""
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(cores())] \
        if kind == "loaded" else []
    try:
        deadline = time.monotonic() + 120
        while loops and os.getloadavg()[0] < len(loops) - 0.5 and time.monotonic() < deadline:
            time.sleep(1)
        yield
    finally:
        for p in loops:
            p.kill()
            p.wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--variants", default="default,chosen")
    p.add_argument("--models", default="dense,moe")
    p.add_argument("--loads", default="quiet,loaded")
    args = p.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the busy loops end with this script
    variants, models, loads = args.variants.split(","), args.models.split(","), args.loads.split(",")
    print(f"{cores()} core(s); load average at start {os.getloadavg()[0]:.2f}; {args.steps} steps a run, "
          f"{args.rounds} round(s), variants interleaved", flush=True)
    rates: dict[tuple[str, str, str], list[float]] = {}
    lines: dict[tuple[str, str], str] = {}
    for r in range(args.rounds):
        for kind in loads:
            with load(kind):
                for model in models:
                    for i in range(len(variants)):
                        variant = variants[(i + r) % len(variants)]
                        rate, line = steps_per_s(model, variant, args.steps)
                        rates.setdefault((kind, model, variant), []).append(rate)
                        lines.setdefault((kind, variant), line)
                        print(f"  round {r + 1} {kind:6} {model:5} {variant:10} {rate:6.2f} steps/s  "
                              f"(load {os.getloadavg()[0]:.1f})", flush=True)
    print(f"\nsteps/s, median of {args.rounds} run(s):")
    print(f"{'':14}" + "".join(f"{v:>12}" for v in variants))
    for kind in loads:
        for model in models:
            print(f"{kind + ' ' + model:14}" + "".join(f"{statistics.median(rates[kind, model, v]):12.2f}"
                                                       for v in variants))
    for (kind, variant), line in lines.items():
        if line and variant == "chosen":
            print(f"{kind}, chosen: {line}")


if __name__ == "__main__":
    main()
