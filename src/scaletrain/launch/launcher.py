"""Starting ranks: `scaletrain train --nproc N` starts N local worker processes (`python -m
scaletrain.launch.worker TASK`) through PyTorch's elastic launcher, the engine behind torchrun; the
rendezvous, the restarts after a failure, signals passed on to the ranks, and one line about
the failure that caused the others.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from scaletrain import threads
from scaletrain.errors import LaunchError, TrainingStopped, UserError, user_error_from_os
from scaletrain.runtime import LAUNCHER_PID_ENV

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)  # a rank stopped by one saved a checkpoint and exits 128 + it
FAILED_GROUP_GRACE_S = 5  # SIGTERM to SIGKILL for the ranks left once one failed (_no_restart_after_final_failures)


def record_worker_error(e: BaseException, rank: int) -> int:
    """Print the error in a few lines and leave it where the launcher looks for it; returns the
    exit code for the worker (2 for a user error, an OS error on a user's path included)."""
    if isinstance(e, OSError) and (mapped := user_error_from_os(e)) is not None:
        e = mapped
    if isinstance(e, UserError):
        text = "; ".join(e.lines)
    else:
        frames = traceback.extract_tb(e.__traceback__)[-3:]
        where = " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in reversed(frames))
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
        text = f"{type(e).__name__}: {first} (at {where})"
    code = e.exit_code if isinstance(e, UserError) else 1
    print(f"scaletrain: error: rank {rank}: {text}", file=sys.stderr, flush=True)
    from scaletrain.watchdog import running_progress

    if (progress := running_progress()) is not None:  # the other ranks leave now, not at their timeout
        progress.abort()
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:  # whole or not at all: the elastic agent parses it, and a rank stopped mid-write left it empty
        from scaletrain.atomic import write_json

        write_json(path, {"message": text, "timestamp": int(time.time()), "scaletrain_time": time.time(),
                          "user_error": isinstance(e, UserError), "rank": rank, "exit_code": code,
                          "final": _restart_would_repeat(e)}, indent=None)
    return code


def _restart_would_repeat(e: BaseException) -> bool:
    """A user error (bad input) or a diverged training fails the same way after a restart; a
    rank that stopped participating (its TrainingStopped comes from a communication error) is
    what --max-restarts is for."""
    if not isinstance(e, UserError):
        return False
    return not (isinstance(e, TrainingStopped) and (e.restartable or isinstance(e.__context__, RuntimeError)))


def check_launch(nproc: int, nnodes: int, rdzv_endpoint: str) -> None:
    """The launch arguments on their own, checked before the job is settled (and before any
    line about it is printed)."""
    if nproc < 1:
        raise LaunchError(f"--nproc must be at least 1, got {nproc}")
    if nnodes < 1:
        raise LaunchError(f"--nnodes must be at least 1, got {nnodes}")
    if nnodes > 1 and not rdzv_endpoint:
        raise LaunchError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT, reachable from every node")


def launch(task: str, worker_args: list[str], *, nproc: int, nnodes: int = 1, node_rank: int | None = None,
           rdzv_endpoint: str = "", rdzv_id: str = "scaletrain", max_restarts: int = 0,
           monitor_interval: float = 0.1, checkpoint_dir: str | Path | None = None,
           pythonpath: tuple[str, ...] = ()) -> int:
    """Start `python -m scaletrain.launch.worker TASK WORKER_ARGS` (see scaletrain.launch.worker: `train`,
    `verify`, ... or MODULE:FUNCTION, importable from `pythonpath` too) on `nproc` local ranks;
    return the exit code.

    SIGINT or SIGTERM to this process reaches every rank, which finishes its step and saves a
    checkpoint (the elastic agent waits 30 s for them); the exit code is then 128 + the signal
    and one line names `checkpoint_dir`'s newest checkpoint. A failure that a restart would only
    repeat (a user error, a diverged training, a stop by signal) ends the job whatever
    `max_restarts` says."""
    from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs, SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    check_launch(nproc, nnodes, rdzv_endpoint)
    for name in ["torch.distributed.elastic", "torch.distributed.launcher", *logging.Logger.manager.loggerDict]:
        if name.startswith(("torch.distributed.elastic", "torch.distributed.launcher")):
            logging.getLogger(name).setLevel(logging.CRITICAL)  # we report failures ourselves, briefly

    local_addr = None
    if node_rank is not None:  # fixed node ranks: like torchrun --master-addr/--master-port
        backend, endpoint, rdzv_configs = "static", rdzv_endpoint, {"rank": node_rank}
    elif rdzv_endpoint:  # nodes join in any order
        backend, endpoint, rdzv_configs = "c10d", rdzv_endpoint, {}
    else:  # one node: a rendezvous on a free loopback port, like torchrun --standalone
        backend, endpoint, rdzv_configs, local_addr = "c10d", "127.0.0.1:0", {}, "127.0.0.1"
    log_dir = tempfile.mkdtemp(prefix="scaletrain-launch-")  # where workers leave their error files
    config = LaunchConfig(
        min_nodes=nnodes, max_nodes=nnodes, nproc_per_node=nproc,
        run_id=rdzv_id if rdzv_endpoint else f"scaletrain-{os.getpid()}",  # the nodes of one job share it
        rdzv_backend=backend, rdzv_endpoint=endpoint, rdzv_configs=rdzv_configs, max_restarts=max_restarts,
        monitor_interval=monitor_interval, logs_specs=DefaultLogsSpecs(log_dir=log_dir), start_method="spawn",
        local_addr=local_addr)
    env_before = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GLOO_SOCKET_IFNAME",
                                                 LAUNCHER_PID_ENV, "PYTHONPATH")}
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
    if pythonpath:
        os.environ["PYTHONPATH"] = os.pathsep.join([*pythonpath, *filter(None, [env_before["PYTHONPATH"]])])
    # the user's OMP_NUM_THREADS and wait policy kept; else the cores shared among the ranks, less those
    # other work keeps busy, and idle threads that sleep (scaletrain.threads)
    os.environ.update(threads.rank_env(threads.on_this_node(nproc), os.environ))
    if env_before["GLOO_SOCKET_IFNAME"] is None:  # gloo talks over the interface that reaches the others
        interface = _interface_towards(local_addr or endpoint.rsplit(":", 1)[0])
        if interface:
            os.environ["GLOO_SOCKET_IFNAME"] = interface
    started = time.time()
    handlers = _signal_handlers()  # the elastic agent replaces them with its own
    try:
        with _stores_bound_to_their_host(endpoint), _no_restart_after_final_failures():
            elastic_launch(config, entrypoint=sys.executable)("-m", "scaletrain.launch.worker", task, *worker_args)
    except SignalException as e:  # the agent has passed the signal on and waited for the ranks
        print(_stop_line(signal.Signals(e.sigval), checkpoint_dir, started), file=sys.stderr, flush=True)
        return 128 + int(e.sigval)
    except ChildFailedError as e:
        stopped = {f.exitcode for f in e.failures.values()}
        if len(stopped) == 1 and (code := stopped.pop()) - 128 in STOP_SIGNALS:  # the ranks were signalled
            print(_stop_line(signal.Signals(code - 128), checkpoint_dir, started), file=sys.stderr, flush=True)
            return code
        print(f"scaletrain: error: {_first_failure(e, log_dir)}", file=sys.stderr, flush=True)
        return _reported_exit_code(log_dir)
    finally:
        # After a signal, torch leaves the rendezvous handler open (its keep-alive thread running) and
        # unreferenced in a cycle: a garbage collection in that thread itself would run its finalizer
        # there, which joins the thread it runs in ("cannot join current thread", a traceback on
        # stderr after the stop line; seen under load). Collected here, the finalizer runs in this thread.
        gc.collect()
        _restore_signal_handlers(handlers)
        for key, value in env_before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        shutil.rmtree(log_dir, ignore_errors=True)
    return 0


