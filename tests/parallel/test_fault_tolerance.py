"""Fault tolerance across replica groups (fault_tolerance.enabled, on torchft): the one-line refusals,
the Lighthouse killed mid-run, three groups killed at named phases (forward, the gradient all-reduce,
the optimizer step, a checkpoint save, a heal) by the injector of tests/ft_faults.py, checked against
one process training their joint batch, and two DiLoCo groups, one killed mid-window by the injector.
Every kill of a group is the injector's (deterministic: at a phase of a step, from inside the rank),
never a poll from outside; the Lighthouse is killed from outside, but late is harmless there."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from scaletrain.config import load_config
from scaletrain.errors import ConfigError

from conftest import MICRO, REPO, micro_cfg, one_line_exit_2, read_metrics, run_cli, run_here, stderr_of

FT = {"fault_tolerance.enabled": True, "fault_tolerance.lighthouse": "http://127.0.0.1:1"}
# two groups of one rank, each with half of a batch of 8 windows (CLI options: `scaletrain ft-local`)
GROUP = [f"--{k}={v}" for k, v in {**MICRO, "train.global_batch": 4, "train.micro_batch": 4,
                                   "train.eval_every": 1000, "train.eval_batches": 1,
                                   "checkpoint.save_final": True}.items()]


@pytest.mark.parametrize("options,fragments", [
    ({"fault_tolerance.groups": 2, "fault_tolerance.replica_id": 2}, ["fault_tolerance.replica_id=2 is out of range",
                                                             "from 0 to 1"]),
    ({"fault_tolerance.groups": 2, "fault_tolerance.min_replicas": 3}, ["fault_tolerance.min_replicas=3 is above "
                                                               "fault_tolerance.groups=2"]),
    ({"model.moe_experts": 4, "parallel.sync.mode": "diloco"},
     ["parallel.sync.mode=diloco and model.moe_bias_rate=0.01", "drift apart", "set model.moe_bias_rate=0"]),
    ({"parallel.zero": 3, "parallel.sync.mode": "diloco", "parallel.dp_replicate": 2},
     ["with parallel.sync.mode=diloco does not protect parallel.dp_replicate=2: the replica groups are the workers"]),
    ({"parallel.dp_replicate": 2, "parallel.sync.mode": "local_sgd"}, ["sync.mode=local_sgd does not protect "
                                                                     "parallel.dp_replicate=2",
                                                                     "use parallel.sync.mode=step"]),
    ({"fault_tolerance.lighthouse": ""}, ["needs fault_tolerance.lighthouse=http://HOST:PORT"]),
])
def test_bad_fault_tolerance_options_are_one_line_each(options, fragments):
    """A key's own range at config validation, what a layout cannot protect at the legality check
    (settle asks both before any rank starts)."""
    from scaletrain.layout import Layout
    from scaletrain.legality import check_config

    with pytest.raises(ConfigError) as e:
        cfg = load_config(None, {**FT, **options})
        check_config(cfg, Layout.from_config(cfg, 2 * Layout.config_world(cfg.parallel)))
    assert len(e.value.lines) == 1
    for f in fragments:
        assert f in e.value.lines[0], e.value.lines[0]


def test_any_layout_inside_a_group_is_accepted_with_dp_sync_step():
    """tp, pp, cp, ep, ZeRO-3 and HSDP inside each group (tests/parallel/test_ft_layouts.py runs them), and a
    mixture of experts balanced by its routing biases (the default) or by its auxiliary loss alone."""
    load_config(None, {**FT, "parallel.tp": 2, "parallel.pp": 2, "parallel.cp": 2, "parallel.zero": 3,
                       "parallel.dp_replicate": 2})
    load_config(None, {**FT, "parallel.ep": 2, "model.moe_experts": 4})
    load_config(None, {**FT, "model.moe_experts": 4, "model.moe_bias_rate": 0, "model.moe_aux_loss": 0.01})


def test_diloco_across_groups_is_accepted_whole_and_refused_streamed_in_one_line():
    """dp_sync with dp_replicate = 1 makes the groups the workers (no refusal); streamed, delayed or
    compressed syncs across groups are one line naming the options."""
    from scaletrain.layout import Layout

    cfg = load_config(None, {**FT, "parallel.sync.mode": "diloco", "parallel.sync.every": 10})
    assert Layout.from_config(cfg, 1).errors() == []
    for inside in ({"parallel.zero": 3}, {"parallel.tp": 2}, {"parallel.pp": 2}, {"parallel.cp": 2},
                   {"parallel.ep": 2, "model.moe_experts": 4, "model.moe_bias_rate": 0}):  # test_ft_layouts.py
        load_config(None, {**FT, "parallel.sync.mode": "diloco", "parallel.sync.every": 10, **inside})
    cfg = cfg.replace(**{"parallel.sync.fragments": 2, "parallel.sync.dtype": "int8"})
    assert Layout.from_config(cfg, 1).errors() == [
        "fault_tolerance.enabled syncs the replica groups' diloco whole, in fp32, with no delay: "
        "parallel.sync.fragments=2, parallel.sync.dtype=int8 across groups is not supported yet; leave "
        "sync.fragments at 1, sync.delay at 0 and sync.dtype at fp32"]


def _closed_port() -> int:
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _status_page(page: list[bytes]):
    """A Lighthouse's status page on loopback serving page[0] (torchft's dashboard, as far as quorum_status
    reads it; change page[0] to change it): (its address, the server, to shut down)."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Page(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            asked = self.requestline.split()[1]  # as sent (http.server folds a leading "//"; the Lighthouse does not)
            body = page[0] if asked == "/status" else b"not here"
            self.send_response(200 if asked == "/status" else 404)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}", server


def test_an_unreachable_lighthouse_and_a_missing_torchft_are_one_line_exit_2(tmp_path, monkeypatch):
    port = _closed_port()
    args = ["train", *[f"--{k}={v}" for k, v in MICRO.items()], f"--log.run_dir={tmp_path / 'run'}",
            "--fault_tolerance.enabled=true", f"--fault_tolerance.lighthouse=http://127.0.0.1:{port}",
            "--fault_tolerance.quorum_timeout_s=0.5"]
    t0 = time.monotonic()
    one_line_exit_2(run_here(*args), f"the Lighthouse at http://127.0.0.1:{port} is unreachable after "
                                     "fault_tolerance.quorum_timeout_s=0.5 s")
    assert time.monotonic() - t0 < 60
    monkeypatch.setitem(sys.modules, "torchft", None)  # as if not installed: its import fails
    one_line_exit_2(run_here(*args), "fault_tolerance.enabled needs torchft", "pip install 'scaletrain[ft]'")
    one_line_exit_2(run_here("lighthouse", "--bind", "[::]:0"), "the Lighthouse needs torchft")


@pytest.mark.multiproc
def test_a_quorum_that_never_forms_says_which_group_gave_up_and_how_many_joined(tmp_path, monkeypatch):
    """Issue 47: a quorum that never formed ended in a torchft traceback (exit 1). One line: the group,
    the groups that joined of those needed, how long it waited, the exit code of the README's table."""
    from scaletrain.cli.lighthouse import start_lighthouse

    monkeypatch.setenv("RUST_LOG", "warn")
    server = start_lighthouse("127.0.0.1:0", 2, 100, 5000)  # needs 2 groups; only one comes
    try:
        address = f"http://127.0.0.1:{server.address().rsplit(':', 1)[1]}"
        r = run_cli("train", *[f"--{k}={v}" for k, v in MICRO.items()], f"--log.run_dir={tmp_path / 'run'}",
                    "--fault_tolerance.enabled=true", f"--fault_tolerance.lighthouse={address}",
                    "--fault_tolerance.groups=2", "--fault_tolerance.min_replicas=2",
                    "--fault_tolerance.quorum_timeout_s=3")
    finally:
        server.shutdown()
    assert r.returncode == 3, r.stderr[-3000:]
    assert "Traceback" not in r.stderr and "TimeoutError" not in r.stderr, r.stderr[-3000:]
    lines = [line for line in r.stderr.splitlines() if line.startswith("scaletrain: error:")]
    assert len(lines) == 1, r.stderr[-3000:]
    assert re.search(r"replica group 0 gave up at step 1: 1 of the 2 groups it needs \(fault_tolerance.min_replicas\) "
                     r"joined its quorum in \d+ s \(fault_tolerance.quorum_timeout_s=3\); it stops with exit code 3",
                     lines[0]), lines[0]


@pytest.mark.parametrize("prints,group,expected", [
    # the odd one of three, told which groups it differs from
    (["aaaa1111", "aaaa1111", "aaaa2222"], 2, "another optimizer and learning-rate schedule (optim.*) than group(s) "
                                              "0, 1 of its quorum"),
    # one hex digit apart, the first of its kind's four
    (["aaaa1111", "aaaa0111"], 1, "another optimizer and learning-rate schedule (optim.*) than"),
    (["aaaa11110000", "aaaa11112222"], 1, "another precision ("),  # the third kind alone
    (["aaaa1111", "aaaa1111", "aaaa2222"], 0, None),  # the majority goes on
    (["aaaa1111", "bbbb1111"], 1, "another model"),  # a tie: the lowest id's settings are the reference
    (["aaaa1111", "bbbb1111"], 0, None),
    (["aaaa1111", "bbbb2222", "aaaa1111"], 1, "another model (model.*) and another optimizer"),
])
def test_the_group_that_differs_from_its_quorum_is_named_with_what_differs(prints, group, expected):
    """Known answers of the fingerprint comparison (two kinds of settings, 4 hex digits each here)."""
    from scaletrain.parallel import fault_tolerance as ft

    kinds = ft.FINGERPRINTED
    padded = [p + "0000" * (len(kinds) - 2) for p in prints]  # the other kinds agree
    ids = [f"{ft.replica_name(g, p)}:uuid{g}" for g, p in enumerate(padded)]
    why = ft.disagreement(group, ids)
    assert (why is None) == (expected is None), why
    if expected:
        assert why.startswith(f"replica group {group} runs {expected}"), why
    assert ft.disagreement(len(prints), ids) is None  # a group not in this quorum: nothing to say of it


