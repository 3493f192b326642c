"""Checkpoints: `torch.distributed.checkpoint` for tensors, JSON for everything else.

A checkpoint is a folder `step_00000040/` holding
    .metadata, *.distcp   model weights and optimizer state (DCP; sharded runs write shards)
    trainer.json          step, config, schedule, loss scaler, data position, optimizer settings
    rng_rank{r}.json      each rank's random-number-generator state

Atomic: everything is written into `.step_00000040.partial/` and renamed when every rank is
done, so a folder named `step_*` is always complete, and `resume = "auto"` never picks a partial
one.

Checked: trainer.json records the sha256 and size of every other file of the checkpoint; they
are verified before a checkpoint is loaded, and `resume = "auto"` falls back to the newest
checkpoint that verifies, naming the damaged one.

Lineage: trainer.json records the run's id and its lineage, the list of (branch, first step)
segments that led to it: resuming from a checkpoint starts a new branch. HEAD.json in the folder
names the position training continues from. Rotation keeps the newest `keep` checkpoints of
the current lineage and never touches another branch's; `resume = "auto"` only picks
checkpoints on HEAD's lineage, so rewinding to an older checkpoint never resumes the abandoned
branch later.

Safe: loading unpickles nothing but an explicit list of DCP's metadata classes (a restricted
unpickler refuses every other global, and any dotted name), tensors are read with
`weights_only=True`, and non-tensor state is JSON.

Tensors are keyed by canonical parameter names (no wrapper prefixes), and DCP reshards them to
whatever layout loads them.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import hashlib
import json
import os
import pickle
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from scaletrain import atomic
from scaletrain.config import locate_data, relative_data, upgrade
from scaletrain.errors import CheckpointError

STEP_RE = re.compile(r"^step_(\d{8})$")
TRAINER_FILE = "trainer.json"
HEAD_FILE = "HEAD.json"
FORMAT_VERSION = 2
READABLE_FORMATS = (1, 2)  # 1: before checksums and lineage

warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


# --------------------------------------------------------------------------------------------
# Optimizer state keyed by parameter name


def _flatten_subclass(t: torch.Tensor) -> dict[str, torch.Tensor] | torch.Tensor:
    """Quantized optimizer states (tensor subclasses) are stored as their plain inner tensors."""
    if type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__") and not hasattr(t, "device_mesh"):
        names, _ = t.__tensor_flatten__()
        return {n: getattr(t, n) for n in names}
    return t


def optimizer_to_named(optimizer: torch.optim.Optimizer, names: dict[int, str]) -> tuple[dict, dict]:
    """(tensors, skeleton): the tensors of the optimizer state keyed by parameter name, and
    everything else (hyper-parameters, non-tensor state) as JSON-ready data."""
    tensors: dict[str, Any] = {}
    skeleton: dict[str, Any] = {"state": {}, "param_groups": []}
    for group in optimizer.param_groups:
        hp = {k: _jsonable(v) for k, v in group.items() if k != "params"}
        skeleton["param_groups"].append({**hp, "params": [names[id(p)] for p in group["params"]]})
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            name = names[id(p)]
            tensors[name] = {k: _flatten_subclass(v) for k, v in state.items() if isinstance(v, torch.Tensor)}
            skeleton["state"][name] = {k: _jsonable(v) for k, v in state.items() if not isinstance(v, torch.Tensor)}
    return tensors, skeleton


def _jsonable(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.item()
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    raise TypeError(f"cannot store optimizer setting {v!r} in a checkpoint")


def restore_optimizer_extras(optimizer: torch.optim.Optimizer, names: dict[int, str], skeleton: dict) -> None:
    """After the state tensors were loaded in place, restore the non-tensor state (if any) of
    each parameter. Hyper-parameters (lr, betas, decay) come from the current config, and the
    grouping of parameters may differ between layouts."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            optimizer.state[p].update(skeleton["state"].get(names[id(p)], {}))


# --------------------------------------------------------------------------------------------
# Saving and finding checkpoints


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier(group=None) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)


