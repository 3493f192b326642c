"""A run folder belongs to one run at a time, and to one run ever.

* A lock: rank 0 holds an exclusive `flock` on the run folder (and on a separate checkpoint
  folder) while it trains, so a second run pointed at the same folder stops with one line
  instead of interleaving metrics and rotating away the first run's checkpoints. The kernel
  drops the lock when the process ends, however it ends, so a crash never leaves a stale lock.
* An identity: `run.json` holds the run's id, which every checkpoint also records; a
  checkpoint of another run is never resumed into this folder.
* A lineage: the branches of the run's history, each (branch id, step it starts at); a resume
  starts a new branch at its checkpoint's step, and HEAD in the checkpoint folder points at it.

Locking costs one open file descriptor; nothing is written to take it. `RunFolder` is how a
trainer holds its folders: it locks them, finds the checkpoint to resume (reading only), and,
once training starts, makes them the run's own.
"""

from __future__ import annotations

import errno
import fcntl
import json
import math
import os
import time
import uuid
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

from scaletrain import atomic
from scaletrain.config import JobConfig, locate_data
from scaletrain.errors import CheckpointError, ConfigError
from scaletrain.train import checkpoint as ckpt

RUN_FILE = "run.json"


def default_run_dir() -> str:
    return str(Path("runs") / datetime.now().strftime("%Y%m%d-%H%M%S"))


class FolderLock:
    """An exclusive, non-blocking lock on a folder, held until `release()` or process exit."""

    def __init__(self, folder: Path):
        self.folder = folder
        self._fd: int | None = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            self.release()
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise FolderBusy(folder) from None
            raise

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the flock
            self._fd = None

    def __del__(self):
        self.release()


class FolderBusy(Exception):
    def __init__(self, folder: Path):
        super().__init__(str(folder))
        self.folder = folder


def holds_run(run_dir: Path, ckpt_dir: Path) -> list[str]:
    """What in these folders shows that a run already lives there (empty: nothing)."""
    found = [name for name in (RUN_FILE, "metrics.jsonl", "config.json") if (run_dir / name).exists()]
    if ckpt_dir.is_dir() and any(p.name.startswith("step_") for p in ckpt_dir.iterdir()):
        found.append(f"checkpoints in {ckpt_dir}")
    return found


def run_id_of(run_dir: Path) -> str | None:
    try:
        value = json.loads((run_dir / RUN_FILE).read_text()).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


def write_identity(run_dir: Path, run_id: str) -> None:
    """Record the run's id (once: a folder never changes hands)."""
    if run_id_of(run_dir) == run_id:
        return
    # a full disk leaves nothing half-written behind
    atomic.write_json(run_dir / RUN_FILE, {"run_id": run_id, "created": time.strftime("%Y-%m-%dT%H:%M:%S")},
                     indent=None)


def new_identity() -> tuple[str, list[list]]:
    """A new run's id, and its lineage: one branch, which starts at step 0."""
    return uuid.uuid4().hex[:12], [[uuid.uuid4().hex[:8], 0]]


def continued_lineage(saved: list | None, branch: str, step: int) -> list[list]:
    """A resumed run's lineage: the checkpoint's, and a new branch that starts at its step."""
    return (saved or []) + [[branch, step]]