def test_the_settings_fingerprint_moves_only_the_digits_of_the_kind_that_changed():
    """Four hex digits per kind (model, optim, precision, train, data, layout): a changed learning rate moves the
    optimizer's alone, a changed width the model's alone; where the model came from (another folder of the
    same model) and the fp16 scale's start (a healed group takes its peer's) move none."""
    from scaletrain.layout import Layout
    from scaletrain.parallel.fault_tolerance import FINGERPRINTED, settings_fingerprint

    def digits(**change):
        cfg = load_config(None, {**FT, **change})
        fp = settings_fingerprint(cfg, Layout.from_config(cfg, 1))
        assert len(fp) == 4 * len(FINGERPRINTED) and int(fp, 16) >= 0
        return [fp[i:i + 4] for i in range(0, len(fp), 4)]

    base = digits()
    kinds = [kind for kind, _ in FINGERPRINTED]

    def moved(**change):
        return [k for k, a, b in zip(kinds, base, digits(**change), strict=True) if a != b]

    assert moved(**{"optim.lr": 1e-4}) == ["optim"]
    assert moved(**{"model.dim": 96}) == ["model"]
    assert moved(**{"train.seed": 7}) == ["train"] and moved(**{"data.seq_len": 48}) == ["data"]
    assert moved(**{"precision.mode": "16-mixed"}) == ["precision"]
    assert moved(**{"parallel.zero": 1}) == ["layout"]
    assert moved(**{"precision.init_scale": 1024.0}) == [] and moved(**{"train.eval_every": 7}) == []


def test_which_lighthouse_addresses_are_this_machine():
    from scaletrain.parallel.fault_tolerance import _loopback

    assert [_loopback(a) for a in ("http://127.0.0.1:29510", "localhost:1", "http://[::1]:80", "127.9.9.9:2",
                                   "http://node7:29510", "10.0.0.1:5", "http://128.0.0.1:1")] == [
        True, True, True, True, False, False, False]


def test_the_lighthouse_status_page_gives_how_many_groups_joined():
    """torchft's dashboard line "only have N participants, need min_replicas M" read as (N, M); None where the
    page says otherwise or nothing answers."""
    from scaletrain.parallel.fault_tolerance import quorum_status

    page = [b"<p>Quorum failed: only have 1 participants, need min_replicas 3</p>"]
    address, server = _status_page(page)
    try:
        assert quorum_status(address) == (1, 3) and quorum_status(address + "/") == (1, 3)
        page[0] = b"<p>quorum formed: 12 participants</p>"
        assert quorum_status(address) is None
        page[0] = b"<p>\xff\xfe only have 2 participants, need min_replicas 4</p>"  # not UTF-8 before the line
        assert quorum_status(address) == (2, 4)
    finally:
        server.shutdown()
        server.server_close()
    assert quorum_status(address) is None


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_group_with_other_settings_is_refused_before_it_is_averaged(tmp_path, monkeypatch):
    """Issue 47: groups started with another learning rate (or head count, or model shape) were averaged
    silently (or crashed the others' collectives). At the first quorum (all three groups: min_replicas 3)
    the odd group is refused in one line naming what differs, exit 2, before any step: nothing of it was
    averaged with the others, who took no step with it."""
    from scaletrain.cli.lighthouse import start_lighthouse

    monkeypatch.setenv("RUST_LOG", "warn")
    server = start_lighthouse("127.0.0.1:0", 3, 100, 5000)
    address = f"http://127.0.0.1:{server.address().rsplit(':', 1)[1]}"
    common = [*[f"--{k}={v}" for k, v in MICRO.items()], "--train.steps=4", "--fault_tolerance.enabled=true",
              f"--fault_tolerance.lighthouse={address}", "--fault_tolerance.groups=3",
              "--fault_tolerance.min_replicas=3", "--fault_tolerance.quorum_timeout_s=120"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    jobs = [subprocess.Popen([sys.executable, "-m", "scaletrain", "train", *common,
                              f"--fault_tolerance.replica_id={g}", f"--log.run_dir={tmp_path / f'group{g}'}",
                              *(["--optim.lr=0.001"] if g == 2 else [])],
                             cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for g in range(3)]
    try:
        err = _ended(jobs[2], 300)
        for job in jobs[:2]:  # they wait for a third group now (min_replicas 3), inside a quorum: ended
            job.kill()
            _ended(job, 60)
    finally:
        for job in jobs:
            if job.poll() is None:
                job.kill()
        server.shutdown()
    assert jobs[2].returncode == 2, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("scaletrain: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    assert lines[0] == (
        "scaletrain: error: replica group 2 runs another optimizer and learning-rate schedule (optim.*) than "
        "group(s) 0, 1 of its quorum, so it would be averaged with them (or break their collectives): every "
        "replica group of a job must run the same settings; start it with theirs"), lines[0]
    assert not (tmp_path / "group2" / "metrics.jsonl").exists()  # it never took a step
    for g in (0, 1):  # and no step was committed with it (a step begun with it in the quorum was not)
        rows = read_metrics(tmp_path / f"group{g}") if (tmp_path / f"group{g}" / "metrics.jsonl").exists() else []
        assert {r["step"] for r in rows if r["ft_groups"] >= 3} <= set(_uncommitted(rows)), (g, rows)


@pytest.mark.multiproc
def test_a_group_behind_an_odd_group_takes_nothing_from_it(tmp_path, monkeypatch):
    """The odd group ahead: group 1 (another learning rate) trains alone (min_replicas 1), then group 0
    joins. At their first quorum group 1 is refused (two groups that disagree: the lowest id's settings
    stand), but it holds the newest step, so torchft has group 0 heal from it: group 0 must not take its
    state (another run's weights), and says why in one line."""
    from scaletrain.cli.lighthouse import start_lighthouse

    monkeypatch.setenv("RUST_LOG", "warn")
    server = start_lighthouse("127.0.0.1:0", 1, 100, 5000)
    address = f"http://127.0.0.1:{server.address().rsplit(':', 1)[1]}"
    common = [*[f"--{k}={v}" for k, v in MICRO.items()], "--train.steps=400",
              "--fault_tolerance.enabled=true", f"--fault_tolerance.lighthouse={address}",
              "--fault_tolerance.groups=2", "--fault_tolerance.min_replicas=1", "--fault_tolerance.quorum_timeout_s=60"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def group(g: int, *more: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "scaletrain", "train", *common,
                                 f"--fault_tolerance.replica_id={g}", f"--log.run_dir={tmp_path / f'group{g}'}", *more],
                                cwd=REPO, env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    jobs = [group(1, "--optim.lr=0.001")]
    try:
        metrics, deadline = tmp_path / "group1" / "metrics.jsonl", time.monotonic() + 180
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):  # it is steps ahead
            assert jobs[0].poll() is None and time.monotonic() < deadline, _ended(jobs[0], 5)[-3000:]
            time.sleep(0.2)
        jobs.append(group(0))
        err, odd = _ended(jobs[1], 180), _ended(jobs[0], 60)
    finally:
        for job in jobs:
            if job.poll() is None:
                job.kill()
        server.shutdown()
    assert jobs[0].returncode == 2 and "replica group 1 runs another optimizer" in odd, odd[-3000:]
    assert jobs[1].returncode is not None and "took the run's state" not in err, err[-3000:]
    if jobs[1].returncode == 0:
        # the quorum that refused group 1 did not ask group 0 to heal (which one torchft forms first is a race):
        # group 0 trained from its own first step to the end, nothing taken
        rows = read_metrics(tmp_path / "group0")
        assert rows[0]["step"] == 1 and rows[-1]["step"] == 400, (rows[0], rows[-1])
    else:  # asked to heal from the odd group: refused in one line, no step taken with or without its state
        assert "replica group 0 was to take the run's state from a peer whose settings differ" in err, err[-3000:]
        assert not (tmp_path / "group0" / "metrics.jsonl").exists()


# --------------------------------------------------------------------------------------------
# Real groups: `scaletrain ft-local` (a Lighthouse and R groups, each under its own elastic agent)

TESTS = Path(__file__).parents[1]  # tests/, where ft_faults.py is


def _ft_local(run_dir: Path, groups: int, *args: str) -> subprocess.Popen:
    """`scaletrain ft-local` with ARGS, tests/ on the ranks' path (for --rank-hook=ft_faults:inject)."""
    return subprocess.Popen([sys.executable, "-m", "scaletrain", "ft-local", "--groups", str(groups), *GROUP,
                             f"--log.run_dir={run_dir}", "--heartbeat-timeout-ms=1000", *args],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1",
                                 "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])})


def _ft_local_here(run_dir: Path, groups: int, *args: str, timeout: float) -> tuple[int, str]:
    """`scaletrain ft-local` as _ft_local starts it, but through the CLI's main in this process: its
    Lighthouse and groups are real processes as ever, only ft-local's own interpreter start-up is saved.
    Returns (exit code, the stderr of ft-local and of every process of the job: fd 2, which they inherit).
    Past `timeout` it gets SIGTERM, as from a user: it passes it on to its groups, which save and stop."""
    from scaletrain import cli

    saved_env = {k: os.environ.get(k) for k in ("PYTHONPATH", "RUST_LOG")}
    os.environ["PYTHONPATH"] = os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])  # for --rank-hook
    before = os.getcwd()
    os.chdir(REPO)
    try:
        return stderr_of(lambda: cli.main(["ft-local", "--groups", str(groups), *GROUP, f"--log.run_dir={run_dir}",
                                           "--heartbeat-timeout-ms=1000", *args]), timeout)
    finally:
        os.chdir(before)
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _ended(job: subprocess.Popen, timeout: float) -> str:
    """The job's stderr once it has ended (killed past `timeout` seconds)."""
    try:
        return job.communicate(timeout=timeout)[1]
    finally:
        if job.poll() is None:
            job.kill()
            job.communicate()


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _cmdline(pid: int) -> list[bytes]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return []


def _rows(run: Path) -> list[dict]:
    return read_metrics(run) if (run / "metrics.jsonl").exists() else []


@pytest.mark.slow
@pytest.mark.multiproc
def test_the_lighthouse_killed_mid_run_stops_the_group_cleanly_with_exit_3(tmp_path):
    """The Lighthouse is the job's single point of failure: SIGKILLed mid-run, a group says so in one
    line within ft_quorum_timeout_s and stops (exit code 3, no restart), its checkpoints intact. One
    group: each group finds the Lighthouse gone at its own next quorum, with no part for its peers."""
    from scaletrain.train.checkpoint import latest_checkpoint, verify_checkpoint

    run = tmp_path / "ft"
    job = _ft_local(run, 1, "--min-replicas", "1", "--train.steps=2000", "--checkpoint.every=2",
                    "--fault_tolerance.quorum_timeout_s=5")
    try:
        # killed once the group is past its start (a Lighthouse gone before the group's first connection is
        # the unreachable Lighthouse of its start, exit 2, another test's case) and has a checkpoint; later
        # is harmless: the group goes on until it dies
        deadline, lighthouse = time.monotonic() + 300, None
        while time.monotonic() < deadline and job.poll() is None:
            lighthouse = lighthouse or next((p for p in _children(job.pid) if b"lighthouse" in _cmdline(p)), None)
            if lighthouse and latest_checkpoint(run / "group0" / "checkpoints"):
                break
            time.sleep(0.1)
        assert lighthouse is not None and job.poll() is None, "the group did not start, or ended before the kill"
        os.kill(lighthouse, signal.SIGKILL)
        err = _ended(job, 300)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 3, err[-3000:]
    assert "restart 1 of at most" not in err
    stops = re.findall(r"rank 0: replica group 0 stops at step \d+: the Lighthouse at http://\S+ no longer "
                       r"answers; the last checkpoint is kept", err)
    assert len(stops) == 1, err[-3000:]
    newest = latest_checkpoint(run / "group0" / "checkpoints")
    assert newest is not None and verify_checkpoint(newest) is None, newest
    assert len(_rows(run / "group0")) < 2000


@pytest.mark.slow
@pytest.mark.multiproc
def test_ft_local_killed_takes_its_lighthouse_and_groups_with_it(tmp_path):
    """ft-local SIGKILLed (it cannot clean up): Linux sends its Lighthouse and each group's launcher
    SIGTERM (their parent-death signal), so the group finishes its step, saves and stops, and nothing
    of the job outlives it."""
    from scaletrain.train.checkpoint import latest_checkpoint, verify_checkpoint

    run = tmp_path / "ft"
    job = _ft_local(run, 1, "--min-replicas", "1", "--train.steps=2000", "--checkpoint.every=1000")
    try:
        deadline, children = time.monotonic() + 300, []
        while time.monotonic() < deadline and job.poll() is None and len(_rows(run / "group0")) < 2:
            time.sleep(0.1)
        children = _children(job.pid)  # the Lighthouse and the group's launcher
        assert len(children) == 2 and job.poll() is None, "the group did not start, or ended before the kill"
        os.kill(job.pid, signal.SIGKILL)
        err = _ended(job, 120)  # the end of its stderr: every process that shares it has closed it
    finally:
        if job.poll() is None:
            job.kill()
    deadline = time.monotonic() + 60  # its stderr closed at exit, a moment before the process is gone
    while [p for p in children if _alive(p)] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in children if _alive(p)], err[-3000:]
    assert "scaletrain: stopped by SIGTERM: the ranks finished their step and saved" in err, err[-3000:]
    newest = latest_checkpoint(run / "group0" / "checkpoints")
    assert newest is not None and verify_checkpoint(newest) is None, newest
    assert len(_rows(run / "group0")) < 2000


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_group_back_after_the_others_finished_is_stopped_and_the_run_ends_0(tmp_path):
    """Two groups, min_replicas 2. Group 1 dies in the last step's optimizer step, after its commit
    vote: group 0 commits that step and finishes without it. Group 1's restart comes back to no peer
    and would wait for a quorum of two that cannot form, then time out and restart, again and again.
    ft-local stops it ft_quorum_timeout_s after group 0 finished and says why; the run ends 0."""
    from ft_faults import fired, write_plan

    run, steps = tmp_path / "ft", 3
    write_plan(run, [{"group": 1, "step": steps, "phase": "optimizer"}])
    code, err = _ft_local_here(run, 2, "--min-replicas", "2", f"--train.steps={steps}",
                               "--fault_tolerance.quorum_timeout_s=12", "--max-restarts=2",
                               "--rank-hook=ft_faults:inject", timeout=400)  # without the stop: fails in ~2 min
    assert code == 0, err[-3000:]
    assert fired(run)[0]["step"] == steps
    assert "restart 1 of at most" in err, err[-3000:]  # it came back
    assert "replica group 1 is stopped: group 0 finished the run 12 s ago" in err, err[-3000:]
    assert "replica group 1 ended with exit code" not in err, err[-3000:]
    assert read_metrics(run / "group0")[-1]["step"] == steps


