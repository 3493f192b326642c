"""Ctrl-C and SIGTERM at any moment of `scaletrain train`'s start-up, for real: each ends in its
documented exit code (3 before training started, 128 + the signal while the command line is read
or once a checkpoint is saved), with one line and no traceback, and none is ignored. A tracker
whose server does not answer holds the run up for log.tracker_wait_s at most, and a signal
meanwhile is not held up at all.

The moments are counted from when the program's own handler is in place (its SIGTERM shows as
caught in /proc/PID/status): before that, in the interpreter's own start-up (tens of ms), Python's
defaults apply, which no program can change. From there on the moments cover the imports of
numpy and torch, the config, the data, the model and the first steps."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import CLI_MICRO, REPO

pytestmark = pytest.mark.slow  # real processes and signals

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
# after the handler is in place; long enough under load to reach the end of torch's import and the data
MOMENTS = (0.0, 0.04, 0.1, 0.2, 0.35, 0.5, 0.7, 0.95, 1.25, 1.6, 2.0, 2.5)
GIVE_UP_S = 240  # far beyond any stop on a loaded machine: a run still going then ignored its signal


def _train(run_dir: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "scaletrain", "train", *CLI_MICRO, "--train.device=cpu",
                             "--train.steps=100000", "--checkpoint.every=100000", f"--log.run_dir={run_dir}", *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=REPO, env=ENV)


def _catches_sigterm(pid: int) -> bool:
    """Whether the process has a handler for SIGTERM (Python itself installs none)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    caught = next(int(line.split()[1], 16) for line in status.splitlines() if line.startswith("SigCgt:"))
    return bool(caught & (1 << (signal.SIGTERM - 1)))


def _handler_in_place(proc: subprocess.Popen) -> float:
    deadline = time.monotonic() + 120
    while not _catches_sigterm(proc.pid):
        assert proc.poll() is None and time.monotonic() < deadline, "the program never handled SIGTERM"
        time.sleep(0.002)
    return time.monotonic()


def _assert_stopped(proc: subprocess.Popen, sig: signal.Signals, run_dir: Path, what: str) -> int:
    """The documented end of a run signalled in its start-up; its exit code."""
    try:
        err = proc.communicate(timeout=GIVE_UP_S)[1]
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"{what}: still running {GIVE_UP_S} s after {sig.name}: the signal was ignored")
    code = proc.returncode
    assert code in (3, 128 + sig), f"{what}: exit code {code}\n{err}"
    assert "Traceback" not in err, f"{what}\n{err}"
    stops = [line for line in err.splitlines() if f"stopped by {sig.name}" in line]
    assert len(stops) == 1, f"{what}\n{err}"
    saved = sorted((run_dir / "checkpoints").glob("step_*"))
    if code == 3:  # nothing to save yet, and it says so
        assert stops[0] == (f"scaletrain: error: stopped by {sig.name} before training started: no checkpoint "
                            "was written") and not saved, f"{what}\n{err}"
    elif stops[0] == f"scaletrain: stopped by {sig.name}":  # while the command line was read: nothing began
        assert not saved, f"{what}\n{err}"
    elif "before the ranks saved a checkpoint" not in stops[0]:  # the launcher's ranks were still starting
        assert saved and str(saved[-1]) in stops[0], f"{what}\n{err}"  # the trainer finished its step and saved
    return code


