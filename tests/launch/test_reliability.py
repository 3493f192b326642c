"""Crashes and hangs: elastic restart, checkpoints that survive kills and full disks, ranks
that stop participating, the rendezvous's addresses."""

from __future__ import annotations

import errno
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from scaletrain.cli import main
from scaletrain.errors import CheckpointError, user_error_from_os
from scaletrain.train import checkpoint as ckpt
from scaletrain.train.trainer import Trainer

from conftest import (
    MICRO,
    REPO,
    assert_same_run,
    micro_cfg,
    micro_overrides,
    mount_tmpfs,
    read_metrics,
    run_cli,
    run_group,
    run_here,
    unmount,
)

pytestmark = pytest.mark.slow  # real processes, signals and mounts (left out of make test-fast)

TRAIN = ["--model.dim=64", "--model.n_layers=2", "--data.seq_len=32", "--train.global_batch=8", "--log.every=1",
         "--log.progress=off", "--log.tensorboard=false", "--train.sample_tokens=0"]


def _rank_of(pid: int) -> int | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    found = [e for e in env if e.startswith(b"RANK=")]
    return int(found[0][5:]) if found else None


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _rows(run: Path) -> int:
    f = run / "metrics.jsonl"
    return len(f.read_text().splitlines()) if f.exists() else 0


@pytest.mark.multiproc
def test_sigkilled_worker_restarts_the_group_which_resumes_exactly(tmp_path):
    # killed past step 25 (55 steps before the end), 15 steps after the checkpoint at 20 and before the next
    steps = ["--train.steps=80", "--checkpoint.every=20"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "scaletrain", "train", "--nproc", "2", *TRAIN, *steps]
    launcher = subprocess.Popen([*cmd, "--max-restarts", "1", f"--log.run_dir={tmp_path / 'killed'}"],
                                stderr=subprocess.PIPE, text=True, cwd=REPO, env=env)
    deadline = time.time() + 600  # an event, not a time: the bound only ends a broken run
    while _rows(tmp_path / "killed") < 25 and time.time() < deadline and launcher.poll() is None:
        time.sleep(0.02)
    killed_at = _rows(tmp_path / "killed")
    victim = [p for p in _children(launcher.pid) if _rank_of(p) == 1]
    assert victim and killed_at < 80, "the run ended before the kill"
    os.kill(victim[0], signal.SIGKILL)
    err = launcher.communicate(timeout=180)[1]
    assert launcher.returncode == 0, err
    assert "restart 1 of at most 1: a rank failed" in err and "resumed from" in err, err
    resumed_at = int(err.split("resumed from ")[1].split(" at step ")[1].split()[0])
    assert resumed_at < killed_at + 2  # a checkpoint from before the kill

    # the uninterrupted run of the same config on two forked ranks (the launcher is not its subject)
    clean = {a[2:].split("=", 1)[0]: a.split("=", 1)[1] for a in [*TRAIN, *steps]}
    code, _, err = run_group(2, [{"overrides": {**clean, "log.run_dir": str(tmp_path / "clean")}}], tmp_path)
    assert code == 0, err
    killed, reference = read_metrics(tmp_path / "killed"), read_metrics(tmp_path / "clean")
    assert [r["step"] for r in killed] == list(range(1, 81))  # the re-done steps replaced, not duplicated
    assert [(r["step"], r["loss"], r["grad_norm"]) for r in killed] == \
        [(r["step"], r["loss"], r["grad_norm"]) for r in reference]  # every step, every bit


STUCK_SURVIVOR = """
import os, signal, threading, time
def mark(name):  # whole or not at all: the SIGKILL may come between opening the file and writing it
    tmp = os.path.join(os.environ["MARKS"], "." + name)
    with open(tmp, "w") as f:
        f.write(repr(time.time()))
    os.replace(tmp, os.path.join(os.environ["MARKS"], name))
def hook(trainer):
    real = trainer.train_step
    def step(batches):
        if trainer.state.step + 1 == 3 and trainer.rt.rank == 1:
            mark("killed")
            os.kill(os.getpid(), signal.SIGKILL)
        if trainer.state.step + 1 == 3:  # rank 0: stuck where no signal reaches Python (a wait in C++)
            signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT, signal.SIGTERM])
            for _ in range(1200):
                mark("alive")
                time.sleep(0.1)
        return real(batches)
    trainer.train_step = step
    return trainer
"""


