"""Run several training configs inside one group of real processes (tests only).

    Tests call `run_group(nproc, jobs)`, which runs `scaletrain.launch.worker dist_worker:main SPEC`
    on nproc ranks forked from a process that has imported this module (tests/forked_ranks.py), or
    through scaletrain's launcher when a job injects a fault.

SPEC is a JSON file: {"jobs": [{"overrides": {...}, "expect_fail": false, "fault": null}, ...],
"out": "results.json"} (a job may also name a "probe", a "module", and "wait_for": [file, lines]).
Rank 0 writes, per job, the logged history (every logged step's loss and gradient norm before
clipping), a fingerprint of the final weights of the whole model, the wall time of the whole job, of
fit() and of each train_step on rank 0, the measured model-state bytes and the window indices each rank read
at step 0.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import zlib
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from scaletrain.config import load_config
from scaletrain.runtime import init_worker
from scaletrain.train import checkpoint as ckpt
from scaletrain.train.trainer import Trainer

# a job's "module" and "probe" name a test module by its file's stem; the test files live in folders under
# tests/ (tests/parallel/, ...), which a rank started by the launcher (its path: tests/ alone) gets here
# (a folder inside a folder too: tests/model/families/)
_TESTS = Path(__file__).resolve().parent
for _folder in sorted({p.parent for p in _TESTS.rglob("test_*.py")} - {_TESTS}):
    if str(_folder) not in sys.path:
        sys.path.append(str(_folder))


def inject(fault: dict | None, rank: int) -> None:
    """Faults for the tests: kill or fail a rank at a chosen moment."""
    if not fault or fault.get("rank") != rank:
        return
    if fault["kind"] == "kill_during_save":
        real = ckpt._write_json
        count = {"n": 0}

        def dying_write(path, data):
            if path.name.startswith("rng_rank"):
                count["n"] += 1
                if count["n"] == fault["save"]:
                    os.kill(os.getpid(), signal.SIGKILL)  # mid-save: shards written, not renamed
            real(path, data)

        ckpt._write_json = dying_write
    elif fault["kind"] == "raise_at_start":
        raise RuntimeError(fault.get("message", "injected failure"))


def inject_into_trainer(trainer, fault: dict | None, rank: int) -> None:
    """Faults that need the trainer, on one rank at one step: poison a local gradient
    ("inf_grad"), or stop participating for a while inside the step ("sleep_in_step")."""
    if not fault or fault.get("rank") != rank:
        return
    if fault["kind"] == "inf_grad":
        real = trainer.update

        def poisoned_update():
            if trainer.step + 1 == fault["step"]:
                grad = trainer.pm.optim_params[0][1].grad
                local = grad.to_local() if hasattr(grad, "to_local") else grad
                local.view(-1)[0] = float("inf")
            return real()

        trainer.update = poisoned_update
    elif fault["kind"] == "sleep_in_step":
        real_fb = trainer.forward_backward

        def sleepy_forward_backward(batches):
            out = real_fb(batches)  # this rank's collectives of the step are issued...
            if trainer.step + 1 == fault["step"]:
                time.sleep(fault["seconds"])  # ...but it never reaches the optimizer's
            return out

        trainer.forward_backward = sleepy_forward_backward


def weight_fingerprint(named_params) -> dict[str, list[float]]:
    """Per parameter: [its norm, its projection on a fixed random direction seeded by its name],
    of the whole tensor (a sharded one is gathered, so every rank of its mesh calls this
    together). The projections of two runs' weights differ by about the norm of the difference
    of the weights: a cheap comparison of final weights that misses no parameter."""
    out = {}
    for name, p in named_params:
        full = (p.detach().full_tensor() if isinstance(p, DTensor) else p.detach()).double().cpu()
        direction = torch.randn(full.shape, dtype=torch.float64,
                                generator=torch.Generator().manual_seed(zlib.crc32(name.encode())))
        out[name] = [full.norm().item(), (full * direction).sum().item()]
    return out


def timed_steps(trainer) -> list[float]:
    """Wrap trainer.train_step to record how long each step takes (seconds, this rank's clock)."""
    seconds: list[float] = []
    real = trainer.train_step

    def timed(batches):
        t0 = time.perf_counter()
        out = real(batches)
        seconds.append(time.perf_counter() - t0)
        return out

    trainer.train_step = timed
    return seconds


def wait_for_lines(path: str, lines: int, timeout: float = 300.0) -> None:
    """Until file `path` has `lines` lines (another process's metrics rows); past `timeout`: an error."""
    deadline = time.monotonic() + timeout
    while not (Path(path).exists() and len(Path(path).read_text().splitlines()) >= lines):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not reach {lines} lines in {timeout:g} s")
        time.sleep(0.05)


def main(spec_path: str) -> None:
    """A rank of the group (the `dist_worker:main` task of scaletrain.launch.worker, which reports failures)."""
    torch.set_num_threads(1)
    spec = json.loads(Path(spec_path).read_text())
    results = []
    rank = int(os.environ["RANK"])
    for job in spec["jobs"]:
        job_t0 = time.perf_counter()
        if job.get("wait_for"):  # [file, lines]: start once another group has written that much (a late group)
            wait_for_lines(*job["wait_for"])
        cfg = load_config(None, job["overrides"])
        rt = init_worker(cfg)
        inject(job.get("fault"), rank)
        module = None
        if job.get("module"):  # "file_stem:factory": a custom nn.Module built by a test module
            import importlib

            name, factory = job["module"].split(":")
            module = getattr(importlib.import_module(name), factory)()
        trainer = Trainer(cfg, rt, stream=open(os.devnull, "w"), model=module)
        inject_into_trainer(trainer, job.get("fault"), rank)
        probe = None
        if job.get("probe"):  # "file_stem:function": a test's instrument on the trainer, returns a reporter
            import importlib

            name, function = job["probe"].split(":")
            probe = getattr(importlib.import_module(name), function)(trainer)
        indices = trainer.sampler(trainer.step).rank_micro_batches(trainer.step)
        step_s = timed_steps(trainer)
        t0 = time.perf_counter()
        result = trainer.fit()
        fit_s = time.perf_counter() - t0
        weights = weight_fingerprint(trainer.pm.dp.named_params)  # this rank's stages, gathered over their shards
        gathered = [None] * rt.world_size
        dist.all_gather_object(gathered, {"rank": rank, "dp_rank": trainer.data.dp_rank, "indices": indices,
                                          "state_bytes": trainer.meter.state_bytes, "probe": probe() if probe else None,
                                          "weights": weights})
        whole = {}  # every stage's parameters (replicas and tensor-parallel peers hold the same values)
        copies: dict[str, list] = {}  # each parameter's fingerprint on every rank that holds it
        for r in gathered:
            for n, v in r.pop("weights").items():
                whole.setdefault(n, v)
                copies.setdefault(n, []).append(v)
        spread = {n: max(abs(v[1] - vs[0][1]) for v in vs) for n, vs in copies.items()}
        results.append({"losses": [(r["step"], r["loss"]) for r in result["history"]],
                        "history": result["history"], "ranks": gathered, "num_params": trainer.pm.num_params,
                        "start_step": result["history"][0]["step"] if result["history"] else None,
                        "weights": whole, "weights_spread": spread, "fit_s": fit_s, "step_s": step_s,
                        "job_s": time.perf_counter() - job_t0})
        dist.barrier()
    if rank == 0:
        Path(spec["out"]).write_text(json.dumps(results))
    dist.barrier()

