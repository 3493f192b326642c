"""Faults from the operating system, for real: a read-only folder, a full disk, a port already
taken, signals and SIGKILL sent to the launcher, a user error under --max-restarts, no C++
compiler for torch.compile, numbers too large for torch. Each ends in one `scaletrain:` line
with its exit code, no traceback, and nothing saved lost."""

from __future__ import annotations

import errno
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from scaletrain.cli import main
from scaletrain.errors import user_error_from_os

from conftest import MICRO, REPO, micro_overrides, mount_tmpfs, run_cli, run_group, unmount

pytestmark = pytest.mark.slow  # real processes, signals and mounts (left out of make test-fast)

MICRO_ARGS = [f"--{key}={value}" for key, value in MICRO.items()]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("scaletrain: error:")]


def assert_one_line(code: int, stderr: str, expected_code: int = 2, *parts: str) -> str:
    """Exit code, exactly one error line holding every part, no traceback."""
    assert code == expected_code, stderr
    assert "Traceback" not in stderr, stderr
    lines = error_lines(stderr)
    assert len(lines) == 1, stderr
    for part in parts:
        assert part in lines[0], (part, lines[0])
    return lines[0]


def run_main(argv: list[str], capsys) -> tuple[int, str]:
    code = main(argv)
    return code, capsys.readouterr().err


# --------------------------------------------------------------------------------------------
# Real faulty folders: read-only, full


def _refuses_writes(folder: Path) -> bool:
    try:
        (folder / "probe").mkdir()
    except OSError:
        return True
    (folder / "probe").rmdir()
    return False


@pytest.fixture
def read_only_dir(tmp_path):
    """A folder nothing can be written to: a read-only tmpfs as root (who ignores permissions),
    a chmod 0o555 folder otherwise."""
    folder = tmp_path / "read-only"
    mounted = mount_tmpfs(folder, "ro,size=1m")
    if not mounted:
        folder.mkdir(exist_ok=True)
        folder.chmod(0o555)
    try:
        if not _refuses_writes(folder):
            pytest.skip("no way to make a read-only folder here")
        yield folder
    finally:
        if mounted:
            unmount(folder)
        else:
            folder.chmod(0o755)


@pytest.fixture
def full_dir(tmp_path):
    """A real tmpfs with no space left."""
    folder = tmp_path / "full"
    if not mount_tmpfs(folder, "size=64k"):
        pytest.skip("cannot mount a small tmpfs here (needs root and mount rights)")
    try:
        fd = os.open(folder / "filler", os.O_WRONLY | os.O_CREAT)
        try:
            with pytest.raises(OSError) as e:
                while True:
                    os.write(fd, b"\0" * 4096)
        finally:
            os.close(fd)
        assert e.value.errno == errno.ENOSPC
        yield folder
    finally:
        unmount(folder)


READ_ONLY_REASONS = ("the file system is read-only", "permission denied")


def test_run_dir_in_a_read_only_folder_is_one_line(read_only_dir):
    r = run_cli("train", *MICRO_ARGS, "--train.steps=1", f"--log.run_dir={read_only_dir / 'run'}")
    line = assert_one_line(r.returncode, r.stderr, 2, "log.run_dir", str(read_only_dir))
    assert any(reason in line for reason in READ_ONLY_REASONS) and "choose another log.run_dir" in line, line


@pytest.mark.multiproc
def test_launcher_refuses_a_read_only_run_dir_before_starting_ranks(read_only_dir):
    r = run_cli("train", "--nproc", "2", *MICRO_ARGS, "--train.steps=1", f"--log.run_dir={read_only_dir / 'run'}")
    line = assert_one_line(r.returncode, r.stderr, 2, "log.run_dir", str(read_only_dir))
    assert "rank" not in line and any(reason in line for reason in READ_ONLY_REASONS), line


@pytest.mark.multiproc
def test_os_error_inside_the_workers_is_a_user_error():
    # /proc refuses a new folder (ENOENT, even for root); the launcher's check cannot tell
    # beforehand when it runs as root, so a rank meets it: still exit 2, never a traceback
    r = run_cli("train", "--nproc", "2", *MICRO_ARGS, "--train.steps=1", "--log.run_dir=/proc/scaletrain-run")
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    lines = error_lines(r.stderr)
    assert lines and all("log.run_dir: /proc" in line or "rank 1" in line for line in lines), r.stderr
    assert any(reason in r.stderr for reason in ("no such file or folder", "permission denied")), r.stderr