def _alive(pid: int) -> bool:
    """Running (a zombie, ended but not reaped yet, is not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_group_that_diverges_ends_the_job_with_its_code(tmp_path):
    """Issue 47: two of three groups stopped on divergence (exit 3) and the third waited for a quorum
    that could not form, timed out and restarted until its restarts ran out. A group that ends with a
    code a restart would repeat ends the job with that code: the others are stopped (they save first)."""
    run = tmp_path / "ft"
    code, err = _ft_local_here(run, 2, "--min-replicas", "2", "--train.steps=40", "--max-restarts=2",
                               "--rank-hook=ft_faults:diverge", timeout=400)
    assert code == 3, err[-3000:]
    assert "scaletrain: error: replica group 1 ended with exit code 3 (training cannot go on: a restart would " \
           "repeat it); the job ends with it, and group(s) 0 are stopped (each saves a checkpoint first)" in err, \
        err[-3000:]
    assert "restart 1 of at most" not in err, err[-3000:]  # group 0 never timed out waiting for a quorum
    last = read_metrics(run / "group0")[-1]["step"]
    assert last < 40
    # stopped while it waited for a quorum of two: the wait is cut short and the steps it took are saved
    # (the launcher's grace of 30 s used to run out first, and SIGKILL lost them)
    saved = run / "group0" / "checkpoints" / f"step_{last:08d}"
    assert f"[group 0] scaletrain: stopped by SIGTERM: the ranks finished their step and saved {saved}" in err, \
        err[-3000:]


@pytest.mark.slow  # the command's own process
def test_the_lighthouse_command_prints_its_address_and_stops_on_sigterm():
    lighthouse = subprocess.Popen([sys.executable, "-m", "scaletrain", "lighthouse", "--bind", "[::]:0"], cwd=REPO,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = lighthouse.stdout.readline()
        assert first.startswith("lighthouse http://") and "--fault_tolerance.lighthouse=http://" in first, first
        address = first.split()[1]
        from scaletrain.parallel.fault_tolerance import lighthouse_problem

        assert lighthouse_problem(address, 10.0) is None  # it answers at the address it printed
        lighthouse.send_signal(signal.SIGTERM)
        out, err = lighthouse.communicate(timeout=60)
    finally:
        if lighthouse.poll() is None:
            lighthouse.kill()
    assert lighthouse.returncode == 0, err
    assert out.strip() == "lighthouse stopped"


# --------------------------------------------------------------------------------------------
# Kills at named phases (tests/ft_faults.py, through ft-local's hidden --rank-hook): three groups of one
# rank, min_replicas 3 (every committed step has all three, so the run is a clean run that skipped the
# uncommitted steps), group 2 the witness that is never killed. Two rounds of two groups killed at once
# (their restarts overlap), then a kill while healing:
#   step 3: group 1 in its forward, group 0 in the gradient all-reduce
#   step 8: group 1 in its optimizer step, group 0 inside its checkpoint save (checkpoint.every 4)
#   group 1 again, while it heals after the second round (its first heal at a step >= 5)
# Steps 1-2, before any kill, are one process training the joint batch (groups 0 and 1: their rows as
# the injector kept them at their kill in step 3; their restarts start metrics.jsonl anew).
PHASE_STEPS = 14
PHASE_KILLS = [{"group": 1, "step": 3, "phase": "forward"}, {"group": 0, "step": 3, "phase": "allreduce"},
               {"group": 1, "step": 8, "phase": "optimizer"}, {"group": 0, "step": 8, "phase": "save"},
               {"group": 1, "step": 5, "phase": "heal"}]


@pytest.fixture(scope="module")
def phase_kills(tmp_path_factory):
    """The run of three groups with PHASE_KILLS; returns (run folder, the fired kills, stderr)."""
    from ft_faults import fired, write_plan

    run = tmp_path_factory.mktemp("ftphases") / "ft"
    write_plan(run, PHASE_KILLS, record=True)
    # (a group killed while healing leaves the others in that step's all-reduce for the step timeout: 15 s)
    code, err = _ft_local_here(run, 3, "--min-replicas", "3", f"--train.steps={PHASE_STEPS}", "--checkpoint.every=4",
                               "--checkpoint.keep=10", "--fault_tolerance.quorum_timeout_s=120",
                               "--fault_tolerance.step_timeout_s=15", "--rank-hook=ft_faults:inject", timeout=600)
    assert code == 0, err[-3000:]
    return run, fired(run), err


@pytest.fixture(scope="module")
def joint_run(phase_kills, tmp_path_factory):
    """One process training the three groups' joint batch of 12 for PHASE_STEPS, skipping the steps the
    kills left uncommitted (what the groups' commit vote did at them): {"history": its metrics rows,
    "start": its initial weights, "trainer": the Trainer at the end}."""
    from scaletrain.hooks import StepHook
    from scaletrain.train.trainer import Trainer

    run, _, _ = phase_kills
    lost = _uncommitted(read_metrics(run / "group2"))

    class SkipThem(StepHook):
        def agree_to_skip(self, skip: bool) -> bool:
            return skip or trainer.state.step + 1 in lost

        def skip_reason(self) -> str | None:
            return "not committed in the faulted run" if trainer.state.step + 1 in lost else None

    trainer = Trainer(micro_cfg(tmp_path_factory.mktemp("joint"), **{
        "train.steps": PHASE_STEPS, "train.global_batch": 12, "train.micro_batch": 4, "train.eval_every": 1000}))
    start = {n: p.detach().clone() for n, p in trainer.pm.optim_params}
    trainer.hooks.add(SkipThem())
    history = trainer.fit()["history"]
    return {"history": history, "start": start, "trainer": trainer, "lost": lost}


def _uncommitted(rows: list[dict]) -> list[int]:
    """The steps a group did not commit (its ft_uncommitted count went up at them)."""
    counts = [0.0] + [r["ft_uncommitted"] for r in rows]
    return [r["step"] for r, before in zip(rows, counts, strict=False) if r["ft_uncommitted"] > before]


@pytest.mark.slow
@pytest.mark.multiproc
def test_kills_at_each_phase_cost_at_most_the_step_they_break_and_no_restart_elsewhere(phase_kills):
    """Each kill fired at its phase and step; the witness (group 2) was never restarted and logged
    every step once; each kill cost at most the commit of the step it broke (or of the next one,
    where the dead group was still in that step's quorum), in every group alike."""
    run, kills, err = phase_kills
    assert sorted(kills) == list(range(len(PHASE_KILLS))), kills
    for i, k in kills.items():
        assert (k["group"], k["phase"]) == (PHASE_KILLS[i]["group"], PHASE_KILLS[i]["phase"])
    assert [kills[i]["step"] for i in range(4)] == [3, 3, 8, 8], kills  # as planned (the save: its checkpoint's)
    assert kills[4]["step"] >= 8  # group 1's heal after the second round: to the peers' step
    assert err.count("restart 1 of at most") == 2 and err.count("restart 2 of at most") == 2, err[-3000:]
    assert err.count("restart 3 of at most") == 1 and "restart 4 of" not in err  # group 1's heal kill
    witness = read_metrics(run / "group2")
    assert [r["step"] for r in witness] == list(range(1, PHASE_STEPS + 1))  # never went back, never restarted
    lost = _uncommitted(witness)
    near = {k["step"] + d for k in kills.values() for d in (0, 1)}
    assert len(lost) <= len(kills) and set(lost) <= near, (lost, kills)
    assert 3 in lost  # group 1 died in its forward, before its share of step 3's all-reduce
    assert "not committed by the replica groups" in err, err[-3000:]  # said, as well as counted
    assert "GLHF" not in err and "got exception" not in err, err[-3000:]  # in our words, not torchft's traceback
    # each group's lines name it (issue 47 #6): its launcher's restarts, its ranks' waits and skipped steps
    ours = [line for line in err.splitlines() if re.search(r"restart \d+ of at most|waits at step|not committed", line)]
    assert ours and all(re.match(r"\[group [0-2]\] ", line) for line in ours), ours
    # a heal is one line of ours, not the peer's HTTP access line and torch's warning on loading what came
    assert re.search(r"\[group 1\] scaletrain: replica group 1 took the run's state at step \d+ from a live peer", err)
    assert "GET /checkpoint" not in err and "not writable" not in err, err[-3000:]
    for g in range(3):  # the restarted groups took the count of skipped steps with the peer's state
        assert read_metrics(run / f"group{g}")[-1]["skipped_steps"] == len(lost), g


def test_a_failure_torchft_recorded_is_said_in_a_few_words():
    from scaletrain.parallel.fault_tolerance import failure_text

    class Recorded:  # torchft's ExceptionWithTraceback
        def __init__(self, e):
            self.original_exception = e

    closed = RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed "
                          "by peer [127.0.0.1]:18345. This is typically caused by a remote worker crashing. Check the "
                          "logs of the remote worker before reporting an error. GLHF!")
    assert failure_text(Recorded(closed)) == "RuntimeError: Connection closed by peer [127.0.0.1]:18345"
    hung = RuntimeError("[/x/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 20000ms for recv operation "
                        "to complete\nmore")
    assert failure_text(Recorded(hung)) == "RuntimeError: Timed out waiting 20000ms for recv operation to complete"
    assert failure_text(TimeoutError()) == "TimeoutError" and failure_text(None) is None
    located = RuntimeError("[/x/gloo/transport/tcp/pair.cc:1] This is typically caused by a remote worker crashing.")
    assert failure_text(Recorded(located)) == "RuntimeError"  # nothing said beyond gloo's location and advice
    assert failure_text(Recorded(RuntimeError("[/x/gloo/transport/tcp/pair.cc:1]"))) == "RuntimeError"


