"""The Slurm and torchrun lines of the docs, run for real: a Slurm controller and two slurmd "nodes"
(network namespaces with their own addresses and hostnames, tests/launch/slurm_cluster.py), the job
scripts taken from the docs as written and given tiny settings on the sbatch line, as a user would.

- docs/guides/nodes.md's sbatch script: 2 nodes x 2 ranks (ZeRO-3) train as one process does;
- `scancel` of that job: SIGTERM reaches every rank, which saves; the job resubmitted with
  checkpoint.resume=auto continues with the losses of the uninterrupted run;
- docs/guides/fault-tolerance.md's Slurm jobs (a Lighthouse job, an array of group jobs): the
  node of one group killed mid-run; Slurm requeues its job when the node comes back, the group
  heals from its peer, and the run ends as `scaletrain ft-local`'s does after a kill;
- the same guide's torchrun line: two groups on two "nodes", one started by torchrun, its node
  killed mid-run and its command started again.

Marked slurm (and slow, multiproc): `make slurm-test` installs Slurm if it can and runs them; the
suite runs them where slurmctld is installed and this process is root, and skips them otherwise.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

import slurm_cluster as cluster

from conftest import REPO, assert_same_run, read_metrics

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.multiproc]

# tiny settings for the docs' configs (llama-8b.toml's model, data and precision made small), on the CPU
TINY = ["--model.preset=tiny", "--model.dim=64", "--model.n_layers=2", "--model.n_heads=4", "--model.max_seq_len=32",
        "--data.path=", "--data.seq_len=32", "--data.num_workers=0", "--train.global_batch=8",
        "--train.compile=false", "--train.device=cpu", "--precision.mode=32-true",
        "--memory.activation_checkpointing=none", "--optim.warmup_steps=2", "--log.every=1", "--log.progress=off",
        "--log.tensorboard=false", "--train.sample_tokens=0"]
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
         "PREEMPTED")


@pytest.fixture(scope="module")
def slurm():
    """The cluster, started for this module and stopped after it; skipped with the reason where
    Slurm is not installed or this process is not root."""
    if why := cluster.missing():
        pytest.skip(f"no Slurm cluster here ({why}); `make slurm-test` installs and runs it")
    probe = subprocess.run(["ip", "netns", "add", "stslurm-probe"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot make network namespaces here: {probe.stderr.strip()}")
    subprocess.run(["ip", "netns", "del", "stslurm-probe"], capture_output=True)
    cluster.start()
    try:
        yield cluster.env()
    finally:
        cluster.stop(keep_logs=True)  # /tmp/scaletrain-slurm/*.log: what the daemons said


def docs_script(page: str, first_line: str) -> str:
    """The fenced bash block of docs/guides/PAGE that begins with FIRST_LINE, as written."""
    blocks = re.findall(r"```bash\n(.*?)```", (REPO / "docs" / "guides" / page).read_text(), re.S)
    found = [b for b in blocks if b.startswith(first_line)]
    assert len(found) == 1, f"{page}: {len(found)} bash blocks begin with {first_line!r}"
    return found[0]


def job_env(slurm: dict) -> dict:
    """What a user's shell has: scaletrain on PATH (this interpreter's), this tree's source."""
    path = os.pathsep.join([str(Path(sys.executable).parent), slurm["PATH"]])
    src = os.pathsep.join([str(REPO / "src"), slurm.get("PYTHONPATH", "")])
    return {**slurm, "PATH": path, "PYTHONPATH": src, "OMP_NUM_THREADS": "1"}


def sbatch(slurm: dict, script: Path, *args: str, options: tuple = ()) -> str:
    """Submit SCRIPT with ARGS after it (sbatch's OPTIONS before it) from the repository; the job id."""
    r = subprocess.run(["sbatch", "--parsable", *options, str(script), *args], capture_output=True, text=True,
                       cwd=REPO, env=job_env(slurm))
    assert r.returncode == 0, r.stderr
    return r.stdout.strip().split(";")[0]


def job(slurm: dict, job_id: str) -> dict:
    """scontrol's fields of the job (of each array task: `job(slurm, "7_1")`)."""
    out = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True, env=slurm).stdout
    return dict(f.split("=", 1) for f in out.split() if "=" in f)


def wait_for(ready, timeout: float, what) -> None:
    """Poll READY until it holds; the bound only ends a broken run (WHAT() says why)."""
    deadline = time.monotonic() + timeout
    while not ready():
        assert time.monotonic() < deadline, what()
        time.sleep(0.5)


