"""A group's ranks forked from a process that has imported torch and scaletrain already (tests only).

Starting a rank the launcher's way (a fresh `python -m scaletrain.launch.worker`) costs it about
3 s of CPU before its first step (measured on a 2-core machine), importing torch, DTensor and the
trainer; the suite starts about 140 ranks. Here one fork server per test process
(multiprocessing's "forkserver", single-threaded, so forking it is safe) imports them once, and
each rank is a fork of it that joins the group from the environment torchrun would have given it
and runs the task as `python -m scaletrain.launch.worker TASK ARGS` does
(scaletrain.launch.worker.main): the same exit codes, failure reports and exit without teardown.
What the launcher itself does (restarts, signals, the one-line summary of a failed job) is tested
through the launcher, by the tests that start it (conftest.launch_here, the CLI).
"""

from __future__ import annotations

import functools
import gc
import multiprocessing
import os
import signal
import socket
import sys
import tempfile
import threading
import time

_starting = threading.Lock()


def _server():
    with _starting:  # groups start from several threads (replica groups); the first starts the server
        return _start_server()


@functools.cache
def _start_server():
    """The fork server, started now with this folder on its import path: it imports dist_worker (torch,
    DTensor, the trainer) once, and each rank forked from it starts with them imported. (Python 3.11's
    fork server is handed the parent's sys.path but does not use it for its preload, which it skips
    without a word when the import fails: this folder, which pytest puts on sys.path at run time, has
    to reach it through PYTHONPATH.)"""
    from multiprocessing import forkserver

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["dist_worker"])
    here, saved = os.path.dirname(os.path.abspath(__file__)), os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, saved) if p)
    try:
        forkserver.ensure_running()
    finally:
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved
    return ctx


@functools.cache
def _ports_given() -> tuple[threading.Lock, set[int]]:
    return threading.Lock(), set()


def _free_port() -> int:
    """A free loopback port that this process has not handed out before: groups started from two
    threads at once (replica groups) must not get the same one between our probe and their rank
    0's bind. (Starting processes from several threads is safe: the fork server has its own lock.)"""
    lock, given = _ports_given()
    with lock:
        while True:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            if port not in given:
                given.add(port)
                return port


def _rank(rank: int, world: int, port: int, error_dir: str, stderr_path: str, env: dict, cwd: str, task: str,
          args: list[str]) -> None:
    gc.freeze()  # the fork server's objects, never collected here: the collector leaves their pages shared
    os.chdir(cwd)  # the test's, now: the server was forked from the first test that started ranks
    os.environ.clear()
    os.environ.update({**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                       "LOCAL_WORLD_SIZE": str(world), "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
                       "TORCHELASTIC_ERROR_FILE": os.path.join(error_dir, f"error_{rank}.json")})
    fd = os.open(stderr_path, os.O_WRONLY | os.O_APPEND)
    os.dup2(fd, 2)
    os.close(fd)
    if "dist_worker" not in sys.modules:  # each rank would import torch and the trainer itself: 3 s of CPU
        raise RuntimeError("tests/forked_ranks.py: the fork server did not preload dist_worker")
    from scaletrain.launch import worker

    worker.main([task, *args])  # leaves by os._exit with the task's code


def run_forked(task: str, args: list[str], nproc: int, timeout: float = 600) -> tuple[int, str]:
    """Run `task` (MODULE:FUNCTION) with `args` on `nproc` forked ranks; returns (exit code, the
    ranks' stderr). Several groups may run at once, each from its own thread. The first rank to
    fail stops the others (SIGTERM, then SIGKILL), as the launcher does; its code is the group's.
    Past `timeout` every rank is stopped: 143."""
    ctx = _server()
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="scaletrain-forked-") as tmp:
        err_path = os.path.join(tmp, "stderr")
        open(err_path, "w").close()
        procs = [ctx.Process(target=_rank, args=(r, nproc, port, tmp, err_path, dict(os.environ), os.getcwd(), task,
                                                 list(args))) for r in range(nproc)]
        for p in procs:
            p.start()
        deadline, code, killed = time.monotonic() + timeout, 0, ""
        while any(p.exitcode is None for p in procs):
            failed = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if failed or time.monotonic() > deadline:
                code = failed[0][1] if failed else 143
                # a rank ended by a signal that no one here sent writes nothing itself: say which and which
                killed = "".join(f"tests/forked_ranks.py: rank {r} ended by signal {signal.Signals(-c).name}\n"
                                 for r, c in failed if c < 0)
                _stop(procs)
                break
            for p in procs:
                p.join(0.05)
        if not code:
            code = next((p.exitcode for p in procs if p.exitcode), 0)
        with open(err_path) as f:
            return (code if code >= 0 else 128 - code), f.read() + killed


def _stop(procs) -> None:
    for p in procs:
        if p.exitcode is None:
            p.terminate()
    for p in procs:
        p.join(30)
        if p.exitcode is None:
            os.kill(p.pid, signal.SIGKILL)
            p.join()
