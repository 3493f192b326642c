"""Asynchronous checkpoints (checkpoint.async_save): how long a save blocks training, and a kill soak.

blocked   Train a model with a checkpoint every --every steps, once saving synchronously and once in
          the background, and time each save as the training loop sees it (from the call to the
          return: the synchronous save writes, hashes and publishes; the background one copies the
          state into CPU memory, after waiting for the save before it if that is still being written).
          Also printed: the checkpoint's size, the mean step time, and the run's wall time (the last
          background save is waited for at the end, so both runs end with every checkpoint written).

              python benchmarks/checkpoint_async.py blocked [--model demo|gpt2-124m|both]
                     [--saves 4] [--every 2] [--repeats 2] [--device cpu|cuda]

          demo: the built-in demo run (the 3.2M-parameter byte-level GPT, batch 32 x 128).
          gpt2-124m: GPT-2 small's shape on the same byte-level data (85M parameters with a
          vocabulary of 256; batch 2 x 64 to keep a CPU step short).

soak      SIGKILL a run saving in the background, again and again, at random moments while a
          checkpoint is being written (a `.step_N.partial` folder is seen, then a random delay),
          each life resuming with checkpoint.resume=auto. After every kill every complete
          checkpoint (step_*) must verify against its checksums and hold, byte for byte, the tensor
          and generator files of a clean synchronous run's checkpoint of the same step, and resume
          must pick the newest of them. Then one life is stopped by SIGTERM during a background
          write (it must exit 143 with a complete checkpoint of the step it stopped at), and a last
          life trains to the end: its metrics must equal the clean run's at every step, bit for bit.

              python benchmarks/checkpoint_async.py soak [--kills 20] [--seed 0] [--json]

Results: docs/benchmarks.md, "Asynchronous checkpoints".
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODELS = {
    "demo": {},
    "gpt2-124m": {"model.preset": "gpt2-124m", "model.vocab_size": 256, "model.max_seq_len": 64,
                  "data.seq_len": 64, "train.global_batch": 2},
}
QUIET = {"log.progress": "off", "log.tensorboard": False, "log.summary": False, "train.sample_tokens": 0,
         "train.eval_every": 0, "checkpoint.save_final": False, "log.every": 1}


# --------------------------------------------------------------------------------------------
# blocked time per save


def timed_run(overrides: dict, run_dir: Path) -> dict:
    """Train `overrides` (on the demo config); the seconds each save blocked the loop, and more."""
    from scaletrain.config import DEMO_CONFIG, load_config
    from scaletrain.train.trainer import Trainer

    cfg = load_config(DEMO_CONFIG, {**QUIET, **overrides, "log.run_dir": str(run_dir)})
    trainer = Trainer(cfg, stream=io.StringIO())
    blocked: list[float] = []
    real_save = trainer.save

    def timed_save(background: bool = False):
        t0 = time.perf_counter()
        path = real_save(background)
        blocked.append(time.perf_counter() - t0)
        return path

    trainer.save = timed_save
    t0 = time.perf_counter()
    result = trainer.fit()
    wall = time.perf_counter() - t0
    last = Path(result["checkpoint"])
    return {"blocked_s": blocked, "wall_s": wall, "bytes": sum(f.stat().st_size for f in last.iterdir()),
            "step_s": statistics.mean(r["step_time_s"] for r in result["history"] if "step_time_s" in r),
            "params": trainer.pm.num_params}


def blocked_main(args) -> None:
    from scaletrain import threads

    # the intra-op threads `scaletrain train` would run (on a busy machine a copy on two threads whose
    # partner waits for a core took 1 s where one thread took 14 ms): chosen as the command line does
    os.environ.update(threads.wait_env(os.environ))  # before torch is imported
    choice = threads.on_this_node(1)
    threads.use(choice)
    names = list(MODELS) if args.model == "both" else [args.model]
    print(f"blocked time per save, {args.saves} saves every {args.every} steps, device {args.device}, "
          f"{os.cpu_count()} CPU core(s), {choice.threads} intra-op thread(s); sync and async runs alternate, "
          f"{args.repeats} of each")
    print(f"{'model':<10} {'params':>7} {'checkpoint':>10} {'mode':<6} {'blocked per save (s)':<30} "
          f"{'step (s)':>8} {'run (s)':>8}")
    for name in names:
        every: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.repeats):
            for background in (False, True):
                work = Path(tempfile.mkdtemp(prefix="ckpt-async-"))
                try:
                    r = timed_run({**MODELS[name], "train.steps": args.saves * args.every,
                                   "checkpoint.every": args.every, "checkpoint.keep": 2,
                                   "checkpoint.async_save": background, "train.device": args.device}, work / "run")
                finally:
                    shutil.rmtree(work, ignore_errors=True)
                every[background] += r["blocked_s"]
                print(f"{name:<10} {r['params'] / 1e6:6.1f}M {r['bytes'] / 2**20:6.1f} MiB "
                      f"{'async' if background else 'sync':<6} {' '.join(f'{s:.3f}' for s in r['blocked_s']):<30} "
                      f"{r['step_s']:8.3f} {r['wall_s']:8.1f}", flush=True)
        sync, background = (statistics.median(every[m]) for m in (False, True))
        print(f"{name}: median blocked per save: sync {sync:.3f} s, async {background:.3f} s "
              f"({sync / background:.1f}x less)", flush=True)


# --------------------------------------------------------------------------------------------
# the kill soak

SOAK = ["--model.preset=tiny", "--data.seq_len=32", "--model.max_seq_len=32", "--train.global_batch=8",
        "--log.every=1", "--log.progress=off", "--log.tensorboard=false", "--train.sample_tokens=0",
        "--train.eval_every=0", "--checkpoint.every=2", "--checkpoint.save_final=true", "--train.device=cpu"]
TENSOR_FILES = ("__0_0.distcp", "rng_rank0.json")


def start(run_dir: Path, steps: int, *extra: str) -> subprocess.Popen:
    log = (run_dir.parent / "stderr.txt").open("a")  # a file, not a pipe: nobody reads a pipe while we wait
    return subprocess.Popen([sys.executable, "-m", "scaletrain", "train", *SOAK, f"--train.steps={steps}",
                             f"--log.run_dir={run_dir}", *extra], stdout=subprocess.DEVNULL, stderr=log,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


def rows(run_dir: Path) -> list[tuple]:
    f = run_dir / "metrics.jsonl"
    return [(r["step"], r["loss"], r["grad_norm"]) for r in map(json.loads, f.read_text().splitlines())] \
        if f.exists() else []


def writing(folder: Path, since_ns: int) -> set[str]:
    """The `.step_N.partial` folders made since `since_ns` (a killed life's stay until the next save clears them)."""
    found = set()
    for p in folder.glob(".step_*.partial") if folder.is_dir() else ():
        try:
            if p.stat().st_mtime_ns >= since_ns:
                found.add(p.name)
        except FileNotFoundError:  # published or cleared meanwhile
            pass
    return found


def until_writing(folder: Path, proc: subprocess.Popen, saves: int) -> bool:
    """Until the `saves`-th background write of this life is under way (False: the run ended first)."""
    since, seen = time.time_ns(), set()
    while proc.poll() is None:
        seen |= writing(folder, since)  # (a life's saves are of steps ever later: names differ)
        if len(seen) >= saves:
            return True
        time.sleep(0.001)
    return False


def check_folder(folder: Path, ref: Path) -> tuple[int, list[str], str | None]:
    """Every complete checkpoint verifies and holds the clean run's tensors of its step; resume
    takes the newest. Returns (checkpoints checked, problems, the one resume takes)."""
    from scaletrain.train import checkpoint as ckpt

    problems = []
    complete = ckpt.complete_checkpoints(folder)
    for path in complete:
        if (problem := ckpt.verify_checkpoint(path)) is not None:
            problems.append(f"{path.name}: {problem}")
        for name in TENSOR_FILES:
            if (path / name).read_bytes() != (ref / path.name / name).read_bytes():
                problems.append(f"{path.name}/{name} differs from the clean run's")
    picked = ckpt.find_resumable(folder, report=problems.append)
    if complete and picked != complete[-1]:
        problems.append(f"resume would take {picked}, not the newest complete {complete[-1].name}")
    return len(complete), problems, picked.name if picked else None


def soak(kills: int, seed: int, work: Path) -> dict:
    rng = random.Random(seed)
    steps = 4 * kills + 20
    t0 = time.perf_counter()
    ref_run, run = work / "clean" / "run", work / "soak" / "run"
    ref_run.parent.mkdir(parents=True)
    run.parent.mkdir(parents=True)
    if start(ref_run, steps, f"--checkpoint.keep={steps}").wait() != 0:
        sys.exit(f"the clean run failed: {(ref_run.parent / 'stderr.txt').read_text()[-2000:]}")
    folder, ref = run / "checkpoints", ref_run / "checkpoints"
    report = {"kills": 0, "mid_write": 0, "checked": 0, "problems": [], "lives": []}
    extra = ("--checkpoint.async_save=true", "--checkpoint.resume=auto", "--checkpoint.keep=3")
    while report["kills"] < kills:
        proc, since = start(run, steps, *extra), time.time_ns()
        if not until_writing(folder, proc, rng.randint(1, 3)):
            break  # the run ended: every step is done
        time.sleep(rng.uniform(0.0, 0.05))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        partial = bool(writing(folder, since))  # the kill cut a write short
        checked, problems, picked = check_folder(folder, ref)
        report["kills"] += 1
        report["mid_write"] += partial
        report["checked"] += checked
        report["problems"] += [f"kill {report['kills']}: {p}" for p in problems]
        report["lives"].append({"logged": len(rows(run)), "partial_left": partial, "resume_takes": picked})
    # a SIGTERM during a background write: the save of the step it stops at completes before exit
    proc, since = start(run, steps, *extra), time.time_ns()
    if until_writing(folder, proc, 1):
        proc.send_signal(signal.SIGTERM)
    code, last = proc.wait(), rows(run)[-1][0]
    from scaletrain.train import checkpoint as ckpt

    newest = ckpt.latest_checkpoint(folder)
    report["sigterm"] = {"exit": code, "last_logged": last, "newest": newest.name if newest else None,
                         "partial_left": bool(writing(folder, since))}
    report["sigterm_ok"] = code == 128 + signal.SIGTERM and newest is not None and newest.name == f"step_{last:08d}" \
        and not report["sigterm"]["partial_left"]
    if start(run, steps, *extra).wait() != 0:
        report["problems"].append("the last life failed")
    report["final_bitwise"] = rows(run) == rows(ref_run) and len(rows(ref_run)) == steps
    report.update(steps=steps, wall_s=round(time.perf_counter() - t0, 1))
    return report


def soak_main(args) -> None:
    work = Path(tempfile.mkdtemp(prefix="ckpt-soak-"))
    try:
        report = soak(args.kills, args.seed, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    ok = not report["problems"] and report["final_bitwise"] and report["sigterm_ok"] and report["kills"] == args.kills
    if args.json:
        print(json.dumps({**report, "ok": ok}))
    else:
        print(f"kill soak: {report['kills']} SIGKILLs ({report['mid_write']} left a .partial folder: mid-write), "
              f"{report['checked']} complete checkpoints checked after them, {len(report['problems'])} problems")
        for p in report["problems"]:
            print(f"  {p}")
        print(f"  SIGTERM during a background write: {report['sigterm']}")
        print(f"  the resumed run's {report['steps']} steps bitwise equal to the clean run's: "
              f"{report['final_bitwise']}")
        print(f"  {report['wall_s']} s; {'PASS' if ok else 'FAIL'}")
    sys.exit(0 if ok else 1)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    b = sub.add_parser("blocked", help="the time each save blocks training, sync and async")
    b.add_argument("--model", choices=[*MODELS, "both"], default="both")
    b.add_argument("--saves", type=int, default=4)
    b.add_argument("--every", type=int, default=2)
    b.add_argument("--repeats", type=int, default=2, help="runs of each mode, alternating (a shared machine is noisy)")
    b.add_argument("--device", default="cpu")
    s = sub.add_parser("soak", help="SIGKILL background writes at random; nothing incomplete is ever resumed")
    s.add_argument("--kills", type=int, default=20)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    (blocked_main if args.what == "blocked" else soak_main)(args)


if __name__ == "__main__":
    main()