class RunFolder:
    """The run folder (`log.run_dir`) and the checkpoint folder as one run holds them.
    `shared(value)`: rank 0's value, on every rank; `restart`: the launcher restarted this
    process after a failure of the group (the run continues, or begins again)."""

    def __init__(self, run_dir: Path, ckpt_dir: Path, cfg: JobConfig, rank: int, *,
                 shared: Callable, restart: bool = False):
        self.run_dir, self.ckpt_dir, self.cfg, self.rank = run_dir, ckpt_dir, cfg, rank
        self.shared, self.restart = shared, restart
        self.locks: list[FolderLock] = []
        self.notes: list[str] = []  # said once the logger exists

    def identity(self) -> tuple[str, list[list]]:
        """The run's id and lineage: a new run's, or, for a process the launcher restarted (its replica
        group's, or its job's, with no checkpoint to resume), the id its folder records: the same run."""
        run_id, lineage = new_identity()
        if self.restart and (kept := run_id_of(self.run_dir)):
            run_id = kept
        return run_id, lineage

    def lock(self) -> None:
        """Rank 0 locks the run folder (and a separate checkpoint folder) if they exist; every
        rank learns whether another run holds one."""
        busy = None
        if self.rank == 0:
            for key, folder in (("log.run_dir", self.run_dir), ("checkpoint.dir", self.ckpt_dir)):
                if not folder.is_dir() or any(lock.folder == folder for lock in self.locks):
                    continue
                if key == "checkpoint.dir" and not self.cfg.checkpoint.dir:
                    continue  # inside the run folder, whose lock covers it
                try:
                    self.locks.append(FolderLock(folder))
                except FolderBusy:
                    busy = (f"{key} {folder} is in use by another scaletrain run (it holds the folder's lock); "
                            f"wait for that run to end, or choose another {key} (nothing was changed)")
                    break
        if busy := self.shared(busy):
            raise ConfigError(busy)

    def release(self) -> None:
        for lock in self.locks:
            lock.release()
        self.locks = []

    def find_resume(self) -> Path | None:
        """The checkpoint this run continues from (checkpoint.resume), or None for a new run;
        refuses a folder that holds another run. Reads only: nothing is written."""
        res = self.cfg.checkpoint.resume
        for name, folder in (("log.run_dir", self.run_dir), ("checkpoint.dir", self.ckpt_dir)):
            if folder.exists() and not folder.is_dir():
                raise ConfigError(f"{name} {folder} is a file, not a folder; choose another {name}")
        held = holds_run(self.run_dir, self.ckpt_dir)
        if res == "auto":
            damaged: list[str] = []
            found = ckpt.find_resumable(self.ckpt_dir, report=damaged.append)
            # a replica group of a fault-tolerant job that never wrote one (another group did) heals from a peer
            if found is None and held and not self.restart and not self.cfg.fault_tolerance.enabled:
                if damaged:  # each named with what is wrong with it, as export does; nothing suggested that loses one
                    raise ConfigError(*damaged, f"log.run_dir {self.run_dir} holds a run ({', '.join(held)}) whose "
                                      "checkpoints are all damaged (above); restore one from a copy, or train anew "
                                      "in another log.run_dir (nothing was changed)")
                raise ConfigError(f"log.run_dir {self.run_dir} holds a run ({', '.join(held)}) but no complete "
                                  "checkpoint to resume; choose another log.run_dir to start over (nothing was "
                                  "changed)")
            self.notes.extend(damaged)
            return found
        if res != "none":
            path = Path(res)
            state = ckpt.read_trainer_state(path)
            own = path.resolve().parent == self.ckpt_dir.resolve()
            owner = run_id_of(self.run_dir)
            if held and not own and (owner is None or owner != state.get("run_id")):
                raise ConfigError(
                    f"log.run_dir {self.run_dir} holds another run ({', '.join(held)}); resuming {path} there "
                    "would mix two runs' metrics and checkpoints; set log.run_dir to a new folder, or resume one "
                    f"of {self.ckpt_dir}'s own checkpoints (nothing was changed)")
            return path
        if self.cfg.checkpoint.dir and ckpt.complete_checkpoints(self.ckpt_dir):
            raise ConfigError(f"checkpoint.dir {self.ckpt_dir} already holds checkpoints; set checkpoint.resume=auto "
                              "to continue from them, or choose another checkpoint.dir (nothing was changed)")
        if held:
            raise ConfigError(f"log.run_dir {self.run_dir} already holds a run; set checkpoint.resume=auto "
                              "to continue it, or choose another log.run_dir (nothing was changed)")
        return None

    def check_resumable(self, path: Path, state: dict, *, global_batch: int, data,
                        peak_lr: float | None = None) -> None:
        """Refuse checkpoint `path` (its trainer `state`) if it was saved for another model shape,
        batch, seed, window length, data (unless checkpoint.allow_data_change) or is past
        train.steps: resuming it would not continue the same run. A learning-rate schedule that
        differs from the saved one from here on (train.steps raised, say) is said in one line."""
        cfg = self.cfg
        # where the shape and the first weights came from does not matter once the run has a checkpoint
        origin = ("from_hf", "init_from")
        saved_model = {k: v for k, v in state["config"]["model"].items() if k not in origin}
        model_now = {k: v for k, v in cfg.to_dict()["model"].items() if k not in origin}
        if saved_model != model_now:
            diff = [f"{k}={saved_model.get(k)!r} (now {v!r})" for k, v in model_now.items()
                    if saved_model.get(k) != v]
            raise CheckpointError(f"{path} was saved for another model shape: {', '.join(diff)}; "
                                  "resume with the model config it was saved with")
        if diff := adapter_changes(state["config"].get("adapter", {}), cfg.to_dict()["adapter"]):
            raise CheckpointError(f"{path} was saved with other adapters: {', '.join(diff)}; resume with the adapter "
                                  "settings it was saved with")
        saved = state["data"]
        if saved["global_batch"] != global_batch or saved["seed"] != cfg.train.seed:
            raise CheckpointError(
                f"{path} was trained with global batch {saved['global_batch']} and seed "
                f"{saved['seed']}; resuming with {global_batch} and {cfg.train.seed} "
                "would change the data order; keep train.global_batch and train.seed")
        ramp = state["config"].get("train", {}).get("batch_rampup", "")
        if ramp != cfg.train.batch_rampup:
            raise CheckpointError(f"{path} was trained with train.batch_rampup={ramp!r}; resuming with "
                                  f"{cfg.train.batch_rampup!r} would change the batches and the data order; keep "
                                  "train.batch_rampup")
        if saved.get("seq_len", cfg.data.seq_len) != cfg.data.seq_len:
            raise CheckpointError(f"{path} was trained with data.seq_len={saved['seq_len']}; resuming with "
                                  f"data.seq_len={cfg.data.seq_len} would cut the data into other windows and "
                                  "change its order; keep data.seq_len, or start a new run")
        fingerprint = getattr(data, "fingerprint", None)
        if saved.get("fingerprint") and fingerprint and saved["fingerprint"] != fingerprint:
            if not cfg.checkpoint.allow_data_change:
                raise CheckpointError(
                    f"{path} was trained on other data ({saved.get('source')}, fingerprint {saved['fingerprint']}; "
                    f"now {data.source}, {fingerprint}); resuming would silently continue on different "
                    "tokens; set checkpoint.allow_data_change=true if that is what you want")
            self.notes.append(f"the data changed since {path} (checkpoint.allow_data_change=true): continuing on "
                              f"{data.source}")
        if int(state["step"]) > cfg.train.steps:
            raise CheckpointError(f"{path} is at step {state['step']}, past train.steps={cfg.train.steps}; set "
                                  f"train.steps above {state['step']} to train on, or resume an earlier checkpoint")
        if peak_lr is not None and (note := schedule_change(state, cfg, peak_lr)):
            self.notes.append(note)

    def take_ownership(self, run_id: str, lineage: list, step: int, resumed_from: Path | None,
                       say: Callable[[str], None]) -> None:
        """Make the run folder this run's: lock it, record the run's id and config, drop the
        metrics rows that will be trained again, and move HEAD to where training continues;
        then `say` the notes gathered so far (rank 0)."""
        if self.rank == 0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        self.lock()
        if self.rank != 0:
            return
        write_identity(self.run_dir, run_id)
        atomic.write_text(self.run_dir / "config.json", self.cfg.to_json())
        if resumed_from is not None or self.restart:
            self.truncate_metrics(step)  # a restart without a checkpoint begins again at step 0
        if resumed_from is not None:
            ckpt.write_head(self.ckpt_dir, lineage, step)
            others = ckpt.off_lineage(self.ckpt_dir)
            if others:
                self.notes.append(f"kept but never resumed or rotated (another branch): "
                                  f"{', '.join(p.name for p in others)}")
            say(f"resumed from {resumed_from} at step {step}")
        for note in self.notes:
            say(note)
        self.notes = []

    def truncate_metrics(self, step: int) -> None:
        """Drop metrics rows past the checkpoint: those steps are trained again. A torn last row
        (a crash mid-write) is dropped; rows of an abandoned branch are kept aside in a file."""
        f = self.run_dir / "metrics.jsonl"
        if not f.exists():
            return
        kept, dropped, torn = [], [], 0
        for line in f.read_text(errors="replace").splitlines():
            try:
                row = json.loads(line)
                (kept if row["step"] <= step else dropped).append(line)
            except (ValueError, TypeError, KeyError):
                torn += line.strip() != ""
        if torn:
            self.notes.append(f"{f}: dropped {torn} unreadable row(s) (a write cut short by a crash)")
        if not dropped and not torn:
            return
        head = ckpt.read_head(self.ckpt_dir)
        if dropped and head is not None and head[1] > step:  # a rewind: those rows are another history
            aside = self.run_dir / f"metrics.abandoned-after-step{step}.jsonl"
            aside.write_text("".join(line + "\n" for line in dropped))
            self.notes.append(f"rewinding to step {step}: "
                              f"the metrics of steps {step + 1}-{head[1]} are kept in {aside}")
        atomic.write_text(f, "".join(line + "\n" for line in kept))


