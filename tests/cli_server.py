"""`scaletrain` commands forked from a process that has imported torch and scaletrain already (tests only).

A fresh `python -m scaletrain` spends 3-6 s of CPU here importing torch before it reads its first option;
the docs' runnable blocks run about 60 such commands. Here one server per test process imports
scaletrain's command line and the library behind its verbs once, and each command is a fork of it: the
`scaletrain` shim on a docs block's PATH (tests/cli/docs_blocks.py) connects to the server's Unix socket,
hands over its command line, folder, environment, import path, umask, signal dispositions and its own
stdin, stdout and stderr (the file descriptors themselves, SCM_RIGHTS), and exits as the command did
(the same code, or killed by the same signal). A signal sent to the shim (a timeout's SIGTERM, a Ctrl-C)
is passed on to the command; a shim that dies takes its command with it.

What a fresh interpreter would give that a fork does not is made so in the fork: the environment
(os.environ and the C library's), the folder and umask, sys.path as `python -m` builds it (the current
folder first), sys.argv, the dispositions of the signals the shim found ignored, fresh random seeds, the
process group of the shim, the number of intra-op threads OMP_NUM_THREADS asks for; at the end the
interpreter's own exit: non-daemon threads joined, atexit handlers run, the streams flushed. What
cannot be made so, the server refuses and the shim starts a fresh interpreter instead: a scaletrain
other than the one preloaded on the command's import path, or an environment variable that torch or
OpenMP read at import (OMP_*, KMP_*, GOMP_*, MKL_*, PYTORCH_*, TORCH_*), or the interpreter at its start
(PYTHON*, but PYTHONPATH, which is the import path above), set otherwise than for the server.
The hash seed of str is the server's for every command (a fresh interpreter draws one).

The server is single-threaded, so forking it is safe; it waits on the socket and its children with one
select loop, and ends when the test process that started it does.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import time

# the variables read once, at import, by torch or its OpenMP: a command whose value differs runs fresh
IMPORT_TIME_VARS = ("OMP_", "KMP_", "GOMP_", "MKL_", "PYTORCH_", "TORCH_", "PYTHON")  # PYTHONPATH aside
# the signals whose disposition a command inherits from its shell (ignored ones stay ignored across exec)
INHERITED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
                     signal.SIGUSR2, signal.SIGALRM, signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU)
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
NOT_SERVED = 0xFFFF  # in place of a wait status: the command must start a fresh interpreter
KILL_AFTER_S = 10  # a command whose shim is gone gets SIGTERM, then SIGKILL this much later


def _import_time_env(env: dict) -> dict:
    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME_VARS) and k != "PYTHONPATH"}


# ---------------------------------------------------------------------------------------------------
# the server


def _preload() -> None:
    """What a command imports before its first step, imported once: torch, the command line and the
    modules behind its verbs, with OpenMP's wait policy set first, as `python -m scaletrain` does."""
    from scaletrain import threads

    os.environ.update(threads.wait_env(os.environ))
    import scaletrain.cli  # noqa: F401 (torch, the config, the parsers)
    import scaletrain.cli.train  # noqa: F401
    import scaletrain.train.trainer  # noqa: F401
    import scaletrain.verify  # noqa: F401


def serve(path: str, log_path: str) -> None:
    """Serve commands at the Unix socket `path` until the process that started this one ends; each
    command's CPU seconds (its children's included) appended to `log_path`, a line each."""
    parent = os.getppid()
    log = open(log_path, "a")
    _preload()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(64)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    running: dict[int, tuple[socket.socket, float | None]] = {}  # pid: (its shim's connection, SIGTERM sent at)
    while os.getppid() == parent:
        conns = {c.fileno(): pid for pid, (c, _) in running.items()}
        readable, _, _ = select.select([listener, *(c for c, _ in running.values())], [], [], 0.05)
        for r in readable:
            if r is listener:
                _accept(listener, running)
            else:  # the shim's end closed: it died, so its command goes too
                pid = conns[r.fileno()]
                conn, sent = running[pid]
                if sent is None:
                    _kill(pid, signal.SIGTERM)
                    running[pid] = (conn, time.monotonic())
        for pid, (_, sent) in list(running.items()):
            if sent is not None and time.monotonic() - sent > KILL_AFTER_S:
                _kill(pid, signal.SIGKILL)
        _reap(running, log)
    for pid in running:
        _kill(pid, signal.SIGKILL)


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _reap(running: dict, log) -> None:
    while running:
        try:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        log.write(f"{usage.ru_utime + usage.ru_stime:.3f}\n")  # the command's CPU, its own children's included
        log.flush()
        if pid in running:
            conn, _ = running.pop(pid)
            try:
                conn.send(struct.pack("!i", status))
            except OSError:
                pass
            conn.close()


def _accept(listener: socket.socket, running: dict) -> None:
    conn, _ = listener.accept()
    msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
    request = json.loads(msg)
    reason = _cannot_serve(request)
    if reason or len(fds) != 3:
        for fd in fds:
            os.close(fd)
        conn.send(struct.pack("!i", NOT_SERVED) + (reason or "no stdio").encode())
        conn.close()
        return
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        listener.close()
        for c, _ in running.values():
            c.close()
        conn.close()
        _command(request, fds)  # never returns
    for fd in fds:
        os.close(fd)
    conn.send(struct.pack("!i", pid))
    running[pid] = (conn, None)


