"""Checkpoints written in the background (`checkpoint.async_save = true`).

What it does: a save copies the state it checkpoints (weights, optimizer state, the step hooks'
tensors) into CPU memory, pinned where the state lives on a GPU so that the copy runs at the
link's speed, and training goes on while a thread writes that copy exactly as a synchronous save
does: `scaletrain.train.checkpoint.save_checkpoint`, the same files, the same checksums in
trainer.json, the same rename from `.step_N.partial` to `step_N` once every rank's files are in,
the same rotation. What is not a tensor (the step, the data position, the generators' state) is
taken when the save starts, so the checkpoint is the state of the step it names.

The thread's collectives (DCP's plan exchange, the barriers, the gathering of checksums) run on a
gloo process group of their own, created at the run's first background save and kept until the
run ends. Two threads issuing collectives on one group can pair one rank's training all-reduce
with another rank's checkpoint barrier and hang; on separate groups they cannot.

At most one save is in flight: a save waits for the one before it (the staging copy is reused,
so it must not change under a write), and so do the final save, the save on SIGINT/SIGTERM and
the end of the run. A process killed while a thread writes leaves a `.partial` folder, which no
resume takes and the next save clears.

What it saves: the time a save blocks training falls to the copy into CPU memory
(docs/benchmarks.md, "Asynchronous checkpoints"). What it costs: one CPU copy of this rank's
checkpointed state, allocated at the first save and reused by every later one (memory stays flat
over a run); a CPU core busy while a checkpoint is written and hashed; and a save that comes
before the last one is written waits for it.
"""

from __future__ import annotations

import copy
import threading
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from scaletrain.train import checkpoint as ckpt


class CheckpointWriter:
    """Writes a run's checkpoints: each at once (`background` False, checkpoint.async_save off),
    or, for the saves that ask for it, in a thread while training goes on."""

    def __init__(self, background: bool, device: torch.device, timeout: timedelta):
        self.background = background
        self._device, self._timeout = device, timeout
        self._group = None  # the background saves' process group (gloo): made at the first, kept for the run
        self._stager = None  # the CPU copy of the state, allocated at the first save, reused by the next
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.writing: Path | None = None  # the checkpoint being written in the background, if any

    def save(self, folder: Path, step: int, tensors: dict[str, Any], trainer_state: dict, keep: int, *,
             wait: bool = True) -> Path:
        """Save the checkpoint of `step` (every rank calls this, as save_checkpoint); returns its folder.
        `wait` False: return once the state is staged, while a thread writes it (when `background`)."""
        if not self.background:
            return ckpt.save_checkpoint(folder, step, tensors, trainer_state, keep)
        self.wait()  # at most one in flight: the staging copy is about to be overwritten
        staged = self._stage(tensors)
        rng = ckpt.rng_state()  # the generators as of this step, not as of the write
        trainer_state = copy.deepcopy(trainer_state)  # (the lineage list is the live run's)
        group = self._own_group()
        self.writing = ckpt.checkpoint_path(folder, step)
        self._thread = threading.Thread(target=self._write, name=f"scaletrain checkpoint {self.writing.name}",
                                        args=(folder, step, staged, trainer_state, keep, group, rng), daemon=True)
        self._thread.start()
        if wait:
            self.wait()
        return ckpt.checkpoint_path(folder, step)

    def wait(self) -> None:
        """Until the save being written in the background, if any, is complete; its failure (a full
        disk: a CheckpointError naming the step and the last complete checkpoint) is raised here."""
        if self._thread is None:
            return
        self._thread.join()
        self._thread, self.writing = None, None
        error, self._error = self._error, None
        if error is not None:
            raise error

    def close(self) -> None:
        """The end of the run: a save still being written completes first (so the run folder is not let
        go under it); its error, on a run already failing, is dropped for the run's own. Then the
        group and the staging copy go."""
        try:
            if self._thread is not None:
                self._thread.join()
        finally:
            self._thread, self.writing, self._error = None, None, None
            if self._group is not None:
                dist.destroy_process_group(self._group)
                self._group = None
            if self._stager is not None:
                self._stager.close()
                self._stager = None

    def _write(self, folder: Path, step: int, staged: dict, trainer_state: dict, keep: int, group, rng: dict) -> None:
        try:
            ckpt.save_checkpoint(folder, step, staged, trainer_state, keep, group=group, rng=rng)
        except BaseException as e:  # noqa: BLE001 - handed to the training thread, which raises it in wait()
            self._error = e

    def _stage(self, tensors: dict[str, Any]) -> dict[str, Any]:
        """A CPU copy of `tensors` (DTensors stay DTensors, their local shards copied), into buffers
        kept from the last save: PyTorch's stager keys them by the storage they copy."""
        if self._stager is None:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            gpu = self._device.type == "cuda"
            self._stager = DefaultStager(StagingOptions(use_pinned_memory=gpu, use_shared_memory=False,
                                                        use_async_staging=False, use_non_blocking_copy=gpu))
        staged = self._stager.stage(tensors)
        _keep_grad_flags(tensors, staged)
        return staged

    def _own_group(self):
        """The background saves' process group, made by every rank together at the first save
        (all ranks save at the same steps); None in a single process."""
        if self._group is None and dist.is_initialized():
            self._group = dist.new_group(backend="gloo", timeout=self._timeout)
        return self._group


def _keep_grad_flags(source: Any, staged: Any) -> None:
    """DCP records each tensor's requires_grad in .metadata; the copies are made without it. Given back
    their originals' (the parameters'), a background save's .metadata describes the tensors as a
    synchronous save's does."""
    if isinstance(source, dict):
        for key, value in source.items():
            _keep_grad_flags(value, staged[key])
    elif isinstance(source, (list, tuple)):
        for a, b in zip(source, staged, strict=True):
            _keep_grad_flags(a, b)
    elif isinstance(source, torch.Tensor) and source.requires_grad and not staged.requires_grad:
        staged.requires_grad_(True)


def writer_for(cfg, device: torch.device) -> CheckpointWriter:
    """The checkpoint writer of a run of `cfg` (a JobConfig) on `device`."""
    return CheckpointWriter(cfg.checkpoint.async_save, device, timedelta(seconds=cfg.parallel.timeout_s))