def ended(slurm: dict, job_id: str, timeout: float = 600) -> dict:
    wait_for(lambda: job(slurm, job_id).get("JobState") in ENDED, timeout,
             lambda: f"job {job_id} did not end: {job(slurm, job_id)}")
    return job(slurm, job_id)


def rows(run: Path) -> list[dict]:
    return read_metrics(run) if (run / "metrics.jsonl").exists() else []


def one_process(run: Path, steps: int) -> list[dict]:
    """The reference: the same config and options trained by one process, no launcher."""
    from scaletrain.config import load_config
    from scaletrain.train.trainer import Trainer

    options = dict(o[2:].split("=", 1) for o in [*TINY, f"--train.steps={steps}", f"--log.run_dir={run}"])
    return Trainer(load_config(str(REPO / "configs" / "llama-8b.toml"), options)).fit()["history"]


# --------------------------------------------------------------------------------------------
# docs/guides/nodes.md: the sbatch script


def nodes_script(tmp_path: Path) -> Path:
    script = tmp_path / "train.sbatch"
    script.write_text(docs_script("nodes.md", "#!/bin/bash"))
    return script


def test_the_nodes_guide_sbatch_script_trains_two_nodes_as_one_process(slurm, tmp_path):
    run, steps = tmp_path / "run", 12
    job_id = sbatch(slurm, nodes_script(tmp_path), "--nproc", "2", *TINY, f"--train.steps={steps}",
                    f"--log.run_dir={run}", options=("-o", str(tmp_path / "job.out")))
    state = ended(slurm, job_id)
    out = (tmp_path / "job.out").read_text()
    assert (state["JobState"], state["ExitCode"]) == ("COMPLETED", "0:0"), out[-3000:]
    assert state["NodeList"] == "node[1-2]", state
    assert "layout: 4 rank(s) = pp 1 × dp_replicate 1 × dp_shard 4 × tp 1; data parallel ZeRO-3" in out, out[-3000:]
    # 4 ranks: 2 micro-batches of 1 window each; one process: 8 of 1; reduced in another order
    assert_same_run(read_metrics(run), one_process(tmp_path / "one", steps), steps=steps, tol=(1e-5, 1e-4),
                    what="the nodes guide's sbatch script, 2 nodes x 2 ranks")


def test_scancel_saves_a_checkpoint_and_the_resubmitted_job_continues_the_run(slurm, tmp_path):
    from scaletrain.train.checkpoint import latest_checkpoint, verify_checkpoint

    run, steps, script = tmp_path / "run", 400, nodes_script(tmp_path)
    args = ["--nproc", "2", *TINY, f"--train.steps={steps}", f"--log.run_dir={run}"]
    first = sbatch(slurm, script, *args, options=("-o", str(tmp_path / "first.out")))
    wait_for(lambda: len(rows(run)) >= 5 or job(slurm, first).get("JobState") in ENDED, 600,
             lambda: f"no steps logged: {job(slurm, first)}")
    subprocess.run(["scancel", first], check=True, env=slurm)
    state, out = ended(slurm, first), (tmp_path / "first.out").read_text()
    assert state["JobState"] == "CANCELLED", (state, out[-3000:])
    assert "scaletrain: stopped by SIGTERM: the ranks finished their step and saved" in out, out[-3000:]
    saved = latest_checkpoint(run / "checkpoints")
    assert saved is not None and verify_checkpoint(saved) is None, saved
    stopped_at = int(saved.name.split("_")[1])
    assert 5 <= stopped_at < steps and rows(run)[-1]["step"] == stopped_at, (saved, rows(run)[-1])

    second = sbatch(slurm, script, *args, "--checkpoint.resume=auto", options=("-o", str(tmp_path / "second.out")))
    state, out = ended(slurm, second), (tmp_path / "second.out").read_text()
    assert (state["JobState"], state["ExitCode"]) == ("COMPLETED", "0:0"), out[-3000:]
    # the resumed steps are the uninterrupted run's: same data position, weights and optimizer state
    resumed = [r for r in read_metrics(run) if r["step"] > stopped_at]
    assert_same_run(resumed, one_process(tmp_path / "one", steps), steps=steps, first=stopped_at + 1,
                    tol=(1e-5, 1e-4), what="resumed after scancel")
