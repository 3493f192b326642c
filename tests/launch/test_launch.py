"""The launcher: `scaletrain train --nproc N`, `torchrun -m scaletrain train`, failures, refusals."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import (
    MICRO_ARGS,
    REPO,
    Case,
    assert_one_clear_line,
    micro_overrides,
    read_metrics,
    run_cli,
    run_group,
    run_here,
    train_args,
)

ARGS = ["--model.dim=64", "--model.n_layers=2", "--data.seq_len=32", "--train.global_batch=8",
        "--train.steps=3", "--log.every=1", "--log.tensorboard=false", "--train.sample_tokens=8"]


@pytest.mark.multiproc
def test_nproc_launches_ranks_and_only_rank0_prints(tmp_path):
    r = run_cli("train", "--nproc", "2", "--parallel.zero=2", *ARGS, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("step 3/3") == 1  # one progress line per step: rank 0 alone prints
    assert "layout: 2 rank(s)" in r.stderr and "ZeRO-2" in r.stderr and "backend gloo" in r.stderr
    assert r.stderr.count("sample: ") == 1
    assert "shared by the 2 ranks on it" in r.stderr  # MFU against each rank's share of the CPU (issue 23)
    runs = list((tmp_path / "runs").iterdir())  # the default run folder, shared by both ranks
    assert len(runs) == 1
    assert [row["step"] for row in read_metrics(runs[0])] == [1, 2, 3]
    assert "Traceback" not in r.stderr


@pytest.mark.multiproc
def test_torchrun_runs_the_same_workers(tmp_path):
    """torchrun starts the workers `scaletrain train --nproc` starts: with parallel.layout=auto rank 0
    chooses the layout (data parallel over the 2 ranks) and every rank follows."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "scaletrain", "train", *ARGS, "--parallel.layout=auto", f"--log.run_dir={tmp_path / 'run'}"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert "parallel.layout=auto chose dp 2" in r.stderr and "layout: 2 rank(s)" in r.stderr, r.stderr
    assert [row["step"] for row in read_metrics(tmp_path / "run")] == [1, 2, 3]


@pytest.mark.multiproc
def test_failing_rank_is_reported_first_in_a_few_lines(tmp_path):
    job = {"overrides": micro_overrides(tmp_path / "run", **{"train.steps": 3}),
           "fault": {"kind": "raise_at_start", "rank": 1, "message": "disk on fire"}}
    code, _, err = run_group(2, [job], tmp_path)
    assert code == 1
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines[0].startswith("scaletrain: error: rank 1: RuntimeError: disk on fire"), err
    assert "rank 1 failed first: RuntimeError: disk on fire" in err
    assert "Traceback" not in err and len(lines) <= 4, err


@pytest.mark.multiproc
@pytest.mark.parametrize("args,message", [
    (["--nproc", "3", "--parallel.dp_replicate=2"], "needs a multiple of dp_replicate × tp × pp = 2"),
    (["--nproc", "2", "--parallel.dp_shard=4"], "but the world has 2"),
    (["--nproc", "2", "--parallel.zero=3", "--parallel.dp_replicate=2"], "parallel.zero=3 shards model states"),
    (["--nproc", "2", "--train.device=cuda"], "no CUDA device is visible"),
    (["--parallel.zero=1"], "there is only 1"),
    (["--nproc", "2", "--train.global_batch=7"], "not divisible"),
    (["--nnodes", "2", "--nproc", "2"], "needs --rdzv-endpoint"),
])
def test_impossible_requests_are_refused(args, message):
    # the CLI refuses these before it starts a rank: its main in this process (no interpreter start-up each)
    r = run_here("train", *args, "--train.steps=1")
    assert r.returncode == 2, r.stderr
    assert message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.mark.multiproc
def test_fixed_node_rank_rendezvous(tmp_path):
    import socket

    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = run_cli("train", "--nproc", "2", "--nnodes", "1", "--node-rank", "0", "--rdzv-endpoint",
                f"127.0.0.1:{port}", *ARGS, f"--log.run_dir={tmp_path / 'run'}")
    assert r.returncode == 0, r.stderr
    assert [row["step"] for row in read_metrics(tmp_path / "run")] == [1, 2, 3]


@pytest.mark.multiproc
def test_auto_layout(tmp_path):
    r = run_here("train", "--parallel.layout=auto", *ARGS, f"--log.run_dir={tmp_path / 'one'}")  # one process
    assert r.returncode == 0, r.stderr
    assert "parallel.layout=auto chose" in r.stderr
    r = run_cli("train", "--nproc", "2", "--parallel.layout=auto", *ARGS, f"--log.run_dir={tmp_path / 'two'}")
    assert r.returncode == 0, r.stderr
    assert "parallel.layout=auto chose" in r.stderr and "layout: 2 rank(s)" in r.stderr
    # (under torchrun: test_torchrun_runs_the_same_workers)
    r = run_here("train", "--parallel.layout=auto", "--parallel.tp=2", "--train.steps=1")
    assert r.returncode == 2 and "leave parallel.tp at their defaults" in r.stderr