@contextlib.contextmanager
def spec_file(spec: dict, prefix: str = "scaletrain-job-"):
    """A JSON file of `spec` for this node's ranks (its path is a worker task's argument: what
    the job settled where it started), removed when the job is over, restarts included."""
    fd, path = tempfile.mkstemp(prefix=prefix, suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(spec, f)
        yield path
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)


def _stop_line(sig: signal.Signals, checkpoint_dir, since: float) -> str:
    """One line after a stop by signal: which checkpoint the ranks left."""
    from scaletrain.train import checkpoint as ckpt

    try:
        latest = ckpt.latest_checkpoint(Path(checkpoint_dir)) if checkpoint_dir else None
    except (UserError, OSError):  # unreadable: say what is known, in one line still
        latest = None
    if latest is not None and latest.stat().st_mtime >= since:
        return (f"scaletrain: stopped by {sig.name}: the ranks finished their step and saved {latest}; continue "
                "with the same log.run_dir and --checkpoint.resume=auto")
    if checkpoint_dir is None:
        return f"scaletrain: stopped by {sig.name}: the ranks were told to finish their step and save a checkpoint"
    return f"scaletrain: stopped by {sig.name} before the ranks saved a checkpoint in {checkpoint_dir}"


def _signal_handlers() -> dict:
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)}