def schedule_change(state: dict, cfg: JobConfig, peak_lr: float) -> str | None:
    """One line on what the learning-rate schedule becomes when resuming checkpoint `state` under
    `cfg` (peak `peak_lr`) changes it from the next step on — a longer train.steps stretches the
    decay, and the learning rate jumps back up — or None when it goes on as saved."""
    from scaletrain.config import OptimConfig
    from scaletrain.schedule import LRSchedule

    step = int(state["step"])
    saved_cfg, saved_steps = state["config"].get("optim", {}), state["config"].get("train", {}).get("steps")
    saved_peak = (state.get("schedule") or {}).get("peak_lr")
    try:
        saved_optim = OptimConfig(**{k: v for k, v in saved_cfg.items() if k in OptimConfig.__dataclass_fields__})
        before = saved_peak * LRSchedule(saved_optim, int(saved_steps))(step)
    except (TypeError, ValueError):  # a checkpoint from before the schedule was recorded: nothing to compare
        return None
    now_schedule = LRSchedule(cfg.optim, cfg.train.steps)
    after = peak_lr * now_schedule(step)
    if math.isclose(before, after, rel_tol=1e-9, abs_tol=1e-15):
        return None
    changed = [f"{key} {a} -> {b}" for key, a, b in (
        ("train.steps", saved_steps, cfg.train.steps), ("optim.schedule", saved_optim.schedule, cfg.optim.schedule),
        ("optim.warmup_steps", saved_optim.warmup_steps, cfg.optim.warmup_steps),
        ("optim.min_lr_ratio", saved_optim.min_lr_ratio, cfg.optim.min_lr_ratio),
        ("peak lr", f"{saved_peak:.3g}", f"{peak_lr:.3g}")) if a != b]
    end = peak_lr * now_schedule(cfg.train.steps - 1)
    return (f"the learning-rate schedule changed ({', '.join(changed)}): it is now {cfg.optim.schedule} from "
            f"{peak_lr:.3g} over {cfg.train.steps} steps, so step {step + 1} trains at lr {after:.3g} where the "
            f"saved schedule gave {before:.3g}, and step {cfg.train.steps} at {end:.3g}; resume with the "
            "checkpoint's train.steps and optim settings to continue it unchanged")


