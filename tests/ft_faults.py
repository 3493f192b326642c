"""Real SIGKILLs at chosen steps and phases of a fault-tolerant job's replica groups: the injector of
tests/parallel/test_fault_tolerance.py and benchmarks/ft_soak.py, given to every rank by
`scaletrain ft-local --rank-hook ft_faults:inject` (this folder on the ranks' PYTHONPATH).

The plan is a JSON file beside the groups' run folders, <log.run_dir of ft-local>/faults.json, written
before the launch:

    {"kills": [{"group": 1, "step": 3, "phase": "forward"}, {"group": 1, "phase": "heal"}, ...],
     "record": true}

Each kill fires once in the whole job, restarts included: rank `rank` (default 0) of group `group`
SIGKILLs itself at the first `phase` it reaches at a step >= `step` (default 0) and <= `until` (if given:
past it the kill is dropped; a group killed after the others finished cannot rejoin them: ft-local
stops it). Just before, it copies its group's metrics.jsonl as it stands (whole rows: the file is
line-buffered) to <log.run_dir>/fired/<index>.metrics.jsonl, the rows of the steps it logged before the
kill, which its restart would drop (`rows_at_kill`), then writes <log.run_dir>/fired/<index>.json
({"group", "rank", "phase", "step", "time"}), which the test reads. The phases, and the step each one
counts as:

    forward    in the model's forward of a training step (its first micro-batch); the step being taken
    reduce     in the group's own gradient reduction: in backward, once the last layers' gradients were
               handed to the data-parallel engine (DDP's buckets in flight), before the first layer's; the step
    allreduce  in the groups' gradient all-reduce: the collective issued, never waited for; the step
    vote       in the commit vote: the group's other ranks have voted or are voting, this one never will; the step
    optimizer  in the optimizer step (the group voted its commit; the weights are not updated yet); the step
    save       inside a checkpoint save (the tensors written in its partial folder, nothing else yet);
               the checkpoint's step
    heal       while healing from a live peer (the peer's weights, optimizer state and step taken, what
               the model computes with not refreshed yet); the step healed to

"record": each group's rank 0 also writes its state (weights, optimizer state, step, skipped steps)
before each step it takes, to <run>/group<r>/states/<step>.pt (a heal or a restart overwrites the step
it went back to), and at the end to <run>/group<r>/states/final.pt: what the tests compare bit for bit.
"journal": each group's rank 0 appends a line per step it took to <run>/group<r>/journal.jsonl (kept
across its restarts, unlike metrics.jsonl): {"step", "skipped", "groups" (in its quorum), "healed" (heals
of this process so far), "pid", "time"}, what benchmarks/ft_soak.py reads.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import torch

PHASES = ("forward", "reduce", "allreduce", "vote", "optimizer", "save", "heal")


def write_plan(run_dir: Path, kills: list[dict], *, record: bool = False, journal: bool = False) -> Path:
    """The plan for a job whose ft-local log.run_dir is `run_dir` (created); returns its path."""
    for k in kills:
        assert k["phase"] in PHASES, k
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "faults.json"
    path.write_text(json.dumps({"kills": kills, "record": record, "journal": journal}))
    return path


def fired(run_dir: Path) -> dict[int, dict]:
    """The kills that fired so far: {index in the plan: what its marker says}."""
    folder = run_dir / "fired"
    return {int(p.stem): json.loads(p.read_text()) for p in folder.glob("*.json")} if folder.is_dir() else {}


def rows_at_kill(run_dir: Path, index: int) -> list[dict]:
    """The metrics rows the killed group had logged when kill `index` of the plan fired."""
    path = run_dir / "fired" / f"{index}.metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def inject(trainer) -> None:
    """The rank hook: arm this rank's kills of the plan (those not fired yet), and the recording."""
    from scaletrain.parallel.fault_tolerance import ReplicaGroups

    job_dir = Path(trainer.folder.run_dir).parent
    plan = json.loads((job_dir / "faults.json").read_text())
    group, rank = trainer.cfg.fault_tolerance.replica_id, trainer.rt.rank
    done = fired(job_dir)
    mine = [(i, k) for i, k in enumerate(plan["kills"])
            if i not in done and k["group"] == group and k.get("rank", 0) == rank]

    def due(phase: str, step: int) -> None:
        for i, k in mine:
            if k["phase"] == phase and k.get("step", 0) <= step <= k.get("until", step):
                marker = job_dir / "fired" / f"{i}.json"
                marker.parent.mkdir(exist_ok=True)
                rows = marker.with_suffix(".metrics.jsonl")  # the restart would start the group's file anew
                metrics = Path(trainer.folder.run_dir) / "metrics.jsonl"
                rows.with_suffix(".tmp").write_bytes(metrics.read_bytes() if metrics.exists() else b"")
                os.replace(rows.with_suffix(".tmp"), rows)
                tmp = marker.with_suffix(".tmp")
                tmp.write_text(json.dumps({"group": group, "rank": rank, "phase": phase, "step": step,
                                           "time": time.time()}))
                os.replace(tmp, marker)  # whole, before the kill: the test reads it
                os.kill(os.getpid(), signal.SIGKILL)

    state = trainer.state
    ft = trainer.hooks.find(ReplicaGroups)
    assert ft is not None, "the fault injector needs fault_tolerance.enabled"

    training = [False]  # the model's forward inside a training step, not an evaluation's

    def forward_backward(batches, real=trainer.forward_backward):
        training[0] = True
        try:
            return real(batches)
        finally:
            training[0] = False

    def in_forward(module, args):
        if training[0]:
            due("forward", state.step + 1)

    trainer.forward_backward = forward_backward
    trainer.model.register_forward_pre_hook(in_forward)

    def allreduce(tensor, *args, real=ft.manager.allreduce, **kwargs):
        work = real(tensor, *args, **kwargs)  # issued to the other groups; this rank dies before waiting
        due("allreduce", state.step + 1)
        return work

    ft.manager.allreduce = allreduce

    def should_commit(*args, real=ft.manager.should_commit, **kwargs):
        due("vote", state.step + 1)
        return real(*args, **kwargs)

    ft.manager.should_commit = should_commit

    def in_reduction(grad):  # the first block's first weight: its gradient comes late in backward
        if training[0]:
            due("reduce", state.step + 1)
        return grad

    first = next(p for n, p in trainer.pm.dp.named_params if ".0." in n and p.requires_grad)
    first.register_hook(in_reduction)

    def optimizer_step(*args, real=trainer.optimizer.step, **kwargs):
        due("optimizer", state.step + 1)
        return real(*args, **kwargs)

    trainer.optimizer.step = optimizer_step

    from scaletrain.train import checkpoint as ckpt

    def rng_state(real=ckpt.rng_state):  # a save calls it once its tensors are in the partial folder
        due("save", state.step)
        return real()

    ckpt.rng_state = rng_state  # this process's module: its saves only

    def refresh(real=ft.refresh):  # the last part of taking a peer's state
        due("heal", state.step)
        return real()

    ft.refresh = refresh
    if plan.get("record") and rank == 0:
        _record_states(trainer)
    if plan.get("journal") and rank == 0:
        _journal(trainer, ft)