@pytest.mark.multiproc
def test_a_stop_signal_while_a_failing_rank_records_its_error_is_absorbed(tmp_path):
    """When a rank fails, the launcher stops the others with SIGTERM; one that is itself failing
    (recording its error) must finish its report, not print a traceback of the signal (seen
    under load: a collective failed on rank 0 as rank 1 died, and the SIGTERM landed in rank
    0's record_worker_error)."""
    import subprocess
    import sys

    probe = tmp_path / "probe.py"
    probe.write_text(
        "import os, signal\n"
        "from scaletrain.launch import launcher, worker\n"
        "record = launcher.record_worker_error\n"
        "def recording(e, rank):\n"
        "    os.kill(os.getpid(), signal.SIGTERM)  # the launcher stopping the ranks, mid-report\n"
        "    sum(range(100000))\n"
        "    return record(e, rank)\n"
        "launcher.record_worker_error = recording\n"
        "def task():\n"
        "    raise RuntimeError('disk on fire')\n"
        "worker.run(task)\n")
    r = subprocess.run([sys.executable, str(probe)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert "RuntimeError: disk on fire" in r.stderr


# --------------------------------------------------------------------------------------------------
# From test_launch_errors.py (merged here):
#
# Launching: launcher flags and layouts refused before any rank starts, more ranks than cores
# said in one line, and Ctrl-C while torch is still being imported.

BAD_INPUT = [
    Case("nproc-zero", train_args("--nproc", "0"), ("--nproc must be at least 1, got 0",)),
    Case("nproc-negative", train_args("--nproc", "-1"), ("--nproc must be at least 1, got -1",)),
    Case("nproc-not-a-number", train_args("--nproc", "two"), ("argument --nproc: invalid int value: 'two'",)),
    Case("nnodes-zero", train_args("--nproc", "1", "--nnodes", "0"), ("--nnodes must be at least 1, got 0",)),
    Case("nnodes-without-endpoint", train_args("--nproc", "1", "--nnodes", "2"),
         ("--nnodes > 1 needs --rdzv-endpoint",)),
]


@pytest.mark.parametrize("case", BAD_INPUT, ids=[c.id for c in BAD_INPUT])
def test_bad_input_gives_one_clear_line(case: Case, workdir: Path, capsys):
    assert_one_clear_line(case, workdir, capsys)


def test_layout_error_from_the_real_command_starts_no_rank(tmp_path):
    """`python -m scaletrain` exits 2 on a world-size mismatch, before the launcher runs."""
    r = subprocess.run([sys.executable, "-m", "scaletrain", "train", *MICRO_ARGS, "--nproc", "2",
                        "--parallel.dp_shard=4", f"--log.run_dir={tmp_path / 'run'}"],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [
        "scaletrain: error: the layout pp × dp_replicate × dp_shard × tp = 1 × 1 × 4 × 1 = 4 ranks, but the world "
        "has 2; set parallel.dp_shard=-1 to use the remaining ranks, or launch 4 processes"]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_more_ranks_than_cores_is_said_in_one_line(tmp_path):
    """On one core, --nproc 2 oversubscribes it: one line says so, and the job runs."""
    r = subprocess.run([sys.executable, "-m", "scaletrain", "train", *MICRO_ARGS, "--train.steps=1", "--nproc", "2",
                        f"--log.run_dir={tmp_path / 'run'}"], capture_output=True, text=True, timeout=300, cwd=REPO,
                       env={**os.environ, "OMP_NUM_THREADS": "1"}, preexec_fn=lambda: os.sched_setaffinity(0, {0}))
    assert r.returncode == 0, r.stderr
    notes = [x for x in r.stderr.splitlines() if "oversubscribed" in x]
    assert notes == ["scaletrain: 2 ranks on 1 CPU core(s): oversubscribed, the ranks take turns on the cores and "
                     "each step is slower than with --nproc 1"], r.stderr


@pytest.mark.slow
def test_ctrl_c_while_torch_is_imported_is_one_line(tmp_path):
    """A SIGINT that lands in `import torch` (seconds on a cold start): one line, exit 130."""
    fake = tmp_path / "slow" / "torch"
    fake.mkdir(parents=True)
    started = tmp_path / "importing"
    (fake / "__init__.py").write_text(f"import pathlib, time\npathlib.Path({str(started)!r}).touch()\ntime.sleep(60)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "slow"), str(REPO / "src")])}
    proc = subprocess.Popen([sys.executable, "-m", "scaletrain", "train", "--train.steps=1"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while not started.exists() and time.time() < deadline:
        time.sleep(0.05)
    assert started.exists(), proc.stderr.read() if proc.poll() is not None else "torch was never imported"
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and err.strip().splitlines() == ["scaletrain: stopped by SIGINT"], err
