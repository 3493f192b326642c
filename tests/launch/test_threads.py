"""Intra-op threads on a shared machine (scaletrain.threads): how many, how idle ones wait, the
line when the machine is busy, and a real `scaletrain train` that runs with them."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from scaletrain import threads
from scaletrain.threads import choose

from conftest import CLI_MICRO, REPO

IDLE = 0.0


@pytest.mark.parametrize("cores, ranks, load, want", [
    (2, 1, IDLE, 2),  # an idle machine: torch's own default, one thread per core
    (2, 1, 0.3, 2),  # a load left by a job that just ended is no busy core
    (2, 1, 0.6, 1),  # one core busy: the job keeps to the other
    (2, 1, 5.0, 1),  # both busy (the shared 2-core machine of issue 47): one thread
    (16, 4, 3.6, 3),  # 4 busy cores: the 12 left shared by 4 ranks
    (16, 4, IDLE, 4),
    (16, 4, 40.0, 1),  # never fewer than one
    (2, 4, IDLE, 1),  # more ranks than cores: one each
    (8, 1, None, 8),  # a load the OS does not give: taken as idle
])
def test_threads_are_the_cores_shared_by_the_ranks_less_the_busy_ones(cores, ranks, load, want):
    choice = choose(cores, ranks, load, {})
    assert choice.threads == want and not choice.given


@pytest.mark.parametrize("load, running, want", [
    (1.8, 0.0, 2),  # the average still holds a job that ended seconds ago; nothing runs now
    (0.2, 3.0, 2),  # work that started a moment ago: the average does not show it yet
    (5.0, 4.0, 1),  # busy by both
    (5.0, 1.0, 1),  # one core busy now
    (None, 2.0, 1),  # the running threads alone, where the average is not given
])
def test_the_busy_cores_are_the_lower_of_the_load_average_and_the_threads_running_now(load, running, want):
    assert choose(2, 1, load, {}, running=running).threads == want


def test_the_users_omp_num_threads_is_kept_under_any_load():
    assert choose(2, 1, 5.0, {"OMP_NUM_THREADS": "2"}).threads == 2
    assert choose(2, 1, IDLE, {"OMP_NUM_THREADS": "1"}).threads == 1
    assert choose(16, 1, IDLE, {"OMP_NUM_THREADS": "4,2"}).threads == 4  # nested levels: torch runs the first
    assert all(choose(2, 1, 5.0, {"OMP_NUM_THREADS": v}).given for v in ("2", "1", "4,2"))
    assert threads.rank_env(choose(2, 2, IDLE, {"OMP_NUM_THREADS": "3"}), {"OMP_NUM_THREADS": "3"}) == \
        {"OMP_WAIT_POLICY": "PASSIVE"}  # the launcher passes the user's on as it is


def test_idle_threads_sleep_unless_the_user_chose_how_they_wait():
    assert threads.wait_env({}) == {"OMP_WAIT_POLICY": "PASSIVE"}
    for var, value in (("OMP_WAIT_POLICY", "ACTIVE"), ("GOMP_SPINCOUNT", "300000"), ("KMP_BLOCKTIME", "0")):
        assert threads.wait_env({var: value}) == {}
    assert threads.rank_env(choose(8, 2, 2.2, {}), {}) == {"OMP_NUM_THREADS": "3", "OMP_WAIT_POLICY": "PASSIVE"}


def test_a_busy_machine_is_one_line_naming_the_load_the_threads_and_the_override():
    assert choose(2, 1, 5.04, {}).note() == (
        "threads: 1 intra-op thread(s), not 2: the machine is busy (load average 5.0 over the last minute, on 2 "
        "core(s)); with this job's 1 thread(s) it has more to run than cores, so each step is slower than on an "
        "idle machine; OMP_NUM_THREADS=N sets the threads")
    assert "(load average 5.0 over the last minute, 4 other thread(s) running now, on 2 core(s))" in \
        choose(2, 1, 5.0, {}, running=4.2).note()
    # one core busy of two: the threads were cut, the machine is not over its cores
    assert choose(2, 1, 1.0, {}).note() == (
        "threads: 1 intra-op thread(s), not 2: the machine is busy (load average 1.0 over the last minute, on 2 "
        "core(s)); OMP_NUM_THREADS=N sets the threads")
    assert choose(2, 1, 3.0, {"OMP_NUM_THREADS": "2"}).note() == (
        "threads: OMP_NUM_THREADS=2 intra-op thread(s), as set: the machine is busy (load average 3.0 over the last "
        "minute, on 2 core(s)); with this job's 2 thread(s) it has more to run than cores, so each step is slower "
        "than on an idle machine")
    assert "4 intra-op thread(s) per rank, not 8: " in choose(32, 4, 14.0, {}).note()


@pytest.mark.parametrize("cores, ranks, load, env", [
    (2, 1, IDLE, {}), (2, 1, 0.3, {}), (2, 1, None, {}), (16, 4, IDLE, {}), (2, 1, 1.8, {"running": 0.0}),
    (1, 2, IDLE, {"OMP_NUM_THREADS": "1"}),  # more ranks than cores, nothing else: the launch says that
    (2, 1, 5.0, {"OMP_NUM_THREADS": "1"}),  # busy, but the user's one thread is all there is to cut to
])
def test_no_line_on_an_idle_machine(cores, ranks, load, env):
    running = env.pop("running", None)
    assert choose(cores, ranks, load, env, running=running).note() is None


def test_the_launcher_gives_its_ranks_the_chosen_threads_and_wait(monkeypatch):
    """What `scaletrain train --nproc N` starts its ranks with, the user's variables unset, then
    restored: the threads of `on_this_node(N)` and the passive wait."""
    import torch.distributed.launcher.api as api

    from scaletrain.launch import launcher

    seen = {}

    def fake_launch(config, entrypoint):
        seen.update({k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")})
        return lambda *args: None

    for var in ("OMP_NUM_THREADS", *threads.WAIT_VARS):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(api, "elastic_launch", fake_launch)
    monkeypatch.setattr(threads, "load_average", lambda: 0.0)  # an idle machine: the cores shared
    monkeypatch.setattr(threads, "running_now", lambda: 0.0)
    monkeypatch.setattr("scaletrain.hardware.cpu_cores", lambda: 8)
    assert launcher.launch("train", [], nproc=2) == 0
    assert seen == {"OMP_NUM_THREADS": "4", "OMP_WAIT_POLICY": "PASSIVE"}
    assert "OMP_NUM_THREADS" not in os.environ and "OMP_WAIT_POLICY" not in os.environ


def busy_machine(cores: int):
    """Real load: busy loops (at the lowest priority: they count in the load average, and yield
    to the work of whoever shares the machine) until the 1-minute load average is a core over
    `cores`, which takes about 20 s from idle. Returns the loops, to stop."""
    loops = [subprocess.Popen(["nice", "-n", "19", sys.executable, "-c", "while True: pass"])
             for _ in range(3 * cores + 2)]
    deadline = time.monotonic() + 120
    while os.getloadavg()[0] < cores + 1 and time.monotonic() < deadline:
        time.sleep(1)
    return loops


@pytest.mark.slow
def test_scaletrain_train_on_a_busy_machine_runs_one_thread_that_sleeps_and_says_why(tmp_path):
    """A real `scaletrain train`, OMP variables unset, started while other work keeps every core
    busy: torch runs one intra-op thread, OpenMP's idle threads sleep, and one line says so."""
    cores = len(os.sched_getaffinity(0))
    loops = busy_machine(cores)
    try:
        load = os.getloadavg()[0]
        assert load >= cores + 0.5, f"the busy loops did not raise the load average ({load:.1f}) in 2 min"
        env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", *threads.WAIT_VARS)}
        env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), str(REPO / "tests" / "launch")])
        r = subprocess.run([sys.executable, "-m", "scaletrain", "train", *CLI_MICRO, "--train.steps=1",
                            "--train.device=cpu", "--rank-hook", "threads_probe:report",
                            f"--log.run_dir={tmp_path / 'run'}"],
                           capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    finally:
        for p in loops:
            p.kill()
            p.wait()
    assert r.returncode == 0, r.stderr
    assert "probe: threads 1 wait PASSIVE" in r.stderr.splitlines(), r.stderr
    notes = [line for line in r.stderr.splitlines() if line.startswith("scaletrain: threads: ")]
    assert len(notes) == 1, r.stderr
    assert notes[0].startswith("scaletrain: threads: 1 intra-op thread(s)") and "the machine is busy (load average " \
        in notes[0] and f"on {cores} core(s))" in notes[0] and notes[0].endswith("OMP_NUM_THREADS=N sets the threads")