@pytest.mark.multiproc
def test_the_ranks_left_after_a_rank_died_are_stopped_within_a_few_seconds(tmp_path):
    """Rank 1 SIGKILLed at step 3 while rank 0 waits where SIGTERM cannot reach it (a collective, a
    commit vote in C++): the launcher SIGKILLs rank 0 FAILED_GROUP_GRACE_S after its SIGTERM, not
    torch's 30 s (a save is a collective: with a peer gone, no rank can make one), so the group restarts
    or the job ends seconds after the failure. A stop by the user's signal keeps the whole grace
    (test_signal_to_the_launcher_saves_a_checkpoint_and_exits_128_plus_it)."""
    from scaletrain.launch.launcher import FAILED_GROUP_GRACE_S

    (tmp_path / "stuck_survivor.py").write_text(STUCK_SURVIVOR)
    path = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    r = run_cli("train", "--nproc", "2", *TRAIN, "--train.steps=6", f"--log.run_dir={tmp_path / 'run'}",
                "--max-restarts=0", "--rank-hook=stuck_survivor:hook",
                env={"PYTHONPATH": path, "MARKS": str(tmp_path)})
    assert r.returncode != 0 and "rank 1" in r.stderr, r.stderr
    killed, last_alive = (float((tmp_path / name).read_text()) for name in ("killed", "alive"))
    # the agent notices within a few tenths, then the grace; 30 s: the grace of torch's default
    assert last_alive - killed < FAILED_GROUP_GRACE_S + 10 < 30, (last_alive - killed, r.stderr[-2000:])


@pytest.mark.multiproc
def test_a_rank_that_stops_participating_fails_the_job_within_the_timeout(tmp_path):
    # rank 1 issues step 3's gradient reduction, then sleeps instead of reaching the next collective
    job = {"overrides": micro_overrides(tmp_path / "run", **{"train.steps": 6, "parallel.zero": 3,
                                                             "parallel.timeout_s": 4}),
           "fault": {"kind": "sleep_in_step", "rank": 1, "step": 3, "seconds": 300}}
    t0 = time.time()
    code, _, err = run_group(2, [job], tmp_path)
    took = time.time() - t0
    assert code == 3, err
    first = err.strip().splitlines()[0]
    assert first.startswith("scaletrain: error: rank 0: step 3: rank 1 stopped participating: a collective did "
                            "not complete within parallel.timeout_s=4 s "
                            "(rank 0 waited in the gradient-norm all-reduce"), err
    assert "rank 1 last reported step 3, forward/backward (it issued" in first
    assert "Traceback" not in err
    # not the 300 s the rank sleeps: the 4 s timeout, the diagnosis and two ranks' start-up, which
    # a busy machine stretches to tens of seconds: the bound leaves them room, 100 s short of the sleep
    assert took < 200, took


# --------------------------------------------------------------------------------------------
# checkpoints


def _save_forever(trainer: Trainer, first_step: int) -> None:
    """In a forked child: save checkpoints of successive steps, weights marked with the step."""
    step = first_step
    while True:
        with torch.no_grad():
            for _, p in trainer.pm.optim_params:
                p.fill_(step)
        trainer.state.step = step
        trainer.save()
        step += 1


def _saved_step(folder) -> int:
    """The step of the newest complete checkpoint (-1 if it vanished while read: keep=2 pruning)."""
    try:
        return ckpt.read_trainer_state(ckpt.latest_checkpoint(folder))["step"]
    except (OSError, TypeError):
        return -1


