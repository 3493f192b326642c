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
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from scaletrain.config import JobConfig
from scaletrain.errors import LaunchError, UserError
from scaletrain.parallel.dims import ParallelDims


@dataclass
class Runtime:
    """This process's place among the ranks, passed explicitly to whoever needs it."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    dims: ParallelDims
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
    dims = ParallelDims.from_config(cfg.parallel, 1)
    return Runtime(0, 0, 1, 1, pick_device(cfg.train.device), dims)


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


def prepare_worker(cfg: JobConfig) -> tuple[JobConfig, Runtime]:
    """Join the process group, let rank 0 choose the layout if it is `auto` (every rank gets
    the same), and build the mesh. Returns the config as it will run."""
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
    dims = ParallelDims.from_config(cfg.parallel, world)
    mesh, dp_mesh = dims.build_mesh(device.type)
    return cfg, Runtime(rank, local_rank, world, local_world, device, dims, mesh, dp_mesh, _start_progress(rank))


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


def record_worker_error(e: BaseException, rank: int) -> None:
    """Print the error in a few lines and leave it where the launcher looks for it."""
    if isinstance(e, UserError):
        text = "; ".join(e.lines)
    else:
        frames = traceback.extract_tb(e.__traceback__)[-3:]
        where = " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in reversed(frames))
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
        text = f"{type(e).__name__}: {first} (at {where})"
    print(f"scaletrain: error: rank {rank}: {text}", file=sys.stderr, flush=True)
    if _progress is not None:  # the other ranks leave now rather than at their collective timeout
        _progress.abort()
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        with open(path, "w") as f:
            json.dump({"message": text, "timestamp": int(time.time()), "scaletrain_time": time.time(),
                       "user_error": isinstance(e, UserError), "rank": rank,
                       "exit_code": e.exit_code if isinstance(e, UserError) else 1}, f)


def launch(worker_args: list[str], *, nproc: int, nnodes: int = 1, node_rank: int | None = None,
           rdzv_endpoint: str = "", rdzv_id: str = "scaletrain", max_restarts: int = 0,
           monitor_interval: float = 0.1,
           program: tuple[str, ...] = ("-m", "scaletrain", "train")) -> int:
    """Start `python PROGRAM WORKER_ARGS` (by default `scaletrain train`) on `nproc` local ranks;
    return the exit code."""
    from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if nproc < 1:
        raise LaunchError(f"--nproc must be at least 1, got {nproc}")
    if nnodes < 1:
        raise LaunchError(f"--nnodes must be at least 1, got {nnodes}")
    if nnodes > 1 and not rdzv_endpoint:
        raise LaunchError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT, reachable from every node")
    for name in ("torch.distributed.elastic", "torch.distributed.launcher"):
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
    env_before = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "GLOO_SOCKET_IFNAME")}
    if env_before["OMP_NUM_THREADS"] is None:  # share the cores among the local ranks, don't oversubscribe
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))
    if env_before["GLOO_SOCKET_IFNAME"] is None:  # gloo talks over the interface that reaches the others
        interface = _interface_towards(local_addr or endpoint.rsplit(":", 1)[0])
        if interface:
            os.environ["GLOO_SOCKET_IFNAME"] = interface
    try:
        with _stores_bound_to_their_host():
            elastic_launch(config, entrypoint=sys.executable)(*program, *worker_args)
    except ChildFailedError as e:
        print(f"scaletrain: error: {_first_failure(e, log_dir)}", file=sys.stderr, flush=True)
        return _reported_exit_code(log_dir)
    finally:
        for key, value in env_before.items():
            if value is None:
                os.environ.pop(key, None)
        shutil.rmtree(log_dir, ignore_errors=True)
    return 0


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
def _stores_bound_to_their_host():
    """PyTorch's rendezvous and agent stores listen on every interface of the machine; bind each
    to the address it was given (loopback for one node, the --rdzv-endpoint host otherwise)."""
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
        sock.bind(address)
        sock.listen(4096)
        given["port"] = sock.getsockname()[1]
        given["master_listen_fd"] = sock.detach()
        return original(**given)

    dist.TCPStore, c10d_rendezvous_backend.TCPStore = bound_store, bound_store
    try:
        yield
    finally:
        dist.TCPStore, c10d_rendezvous_backend.TCPStore = original, original


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
