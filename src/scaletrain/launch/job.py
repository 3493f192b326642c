"""A training job: settled once, where it starts, then run by every rank.

`settle(cfg, world, device)` is the one place a job's request is checked and completed before
anything is built or written: torch.compile's C++ compiler, `parallel.layout = "auto"` chosen by
the planner, the layout derived and checked against the model, the run folder named (so every
rank, on every node, writes to the same one), the data folders made absolute (so the config the
run saves names them from any working folder), a checkpoint of another parallel.sync.mode or
number of workers refused, the output folders checked writable, and more ranks than cores
said. It returns the config as the job runs it and its Layout; every rank is given both. The
three ways a job starts all settle it here:

    one process   `scaletrain train`, or a script under plain python: `start` settles it;
    --nproc N     `launch` starts ranks with the settled config and layout in a JSON file
                  (`spec`); each rank runs `train_rank` and settles nothing again;
    torchrun      each rank loads the config itself; in `start` rank 0 settles it and the others
                  receive what it settled (or its error), so they cannot disagree.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from scaletrain import threads
from scaletrain.config import JobConfig, from_dict, with_absolute_data
from scaletrain.errors import CheckpointError, ConfigError, UserError, config_paths, os_errors_named, user_error_from_os
from scaletrain.layout import Layout
from scaletrain.legality import check_config

if TYPE_CHECKING:  # torch is imported by what runs the job, not by reading its config
    import torch


def settle(cfg: JobConfig, world: int, device: torch.device, *, per_node: int | None = None, note=None,
           measure=None) -> tuple[JobConfig, Layout]:
    """(the config as the job runs it, its layout on `world` ranks of `device`), `per_node` of
    them on this node (default: all). `note`, a function of a str, is told the choices made for
    the user; `measure`: `scaletrain.measure`, given by a caller that may start groups of processes
    on this node, which parallel.auto_measure_s needs to time layouts (the job does not import it:
    measuring runs jobs)."""
    from scaletrain.hardware import cpu_cores
    from scaletrain.plan.auto import resolve
    from scaletrain.train.run_folder import default_run_dir

    here = per_node or world
    if cfg.train.compile:  # every rank would fail the same way: said once, before anything is built
        from scaletrain.parallel.checks import check_compiler

        check_compiler(device)
    cfg, layout = resolve(cfg, world, device, gpus_per_node=per_node, note=note, measure=measure)
    if cfg.checkpoint.resume == "auto" and not (cfg.log.run_dir or cfg.checkpoint.dir):
        raise ConfigError("checkpoint.resume=auto resumes the run in log.run_dir, but none is given (each run would "
                          "start in a new folder and never resume); add --log.run_dir=runs/NAME")
    try:  # the one legality check (the planner's search asks it too), said once here, not by every rank
        check_config(cfg, layout, device_type=device.type)
    except ConfigError as e:
        raise _with_saved_world(e, cfg, world) from None
    if not cfg.log.run_dir:  # named here, once: every rank (and node) must write to the same folder
        cfg = cfg.replace(**{"log.run_dir": default_run_dir()})
    cfg = with_absolute_data(cfg)  # the run's saved config finds its data from any working folder
    _check_resume(cfg, layout)
    _check_writable({"log.run_dir": cfg.log.run_dir, "checkpoint.dir": cfg.checkpoint.dir})
    if note is not None and device.type == "cpu" and here > (cores := cpu_cores()):
        note(f"{here} ranks on {cores} CPU core(s): oversubscribed, the ranks take turns on the cores "
             f"and each step is slower than with --nproc {cores}")
    if note is not None and device.type == "cpu" and (line := threads.on_this_node(here).note()):
        note(line)
    return cfg, layout


def _resumed(cfg: JobConfig) -> tuple[Path, dict] | None:
    """(the checkpoint the job resumes, its trainer state), or None (a new run, or one the trainer
    reports: with auto it falls back to an older checkpoint, naming this one)."""
    from scaletrain.train import checkpoint as ckpt

    res = cfg.checkpoint.resume
    if res == "none":
        return None
    if res == "auto":
        if not (cfg.checkpoint.dir or cfg.log.run_dir):
            return None
        folder = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else Path(cfg.log.run_dir) / "checkpoints"
        path = ckpt.latest_checkpoint(folder)
        if path is None:
            return None
    else:
        path = Path(res)
    try:
        return path, ckpt.read_trainer_state(path)
    except CheckpointError:
        return None


def _with_saved_world(e: ConfigError, cfg: JobConfig, world: int) -> ConfigError:
    """A layout that does not fit this world, for a run saved by another number of ranks: the
    fix is first to resume with those ranks (the saved layout), not to change it."""
    resumed = _resumed(cfg)
    saved = resumed[1].get("world_size") if resumed else None
    if not isinstance(saved, int) or saved == world:
        return e
    return ConfigError(*e.lines[:-1], f"{e.lines[-1]}; {resumed[0]} was saved by {saved} ranks: resume it with "
                                      f"--nproc {saved} to keep its layout")


def _check_resume(cfg: JobConfig, layout: Layout) -> None:
    """A checkpoint of another parallel.sync.mode, or of another number of workers, is refused here,
    in one line, before any rank starts (the trainer checks it again)."""
    from scaletrain.train import checkpoint as ckpt

    if (resumed := _resumed(cfg)) is not None:
        ckpt.check_sync(*resumed, layout)


def _check_writable(paths: dict[str, str]) -> None:
    """Refuse a folder on a read-only or full disk, or one we may not write to, before any rank
    starts: on this node they would all fail on it, in a line each."""
    for option, path in paths.items():
        if not path:
            continue
        folder = os.path.abspath(path)
        while not os.path.exists(folder) and os.path.dirname(folder) != folder:
            folder = os.path.dirname(folder)  # the folder it will be created in
        if not os.path.isdir(folder):
            continue  # the trainer names a file in the way
        disk = os.statvfs(folder)
        code = (errno.EROFS if disk.f_flag & os.ST_RDONLY else errno.EACCES if not os.access(folder, os.W_OK)
                else errno.ENOSPC if disk.f_blocks and (disk.f_bfree if os.geteuid() == 0 else disk.f_bavail) == 0
                else None)
        if code is not None:
            raise user_error_from_os(OSError(code, os.strerror(code), folder), {option: path})


def start(cfg: JobConfig, layout: Layout | None = None, *, note=None, measure=None):
    """(the config as it runs, this process's Runtime): join the group of ranks (a process
    started by a launcher or torchrun; else this process is the whole job) and build the mesh of
    `layout`, the job's, settled where it started; when it is not given, the job is settled
    here: by this process alone, or under torchrun by rank 0 for every rank. `note` and
    `measure` as for `settle` (rank 0 alone notes)."""
    from scaletrain import runtime

    place = runtime.join(cfg)
    threads.use(threads.on_this_node(place.local_world_size))  # before the first parallel work
    if layout is None:
        cfg, layout = _settled_on_rank0(cfg, place, note, measure)
    return cfg, runtime.runtime_of(cfg, layout, place)


def _settled_on_rank0(cfg: JobConfig, place, note, measure) -> tuple[JobConfig, Layout]:
    """`settle` on rank 0 alone; every other rank receives its result, or its error."""
    def settle_here():
        return settle(cfg, place.world_size, place.device, per_node=place.local_world_size, note=note,
                      measure=measure)

    if not place.distributed:
        return settle_here()
    import torch.distributed as dist

    box: list = [None]
    if place.rank == 0:
        try:
            with os_errors_named(config_paths(cfg)):
                chosen, chosen_layout = settle_here()
            box = [(chosen.to_dict(), chosen_layout.to_dict())]
        except UserError as e:
            box = [e]
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], UserError):
        raise box[0]
    return from_dict(box[0][0]), Layout(**box[0][1])


def launch(cfg: JobConfig, layout: Layout, *, nproc: int, nnodes: int = 1, node_rank: int | None = None,
           rdzv_endpoint: str = "", rdzv_id: str = "scaletrain", max_restarts: int = 0,
           rank_hook: str | None = None) -> int:
    """Start the `train` task on `nproc` local ranks (of `nnodes` nodes) for the settled `cfg`
    and `layout`, each rank handed both (`spec`); returns the job's exit code. `rank_hook`: see
    `call_rank_hook` (tests only)."""
    from scaletrain.launch import launcher

    with launcher.spec_file({**spec(cfg, layout), "rank_hook": rank_hook}, prefix="scaletrain-train-") as path:
        return launcher.launch("train", [path], nproc=nproc, nnodes=nnodes, node_rank=node_rank,
                               rdzv_endpoint=rdzv_endpoint, rdzv_id=rdzv_id, max_restarts=max_restarts,
                               checkpoint_dir=cfg.checkpoint.dir or os.path.join(cfg.log.run_dir, "checkpoints"))


def spec(cfg: JobConfig, layout: Layout) -> dict:
    """What every rank of a job is given: the config as it will run and its layout."""
    return {"config": cfg.to_dict(), "layout": layout.to_dict()}


def train_rank(spec_path: str) -> int:
    """One rank of `scaletrain train --nproc N` (the `train` task of scaletrain.launch.worker, which
    reports its failures): SPEC_PATH is the JSON file of `spec`."""
    job = json.loads(Path(spec_path).read_text())
    return train(from_dict(job["config"]), Layout(**job["layout"]), rank_hook=job.get("rank_hook"))


def call_rank_hook(hook: str | None, trainer):
    """`scaletrain train --rank-hook MODULE:FUNCTION` (hidden, for tests only: the fault-tolerance
    tests inject their SIGKILLs at chosen steps and phases with it, tests/ft_faults.py): FUNCTION,
    importable on the ranks, is called with each rank's Trainer once it is built, before it trains.
    Returns the Trainer (no hook: nothing is called)."""
    import importlib

    if not hook:
        return trainer
    module, _, name = hook.partition(":")
    try:
        function = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise ConfigError(f"--rank-hook {hook!r} is not an importable MODULE:FUNCTION ({e})") from None
    function(trainer)
    return trainer


def train(cfg: JobConfig, layout: Layout | None = None, note=None, rank_hook: str | None = None) -> int:
    """Train `cfg` as one rank of a group (`layout`: cfg's, settled where the job started; None
    under torchrun, where rank 0 settles it for all, telling `note`). Returns the rank's exit
    code. A rank the launcher restarted after a failure resumes from the newest checkpoint.
    `rank_hook`: see `call_rank_hook` (tests only)."""
    from scaletrain import runtime
    from scaletrain.train.trainer import Trainer

    rank = int(os.environ.get("RANK", "0"))
    restarts = runtime.restart_count()
    if restarts > 0 and cfg.checkpoint.resume == "none":
        # the launcher restarted the group after a failure: continue from the newest checkpoint
        cfg = cfg.replace(**{"checkpoint.resume": "auto"})
    if restarts > 0 and rank == 0:
        then = ("the group rejoins its peers: from its newest complete checkpoint if it has one, then a live "
                "peer's state" if cfg.fault_tolerance.enabled else
                "the group resumes from its newest complete checkpoint (or begins again without one)")
        print(f"scaletrain: restart {restarts} of at most {os.environ.get('TORCHELASTIC_MAX_RESTARTS', '?')}: "
              f"a rank failed; {then}", file=sys.stderr, flush=True)
    with os_errors_named(config_paths(cfg)):
        cfg, rt = start(cfg, layout, note=note)
        return exit_code(call_rank_hook(rank_hook, Trainer(cfg, rt, restart=restarts > 0)).fit())


def exit_code(result: dict) -> int:
    """The exit code of a finished `Trainer.fit()`: 0, or 128 + the signal that stopped it."""
    if result["stopped_by"] is None:
        return 0
    # stopped by a signal and saved: this process is on its way out; later signals (a second
    # Ctrl-C) must not turn exit 128+N into a death by signal. SIG_IGN, unlike a Python handler,
    # outlives the interpreter's own shutdown.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    return 128 + int(result["stopped_by"])


def train_config(config: str | None, extra: list[str]) -> tuple[JobConfig, list[str]]:
    """(the config `scaletrain train` runs, the lines that say where it came from and what the
    data changed of it). `config`, a TOML file or a run's config.json; without it, when the
    options resume a run (checkpoint.resume=auto with its log.run_dir, or a checkpoint folder),
    that run's own saved config; else the demo (configs/tiny.toml), its evaluation fitted to the
    data (`_demo_evaluation`). The options `extra` go on top and are checked, by the config and,
    on resuming, against the checkpoint."""
    from scaletrain.config import DEMO_CONFIG, flat_keys, load_config, parse_override_args
    from scaletrain.train.run_folder import saved_config

    if config:
        notes: list[str] = []
        return load_config(config, extra, notes=notes.append), notes
    options, notes = parse_override_args(extra)[0], []
    saved = saved_config(options, notes.append)
    if saved is None:
        return _demo_evaluation(load_config(DEMO_CONFIG, extra, notes=notes.append), options, notes), notes
    raw, source = saved
    renamed: list[str] = []  # an old run's config holds old names: one line each
    cfg = from_dict(raw, overrides=extra, source=source, notes=renamed.append)
    before = flat_keys(from_dict(raw, source=source).to_dict())
    changed = [f"{k}={v}" for k, v in flat_keys(cfg.to_dict()).items() if before[k] != v]
    return cfg, [f"config: the run's own ({source}){', with ' + ', '.join(changed) if changed else ''}", *notes,
                 *renamed]


def _demo_evaluation(cfg: JobConfig, given: dict[str, str], notes: list[str]) -> JobConfig:
    """The demo config's evaluation (train.eval_every and eval_batches, written for the built-in
    data and its validation text) fitted to the data the options give, where they leave those
    two to the demo: data without a validation split, or with less than one batch of it, is not
    evaluated; a split of fewer batches than eval_batches is evaluated on those it holds. Each
    change is a line of `notes`. What the options set stays as asked: the trainer refuses what
    the data cannot give."""
    from scaletrain.config import data_paths
    from scaletrain.data.prepare import recorded_validation_tokens

    train, folders = cfg.train, data_paths(cfg.data)
    if not train.eval_every or "train.eval_every" in given or folders == [""]:
        return cfg
    tokens = {folder: recorded_validation_tokens(folder) for folder in folders}
    demo = f"the demo config's evaluation (train.eval_every={train.eval_every})"
    if not any(tokens.values()):
        what = f"data.path {cfg.data.path} has no" if not cfg.data.mix else "none of data.mix's folders has a"
        notes.append(f"{what} validation split, so {demo} steps aside; prepare the data with --val-fraction F "
                     "for a validation loss")
        return cfg.replace(**{"train.eval_every": 0})
    batch = train.global_batch
    if not batch or "train.eval_batches" in given:
        return cfg  # a batch derived from the layout: the trainer checks it
    held = {folder: (n - 1) // cfg.data.seq_len // batch for folder, n in tokens.items() if n}
    folder, least = min(held.items(), key=lambda item: item[1])
    if least < 1:
        notes.append(f"the validation split of {folder} holds fewer windows of data.seq_len={cfg.data.seq_len} than "
                     f"one batch of {batch}, so {demo} steps aside; prepare the data with a larger --val-fraction "
                     "for a validation loss")
        return cfg.replace(**{"train.eval_every": 0})
    if train.eval_batches and least < train.eval_batches:
        notes.append(f"the validation split of {folder} holds {least} whole batch(es) of {batch} windows, fewer "
                     f"than the demo config's train.eval_batches={train.eval_batches}: each evaluation uses those "
                     f"{least}")
        return cfg.replace(**{"train.eval_batches": least})
    return cfg