SGD = ["--optim.name=sgd", "--optim.momentum=0", "--optim.weight_decay=0", "--train.grad_clip=0"]


@pytest.mark.slow
@pytest.mark.multiproc
def test_with_fewer_groups_alive_than_configured_the_step_is_the_mean_of_the_live_ones(tmp_path):
    """Three groups, min_replicas 2, group 0 killed at step 3: groups 1 and 2 go on without it. A step
    they took alone moved group 1's weights by the learning rate times the MEAN of the two live groups'
    gradients (recomputed here by hand, on the windows each group reads, from group 1's recorded
    weights; SGD without momentum, decay or clipping: the update is that mean, nothing else). With
    every group alive, dividing by the live and by the configured groups agree; here they do not.
    The checkpoints of those steps were written by group 1, the lowest id in the quorum (not group 0)."""
    import torch
    import torch.nn.functional as F

    from ft_faults import write_plan
    from scaletrain.data.loader import StepSampler
    from scaletrain.train.trainer import Trainer

    run = tmp_path / "ft"
    write_plan(run, [{"group": 0, "step": 3, "phase": "forward"}], record=True)
    code, err = _ft_local_here(run, 3, "--min-replicas", "2", "--train.steps=8", "--checkpoint.every=1",
                               "--checkpoint.keep=10", "--fault_tolerance.quorum_timeout_s=12", *SGD,
                               "--rank-hook=ft_faults:inject", timeout=600)
    assert code == 0, err[-3000:]
    rows = read_metrics(run / "group1")
    # after the kill (the first quorum may hold any two groups: min_replicas 2 lets it form before the third)
    alone = [r["step"] for r in rows if r["ft_groups"] == 2 and r["step"] > 3 and r["step"] not in _uncommitted(rows)]
    assert alone, rows
    s = alone[0]
    # a group's state before each step it takes, and at the end (after step 8: the group may rejoin by then)
    before, after = (torch.load(run / "group1" / "states" / (f"{k:04d}.pt" if k < 8 else "final.pt"))
                     for k in (s - 1, s))
    cfg = micro_cfg(tmp_path / "ref", **{"train.global_batch": 4, "train.micro_batch": 4, "train.steps": 8,
                                         "optim.name": "sgd", "optim.momentum": 0.0, "optim.weight_decay": 0.0,
                                         "train.grad_clip": 0.0})
    ref = Trainer(cfg)
    params = dict(ref.pm.optim_params)
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(before["params"][n])
    grads = []
    for group in (1, 2):  # what each live group reads at step s: dp rank `group` of a 3-rank run of 12 windows
        windows = StepSampler(len(ref.data.dataset), 12, 4, 1, dp_rank=group, dp_size=3,
                              seed=cfg.train.seed).rank_micro_batches(s - 1)[0]
        inputs, targets = ref.data.dataset[windows]
        loss = F.cross_entropy(ref.model(inputs).flatten(0, 1), targets.flatten())  # the group's mean token loss
        grads.append(torch.autograd.grad(loss, list(params.values())))
    lr = ref.schedule.lr(s - 1)
    for (n, p), g1, g2 in zip(params.items(), *grads, strict=True):
        expected = p.detach() - lr * (g1 + g2) / 2
        torch.testing.assert_close(after["params"][n], expected, rtol=1e-5, atol=1e-7, msg=f"{n} at step {s}")
    ref.folder.release()
    # the checkpoint of a step without group 0 is group 1's, the lowest id in that step's quorum
    assert (run / "group1" / "checkpoints" / f"step_{s:08d}").is_dir()
    assert not (run / "group2" / "checkpoints" / f"step_{s:08d}").exists()


@pytest.mark.multiproc
def test_a_non_finite_gradient_in_one_group_skips_the_step_in_every_group(tmp_path):
    """Group 2's gradient holds a NaN at step 4, before the groups average: the average carries it to
    every group, so every group skips step 4 (counted and said), none takes it into its weights, and
    the three go on and end on the same weights (the same validation loss, to the bit)."""
    run = tmp_path / "ft"
    code, err = _ft_local_here(run, 3, "--min-replicas", "3", "--train.steps=6", "--train.eval_every=6",
                               "--rank-hook=ft_faults:nan_in_group_2", timeout=600)
    assert code == 0, err[-3000:]
    rows = {g: read_metrics(run / f"group{g}") for g in range(3)}
    for g in range(3):
        assert [r["step"] for r in rows[g]] == list(range(1, 7)), (g, rows[g])
        skipped = [r["skipped_steps"] for r in rows[g]]
        assert skipped == [0, 0, 0, 1, 1, 1], (g, skipped)  # step 4, in every group, and no other
        assert all(math.isfinite(r["loss"]) for r in rows[g]), (g, rows[g])
    assert len({rows[g][-1]["val_loss"] for g in range(3)}) == 1, [rows[g][-1] for g in range(3)]
    assert len(re.findall(r"\[group [0-2]\] .*step 4.*skipped", err)) >= 1, err[-3000:]


# one rank of a two-rank group killed at each moment of a step (issue 47 #1: a rank killed inside the groups'
# all-reduce left its counterparts' receive hanging until the step timeout; their group's other rank, at the
# commit vote already, gave up on the vote at that same timeout, and a group nobody killed restarted)
RANK_KILLS = [{"group": 1, "rank": 1, "step": 3, "phase": "forward"},
              {"group": 0, "rank": 1, "step": 5, "phase": "reduce"},
              {"group": 1, "rank": 1, "step": 7, "phase": "allreduce"},
              {"group": 0, "rank": 1, "step": 9, "phase": "vote"},
              {"group": 1, "rank": 1, "step": 11, "phase": "optimizer"}]
RANK_STEPS = 13


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_rank_killed_at_any_moment_of_a_step_restarts_its_own_group_alone(tmp_path):
    """Three groups of two ranks, min_replicas 3: rank 1 of group 0 or 1 SIGKILLed in the forward, the
    group's own gradient reduction, the groups' all-reduce, the commit vote and the optimizer step. Only
    the killed group restarts (a new process for its rank 0 each time); the witness (group 2) took every
    step once in one process, and the job ends 0."""
    from ft_faults import fired, write_plan

    run = tmp_path / "ft"
    write_plan(run, RANK_KILLS, journal=True)
    code, err = _ft_local_here(run, 3, "--nproc", "2", "--min-replicas", "3", f"--train.steps={RANK_STEPS}",
                               "--train.global_batch=8", "--fault_tolerance.step_timeout_s=15",
                               "--fault_tolerance.quorum_timeout_s=180", "--rank-hook=ft_faults:inject", timeout=900)
    assert code == 0, err[-3000:]
    kills = fired(run)
    assert [(kills[i]["group"], kills[i]["phase"]) for i in sorted(kills)] == \
        [(k["group"], k["phase"]) for k in RANK_KILLS], (kills, err[-3000:])
    journal = {g: [json.loads(line) for line in (run / f"group{g}" / "journal.jsonl").read_text().splitlines()]
               for g in range(3)}
    witness = journal[2]
    assert len({r["pid"] for r in witness}) == 1, (witness, err[-3000:])  # never restarted
    assert [r["step"] for r in witness] == list(range(1, RANK_STEPS + 1))
    for g in (0, 1):  # a new rank 0 after each of its kills, and none besides
        pids = list(dict.fromkeys(r["pid"] for r in journal[g]))
        assert len(pids) == 1 + sum(k["group"] == g for k in RANK_KILLS), (g, journal[g])