def test_twenty_five_random_kills_during_saves_never_lose_the_last_checkpoint(tmp_path):
    cfg = micro_cfg(tmp_path, **{"checkpoint.keep": 2, "train.steps": 1})
    trainer = Trainer(cfg)
    trainer.fit()  # one real step, so the optimizer has state to save
    trainer.save()
    folder = trainer.folder.ckpt_dir
    rng = random.Random(0)
    last = 1
    for kill in range(25):
        pid = os.fork()
        if pid == 0:  # the child: dies by SIGKILL somewhere inside a save
            try:
                _save_forever(trainer, last + 1)
            finally:
                os._exit(1)
        # once the child has completed a save (on a busy machine a save may take longer than the
        # whole random wait), kill it at a random moment of the saves that follow
        deadline = time.time() + 600  # an event, not a time: the bound only ends a broken run
        while time.time() < deadline and _saved_step(folder) <= last:
            time.sleep(0.01)
        time.sleep(rng.uniform(0.0, 0.5))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        latest = ckpt.latest_checkpoint(folder)
        assert latest is not None, kill
        step = ckpt.read_trainer_state(latest)["step"]
        assert step >= last and latest.name == f"step_{step:08d}"
        tensors = trainer.checkpoint_tensors()
        ckpt.load_tensors(latest, tensors)  # the whole checkpoint reads back, with the step's values
        assert all(torch.all(p == step) for p in tensors["model"].values()), (kill, step)
        last = step
    assert last >= 26  # the saves made progress between kills
    leftovers = [p.name for p in folder.iterdir() if p.name.startswith(".")]
    assert len(leftovers) <= 2  # the killed save's partial folder at most (the next save clears it)
    resumed = Trainer(micro_cfg(tmp_path, **{"checkpoint.resume": "auto", "train.steps": last + 2}))
    assert resumed.step == last  # the newest complete checkpoint, never one of the partial saves left aside
    print(f"kills survived: 25, last complete step {last}, partial folders left aside: {leftovers}")


def test_full_disk_during_save_is_one_clear_error_and_keeps_the_last_checkpoint(tmp_path):
    disk = tmp_path / "small-disk"
    if not mount_tmpfs(disk, "size=3m"):
        pytest.skip("cannot mount a small tmpfs here (needs root and mount rights)")
    try:
        cfg = micro_cfg(tmp_path, **{"checkpoint.dir": str(disk), "checkpoint.keep": 5, "checkpoint.every": 1,
                                     "train.steps": 10})
        trainer = Trainer(cfg)
        with pytest.raises(CheckpointError) as e:
            trainer.fit()
        saved = ckpt.complete_checkpoints(disk)
        assert saved, "not even one checkpoint fitted"
        msg = str(e.value)
        assert f"saving checkpoint step {len(saved) + 1} to {disk} failed: the disk is full; the last complete " \
               f"checkpoint {saved[-1]} is intact" == msg
        assert not [p for p in disk.iterdir() if p.name.startswith(".")]  # the partial save was removed
        resumed = Trainer(micro_cfg(tmp_path, **{"checkpoint.dir": str(disk), "checkpoint.resume": "auto",
                                                 "train.steps": 10}))
        assert resumed.step == len(saved)
    finally:
        unmount(disk)


def test_full_disk_reported_where_tmpfs_is_unavailable(tmp_path, monkeypatch):
    import errno

    cfg = micro_cfg(tmp_path, **{"checkpoint.every": 2, "train.steps": 6})
    trainer = Trainer(cfg)
    real = ckpt._write_json
    calls = {"n": 0}

    def full(path, data):
        calls["n"] += 1
        if calls["n"] > 2:  # the first save (rng + trainer.json) fits, the second does not
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path, data)

    monkeypatch.setattr(ckpt, "_write_json", full)
    with pytest.raises(CheckpointError, match=r"step 4 .* failed: the disk is full; the last complete checkpoint "
                                              r".*step_00000002 is intact"):
        trainer.fit()
    assert [p.name for p in trainer.folder.ckpt_dir.iterdir()] == ["step_00000002"]


# --------------------------------------------------------------------------------------------
# the rendezvous listens where it is told