def _journal(trainer, ft) -> None:
    path = Path(trainer.folder.run_dir) / "journal.jsonl"

    def train_step(batches, real=trainer.train_step):
        out = real(batches)
        with path.open("a") as f:  # one short line per write: whole even when this process dies next
            f.write(json.dumps({"step": trainer.state.step + 1, "skipped": bool(out[2]), "groups": ft.participants,
                                "healed": ft.healed, "pid": os.getpid(), "time": time.time()}) + "\n")
        return out

    trainer.train_step = train_step


def _record_states(trainer) -> None:
    folder = Path(trainer.folder.run_dir) / "states"
    folder.mkdir(parents=True, exist_ok=True)

    def write(name: str) -> None:
        state = {"step": trainer.state.step, "skipped_steps": trainer.state.skipped_steps,
                 "params": {n: p.detach().clone() for n, p in trainer.pm.optim_params},
                 "optim": trainer.optimizer.state_dict()}
        torch.save(state, folder / f".{name}.tmp")
        os.replace(folder / f".{name}.tmp", folder / f"{name}.pt")

    def begin_step(loss_factor, real=trainer.hooks.begin_step):
        real(loss_factor)  # the quorum joined: a group behind has healed by now
        write(f"{trainer.state.step:04d}")

    def fit(real=trainer.fit):
        result = real()
        write("final")
        return result

    trainer.hooks.begin_step = begin_step
    trainer.fit = fit


def diverge(trainer) -> None:
    """A rank hook: the ranks of replica group 1 stop at step 3 as a diverged run stops (TrainingStopped,
    exit code 3); the other groups train on."""
    from scaletrain.errors import TrainingStopped

    if trainer.cfg.fault_tolerance.replica_id != 1:
        return
    real = trainer.health.watch_loss

    def watch_loss(step, loss, skipped):
        if step >= 3:
            raise TrainingStopped(f"step {step}: the loss diverged (planted by the test)")
        return real(step, loss, skipped)

    trainer.health.watch_loss = watch_loss


def nan_in_group_2(trainer) -> None:
    """A rank hook: replica group 2's gradients hold a NaN at step 4, before the groups average them
    (every group then sees a non-finite gradient); the other groups' are untouched."""
    import math

    from scaletrain.parallel.fault_tolerance import ReplicaGroups

    if trainer.cfg.fault_tolerance.replica_id != 2:
        return
    ft = trainer.hooks.find(ReplicaGroups)

    def reduce_gradients(named, real=ft.reduce_gradients):
        if trainer.state.step + 1 == 4:
            grad = next(p.grad for _, p in named if p.grad is not None)
            grad.view(-1)[0] = math.nan
        return real(named)

    ft.reduce_gradients = reduce_gradients