def test_full_disk_is_one_line_and_keeps_what_was_there(full_dir):
    before = sorted(p.name for p in full_dir.iterdir())
    r = run_cli("train", *MICRO_ARGS, "--train.steps=1", f"--log.run_dir={full_dir / 'run'}")
    assert_one_line(r.returncode, r.stderr, 2, "log.run_dir", "the disk is full", "free some space")
    assert set(before) <= {p.name for p in full_dir.iterdir()}  # nothing that was there is gone
    r = run_cli("train", "--nproc", "2", *MICRO_ARGS, "--train.steps=1", f"--log.run_dir={full_dir / 'run2'}")
    assert_one_line(r.returncode, r.stderr, 2, "log.run_dir", "the disk is full")


@pytest.mark.parametrize("code,reason", [
    (errno.EACCES, "permission denied"), (errno.EPERM, "operation not permitted"),
    (errno.EROFS, "read-only"), (errno.ENOSPC, "the disk is full"), (errno.EDQUOT, "quota"),
    (errno.ENOENT, "no such file or folder"), (errno.EEXIST, "already exists"),
    (errno.ENOTDIR, "not a folder"), (errno.EISDIR, "is a folder"), (errno.ENAMETOOLONG, "too long"),
])
def test_each_user_os_error_maps_to_one_line_naming_path_and_option(code, reason):
    path = Path("/srv/scaletrain/run/metrics.jsonl")
    error = user_error_from_os(OSError(code, os.strerror(code), str(path)), {"log.run_dir": path.parent})
    assert error is not None and len(error.lines) == 1
    assert error.lines[0].startswith(f"log.run_dir: {path}: ") and reason in error.lines[0], error.lines[0]
    assert error.exit_code == 2


def test_os_errors_that_are_ours_stay_tracebacks(tmp_path):
    assert user_error_from_os(OSError(errno.ECONNREFUSED, "refused")) is None  # not about a path
    assert user_error_from_os(OSError(errno.EACCES, "denied")) is None  # names no path
    installed = os.path.join(sys.prefix, "lib", "missing.py")
    assert user_error_from_os(OSError(errno.ENOENT, "missing", installed)) is None  # a broken install
    full = user_error_from_os(OSError(errno.ENOSPC, "full"), {"log.run_dir": tmp_path, "data.path": "d"},
                              outputs=("log.run_dir",))  # a write to an open file names no path
    assert full is not None and full.lines[0].startswith(f"log.run_dir {tmp_path}: the disk is full")


# --------------------------------------------------------------------------------------------
# export: where the file cannot go


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    from scaletrain.config import load_config
    from scaletrain.train.trainer import Trainer

    root = tmp_path_factory.mktemp("export")
    Trainer(load_config(None, {**MICRO, "train.steps": 1, "checkpoint.save_final": True,
                               "log.run_dir": str(root / "run")})).fit()
    return root / "run" / "checkpoints" / "step_00000001"


def _export(checkpoint: Path, out: Path, capsys) -> tuple[int, str]:
    return run_main(["export", str(checkpoint), "--out", str(out)], capsys)


def test_export_into_a_read_only_folder(checkpoint, read_only_dir, capsys):
    code, err = _export(checkpoint, read_only_dir / "m.safetensors", capsys)
    line = assert_one_line(code, err, 2, "--out", str(read_only_dir), "choose another --out")
    assert any(r in line for r in ("read-only", "not writable")), line
    assert list(read_only_dir.iterdir()) == []


def test_export_onto_a_folder_or_into_a_missing_one(checkpoint, tmp_path, capsys):
    target = tmp_path / "a-folder"
    target.mkdir()
    code, err = _export(checkpoint, target, capsys)
    assert_one_line(code, err, 2, f"--out {target} is a folder", "give a file name")
    assert list(target.iterdir()) == []
    # a missing parent folder is created, as `--format hf` creates its own (issue 23)
    code, err = _export(checkpoint, tmp_path / "missing" / "m.safetensors", capsys)
    assert code == 0, err
    assert [p.name for p in (tmp_path / "missing").iterdir()] == ["m.safetensors"]


