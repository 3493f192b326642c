"""Starting ranks, and what each rank knows about the others.

`scaletrain train --nproc N` starts N local worker processes through PyTorch's elastic launcher
(the engine behind torchrun); `torchrun -m scaletrain train ...` starts the same workers. Each
worker reads torchrun's environment contract (RANK, WORLD_SIZE, LOCAL_RANK, ...) exactly once,
here, and passes a `Runtime` object down: nothing below reads the environment.

Backend: NCCL when the ranks train on CUDA, gloo on CPU. A request that cannot run as asked
(a CUDA run with fewer GPUs than local ranks, a layout that needs another world size) is
refused with one line; it is never quietly downgraded.
"""

from __future__ import annotations

import contextlib
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
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from scaletrain.config import JobConfig
from scaletrain.errors import LaunchError, TrainingStopped, UserError, user_error_from_os
from scaletrain.layout import Layout

LAUNCHER_PID_ENV = "SCALETRAIN_LAUNCHER_PID"  # lets a worker see that its launcher died before it could ask to follow
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)  # a rank stopped by one saved a checkpoint and exits 128 + it


@dataclass
class Runtime:
    """This process's place among the ranks, passed explicitly to whoever needs it."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    layout: Layout  # resolved for this world: every part of the run reads it from here
    mesh: object | None = None  # the 4-D DeviceMesh when distributed
    dp_mesh: object | None = None  # its data-parallel axes flattened into one
    progress: object | None = None  # this rank's published progress (parallel.watchdog.Progress)

    @property
    def distributed(self) -> bool:
        return self.mesh is not None

    def axis(self, name: str):
        """The 1-D mesh of one axis: `dp` (flattened), `dp_replicate`, `dp_shard`, `tp`, `pp`."""
        return self.dp_mesh if name == "dp" else self.mesh[name]

    def group(self, name: str):
        """The process group of one axis, or None in a single process."""
        return self.axis(name).get_group() if self.mesh is not None else None


def pick_device(name: str, local_rank: int = 0, local_world_size: int = 1) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise LaunchError("train.device=cuda but no CUDA device is visible; use train.device=cpu or auto")
        if local_world_size > count:
            raise LaunchError(f"{local_world_size} ranks on this node need {local_world_size} GPUs, but only {count} "
                              f"are visible; launch at most {count} processes per node or train on cpu")
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def single_process(cfg: JobConfig) -> Runtime:
    if cfg.parallel.layout == "auto":
        raise ValueError("parallel.layout=auto: resolve the layout first (scaletrain.plan.auto.auto_layout)")
    return Runtime(0, 0, 1, 1, pick_device(cfg.train.device), Layout.from_config(cfg, 1))


def restart_count() -> int:
    """How often the elastic launcher has restarted this worker's group (0 the first time)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def is_worker() -> bool:
    """True in a process started by our launcher or by torchrun."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ


def init_worker(cfg: JobConfig) -> Runtime:
    """Join the process group described by torchrun's environment and build the mesh."""
    if cfg.parallel.layout == "auto":
        raise ValueError("parallel.layout=auto: use prepare_worker, which resolves the layout first")
    return prepare_worker(cfg)[1]


def die_with_launcher() -> None:
    """Have Linux send this worker SIGTERM when the process that started it (the launcher, whose
    elastic agent is the workers' parent) dies, even by SIGKILL: no rank outlives its launcher.
    SIGTERM, not SIGKILL: a training rank finishes its step and saves a checkpoint first."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGTERM), 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    launcher = os.environ.get(LAUNCHER_PID_ENV)
    if launcher and os.getppid() != int(launcher):  # it died before the call above: no signal will come
        os.kill(os.getpid(), signal.SIGTERM)


def prepare_worker(cfg: JobConfig) -> tuple[JobConfig, Runtime]:
    """Join the process group, let rank 0 choose the layout if it is `auto` (every rank gets
    the same), and build the mesh. Returns the config as it will run."""
    die_with_launcher()
    env = os.environ
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    local_rank = int(env["LOCAL_RANK"])
    local_world = int(env.get("LOCAL_WORLD_SIZE", world))
    device = pick_device(cfg.train.device, local_rank, local_world)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        backend = "gloo"
    timeout = timedelta(seconds=cfg.parallel.timeout_s)
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=timeout, device_id=device if device.type == "cuda" else None,
                                **_attempt_store(rank, world, timeout))
    if cfg.parallel.layout == "auto":
        box = [None]
        if rank == 0:
            from scaletrain.plan.auto import auto_layout

            try:
                box = [auto_layout(cfg, world, device, gpus_per_node=local_world)[0].to_dict()]
            except UserError as e:
                box = [e]
        dist.broadcast_object_list(box, src=0)
        if isinstance(box[0], UserError):
            raise box[0]
        from scaletrain.config import from_dict

        cfg = from_dict(box[0])
    layout = Layout.from_config(cfg, world)
    mesh, dp_mesh = layout.build_mesh(device.type)
    return cfg, Runtime(rank, local_rank, world, local_world, device, layout, mesh, dp_mesh, _start_progress(rank))


_progress = None


def _start_progress(rank: int):
    """Publish this rank's progress for the timeout messages (see parallel.watchdog)."""
    global _progress
    from scaletrain.parallel.watchdog import Progress

    try:
        store = dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):  # a PyTorch without it: timeouts name no rank
        return None
    if _progress is not None:
        _progress.stop()
    _progress = Progress(store, rank).start()
    return _progress


