"""Launching: launcher flags and layouts refused before any rank starts, more ranks than cores
said in one line, and Ctrl-C while torch is still being imported."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import MICRO_ARGS, REPO, Case, assert_one_clear_line, train_args

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