def _address(hex_addr: str, v6: bool) -> str:
    import ipaddress
    import struct

    host, port = hex_addr.split(":")
    raw = bytes.fromhex(host)
    if v6:
        raw = b"".join(struct.pack("<I", struct.unpack(">I", raw[i:i + 4])[0]) for i in range(0, 16, 4))
        ip = ipaddress.IPv6Address(raw)
        ip = ip.ipv4_mapped or ip
    else:
        ip = ipaddress.IPv4Address(struct.pack("<I", struct.unpack(">I", raw)[0]))
    return f"{ip}:{int(port, 16)}"


# --------------------------------------------------------------------------------------------
# several hosts: two network namespaces joined by a veth pair


@pytest.fixture
def two_hosts():
    """Two network namespaces, 10.77.0.1 and 10.77.0.2, joined by a veth pair."""
    tag = f"st{os.getpid() % 100000}"
    names = [f"{tag}n0", f"{tag}n1"]
    script = [
        f"ip netns add {names[0]}", f"ip netns add {names[1]}",
        f"ip link add {tag}a type veth peer name {tag}b",
        f"ip link set {tag}a netns {names[0]}", f"ip link set {tag}b netns {names[1]}",
        f"ip -n {names[0]} addr add 10.77.0.1/24 dev {tag}a", f"ip -n {names[1]} addr add 10.77.0.2/24 dev {tag}b",
        f"ip -n {names[0]} link set {tag}a up", f"ip -n {names[1]} link set {tag}b up",
        f"ip -n {names[0]} link set lo up", f"ip -n {names[1]} link set lo up",
    ]
    try:
        for line in script:
            r = subprocess.run(line.split(), capture_output=True, text=True)
            if r.returncode != 0:
                pytest.skip(f"cannot make network namespaces here ({line!r}: {r.stderr.strip() or r.returncode})")
        yield names
    except FileNotFoundError:
        pytest.skip("cannot make network namespaces here: the `ip` tool is missing")
    finally:
        for name in names:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


def _listening(pids: list[int]) -> set[str]:
    """host:port of every listening TCP socket that one of `pids` holds (read from the sockets
    tables of the processes' own network namespace)."""
    inodes, tables = set(), []
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
            tables += [(Path(f"/proc/{pid}/net/tcp").read_text(), False),
                       (Path(f"/proc/{pid}/net/tcp6").read_text(), True)]
        except OSError:
            continue
    found = set()
    for text, v6 in tables:
        for line in text.splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:
                found.add(_address(f[1], v6))
    return found


@pytest.mark.multiproc
def test_two_hosts_with_two_ranks_each_train_like_one_process(tmp_path, two_hosts):
    layout = ["--parallel.dp_replicate=2", "--parallel.dp_shard=2", "--parallel.zero=3"]  # HSDP across the hosts
    args = [f"--{k}={v}" for k, v in micro_overrides(tmp_path / "run", **{"train.steps": 20}).items()] + layout
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("GLOO_SOCKET_IFNAME", None)  # the launcher finds the interface that reaches the rendezvous
    nodes = [subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-m", "scaletrain", "train", "--nproc", "2",
                               "--nnodes", "2", "--node-rank", str(i), "--rdzv-endpoint", "10.77.0.1:29577", *args],
                              stderr=subprocess.PIPE, text=True, cwd=REPO, env=env)
             for i, ns in enumerate(two_hosts)]
    deadline = time.time() + 600  # an event, not a time: the bound only ends a broken run
    while _rows(tmp_path / "run") < 3 and time.time() < deadline and nodes[0].poll() is None:
        time.sleep(0.05)
    # node 0's launcher (rendezvous store) and workers: every listener on the address it was told
    host0 = [nodes[0].pid, *_children(nodes[0].pid)]
    host0 += [c for p in host0[1:] for c in _children(p)]
    listening = _listening(host0)
    errs = [n.communicate(timeout=180)[1] for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], errs
    assert "layout: 4 rank(s) = pp 1 × dp_replicate 2 × dp_shard 2 × tp 1" in errs[0], errs[0]
    assert listening and all(a.startswith("10.77.0.1:") for a in listening), listening

    one = Trainer(micro_cfg(tmp_path / "one", **{"train.steps": 20})).fit()["history"]
    four = read_metrics(tmp_path / "run")
    # reduction order differs: fp32 noise; every step's loss and gradient norm
    # 20 steps; two hosts reduce in another order (seen 1.3e-4)
    assert_same_run(four, one, steps=20, tol=(1e-5, 1e-3), what="2 nodes x 2 ranks, HSDP")


