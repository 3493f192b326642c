"""The training loop: one explicit function per phase, no callbacks.

    setup:  data -> model (meta) -> parallelize -> materialize -> optimizer -> resume
    step:   for each micro-batch: forward, loss / tokens of the global batch, backward
            -> unscale (fp16) -> clip by global norm -> optimizer step (unless overflow) -> lr
    eval:   every train.eval_every steps and at the end, forward only over fixed validation windows
    around: metrics every log.every steps, checkpoints every checkpoint.every steps and at the
            end, and a checkpoint before stopping on SIGINT/SIGTERM.

Each concern around the loop lives in a module named after it: train.run_folder (locks, resume
look-up, the folder's identity), train.health (what stops a run, and its one-line reason; the
signals that stop it), train.metrics (a metrics row, the lines that open the log),
train.evaluate (the validation loss), parallel.pipeline (a step through the pipeline schedule),
model.generate (the sample).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import signal
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from scaletrain.config import JobConfig
from scaletrain.data.dataset import WindowDataset, open_data
from scaletrain.config import parse_mix
from scaletrain.data.loader import StepSampler, build_loader
from scaletrain.data.mix import MixData, MixDataset, MixSampler
from scaletrain.errors import ConfigError, DataError
from scaletrain.model.flops import flops_per_token
from scaletrain.model.generate import Interrupted, sample_text
from scaletrain.model.loss import cross_entropy_sum
from scaletrain.model.transformer import Transformer, count_params
from scaletrain.optim import LRSchedule, build_optimizer, get_lr, peak_lr, set_lr
from scaletrain.parallel import pipeline
from scaletrain.parallel.context_parallel import reduce_gradients, shard_sequence
from scaletrain.parallel.data_parallel import DataParallel, clip_gradients, model_state_bytes
from scaletrain.parallel.init import canonical_name
from scaletrain.parallel.parallelize import parallelize
from scaletrain.parallel.tensor_parallel import replicated_kv_names
from scaletrain.precision import MasterWeights, Precision
from scaletrain.quant.fp8 import precompute_fp8_scales
from scaletrain.quant.layers import describe, layer_plan
from scaletrain.runtime import Runtime, single_process
from scaletrain.train import checkpoint as ckpt
from scaletrain.train import run_folder
from scaletrain.train.evaluate import validation_loss, validation_sets
from scaletrain.train.health import Health, StopSignals
from scaletrain.train.metrics import MetricsLogger, StepMeter, announce, perplexity, report_state_bytes
from scaletrain.train.run_folder import default_run_dir


def _plain(t: torch.Tensor) -> torch.Tensor:
    """A replicated DTensor (the loss under tensor parallelism) as the tensor it holds."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def _kept_in(part: str, name: str) -> property:
    """A Trainer attribute kept by one of its parts (self.health, self.signals, self.meter)."""
    return property(lambda self: getattr(getattr(self, part), name),
                    lambda self, value: setattr(getattr(self, part), name, value))


