"""What each rank knows about the others: the `Runtime` (rank, device, layout, mesh).

A worker started by our launcher (scaletrain.launch.launcher) or by torchrun reads torchrun's
environment contract (RANK, WORLD_SIZE, LOCAL_RANK, ...) exactly once, here, in `join`, and
passes a `Runtime` object down: nothing below reads the environment. Under plain `python` (no
launcher) the job is one process. The layout comes settled from where the job started
(scaletrain.launch.job); this module builds its mesh and never chooses one.

Backend: NCCL when the ranks train on CUDA, gloo on CPU. A request that cannot run as asked
(a CUDA run with fewer GPUs than local ranks, a layout that needs another world size) is
refused with one line; it is never quietly downgraded.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from scaletrain.config import JobConfig
from scaletrain.errors import ConfigError, LaunchError
from scaletrain.layout import Layout

LAUNCHER_PID_ENV = "SCALETRAIN_LAUNCHER_PID"  # lets a worker see that its launcher died before it could ask to follow


@dataclass
class Runtime:
    """This process's place among the ranks, passed explicitly to whoever needs it."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    layout: Layout  # resolved for this world: every part of the run reads it from here
    mesh: object | None = None  # the 5-D DeviceMesh when distributed
    dp_mesh: object | None = None  # its data-parallel axes flattened into one
    progress: object | None = None  # this rank's published progress (scaletrain.watchdog.Progress)
    # the config values `layout` was derived from (`layout_key`); None: the layout was given as it is
    layout_of: tuple | None = None
    # expert parallelism's meshes by ep size, built on first use (shared by the runtimes `with_layout`
    # makes: one group of processes keeps one set of process groups per ep)
    expert_meshes: dict = field(default_factory=dict)

    @property
    def distributed(self) -> bool:
        return self.mesh is not None

    def with_layout(self, layout: Layout) -> Runtime:
        """This group of processes running another layout on its mesh: one group (one mesh) can run
        configs that differ in engine, stage or batch (bench, verify, the tests), never in the mesh.
        The caller derived `layout` for the config it trains; a Trainer takes it as it is."""
        if layout.mesh_shape != self.layout.mesh_shape:
            raise ConfigError(f"this group's mesh is {self.layout.describe_ranks()}, but the config asks for "
                              f"{layout.describe_ranks()}; start a group for that layout")
        return dataclasses.replace(self, layout=layout, layout_of=None)

    def for_config(self, cfg: JobConfig) -> Runtime:
        """The runtime a trainer of `cfg` runs with: this one, when its layout is cfg's (derived from
        the same config values, or given with `with_layout`); else, for a config that differs in its
        layout (another ZeRO stage or batch on the same group), cfg's own layout on this mesh."""
        if self.layout_of is None or self.layout_of == layout_key(cfg):
            return self
        return self.with_layout(Layout.from_config(cfg, self.world_size))

    def axis(self, name: str):
        """The 1-D mesh of one axis: `dp` (flattened), `dp_replicate`, `dp_shard`, `cp`, `tp`, `pp`."""
        return self.dp_mesh if name == "dp" else self.mesh[name]

    def step_mesh(self):
        """The ranks that reduce gradients every step (Layout.step_axis)."""
        return self.axis(self.layout.step_axis)

    def shard_mesh(self):
        """The mesh FSDP shards over: dp_shard, or (HSDP) dp_replicate × dp_shard (Layout.shard_axes)."""
        axes = self.layout.shard_axes
        return self.mesh[axes] if len(axes) > 1 else self.mesh[axes[0]]

    def expert_step_mesh(self):
        """The ranks that reduce the experts' gradients every step (Layout.expert_step_axis)."""
        return self.expert_mesh()[self.layout.expert_step_axis]

    def expert_mesh(self):
        """Expert parallelism's mesh for this layout's ep (Layout.build_expert_mesh), built once."""
        ep = self.layout.ep
        if ep not in self.expert_meshes:
            self.expert_meshes[ep] = self.layout.build_expert_mesh(self.device.type)
        return self.expert_meshes[ep]

    def group(self, name: str):
        """The process group of one axis, or None in a single process."""
        return self.axis(name).get_group() if self.mesh is not None else None

    def shared(self, value):
        """Rank 0's value of something every rank must agree on (a time-stamped folder, a new
        run's id); every rank calls it."""
        if self.mesh is None:
            return value
        import torch.distributed as dist

        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]


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


def layout_key(cfg: JobConfig) -> tuple:
    """The config values a layout is derived from (the derivation reads no others; the whole
    [parallel] and [memory] sections, to be safe): configs with the same key have the same layout
    on the same number of ranks."""
    train = cfg.train
    return (dataclasses.astuple(cfg.parallel), dataclasses.astuple(cfg.memory), train.global_batch,
            train.micro_batch, train.grad_accum)


