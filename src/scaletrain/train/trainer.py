"""The training loop: one explicit function per phase, no callbacks.

    setup:  data -> model (meta) -> parallelize -> materialize -> optimizer -> resume
    step:   for each micro-batch: forward, loss / tokens of the global batch, backward
            -> unscale (fp16) -> clip by global norm -> optimizer step (unless overflow) -> lr
    eval:   every train.eval_every steps and at the end, forward only over fixed validation windows
    around: metrics every log.every steps, checkpoints every checkpoint.every steps and at the
            end, and a checkpoint before stopping on SIGINT/SIGTERM.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import errno
import json
import math
import os
import signal
import time
import uuid
from datetime import datetime
from pathlib import Path

import numpy as np
import torch

import torch.distributed as dist
from torch.distributed.tensor import DTensor

from scaletrain.config import JobConfig
from scaletrain.data.dataset import WindowDataset, open_data, open_validation
from scaletrain.data.loader import StepSampler, build_loader, rank_slices, validation_batches
from scaletrain.errors import CheckpointError, ConfigError, DataError, TrainingStopped, UserError
from scaletrain.layout import Layout
from scaletrain.model.flops import flops_per_token
from scaletrain.model.generate import generate
from scaletrain.model.loss import cross_entropy_sum
from scaletrain.model.transformer import Transformer, count_params
from scaletrain.optim import LRSchedule, build_optimizer, get_lr, peak_lr, set_lr
from scaletrain.parallel.data_parallel import DataParallel, clip_gradients, model_state_bytes
from scaletrain.parallel import watchdog
from scaletrain.parallel.launch import Runtime, single_process
from scaletrain.parallel.pipeline import build_schedule
from scaletrain.parallel.parallelize import parallelize
from scaletrain.hardware import device_peak_flops
from scaletrain.precision import MasterWeights, Precision
from scaletrain.train import checkpoint as ckpt
from scaletrain.train import run_folder
from scaletrain.train.metrics import MetricsLogger, peak_memory_bytes, perplexity


# words of gloo's and NCCL's messages when a peer is gone or late
_COMM_FAILURES = ("Timed out", "timed out", "Timeout", "Connection closed", "Connection reset", "Broken pipe",
                  "NCCL communicator was aborted", "Socket Timeout")


class _Interrupted(Exception):
    """A signal during the sample printed after training."""


def default_run_dir() -> str:
    return str(Path("runs") / datetime.now().strftime("%Y%m%d-%H%M%S"))


def _plain(t: torch.Tensor) -> torch.Tensor:
    """A replicated DTensor (the loss under tensor parallelism) as the tensor it holds."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def _with_layout_of(cfg: JobConfig, rt: Runtime) -> Runtime:
    """The runtime with `cfg`'s own layout: one group of processes (one mesh) can run configs
    that differ in engine, stage or batch (bench, verify, the tests), never in the mesh."""
    layout = Layout.from_config(cfg, rt.world_size)
    if layout.mesh_shape != rt.layout.mesh_shape:
        raise ConfigError(f"this group's mesh is {rt.layout.describe_ranks()}, but the config asks for "
                          f"{layout.describe_ranks()}; start a group for that layout")
    return dataclasses.replace(rt, layout=layout)