def _cannot_serve(request: dict) -> str | None:
    """Why this command cannot be a fork of the server (None: it can)."""
    import importlib.machinery

    import scaletrain

    spec = importlib.machinery.PathFinder.find_spec("scaletrain", [request["cwd"], *request["path"]])
    if spec is None or spec.origin != scaletrain.__file__:
        return f"its scaletrain is {spec and spec.origin}, the server's {scaletrain.__file__}"
    from scaletrain import threads

    env = {**request["env"], **threads.wait_env(request["env"])}  # as `python -m scaletrain` sets it first
    if _import_time_env(env) != _import_time_env(dict(os.environ)):
        return "a variable read when torch is imported differs"
    return None


def _command(request: dict, fds: list[int]) -> None:
    """In the fork: become the fresh `python -m scaletrain ARGS` the shim asked for, run it, exit as it
    would."""
    try:
        os.setpgid(0, request["pgid"])  # the shim's process group, as a child of its shell would be
    except OSError:
        pass
    import ctypes

    ctypes.CDLL(None).prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG: a server that dies stops it
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.umask(request["umask"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.path[:] = [request["cwd"], *request["path"]]
    sys.argv[:] = ["-m", *request["argv"]]
    sys.stdout.reconfigure(line_buffering=os.isatty(1))
    for sig in INHERITED_SIGNALS:
        ignored = sig in request["ignored"]
        default = signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL
        signal.signal(sig, signal.SIG_IGN if ignored else default)
    _reseed()
    os._exit(_run_as_main())


def _reseed() -> None:
    """Fresh seeds, as a fresh interpreter draws (the fork would repeat the server's)."""
    import random

    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()


def _run_as_main() -> int:
    """`python -m scaletrain`: its module run as __main__, then what the interpreter does at exit; the
    exit code."""
    import runpy
    import threading
    import traceback

    code = 0
    try:
        runpy.run_module("scaletrain", run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = _exit_code(e.code)
    except KeyboardInterrupt:  # Python ends by the signal itself: the shell sees 130
        traceback.print_exc()
        _flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    except BaseException:
        traceback.print_exc()
        code = 1
    threading._shutdown()  # the interpreter's exit: non-daemon threads joined, then atexit
    atexit._run_exitfuncs()
    return code if _flush() else 120


def _exit_code(value) -> int:
    if value is None:
        return 0
    if isinstance(value, int):
        return value & 0xFF
    print(value, file=sys.stderr)
    return 1


def _flush() -> bool:
    ok = True
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            ok = False
    return ok


# ---------------------------------------------------------------------------------------------------
# the test's side


class Server:
    """A running server: `socket`, its address for the shims (SCALETRAIN_CLI_SERVER), and `close()`."""

    def __init__(self, folder, pythonpath: str):
        self.socket, self.log = os.path.join(str(folder), "cli.sock"), os.path.join(str(folder), "cpu.log")
        open(self.log, "w").close()
        env = {**os.environ, "PYTHONPATH": pythonpath}
        self.proc = subprocess.Popen([sys.executable, __file__, self.socket, self.log], env=env,
                                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if line != "ready\n":
            self.proc.kill()
            raise RuntimeError(f"tests/cli_server.py did not start: {line!r}, exit code {self.proc.wait()}")

    def cpu_s(self) -> float:
        """The CPU seconds of the commands served so far, their children's included."""
        with open(self.log) as f:
            return sum(float(line) for line in f)

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.proc.stdout.close()


# ---------------------------------------------------------------------------------------------------
# the shim's side: `client(address, argv)` from a `scaletrain` script started by the shell


def client(address: str, argv: list[str], path: list[str]) -> None:
    """Run `python -m scaletrain ARGV` as a fork of the server at `address` and exit as it did; a fresh
    interpreter when the server cannot (or is not there). `path`: the import path of a fresh interpreter,
    less its first entry (the current folder, under `-m`)."""
    ignored = [int(s) for s in INHERITED_SIGNALS if signal.getsignal(s) is signal.SIG_IGN]
    umask = os.umask(0)
    os.umask(umask)
    request = {"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ), "path": path,
               "umask": umask, "pgid": os.getpgid(0), "ignored": ignored}
    try:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        conn.connect(address)
        socket.send_fds(conn, [json.dumps(request).encode()], [0, 1, 2])
        head = conn.recv(4096)
    except OSError:
        head = b""
    if len(head) < 4 or struct.unpack("!i", head[:4])[0] == NOT_SERVED:
        os.execv(sys.executable, [sys.executable, "-m", "scaletrain", *argv])
    pid = struct.unpack("!i", head[:4])[0]
    for sig in FORWARDED_SIGNALS:
        if sig not in ignored:
            signal.signal(sig, lambda signum, _frame: _kill(pid, signum))
    while True:
        try:
            reply = conn.recv(16)
            break
        except InterruptedError:
            continue
    if len(reply) < 4:  # the server is gone
        print(f"tests/cli_server.py: the server ended before command {pid}", file=sys.stderr)
        os._exit(1)
    code = os.waitstatus_to_exitcode(struct.unpack("!i", reply[:4])[0])
    if code < 0:  # killed by a signal: so is the shim, for its shell to see the same
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code)


if __name__ == "__main__":
    serve(*sys.argv[1:])
