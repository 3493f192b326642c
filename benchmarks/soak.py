"""Soak: a long CPU run with faults injected, against the same run without them.

Two runs of the same config on --nproc ranks (ZeRO-3 by default), each --steps steps with a
checkpoint every --every steps:

  clean    no faults.
  faulted  `--max-restarts` set, and while it trains this script
             1. SIGKILLs a worker (at --kill-at),
             2. freezes a worker with SIGSTOP so it stops answering (at --hang-at): the others
                must notice within parallel.timeout_s, stop, and the group must restart,
             3. poisons one gradient with NaN on one rank at step --nan-at: the step must be
                skipped with the weights untouched.
           After 1 and 2 the group resumes from its newest complete checkpoint.

Printed: the wall time of each run, every fault with the step it hit and how it was survived,
whether every step before the NaN step logged bitwise the same loss as the clean run, and the
final losses. The NaN step drops one update, so from there on the faulted run is a slightly
different (equally valid) trajectory; the final losses are compared with a relative tolerance
(--tolerance, default 1e-2) and the difference is printed. Without the NaN fault (--nan-at 0)
the final losses must be bitwise equal.

    python benchmarks/soak.py [--steps 2000] [--every 100] [--nproc 2] [--kill-at 450]
                              [--hang-at 1050] [--nan-at 1500] [--section.key=value ...]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
TINY = ["--model.dim=64", "--model.n_layers=2", "--model.n_heads=4", "--data.seq_len=32", "--train.global_batch=8",
        "--optim.warmup_steps=20", "--log.every=1", "--log.progress=off", "--log.tensorboard=false",
        "--train.sample_tokens=0", "--parallel.zero=3"]


def rank_main(*argv: str) -> int:
    """One rank of the faulted run: the normal `scaletrain train` worker with a NaN planted in
    one local gradient at one step, once (a marker file keeps a restarted group from repeating it).
    The `soak:rank_main` task of scaletrain.launch.worker."""
    from scaletrain.config import load_config
    from scaletrain.launch import job
    from scaletrain.train.trainer import Trainer

    nan_at, marker = int(os.environ["SOAK_NAN_AT"]), Path(os.environ["SOAK_NAN_MARKER"])
    real_update = Trainer.update

    def update(self):
        if self.step + 1 == nan_at and os.environ.get("RANK") == "1" and not marker.exists():
            grad = self.optim_params[0][1].grad
            local = grad.to_local() if hasattr(grad, "to_local") else grad
            local.view(-1)[0] = float("nan")
            marker.write_text(str(nan_at))
        return real_update(self)

    Trainer.update = update
    return job.train(load_config(None, list(argv)))


def _rows(run: Path) -> list[dict]:
    f = run / "metrics.jsonl"
    if not f.exists():
        return []
    rows = []
    for line in f.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written
            break
    return rows


def _descendants(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    kids = [int(p) for p in out.split()]
    return kids + [d for k in kids for d in _descendants(k)]


def _rank_pid(root: int, rank: int) -> int | None:
    for pid in _descendants(root):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env and b"TORCHELASTIC_RUN_ID" in b" ".join(env):
            return pid
    return None


def _run(args, extra: list[str], run_dir: Path, faults: bool) -> tuple[float, list[str], list[dict], str]:
    run_dir.parent.mkdir(parents=True)
    common = [*TINY, f"--train.steps={args.steps}", f"--checkpoint.every={args.every}", "--checkpoint.keep=3",
              f"--log.run_dir={run_dir}", f"--parallel.timeout_s={args.timeout}", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if faults:
        env.update(SOAK_NAN_AT=str(args.nan_at), SOAK_NAN_MARKER=str(run_dir.parent / "nan-planted"))
        code = ("import sys; from scaletrain.launch.launcher import launch; "
                f"sys.exit(launch('soak:rank_main', {common!r}, nproc={args.nproc}, "
                f"max_restarts={args.max_restarts}, pythonpath=({str(HERE.parent)!r},)))")
        cmd = [sys.executable, "-c", code]
    else:
        cmd = [sys.executable, "-m", "scaletrain", "train", "--nproc", str(args.nproc), *common]
    events = []
    pending = [(kind, at) for kind, at in (("kill", args.kill_at), ("hang", args.hang_at)) if faults and at]
    start = time.perf_counter()
    log = (run_dir.parent / "stderr.txt").open("w+")  # a file, not a pipe: nobody reads a pipe while we wait
    proc = subprocess.Popen(cmd, stderr=log, stdout=subprocess.DEVNULL, text=True, env=env)
    while proc.poll() is None:
        time.sleep(0.05)
        rows = _rows(run_dir) if pending else []
        if not rows or rows[-1]["step"] < pending[0][1]:
            continue
        pid = _rank_pid(proc.pid, 1)
        if pid is None:  # the group is restarting
            continue
        kind = pending.pop(0)[0]
        os.kill(pid, signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
        events.append(f"{'SIGKILL' if kind == 'kill' else 'SIGSTOP (a hang)'} to rank 1 (pid {pid}) after step "
                      f"{rows[-1]['step']}, {time.perf_counter() - start:.1f} s into the run")
    log.seek(0)
    stderr = log.read()
    log.close()
    if proc.returncode != 0:
        sys.exit(f"the {'faulted' if faults else 'clean'} run failed (exit {proc.returncode}):\n{stderr[-3000:]}")
    return time.perf_counter() - start, events, _rows(run_dir), stderr


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--every", type=int, default=100, help="checkpoint every this many steps")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--max-restarts", type=int, default=3)
    ap.add_argument("--timeout", type=int, default=10, help="parallel.timeout_s of both runs")
    ap.add_argument("--kill-at", type=int, default=450, help="SIGKILL rank 1 after this step (0: no kill)")
    ap.add_argument("--hang-at", type=int, default=1050, help="SIGSTOP rank 1 after this step (0: no hang)")
    ap.add_argument("--nan-at", type=int, default=1500, help="NaN gradient on rank 1 at this step (0: none)")
    ap.add_argument("--tolerance", type=float, default=1e-2, help="relative, on the final loss")
    args, extra = ap.parse_known_args(argv)

    work = Path(tempfile.mkdtemp(prefix="soak-"))
    try:
        t_clean, _, clean, _ = _run(args, extra, work / "clean" / "run", faults=False)
        t_fault, events, faulted, stderr = _run(args, extra, work / "faulted" / "run", faults=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    restarts = [line for line in stderr.splitlines() if "scaletrain: restart" in line]
    stopped = [line for line in stderr.splitlines() if "stopped participating" in line]
    skipped = [line for line in stderr.splitlines() if "non-finite gradient" in line]
    print(f"soak: {args.steps} steps on {args.nproc} ranks, checkpoint every {args.every}, "
          f"parallel.timeout_s={args.timeout:g}")
    print(f"  clean run    {t_clean:7.1f} s   {len(clean)} steps logged")
    print(f"  faulted run  {t_fault:7.1f} s   {len(faulted)} steps logged, {len(restarts)} restart(s)")
    for e in events:
        print(f"  injected: {e}")
    if args.nan_at:
        print(f"  injected: NaN in one gradient on rank 1 at step {args.nan_at}")
    for line in stopped + skipped + restarts:
        print(f"  reported: {line.strip()}")
    assert [r["step"] for r in faulted] == [r["step"] for r in clean] == list(range(1, args.steps + 1)), \
        "the faulted run's metrics do not hold every step exactly once"
    cut = args.nan_at - 1 if args.nan_at else args.steps
    same = sum(a["loss"] == b["loss"] for a, b in zip(clean[:cut], faulted[:cut]))
    print(f"  steps 1-{cut}: {same} of {cut} losses bitwise equal to the clean run")
    if args.nan_at:
        row = faulted[args.nan_at - 1]
        print(f"  step {args.nan_at}: skipped_steps={row.get('skipped_steps')} in the metrics row")
    a, b = clean[-1]["loss"], faulted[-1]["loss"]
    rel = abs(a - b) / abs(a)
    ok = same == cut and (rel == 0 if not args.nan_at else rel <= args.tolerance)
    print(f"  final loss: clean {a:.6f}, faulted {b:.6f}, relative difference {rel:.2e} "
          f"({'bitwise' if not args.nan_at else f'tolerance {args.tolerance:g}'}): {'PASS' if ok else 'FAIL'}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