def _write_json(path: Path, data: Any) -> None:
    with path.open("w") as f:
        json.dump(data, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def saved_text(path: Path | None) -> str:
    """A saved checkpoint as the run's summary states it: where, and its size (adapter fine-tuning's
    are the adapters' size, not the model's)."""
    if path is None:
        return "none"
    from scaletrain.fmt import size

    return f"{path} ({size(sum(f.stat().st_size for f in Path(path).iterdir() if f.is_file()))})"


def rng_state() -> dict:
    state = {"cpu": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = base64.b64encode(torch.cuda.get_rng_state().numpy().tobytes()).decode()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["cpu"])), dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["cuda"])), dtype=torch.uint8))


def complete_checkpoints(folder: Path) -> list[Path]:
    """Complete checkpoints in `folder`, oldest first."""
    if not folder.is_dir():
        return []
    found = [p for p in folder.iterdir() if p.is_dir() and STEP_RE.match(p.name) and (p / TRAINER_FILE).is_file()]
    return sorted(found, key=lambda p: p.name)


def latest_checkpoint(folder: Path) -> Path | None:
    found = complete_checkpoints(folder)
    return found[-1] if found else None


# --------------------------------------------------------------------------------------------
# Lineage: which checkpoints lie on the path that led to a given position of training

Lineage = list  # [[branch id, first step of the branch], ...], oldest first


def is_ancestor(lineage: Lineage, step: int, of_lineage: Lineage, of_step: int) -> bool:
    """Whether position (lineage, step) lies on the path that led to (of_lineage, of_step),
    itself included. A branch covers the steps from its first step to the first step of the
    branch that followed it (the checkpoint it was resumed from), or to the position itself."""
    if not lineage or not of_lineage:
        return not lineage and not of_lineage and step <= of_step  # checkpoints from before lineage
    i = len(lineage) - 1
    if len(of_lineage) <= i or [list(x) for x in of_lineage[:i + 1]] != [list(x) for x in lineage]:
        return False
    end = of_lineage[i + 1][1] if i + 1 < len(of_lineage) else of_step
    return step <= end


def _position(state: dict) -> tuple[Lineage, int]:
    return state.get("lineage") or [], int(state["step"])


def write_head(folder: Path, lineage: Lineage, step: int) -> None:
    """Record the position training continues from (after each save, and on a rewind)."""
    folder.mkdir(parents=True, exist_ok=True)
    with atomic.replacing(folder / HEAD_FILE, durable=True) as tmp:
        _write_json(tmp, {"lineage": lineage, "step": step})