def saved_config(options: dict[str, str], report: Callable[[str], None]) -> tuple[dict, str] | None:
    """The config of the run that command-line `options` ({"section.key": text}) resume, as
    saved, and where it was read: checkpoint.resume=auto in log.run_dir reads the run's
    config.json, or, where that is missing or not a config, the config its newest checkpoint
    holds (said through `report`); checkpoint.resume=FOLDER reads that checkpoint's own config.
    Its data folders are found where the run recorded them, or where they moved with the run
    (`ckpt.saved_config`), unless the options name the data. None when the options resume
    nothing that has a config (a new run, or a folder without one)."""
    resume = options.get("checkpoint.resume", "none").strip()
    fix = "give the data's folder with --data.path (--data.mix for several)"
    if "data.path" in options or "data.mix" in options:
        fix = None  # the data given replaces the run's: nothing to find
    if resume == "auto":
        run_dir = options.get("log.run_dir", "")
        if not run_dir:
            return None
        f = Path(run_dir) / "config.json"
        raw, problem = None, "missing"
        if f.exists():
            try:
                raw = json.loads(f.read_text())
                problem = None if isinstance(raw, dict) else f"a JSON {type(raw).__name__}, not an object of sections"
            except (OSError, ValueError):  # a folder in its place, or not JSON
                problem = "not readable as JSON"
        section = raw.get("checkpoint") if problem is None else None
        elsewhere = section.get("dir") if isinstance(section, dict) and isinstance(section.get("dir"), str) else ""
        folder = Path(options.get("checkpoint.dir") or elsewhere or Path(run_dir) / "checkpoints")
        newest, state = None, None
        for candidate in reversed(ckpt.complete_checkpoints(folder)) if folder.is_dir() else []:
            try:  # a damaged one is named by the trainer, which resumes an older one
                newest, state = candidate, ckpt.read_trainer_state(candidate)
                break
            except CheckpointError:
                continue
        if newest is None:  # nothing to resume: the trainer says so, or starts the run
            if problem == "missing":
                return None
            if problem is None:
                return raw, str(f)
            raise ConfigError(f"{f}: {problem}, so not the run's config, and no checkpoint in {folder} holds one; "
                              "restore it, or give the run's config with --config FILE")
        if problem is not None:  # every checkpoint holds the config it was saved with
            report(f"{f} is {problem}: the run's config is the one its newest checkpoint holds, {newest}")
            return ckpt.saved_config(newest, state, fix=fix, report=report), str(newest / ckpt.TRAINER_FILE)
        # the checkpoint's record of where the data lies relative to it holds for the data it names
        saved_data, data, recorded = state["config"].get("data"), raw.get("data"), state.get("data_relative")
        same = {k: v for k, v in recorded.items() if isinstance(saved_data, dict) and isinstance(data, dict)
                and saved_data.get(k) == data.get(k)} if isinstance(recorded, dict) else {}
        return locate_data(raw, same, newest, what=f"the run of {f}", fix=fix, report=report), str(f)
    if resume == "none" or not (Path(resume) / ckpt.TRAINER_FILE).is_file():
        return None  # a missing folder is reported by the config's own check
    state = ckpt.read_trainer_state(Path(resume))
    return ckpt.saved_config(Path(resume), state, fix=fix, report=report), str(Path(resume) / ckpt.TRAINER_FILE)


def adapter_changes(saved: dict, now: dict) -> list[str]:
    """The adapter.* settings the adapters' tensors and numbers depend on, changed since a checkpoint
    (a checkpoint from before the section was adapter.kind=none)."""
    kind = saved.get("kind", "none")
    if kind != now["kind"] or kind == "none":
        return [] if kind == now["kind"] else [f"adapter.kind={kind!r} (now {now['kind']!r})"]
    return [f"adapter.{k}={saved.get(k)!r} (now {now[k]!r})" for k in ("rank", "alpha", "targets", "rslora")
            if saved.get(k) != now[k]]
