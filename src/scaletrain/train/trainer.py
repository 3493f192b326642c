"""The training loop: one explicit function per phase, no callbacks.

    setup:  data -> model (meta) -> parallelize -> materialize -> optimizer -> step hooks -> resume
    step:   lr -> micro-batches (accumulated, or through the pipeline schedule): forward, loss / tokens of the
            global batch, backward -> hooks' gradient reductions -> unscale (fp16) -> clip by global norm
            -> optimizer step (unless skipped) -> hooks' after-step work
    around: validation every train.eval_every steps, metrics every log.every, checkpoints every
            checkpoint.every, at the end, and before stopping on SIGINT/SIGTERM.

The step never names a technique: what one does every step reaches it as a hook (scaletrain/hooks.py) from
parallelize() or built from the run. Each concern around the loop has its module: train.state, train.run_folder,
train.health (what stops a run, and why, in one line), train.metrics, train.evaluate, scaletrain.schedule.
"""

from __future__ import annotations

import dataclasses
import math
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist

from scaletrain.config import JobConfig, parse_mix
from scaletrain.data.loader import StepSampler, build_loader
from scaletrain.data.mix import open_training_data, step_sampler
from scaletrain.errors import ConfigError
from scaletrain.interrupt import StopWaiting, stop_exception
from scaletrain.legality import check_config, check_data
from scaletrain.model.flops import flops_per_token
from scaletrain.model.generate import sample_text
from scaletrain.model.transformer import Transformer
from scaletrain.objectives.preference import (
    PreferenceObjective,
    open_preference_data,
    reference_mode,
    reference_weights,
)
from scaletrain.objectives.rl import RLObjective
from scaletrain.objectives.rl_data import open_prompts
from scaletrain.optim import build_optimizer, get_lr, init_optimizer_state, set_lr
from scaletrain.parallel.parallelize import initial_weights, parallelize, parallelize_module, step_hooks
from scaletrain.precision import Precision
from scaletrain.runtime import Runtime, single_process
from scaletrain.schedule import TrainSchedule
from scaletrain.train import checkpoint as ckpt
from scaletrain.train import run_folder
from scaletrain.train.async_save import writer_for
from scaletrain.train.downstream import TaskEvaluation
from scaletrain.train.evaluate import validation_loss, validation_sets
from scaletrain.train.health import Health
from scaletrain.train.metrics import MetricsLogger, StepMeter, announce, perplexity, print_sample, report_state_bytes
from scaletrain.train.run_folder import default_run_dir
from scaletrain.train.state import TrainState


@dataclasses.dataclass
class RunData:
    """What a run reads: the training text (`corpus`: its source, tokenizer, sources' names), its
    windows (`dataset`), this rank's place in each step's batch (`dp_rank`), the batch per step
    (`batch_schedule`: train.batch_rampup), the validation sets and data.mix's draw counter."""

    corpus: object
    dataset: object
    dp_rank: int
    batch_schedule: object
    val_sets: list = dataclasses.field(default_factory=list)
    mix_sampler: StepSampler | None = None


