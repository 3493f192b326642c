"""The Slurm and torchrun lines of the docs, run for real: a Slurm controller and two slurmd "nodes"
(network namespaces with their own addresses and hostnames, tests/launch/slurm_cluster.py), the job
scripts taken from the docs as written and given tiny settings on the sbatch line, as a user would.

- docs/guides/nodes.md's sbatch script: 2 nodes x 2 ranks (ZeRO-3) train as one process does;
  `scancel` of that job: SIGTERM reaches every rank, which saves; the job resubmitted with
  checkpoint.resume=auto continues with the losses of the uninterrupted run (one job and its
  resubmission: both halves held against one reference run);
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
    # one cluster a machine (its names, addresses and ports are fixed): a second test run waits for the first
    with open("/tmp/scaletrain-slurm.lock", "w") as lock:
        deadline = time.monotonic() + 900
        while not _locked(lock):
            if time.monotonic() > deadline:
                pytest.skip("another test run has held this machine's Slurm cluster for 15 minutes")
            time.sleep(1)
        cluster.start()
        try:
            yield cluster.env()
        finally:
            cluster.stop(keep_logs=True)  # /tmp/scaletrain-slurm/*.log: what the daemons said


def _locked(lock) -> bool:
    import fcntl

    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


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


def sbatch(slurm: dict, script: Path, *args: str, options: tuple = (), cwd: Path = REPO) -> str:
    """Submit SCRIPT with ARGS after it (sbatch's OPTIONS before it) from CWD; the job id."""
    r = subprocess.run(["sbatch", "--parsable", *options, str(script), *args], capture_output=True, text=True,
                       cwd=cwd, env=job_env(slurm))
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


def test_the_nodes_guide_sbatch_script_trains_two_nodes_as_one_process_and_resumes_after_scancel(slurm, tmp_path):
    """One job of the nodes guide's script (2 nodes x 2 ranks, ZeRO-3) trains as one process does,
    scancel stops it with a checkpoint, and the same script resubmitted with checkpoint.resume=auto
    ends the run with the uninterrupted run's losses: the steps before the stop and those after,
    against one reference run."""
    from scaletrain.train.checkpoint import latest_checkpoint, verify_checkpoint

    # 40 steps: on a 2-core CI machine a step of the 4 ranks takes tenths of a second, so the stop,
    # a second or two after the third row, lands long before the end
    run, steps, script = tmp_path / "run", 40, nodes_script(tmp_path)
    args = ["--nproc", "2", *TINY, f"--train.steps={steps}", f"--log.run_dir={run}"]
    first = sbatch(slurm, script, *args, options=("-o", str(tmp_path / "first.out")))
    wait_for(lambda: len(rows(run)) >= 3 or job(slurm, first).get("JobState") in ENDED, 600,
             lambda: f"no steps logged: {job(slurm, first)}")
    subprocess.run(["scancel", first], check=True, env=slurm)
    state, out = ended(slurm, first), (tmp_path / "first.out").read_text()
    assert state["JobState"] == "CANCELLED", (state, out[-3000:])
    assert state["NodeList"] == "node[1-2]", state
    assert "layout: 4 rank(s) = pp 1 × dp_replicate 1 × dp_shard 4 × tp 1; data parallel ZeRO-3" in out, out[-3000:]
    assert "scaletrain: stopped by SIGTERM: the ranks finished their step and saved" in out, out[-3000:]
    saved = latest_checkpoint(run / "checkpoints")
    assert saved is not None and verify_checkpoint(saved) is None, saved
    stopped_at = int(saved.name.split("_")[1])
    assert 3 <= stopped_at < steps and rows(run)[-1]["step"] == stopped_at, (saved, rows(run)[-1])
    before = rows(run)
    reference = one_process(tmp_path / "one", steps)
    # 4 ranks: 2 micro-batches of 1 window each; one process: 8 of 1; reduced in another order
    assert_same_run(before, reference[:stopped_at], steps=stopped_at, tol=(1e-5, 1e-4),
                    what="the nodes guide's sbatch script, 2 nodes x 2 ranks")

    second = sbatch(slurm, script, *args, "--checkpoint.resume=auto", options=("-o", str(tmp_path / "second.out")))
    state, out = ended(slurm, second), (tmp_path / "second.out").read_text()
    assert (state["JobState"], state["ExitCode"]) == ("COMPLETED", "0:0"), out[-3000:]
    assert state["NodeList"] == "node[1-2]", state
    # the resumed steps are the uninterrupted run's: same data position, weights and optimizer state
    resumed = [r for r in read_metrics(run) if r["step"] > stopped_at]
    assert_same_run(resumed, reference, steps=steps, first=stopped_at + 1, tol=(1e-5, 1e-4),
                    what="resumed after scancel")


# --------------------------------------------------------------------------------------------
# docs/guides/fault-tolerance.md: the Lighthouse job and the array of group jobs; the torchrun line

# each group's batch of 4 windows, a validation loss at the end only (as tests/parallel/test_fault_tolerance.py)
FT_TINY = [*TINY, "--train.global_batch=4", "--train.eval_every=1000", "--train.eval_batches=1",
           "--fault_tolerance.groups=2", "--fault_tolerance.quorum_timeout_s=600"]
FT_STEPS = 60


def ft_folder(tmp_path: Path) -> Path:
    """A user's project folder: configs/ (the repository's), where the jobs are submitted from and
    write runs/ft/group<r>."""
    (tmp_path / "configs").symlink_to(REPO / "configs")
    return tmp_path


def assert_ends_as_ft_local(runs: Path, killed: int, kill_step: int) -> None:
    """How `scaletrain ft-local`'s run ends after a group is killed (tests/parallel/test_fault_tolerance.py):
    the group never killed took every step once, in order; the killed one healed from it after the
    kill; both end on the same weights (the same validation loss, bit for bit); the last checkpoint verifies."""
    from scaletrain.train.checkpoint import latest_checkpoint, verify_checkpoint

    alive = 1 - killed
    kept, back = read_metrics(runs / f"group{alive}"), read_metrics(runs / f"group{killed}")
    assert [r["step"] for r in kept] == list(range(1, FT_STEPS + 1)), [r["step"] for r in kept]
    assert kept[-1]["ft_healed"] == 0, kept[-1]
    healed = [r["step"] for r in back if r["ft_healed"]]
    assert healed and healed[0] > kill_step and healed[-1] == FT_STEPS, (kill_step, healed)
    assert back[-1]["val_loss"] == kept[-1]["val_loss"], (back[-1], kept[-1])
    newest = latest_checkpoint(runs / "group0" / "checkpoints")  # the lowest id in the quorum writes them
    assert newest is not None and newest.name == f"step_{FT_STEPS:08d}" and verify_checkpoint(newest) is None


def test_the_ft_guide_slurm_jobs_survive_a_node_killed_mid_run(slurm, tmp_path):
    here = ft_folder(tmp_path)
    for name, first_line in (("lighthouse", "#!/bin/bash\n#SBATCH --job-name=lighthouse"),
                             ("groups", "#!/bin/bash\n#SBATCH --nodes=2")):
        (here / f"{name}.sbatch").write_text(docs_script("fault-tolerance.md", first_line))
    lighthouse = sbatch(slurm, here / "lighthouse.sbatch", options=("-w", "node1", "-o", str(here / "lh.out")),
                        cwd=here)
    # one node a group (5 of a node's 8 CPUs: the groups land on different nodes, the Lighthouse on node1)
    groups = sbatch({**slurm, "LIGHTHOUSE_JOB": lighthouse}, here / "groups.sbatch", "--nproc", "1", *FT_TINY,
                    f"--train.steps={FT_STEPS}", cwd=here,
                    options=(f"--dependency=after:{lighthouse}", "--nodes=1", "--cpus-per-task=5", "--array=0-1",
                             "-o", str(here / "group%a.out")))
    try:
        wait_for(lambda: all(job(slurm, f"{groups}_{g}").get("JobState") == "RUNNING" for g in (0, 1)), 300,
                 lambda: f"the groups did not start: {job(slurm, groups)}")
        on_node2 = [g for g in (0, 1) if job(slurm, f"{groups}_{g}")["NodeList"] == "node2"]
        assert len(on_node2) == 1, [job(slurm, f"{groups}_{g}")["NodeList"] for g in (0, 1)]
        killed, run = on_node2[0], here / "runs" / "ft" / f"group{on_node2[0]}"
        wait_for(lambda: len(rows(run)) >= 5, 300, lambda: f"group {killed} logged no steps")
        cluster.kill_node("node2")
        kill_step = rows(run)[-1]["step"]
        wait_for(lambda: cluster.node_state("node2") == "down", 120, lambda: "node2 is not down")
        cluster.start_node("node2")  # the machine is back: Slurm starts the requeued job there
        states = {g: ended(slurm, f"{groups}_{g}") for g in (0, 1)}
    finally:
        subprocess.run(["scancel", lighthouse, groups], env=slurm)
    outs = {g: (here / f"group{g}.out").read_text()[-3000:] for g in (0, 1)}
    assert [(s["JobState"], s["ExitCode"]) for s in states.values()] == [("COMPLETED", "0:0")] * 2, outs
    assert (states[killed]["Restarts"], states[1 - killed]["Restarts"]) == ("1", "0"), states
    assert_ends_as_ft_local(here / "runs" / "ft", killed, kill_step)


def test_the_ft_guide_torchrun_line_survives_its_node_killed(slurm, tmp_path):
    """The guide's lines "anywhere": the Lighthouse and group 0 (`scaletrain train`) on node1, group 1
    (`torchrun ... -m scaletrain train`) on node2; node2 killed mid-run, and its command started
    there again, as whoever runs the nodes would."""
    here, host = ft_folder(tmp_path), cluster.NODES["node1"]
    env = {**job_env(slurm), "RUST_LOG": "warn"}
    same = ["--config", "configs/llama-8b.toml", "--checkpoint.resume=auto", "--fault_tolerance.enabled=true",
            f"--fault_tolerance.lighthouse=http://{host}:29510", "--fault_tolerance.min_replicas=2", *FT_TINY,
            f"--train.steps={FT_STEPS}"]

    def start(node: str, name: str, *argv: str) -> subprocess.Popen:
        with open(here / f"{name}.err", "ab") as err:
            return subprocess.Popen(cluster.on_node(node, *argv), cwd=here, env=env, stdout=subprocess.DEVNULL,
                                    stderr=err)

    def group1(name: str) -> subprocess.Popen:
        return start("node2", name, "torchrun", "--nproc-per-node", "1", "--max-restarts", "100", "-m", "scaletrain",
                     "train", "--log.run_dir=runs/ft/group1", *same, "--fault_tolerance.replica_id=1")

    lighthouse = start("node1", "lighthouse", "scaletrain", "lighthouse", "--min-replicas", "2", "--bind",
                       "[::]:29510")
    group0 = start("node1", "group0", "scaletrain", "train", "--nproc", "1", "--max-restarts", "100",
                   "--log.run_dir=runs/ft/group0", *same, "--fault_tolerance.replica_id=0")
    first = group1("group1-first")
    try:
        run = here / "runs" / "ft" / "group1"
        wait_for(lambda: len(rows(run)) >= 5 or first.poll() is not None, 300,
                 lambda: f"group 1 logged no steps: {(here / 'group1-first.err').read_text()[-3000:]}")
        cluster.kill_node("node2")
        kill_step = rows(run)[-1]["step"]
        assert first.wait(60) == -9, (here / "group1-first.err").read_text()[-3000:]  # SIGKILLed, not ended
        again = group1("group1-again")
        codes = [group0.wait(600), again.wait(600)]
    finally:
        for p in (lighthouse, group0, first, *([again] if "again" in locals() else [])):
            if p.poll() is None:
                p.terminate()
                p.wait(60)
        cluster.start_node("node2")  # its slurmd, for the tests after this one
    errs = {n: (here / f"{n}.err").read_text()[-3000:] for n in ("group0", "group1-again")}
    assert codes == [0, 0], errs
    assert_ends_as_ft_local(here / "runs" / "ft", 1, kill_step)