def _restore_signal_handlers(handlers: dict) -> None:
    for sig, handler in handlers.items():
        if handler is not None:
            signal.signal(sig, handler)


def _final_failure(failure) -> bool:
    """Whether a rank failed in a way that a restart would only repeat (see record_worker_error):
    its report says so, or it exited with code 2 (a user error) or 128 + SIGINT/SIGTERM (it was
    stopped by a signal and saved a checkpoint)."""
    if failure.exitcode == 2 or failure.exitcode - 128 in STOP_SIGNALS:
        return True
    try:
        with open(failure.error_file) as f:
            return json.load(f).get("final") is True
    except (OSError, ValueError, TypeError, AttributeError):
        return False


@contextlib.contextmanager
def _no_restart_after_final_failures():
    """The elastic agent restarts the group after any failure while restarts are left; after a
    final one (a user error, a diverged run, a stop by signal) leave none, so the job ends with
    that failure's exit code. Torch disables restarts the same way for a rank stuck in D-state.

    Once a rank has failed, torch stops the others with SIGTERM and SIGKILLs them after a grace of
    30 s. They cannot save: every checkpoint save is a collective of all ranks, and a peer is gone. A
    rank waiting in a collective or a commit vote with the dead one (a replica group's) sat out the
    whole grace: the restart came 30 s late. After a failure the grace is FAILED_GROUP_GRACE_S; a stop
    by the user's signal keeps the whole of it (the ranks finish their step and save)."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing.api import SubprocessContext

    original, original_close = LocalElasticAgent._monitor_workers, SubprocessContext.close

    def monitor(agent, worker_group):
        result = original(agent, worker_group)
        if result.is_failed() and any(_final_failure(f) for f in result.failures.values()):
            agent._remaining_restarts = 0
        return result

    def close(context, death_sig=None, timeout=30):
        if death_sig is None and context._failures:  # torch's own stop of the others, a rank having failed
            timeout = min(timeout, FAILED_GROUP_GRACE_S)
        original_close(context, death_sig, timeout)

    LocalElasticAgent._monitor_workers, SubprocessContext.close = monitor, close
    try:
        yield
    finally:
        LocalElasticAgent._monitor_workers, SubprocessContext.close = original, original_close


def _interface_towards(host: str) -> str | None:
    """The name of the network interface this machine uses to reach `host` (IPv4), or None.
    Without it gloo picks the address of the machine's host name, which on many clusters (and
    in containers) is not on the network the nodes share."""
    import fcntl
    import socket
    import struct

    try:
        target = socket.getaddrinfo(host.strip("[]"), None, socket.AF_INET)[0][4][0]
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((target, 9))  # no packet is sent: this only asks the routing table
            local = s.getsockname()[0]
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            for _, name in socket.if_nameindex():
                try:
                    packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
                except OSError:
                    continue
                if socket.inet_ntoa(packed[20:24]) == local:
                    return name
    except OSError:
        pass
    return None


@contextlib.contextmanager
def _stores_bound_to_their_host(endpoint: str):
    """PyTorch's rendezvous and agent stores listen on every interface of the machine; bind each
    to the address it was given (loopback for one node, the --rdzv-endpoint host otherwise).
    A port that cannot be bound (in use, privileged) is refused in one line: each job needs its
    own rendezvous port on the host that listens on it."""
    import socket

    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend

    original = dist.TCPStore

    def arguments(host_name, port, world_size=None, is_master=False, timeout=timedelta(seconds=300),
                  wait_for_workers=True, multi_tenant=False, master_listen_fd=None, use_libuv=True):
        return dict(locals())  # TCPStore's documented signature, to see what a caller passed

    def bound_store(*args, **kwargs):
        given = arguments(*args, **kwargs)
        if not given.get("is_master") or given.get("master_listen_fd") is not None:
            return original(**given)
        family, kind, proto, _, address = socket.getaddrinfo(given["host_name"], given["port"],
                                                             type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
            sock.listen(4096)
        except OSError as e:
            sock.close()
            raise _port_error(e, given["host_name"], given["port"], endpoint) from None
        given["port"] = sock.getsockname()[1]
        given["master_listen_fd"] = sock.detach()
        return original(**given)

    dist.TCPStore, c10d_rendezvous_backend.TCPStore = bound_store, bound_store
    try:
        yield
    finally:
        dist.TCPStore, c10d_rendezvous_backend.TCPStore = original, original


def _port_error(e: OSError, host: str, port: int, endpoint: str) -> LaunchError:
    import errno

    what = f"--rdzv-endpoint {endpoint}" if endpoint.endswith(f":{port}") else f"rendezvous address {host}:{port}"
    if e.errno == errno.EADDRINUSE:
        return LaunchError(f"{what}: port {port} is already in use on this machine (another job or program "
                           "listens there); give this job a free port: jobs cannot share a rendezvous port, even "
                           "with distinct --rdzv-id")
    if e.errno == errno.EACCES:
        return LaunchError(f"{what}: permission denied to listen on port {port} (ports below 1024 need root); "
                           "choose a port above 1023")
    return LaunchError(f"{what}: cannot listen on {host}:{port} ({e.strerror or e}); give an address of this "
                       "machine and a free port")


def _reports(log_dir: str) -> list[dict]:
    """Every error a worker recorded (ranks stopped by the launcher after the first failure
    record none)."""
    found = []
    for path in Path(log_dir).rglob("error.json"):
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(data, dict) and "scaletrain_time" in data:
            found.append(data)
    return found


def _reported_exit_code(log_dir: str) -> int:
    """2 for a user error, 3 for a stopped training, 1 for anything else."""
    codes = [r.get("exit_code", 1) for r in _reports(log_dir)]
    return min((c for c in codes if c in (2, 3)), default=1)


def _first_failure(e, log_dir: str) -> str:
    """One line about the failure that caused the others: a user error if any, else the
    earliest error a worker recorded, else what the launcher saw."""
    reports = sorted(_reports(log_dir), key=lambda r: (not r.get("user_error"), r["scaletrain_time"]))
    if reports:
        r = reports[0]
        return f"rank {r['rank']} failed first: {r['message']}"
    rank, failure = min(e.failures.items(), key=lambda item: (item[1].timestamp, item[0]))
    how = f"killed by signal {-failure.exitcode}" if failure.exitcode < 0 else f"exit code {failure.exitcode}"
    return f"rank {rank} failed first ({how}) without recording an error; see its output above"