@pytest.mark.slow
@pytest.mark.multiproc
def test_the_witness_waits_for_restarting_groups_and_says_so_once_per_wait(phase_kills):
    """While killed groups restart, the witness has fewer than min_replicas groups in its quorum: it
    waits (it is not restarted: the test above), and says so in one line per step it waits at, not
    one per try."""
    run, kills, err = phase_kills
    waits = [int(s) for s in re.findall(r"replica group 2 waits at step (\d+): fewer than "
                                        r"fault_tolerance.min_replicas=3 groups are in its quorum yet", err)]
    assert [w for w in waits if w > kills[0]["step"]], err[-3000:]  # after the first kills: a restart's wait
    assert len(waits) == len(set(waits)), waits


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_group_healed_from_a_peer_holds_its_state_bit_for_bit(phase_kills):
    """Before every step each group took, its weights, optimizer state, step and skipped steps were
    the witness's bit for bit: in particular right after each heal (a restart from nothing or from an
    older checkpoint, taking the peer's state), and at the end."""
    import torch

    run, kills, _ = phase_kills
    states = {g: run / f"group{g}" / "states" for g in range(3)}
    witness = {p.stem: p for p in states[2].glob("*.pt")}
    healed = {g: [r["step"] for r in read_metrics(run / f"group{g}") if r.get("ft_healed")] for g in (0, 1)}
    assert healed[0] and healed[1], healed
    for g in (0, 1):  # it went on from the peers' step (not from 0), and from there to the end
        steps = [r["step"] for r in read_metrics(run / f"group{g}")]
        assert healed[g][0] > kills[0]["step"] and steps == sorted(set(steps)) and steps[-1] == PHASE_STEPS, steps
        # and nothing it had written was lost (issue 47): the rows before its first kill are still there,
        # and every committed step the witness logged after it, up to the group's next kill, is too
        first = min(k["step"] for k in kills.values() if k["group"] == g)
        assert set(range(1, first)) <= set(steps), (g, first, steps)
    for g in (0, 1):
        recorded = {p.stem: p for p in states[g].glob("*.pt")}
        # the state it held before the first step it took after its last heal: what it took from the peer
        assert f"{healed[g][0] - 1:04d}" in recorded and "final" in recorded, (g, healed[g], sorted(recorded))
        assert len(recorded) >= PHASE_STEPS - 1  # all but the steps it was down for (a heal kill: one more)
        for name, path in recorded.items():
            a, b = torch.load(path, weights_only=False), torch.load(witness[name], weights_only=False)
            _assert_same_state(a, b, f"group {g} before step {name}")


def _assert_same_state(a: dict, b: dict, what: str) -> None:
    import torch

    assert (a["step"], a["skipped_steps"]) == (b["step"], b["skipped_steps"]), what
    assert a["params"].keys() == b["params"].keys()
    for n in a["params"]:
        assert torch.equal(a["params"][n], b["params"][n]), f"{what}: {n}"
    sa, sb = a["optim"]["state"], b["optim"]["state"]
    assert sa.keys() == sb.keys(), what
    for i in sa:
        for k in sa[i]:
            assert torch.equal(torch.as_tensor(sa[i][k]), torch.as_tensor(sb[i][k])), f"{what}: optimizer {i} {k}"


@pytest.mark.slow
@pytest.mark.multiproc
def test_three_groups_train_as_one_process_on_their_joint_batch_until_the_first_kill(phase_kills, joint_run):
    """While all three groups are in every step (steps 1-2, before the kills of step 3), the mean of
    their losses and their common gradient norm are those of one process training the batch of 12
    they share (groups 0 and 1: their rows as they were at their kill, which their restart dropped);
    and the groups' gradient norms agree bit for bit at every step they all logged."""
    from ft_faults import rows_at_kill

    run, kills, _ = phase_kills
    first = kills[0]["step"] - 1
    assert first == 2 and kills[1]["step"] == kills[0]["step"], kills
    groups = [rows_at_kill(run, 1), rows_at_kill(run, 0), read_metrics(run / "group2")]  # kill 1 is group 0's
    for a, b, c, r in zip(*(g[:first] for g in groups), joint_run["history"][:first], strict=True):
        assert a["step"] == b["step"] == c["step"] == r["step"]
        assert a["ft_groups"] == b["ft_groups"] == c["ft_groups"] == 3.0
        assert a["grad_norm"] == b["grad_norm"] == c["grad_norm"]  # one averaged gradient in all, bit for bit
        assert abs((a["loss"] + b["loss"] + c["loss"]) / 3 - r["loss"]) < 1e-5 * r["loss"], (a, b, c, r)
        assert abs(a["grad_norm"] - r["grad_norm"]) < 1e-4 * r["grad_norm"], (a, r)
    last = {g: {r["step"]: r for r in read_metrics(run / f"group{g}")} for g in range(3)}
    common = [s for s in last[2] if s in last[0] and s in last[1] and s not in joint_run["lost"]]
    assert len(common) >= 3, common
    for s in common:
        assert last[0][s]["grad_norm"] == last[1][s]["grad_norm"] == last[2][s]["grad_norm"], s


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_run_with_kills_ends_where_a_clean_run_that_skipped_the_same_steps_ends(phase_kills, joint_run):
    """The three groups end on the same weights bit for bit (and validation loss), and on those of one
    process training their joint batch of 12 that skips the steps the kills left uncommitted (within
    1e-4 of each parameter's change over the run: the groups average three means where it takes one)."""
    import torch

    run, _, _ = phase_kills
    final = [torch.load(run / f"group{g}" / "states" / "final.pt", weights_only=False) for g in range(3)]
    for g in (0, 1):
        _assert_same_state(final[g], final[2], f"group {g} at the end")
    trainer, start = joint_run["trainer"], joint_run["start"]
    assert trainer.state.skipped_steps == len(joint_run["lost"]) == final[2]["skipped_steps"]
    worst = 0.0
    for n, p in trainer.pm.optim_params:
        change = (p.detach() - start[n]).norm().item()
        worst = max(worst, (final[2]["params"][n] - p.detach()).norm().item() / change)
    print(f"final weights against the clean run: {worst:.2e} of their change")
    assert worst < 1e-4, worst
    rows = {g: read_metrics(run / f"group{g}")[-1] for g in range(3)}
    assert rows[0]["val_loss"] == rows[1]["val_loss"] == rows[2]["val_loss"]


@pytest.mark.slow
@pytest.mark.multiproc
def test_checkpoints_written_around_kills_are_whole_and_the_killed_save_left_none(phase_kills):
    """Group 0 (the lowest id, the writer) died inside its save of step 8: no step 8 checkpoint, no
    partial folder left (the next save cleared it), and every checkpoint there verifies, the newest
    at the last step; nobody else wrote one (group 0 was in every quorum that committed)."""
    from scaletrain.train.checkpoint import complete_checkpoints, latest_checkpoint, verify_checkpoint

    run, kills, _ = phase_kills
    folder = run / "group0" / "checkpoints"
    saved = [p.name for p in complete_checkpoints(folder)]
    assert saved == [f"step_{s:08d}" for s in (4, 12, PHASE_STEPS)], saved
    assert all(verify_checkpoint(p) is None for p in complete_checkpoints(folder))
    assert latest_checkpoint(folder).name == f"step_{PHASE_STEPS:08d}"
    assert not [p.name for p in folder.iterdir() if p.name.startswith(".step_")]
    assert not (run / "group1" / "checkpoints").exists() and not (run / "group2" / "checkpoints").exists()


# --------------------------------------------------------------------------------------------
# DiLoCo across the groups: each group a worker, the pseudo-gradient averaged over the live groups


H = 8  # inner steps per window; group 1 is killed inside the second window (steps 9-16)
D_STEPS, D_KILL_AFTER = 24, 10
# validation after every window: the weights the sync leaves (or the discard takes back)
DILOCO = ["--parallel.sync.mode=diloco", f"--parallel.sync.every={H}", "--fault_tolerance.step_timeout_s=20",
          f"--train.eval_every={H}"]


@pytest.fixture(scope="module")
def killed_diloco(tmp_path_factory):
    """Two groups (min_replicas 2) doing DiLoCo every H steps; group 1's rank SIGKILLs itself (tests/ft_faults.py)
    in its forward of step D_KILL_AFTER + 1, mid-window. Returns (run folder, group 1's rows at the kill, stderr)."""
    from ft_faults import fired, rows_at_kill, write_plan

    run = tmp_path_factory.mktemp("ftd") / "ft"
    write_plan(run, [{"group": 1, "step": D_KILL_AFTER + 1, "phase": "forward"}])
    code, err = _ft_local_here(run, 2, "--min-replicas", "2", "--fault_tolerance.quorum_timeout_s=120",
                               f"--train.steps={D_STEPS}", *DILOCO, "--rank-hook=ft_faults:inject", timeout=600)
    assert code == 0, err[-3000:]
    assert fired(run)[0]["step"] == D_KILL_AFTER + 1, fired(run)
    return run, rows_at_kill(run, 0), err


@pytest.mark.slow
@pytest.mark.multiproc
def test_diloco_across_groups_matches_its_simulation_and_discards_a_window_a_group_died_in(killed_diloco, tmp_path):
    """Until the kill the two groups are verify's one-process simulation of 2 DiLoCo workers (each
    step's mean loss and RMS gradient norm, a sync after step 8 included). Group 1 dies mid-window:
    group 0's sync after step 16 is not committed and discarded (weights back to the last sync),
    it goes on; group 1 restarts, heals from group 0 at step 16 and both end with the same weights."""
    import math

    from scaletrain.layout import Layout
    from scaletrain.verify import isolated, simulate_workers

    run, before_kill, err = killed_diloco
    cfg = micro_cfg(tmp_path, **{"train.steps": D_STEPS, "train.global_batch": 8, "train.micro_batch": 4,
                                 "parallel.dp_replicate": 2, "parallel.sync.mode": "diloco", "parallel.sync.every": H})
    ref = simulate_workers(isolated(cfg, tmp_path / "ref", D_KILL_AFTER), Layout.from_config(cfg, 2), D_STEPS,
                           tmp_path / "ref")
    g0, g1 = read_metrics(run / "group0"), read_metrics(run / "group1")
    for a, b, r in zip(g0[:D_KILL_AFTER], before_kill[:D_KILL_AFTER], ref, strict=True):
        assert a["step"] == b["step"] == r["step"]
        assert abs((a["loss"] + b["loss"]) / 2 - r["loss"]) < 1e-6 * r["loss"], (a, b, r)
        assert abs(math.hypot(a["grad_norm"], b["grad_norm"]) / math.sqrt(2) - r["grad_norm"]) < 1e-5 * r["grad_norm"]
    assert "replica group 0 discards the sync window of steps 9-16: not committed" in err, err[-3000:]
    assert [r["step"] for r in g0] == list(range(1, D_STEPS + 1))  # it went on
    val = {r["step"]: r["val_loss"] for r in g0 if "val_loss" in r}
    assert val[H] == val[2 * H] != val[3 * H]  # after the discard: the weights of the sync after step 8, exactly
    assert g0[-1]["ft_uncommitted"] == 1 and g0[2 * H - 2]["ft_uncommitted"] == 0
    assert err.count("restart 1 of at most") == 1, err[-3000:]
    healed = [r for r in g1 if r.get("ft_healed")]
    assert healed and healed[0]["step"] == 2 * H + 1  # from the peer's state at the discarded window's end
    assert g0[-1]["val_loss"] == g1[-1]["val_loss"]  # the same weights at the end, bit for bit