def single_process(cfg: JobConfig, layout: Layout | None = None) -> Runtime:
    """One process: `layout` (cfg's, derived where the job started), or cfg's derived here."""
    if cfg.parallel.layout == "auto":
        raise ValueError("parallel.layout=auto: settle the job first (scaletrain.launch.job.settle)")
    if layout is None:
        layout = Layout.from_config(cfg, 1)
    elif layout.world != 1:
        raise LaunchError(f"the layout has {layout.describe_ranks()}, but this is one process")
    return Runtime(0, 0, 1, 1, pick_device(cfg.train.device), layout, layout_of=layout_key(cfg))


def restart_count() -> int:
    """How often the elastic launcher has restarted this worker's group (0 the first time)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def is_worker() -> bool:
    """True in a process started by our launcher or by torchrun."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ


def init_worker(cfg: JobConfig) -> Runtime:
    """Join the process group described by torchrun's environment and build the mesh of cfg's
    (manual) layout."""
    return prepare_worker(cfg)[1]


def die_with_launcher() -> None:
    """Have Linux send this worker SIGTERM when the process that started it (the launcher, whose
    elastic agent is the workers' parent) dies, even by SIGKILL: no rank outlives its launcher."""
    from scaletrain.interrupt import die_with_parent

    launcher = os.environ.get(LAUNCHER_PID_ENV)
    die_with_parent(int(launcher) if launcher else None)


@dataclass(frozen=True)
class Place:
    """This process among the ranks before its layout is known: the process group is joined
    (`join`), the mesh not yet built."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    distributed: bool  # started by a launcher (or torchrun): a member of a process group


def join(cfg: JobConfig) -> Place:
    """Join the process group torchrun's environment describes (read here, once), on this rank's
    device; without a launcher (plain `python`, no RANK) this process is the whole job, one rank."""
    if not is_worker():
        return Place(0, 0, 1, 1, pick_device(cfg.train.device), distributed=False)
    die_with_launcher()
    env = os.environ
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    local_rank = int(env["LOCAL_RANK"])
    local_world = int(env.get("LOCAL_WORLD_SIZE", world))
    device = pick_device(cfg.train.device, local_rank, local_world)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = timedelta(seconds=cfg.parallel.timeout_s)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timeout,
                                device_id=device if device.type == "cuda" else None,
                                **_attempt_store(rank, world, timeout))
    return Place(rank, local_rank, world, local_world, device, distributed=True)


def runtime_of(cfg: JobConfig, layout: Layout, place: Place) -> Runtime:
    """The Runtime of `place` running `layout` (cfg's, settled where the job started): its mesh
    built, this rank's progress published."""
    if not place.distributed:
        return single_process(cfg, layout)
    if layout.world != place.world_size:
        raise LaunchError(f"the job's layout has {layout.describe_ranks()}, but {place.world_size} were started")
    mesh, dp_mesh = layout.build_mesh(place.device.type)
    return Runtime(place.rank, place.local_rank, place.world_size, place.local_world_size, place.device, layout,
                   mesh, dp_mesh, _start_progress(place.rank), layout_key(cfg))


def prepare_worker(cfg: JobConfig, layout: Layout | None = None) -> tuple[JobConfig, Runtime]:
    """Join the process group and build the mesh of `layout`: cfg's, settled where the job
    started (scaletrain's launcher hands every rank both), or, when it is not given, cfg's derived
    here (a manual layout: `parallel.layout = auto` is chosen where a job starts, by
    `scaletrain.launch.job.start`). Returns the config and this rank's Runtime.

    Without a launcher (plain `python script.py`: no RANK in the environment) this process is
    the whole job: one rank."""
    if layout is None and cfg.parallel.layout == "auto":
        raise ConfigError("parallel.layout=auto is chosen where the job starts: call scaletrain.launch.job.start(cfg) "
                          "instead of prepare_worker, or set parallel.layout=manual")
    place = join(cfg)
    return cfg, runtime_of(cfg, layout or Layout.from_config(cfg, place.world_size), place)


def _start_progress(rank: int):
    """Publish this rank's progress for the timeout messages (see scaletrain.watchdog); a
    process that joins again (the test suite's groups host many runs) replaces its old record."""
    from scaletrain.watchdog import Progress, running_progress

    try:
        store = dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):  # a PyTorch without it: timeouts name no rank
        return None
    if (old := running_progress()) is not None:
        old.stop()
    return Progress(store, rank).start()


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
    from scaletrain.watchdog import running_progress

    if (progress := running_progress()) is not None:
        progress.stop()
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