def test_a_signal_at_any_moment_of_the_start_up_stops_the_run_in_one_line(tmp_path):
    """MOMENTS after the handler is in place, SIGINT and SIGTERM in turn; and, in each batch, one
    run signalled as its trainer takes the run folder (the hand-over to the trainer's handler)."""
    for batch, sig in ((MOMENTS[0::2], signal.SIGTERM), (MOMENTS[1::2], signal.SIGINT)):  # a few at once: 2 cores
        runs = []
        for moment in batch:
            run_dir = tmp_path / f"{moment}"
            proc = _train(run_dir)
            runs.append((moment, (signal.SIGINT, signal.SIGTERM)[len(runs) % 2], proc, run_dir,
                         _handler_in_place(proc)))
        for moment, each, proc, _, ready in sorted(runs, key=lambda r: r[4] + r[0]):
            time.sleep(max(0.0, ready + moment - time.monotonic()))
            proc.send_signal(each)
        handover = _train(tmp_path / f"handover-{sig.name}")
        while not (tmp_path / f"handover-{sig.name}").exists():
            assert handover.poll() is None, handover.communicate()[1]
            time.sleep(0.002)
        handover.send_signal(sig)
        for moment, each, proc, run_dir, _ in runs:
            _assert_stopped(proc, each, run_dir, f"{each.name} {moment} s after the handler")
        code = _assert_stopped(handover, sig, tmp_path / f"handover-{sig.name}", f"{sig.name} at the hand-over")
        assert code == 128 + sig  # the trainer had it: one step, saved


@pytest.mark.multiproc
def test_a_signal_in_the_launchers_and_the_ranks_start_up_stops_the_job_in_one_line(tmp_path):
    """One signal in the launcher's own start-up (torch's import, the settling), one when its
    ranks have just been started."""
    early, late = _train(tmp_path / "early", "--nproc=2"), _train(tmp_path / "late", "--nproc=2")
    time.sleep(max(0.0, _handler_in_place(early) + 0.3 - time.monotonic()))
    early.send_signal(signal.SIGINT)
    deadline = time.monotonic() + 120
    while not subprocess.run(["pgrep", "-P", str(late.pid)], capture_output=True).stdout:
        assert late.poll() is None and time.monotonic() < deadline, "the launcher started no rank"
        time.sleep(0.01)
    time.sleep(0.3)
    late.send_signal(signal.SIGTERM)
    _assert_stopped(early, signal.SIGINT, tmp_path / "early", "SIGINT to the launcher as it started")
    _assert_stopped(late, signal.SIGTERM, tmp_path / "late", "SIGTERM to the launcher as its ranks started")


@pytest.mark.skipif(importlib.util.find_spec("mlflow") is None, reason="mlflow is not installed")
def test_a_tracker_that_cannot_connect_holds_the_run_up_for_its_bound_and_signals_not_at_all(tmp_path):
    refused = ["--log.mlflow=startup", "--log.mlflow_uri=http://127.0.0.1:9"]  # nothing listens on port 9
    bounded = subprocess.Popen([sys.executable, "-m", "scaletrain", "train", *CLI_MICRO, "--train.device=cpu",
                                "--train.steps=2", f"--log.run_dir={tmp_path / 'bounded'}", *refused,
                                "--log.tracker_wait_s=2"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               text=True, cwd=REPO, env=ENV)
    waiting = _train(tmp_path / "waiting", *refused, "--log.tracker_wait_s=600")
    for line in waiting.stderr:  # the run's lines up to its trackers' start
        if line.startswith("data:"):
            break
    time.sleep(1.0)  # MLflow's client is being imported, or retrying
    waiting.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    rest = waiting.communicate(timeout=120)[1]
    assert time.monotonic() - sent < 60, "the stop waited for the tracker"  # it waited 238 s for MLflow
    assert waiting.returncode == 143, rest
    assert "log.mlflow: the tracker could not start (TimeoutError: the run was stopped by a signal" in rest, rest
    assert "Traceback" not in rest, rest

    err = bounded.communicate(timeout=180)[1]
    assert bounded.returncode == 0, err
    lines = [line for line in err.splitlines() if line.startswith("log.mlflow:")]
    assert lines == ["log.mlflow: the tracker could not start (TimeoutError: no answer within "
                     "log.tracker_wait_s=2 s); this run logs to metrics.jsonl without it"], err
    assert len((tmp_path / "bounded" / "metrics.jsonl").read_text().splitlines()) == 2