def test_export_onto_a_full_disk_leaves_no_partial_file(checkpoint, full_dir, capsys):
    (full_dir / "filler").write_bytes(b"")  # room for the file's start, not for its 0.5 MB of weights
    before = {p.name for p in full_dir.iterdir()}
    code, err = _export(checkpoint, full_dir / "m.safetensors", capsys)
    assert_one_line(code, err, 2, "--out", "the disk is full")
    assert {p.name for p in full_dir.iterdir()} == before  # neither the file nor its partial copy


# --------------------------------------------------------------------------------------------
# a rendezvous port already taken


@pytest.fixture
def taken_port():
    with socket.socket() as s:  # another program listening on the port
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        yield s.getsockname()[1]


@pytest.mark.multiproc
@pytest.mark.parametrize("form", [["--node-rank", "0"], []], ids=["static", "c10d"])
def test_rendezvous_port_in_use_is_one_line(taken_port, form, tmp_path):
    # refused, not a rendezvous timeout: run_cli's 240 s end before the store's own 300 s (a busy
    # machine takes tens of seconds to start the CLI: no tighter wall-clock bound holds there)
    r = run_cli("train", "--nproc", "2", *form, "--rdzv-endpoint", f"127.0.0.1:{taken_port}", *MICRO_ARGS,
                "--train.steps=1", f"--log.run_dir={tmp_path / 'run'}", timeout=240)
    assert_one_line(r.returncode, r.stderr, 2, f"--rdzv-endpoint 127.0.0.1:{taken_port}",
                    f"port {taken_port} is already in use", "free port", "--rdzv-id")
    assert not (tmp_path / "run").exists()


# --------------------------------------------------------------------------------------------
# signals to the launcher


def _start_long_run(run_dir: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "scaletrain", "train", "--nproc", "2", *MICRO_ARGS,
                             "--train.steps=100000", "--checkpoint.every=100000", *extra, f"--log.run_dir={run_dir}"],
                            stderr=subprocess.PIPE, text=True, cwd=REPO, env=ENV)


def _wait_for_rows(launcher: subprocess.Popen, run_dir: Path, rows: int, timeout: float = 600) -> None:
    metrics, deadline = run_dir / "metrics.jsonl", time.time() + timeout
    while time.time() < deadline and launcher.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= rows:
            return
        time.sleep(0.05)
    launcher.kill()
    pytest.fail(f"the run did not log {rows} steps: {launcher.communicate()[1][-2000:]}")


@pytest.mark.multiproc
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_to_the_launcher_saves_a_checkpoint_and_exits_128_plus_it(tmp_path, sig):
    run_dir = tmp_path / "run"
    launcher = _start_long_run(run_dir)
    _wait_for_rows(launcher, run_dir, 3)
    launcher.send_signal(sig)
    err = launcher.communicate(timeout=90)[1]
    assert launcher.returncode == 128 + sig, err
    assert "Traceback" not in err and not error_lines(err), err
    stops = [line for line in err.splitlines() if line.startswith(f"scaletrain: stopped by {sig.name}")]
    assert len(stops) == 1, err
    saved = sorted((run_dir / "checkpoints").glob("step_*"))
    assert saved and str(saved[-1]) in stops[0], (stops, saved)