def _attempt_store(rank: int, world: int, timeout: timedelta) -> dict:
    """The process group's store, private to this attempt of the job.

    Under an elastic launcher the workers share the agent's store, and it outlives a restart;
    PyTorch keys it by nothing that changes between attempts (pytorch/pytorch#135712), so a
    restarted group can read its predecessor's addresses and hang while connecting. Each rank
    counts its own joins in the store: every attempt of a fixed-size job re-joins every rank
    once, so the counts agree and name the attempt, whatever each node's restart counter says."""
    env = os.environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}  # env:// makes a fresh store for each attempt
    agent = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world, is_master=False, timeout=timeout)
    attempt = agent.add(f"scaletrain/joins/rank{rank}", 1)
    return {"store": dist.PrefixStore(f"scaletrain/attempt{attempt}", agent), "rank": rank, "world_size": world}


def shutdown() -> None:
    global _progress
    if _progress is not None:
        _progress.stop()
        _progress = None
    if dist.is_initialized():
        dist.destroy_process_group()


def exit_worker(code: int) -> None:
    """Leave a worker process now: flush, drop the process group, and skip the interpreter's
    teardown, where C++ threads of the communication libraries sometimes abort the process
    ("terminate called without an active exception") after all the work succeeded."""
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        shutdown()
    finally:
        os._exit(code)


# --------------------------------------------------------------------------------------------
# The parent: starting workers


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
    if _progress is not None:  # the other ranks leave now rather than at their collective timeout
        _progress.abort()
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        with open(path, "w") as f:
            json.dump({"message": text, "timestamp": int(time.time()), "scaletrain_time": time.time(),
                       "user_error": isinstance(e, UserError), "rank": rank, "exit_code": code,
                       "final": _restart_would_repeat(e)}, f)
    return code


def _restart_would_repeat(e: BaseException) -> bool:
    """A user error (bad input) or a diverged training fails the same way after a restart; a
    rank that stopped participating (its TrainingStopped comes from a communication error) is
    what --max-restarts is for."""
    if not isinstance(e, UserError):
        return False
    return not (isinstance(e, TrainingStopped) and isinstance(e.__context__, RuntimeError))


def launch(task: str, worker_args: list[str], *, nproc: int, nnodes: int = 1, node_rank: int | None = None,
           rdzv_endpoint: str = "", rdzv_id: str = "scaletrain", max_restarts: int = 0,
           monitor_interval: float = 0.1, checkpoint_dir: str | Path | None = None,
           pythonpath: tuple[str, ...] = ()) -> int:
    """Start `python -m scaletrain.worker TASK WORKER_ARGS` (see scaletrain.worker: `train`,
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

    if nproc < 1:
        raise LaunchError(f"--nproc must be at least 1, got {nproc}")
    if nnodes < 1:
        raise LaunchError(f"--nnodes must be at least 1, got {nnodes}")
    if nnodes > 1 and not rdzv_endpoint:
        raise LaunchError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT, reachable from every node")
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
    env_before = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "GLOO_SOCKET_IFNAME", LAUNCHER_PID_ENV,
                                                 "PYTHONPATH")}
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
    if pythonpath:
        os.environ["PYTHONPATH"] = os.pathsep.join([*pythonpath, *filter(None, [env_before["PYTHONPATH"]])])
    if env_before["OMP_NUM_THREADS"] is None:  # share the cores among the local ranks, don't oversubscribe
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))
    if env_before["GLOO_SOCKET_IFNAME"] is None:  # gloo talks over the interface that reaches the others
        interface = _interface_towards(local_addr or endpoint.rsplit(":", 1)[0])
        if interface:
            os.environ["GLOO_SOCKET_IFNAME"] = interface
    started = time.time()
    handlers = _signal_handlers()  # the elastic agent replaces them with its own
    try:
        with _stores_bound_to_their_host(endpoint), _no_restart_after_final_failures():
            elastic_launch(config, entrypoint=sys.executable)("-m", "scaletrain.worker", task, *worker_args)
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
        _restore_signal_handlers(handlers)
        for key, value in env_before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        shutil.rmtree(log_dir, ignore_errors=True)
    return 0


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
    that failure's exit code. Torch disables restarts the same way for a rank stuck in D-state."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    original = LocalElasticAgent._monitor_workers

    def monitor(agent, worker_group):
        result = original(agent, worker_group)
        if result.is_failed() and any(_final_failure(f) for f in result.failures.values()):
            agent._remaining_restarts = 0
        return result

    LocalElasticAgent._monitor_workers = monitor
    try:
        yield
    finally:
        LocalElasticAgent._monitor_workers = original


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
