"""Soak of fault tolerance across replica groups (fault_tolerance.enabled, torchft): R groups of N ranks
train a tiny model on CPU while random groups are SIGKILLed at random steps and phases, against a
clean run of the same batch.

    python benchmarks/ft_soak.py [--groups 3] [--nproc 2] [--steps 500] [--kills 20] [--seed 0]
                                 [--min-replicas 2] [--every 25] [--section.key=value ...]

The faulted run is `scaletrain ft-local` with the kills of tests/ft_faults.py (its hidden --rank-hook):
each kill SIGKILLs one rank of one group at a phase drawn from forward, the gradient all-reduce, the
optimizer step, a checkpoint save (the writer, group 0) and a heal (the group's next heal after a kill
of its own). With --min-replicas below --groups the live groups go on while a killed group restarts;
the job's batch shrinks meanwhile (train.global_batch per group alive).

The clean run is one process training the groups' joint batch (R x train.global_batch) for the same
steps: what R groups that never fail compute (tests/test_fault_tolerance.py shows the two agree).

Printed (and written to --out as JSON): the kills that fired, with their phase and step; job-wide
restarts (a restart of a group that was not killed, or of the whole job: must be 0); for each rejoin,
how many steps the restarted group took to hold the live groups' step (healed at its first quorum: 0);
the steps not committed; the group-steps missed while groups were down; what a job-wide restart from
the newest checkpoint would have redone at each kill; the final validation losses.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO / "tests"))  # the injector: tests/ft_faults.py

from ft_faults import PHASES, fired, write_plan  # noqa: E402

TINY = {"model.dim": 64, "model.n_layers": 2, "model.n_heads": 4, "model.max_seq_len": 32, "data.seq_len": 32,
        "train.device": "cpu", "optim.warmup_steps": 20, "log.every": 1, "log.progress": "off",
        "log.tensorboard": False, "train.sample_tokens": 0, "train.eval_batches": 4}


def plan(groups: int, nproc: int, steps: int, kills: int, seed: int, every: int) -> list[dict]:
    """`kills` kills at distinct random steps after the first checkpoint and before the last third of
    the run (a group killed near the end comes back to groups that have finished: it cannot rejoin,
    and ft-local stops it, which measures nothing), in random groups, ranks and phases. A save kill hits group 0 (the
    writer while it lives) at a checkpoint's step; a heal kill is a kill of the same group in its
    forward followed by one in its next heal (two kills)."""
    rng = random.Random(seed)
    out: list[dict] = []
    taken: set[int] = set()
    last = steps - steps // 3
    while len(out) < kills:
        step = rng.randrange(every + 1, last)
        if step in taken:
            continue
        taken.add(step)
        phase, group, rank = rng.choice(PHASES), rng.randrange(groups), rng.randrange(nproc)
        if phase == "save" and -(step // every) not in taken:  # one kill per save
            taken.add(-(step // every))
            out.append({"group": 0, "rank": rank, "step": step // every * every, "phase": "save"})
        elif phase == "heal" and len(out) + 2 <= kills:
            out += [{"group": group, "rank": rank, "step": step, "phase": "forward"},
                    {"group": group, "rank": rank, "step": step, "phase": "heal"}]
        elif phase not in ("heal", "save"):
            out.append({"group": group, "rank": rank, "step": step, "phase": phase})
    return [{**k, "until": last} for k in out]  # a kill its group reaches only later (it was down) is dropped


def journal(run: Path, group: int) -> list[dict]:
    path = run / f"group{group}" / "journal.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def analyse(run: Path, groups: int, steps: int, every: int, kills: list[dict]) -> dict:
    done = fired(run)
    lines = {g: journal(run, g) for g in range(groups)}
    pids = {g: list(dict.fromkeys(e["pid"] for e in lines[g])) for g in range(groups)}
    killed = {g: sum(1 for k in done.values() if k["group"] == g) for g in range(groups)}
    # a group's restarts are its processes after the first; each must come from a kill of its own
    unexplained = {g: len(pids[g]) - 1 - killed[g] for g in range(groups)}
    # rejoin: the first step a new process took; it held the live groups' step if no group had taken a
    # later step by the time it finished that one
    rejoins = []
    for g in range(groups):
        for pid in pids[g][1:]:
            first = next(e for e in lines[g] if e["pid"] == pid)
            newest = max((e["step"] for h in range(groups) for e in lines[h] if e["time"] < first["time"]), default=0)
            rejoins.append({"group": g, "step": first["step"], "behind": max(0, newest - first["step"]),
                            "healed": first["healed"]})
    by_step: dict[int, dict] = {}
    for g in range(groups):
        for e in lines[g]:
            by_step[e["step"]] = e  # the last group's word on each step: they agree (one quorum)
    uncommitted = sorted(s for s, e in by_step.items() if e["skipped"])
    missed = sum(groups - by_step[s]["groups"] for s in by_step if not by_step[s]["skipped"])
    # a job-wide restart at each kill redoes, in every group, the steps since the newest checkpoint: a kill
    # inside step s loses s and those since the last checkpoint; one inside the save of s, the checkpoint too
    redone = [every if k["phase"] == "save" else k["step"] - (k["step"] - 1) // every * every
              for k in done.values()]
    # every group restart says so in a line (which group, it does not say): each must come from a kill,
    # or from a rank that found itself behind the quorum in its loop (it heals, then restarts itself)
    err = (run.parent / "stderr.txt").read_text() if (run.parent / "stderr.txt").exists() else ""
    restarts, midloop = len(re.findall(r"restart \d+ of at most", err)), err.count("mid-run; it restarts")
    return {"kills_planned": len(kills), "kills_fired": len(done),
            "fired": sorted(done.values(), key=lambda k: k["time"]),
            "group_restarts": restarts, "restarts_after_a_mid_loop_heal": midloop,
            "restarts_per_group_that_took_a_step": {g: len(pids[g]) - 1 for g in range(groups)},
            "job_wide_restarts": sum(max(0, u) for u in unexplained.values()) + max(0, restarts - len(done) - midloop),
            "rejoins": rejoins, "max_behind_at_rejoin": max((r["behind"] for r in rejoins), default=0),
            "steps_logged": len(by_step), "uncommitted_steps": uncommitted,
            "group_steps_missed_while_down": missed,
            "job_restart_would_redo_steps": sum(redone), "job_restart_would_redo_group_steps": groups * sum(redone)}


def clean_val_loss(cfg_values: dict, folder: Path) -> float:
    """The final validation loss of one process trained on `cfg_values` in `folder` (read back when it
    was trained there already)."""
    import io

    from scaletrain.config import load_config
    from scaletrain.train.trainer import Trainer

    if (folder / "metrics.jsonl").exists():
        return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()][-1]["val_loss"]
    trainer = Trainer(load_config(None, {**cfg_values, "log.run_dir": str(folder)}), stream=io.StringIO())
    return trainer.fit()["history"][-1]["val_loss"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", type=int, default=3)
    ap.add_argument("--nproc", type=int, default=2, help="ranks of each group")
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--min-replicas", type=int, default=2)
    ap.add_argument("--every", type=int, help="checkpoint.every (default: 25, or a tenth of a shorter run's steps)")
    ap.add_argument("--batch", type=int, default=4, help="train.global_batch of each group")
    ap.add_argument("--out", help="write the result as JSON here")
    ap.add_argument("--timeout", type=float, default=900, help="seconds the faulted run may take (default 900)")
    ap.add_argument("--analyse", metavar="RUN", help="only analyse the faulted run left in RUN (its folder ft)")
    args, extra = ap.parse_known_args()
    args.every = args.every or max(1, min(25, args.steps // 10))
    room = args.steps - args.steps // 3 - args.every - 1  # the steps a kill may fall on
    if args.kills > room:
        ap.error(f"--kills={args.kills} do not fit {args.steps} steps: kills fall on distinct steps after the first "
                 f"checkpoint (--every={args.every}) and before the last third, {max(room, 0)} here; give fewer "
                 "--kills, a smaller --every or more --steps")
    values = {**TINY, "train.steps": args.steps, "train.global_batch": args.batch,
              "train.micro_batch": args.batch // args.nproc, "train.eval_every": args.steps,
              "checkpoint.every": args.every, "checkpoint.save_final": True}
    kills = plan(args.groups, args.nproc, args.steps, args.kills, args.seed, args.every)
    tmp = Path(args.analyse or tempfile.mkdtemp(prefix="ft-soak-"))
    run = tmp / "ft"
    if args.analyse:
        kills = json.loads((run / "faults.json").read_text())["kills"]
        return report(args, run, tmp, kills, values, wall=float("nan"))
    write_plan(run, kills, journal=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "tests"), os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, "-m", "scaletrain", "ft-local", "--groups", str(args.groups), "--nproc",
               str(args.nproc), "--min-replicas", str(args.min_replicas), "--heartbeat-timeout-ms=1000",
               "--max-restarts", str(args.kills + 5), "--rank-hook=ft_faults:inject",
               *[f"--{k}={v}" for k, v in values.items()], f"--log.run_dir={run}",
               "--fault_tolerance.quorum_timeout_s=300", *extra]
    print(f"faulted run: {args.groups} groups x {args.nproc} ranks, {args.steps} steps, {len(kills)} kills "
          f"(seed {args.seed}), min_replicas {args.min_replicas}, in {run}", flush=True)
    t0 = time.time()
    with open(tmp / "stderr.txt", "w") as err:
        try:
            code = subprocess.run(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=err,
                                  timeout=args.timeout).returncode
        except subprocess.TimeoutExpired:
            code = "a timeout"
    wall = time.time() - t0
    if code != 0:
        print((tmp / "stderr.txt").read_text()[-5000:], file=sys.stderr)
        print(f"the faulted run failed with exit code {code} after {wall:.0f} s; its folder: {run}", file=sys.stderr)
        return 1
    return report(args, run, tmp, kills, values, wall)


def report(args, run: Path, tmp: Path, kills: list[dict], values: dict, wall: float) -> int:
    result = analyse(run, args.groups, args.steps, args.every, kills)
    # the final validation loss of the groups that finished (they hold the same weights)
    ends = {g: rows[-1] for g in range(args.groups) if (rows := [
        json.loads(line) for line in (run / f"group{g}" / "metrics.jsonl").read_text().splitlines()])}
    finished = {g: r["val_loss"] for g, r in ends.items() if r["step"] == args.steps and "val_loss" in r}
    result["groups_finished"] = sorted(finished)
    result["val_loss"] = next(iter(finished.values()))
    result["val_loss_groups_agree"] = len(set(finished.values())) == 1
    t1 = time.time()
    result["clean_val_loss"] = clean_val_loss({**values, "train.global_batch": args.groups * args.batch,
                                               "train.micro_batch": args.batch}, tmp / "clean")
    # the same with one group fewer throughout: how much of a gap the batch lost while groups are down explains
    result["clean_val_loss_one_group_fewer"] = clean_val_loss(
        {**values, "train.global_batch": (args.groups - 1) * args.batch, "train.micro_batch": args.batch},
        tmp / "clean_one_group_fewer")
    result["wall_s"], result["clean_wall_s"] = round(wall, 1), round(time.time() - t1, 1)
    result["val_loss_rel_diff"] = abs(result["val_loss"] - result["clean_val_loss"]) / result["clean_val_loss"]
    result["command"] = " ".join(sys.argv)
    for k, v in result.items():
        if k not in ("fired", "rejoins"):
            print(f"{k:36} {v}")
    print("fired:", ", ".join(f"g{k['group']}r{k['rank']} {k['phase']}@{k['step']}" for k in result["fired"]))
    print("rejoins (group, step, behind):", ", ".join(f"({r['group']}, {r['step']}, {r['behind']})"
                                                     for r in result["rejoins"]))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