# --- the hook's own arithmetic and bookkeeping, in one process: torchft's Manager stood in for ------------
# (the multi-process tests above run the real Manager; these give the rules known answers by hand, with fewer
# groups alive than configured and a writer that is not group 0)


class _Wire:
    """The groups' all-reduce between threads of this process: each group's flat tensor becomes the sum of all."""

    def __init__(self, groups: int):
        import threading

        self.posted: list = []
        self.read, self.written = threading.Barrier(groups), threading.Barrier(groups)


class _Work:
    def __init__(self, wire: _Wire, flat):
        self.wire, self.flat = wire, flat

    def wait(self):
        self.wire.read.wait()  # every group has posted
        total = sum(t.clone() for t in self.wire.posted)
        self.wire.written.wait()  # every group has read before any writes
        self.flat.copy_(total)
        return self.flat


class _Manager:
    """What ReplicaGroups asks of torchft's Manager, answered as told."""

    def __init__(self, wire=None, participants=1, rank_in_quorum=0, commit=True, error=None):
        self.wire, self.participants, self.rank_in_quorum = wire, participants, rank_in_quorum
        self.commit, self.error, self.fns, self.loaded, self.ops = commit, error, {}, None, []

    def register_state_dict_fn(self, key, load, save):
        self.fns[key] = (load, save)

    def allreduce(self, flat, reduce_op=None):
        self.ops.append(reduce_op)
        self.wire.posted.append(flat)
        return _Work(self.wire, flat)

    def num_participants(self):
        return self.participants

    def participating_rank(self):
        return self.rank_in_quorum

    def should_commit(self, timeout=None):
        self.vote_timeout = timeout
        return self.commit

    def errored(self):
        return self.error

    def current_step(self):
        return 11

    def batches_committed(self):
        return 44

    def load_state_dict(self, state):
        self.loaded = state

    def start_quorum(self):
        self.quorums = getattr(self, "quorums", 0) + 1


def _group(manager, seed=0, **kw):
    """A replica group's hook over two uneven parameters (and a frozen one), AdamW over the trainable."""
    import types

    import torch

    from scaletrain.parallel.fault_tolerance import ReplicaGroups

    g = torch.Generator().manual_seed(seed)
    named = [("w", torch.nn.Parameter(torch.randn(3, 5, generator=g))),
             ("b", torch.nn.Parameter(torch.randn(7, generator=g))),
             ("frozen", torch.nn.Parameter(torch.randn(2, generator=g), requires_grad=False))]
    optimizer = torch.optim.AdamW([p for _, p in named[:2]], lr=0.1)
    state = types.SimpleNamespace(step=0, skipped_steps=0, early_loss=None)
    refreshed = []
    hook = ReplicaGroups(manager, named, optimizer, state, lambda: refreshed.append(1),
                         **{"replica_id": 0, "groups": 3, "min_replicas": 1, "quorum_timeout_s": 60.0, "rank": 0,
                            "lighthouse": "", "step_timeout_s": 60.0, **kw})
    hook.refreshed = refreshed
    return hook