class Trainer:
    def __init__(self, cfg: JobConfig, runtime: Runtime | None = None, *, stream=None, restart: bool = False,
                 model: torch.nn.Module | None = None, loss_fn=None):
        """`restart`: this process was restarted by the launcher after a failure of the group
        (the run continues from its newest checkpoint, or begins again if it has none).

        `model`: train this nn.Module (with its own weights) instead of building the config's
        transformer. The protocol: `model(inputs)` takes token ids (B, T) and returns what
        `loss_fn(outputs, targets)` turns into the *sum* of the token losses of the micro-batch
        (default: cross-entropy of (B, T, vocab) logits); its repeated blocks are an
        nn.ModuleList/ModuleDict named `layers` (or `h`, `blocks`: see parallel.parallelize.
        find_blocks), the unit of ZeRO-3 sharding, activation checkpointing and compile. Data
        parallelism (DDP, ZeRO 0-3), precision, activation checkpointing and compile apply;
        tensor and pipeline parallelism are refused."""
        self.cfg = cfg
        self._user_model, self.loss_fn = model, loss_fn or cross_entropy_sum
        self.rt = rt = _with_layout_of(cfg, runtime or single_process(cfg))
        rt.layout.check(cfg.model if model is None else None)  # a custom module: tp/pp refused later
        self.rank, self.world_size, self.device = rt.rank, rt.world_size, rt.device
        self.run_dir = Path(cfg.log.run_dir or self._shared(default_run_dir()))
        self.ckpt_dir = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else self.run_dir / "checkpoints"
        self.restart = restart
        self._locks: list[run_folder.FolderLock] = []
        self._notes: list[str] = []  # said once the logger exists
        try:
            self._lock_folders()  # those that exist already; fit() locks the ones it creates
            self._build(stream)
        except BaseException:
            self._release_locks()
            raise

    def _build(self, stream) -> None:
        cfg, rt = self.cfg, self.rt
        self.precision = Precision(cfg.precision, self.device)
        self.precision.configure_backends()
        resume_from = self._find_resume()  # reads only: nothing is written before fit()

        # data: order from (seed, step) alone; each data-parallel rank reads its slice
        self.layout = rt.layout  # ranks, batch triad (global = micro × accum × dp), engines
        self.dp_rank = rt.axis("dp").get_local_rank() if rt.distributed else 0
        self.data = open_data(cfg.data.path, cfg.data.verify_checksums)
        if self._user_model is None and self.data.vocab_size > cfg.model.vocab_size:
            raise DataError(f"{self.data.source}: the tokenizer has {self.data.vocab_size} tokens but "
                            f"model.vocab_size={cfg.model.vocab_size}; set model.vocab_size to at least "
                            f"{self.data.vocab_size}")
        self.dataset = WindowDataset(self.data, cfg.data.seq_len)
        self.tokens_per_step = self.layout.global_batch * cfg.data.seq_len
        self.val_dataset, self.val_batches = self._validation_set()

        # model: built on the meta device (no memory), then parallelized and materialized
        torch.manual_seed(cfg.train.seed + self.rank)  # dropout differs per rank; weights do not
        try:
            if self._user_model is not None:
                from scaletrain.parallel.parallelize import parallelize_module

                self.pm = parallelize_module(self._user_model, cfg, rt, self.precision)
            else:
                with torch.device("meta"):
                    model = Transformer(cfg.model)
                weights = None  # a new run from existing weights (a resumed one takes the checkpoint's)
                if cfg.model.init_from and resume_from is None:
                    from scaletrain.model.hf import load_hf_weights

                    weights = load_hf_weights(cfg.model.init_from, cfg.model)  # names, shapes checked; read on use
                self.pm = parallelize(model, cfg, rt, self.precision, weights=weights)
                if weights is not None:
                    self._notes.append(f"weights from {cfg.model.init_from}: rank {self.rank} read "
                                       f"{weights.bytes_read / 2**20:.2f} MiB of {weights.total_bytes / 2**20:.2f} MiB "
                                       "(its own shards of its own stages' tensors)")
        except RuntimeError as e:  # torch.OutOfMemoryError included
            if "out of memory" not in str(e) and "can't allocate memory" not in str(e):
                raise
            raise ConfigError(f"the model's weights ({count_params(cfg.model) / 1e6:,.1f}M parameters) do not fit "
                              f"in {self.device} memory on rank {self.rank}; shrink the model, or shard it "
                              "(parallel.zero=3, tp, pp): `scaletrain plan --config FILE` finds a layout") from None
        self.dp: DataParallel = self.pm.dp
        self.model = self.dp.model  # forward goes through the data-parallel wrapper
        self.named_params = self.dp.named_params  # this rank's (pipeline stages') parameters
        self.num_params = count_params(cfg.model) if self._user_model is None else \
            sum(p.numel() for p in self._user_model.parameters())  # the whole model's (ZeRO-3: before sharding)
        self.pipeline = self._build_schedule() if self.pm.stages else None
        self.tp = rt.layout.tp

        # optimizer: over what holds the fp32 truth: the parameters, their ZeRO shards, or
        # (bf16-true without a sharding engine) fp32 master copies
        use_master = self.precision.master_weights and not self.pm.keeps_fp32_weights
        self.master = MasterWeights(self.named_params) if use_master else None
        self.optim_params = self.master.named_master if self.master else self.dp.named_optim_params
        self.param_names = {id(p): n for n, p in self.optim_params}
        self.lr = peak_lr(cfg.optim, self.layout.global_batch)
        self.optimizer = build_optimizer(cfg.optim, self.optim_params, self.lr, self.device)
        self.schedule = LRSchedule(cfg.optim, cfg.train.steps)
        self.scaler = self.precision.scaler
        self.state_bytes: dict[str, int] | None = None  # measured during the first step
        self.consecutive_skips = self.skipped_steps = self.spikes = self.applied_steps = 0
        self._loss_mean: float | None = None
        self._early_losses: list[float] = []  # the first steps' losses: the divergence check's yardstick
        self.early_loss: float | None = None
        self._fault: str | None = None  # an I/O failure that stops the run after an emergency save
        self._saving = False
        self.run_id, self.lineage = self._shared((uuid.uuid4().hex[:12], [[uuid.uuid4().hex[:8], 0]]))
        self.resumed_from: Path | None = None
        self._phase = "start-up"  # what the step is doing, named when a collective times out
        self.current_step = 0

        self.step = 0
        self.metrics = MetricsLogger(self.run_dir if self.rank == 0 else None, cfg.train.steps,
                                     enabled=self.rank == 0, tensorboard=cfg.log.tensorboard,
                                     progress=cfg.log.progress, stream=stream)
        if resume_from is not None:
            self._resume(resume_from)
        self._stop_signal: int | None = None
        # a custom module's FLOPs are not known in detail: 6 per parameter per token (matmuls, no attention)
        self.flops_per_token = flops_per_token(cfg.model, cfg.data.seq_len) if self._user_model is None else \
            6 * self.num_params
        self.peak_flops, self.peak_source = device_peak_flops(
            self.device, self.precision.compute_dtype, tf32=cfg.precision.mode == "tf32")

    def _validation_set(self) -> tuple[WindowDataset | None, np.ndarray | None]:
        """The validation windows that train.eval_every evaluates, fixed for the run: (dataset,
        (batches, global_batch) window indices); (None, None) when evaluation is off."""
        train, path = self.cfg.train, self.cfg.data.path
        if not train.eval_every:
            return None, None
        data = open_validation(path, self.cfg.data.verify_checksums)
        if data is None:
            raise ConfigError(f"train.eval_every={train.eval_every} needs a validation split, and data.path {path} has "
                              "none; prepare the data again with --val-fraction (e.g. 0.05), or set train.eval_every=0")
        dataset = WindowDataset(data, self.cfg.data.seq_len)
        return dataset, validation_batches(len(dataset), self.layout.global_batch, train.eval_batches, train.seed,
                                           data.source)

    def _shared(self, value):
        """Rank 0's value of something every rank must agree on (e.g. a time-stamped folder)."""
        if not self.rt.distributed:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    # ---------------------------------------------------------------------------------------
    # set-up helpers

    def _lock_folders(self) -> None:
        """Rank 0 locks the run folder (and a separate checkpoint folder) if they exist; every
        rank learns whether another run holds one."""
        busy = None
        if self.rank == 0:
            for key, folder in (("log.run_dir", self.run_dir), ("checkpoint.dir", self.ckpt_dir)):
                if not folder.is_dir() or any(lock.folder == folder for lock in self._locks):
                    continue
                if key == "checkpoint.dir" and not self.cfg.checkpoint.dir:
                    continue  # inside the run folder, whose lock covers it
                try:
                    self._locks.append(run_folder.FolderLock(folder))
                except run_folder.FolderBusy:
                    busy = (f"{key} {folder} is in use by another scaletrain run (it holds the folder's lock); "
                            f"wait for that run to end, or choose another {key} (nothing was changed)")
                    break
        if busy := self._shared(busy):
            raise ConfigError(busy)

    def _release_locks(self) -> None:
        for lock in self._locks:
            lock.release()
        self._locks = []

    def _find_resume(self) -> Path | None:
        res = self.cfg.checkpoint.resume
        for name, folder in (("log.run_dir", self.run_dir), ("checkpoint.dir", self.ckpt_dir)):
            if folder.exists() and not folder.is_dir():
                raise ConfigError(f"{name} {folder} is a file, not a folder; choose another {name}")
        held = run_folder.holds_run(self.run_dir, self.ckpt_dir)
        if res == "auto":
            found = ckpt.find_resumable(self.ckpt_dir, report=self._notes.append)
            if found is None and held and not self.restart:
                raise ConfigError(f"log.run_dir {self.run_dir} holds a run ({', '.join(held)}) but no complete "
                                  "checkpoint to resume; choose another log.run_dir, or move that folder away to "
                                  "start over (nothing was changed)")
            return found
        if res != "none":
            path = Path(res)
            state = ckpt.read_trainer_state(path)
            own = path.resolve().parent == self.ckpt_dir.resolve()
            owner = run_folder.run_id_of(self.run_dir)
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

    def checkpoint_tensors(self) -> dict:
        # the weights the optimizer steps are the model's true state: fp32 masters in bf16-true,
        # the shards under ZeRO-1/2 (DCP writes each rank's shard and reshards on load)
        optim, _ = ckpt.optimizer_to_named(self.optimizer, self.param_names)
        return {"model": dict(self.optim_params), "optim": optim}

    def _resume(self, path: Path) -> None:
        state = ckpt.read_trainer_state(path)
        # where the shape and the first weights came from does not matter once the run has a checkpoint
        origin = ("from_hf", "init_from")
        saved_model = {k: v for k, v in state["config"]["model"].items() if k not in origin}
        model_now = {k: v for k, v in self.cfg.to_dict()["model"].items() if k not in origin}
        if saved_model != model_now:
            diff = [f"{k}={saved_model.get(k)!r} (now {v!r})" for k, v in model_now.items()
                    if saved_model.get(k) != v]
            raise CheckpointError(f"{path} was saved for another model shape: {', '.join(diff)}; "
                                  "resume with the model config it was saved with")
        data = state["data"]
        if data["global_batch"] != self.layout.global_batch or data["seed"] != self.cfg.train.seed:
            raise CheckpointError(
                f"{path} was trained with global batch {data['global_batch']} and seed "
                f"{data['seed']}; resuming with {self.layout.global_batch} and {self.cfg.train.seed} "
                "would change the data order; keep train.global_batch and train.seed")
        if data.get("seq_len", self.cfg.data.seq_len) != self.cfg.data.seq_len:
            raise CheckpointError(f"{path} was trained with data.seq_len={data['seq_len']}; resuming with "
                                  f"data.seq_len={self.cfg.data.seq_len} would cut the data into other windows and "
                                  "change its order; keep data.seq_len, or start a new run")
        fingerprint = getattr(self.data, "fingerprint", None)
        if data.get("fingerprint") and fingerprint and data["fingerprint"] != fingerprint:
            if not self.cfg.checkpoint.allow_data_change:
                raise CheckpointError(
                    f"{path} was trained on other data ({data.get('source')}, fingerprint {data['fingerprint']}; "
                    f"now {self.data.source}, {fingerprint}); resuming would silently continue on different "
                    "tokens; set checkpoint.allow_data_change=true if that is what you want")
            self._notes.append(f"the data changed since {path} (checkpoint.allow_data_change=true): continuing on "
                               f"{self.data.source}")
        if int(state["step"]) > self.cfg.train.steps:
            raise CheckpointError(f"{path} is at step {state['step']}, past train.steps={self.cfg.train.steps}; set "
                                  f"train.steps above {state['step']} to train on, or resume an earlier checkpoint")
        ckpt.init_optimizer_state(self.optimizer)
        # resume=auto verified the files while choosing this checkpoint; a given path is verified here
        ckpt.load_tensors(path, self.checkpoint_tensors(), verify=self.cfg.checkpoint.resume != "auto")
        ckpt.restore_optimizer_extras(self.optimizer, self.param_names, state["optimizer"])
        self._weights_from_state()
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self.step = int(state["step"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.early_loss = state.get("early_loss")
        # the run goes on under its own id, on a new branch that starts at this checkpoint
        self.run_id = state.get("run_id") or self.run_id
        self.lineage = (state.get("lineage") or []) + [[self.lineage[-1][0], self.step]]
        self.resumed_from = path
        ckpt.load_rng(path, self.rank, self.world_size, state["world_size"])

    def _weights_from_state(self) -> None:
        """Refresh what the model computes with from what the optimizer steps."""
        if self.master:
            self.master.master_to_model()
        self.dp.after_optimizer_step()  # ZeRO-1/2: gather the updated shards into every replica

    def _truncate_metrics(self, step: int) -> None:
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
            self._notes.append(f"{f}: dropped {torn} unreadable row(s) (a write cut short by a crash)")
        if not dropped and not torn:
            return
        head = ckpt.read_head(self.ckpt_dir)
        if dropped and head is not None and head[1] > step:  # a rewind: those rows are another history
            aside = self.run_dir / f"metrics.abandoned-after-step{step}.jsonl"
            aside.write_text("".join(line + "\n" for line in dropped))
            self._notes.append(f"rewinding to step {step}: the metrics of steps {step + 1}-{head[1]} are kept in {aside}")
        tmp = f.with_name(".metrics.jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, f)

    def save(self) -> Path:
        _, skeleton = ckpt.optimizer_to_named(self.optimizer, self.param_names)
        state = {
            "step": self.step,
            "world_size": self.world_size,
            "config": self.cfg.to_dict(),
            "schedule": {"kind": self.cfg.optim.schedule, "step": self.step, "peak_lr": self.lr},
            "scaler": self.scaler.state_dict() if self.scaler else None,
            "data": {"step": self.step, "seed": self.cfg.train.seed, "global_batch": self.layout.global_batch,
                     "seq_len": self.cfg.data.seq_len, "source": self.data.source,
                     "fingerprint": getattr(self.data, "fingerprint", None)},
            "optimizer": skeleton,
            "skipped_steps": self.skipped_steps,
            "early_loss": self.early_loss,
            "run_id": self.run_id,
            "lineage": self.lineage,
        }
        self._saving = True
        try:
            return ckpt.save_checkpoint(self.ckpt_dir, self.step, self.checkpoint_tensors(), state,
                                        keep=self.cfg.checkpoint.keep)
        finally:
            self._saving = False

    def _loader(self):
        b = self.layout
        sampler = StepSampler(len(self.dataset), b.global_batch, b.micro_batch, b.grad_accum,
                              dp_rank=self.dp_rank, dp_size=b.dp, seed=self.cfg.train.seed, start_step=self.step)
        return build_loader(self.dataset, sampler, num_workers=self.cfg.data.num_workers,
                            pin_memory=self.cfg.data.pin_memory and self.device.type == "cuda",
                            prefetch_factor=self.cfg.data.prefetch_factor)

    # ---------------------------------------------------------------------------------------
    # one optimizer step

    def train_step(self, batches) -> tuple[torch.Tensor, torch.Tensor, bool, float]:
        """One optimizer step. Returns (loss, grad_norm, skipped, seconds spent waiting for data)."""
        loss, wait = self.forward_backward(batches)
        grad_norm, skipped = self.update()
        return loss, grad_norm, skipped, wait

    def _loss_context(self):
        """With tensor parallelism the logits stay split by vocabulary: compute the loss (and its
        backward) on the shards, never gathering the full logits."""
        if self.tp > 1:
            from torch.distributed.tensor.parallel import loss_parallel

            return loss_parallel()
        return contextlib.nullcontext()

    def _loss_factor(self) -> float:
        # normalise by the tokens of the whole global batch: gradients add up over micro-batches
        # and ranks, and we want the gradient of the mean token loss. The data-parallel
        # reductions average over ranks, hence the factor dp. Under fp16 that factor is applied
        # when unscaling instead: backward then sees the loss scale times each token's share,
        # exactly as one process does, so it overflows on the same steps on every layout.
        if self.scaler:
            return self.scaler.scale / self.tokens_per_step
        return self.layout.dp / self.tokens_per_step

    def forward_backward(self, batches) -> tuple[torch.Tensor, float]:
        """Accumulate this step's gradients over its micro-batches; returns (loss, data wait)."""
        self._enter("forward/backward")
        if self.pipeline is not None:
            return self._pipeline_forward_backward(batches)
        wait = 0.0
        loss_sum = torch.zeros((), device=self.device)
        last = self.layout.grad_accum - 1
        for k in range(self.layout.grad_accum):
            t0 = time.perf_counter()
            inputs, targets = next(batches)
            wait += time.perf_counter() - t0
            inputs = inputs.to(self.device, non_blocking=True)
            targets = targets.to(self.device, non_blocking=True)
            with self.dp.micro_step(last=k == last), self._loss_context():  # sync gradients on the last
                with self.precision.autocast():
                    logits = self.model(inputs)  # (B, T, vocab)
                loss = self.loss_fn(logits, targets) * self._loss_factor()
                loss.backward()
            loss_sum += _plain(loss.detach())
        self.dp.finish_gradients()
        return loss_sum / self._loss_factor() / self.tokens_per_step, wait

    def measure_activation_bytes(self, batches) -> int | None:
        """Bytes one micro-batch's forward keeps for backward on this rank (measured from live
        tensors); None under pipelining, where a micro-batch's forward spans the schedule."""
        from scaletrain.memory import saved_activation_bytes

        if self.pipeline is not None:
            return None
        inputs, targets = (t.to(self.device) for t in next(batches))

        def forward():
            with self.precision.autocast():
                logits = self.model(inputs)
            return self.loss_fn(logits, targets) * self._loss_factor()

        with self.dp.micro_step(last=True), self._loss_context():
            held = saved_activation_bytes(self.dp.module, forward)
        self.dp.finish_gradients()
        self.dp.zero_grad(self.optimizer)
        if self.master:
            self.master.grads_to_master()
            self.optimizer.zero_grad(set_to_none=True)
        return held

    def _build_schedule(self):
        def loss_fn(logits, targets):
            return self.loss_fn(logits, targets) * self._loss_factor()

        return build_schedule(self.pm.stages, self.layout.pp_schedule, self.layout.grad_accum, loss_fn)

    def _pipeline_forward_backward(self, batches) -> tuple[torch.Tensor, float]:
        """All of the step's micro-batches go through the schedule at once; the last stage
        computes the losses, the others report zero (the metrics sum over stages)."""
        t0 = time.perf_counter()
        parts = [next(batches) for _ in range(self.layout.grad_accum)]
        wait = time.perf_counter() - t0
        inputs = torch.cat([x for x, _ in parts]).to(self.device, non_blocking=True)
        targets = torch.cat([y for _, y in parts]).to(self.device, non_blocking=True)
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.pm.first else ()
        kwargs = {"target": targets, "losses": losses} if self.pm.last else {}
        # the schedule decides when each stage's gradients are final; sharding engines reduce after it
        with self.dp.micro_step(last=False), self._loss_context(), self.precision.autocast():
            self.pipeline.step(*args, return_outputs=False, **kwargs)
        self.dp.finish_gradients()
        loss_sum = torch.stack([_plain(x.detach()).float() for x in losses]).sum() if losses else \
            torch.zeros((), device=self.device)
        return loss_sum / self._loss_factor() / self.tokens_per_step, wait

    @torch.no_grad()
    def evaluate(self) -> float:
        """The mean token loss over the run's fixed validation windows, in eval mode and without
        gradients. Each validation batch is split over ranks and micro-batches exactly like a
        training step's global batch; pipeline stages run the schedule's forward-only pass; the
        summed token losses are all-reduced like the training loss (tensor-parallel ranks hold
        copies). Gradients, optimizer state and random streams are left as they were."""
        self._enter("evaluation")
        b, modules = self.layout, self.dp.modules
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        was_training = [m.training for m in modules]
        for m in modules:
            m.eval()  # no dropout
        try:
            for global_batch in self.val_batches:
                micro = rank_slices(global_batch, b.micro_batch, b.grad_accum, self.dp_rank, b.dp)
                if self.pipeline is not None:
                    total += self._pipeline_eval_sum(micro)
                    continue
                for indices in micro:
                    inputs, targets = (t.to(self.device) for t in self.val_dataset[indices])
                    with self._loss_context():
                        with self.precision.autocast():
                            logits = self.dp.module(inputs)  # the chunk itself: no DDP bookkeeping
                        total += _plain(self.loss_fn(logits, targets)).double()
        finally:
            for m, training in zip(modules, was_training):
                m.train(training)
            if self.dp.zero == 3:
                for module in modules:  # free what FSDP gathered for the forwards
                    for m in module.modules():
                        if hasattr(m, "reshard"):
                            m.reshard()
        if self.rt.distributed:
            self._enter("the evaluation all-reduce")
            dist.all_reduce(total)
            total /= self.layout.tp
        return float(total) / (len(self.val_batches) * self.tokens_per_step)

    def _pipeline_eval_sum(self, micro: list[list[int]]) -> torch.Tensor:
        """One validation batch through the pipeline schedule's forward-only pass: the sum of its
        token losses on the last stage, zero elsewhere."""
        parts = [self.val_dataset[indices] for indices in micro]
        inputs = torch.cat([x for x, _ in parts]).to(self.device)
        targets = torch.cat([y for _, y in parts]).to(self.device)
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.pm.first else ()
        kwargs = {"target": targets, "losses": losses} if self.pm.last else {}
        with self._loss_context(), self.precision.autocast():
            self.pipeline.eval(*args, return_outputs=False, **kwargs)
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for loss in losses:  # the schedule's loss function carries the training scale: take it off
            total += _plain(loss).double() / self._loss_factor()
        return total

    def update(self) -> tuple[torch.Tensor, bool]:
        """Unscale, clip, step, zero: returns (gradient norm before clipping, skipped).

        A step whose gradients are not finite anywhere (an fp16 overflow, or inf/NaN in any
        mode) is skipped without touching the weights or the optimizer state."""
        self._enter("the gradient-norm all-reduce (and fp16 overflow check)")
        if self.master:
            self.master.grads_to_master()
        params = [p for _, p in self.optim_params]
        overflow = self.scaler.unscale_(params, times=self.layout.dp) if self.scaler else False
        grad_norm = clip_gradients(params, self.cfg.train.grad_clip,
                                   self.rt.group("pp") if self.layout.pp > 1 else None)
        # the norm is global (reduced over every shard and stage): every rank decides alike
        skip = overflow or not math.isfinite(float(grad_norm))
        measure = self.state_bytes is None
        if measure:
            self.state_bytes = model_state_bytes(self.dp, params, None)
        self._enter("the optimizer step (with the ZeRO parameter all-gather)")
        if not skip:
            self.optimizer.step()
        if measure:
            self.state_bytes["optimizer"] = model_state_bytes(self.dp, [], self.optimizer)["optimizer"]
            self._report_state_bytes()
        at_minimum = self.scaler is not None and self.scaler.scale <= self.scaler.min_scale
        if self.scaler:
            self.scaler.update(overflow)
        if skip:
            self._skipped(params, overflow, at_minimum)
        else:
            self.consecutive_skips = 0
            self.applied_steps += 1
        self.dp.zero_grad(self.optimizer)
        if not skip:
            self._weights_from_state()
        return grad_norm, skip

    def _skipped(self, params, overflow: bool, at_minimum: bool) -> None:
        """Count a skipped step; stop after train.max_skipped_steps in a row (for fp16, in a row
        at the minimum loss scale: above it, the scaler backs off and tries again)."""
        step, limit = self.step + 1, self.cfg.train.max_skipped_steps
        self.skipped_steps += 1
        if overflow and self.scaler is not None:
            self.consecutive_skips = self.consecutive_skips + 1 if at_minimum else 0
            if self.consecutive_skips < limit:
                return
            raise TrainingStopped(
                f"step {step}: the fp16 loss scale collapsed to its minimum (precision.min_scale="
                f"{self.scaler.min_scale:g}) and gradients still overflow, {self.consecutive_skips} steps in a row; "
                "fp16's range is too small for this run: train with precision.mode=bf16-mixed")
        self.consecutive_skips += 1
        name = self._first_nonfinite_gradient(params)
        self.metrics.info(f"step {step}: non-finite gradient (first in {name}); step skipped, weights untouched")
        if self.consecutive_skips >= limit:
            raise TrainingStopped(
                f"step {step}: {self.consecutive_skips} steps in a row had non-finite gradients (the first in "
                f"{name}); stopping (train.max_skipped_steps={limit}). Lower optim.lr, check the data near this "
                "step, or resume from an earlier checkpoint")

    def _first_nonfinite_gradient(self, params) -> str:
        local = None
        for p in params:
            g = p.grad
            if g is not None and not bool(torch.isfinite(g.to_local() if isinstance(g, DTensor) else g).all()):
                local = self.param_names[id(p)]
                break
        if self.rt.distributed:
            every = [None] * self.world_size
            dist.all_gather_object(every, local)
            local = next((n for n in every if n is not None), None)
        return local or "(none: the loss itself was not finite)"

    def _report_state_bytes(self) -> None:
        b = self.state_bytes
        total = b["params"] + b["grads"] + b["optimizer"]
        self.metrics.info(
            f"model states on rank {self.rank} (measured): parameters {b['params'] / 2**20:.2f} MiB, gradients "
            f"{b['grads'] / 2**20:.2f} MiB, optimizer {b['optimizer'] / 2**20:.2f} MiB, total {total / 2**20:.2f} MiB "
            f"= {total / self.num_params:.2f} bytes/param")

    # ---------------------------------------------------------------------------------------
    # the loop

    def fit(self) -> dict:
        cfg = self.cfg
        self._install_signal_handlers()  # from here on a signal stops the run at a step's end, saved
        try:
            self._take_ownership()
            self._announce()
            result = self._loop()
            if result["stopped_by"] is None and cfg.train.sample_tokens:  # a signal now cuts the sample short
                self._print_sample()
        except BaseException:
            self.metrics.close()  # no file left open (a disk that cannot be unmounted, a torn row)
            raise
        finally:
            self._restore_signal_handlers()
            self._release_locks()
        self.metrics.close()
        return result

    def _print_sample(self) -> None:
        if self.pipeline is not None:
            self.metrics.info("sample: skipped, the model is split into pipeline stages "
                              "(export the checkpoint and sample it whole)")
        elif self._user_model is not None:
            self.metrics.info("sample: skipped, the model is a custom module (its outputs need not be logits)")
        elif self.rank == 0 or self._sample_on_all_ranks():
            try:
                self.metrics.info("sample: " + self.sample(self.cfg.train.sample_prompt, self.cfg.train.sample_tokens))
            except _Interrupted:
                self.metrics.info("sample: interrupted by a signal (training finished and was saved)")

    def _take_ownership(self) -> None:
        """Make the run folder this run's: lock it, record the run's id and config, drop the
        metrics rows that will be trained again, and move HEAD to where training continues."""
        if self.rank == 0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        self._lock_folders()
        if self.rank != 0:
            return
        run_folder.write_identity(self.run_dir, self.run_id)
        tmp = self.run_dir / ".config.json.tmp"
        try:
            tmp.write_text(self.cfg.to_json())
            os.replace(tmp, self.run_dir / "config.json")
        except OSError:
            tmp.unlink(missing_ok=True)
            raise
        if self.resumed_from is not None or self.restart:
            self._truncate_metrics(self.step)  # a restart without a checkpoint begins again at step 0
        if self.resumed_from is not None:
            ckpt.write_head(self.ckpt_dir, self.lineage, self.step)
            others = ckpt.off_lineage(self.ckpt_dir)
            if others:
                self._notes.append(f"kept but never resumed or rotated (another branch): "
                                   f"{', '.join(p.name for p in others)}")
            self.metrics.info(f"resumed from {self.resumed_from} at step {self.step}")
        for note in self._notes:
            self.metrics.info(note)
        self._notes = []

    def _loop(self) -> dict:
        cfg = self.cfg
        losses: list[float] = []
        batches = iter(self._loader())
        window_t0, window_wait, window_steps = time.perf_counter(), 0.0, 0
        last_saved = self.resumed_from if self.resumed_from is not None and self.step >= cfg.train.steps else None
        first_step = self.step
        while self.step < cfg.train.steps:
            self.current_step = self.step + 1
            if self.rt.progress is not None:
                self.rt.progress.step = self.current_step
            set_lr(self.optimizer, self.lr * self.schedule(self.step))
            local_loss, grad_norm, skipped, wait = self._guarded(self.train_step, batches)
            self.step += 1
            loss, stop = self._guarded(self._end_of_step, local_loss)
            self._watch_loss(loss, skipped)
            window_wait += wait
            window_steps += 1
            val_loss = None
            if self.val_batches is not None and not stop and \
                    (self.step % cfg.train.eval_every == 0 or self.step == cfg.train.steps):
                t_eval = time.perf_counter()
                val_loss = self._guarded(self.evaluate)
                window_t0 += time.perf_counter() - t_eval  # evaluating is not training: tokens/s leaves it out
            if self.step % cfg.log.every == 0 or self.step in (1, cfg.train.steps) or val_loss is not None:
                elapsed = time.perf_counter() - window_t0
                row = self._guarded(self._metrics_row, loss, grad_norm, elapsed, window_wait, window_steps)
                if val_loss is not None:
                    row.update(val_loss=val_loss, val_ppl=perplexity(val_loss))
                losses.append(row["loss"])
                self._log(row)
                window_t0, window_wait, window_steps = time.perf_counter(), 0.0, 0
            if cfg.checkpoint.every and self.step % cfg.checkpoint.every == 0:
                self._enter("checkpoint save")
                last_saved = self._guarded(self.save)
            if stop:
                break
        if self.step > first_step and self.applied_steps == 0:
            raise TrainingStopped(
                f"every one of the {self.step - first_step} steps of this run was skipped (non-finite gradients"
                f"{' or fp16 overflow' if self.scaler else ''}): the weights never changed; "
                + ("lower precision.init_scale or train with precision.mode=bf16-mixed" if self.scaler else
                   "lower optim.lr, or check the data and the model's initialisation"))

        stopped = self._stop_signal
        if (self._fault or stopped is not None or cfg.checkpoint.save_final) and \
                (last_saved is None or last_saved.name != f"step_{self.step:08d}"):
            try:
                last_saved = self.save()
            except CheckpointError as e:
                if self._fault:
                    raise UserError(f"{self._fault}; the emergency checkpoint failed too: {e.lines[0]}") from None
                raise
        if self._fault:
            raise UserError(f"{self._fault}; checkpoint {last_saved} was saved first, resume from it once there is room")
        if stopped is not None:
            self.metrics.info(f"stopped by {signal.Signals(stopped).name} after step {self.step}; "
                              f"checkpoint saved to {last_saved}")
        extra = {"checkpoint": str(last_saved) if last_saved else "none",
                 "steps skipped (non-finite gradients)": self.skipped_steps}
        if self.spikes:
            extra["loss spikes logged"] = self.spikes
        self.metrics.summary(extra)
        return {"losses": losses, "history": self.metrics.history, "step": self.step,
                "stopped_by": stopped, "checkpoint": str(last_saved) if last_saved else None,
                "run_dir": str(self.run_dir)}

    def _log(self, row: dict) -> None:
        """Write a metrics row; if the file system refuses it (a full disk), the run stops after
        this step with an emergency checkpoint, which every rank takes part in."""
        if self._fault:
            return
        try:
            self.metrics.log(row)
        except OSError as e:
            what = "the disk is full" if e.errno in (errno.ENOSPC, errno.EDQUOT) else (e.strerror or str(e))
            self._fault = f"step {self.step}: writing metrics to {self.run_dir / 'metrics.jsonl'} failed: {what}"
            self.metrics.enabled = False

    def _enter(self, phase: str) -> None:
        self._phase = phase
        if self.rt.progress is not None:
            self.rt.progress.phase = phase

    def _guarded(self, fn, *args):
        """Run one phase of a step; turn a communication failure into one line that names the
        ranks that stopped participating and the collective it happened in."""
        try:
            return fn(*args)
        except (RuntimeError, dist.DistError) as e:
            text = str(e)
            if isinstance(e, torch.OutOfMemoryError) or "out of memory" in text or "can't allocate memory" in text:
                raise ConfigError(self._describe_oom()) from None
            if not self.rt.distributed or not any(k in text for k in _COMM_FAILURES):
                raise
            raise TrainingStopped(self._describe_comm_failure(text)) from None

    def _describe_oom(self) -> str:
        b = self.layout
        where = f"step {self.current_step}: out of {self.device.type} memory on rank {self.rank} during {self._phase}"
        if self._phase.startswith("forward"):
            ac = self.cfg.memory.activation_checkpointing
            fix = f"lower train.micro_batch (now {b.micro_batch}; gradient accumulation keeps the global batch)"
            if ac != "full":
                fix += f", or set memory.activation_checkpointing={'full' if ac == 'selective' else 'selective or full'}"
            return f"{where} (activations of micro-batch {b.micro_batch} x data.seq_len {self.cfg.data.seq_len}); {fix}"
        return (f"{where}; the model states do not fit: shard them (parallel.zero=2 or 3, tp, pp) or use a smaller "
                "optimizer (optim.name=adafactor or adamw8bit); `scaletrain plan --config FILE` finds a layout")

    def _describe_comm_failure(self, text: str) -> str:
        step = self.current_step
        timed_out = any(k in text for k in ("Timed out", "timed out", "Timeout", "timeout"))
        what = (f"a collective did not complete within parallel.timeout_s={self.cfg.parallel.timeout_s} s"
                if timed_out else "a peer closed its connection")
        lagging = watchdog.lagging(self.rt.progress.store, self.world_size) if self.rt.progress else []
        if not lagging:
            return f"step {step}: {what} during {self._phase}; no rank is behind: another rank failed (see its error)"
        names = ", ".join(str(r.rank) for r in lagging)
        return (f"step {step}: rank {names} stopped participating: {what} (rank {self.rank} waited in "
                f"{self._phase}); " + "; ".join(str(r) for r in lagging))

    def _end_of_step(self, local_loss: torch.Tensor) -> tuple[float, bool]:
        """The global batch's loss, and whether a signal reached any rank (then every rank stops
        after this same step): one small all-reduce for both."""
        flag = float(self._stop_signal or (1 if self._fault else 0))
        if not self.rt.distributed:
            return float(local_loss), bool(flag)
        self._enter("the end-of-step all-reduce of loss and stop flag")
        t = torch.stack([torch.tensor(flag, device=self.device), local_loss.float().reshape(())])
        dist.all_reduce(t)  # every rank's share of the loss; tensor-parallel ranks hold copies
        if t[0] > 0 and not self._fault:
            self._stop_signal = self._stop_signal or signal.SIGTERM
        return float(t[1]) / self.layout.tp, bool(t[0] > 0)

    def _watch_loss(self, loss: float, skipped: bool) -> None:
        """Log a loss above log.spike_factor × its running mean; stop a run whose loss diverged:
        above train.divergence_factor × its early value (the mean of the first 5 steps), or,
        after warm-up, above ln(vocab_size) + train.divergence_margin, which is worse than a
        model that guesses every token uniformly. Every rank sees the same global loss."""
        if skipped or not math.isfinite(loss):
            return
        train = self.cfg.train
        if train.divergence_factor:
            if self.early_loss is None:
                self._early_losses.append(loss)
                if len(self._early_losses) == 5:
                    self.early_loss = sum(self._early_losses) / 5
            elif loss > train.divergence_factor * self.early_loss:
                raise TrainingStopped(
                    f"step {self.step}: the loss {loss:.4f} is {loss / self.early_loss:.1f}x its early value "
                    f"{self.early_loss:.4f} (train.divergence_factor={train.divergence_factor:g}): the run diverged; "
                    "lower optim.lr, raise optim.warmup_steps, or resume from an earlier checkpoint")
            uniform = math.log(self.cfg.model.vocab_size)
            if self._user_model is None and self.step > self.cfg.optim.warmup_steps and \
                    loss > uniform + train.divergence_margin:  # a custom loss need not be a cross-entropy
                raise TrainingStopped(
                    f"step {self.step}: after warm-up the loss {loss:.4f} is above ln(vocab_size) + "
                    f"train.divergence_margin = {uniform:.4f} + {train.divergence_margin:g}, worse than guessing "
                    f"each of {self.cfg.model.vocab_size} tokens uniformly: the run diverged; lower optim.lr, "
                    "raise optim.warmup_steps, or resume from an earlier checkpoint")
        factor = self.cfg.log.spike_factor
        if factor and self._loss_mean is not None and self.step > 10 and loss > factor * self._loss_mean:
            self.spikes += 1
            self.metrics.info(f"loss spike at step {self.step}: {loss:.4f} is {loss / self._loss_mean:.1f}x the "
                              f"running mean {self._loss_mean:.4f} (log.spike_factor={factor:g})")
        self._loss_mean = loss if self._loss_mean is None else 0.98 * self._loss_mean + 0.02 * loss

    def _metrics_row(self, loss: float, grad_norm, elapsed, wait, steps) -> dict:
        peak = peak_memory_bytes(self.device)
        if self.rt.distributed:  # the largest peak of any rank
            self._enter("the metrics all-reduce")
            t = torch.tensor([peak], device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            peak = int(t.item())
        tokens_per_s = self.tokens_per_step * steps / elapsed
        achieved = self.flops_per_token * tokens_per_s / self.world_size  # model FLOP/s per device
        if self.device.type == "cpu" and achieved > self.peak_flops:  # the probe missed the true peak: raise it
            from scaletrain.hardware import raise_cpu_peak

            self.peak_flops = raise_cpu_peak(self.precision.compute_dtype, achieved)
        row = {
            "step": self.step,
            "loss": float(loss),
            "lr": get_lr(self.optimizer),
            "grad_norm": float(grad_norm),
            "tokens_per_s": tokens_per_s,
            "tokens_per_s_per_device": tokens_per_s / self.world_size,
            "mfu": achieved / self.peak_flops,
            "peak_mem_bytes": peak,
            "data_wait_frac": wait / elapsed,
            "step_time_s": elapsed / steps,
            "skipped_steps": self.skipped_steps,
        }
        if self.scaler:
            row["loss_scale"] = self.scaler.scale
        return row

    def _announce(self) -> None:
        b, cfg = self.layout, self.cfg
        self.metrics.info(
            f"scaletrain: {self.num_params / 1e6:.2f}M parameters, device {self.device}, precision "
            f"{cfg.precision.mode}, optimizer {cfg.optim.name}, activation checkpointing "
            f"{cfg.memory.activation_checkpointing}{', compiled' if cfg.train.compile else ''}"
            f"{f'; weights from {cfg.model.init_from}' if cfg.model.init_from and self.resumed_from is None else ''}")
        if self.rt.distributed:
            stages = f"; rank 0 holds stages {self.pm.stage_ids} of {self.pm.num_stages}" if self.layout.pp > 1 else ""
            self.metrics.info(f"layout: {self.layout.explain()}{stages}; backend {dist.get_backend()}")
        self.metrics.info(
            f"data: {self.data.source}, {self.data.num_tokens:,} tokens, {len(self.dataset):,} windows of "
            f"{cfg.data.seq_len}; batch {b.global_batch} = micro {b.micro_batch} x accum {b.grad_accum} "
            f"x dp {b.dp}; run folder {self.run_dir}")
        if self.val_batches is not None:
            n, data = len(self.val_batches), self.val_dataset.data
            self.metrics.info(f"validation: {data.source}, {data.num_tokens:,} tokens; {n} batch(es) = "
                              f"{n * b.global_batch:,} windows every {cfg.train.eval_every} steps and at the end")
        if note := self.precision.note():
            self.metrics.info(note)

    def _install_signal_handlers(self) -> None:
        self._old_handlers = {}

        def handler(signum, frame):
            if self._stop_signal is not None:
                if self.rank == 0:
                    print(f"scaletrain: {signal.Signals(signum).name} again: already stopping; the checkpoint "
                          "save finishes first (SIGKILL would lose it)", file=sys.stderr, flush=True)
            self._stop_signal = self._stop_signal or signum

        try:
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old_handlers[sig] = signal.signal(sig, handler)
        except ValueError:  # not the main thread: leave the process's handlers alone
            self._old_handlers = {}

    def _restore_signal_handlers(self) -> None:
        for sig, old in self._old_handlers.items():
            signal.signal(sig, old)  # the caller's own (the CLI ignores later signals after a stop)

    @torch.no_grad()
    def sample(self, prompt: str, new_tokens: int) -> str:
        """Generate from the trained model. Every rank of a sharded model (FSDP, tensor parallel)
        takes part in each forward; all draw the same tokens from the same generator."""
        tok = self.data.tokenizer
        x = torch.tensor([tok.encode(prompt) or [0]], device=self.device)
        gen = torch.Generator(device=self.device).manual_seed(self.cfg.train.seed)
        module = self.dp.module

        def logits_of(tokens):
            if self._stop_signal is not None and not self.rt.distributed:  # sharded ranks must all go on
                raise _Interrupted()
            with self.precision.autocast():
                logits = module(tokens)
            return logits.full_tensor() if isinstance(logits, DTensor) else logits  # vocabulary shards

        module.eval()
        out = generate(logits_of, x, new_tokens, window=min(self.cfg.data.seq_len, self.cfg.model.max_seq_len),
                       generator=gen)
        module.train()
        if self.rt.distributed and self._sample_on_all_ranks():
            for m in module.modules():  # free what FSDP gathered for the forwards
                if hasattr(m, "reshard"):
                    m.reshard()
            dist.barrier()  # and let every rank finish together
        return tok.decode(out[0].tolist())

    def _sample_on_all_ranks(self) -> bool:
        return self.dp.zero == 3 or self.tp > 1