def test_a_restarted_rank_that_is_waited_for_says_the_step_it_resumes(tmp_path):
    """A rank restarted after a failure (torchrun's restart) loads the last checkpoint; while it
    does, a peer that times out waiting for it names the step it resumes and what it is doing,
    not "step 0, start-up" (a worker that had done 7 steps was reported so)."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from scaletrain.train.health import Health
    from scaletrain.watchdog import Progress, lagging

    store = dist.HashStore()
    peer, restarted = Progress(store, 0, interval=0.02), Progress(store, 1)
    peer.step, peer.phase = 7, "forward/backward"
    health = Health.__new__(Health)  # only what resuming touches: the rank's progress
    health.rt, health.phase, health.current_step = SimpleNamespace(progress=restarted), "start-up", 0
    health.resuming(7)
    restarted.publish()  # then it stops publishing (loading, or frozen)
    peer.start()
    try:
        found = lagging(store, 2, interval=0.4, timeout_s=5.0)  # a second between reads: the peer refreshes
    finally:
        peer.stop()
    assert [str(f) for f in found] == ["rank 1 last reported step 7, start-up, resuming from the checkpoint of "
                                       "step 7 (it stopped reporting: dead or frozen)"]


# --------------------------------------------------------------------------------------------------
# From test_os_faults.py (merged here):
#
# Faults from the operating system, for real: a read-only folder, a full disk, a port already
# taken, signals and SIGKILL sent to the launcher, a user error under --max-restarts, no C++
# compiler for torch.compile, numbers too large for torch. Each ends in one `scaletrain:` line
# with its exit code, no traceback, and nothing saved lost.

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
    r = run_here("train", *MICRO_ARGS, "--train.steps=1", f"--log.run_dir={read_only_dir / 'run'}")
    line = assert_one_line(r.returncode, r.stderr, 2, "log.run_dir", str(read_only_dir))
    assert any(reason in line for reason in READ_ONLY_REASONS) and "choose another log.run_dir" in line, line


@pytest.mark.multiproc
def test_launcher_refuses_a_read_only_run_dir_before_starting_ranks(read_only_dir):
    # the CLI's main in this process: the refusal comes before any rank or fresh process
    r = run_here("train", "--nproc", "2", *MICRO_ARGS, "--train.steps=1", f"--log.run_dir={read_only_dir / 'run'}")
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
    r = run_here("train", *MICRO_ARGS, "--train.steps=1", f"--log.run_dir={full_dir / 'run'}")
    assert_one_line(r.returncode, r.stderr, 2, "log.run_dir", "the disk is full", "free some space")
    assert set(before) <= {p.name for p in full_dir.iterdir()}  # nothing that was there is gone
    r = run_here("train", "--nproc", "2", *MICRO_ARGS, "--train.steps=1", f"--log.run_dir={full_dir / 'run2'}")
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
def test_single_node_listens_on_loopback_only_and_a_sigkilled_launcher_leaves_no_worker_running(tmp_path):
    """One run of the launcher on one node: its rendezvous store and its workers listen on
    127.0.0.1 alone; SIGKILLed, it takes its workers with it."""
    launcher = _start_long_run(tmp_path / "run")
    _wait_for_rows(launcher, tmp_path / "run", 3)
    workers = _workers(launcher.pid)
    assert len(workers) == 2, workers
    listening = _listening([launcher.pid, *workers])
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
    assert listening and all(a.startswith("127.0.0.1:") for a in listening), listening


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
    # (tests/launch/test_launch.py's "a user error in the workers exits 2 in a few lines" is this run's too)
    assert len(r.stderr.strip().splitlines()) <= 4, r.stderr
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