class Trainer:
    """One run: `fit()` trains it; `train_step`, `evaluate`, `save` and `sample` are its parts."""

    def __init__(self, cfg: JobConfig, runtime: Runtime | None = None, *, stream=None, restart: bool = False,
                 model: torch.nn.Module | None = None, loss_fn=None, schedule: TrainSchedule | None = None):
        """`restart`: the launcher restarted this process after a failure of the group (it goes on from
        the newest checkpoint). `schedule`: each step's learning rate (default: cfg's over train.steps;
        verify passes the whole run's). `model`: train this nn.Module (with its own weights), whose
        outputs `loss_fn` turns into the sum of the token losses (default: cross-entropy of logits);
        the protocol: parallel.parallelize.parallelize_module."""
        self.cfg = cfg
        # custom_model: the user's nn.Module, or None for scaletrain's transformer
        self._custom_model, self._loss_fn, self._schedule = model, loss_fn, schedule  # (None: the model's, pm.loss_fn)
        # the runtime's layout is cfg's (derived once, where the job began); a config that asks for
        # another stage or batch on the same group of ranks gets its own layout on the same mesh
        self.rt = rt = (runtime or single_process(cfg)).for_config(cfg)
        # the one legality check, as settle asks it (a Trainer may be built without a job)
        check_config(cfg, rt.layout, custom_module=model is not None, device_type=rt.device.type)
        run_dir = Path(cfg.log.run_dir or rt.shared(default_run_dir()))
        if not cfg.log.run_dir:  # the folder it writes, in the config it saves (resuming reads it there)
            self.cfg = cfg = dataclasses.replace(cfg, log=dataclasses.replace(cfg.log, run_dir=str(run_dir)))
        ckpt_dir = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else run_dir / "checkpoints"
        self.folder = run_folder.RunFolder(run_dir, ckpt_dir, cfg, rt.rank, shared=rt.shared, restart=restart)
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

        if missing := self.rt.shared(missing_packages(cfg.log) if self.rt.rank == 0 else None):
            raise ConfigError(*missing)  # only rank 0 logs: its packages are the ones that matter
        self.precision = Precision(cfg.precision, self.rt.device)
        self.precision.configure_backends()
        resume_from = self.folder.find_resume()  # reads only: nothing is written before fit()
        self.layout = rt.layout  # ranks, batch triad (global = micro × accum × dp), engines
        # train.objective=preference's or rl's loss, data and metrics (lm: None)
        self.objective: PreferenceObjective | RLObjective | None = None
        self._build_data()
        self._build_model(resume_from)
        # the validation windows (train.eval_every), once the model is known to fit
        self.data.val_sets = validation_sets(cfg, self.layout.global_batch) if self.objective is None else []
        self._tasks = TaskEvaluation.for_run(cfg)  # eval.tasks: lm-eval's tasks every eval.every steps, or None
        self.state = TrainState()  # before the hooks: fault tolerance heals it from a peer
        self._build_optimizer()
        # the windows drawn from each source so far are logged (one sampler, on every rank alike; after the hooks)
        self.data.mix_sampler = self.sampler(0) if cfg.data.mix else None
        self.state.run_id, self.state.lineage = self.rt.shared(self.folder.identity())
        self.metrics = MetricsLogger(self.folder.run_dir if rt.rank == 0 else None, cfg.train.steps,
                                     enabled=rt.rank == 0, tensorboard=cfg.log.tensorboard, summary=cfg.log.summary,
                                     progress=cfg.log.progress, stream=stream, device_type=rt.device.type)
        self.health = Health(cfg, self.layout, rt, self.metrics, self.state, precision=self.precision,
                             param_names=self._param_names,
                             custom_loss=self._custom_model is not None or self.objective is not None,
                             loss_scale_free=cfg.train.objective == "rl")  # a policy loss: no yardstick
        self.hooks.enter, self.health.skip_reason = self.health.enter, self.hooks.skip_reason
        self.hooks.say_to(self.metrics.info)  # what a technique sees go wrong (a collapsed router), when it does
        self.hooks.interrupt_waits_with(self.health.signals.interruptible)  # a stop cuts a wait before a step
        if resume_from is not None:
            self._resume(resume_from)
        self._writer = writer_for(cfg, rt.device)  # checkpoints: at once, or in the background (async_save)
        # a custom module's FLOPs are not known in detail: 6 per parameter per token (matmuls, no attention)
        self.meter = StepMeter(rt, tokens_per_step=self.step_tokens(0),
                               compute_dtype=self.precision.compute_dtype,
                               flops_per_token=flops_per_token(cfg.model, cfg.data.seq_len)
                               if self._custom_model is None else 6 * self.pm.num_params,
                               tf32=cfg.precision.mode == "tf32", enter=self.health.enter, say=self.metrics.info)

    def _build_data(self) -> None:
        """Data: order from (seed, step) alone; each data-parallel rank reads its slice."""
        cfg = self.cfg
        if cfg.train.objective != "lm" and self._custom_model is not None:
            raise ConfigError(f"train.objective={cfg.train.objective} trains scaletrain's transformer (its loss reads "
                              "the logits of each completion); a custom module trains with train.objective=lm")
        if cfg.train.objective == "preference":
            dataset = open_preference_data(cfg.data, cfg.model.vocab_size, loss=cfg.preference.loss)
            corpus = dataset.data.tokens  # its source, tokenizer and fingerprint
        elif cfg.train.objective == "rl":  # the prompts, tokenized with data.path's tokenizer
            corpus = dataset = open_prompts(cfg)
        else:
            corpus, dataset = open_training_data(cfg.data, parse_mix(cfg.data.mix) if cfg.data.mix else None,
                                                 cfg.model.vocab_size if self._custom_model is None else None)
        check_data(self.layout, source=corpus.source, loss_mask=getattr(dataset, "mask", None) is not None)
        self.data = RunData(corpus, dataset, dp_rank=self.rt.axis("dp").get_local_rank() if self.rt.distributed else 0,
                            batch_schedule=self.layout.batch_schedule(cfg.data.seq_len))  # train.batch_rampup's
        self.schedule = self._schedule or TrainSchedule.for_job(cfg, self.data.batch_schedule, cfg.train.steps)
        if self._schedule is None and (note := self.schedule.warmup_note(cfg.train.steps)):
            self.folder.notes.append(note)  # (verify's shorter checks run part of a longer schedule)

    def _build_model(self, resume_from: Path | None) -> None:
        """Model: built on the meta device (no memory), then parallelized and materialized."""
        torch.manual_seed(self.cfg.train.seed + self.rt.rank)  # dropout differs per rank; weights do not
        self.pm = self._parallel_model(resume_from)  # weights that do not fit: one line (parallelize)
        self.model = self.pm.dp.model  # forward goes through the data-parallel wrapper
        self._loss_fn = self._loss_fn or self.pm.loss_fn  # cross-entropy (with multi-token prediction: model/mtp.py)
        if self.cfg.train.objective != "lm":  # its loss, and the reference model it may need
            kind = PreferenceObjective if self.cfg.train.objective == "preference" else RLObjective
            self.objective = kind(self, self._reference_model())
            self._loss_fn = self.objective.micro_loss
        self.pm.schedule(self.layout.pp_schedule, self.layout.grad_accum,  # pipeline parallel: pm.micro_schedule
                         lambda logits, targets: self._loss_fn(logits, targets) * self.loss_factor())
        # a step's micro-batches: through the pipeline schedule at once, or accumulated one by one
        self._micro_batches = self._through_schedule if self.pm.micro_schedule is not None else self._accumulate

    def _reference_model(self):
        """preference.reference=model (rl.reference=model): a frozen copy of the starting weights (seed's, or
        model.init_from's), parallelized exactly like the policy; its forward needs no gradients, nor an optimizer."""
        if reference_mode(self.cfg) != "model":
            return None
        with torch.device("meta"):
            model = Transformer(self.cfg.model)
        pm = parallelize(model, self.cfg, self.rt, self.precision, weights=reference_weights(self.cfg))
        for module in pm.dp.modules:
            module.requires_grad_(False)
        return pm

    def _parallel_model(self, resume_from: Path | None):
        cfg = self.cfg
        if self._custom_model is not None:
            return parallelize_module(self._custom_model, cfg, self.rt, self.precision)
        with torch.device("meta"):
            model = Transformer(cfg.model, separator=self.data.dataset.separator)  # data.document_mask's, or None
        weights = initial_weights(cfg, resuming=resume_from is not None)  # model.init_from, read on use
        pm = parallelize(model, cfg, self.rt, self.precision, weights=weights)
        self.folder.notes.extend(pm.notes)  # what the quantization layer rule converted (qat, fp8)
        if weights is not None:
            self.folder.notes.append(weights.describe(cfg.model.init_from, self.rt.rank))
        return pm

    def _build_optimizer(self) -> None:
        """Optimizer over what holds the fp32 truth: parameters, ZeRO shards or (bf16-true, unsharded) fp32 masters."""
        cfg = self.cfg
        self._param_names = {id(p): n for n, p in self.pm.optim_params}
        self.optimizer = build_optimizer(cfg.optim, self.pm.optim_params, self.schedule.peak, self.rt.device)
        if note := getattr(self.optimizer, "note", None):  # which parameters which optimizer steps (muon)
            self.folder.notes.append(note)
        # the techniques' per-step work, in the order the composition gives (parallel.parallelize.step_hooks)
        self.hooks = step_hooks(self.pm, cfg, self.rt, optimizer=self.optimizer, state=self.state,
                                refresh=self.refresh_weights, precision=self.precision)

    @property
    def step(self) -> int:  # optimizer steps done (the run's TrainState holds it)
        return self.state.step

    # ---------------------------------------------------------------------------------------
    # checkpoints

    def checkpoint_tensors(self) -> dict:
        """What DCP saves and loads: the weights the optimizer steps (fp32 masters in bf16-true, the shards under
        ZeRO-1/2: DCP writes each rank's shard and reshards on load), the optimizer state, the step hooks' state."""
        optim, _ = ckpt.optimizer_to_named(self.optimizer, self._param_names)
        return self.hooks.checkpoint_tensors({"model": dict(self.pm.optim_params), "optim": optim})

    def save(self, background: bool = False) -> Path:
        """A checkpoint: tensors and what resuming needs to go on bitwise (step, data, loss scale, lineage, hooks).
        `background` (the loop's periodic saves), with checkpoint.async_save: returns once the state is copied to
        CPU memory, while a thread writes it; the next save and the run's end wait for it."""
        _, skeleton = ckpt.optimizer_to_named(self.optimizer, self._param_names)
        cfg = self.cfg
        state = {**self.state.state_dict(), "world_size": self.rt.world_size, "config": cfg.to_dict(),
                 "schedule": {"kind": cfg.optim.schedule, "step": self.step, "peak_lr": self.schedule.peak},
                 "data": {"step": self.step, "seed": cfg.train.seed, "global_batch": self.layout.global_batch,
                          "seq_len": cfg.data.seq_len, "source": self.data.corpus.source,
                          "fingerprint": getattr(self.data.corpus, "fingerprint", None)},
                 "optimizer": skeleton, **self.hooks.state_dict()}
        return self._writer.save(self.folder.ckpt_dir, self.step, self.checkpoint_tensors(), state,
                                 keep=cfg.checkpoint.keep, wait=not background)

    def _resume(self, path: Path) -> None:
        """Continue from checkpoint `path`, once checked against this model, data, batch and layout."""
        state = ckpt.read_trainer_state(path)
        self.health.resuming(int(state["step"]))  # what a peer that waits for this rank is told
        self.folder.check_resumable(path, state, global_batch=self.layout.global_batch, data=self.data.corpus,
                                    peak_lr=self.schedule.peak)
        ckpt.check_sync(path, state, self.layout)
        self.hooks.prepare_load(state)
        init_optimizer_state(self.optimizer)
        # resume=auto verified the files while choosing this checkpoint; a given path is verified here
        ckpt.load_tensors(path, self.checkpoint_tensors(), verify=self.cfg.checkpoint.resume != "auto")
        ckpt.restore_optimizer_extras(self.optimizer, self._param_names, state["optimizer"])
        self.refresh_weights()
        self.hooks.load_state_dict(state)
        branch = self.state.lineage[-1][0]
        self.state.load_state_dict(state, path)
        # the run goes on on a new branch of its lineage that starts at this checkpoint
        self.state.lineage = run_folder.continued_lineage(state.get("lineage"), branch, self.step)
        ckpt.load_rng(path, self.rt.rank, self.rt.world_size, state["world_size"])

    def refresh_weights(self) -> None:
        """Refresh what the model computes with from what the optimizer steps."""
        self.hooks.refresh_weights()  # bf16-true: the fp32 masters rounded into the model
        self.pm.dp.after_optimizer_step()  # ZeRO-1/2: gather the updated shards into every replica

    def sampler(self, start_step: int) -> StepSampler:
        """Which windows this rank reads at each step from `start_step` on (the data-parallel cut)."""
        return step_sampler(self.data.dataset, self.layout, dp_rank=self.data.dp_rank, seed=self.cfg.train.seed,
                            start_step=start_step, schedule=self.data.batch_schedule, outer=self.hooks.data_outer)

    def batches(self):
        """This rank's micro-batches (inputs, targets) from this step on: its share of the windows and tokens."""
        # an objective's: a preference run's examples (their reference log-probs go to the loss), or the rollouts
        # of an RL run (sampled from the policy every rl.updates steps)
        return self._loader() if self.objective is None else self.objective.batches(self._loader)

    def _loader(self):
        return iter(build_loader(self.data.dataset, self.sampler(self.step), share=self.pm.batch_share,
                                 num_workers=self.cfg.data.num_workers,
                                 pin_memory=self.cfg.data.pin_memory and self.rt.device.type == "cuda",
                                 prefetch_factor=self.cfg.data.prefetch_factor))

    # ---------------------------------------------------------------------------------------
    # one optimizer step

    def train_step(self, batches) -> tuple[torch.Tensor, torch.Tensor, bool, float]:
        """One optimizer step. Returns (loss, grad_norm, skipped, seconds spent waiting for data)."""
        self.hooks.begin_step(self.loss_factor() if self.objective is None else  # a loss added inside the model
                              self.loss_factor() / self.step_tokens())  # (a mixture's): a mean over the tokens
        loss, wait = self.forward_backward(batches)
        grad_norm, skipped = self.update()
        return loss, grad_norm, skipped, wait

    def token_loss(self, logits, targets) -> torch.Tensor:
        """The sum of the token losses of `logits` against `targets`: cross-entropy, or a custom module's loss_fn."""
        return self._loss_fn(logits, targets)

    def loss_factor(self) -> float:
        # by the counted tokens of the whole global batch (every rank counts them alike from the data): gradients
        # add up over micro-batches and ranks to the mean token loss's; the dp reductions average over ranks, hence
        # the factor dp. Under fp16 unscaling applies dp: backward sees the scale times each token's share.
        scale = self.precision.loss_scale()
        return (self.layout.dp if scale is None else scale) / self.loss_divisor()

    def loss_divisor(self) -> int:
        """What the step's summed losses are divided by: its counted tokens; 1 for a preference run, whose
        loss divides itself (by the step's pairs; ORPO's NLL by its tokens)."""
        return self.counted_tokens() if self.objective is None else 1

    def counted_tokens(self, step: int | None = None) -> int:
        """Targets counted in a step's global batch: all its tokens, or those its loss mask marks (from the data)."""
        step = self.step if step is None else step
        return self.data.dataset.counted_in_step(step, self.sampler) or self.step_tokens(step)

    def step_tokens(self, step: int | None = None) -> int:
        """Tokens of a step's global batch (this step's by default): fewer during a batch-size warm-up."""
        rows = 1 if self.objective is None else self.data.dataset.rows_per_example  # a pair: two sequences
        return self.data.batch_schedule.batch(self.step if step is None else step) * self.cfg.data.seq_len * rows

    def forward_backward(self, batches) -> tuple[torch.Tensor, float]:
        """This step's gradients over its micro-batches; returns (mean token loss, data wait)."""
        self.health.enter("forward/backward")
        loss_sum, wait = self._micro_batches(batches)
        if self.objective is not None:  # its reference passes ran as the step's micro-batches were drawn
            wait = max(0.0, wait - self.objective.take_ref_seconds())
        return loss_sum / self.loss_factor() / self.loss_divisor(), wait

    def _through_schedule(self, batches) -> tuple[torch.Tensor, float]:
        """All micro-batches through the schedule at once; the last stage's losses (the others: 0)."""
        return self.pm.through_schedule(self.pm.micro_schedule, batches, self.layout.grad_accum, device=self.rt.device,
                                        autocast=self.precision.autocast, loss_context=self.pm.loss_context)

    def _accumulate(self, batches) -> tuple[torch.Tensor, float]:
        """Gradients accumulated micro-batch by micro-batch, synced on the last."""
        wait = 0.0
        loss_sum = torch.zeros((), device=self.rt.device)
        accum = self.data.batch_schedule.accum(self.step)  # grad_accum, or fewer during a batch-size warm-up
        last = accum - 1
        for k in range(accum):
            t0 = time.perf_counter()
            inputs, targets = next(batches)
            wait += time.perf_counter() - t0
            inputs, targets = (x.to(self.rt.device, non_blocking=True) for x in (inputs, targets))
            with self.pm.dp.micro_step(last=k == last), self.pm.loss_context():  # sync gradients on the last
                with self.precision.autocast():
                    logits = self.model(inputs)  # (B, T, vocab)
                loss = self._loss_fn(logits, targets) * self.loss_factor()
                loss.backward()
            loss_sum += self.pm.whole(loss.detach())
        self.pm.dp.finish_gradients()
        return loss_sum, wait

    def evaluate(self) -> dict[str, float]:
        """{"val_loss": ...} over the run's fixed validation windows, "val_loss/NAME" per data.mix source
        (a preference run: the held-out split's loss, rewards, margins and accuracy, val_*)."""
        return validation_loss(self) if self.objective is None else self.objective.evaluate()

    def _evaluates(self) -> bool:
        """Whether the run evaluates held-out data (train.eval_every)."""
        return bool(self.data.val_sets) if self.objective is None else self.objective.val is not None

    def update(self) -> tuple[torch.Tensor, bool]:
        """Reduce (and unscale), clip, step, zero: returns (gradient norm before clipping, skipped).

        A step whose gradients are not finite anywhere (an fp16 overflow, or inf/NaN in any
        mode) is skipped without touching the weights or the optimizer state."""
        named = self.pm.optim_params
        params = [p for _, p in named]
        self.hooks.reduce_gradients(named)
        self.health.enter("the gradient-norm all-reduce")
        grad_norm = self.pm.clip_gradients(params, self.cfg.train.grad_clip)
        # the norm is global (reduced over every shard and stage): every rank decides alike
        skip = self.hooks.agree_to_skip(not math.isfinite(float(grad_norm)))
        self.health.enter("the optimizer step (with the ZeRO parameter all-gather)")
        if not skip:
            self.optimizer.step()
        if self.meter.state_bytes is None:  # measured once, while gradients and optimizer state are live
            self.meter.state_bytes = self.pm.state_bytes(params, self.optimizer)
            report_state_bytes(self.metrics.info, self.rt.rank, self.meter.state_bytes, self.pm.num_params)
        self.health.step_done(self.step + 1, skip, params)
        self.pm.dp.zero_grad(self.optimizer)
        if self.hooks.after_optimizer_step(applied=not skip) or not skip:
            self.refresh_weights()
        return grad_norm, skip

    # ---------------------------------------------------------------------------------------
    # the loop

    def fit(self) -> dict:
        """Train from where the run stands to train.steps, or until a signal, a full disk or a
        diverged loss stops it; checkpoint, sample, and return the run's summary."""
        self.health.signals.install()  # from here on a signal stops the run at a step's end, saved
        try:
            # first a hook may take the run's state from a peer (a restarted replica group heals): the folder's
            # history is then kept up to the step it goes on from, not cut back to where this process began
            try:
                self.hooks.start()
            except StopWaiting:  # a stop before this process took a step: nothing of its own to save
                raise stop_exception(self.health.signals.received) from None
            st = self.state
            self.folder.take_ownership(st.run_id, st.lineage, st.step, st.resumed_from, self.metrics.info)
            announce(self)
            self.metrics.start_trackers(self.cfg, st.run_id, stopping=lambda: self.health.signals.received is not None)
            if self.objective is not None:  # e.g. preference.reference=precomputed's pass over the data
                self.health.enter("the objective's preparation (the reference log-probs' pass over the data)")
                self.objective.before_training(self.folder.run_dir)
            result = self._loop()
            if result["stopped_by"] is None and self.cfg.train.sample_tokens:  # a signal now cuts the sample short
                print_sample(self)
        except BaseException:
            self.metrics.close()  # no file left open (a disk that cannot be unmounted, a torn row)
            raise
        finally:
            self.health.signals.restore()
            self._writer.close()  # a checkpoint still being written completes before the folder is let go
            self.folder.release()
        self.metrics.close()
        return result

    def _loop(self) -> dict:
        cfg, guarded, losses = self.cfg, self.health.guarded, []
        batches = self.batches()
        self.meter.new_window()
        resumed = self.state.resumed_from
        last_saved = resumed if resumed is not None and self.step >= cfg.train.steps else None
        first_step = self.step
        while self.step < cfg.train.steps:
            self.health.begin_step(self.step + 1)
            set_lr(self.optimizer, self.schedule.lr(self.step))
            try:
                done = guarded(self.train_step, batches)
            except StopWaiting:  # a stop signal while the step waited to begin (a quorum): _finish saves the steps done
                break
            if done is None:
                break  # the data failed under the run (health.fault): _finish saves the steps done
            local_loss, grad_norm, skipped, wait = done
            self.state.step += 1
            loss, grad_norm, stop = guarded(self.end_of_step, local_loss, grad_norm)
            if self.data.dataset.counts_nothing(self.step - 1, self.sampler):
                loss = None  # no target counted: a step with nothing to learn has no loss (not a loss of 0)
            self.health.watch_loss(self.step, loss, skipped)
            self.meter.stepped(wait, self.step_tokens(self.step - 1), self.counted_tokens(self.step - 1))
            val_loss = None if stop else self._evaluations()
            # a stop (a signal, a fault) logs the step it stopped at: the summary reports that step
            if self.step % cfg.log.every == 0 or self.step in (1, cfg.train.steps) or val_loss is not None or stop:
                losses.append(self._log(loss, grad_norm, val_loss))
            if cfg.checkpoint.every and self.step % cfg.checkpoint.every == 0 and self.hooks.writes_checkpoint():
                self.health.enter("checkpoint save")
                last_saved = guarded(self.save, True)  # in the background, with checkpoint.async_save
            if stop:
                break
        self.health.check_weights_changed(self.step - first_step)
        return self._finish(losses, last_saved)

    def _evaluations(self) -> dict[str, float] | None:
        """What is due after this step: the validation loss (train.eval_every) and the task scores
        (eval.tasks, every eval.every steps), both at the last step; None when nothing is."""
        cfg, out = self.cfg, {}
        with self.meter.paused():  # evaluating is not training: tokens/s leaves it out
            if self._evaluates() and (self.step % cfg.train.eval_every == 0 or self.step == cfg.train.steps):
                out.update(self.health.guarded(self.evaluate) or {})
            if self._tasks is not None and self._tasks.due(self.step, cfg.train.steps):
                out.update(self.health.guarded(self._tasks.run, self) or {})
        return out or None

    def _log(self, loss: float, grad_norm, val_loss: dict[str, float] | None) -> float:
        """Log the metrics of the steps since the last row, and start the next; returns the row's loss."""
        row = self.health.guarded(self.meter.row, self.step, loss, grad_norm, get_lr(self.optimizer),
                                  self.state.skipped_steps, self.precision.loss_scale())
        row["global_batch"] = self.data.batch_schedule.batch(self.step - 1)  # of the logged step
        row.update(self.hooks.metrics())  # what the techniques measured in it (a mixture's balance)
        if self.objective is not None:  # the pairs' rewards, margins, accuracy and log-probs
            row.update(self.objective.metrics())
        if self.data.mix_sampler is not None:  # the share of the windows so far drawn from each source
            row.update(self.data.mix_sampler.shares(self.step, self.data.corpus.names))
        if val_loss is not None and "val_loss" in val_loss:
            row.update(val_loss=val_loss["val_loss"])
            if self.objective is None:
                row.update(val_ppl=perplexity(val_loss["val_loss"]))
        if val_loss is not None:  # and the task scores (eval.tasks), tasks/TASK/METRIC
            row.update(val_loss)
        self.health.log_row(row, self.step, self.folder.run_dir / "metrics.jsonl")
        self.meter.new_window()
        return row["loss"]

    def _finish(self, losses: list[float], last_saved: Path | None) -> dict:
        """The end of the loop: the final (or emergency) checkpoint, the summary, the result."""
        self._writer.wait()  # a checkpoint still being written in the background is complete first
        stopped = self.health.signals.received
        due = (self.health.fault or stopped is not None or self.cfg.checkpoint.save_final) and \
            (last_saved is None or last_saved.name != f"step_{self.step:08d}") and self.hooks.writes_checkpoint()
        last_saved = self.health.final_checkpoint(self.save if due else None, last_saved)
        if stopped is not None:
            self.metrics.info(f"stopped by {signal.Signals(stopped).name} after step {self.step}; "
                              f"checkpoint saved to {last_saved}")
        extra = {"loss spikes logged": self.health.spikes} if self.health.spikes else {}
        if self.objective is not None:  # the held-out accuracy, or reward
            extra.update(self.objective.summary())
        self.metrics.summary({"checkpoint": ckpt.saved_text(last_saved),
                              "steps skipped (non-finite gradients)": self.state.skipped_steps, **extra})
        return {"losses": losses, "history": self.metrics.history, "step": self.step,
                "stopped_by": stopped, "checkpoint": str(last_saved) if last_saved else None,
                "run_dir": str(self.folder.run_dir)}

    def end_of_step(self, local_loss: torch.Tensor, grad_norm) -> tuple[float, object, bool]:
        """The global batch's loss, the gradient norm the hooks report, and whether a signal
        reached any rank (then every rank stops after this same step): one small all-reduce."""
        signals, fault = self.health.signals, self.health.fault
        flag = float(signals.received or (1 if fault else 0))
        grad_norm = self.hooks.reported_norm(grad_norm)
        if not self.rt.distributed:
            return float(local_loss), grad_norm, bool(flag)
        self.health.enter("the end-of-step all-reduce of loss and stop flag")
        t = torch.stack([torch.tensor(flag, device=self.rt.device), local_loss.float().reshape(())])
        dist.all_reduce(t)  # every rank's share of the loss; some ranks hold copies of it
        if t[0] > 0 and not fault:
            signals.received = signals.received or signal.SIGTERM
        copies = self.layout.loss_copies if self.objective is None else self.objective.copies()
        return float(t[1]) / copies, grad_norm, bool(t[0] > 0)

    def sample(self, prompt: str, new_tokens: int) -> str:
        """Generate from the trained model. Every rank of a sharded model (FSDP, tensor parallel)
        takes part in each forward; all draw the same tokens from the same generator."""
        return sample_text(self.pm.dp.module, self.data.corpus.tokenizer, prompt, new_tokens,
                           window=min(self.cfg.data.seq_len, self.cfg.model.max_seq_len), seed=self.cfg.train.seed,
                           device=self.rt.device, autocast=self.precision.autocast,
                           all_ranks=self.rt.distributed and self.pm.sharded_forward,  # sharded: all go on
                           use_cache=not self.cfg.train.compile and self._custom_model is None,  # compiled: recompiles
                           interrupted=lambda: self.health.signals.received is not None and not self.rt.distributed,
                           length_multiple=self.pm.length_multiple)  # sequence parallelism: forwards padded to tp