class Trainer:
    """One run: `fit()` trains it; `train_step`, `evaluate`, `save` and `sample` are its parts."""

    # what stops a run is counted by self.health; these read and set it there
    early_loss = _kept_in("health", "early_loss")
    skipped_steps = _kept_in("health", "skipped_steps")
    consecutive_skips = _kept_in("health", "consecutive_skips")
    applied_steps = _kept_in("health", "applied_steps")
    spikes = _kept_in("health", "spikes")
    _fault = _kept_in("health", "fault")  # an I/O failure that stops the run after an emergency save
    _stop_signal = _kept_in("signals", "received")  # the SIGINT/SIGTERM that stops the run at a step's end
    # what MFU is measured against: model FLOPs per token, and the device's peak FLOP/s
    flops_per_token = _kept_in("meter", "flops_per_token")
    peak_flops = _kept_in("meter", "peak_flops")

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
        # the runtime's layout is cfg's (derived once, where the job began); a config that asks for
        # another stage or batch on the same group of ranks gets its own layout on the same mesh
        self.rt = rt = (runtime or single_process(cfg)).for_config(cfg)
        # a custom module: tp, pp and cp refused later
        rt.layout.check(cfg.model if model is None else None, seq_len=cfg.data.seq_len)
        self.rank, self.world_size, self.device = rt.rank, rt.world_size, rt.device
        self.run_dir = Path(cfg.log.run_dir or self._shared(default_run_dir()))
        if not cfg.log.run_dir:  # the folder it writes, in the config it saves (resuming reads it there)
            self.cfg = cfg = dataclasses.replace(cfg, log=dataclasses.replace(cfg.log, run_dir=str(self.run_dir)))
        self.ckpt_dir = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else self.run_dir / "checkpoints"
        self.restart = restart
        self.folder = run_folder.RunFolder(self.run_dir, self.ckpt_dir, cfg, self.rank, shared=self._shared,
                                           restart=restart)
        try:
            self.folder.lock()  # those that exist already; fit() locks the ones it creates
            self._build(stream)
        except BaseException:
            self.folder.release()
            raise

    def _build(self, stream) -> None:
        """Data -> model (meta) -> parallelize -> materialize -> optimizer -> metrics -> resume."""
        cfg, rt = self.cfg, self.rt
        from scaletrain.train.trackers import missing_packages  # before anything is built or written

        if missing := self._shared(missing_packages(cfg.log) if self.rank == 0 else None):
            raise ConfigError(*missing)  # only rank 0 logs: its packages are the ones that matter
        self.precision = Precision(cfg.precision, self.device)
        self.precision.configure_backends()
        resume_from = self.folder.find_resume()  # reads only: nothing is written before fit()
        self.layout = rt.layout  # ranks, batch triad (global = micro × accum × dp), engines
        self._build_data()
        self._build_model(resume_from)
        # the validation windows (train.eval_every), once the model is known to fit
        self.val_sets = validation_sets(cfg, self.layout.global_batch)
        self._build_optimizer()
        self.run_id, self.lineage = self._shared(run_folder.new_identity())
        self.resumed_from: Path | None = None
        self.step = 0
        self.metrics = MetricsLogger(self.run_dir if self.rank == 0 else None, cfg.train.steps,
                                     enabled=self.rank == 0, tensorboard=cfg.log.tensorboard,
                                     progress=cfg.log.progress, stream=stream, device_type=self.device.type)
        self.health = Health(cfg, self.layout, rt, self.metrics, scaler=self.scaler, param_names=self.param_names,
                             custom_loss=self._user_model is not None)
        if resume_from is not None:
            self._resume(resume_from)
        self.signals = StopSignals(self.rank)
        # a custom module's FLOPs are not known in detail: 6 per parameter per token (matmuls, no attention)
        self.meter = StepMeter(rt, tokens_per_step=self.tokens_per_step, compute_dtype=self.precision.compute_dtype,
                               flops_per_token=flops_per_token(cfg.model, cfg.data.seq_len)
                               if self._user_model is None else 6 * self.num_params,
                               tf32=cfg.precision.mode == "tf32", enter=self.health.enter)

    def _build_data(self) -> None:
        """Data: order from (seed, step) alone; each data-parallel rank reads its slice."""
        cfg = self.cfg
        self.dp_rank = self.rt.axis("dp").get_local_rank() if self.rt.distributed else 0
        # context-parallel ranks read the same batch, each its own chunks of every sequence
        self.cp_rank = self.rt.axis("cp").get_local_rank() if self.layout.cp > 1 else 0
        if cfg.data.mix:  # several folders in proportion (scaletrain.data.mix)
            self.data = MixData(parse_mix(cfg.data.mix), cfg.data.verify_checksums)
        else:
            self.data = open_data(cfg.data.path, cfg.data.verify_checksums)
        if self._user_model is None and self.data.vocab_size > cfg.model.vocab_size:
            raise DataError(f"{self.data.source}: the tokenizer has {self.data.vocab_size} tokens but "
                            f"model.vocab_size={cfg.model.vocab_size}; set model.vocab_size to at least "
                            f"{self.data.vocab_size}")
        self.dataset = MixDataset(self.data, cfg.data.seq_len) if cfg.data.mix else \
            WindowDataset(self.data, cfg.data.seq_len)
        self.tokens_per_step = self.layout.global_batch * cfg.data.seq_len  # of the full batch
        self.batch_schedule = self.layout.batch_schedule(cfg.data.seq_len)  # train.batch_rampup, if any
        # the windows drawn from each source so far are logged (one sampler, on every rank alike)
        self.mix_sampler = self._sampler(0) if cfg.data.mix else None

    def _build_model(self, resume_from: Path | None) -> None:
        """Model: built on the meta device (no memory), then parallelized and materialized."""
        cfg = self.cfg
        torch.manual_seed(cfg.train.seed + self.rank)  # dropout differs per rank; weights do not
        try:
            self.pm = self._parallel_model(resume_from)
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
        self.pipeline = pipeline.build_schedule(
            self.pm.stages, self.layout.pp_schedule, self.layout.grad_accum,
            lambda logits, targets: self.loss_fn(logits, targets) * self._loss_factor()) if self.pm.stages else None
        self.tp = self.rt.layout.tp
        self.tied = self._tied_weight()

    def _tied_weight(self):
        """A tied embedding under pipelining: (the group of the first and the last stage, whether
        this rank's copy is the last stage's) or None. The two copies start equal (one name, one
        initial value), get the sum of both stages' gradients, and so stay equal."""
        if self.layout.pp == 1 or self._user_model is not None or not self.cfg.model.tie_embeddings:
            return None
        group = pipeline.tied_weight_group(self.rt.mesh)
        return None if group is None else (group, not self.pm.first)  # None: a middle stage

    def _parallel_model(self, resume_from: Path | None):
        cfg = self.cfg
        if self._user_model is not None:
            from scaletrain.parallel.parallelize import parallelize_module

            return parallelize_module(self._user_model, cfg, self.rt, self.precision)
        with torch.device("meta"):
            model = Transformer(cfg.model)
        weights = None  # a new run from existing weights (a resumed one takes the checkpoint's)
        if cfg.model.init_from and resume_from is None:
            from scaletrain.data.tokenizer import check_same_tokenizer
            from scaletrain.model.hf import load_hf_weights

            check_same_tokenizer(cfg.model.init_from, cfg.data.path)  # the ids must mean the same text
            weights = load_hf_weights(cfg.model.init_from, cfg.model)  # names, shapes checked; read on use
        if cfg.train.qat != "none":  # the layer rule, said once (quant/layers.py)
            self.folder.notes.extend(describe(layer_plan(model, cfg.train.qat), f"train.qat={cfg.train.qat}"))
        pm = parallelize(model, cfg, self.rt, self.precision, weights=weights)
        if pm.fp8_plan:  # the same rule, said once (quant/layers.py)
            pc = cfg.precision
            self.folder.notes.extend(describe(pm.fp8_plan, f"precision.mode=fp8 ({pc.fp8_recipe} scales"
                                              f"{', emulated' if pc.fp8_emulate else ''}"
                                              f"{', fp8 all-gather' if pm.fp8_scales else ''})"))
        if weights is not None:
            self.folder.notes.append(f"weights from {cfg.model.init_from}: rank {self.rank} read "
                                     f"{weights.bytes_read / 2**20:.2f} MiB of {weights.total_bytes / 2**20:.2f} MiB "
                                     "(its own shards of its own stages' tensors)")
        return pm

    def _build_optimizer(self) -> None:
        """Optimizer: over what holds the fp32 truth: the parameters, their ZeRO shards, or
        (bf16-true without a sharding engine) fp32 master copies."""
        cfg = self.cfg
        use_master = self.precision.master_weights and not self.pm.keeps_fp32_weights
        self.master = MasterWeights(self.named_params) if use_master else None
        self.optim_params = self.master.named_master if self.master else self.dp.named_optim_params
        self.param_names = {id(p): n for n, p in self.optim_params}
        self.lr = peak_lr(cfg.optim, self.layout.global_batch)
        self.optimizer = build_optimizer(cfg.optim, self.optim_params, self.lr, self.device)
        # the schedule runs over full-batch steps: a batch-size warm-up moves it by the tokens seen
        self.schedule = LRSchedule(cfg.optim, self.batch_schedule.equivalent_steps(cfg.train.steps))
        self.scaler = self.precision.scaler
        self.state_bytes: dict[str, int] | None = None  # measured during the first step
        self.outer = self._outer_sync()

    def _outer_sync(self):
        """parallel.dp_sync = local_sgd or diloco: the workers' periodic sync (parallel/local_sgd.py)."""
        lay, par = self.layout, self.cfg.parallel
        if not lay.local_sync:
            return None
        from scaletrain.parallel.local_sgd import OuterSync, ReplicaAverage
        from scaletrain.parallel.parallelize import find_blocks

        if self._user_model is None:
            n_blocks = self.cfg.model.n_layers
        else:
            blocks = find_blocks(self._user_model)
            n_blocks = len(blocks) if blocks is not None else 1
        if lay.sync_fragments > n_blocks:
            raise ConfigError(f"parallel.sync_fragments={lay.sync_fragments} splits the model's blocks into "
                              f"fragments, but it has {n_blocks}; use at most {n_blocks} fragments")
        comm = ReplicaAverage.for_mesh(self.rt.mesh, lay.sync_dtype, background=lay.sync_delay > 0,
                                       timeout=timedelta(seconds=par.timeout_s))
        return OuterSync(self.optim_params, mode=lay.dp_sync, sync_every=lay.sync_every,
                         fragments=lay.sync_fragments, delay=lay.sync_delay, outer_optimizer=par.outer_optimizer,
                         outer_lr=par.outer_lr, outer_momentum=par.outer_momentum, on_cpu=par.outer_on_cpu,
                         n_blocks=n_blocks, comm=comm)

    @property
    def worker(self) -> int:
        """This rank's worker (its dp_replicate group) when the workers sync every few steps."""
        return self.rt.axis("dp_replicate").get_local_rank() if self.rt.distributed else 0

    def _shared(self, value):
        """Rank 0's value of something every rank must agree on (e.g. a time-stamped folder)."""
        if not self.rt.distributed:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    # ---------------------------------------------------------------------------------------
    # checkpoints

    def checkpoint_tensors(self) -> dict:
        # the weights the optimizer steps are the model's true state: fp32 masters in bf16-true,
        # the shards under ZeRO-1/2 (DCP writes each rank's shard and reshards on load)
        optim, _ = ckpt.optimizer_to_named(self.optimizer, self.param_names)
        if self.outer is None:
            return {"model": dict(self.optim_params), "optim": optim}
        # workers that sync every few steps: the model is the outer (synchronised) weights; each
        # worker's own weights and inner optimizer state are kept under its index
        shared, own = self.outer.tensors()
        return {"model": self.outer.outer_weights(), "outer": shared,
                "workers": {str(self.worker): {"model": dict(self.optim_params), "optim": optim, "outer": own}}}

    def _resume(self, path: Path) -> None:
        state = ckpt.resume_trainer(self, path)
        # the run goes on on a new branch of its lineage that starts at this checkpoint
        self.lineage = run_folder.continued_lineage(state.get("lineage"), self.lineage[-1][0], self.step)

    def _weights_from_state(self) -> None:
        """Refresh what the model computes with from what the optimizer steps."""
        if self.master:
            self.master.master_to_model()
        self.dp.after_optimizer_step()  # ZeRO-1/2: gather the updated shards into every replica

    def save(self) -> Path:
        return ckpt.save_trainer(self)

    def _sampler(self, start_step: int) -> StepSampler:
        b = self.layout
        if self.cfg.data.mix:
            return MixSampler(self.dataset, self.data.weights, b.global_batch, b.micro_batch, b.grad_accum,
                              dp_rank=self.dp_rank, dp_size=b.dp, seed=self.cfg.train.seed, start_step=start_step)
        return StepSampler(len(self.dataset), b.global_batch, b.micro_batch, b.grad_accum,
                           dp_rank=self.dp_rank, dp_size=b.dp, seed=self.cfg.train.seed, start_step=start_step,
                           schedule=self.batch_schedule)

    def _loader(self):
        sampler = self._sampler(self.step)
        return build_loader(self.dataset, sampler, num_workers=self.cfg.data.num_workers,
                            pin_memory=self.cfg.data.pin_memory and self.device.type == "cuda",
                            prefetch_factor=self.cfg.data.prefetch_factor)

    # ---------------------------------------------------------------------------------------
    # one optimizer step

    def train_step(self, batches) -> tuple[torch.Tensor, torch.Tensor, bool, float]:
        """One optimizer step. Returns (loss, grad_norm, skipped, seconds spent waiting for data)."""
        loss, wait = self.forward_backward(batches)
        grad_norm, skipped = self.update()
        if self.outer is not None:
            self.health.enter("the workers' sync (parallel.dp_sync)")
            if self.outer.after_step():
                self._weights_from_state()
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
            return self.scaler.scale / self.step_tokens()
        return self.layout.dp / self.step_tokens()

    def step_tokens(self, step: int | None = None) -> int:
        """Tokens of a step's global batch (this step's by default): fewer during a batch-size warm-up."""
        return self.batch_schedule.batch(self.step if step is None else step) * self.cfg.data.seq_len

    def lr_at(self, step: int) -> float:
        """The learning rate of step `step` (0-based): the schedule at the full-batch steps seen, the
        linear scaling rule (optim.scale_lr_with_batch) at the step's batch."""
        if not self.batch_schedule.ramps:
            return self.lr * self.schedule(step)
        peak = peak_lr(self.cfg.optim, self.batch_schedule.batch(step))
        return peak * self.schedule(self.batch_schedule.equivalent_steps(step))

    def forward_backward(self, batches) -> tuple[torch.Tensor, float]:
        """Accumulate this step's gradients over its micro-batches; returns (loss, data wait).
        Under pipelining all of them go through the schedule at once; the last stage computes
        the losses, the others report zero (the metrics sum over stages)."""
        self.health.enter("forward/backward")
        if self.layout.cp > 1:
            batches = map(self.cp_shard, batches)
        if self.pipeline is not None:
            loss_sum, wait = pipeline.forward_backward(
                self.pm, self.pipeline, batches, self.layout.grad_accum, device=self.device,
                autocast=self.precision.autocast, loss_context=self._loss_context)
            return loss_sum / self._loss_factor() / self.step_tokens(), wait
        wait = 0.0
        loss_sum = torch.zeros((), device=self.device)
        accum = self.batch_schedule.accum(self.step)  # grad_accum, or fewer during a batch-size warm-up
        last = accum - 1
        for k in range(accum):
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
        return loss_sum / self._loss_factor() / self.step_tokens(), wait

    def cp_shard(self, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """This context-parallel rank's tokens of a batch's (inputs, targets)."""
        if self.layout.cp == 1:
            return batch
        return tuple(shard_sequence(t, self.layout.cp, self.cp_rank) for t in batch)

    def evaluate(self) -> dict[str, float]:
        """The mean token loss over the run's fixed validation windows (see train.evaluate):
        {"val_loss": ...}, and "val_loss/NAME" for each source of a data.mix."""
        return validation_loss(self)

    def update(self) -> tuple[torch.Tensor, bool]:
        """Unscale, clip, step, zero: returns (gradient norm before clipping, skipped).

        A step whose gradients are not finite anywhere (an fp16 overflow, or inf/NaN in any
        mode) is skipped without touching the weights or the optimizer state."""
        self.health.enter("the gradient-norm all-reduce (and fp16 overflow check)")
        if self.master:
            self.master.grads_to_master()
        params = [p for _, p in self.optim_params]
        if self.layout.cp > 1:  # the cp ranks' shares of the same batch: summed (the loss is over all tokens)
            self.health.enter("the context-parallel gradient all-reduce")
            reduce_gradients(params, self.rt.group("cp"))
        if kv := replicated_kv_names(self.cfg.model, self.tp) if self._user_model is None else ():
            self.health.enter("the replicated K/V projections' gradient all-reduce (tp)")
            reduce_gradients([p for n, p in self.optim_params if n.endswith(kv)], self.rt.group("tp"))
        copies = ()
        if self.tied is not None:  # the embedding's and the head's gradients, summed on both stages
            self.health.enter("the tied embedding's gradient all-reduce (first and last pipeline stage)")
            # (its shards under ZeRO-1/2, its fp32 master under bf16-true: the same on both stages)
            tied = [p for n, p in self.optim_params if canonical_name(n) == "tok_emb.weight"]
            reduce_gradients(tied, self.tied[0])
            copies = tuple(tied) if self.tied[1] else ()
        overflow = self.scaler.unscale_(params, times=self.layout.dp) if self.scaler else False
        grad_norm = clip_gradients(params, self.cfg.train.grad_clip,
                                   self.rt.group("pp") if self.layout.pp > 1 else None, copies=copies)
        # the norm is global (reduced over every shard and stage): every rank decides alike
        skip = overflow or not math.isfinite(float(grad_norm))
        if self.outer is not None and self.rt.distributed:  # each worker has its own norm: skip together
            flag = torch.tensor(float(skip), device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            skip = bool(flag > 0)
        measure = self.state_bytes is None
        if measure:
            self.state_bytes = model_state_bytes(self.dp, params, None)
        self.health.enter("the optimizer step (with the ZeRO parameter all-gather)")
        if not skip:
            self.optimizer.step()
            if self.pm.fp8_scales:  # the fp8 weights' scales, for the next step's all-gathers
                precompute_fp8_scales(self.dp.models)
        if measure:
            self.state_bytes["optimizer"] = model_state_bytes(self.dp, [], self.optimizer)["optimizer"]
            report_state_bytes(self.metrics.info, self.rank, self.state_bytes, self.num_params)
        at_minimum = self.scaler is not None and self.scaler.scale <= self.scaler.min_scale
        if self.scaler:
            self.scaler.update(overflow)
        if skip:
            self.health.step_skipped(self.step + 1, params, overflow, at_minimum)
        else:
            self.health.step_applied()
        self.dp.zero_grad(self.optimizer)
        if not skip:
            self._weights_from_state()
        return grad_norm, skip

    # ---------------------------------------------------------------------------------------
    # the loop

    def fit(self) -> dict:
        """Train from where the run stands to train.steps, or until a signal, a full disk or a
        diverged loss stops it; checkpoint, sample, and return the run's summary."""
        self.signals.install()  # from here on a signal stops the run at a step's end, saved
        try:
            self.folder.take_ownership(self.run_id, self.lineage, self.step, self.resumed_from, self.metrics.info)
            announce(self)
            self.metrics.start_trackers(self.cfg, self.run_id)
            result = self._loop()
            if result["stopped_by"] is None and self.cfg.train.sample_tokens:  # a signal now cuts the sample short
                self._print_sample()
        except BaseException:
            self.metrics.close()  # no file left open (a disk that cannot be unmounted, a torn row)
            raise
        finally:
            self.signals.restore()
            self.folder.release()
        self.metrics.close()
        return result

    def _loop(self) -> dict:
        cfg, guarded = self.cfg, self.health.guarded
        losses: list[float] = []
        batches = iter(self._loader())
        self.meter.new_window()
        last_saved = self.resumed_from if self.resumed_from is not None and self.step >= cfg.train.steps else None
        first_step = self.step
        while self.step < cfg.train.steps:
            self.health.begin_step(self.step + 1)
            set_lr(self.optimizer, self.lr_at(self.step))
            local_loss, grad_norm, skipped, wait = guarded(self.train_step, batches)
            self.step += 1
            loss, grad_norm, stop = guarded(self._end_of_step, local_loss, grad_norm)
            self.health.watch_loss(self.step, loss, skipped)
            self.meter.stepped(wait, self.step_tokens(self.step - 1))
            val_loss = None
            if self.val_sets and not stop and \
                    (self.step % cfg.train.eval_every == 0 or self.step == cfg.train.steps):
                with self.meter.paused():  # evaluating is not training: tokens/s leaves it out
                    val_loss = guarded(self.evaluate)
            # a stop (a signal, a fault) logs the step it stopped at: the summary reports that step
            if self.step % cfg.log.every == 0 or self.step in (1, cfg.train.steps) or val_loss is not None or stop:
                losses.append(self._log(loss, grad_norm, val_loss))
            if cfg.checkpoint.every and self.step % cfg.checkpoint.every == 0:
                self.health.enter("checkpoint save")
                last_saved = guarded(self.save)
            if stop:
                break
        self.health.check_weights_changed(self.step - first_step)
        return self._finish(losses, last_saved)

    def _log(self, loss: float, grad_norm, val_loss: dict[str, float] | None) -> float:
        """Log the metrics of the steps since the last row, and start the next; returns the row's loss."""
        row = self.health.guarded(self.meter.row, self.step, loss, grad_norm, get_lr(self.optimizer),
                                  self.skipped_steps, self.scaler.scale if self.scaler else None)
        row["global_batch"] = self.batch_schedule.batch(self.step - 1)  # of the logged step
        if self.mix_sampler is not None:  # the share of the windows so far drawn from each source
            drawn = self.mix_sampler.drawn(self.step)
            row.update({f"mix/{name}": n / sum(drawn) for name, n in zip(self.data.names, drawn)})
        if val_loss is not None:
            row.update(val_loss=val_loss["val_loss"], val_ppl=perplexity(val_loss["val_loss"]))
            row.update(val_loss)
        self.health.log_row(row, self.step, self.run_dir / "metrics.jsonl")
        self.meter.new_window()
        return row["loss"]

    def _finish(self, losses: list[float], last_saved: Path | None) -> dict:
        """The end of the loop: the final (or emergency) checkpoint, the summary, the result."""
        stopped = self._stop_signal
        due = (self._fault or stopped is not None or self.cfg.checkpoint.save_final) and \
            (last_saved is None or last_saved.name != f"step_{self.step:08d}")
        last_saved = self.health.final_checkpoint(self.save if due else None, last_saved)
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

    def _end_of_step(self, local_loss: torch.Tensor, grad_norm) -> tuple[float, object, bool]:
        """The global batch's loss, the gradient norm, and whether a signal reached any rank (then
        every rank stops after this same step): one small all-reduce for all. When the workers
        sync every few steps, each has its own gradient norm: the one reported is their root mean
        square."""
        flag = float(self._stop_signal or (1 if self._fault else 0))
        if not self.rt.distributed:
            return float(local_loss), grad_norm, bool(flag)
        self.health.enter("the end-of-step all-reduce of loss and stop flag")
        parts = [torch.tensor(flag, device=self.device), local_loss.float().reshape(())]
        if self.outer is not None:  # every rank of a worker holds its norm: each adds its share
            ranks_per_worker = self.world_size // self.layout.dp_replicate
            parts.append(torch.as_tensor(grad_norm, device=self.device).float().reshape(()) ** 2 / ranks_per_worker)
        t = torch.stack(parts)
        dist.all_reduce(t)  # every rank's share of the loss; tensor-parallel ranks hold copies
        if t[0] > 0 and not self._fault:
            self._stop_signal = self._stop_signal or signal.SIGTERM
        if self.outer is not None:
            grad_norm = (t[2] / self.layout.dp_replicate).sqrt()
        return float(t[1]) / self.layout.tp, grad_norm, bool(t[0] > 0)

    # ---------------------------------------------------------------------------------------
    # the sample printed after training

    def _print_sample(self) -> None:
        if self.pipeline is not None:
            self.metrics.info("sample: skipped, the model is split into pipeline stages "
                              "(export the checkpoint and sample it whole)")
        elif self.layout.cp > 1:
            self.metrics.info("sample: skipped, the model's attention is split over the context-parallel ranks "
                              "(export the checkpoint and sample it whole)")
        elif self._user_model is not None:
            self.metrics.info("sample: skipped, the model is a custom module (its outputs need not be logits)")
        elif self.rank == 0 or self._sample_on_all_ranks():
            try:
                self.metrics.result("sample: " + self.sample(self.cfg.train.sample_prompt,
                                                             self.cfg.train.sample_tokens))
            except Interrupted:
                self.metrics.info("sample: interrupted by a signal (training finished and was saved)")

    def sample(self, prompt: str, new_tokens: int) -> str:
        """Generate from the trained model. Every rank of a sharded model (FSDP, tensor parallel)
        takes part in each forward; all draw the same tokens from the same generator."""
        return sample_text(self.dp.module, self.data.tokenizer, prompt, new_tokens,
                           window=min(self.cfg.data.seq_len, self.cfg.model.max_seq_len), seed=self.cfg.train.seed,
                           device=self.device, autocast=self.precision.autocast,
                           all_ranks=self.rt.distributed and self._sample_on_all_ranks(),
                           # a compiled block would recompile for every new length: no cache then
                           use_cache=not self.cfg.train.compile and self._user_model is None,
                           # sharded ranks must all go on
                           interrupted=lambda: self._stop_signal is not None and not self.rt.distributed)

    def _sample_on_all_ranks(self) -> bool:
        return self.dp.zero == 3 or self.tp > 1
