"""Shared helpers: a micro config that trains in milliseconds per step on a CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# keep the tests on few threads: the suite runs beside other work on 2 cores
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)

from scaletrain.config import load_config  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

MICRO = {
    "model.dim": 64, "model.n_layers": 2, "model.n_heads": 4, "model.max_seq_len": 32,
    "data.seq_len": 32, "train.global_batch": 8, "train.steps": 10, "train.device": "cpu",
    "log.every": 1, "log.tensorboard": False, "log.progress": "off", "checkpoint.save_final": False,
    "optim.warmup_steps": 2, "train.sample_tokens": 0,
}


def micro_cfg(tmp_path: Path, **overrides):
    """A tiny, fast config writing into tmp_path; overrides use dotted names."""
    values = {**MICRO, "log.run_dir": str(tmp_path / "run"), **overrides}
    return load_config(None, values)


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def run_here(*args: str):
    """`scaletrain ARGS` through the CLI's main in this process, from the repository (no
    interpreter start-up, ~3 s saved): for commands that start no ranks and need no fresh
    process. Returns a CompletedProcess like run_cli; an unexpected exception propagates."""
    import contextlib
    import io

    from scaletrain import cli

    out, err, before = io.StringIO(), io.StringIO(), os.getcwd()
    os.chdir(REPO)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = cli.main(list(args))
    finally:
        os.chdir(before)
    return subprocess.CompletedProcess(["scaletrain", *args], code, out.getvalue(), err.getvalue())


def run_cli(*args: str, timeout: float = 300, env: dict | None = None, cwd: Path | None = None):
    """Run `python -m scaletrain ARGS` in a fresh process; returns CompletedProcess."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "scaletrain", *args], capture_output=True, text=True,
                          timeout=timeout, env=full_env, cwd=cwd or REPO)


@pytest.fixture
def micro(tmp_path):
    return lambda **kw: micro_cfg(tmp_path, **kw)


def run_group(nproc: int, jobs: list[dict], tmp_path: Path, timeout: float = 600) -> tuple[int, list | None, str]:
    """Run `jobs` (dicts with "overrides", optional "fault") in one group of `nproc` real
    processes started by scaletrain's launcher; returns (exit code, rank 0's results, stderr)."""
    spec = tmp_path / f"spec-{len(list(tmp_path.glob('spec-*')))}.json"
    out = spec.with_suffix(".out.json")
    spec.write_text(json.dumps({"jobs": jobs, "out": str(out)}))
    code, err = launch_here("dist_worker:main", [str(spec)], nproc, timeout)
    results = json.loads(out.read_text()) if out.exists() else None
    return code, results, err


def launch_here(task: str, args: list[str], nproc: int, timeout: float = 600) -> tuple[int, str]:
    """scaletrain's launcher called from this process (torch is imported already: no extra
    interpreter start-up per group), its stderr and its ranks' captured; returns (exit code,
    stderr). Past `timeout` the launcher gets SIGTERM, as from a user: the ranks stop and it
    returns 143."""
    import signal
    import tempfile
    import threading

    from scaletrain.launcher import launch

    with tempfile.TemporaryFile(mode="w+") as captured:
        sys.stderr.flush()
        saved_fd, saved_stream = os.dup(2), sys.stderr
        os.dup2(captured.fileno(), 2)
        sys.stderr = os.fdopen(os.dup(2), "w", buffering=1)
        timer = threading.Timer(timeout, os.kill, (os.getpid(), signal.SIGTERM))
        timer.start()
        try:
            code = launch(task, args, nproc=nproc, pythonpath=(str(REPO / "tests"),))
        finally:
            timer.cancel()
            sys.stderr.close()
            sys.stderr = saved_stream
            os.dup2(saved_fd, 2)
            os.close(saved_fd)
        captured.seek(0)
        return code, captured.read()


def mount_tmpfs(path: Path, options: str) -> bool:
    """Mount a tmpfs with mount OPTIONS (e.g. "size=64k", "ro,size=1m") at `path`, for tests
    of real full or read-only disks; False where this user cannot mount (not root)."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                          capture_output=True).returncode == 0


def unmount(path: Path) -> None:
    """Undo mount_tmpfs; a file still open there (a lock, a log) detaches it instead."""
    if subprocess.run(["umount", str(path)], capture_output=True).returncode:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def micro_overrides(run_dir: Path, **overrides) -> dict:
    return {**MICRO, "log.run_dir": str(run_dir), **overrides}


def forge_checksums(checkpoint: Path) -> None:
    """Rewrite a checkpoint's recorded checksums to match its files, as an attacker who can
    write the folder can: what then stops a malicious file is the loader, not the checksum."""
    import hashlib

    f = Path(checkpoint) / "trainer.json"
    state = json.loads(f.read_text())
    for name in state["files"]:
        data = (Path(checkpoint) / name).read_bytes()
        state["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    f.write_text(json.dumps(state))