def test_the_groups_gradient_is_the_mean_over_the_groups_alive_and_the_expert_loads_their_sum():
    """Three groups configured, two alive (group 0 gone): each rank's gradient becomes (g1 + g2) / 2, not / 3,
    and a mixture's expert load counts g1's + g2's (summed: the biases move as for the joint batch); a frozen
    parameter (no gradient) is left out."""
    import threading

    import torch

    wire = _Wire(2)
    hooks = [_group(_Manager(wire, participants=2), seed=r, replica_id=r) for r in (1, 2)]
    grads, loads = [], []
    for r, hook in enumerate(hooks):
        g = torch.Generator().manual_seed(10 + r)
        for _, p in hook.named[:2]:
            p.grad = torch.randn(p.shape, generator=g)
        grads.append([p.grad.clone() for _, p in hook.named[:2]])
        moe = torch.nn.Module()
        moe.stats = torch.tensor([[3.0, 0.0, 5.0], [1.0, 2.0, 0.0]]) * (r + 1)  # (layers' counts) per expert
        hook.moe = {"layers.0.moe": moe}
        loads.append(moe.stats.clone())
    threads = [threading.Thread(target=h.reduce_gradients, args=(h.named,)) for h in hooks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    for hook in hooks:
        assert [op.name for op in hook.manager.ops] == ["SUM"]
        for (_, p), a, b in zip(hook.named[:2], *grads, strict=True):
            torch.testing.assert_close(p.grad, (a + b) / 2, rtol=0, atol=1e-6)
        assert torch.equal(hook.moe["layers.0.moe"].stats, loads[0] + loads[1])
        assert hook.named[2][1].grad is None


def test_a_group_healed_from_a_peer_takes_its_whole_state_and_then_steps_as_it_does():
    """What a live peer hands out (torchft's registered state_dict fn) and a group behind it loads: weights,
    AdamW's moments and step, the run's step, skipped steps and the divergence yardstick, the fp16 scale and
    the routing biases; the group then refreshes what its model computes with. After the heal, one step on the
    same gradients leaves both bit for bit alike (a moment left behind would not)."""
    import torch

    class Scaler:
        def __init__(self, scale):
            self.scale = scale

        def state_dict(self):
            return {"scale": self.scale}

        def load_state_dict(self, state):
            self.scale = state["scale"]

    peer, behind = _group(_Manager(), seed=0, scaler=Scaler(1024.0)), _group(_Manager(), seed=1, scaler=Scaler(8.0))
    for hook, bias in ((peer, [0.5, -0.25, 0.0]), (behind, [0.0, 0.0, 0.0])):
        moe = torch.nn.Module()
        moe.expert_bias = torch.tensor(bias)
        hook.moe = {"layers.1.moe": moe}
    for _ in range(3):  # the peer trained
        for _, p in peer.named[:2]:
            p.grad = torch.ones_like(p)
        peer.optimizer.step()
    peer.state.step, peer.state.skipped_steps, peer.state.early_loss = 7, 2, 3.5
    load, _ = behind.manager.fns["scaletrain"]
    _, save = peer.manager.fns["scaletrain"]
    load(save())
    assert (behind.state.step, behind.state.skipped_steps, behind.state.early_loss) == (7, 2, 3.5)
    assert behind.scaler.scale == 1024.0 and behind.healed == 1 and behind.refreshed == [1]
    assert torch.equal(behind.moe["layers.1.moe"].expert_bias, torch.tensor([0.5, -0.25, 0.0]))
    for (n, p), (_, q) in zip(peer.named, behind.named, strict=True):
        assert torch.equal(p, q), n  # (a frozen one too: the hook's weights are the run's named ones)
    for hook in (peer, behind):
        for _, p in hook.named[:2]:
            p.grad = torch.full_like(p, -0.5)
        hook.optimizer.step()
    for (_, p), (_, q) in zip(peer.named[:2], behind.named[:2], strict=True):
        assert torch.equal(p, q)


def test_a_peer_with_other_settings_gives_nothing_to_a_group_behind_it():
    import torch

    peer, behind = _group(_Manager(), seed=0), _group(_Manager(), seed=1)
    peer.fingerprint, behind.fingerprint = "aaaa", "bbbb"
    before = [p.clone() for _, p in behind.named]
    with pytest.raises(RuntimeError, match=r"^replica group 0 was to take the run's state from a peer whose settings "
                                           r"differ from its own .* restarts, to heal from a group that agrees"):
        behind.manager.fns["scaletrain"][0](peer.manager.fns["scaletrain"][1]())
    behind.disagreement = lambda: "this group is the odd one"  # refused at this quorum: it takes nothing either
    behind.manager.fns["scaletrain"][0](peer.manager.fns["scaletrain"][1]())
    assert all(torch.equal(p, b) for (_, p), b in zip(behind.named, before, strict=True)) and behind.healed == 0


def test_the_vote_the_writer_and_the_counts_are_the_managers():
    """A step the quorum does not commit is skipped (and counted, and said with what failed and how many groups
    were in it); the checkpoint writer is the lowest replica id in the quorum, whichever id that is; torchft's
    committed count goes into the checkpoint and back."""
    from scaletrain.parallel.fault_tolerance import VOTE_MARGIN_S

    class Recorded:
        original_exception = RuntimeError("Connection closed by peer [127.0.0.1]:1")

    hook = _group(_Manager(participants=2, rank_in_quorum=0, commit=False, error=Recorded()), replica_id=2,
                  step_timeout_s=7.0)
    hook.begin_step(1.0)
    hook.joined = True  # (as start() leaves it: the next step joins no second quorum)
    assert hook.agree_to_skip(False) is True and hook.uncommitted == 1
    assert hook.manager.vote_timeout.total_seconds() == 2 * 7.0 + VOTE_MARGIN_S
    assert hook.skip_reason() == ("not committed by the replica groups (a group failed in it: RuntimeError: "
                                  "Connection closed by peer [127.0.0.1]:1; 2 in its quorum)")
    assert hook.writes_checkpoint()  # group 2, the lowest id alive
    assert hook.metrics() == {"ft_groups": 2.0, "ft_uncommitted": 1.0, "ft_healed": 0.0}
    hook.manager.commit, hook.manager.error = True, None
    assert hook.agree_to_skip(True) is True and hook.agree_to_skip(False) is False and hook.uncommitted == 1
    assert hook.skip_reason() is None
    hook.manager.rank_in_quorum = 1  # the next quorum has a lower id alive
    assert hook.writes_checkpoint()  # as of the last quorum formed (torchft's next one is not waited for)
    hook.joined = False  # (the next step joins its quorum)
    hook.begin_step(1.0)
    assert not hook.writes_checkpoint()
    assert hook.state_dict() == {"committed_steps": 11, "batches_committed": 44}
    hook.load_state_dict(hook.state_dict())
    assert hook.manager.loaded == {"step": 11, "batches_committed": 44}
    hook.manager.loaded = None
    hook.load_state_dict(None)  # a fresh run: torchft's count left at zero
    assert hook.manager.loaded is None and hook.data_outer == (2, 3)


def test_each_step_joins_one_quorum_and_a_heal_mid_run_restarts_the_group():
    from scaletrain.errors import QuorumNotFormed

    hook = _group(_Manager(participants=3))
    hook.start()
    hook.begin_step(1.0)  # the quorum start() joined
    assert hook.manager.quorums == 1 and hook.participants == 3
    hook.begin_step(1.0)
    assert hook.manager.quorums == 2
    hook.manager.start_quorum = lambda: setattr(hook.state, "step", 9)  # behind the quorum: healed to step 9
    with pytest.raises(RuntimeError, match="was behind the quorum at step 0 and healed to step 9 mid-run"):
        hook.begin_step(1.0)

    def too_few():
        raise TimeoutError("quorum timed out")

    hook.state.step = 4
    hook.manager.start_quorum = too_few
    with pytest.raises(QuorumNotFormed, match=r"^replica group 0 gave up at step 5: fewer than the 1 groups it needs "
                                              r"\(fault_tolerance.min_replicas\) joined its quorum in 0 s "
                                              r"\(fault_tolerance.quorum_timeout_s=60\); it stops with exit code 3"):
        hook.begin_step(1.0)
    hook.manager.start_quorum = lambda: (_ for _ in ()).throw(ValueError("another failure"))
    with pytest.raises(ValueError, match="another failure"):  # not a timeout: torchft's own error, as it is
        hook.begin_step(1.0)


class _TorchFT:
    """torchft as ReplicaGroups.for_run imports it: its Manager and ProcessGroupGloo record what they are given."""

    def __init__(self):
        self.managers: list = []
        ft = self

        class ProcessGroupGloo:
            def __init__(self, timeout):
                self.timeout = timeout

        class Manager(_Manager):
            def __init__(self, **kwargs):
                super().__init__()
                self.kwargs = kwargs
                self._client = types.SimpleNamespace(_quorum=lambda *a, **k: (ft.asked.append((a, k)), ft.quorum)[1],
                                                     ids="the client's own")
                ft.managers.append(self)

        self.Manager, self.ProcessGroupGloo = Manager, ProcessGroupGloo
        self.quorum, self.asked = None, []


def _for_run(tmp_path, monkeypatch, rank=0, world=2, hooks=(), host="127.0.0.1", **overrides):
    """ReplicaGroups.for_run on rank `rank` of a group of `world`, torchft stood in for, a Lighthouse that
    answers (a socket listening on loopback, named `host`): (the hook, the Manager it made, the config)."""
    import socket

    import torch

    from scaletrain.layout import Layout
    from scaletrain.parallel.fault_tolerance import ReplicaGroups

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    torchft = _TorchFT()
    monkeypatch.setitem(sys.modules, "torchft", torchft)
    cfg = micro_cfg(tmp_path, **{**FT, "fault_tolerance.lighthouse": f"http://{host}:{port}", **overrides})
    shared = []  # what this rank gave rank 0's broadcasts (the Lighthouse's problem, the store's port)
    told = iter([None, 4242])  # what rank 0 told the others: no problem, the store's port

    def broadcast(v):
        shared.append(v)
        return v if rank == 0 else next(told)

    rt = types.SimpleNamespace(rank=rank, world_size=world, layout=Layout.from_config(cfg, world), shared=broadcast)
    named = [("w", torch.nn.Parameter(torch.zeros(3)))]
    optimizer = torch.optim.SGD([named[0][1]], lr=0.1)
    state, scaler = types.SimpleNamespace(step=0, skipped_steps=0, early_loss=None), object()
    refresh = lambda: None  # noqa: E731
    try:
        hook = ReplicaGroups.for_run(cfg, rt, named, optimizer, state, refresh, scaler=scaler, hooks=hooks)
    finally:
        listener.close()
    if hook is not None:
        assert (hook.named, hook.optimizer, hook.state, hook.refresh, hook.scaler) == \
            (named, optimizer, state, refresh, scaler)
    return hook, (torchft.managers[0] if torchft.managers else None), cfg, torchft, shared


def test_the_run_hook_gives_torchft_every_fault_tolerance_option(tmp_path, monkeypatch):
    """ReplicaGroups.for_run (the hook a run with fault_tolerance.enabled builds) passes every
    [fault_tolerance] value, each set off its default here, to torchft's Manager and to the hook:
    the timeouts, the quorum's size, this rank's place, the group's name at the Lighthouse (its
    settings' fingerprint, then its id) and the store rank 0 serves."""
    import logging
    from datetime import timedelta

    from scaletrain.layout import Layout
    from scaletrain.parallel.fault_tolerance import VOTE_MARGIN_S, ReplicaGroups, replica_name, settings_fingerprint

    logging.getLogger("torchft").setLevel(logging.INFO)
    hook, manager, cfg, _, shared = _for_run(
        tmp_path, monkeypatch, **{"fault_tolerance.groups": 5, "fault_tolerance.replica_id": 3,
                                  "fault_tolerance.min_replicas": 2, "fault_tolerance.quorum_timeout_s": 7.5,
                                  "fault_tolerance.step_timeout_s": 4.25})
    fingerprint = settings_fingerprint(cfg, Layout.from_config(cfg, 2))
    kw = manager.kwargs
    assert type(hook) is ReplicaGroups
    assert kw["pg"].timeout == timedelta(seconds=4.25) and kw["timeout"] == timedelta(seconds=4.25)
    assert kw["quorum_timeout"] == timedelta(seconds=7.5) and kw["connect_timeout"] == timedelta(seconds=7.5)
    assert (kw["min_replica_size"], kw["rank"], kw["world_size"], kw["use_async_quorum"], kw["init_sync"]) == \
        (2, 0, 2, False, False)
    assert (kw["load_state_dict"], kw["state_dict"]) == (None, None)  # the hook registers its own below
    assert kw["replica_id"] == replica_name(3, fingerprint) == f"{fingerprint}-group0003"
    assert kw["lighthouse_addr"] == cfg.fault_tolerance.lighthouse
    assert (kw["store_addr"], kw["hostname"]) == ("127.0.0.1", "127.0.0.1")  # a Lighthouse on loopback
    assert kw["store_port"] == hook.store.port and hook.store.port > 0 and shared == [None, hook.store.port]
    assert (hook.replica_id, hook.groups, hook.min_replicas, hook.quorum_timeout_s, hook.rank) == (3, 5, 2, 7.5, 0)
    assert hook.lighthouse == cfg.fault_tolerance.lighthouse and hook.data_outer == (3, 5)
    assert hook.vote_timeout == timedelta(seconds=2 * 4.25 + VOTE_MARGIN_S)
    assert hook.fingerprint == fingerprint and hook.moe == {}
    assert set(manager.fns) == {"scaletrain"}  # the state a healing peer receives
    assert logging.getLogger("torchft").level == logging.CRITICAL  # its tracebacks are ours to say in a line


def test_the_run_hook_checks_each_quorum_for_groups_that_disagree(tmp_path, monkeypatch):
    """The Manager's client is wrapped: each quorum it returns is checked against this group's
    fingerprint before anything else (a group named with other settings is the disagreement said)."""
    from scaletrain.parallel.fault_tolerance import replica_name

    hook, manager, _, torchft, _ = _for_run(tmp_path, monkeypatch, **{"fault_tolerance.replica_id": 1})
    assert hook.disagreement() is None and manager._client.ids == "the client's own"
    mine = manager.kwargs["replica_id"]
    torchft.quorum = types.SimpleNamespace(replica_ids=[replica_name(0, hook.fingerprint), mine])
    assert manager._client._quorum(7, timeout=3) is torchft.quorum and hook.disagreement() is None
    assert torchft.asked == [((7,), {"timeout": 3})]  # what torchft asks its client, passed on whole
    other = "0000" + hook.fingerprint[4:]  # another model (its first kind's digits)
    assert other != hook.fingerprint
    torchft.quorum = types.SimpleNamespace(replica_ids=[replica_name(0, other), mine])
    manager._client._quorum()
    said = hook.disagreement()
    assert said is not None and said.startswith("replica group 1 runs another model (model.*) than group(s) 0 "), said


def test_the_run_hook_of_other_ranks_and_runs(tmp_path, monkeypatch):
    """Off: no hook, torchft not asked. Rank 1: no store of its own, rank 0's port; diloco across the
    groups: the outer loop from [parallel.sync]; a mixture: its layers' routing biases kept together."""
    import torch

    from scaletrain.parallel.fault_tolerance import ReplicaGroupsOuter
    from scaletrain.parallel.moe_balance import MoEBalance

    hook, manager, *_ = _for_run(tmp_path, monkeypatch, **{"fault_tolerance.enabled": False})
    assert hook is None and manager is None
    hook, manager, *_ = _for_run(tmp_path, monkeypatch, rank=1)
    assert hook.store is None and manager.kwargs["store_port"] == 4242 and manager.kwargs["rank"] == hook.rank == 1
    # only rank 0 asks the Lighthouse (and tells the others what it found): rank 1 does not wait on it
    from scaletrain.parallel import fault_tolerance

    asked = []
    monkeypatch.setattr(fault_tolerance, "lighthouse_problem", lambda *a: asked.append(a))
    _for_run(tmp_path, monkeypatch, rank=1)
    assert asked == []
    _for_run(tmp_path, monkeypatch, rank=0, **{"fault_tolerance.quorum_timeout_s": 0.5})
    assert len(asked) == 1 and asked[0][1] == 0.5
    hook, manager, *_ = _for_run(tmp_path, monkeypatch, world=1, **{
        "parallel.sync.mode": "diloco", "parallel.sync.every": 3, "parallel.sync.outer_lr": 0.4,
        "parallel.sync.outer_momentum": 0.3, "parallel.sync.outer_on_cpu": True})
    outer = hook.outer
    assert type(hook) is ReplicaGroupsOuter and hook.discarded == 0
    assert (outer.mode, outer.every, outer.lr, outer.momentum, outer.nesterov, outer.on_cpu) == \
        ("diloco", 3, 0.4, 0.3, True, True)  # Nesterov: the config's default outer optimizer
    assert (outer.fragments, outer.delay) == (1, 0) and outer.comm.hook is hook  # whole, at once, through torchft
    hook, *_ = _for_run(tmp_path, monkeypatch, world=1, **{"parallel.sync.mode": "diloco",
                                                          "parallel.sync.outer_optimizer": "sgd"})
    assert hook.outer.nesterov is False
    balance = MoEBalance.__new__(MoEBalance)
    balance.layers = {"layers.0.moe": torch.nn.Module()}
    hook, *_ = _for_run(tmp_path, monkeypatch, hooks=(object(), balance))
    assert hook.moe is balance.layers


def test_a_fresh_group_has_joined_nothing_skipped_nothing_and_writes_until_a_quorum_says_otherwise():
    """Before its first quorum: no skip to explain, no groups counted, nothing healed; it would write
    a checkpoint (a group stopped during its start-up saves); a first step without start() joins
    its quorum. Each step not committed and each heal counts once more."""
    hook = _group(_Manager(participants=2))
    assert hook.skip_reason() is None and hook.writes_checkpoint() is True and hook.fingerprint == ""
    assert hook.metrics() == {"ft_groups": 0.0, "ft_uncommitted": 0.0, "ft_healed": 0.0}
    hook.begin_step(1.0)
    assert hook.manager.quorums == 1 and hook.metrics()["ft_groups"] == 2.0
    hook.manager.commit = False
    assert hook.agree_to_skip(False) and hook.agree_to_skip(False) and hook.uncommitted == 2
    assert hook.skip_reason() == "not committed by the replica groups (a group failed in it; 2 in its quorum)"
    peer = _group(_Manager())
    for _ in range(2):
        hook.manager.fns["scaletrain"][0](peer.manager.fns["scaletrain"][1]())
    assert hook.healed == 2 and hook.metrics()["ft_healed"] == 2.0


@pytest.mark.parametrize("rank", [0, 1])
def test_a_heal_is_said_once_by_rank_0(rank, capsys):
    hook, peer = _group(_Manager(), rank=rank, replica_id=1), _group(_Manager())
    peer.state.step = 6
    hook.manager.fns["scaletrain"][0](peer.manager.fns["scaletrain"][1]())
    out, err = capsys.readouterr()
    said = ("scaletrain: replica group 1 took the run's state at step 6 from a live peer (it was behind its quorum: "
            "a restart, or a late start)\n")
    assert (out, err) == ("", said if rank == 0 else "")


@pytest.mark.parametrize("min_replicas,lighthouse,why", [
    (2, "", "fewer than fault_tolerance.min_replicas=2 groups are in its quorum yet; it goes on when enough join"),
    (1, "", "the Lighthouse has not formed its quorum yet (groups still joining); it goes on when it does"),
    (1, "closed", "the Lighthouse at {lighthouse} does not answer; it stops"),
])
def test_a_wait_for_the_quorum_is_said_by_rank_0_with_why(min_replicas, lighthouse, why, monkeypatch, capsys):
    """A quorum that takes longer than WAIT_NOTE_S: rank 0 says once that its group waits, at which
    step, why and for how long at most; rank 1 says nothing, nor does anyone when the quorum forms
    in time."""
    from scaletrain.parallel import fault_tolerance

    monkeypatch.setattr(fault_tolerance, "WAIT_NOTE_S", 0.05)
    lighthouse = f"http://127.0.0.1:{_closed_port()}" if lighthouse else ""
    for rank in (0, 1):
        hook = _group(_Manager(), rank=rank, min_replicas=min_replicas, lighthouse=lighthouse, quorum_timeout_s=7.5)
        hook.state.step = 4
        hook.manager.start_quorum = lambda: time.sleep(0.4)
        hook.start()
        out, err = capsys.readouterr()
        said = (f"scaletrain: replica group 0 waits at step 5: {why.format(lighthouse=lighthouse)} (up to "
                "fault_tolerance.quorum_timeout_s=7.5 s)\n")
        assert (out, err) == ("", said if rank == 0 else "")
    hook = _group(_Manager(), lighthouse=lighthouse)
    hook.start()  # formed at once
    time.sleep(0.2)
    assert capsys.readouterr() == ("", "")


def test_a_quorum_that_fails_is_said_for_what_it_is(monkeypatch):
    """torchft's quorum request failing: on a timeout with the Lighthouse answering, the groups that
    joined of those needed (from its status page) and how long it waited, restartable; any other
    error as it is; with the Lighthouse gone, a stop (no restart); a quorum formed with a group that
    disagrees, refused in the disagreement's words."""
    from scaletrain.errors import ConfigError, QuorumNotFormed, TrainingStopped

    address, server = _status_page([b"<p>Quorum: only have 1 participants, need min_replicas 2</p>"])
    try:
        hook = _group(_Manager(), replica_id=1, min_replicas=2, lighthouse=address, quorum_timeout_s=9.0)
        hook.state.step = 3
        hook.manager.start_quorum = lambda: (_ for _ in ()).throw(RuntimeError("Timeout expired after 9s"))
        with pytest.raises(QuorumNotFormed) as e:
            hook.start()
        assert str(e.value) == ("replica group 1 gave up at step 4: 1 of the 2 groups it needs "
                                "(fault_tolerance.min_replicas) joined its quorum in 0 s "
                                "(fault_tolerance.quorum_timeout_s=9); it stops with exit code 3, and its launcher "
                                "restarts it while --max-restarts allows: it joins when enough groups are up")
        hook.manager.start_quorum = lambda: (_ for _ in ()).throw(RuntimeError("connection reset"))
        with pytest.raises(RuntimeError, match="^connection reset$"):
            hook.start()
    finally:
        server.shutdown()
        server.server_close()
    gone = f"http://127.0.0.1:{_closed_port()}"
    hook = _group(_Manager(), lighthouse=gone)
    hook.state.step = 3
    hook.manager.start_quorum = lambda: (_ for _ in ()).throw(RuntimeError("Timeout expired"))
    with pytest.raises(TrainingStopped) as e:
        hook.start()
    assert str(e.value).startswith(f"replica group 0 stops at step 3: the Lighthouse at {gone} no longer answers")
    hook = _group(_Manager(rank_in_quorum=1))
    hook.disagreement = lambda: "replica group 0 runs another model"
    with pytest.raises(ConfigError, match="^replica group 0 runs another model$"):
        hook.start()
    assert hook.writes_checkpoint() is True  # (left as it was: the refused quorum decides nothing)
    hook.disagreement = lambda: None
    hook.start()
    assert hook.writes_checkpoint() is False  # another group holds the lowest id of this quorum


def test_which_failures_are_a_quorum_timing_out():
    from scaletrain.parallel.fault_tolerance import _timed_out

    assert _timed_out(TimeoutError("no words of a timeout here"))
    assert _timed_out(RuntimeError("Timeout expired after 60s"))  # torchft's
    assert _timed_out(RuntimeError("the connect TIMED OUT"))
    assert not _timed_out(RuntimeError("Connection refused"))


def test_the_lighthouse_check_reads_the_address_and_waits_for_it():
    """`lighthouse_problem`: an address without a port, or with a port out of range, is not HOST:PORT;
    one without the scheme is read as http; a Lighthouse that comes up within the timeout is found;
    one that does not is said with the system's reason."""
    import errno
    import socket
    import threading

    from scaletrain.parallel.fault_tolerance import lighthouse_problem

    for bad in ("http://127.0.0.1", "http://127.0.0.1:99999"):
        assert lighthouse_problem(bad, 0.1) == (f"fault_tolerance.lighthouse={bad!r} is not http://HOST:PORT; give the "
                                               "address `scaletrain lighthouse` prints")
    port = _closed_port()
    listener = socket.socket()
    threading.Timer(0.5, lambda: (listener.bind(("127.0.0.1", port)), listener.listen())).start()
    try:
        assert lighthouse_problem(f"127.0.0.1:{port}", 10.0) is None  # up after half a second; no scheme given
    finally:
        time.sleep(0.6)
        listener.close()
    gone = _closed_port()
    assert lighthouse_problem(f"http://127.0.0.1:{gone}", 0.3) == (
        f"the Lighthouse at http://127.0.0.1:{gone} is unreachable after fault_tolerance.quorum_timeout_s=0.3 s "
        f"({os.strerror(errno.ECONNREFUSED)}); start it with `scaletrain lighthouse`, or fix "
        "fault_tolerance.lighthouse")


def test_a_groups_name_without_a_fingerprint_is_its_id_alone():
    from scaletrain.parallel.fault_tolerance import replica_name

    assert replica_name(3) == "group0003" and replica_name(12, "ab12cd34") == "ab12cd34-group0012"


def test_a_group_that_differs_in_two_kinds_names_every_group_it_differs_from():
    """Four groups: group 1 differs in its model from groups 0 and 2 and in its optimizer from 0 and 3."""
    from scaletrain.parallel.fault_tolerance import FINGERPRINTED, disagreement

    def name(gid, model, optim):
        rest = "0000" * (len(FINGERPRINTED) - 2)
        return f"{model}{optim}{rest}-group{gid:04d}:uuid"

    ids = [name(0, "aaaa", "bbbb"), name(1, "xxxx", "yyyy"), name(2, "aaaa", "cccc"), name(3, "dddd", "bbbb")]
    said = disagreement(1, ids)
    assert said.startswith("replica group 1 runs another model (model.*) and another optimizer and learning-rate "
                           "schedule (optim.*) than group(s) 0, 2, 3 of its quorum"), said


def test_the_healing_transfers_quiet_only_their_access_lines_and_their_one_warning(monkeypatch, capsys):
    import warnings
    from http.server import BaseHTTPRequestHandler

    from scaletrain.parallel.fault_tolerance import _quiet_healing_transfers

    monkeypatch.setattr(BaseHTTPRequestHandler, "log_request", BaseHTTPRequestHandler.log_request)  # put back after
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _quiet_healing_transfers()
        handler = BaseHTTPRequestHandler.__new__(BaseHTTPRequestHandler)
        handler.log_request(200)  # an access line: nothing printed
        warnings.warn("The given buffer is not writable, and PyTorch does not support ...", UserWarning, stacklevel=1)
        warnings.warn("another warning", UserWarning, stacklevel=1)
        warnings.warn("The given buffer is not writable", DeprecationWarning, stacklevel=1)
    assert [(w.category, str(w.message)) for w in seen] == [(UserWarning, "another warning"),
                                                             (DeprecationWarning, "The given buffer is not writable")]
    assert capsys.readouterr() == ("", "")


def test_a_lighthouse_on_another_host_name_serves_the_groups_store_by_this_hosts_name(tmp_path, monkeypatch):
    """With the Lighthouse named by a host name (not loopback), the group's store and Manager are
    reached by this host's name, so that groups on other machines can."""
    import socket

    name = socket.gethostname()
    try:
        address = socket.gethostbyname(name)
    except OSError:
        pytest.skip(f"this host's name {name!r} does not resolve")
    if not address.startswith("127."):
        pytest.skip(f"this host's name {name!r} leads to {address}, not to loopback where the test's Lighthouse is")
    hook, manager, *_ = _for_run(tmp_path, monkeypatch, host=name)
    assert manager.kwargs["store_addr"] == manager.kwargs["hostname"] == name


def test_a_parameters_local_part_is_its_shard_under_fsdp_and_itself_otherwise():
    """The healing copy and the optimizer state travel as each rank's local part: a DTensor's
    to_local(), a parameter's data, any other tensor as it is."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from scaletrain.parallel.fault_tolerance import _local
    from scaletrain.plan.trace import release_fake_world

    release_fake_world()  # (a fake group a planner test may have left in this process)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        whole = torch.arange(6.0).reshape(3, 2)
        sharded = torch.nn.Parameter(distribute_tensor(whole, init_device_mesh("cpu", (1,)), [Shard(0)]))
        local = _local(sharded)
        assert type(local) is torch.Tensor and torch.equal(local, whole)
        plain = torch.nn.Parameter(whole.clone())
        assert type(_local(plain)) is torch.Tensor and _local(plain).data_ptr() == plain.data_ptr()
        assert _local(whole) is whole
    finally:
        dist.destroy_process_group()