def _workers(launcher_pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(launcher_pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _running(pid: int) -> bool:
    try:  # a zombie waiting for its new parent to reap it runs no more
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


@pytest.mark.multiproc
def test_sigkilled_launcher_leaves_no_worker_running(tmp_path):
    launcher = _start_long_run(tmp_path / "run")
    _wait_for_rows(launcher, tmp_path / "run", 3)
    workers = _workers(launcher.pid)
    assert len(workers) == 2, workers
    launcher.kill()
    launcher.wait()
    deadline = time.time() + 60  # they go at once (parent-death signal); 60 s is for a busy machine
    while any(_running(p) for p in workers) and time.time() < deadline:
        time.sleep(0.05)
    left = [p for p in workers if _running(p)]
    for pid in left:  # do not leave them behind for the other tests
        os.kill(pid, signal.SIGKILL)
    assert not left, f"workers {left} outlived their launcher by 60 s"
    launcher.stderr.close()


# --------------------------------------------------------------------------------------------
# failures a restart would only repeat


@pytest.mark.multiproc
def test_user_error_in_the_workers_is_not_restarted(tmp_path):
    not_a_checkpoint = tmp_path / "empty"  # the launcher checks no checkpoint; each rank does
    not_a_checkpoint.mkdir()
    r = run_cli("train", "--nproc", "2", "--max-restarts", "2", *MICRO_ARGS, "--train.steps=2",
                f"--checkpoint.resume={not_a_checkpoint}", f"--log.run_dir={tmp_path / 'run'}")
    assert r.returncode == 2, r.stderr
    assert "restart" not in r.stderr, r.stderr  # rank 0 of a restarted group says "restart 1 of at most 2"
    assert "Traceback" not in r.stderr
    firsts = [line for line in error_lines(r.stderr) if "failed first: " in line]
    assert len(firsts) == 1 and "not a complete scaletrain checkpoint" in firsts[0], r.stderr
    reports = [line for line in error_lines(r.stderr) if "not a complete scaletrain checkpoint" in line]
    assert len(reports) <= 3, r.stderr  # each rank once, then the launcher's summary: it ran once


# --------------------------------------------------------------------------------------------
# torch.compile without a C++ compiler


def test_compile_without_a_compiler_is_refused_up_front(tmp_path):
    # the check is real: inductor itself finds no compiler with this environment
    probe = "from torch._inductor.cpp_builder import get_cpp_compiler; get_cpp_compiler()"
    inductor = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                              env={**ENV, "CXX": "/nonexistent/g++"})
    assert inductor.returncode != 0 and "InvalidCxxCompiler" in inductor.stderr, inductor.stderr
    r = run_cli("train", *MICRO_ARGS, "--train.steps=1", "--train.compile=true", f"--log.run_dir={tmp_path / 'run'}",
                env={"CXX": "/nonexistent/g++"})
    assert_one_line(r.returncode, r.stderr, 2, "train.compile=true", "CXX='/nonexistent/g++'",
                    "set train.compile=false", "install g++")
    assert not (tmp_path / "run").exists()


def test_compiler_check_passes_where_inductor_finds_one():
    import shutil

    import torch

    from scaletrain.parallel.checks import check_compiler

    if os.environ.get("CXX") is None and shutil.which("g++") is None:
        pytest.skip("no g++ here")
    check_compiler(torch.device("cpu"))  # no error


# --------------------------------------------------------------------------------------------
# numbers too large for torch


@pytest.mark.parametrize("override,message", [
    ("--train.seed=99999999999999999999999", "train.seed: 99999999999999999999999 must be at most 9223372036854775807"),
    ("--parallel.timeout_s=99999999999", "parallel.timeout_s: 99999999999 must be at most 604800"),
    ("--parallel.timeout_s=1e300", "parallel.timeout_s: expected an integer, got '1e300'"),
])
def test_numbers_too_large_for_torch_are_config_errors(override, message, tmp_path, capsys):
    code, err = run_main(["train", *MICRO_ARGS, override, f"--log.run_dir={tmp_path / 'run'}"], capsys)
    assert_one_line(code, err, 2, message)
    assert not (tmp_path / "run").exists()


@pytest.mark.multiproc
def test_the_largest_allowed_seed_and_timeout_run(tmp_path, capsys):
    code, err = run_main(["train", *MICRO_ARGS, "--train.steps=1", f"--train.seed={2**63 - 1}",
                          f"--log.run_dir={tmp_path / 'run'}"], capsys)
    assert code == 0, err
    # the largest timeout, through the product: the launcher starts 2 ranks, each joins the
    # process group with parallel.timeout_s (its first job's) and trains a step with the seed
    largest = {"train.steps": 1, "train.seed": 2**63 - 1, "parallel.timeout_s": 7 * 24 * 3600}
    code, results, err = run_group(2, [{"overrides": micro_overrides(tmp_path / "two", **largest)}], tmp_path)
    assert code == 0, err
    assert [r["step"] for r in results[0]["history"]] == [1]