def read_head(folder: Path) -> tuple[Lineage, int] | None:
    try:
        head = json.loads((Path(folder) / HEAD_FILE).read_text())
        return head["lineage"], int(head["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _states(folder: Path) -> list[tuple[Path, dict | None]]:
    """Every complete checkpoint with its trainer state (None where it cannot be read)."""
    out = []
    for path in complete_checkpoints(folder):
        try:
            out.append((path, read_trainer_state(path)))
        except CheckpointError:
            out.append((path, None))
    return out


def off_lineage(folder: Path) -> list[Path]:
    """Checkpoints of `folder` that are neither ancestors nor descendants of HEAD: an abandoned
    branch, kept on disk, never resumed or rotated."""
    head = read_head(folder)
    if head is None:
        return []
    return [path for path, state in _states(folder) if state is not None
            and not is_ancestor(*_position(state), *head) and not is_ancestor(*head, *_position(state))]


# --------------------------------------------------------------------------------------------
# Checksums


def _digest(path: Path) -> dict:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return {"sha256": h.hexdigest(), "bytes": path.stat().st_size}


def _own_files(folder: Path, rank: int) -> list[Path]:
    """The files this rank wrote into a checkpoint folder (DCP names its files by rank)."""
    own = sorted(folder.glob(f"__{rank}_*.distcp")) + [folder / f"rng_rank{rank}.json"]
    return own + ([folder / ".metadata"] if rank == 0 else [])


def verify_checkpoint(path: Path, state: dict | None = None) -> str | None:
    """Check every file of checkpoint `path` against the checksums in its trainer.json. Every rank
    calls this together (each hashes a share of the files). Returns the first problem found,
    or None. Checkpoints from before checksums (format 1) pass unchecked."""
    path = Path(path)
    state = state if state is not None else read_trainer_state(path)
    files = sorted((state.get("files") or {}).items())
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    problem = None
    for name, want in files[rank::world]:
        f = path / name
        try:
            got = _digest(f) if f.stat().st_size == want["bytes"] else {"bytes": f.stat().st_size}
        except OSError:
            problem = f"{name} is missing or unreadable"
            break
        if got["bytes"] != want["bytes"]:
            problem = f"{name} has {got['bytes']} bytes, {want['bytes']} were written"
            break
        if got["sha256"] != want["sha256"]:
            problem = f"{name} does not match the checksum written with it"
            break
    if dist.is_initialized():
        every = [None] * world
        dist.all_gather_object(every, problem)
        problem = next((p for p in every if p), None)
    return problem


def find_resumable(folder: Path, report=print) -> Path | None:
    """The newest checkpoint of `folder` on HEAD's lineage that reads and verifies; each damaged
    one on the way is named in one line through `report`, with what is wrong with it and whether an
    older one was found. Every rank calls this together."""
    folder = Path(folder)
    head = read_head(folder)
    damaged, found = [], None
    for path, state in reversed(_states(folder)):
        if state is not None and head is not None and not (
                is_ancestor(*_position(state), *head) or is_ancestor(*head, *_position(state))):
            continue  # another branch: kept, never resumed
        problem = "its trainer.json cannot be read" if state is None else verify_checkpoint(path, state)
        if problem is None:
            found = path
            break
        damaged.append(f"checkpoint {path} is damaged ({problem})")
    for line in damaged:
        report(f"{line}; {'falling back to an older one' if found else 'no older one is complete'}")
    return found


# --------------------------------------------------------------------------------------------
# Saving


def checkpoint_path(folder: Path, step: int) -> Path:
    """Where the checkpoint of `step` is, once complete."""
    return Path(folder) / f"step_{step:08d}"


def save_checkpoint(folder: Path, step: int, tensors: dict[str, Any], trainer_state: dict, keep: int, *,
                    group=None, rng: dict | None = None) -> Path:
    """Write a checkpoint of `step` (every rank calls this); returns its folder. `trainer_state`
    holds "lineage": rotation keeps the newest `keep` checkpoints of that lineage. `group`: the
    process group every collective of the save runs on (None: the default one; a background save
    has its own, scaletrain.train.async_save). `rng`: this rank's generators' state as of the
    step saved (None: now)."""
    folder = Path(folder)
    final = checkpoint_path(folder, step)
    partial = folder / f".{final.name}.partial"
    rank = _rank()
    # imported here, not with this module: DCP and DTensor are a second of imports, paid by the processes that save
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        if rank == 0:
            _clear_partial(folder)
            partial.mkdir()
        _barrier(group)
        dcp.save(tensors, storage_writer=FileSystemWriter(str(partial)), process_group=group,
                 no_dist=not dist.is_initialized())
        _write_json(partial / f"rng_rank{rank}.json", rng if rng is not None else rng_state())
        _barrier(group)  # rank 0's .metadata is written once every rank's data is
        files = {f.name: _digest(f) for f in _own_files(partial, rank)}
        if dist.is_initialized():
            every = [None] * dist.get_world_size()
            dist.all_gather_object(every, files, group=group)
            files = {k: v for part in every for k, v in part.items()}
        if rank == 0:
            _publish(folder, partial, final, step, trainer_state, files, keep)
        _barrier(group)
    except (OSError, RuntimeError, CheckpointException) as e:
        full = _disk_full(folder, _causes(e), _local_bytes(tensors))
        os_errors = [c for c in _causes(e) if isinstance(c, OSError)]
        if not full and not os_errors:
            raise
        if rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        last = latest_checkpoint(folder)
        kept = f"the last complete checkpoint {last} is intact" if last else "no earlier checkpoint exists"
        reason = "the disk is full" if full else f"{os_errors[0].strerror or os_errors[0]}"
        raise CheckpointError(f"saving checkpoint step {step} to {folder} failed: {reason}; {kept}") from None
    return final


def _clear_partial(folder: Path) -> None:
    """Remove what saves or deletions that were killed left: partial folders, and HEAD files
    half-written by another process (this run owns the folder: no other process writes here now)."""
    folder.mkdir(parents=True, exist_ok=True)
    for dead in folder.glob(".step_*"):
        shutil.rmtree(dead, ignore_errors=True)
    for dead in folder.glob(f".{HEAD_FILE}.partial-*"):
        dead.unlink(missing_ok=True)


def _publish(folder: Path, partial: Path, final: Path, step: int, trainer_state: dict, files: dict,
             keep: int) -> None:
    """Rank 0, once every rank's files are in `partial` (`files`: their checksums): write trainer.json,
    rename `partial` to `final` (atomically; the same step saved again replaces the old one), point HEAD
    at it, rotate."""
    # the data folders relative to this checkpoint too: found again when the run folder moves with them
    relative = relative_data((trainer_state.get("config") or {}).get("data") or {}, final)
    _write_json(partial / TRAINER_FILE, {"format_version": FORMAT_VERSION, **trainer_state,
                                         "data_relative": relative, "files": files})
    atomic.fsync_dir(partial)
    lineage = trainer_state.get("lineage") or []
    if final.exists() and not _same_line(final, lineage, step):
        _set_aside(folder, final)  # another branch's checkpoint of this step: kept, out of the way
    if final.exists():  # saving the same step again (e.g. stopped right after a save)
        old = folder / f".step_{step:08d}.old"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(partial, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(partial, final)
    atomic.fsync_dir(folder)
    # the checkpoint is complete; a HEAD left behind still leads to it (its descendant)
    with contextlib.suppress(OSError):  # (a failed write removes its own partial file)
        write_head(folder, lineage, step)
    _rotate(folder, lineage, step, keep)


def _same_line(path: Path, lineage: Lineage, step: int) -> bool:
    try:
        return is_ancestor(*_position(read_trainer_state(path)), lineage, step)
    except CheckpointError:
        return False


def _set_aside(folder: Path, path: Path) -> Path:
    """Move a checkpoint of an abandoned branch (or an unreadable one) to abandoned/, where it is
    never resumed, rotated or overwritten."""
    try:
        branch = _position(read_trainer_state(path))[0][-1][0]
    except (CheckpointError, IndexError):
        branch = "unknown"
    aside = folder / "abandoned" / f"{path.name}.{branch}"
    aside.parent.mkdir(exist_ok=True)
    n = 1
    while aside.exists():
        aside, n = aside.with_name(f"{path.name}.{branch}.{n}"), n + 1
    os.replace(path, aside)
    return aside


def _rotate(folder: Path, lineage: Lineage, step: int, keep: int) -> None:
    """Delete all but the newest `keep` checkpoints on this lineage; other branches stay."""
    mine = [path for path, state in _states(folder)
            if state is not None and is_ancestor(*_position(state), lineage, step)]
    for stale in mine[:-keep]:
        trash = folder / f".{stale.name}.deleting"  # out of sight first: never half a checkpoint
        os.replace(stale, trash)
        shutil.rmtree(trash, ignore_errors=True)


def _local_bytes(tensors: Any) -> int:
    if isinstance(tensors, dict):
        return sum(_local_bytes(v) for v in tensors.values())
    if isinstance(tensors, torch.Tensor):
        t = tensors.to_local() if hasattr(tensors, "to_local") else tensors
        return t.numel() * t.element_size()
    return 0


def _disk_full(folder: Path, causes: list[BaseException], needed: int) -> bool:
    """Whether a failed save ran out of space: an ENOSPC/EDQUOT anywhere, or (torch.save reports a
    short write as a RuntimeError) less room left on the file system than this rank's share."""
    if any(isinstance(c, OSError) and c.errno in (errno.ENOSPC, errno.EDQUOT) for c in causes):
        return True
    try:
        return shutil.disk_usage(folder).free < needed
    except OSError:
        return False


def read_trainer_state(path: Path) -> dict:
    path = Path(path)
    f = path / TRAINER_FILE
    if not path.is_dir() or not f.is_file() or not (path / ".metadata").is_file():
        raise CheckpointError(f"{path} is not a complete scaletrain checkpoint (it needs {TRAINER_FILE} and "
                              ".metadata); pick a step_* folder written by scaletrain, or a run folder that holds one")
    try:
        state = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{f}: not valid JSON ({e.msg}); the checkpoint is damaged") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{f}: expected a JSON object; the checkpoint is damaged")
    if state.get("format_version") not in READABLE_FORMATS:
        raise CheckpointError(f"{f}: checkpoint format {state.get('format_version')!r} is not one this version "
                              f"reads ({', '.join(map(str, READABLE_FORMATS))}); use the scaletrain that wrote it")
    bad = [key for key, kind in (("step", int), ("world_size", int), ("config", dict), ("data", dict),
                                 ("optimizer", dict)) if not isinstance(state.get(key), kind)]
    if not bad and not isinstance(state["config"].get("model"), dict):
        bad.append("config.model")
    if not bad and not {"global_batch", "seed"} <= set(state["data"]):
        bad.append("data")
    if bad:
        raise CheckpointError(f"{f}: missing or malformed {', '.join(bad)}; the checkpoint is damaged")
    return state


def _causes(e: BaseException) -> list[BaseException]:
    """The per-rank exceptions inside DCP's CheckpointException (or e itself)."""
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(e, CheckpointException):
        return [exc for exc, _ in e.failures.values()]
    return [e]


def load_tensors(path: Path, tensors: dict[str, Any], verify: bool = True) -> None:
    """Fill `tensors` (nested dict of tensors, DTensors included) in place from checkpoint `path`,
    after checking its files against their checksums (unless the caller just did)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from scaletrain.train.dcp_safe import SafeLoadPlanner, SafeReader

    if verify and (problem := verify_checkpoint(path)):
        raise CheckpointError(f"{path} is damaged ({problem}); use another checkpoint")
    try:  # read the metadata once first: DCP logs a traceback when it cannot, then fails vaguely
        SafeReader(str(path)).read_metadata()
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - a damaged pickle raises many kinds
        raise CheckpointError(f"{path}/.metadata cannot be read ({type(e).__name__}: {e}); the checkpoint is "
                              "damaged; use another checkpoint") from None
    try:
        dcp.load(tensors, storage_reader=SafeReader(str(path)), planner=SafeLoadPlanner(),
                 no_dist=not dist.is_initialized())
    except (Exception, CheckpointException) as e:
        for cause in _causes(e):
            text = str(cause)
            if isinstance(cause, CheckpointError):
                raise cause from None
            if "refusing to load" in text:  # our refusal, wrapped by DCP on the way out
                raise CheckpointError(text[text.index("refusing to load"):].split("; rank local")[0]) from None
            if isinstance(cause, pickle.UnpicklingError) or "Weights only load failed" in text:
                raise CheckpointError(f"refusing to load {path}: a tensor file holds objects that are not "
                                      "plain tensors; the folder may have been tampered with") from None
            if isinstance(cause, OSError) or "PytorchStreamReader" in text:
                raise CheckpointError(f"{path} is damaged or incomplete ({text.splitlines()[0][:200]}); "
                                      "use another checkpoint") from None
            if isinstance(cause, (KeyError, RuntimeError, AssertionError, ValueError)):
                raise CheckpointError(f"{path} does not match this model and optimizer "
                                      f"({text.splitlines()[0][:200] if text else type(cause).__name__}); "
                                      "resume with the config it was saved with") from None
        raise


def load_rng(path: Path, rank: int, world_size: int, saved_world_size: int) -> bool:
    """Restore this rank's RNG state if the checkpoint had the same number of ranks."""
    f = Path(path) / f"rng_rank{rank}.json"
    if saved_world_size != world_size or not f.is_file():
        return False
    set_rng_state(json.loads(f.read_text()))
    return True


def check_sync(path: Path, state: dict, layout) -> None:
    """Refuse a checkpoint saved under another parallel.sync.mode, or (local_sgd, diloco) by
    another number of workers: each worker's own weights and optimizer state are in it."""
    sync = upgrade(state["config"], [], {}).get("parallel", {}).get("sync", {})  # (old names too)
    saved = sync.get("mode", "step")
    if saved != layout.dp_sync:
        raise CheckpointError(f"{path} was trained with parallel.sync.mode={saved}; resuming it with "
                              f"sync.mode={layout.dp_sync} would not continue the same run; resume with "
                              f"parallel.sync.mode={saved}, or start a new run (model.init_from takes its weights)")
    if layout.outer is not None and not layout.fault_tolerance:  # (across replica groups: any number resumes it)
        outer = state.get("outer")
        if not isinstance(outer, dict) or not isinstance(outer.get("workers"), int):
            raise CheckpointError(f"{path}: trainer.json has no state of the workers' sync; the checkpoint is damaged")
        if outer["workers"] != layout.dp_replicate:
            raise CheckpointError(
                f"{path} holds the weights and inner optimizer state of {outer['workers']} workers "
                f"(sync.mode={saved}); resuming needs {outer['workers']} workers, not {layout.dp_replicate}: set "
                f"parallel.dp_replicate={outer['workers']} (with as many ranks as that takes)")
        if outer.get("in_flight"):  # a fragment's average under way: its parameters and its landing are fixed
            for key, now in (("fragments", layout.sync_fragments), ("delay", layout.sync_delay)):
                was = sync.get(key, now)
                if was != now:
                    step = outer["in_flight"][0].get("apply_at")
                    raise CheckpointError(
                        f"{path} was saved with a fragment's sync in flight under parallel.sync.{key}={was} (it "
                        f"lands at step {step}); resuming with sync.{key}={now} would apply it to other parameters or "
                        f"without the steps done meanwhile: resume with parallel.sync.{key}={was}, or from a "
                        "checkpoint with no sync in flight")


def saved_config(path: Path, state: dict, *, fix: str | None = None, report=None) -> dict:
    """The config checkpoint `path` (its trainer `state`) was saved with, its data folders found
    (`locate_data`): where the run recorded them, else where they lie relative to the checkpoint
    (its run folder moved with them); one that is in neither place is a DataError ending with
    `fix` (None: left for whoever opens it)."""
    return locate_data(state["config"], state.get("data_relative"), Path(path), what=f"the run of {path}",
                       fix=fix, report=report)


def checkpoint_of(path: str | Path, report=print) -> Path:
    """The checkpoint that `eval` and `export` take from `path`: a checkpoint folder itself, or,
    for a run folder (or its checkpoint folder), its newest complete checkpoint on the lineage
    training continues from that verifies (said through `report`)."""
    path = Path(path)
    if (path / TRAINER_FILE).is_file() or STEP_RE.match(path.name) or not path.is_dir():
        return path  # read_trainer_state says what is wrong with it, if anything
    folders = [path / "checkpoints", path]
    try:  # a run whose checkpoint.dir is elsewhere
        elsewhere = json.loads((path / "config.json").read_text())["checkpoint"]["dir"]
        if isinstance(elsewhere, str) and elsewhere:
            folders.insert(0, Path(elsewhere))
    except (OSError, ValueError, KeyError, TypeError):
        pass
    for folder in folders:
        if complete_checkpoints(folder):
            found = find_resumable(folder, report=report)
            if found is None:
                raise CheckpointError(f"{path}: no checkpoint in {folder} verifies; give a step_* folder to use one "
                                      "anyway (each damaged one is named above)")
            report(f"{path}: its newest complete checkpoint is {found}")
            return found
    return path  # neither: read_trainer_state says so
