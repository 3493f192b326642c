"""The training loop: one explicit function per phase, no callbacks.

    setup:  data -> model (meta) -> parallelize -> materialize -> optimizer -> resume
    step:   for each micro-batch: forward, loss / tokens of the global batch, backward
            -> unscale (fp16) -> clip by global norm -> optimizer step (unless overflow) -> lr
    around: metrics every log.every steps, checkpoints every checkpoint.every steps and at the
            end, and a checkpoint before stopping on SIGINT/SIGTERM.
"""

from __future__ import annotations

import math
import signal
import time
from datetime import datetime
from pathlib import Path

import torch
import torch.nn.functional as F

from scaletrain.config import JobConfig, resolve_batch
from scaletrain.data.dataset import WindowDataset, open_data
from scaletrain.data.loader import StepSampler, build_loader
from scaletrain.errors import CheckpointError, ConfigError, DataError, LaunchError
from scaletrain.model.flops import flops_per_token
from scaletrain.model.transformer import Transformer
from scaletrain.optim import LRSchedule, build_optimizer, get_lr, peak_lr, set_lr
from scaletrain.parallel.init import canonical_name, init_weights
from scaletrain.parallel.parallelize import parallelize
from scaletrain.plan.hardware import device_peak_flops
from scaletrain.precision import MasterWeights, Precision
from scaletrain.train import checkpoint as ckpt
from scaletrain.train.metrics import MetricsLogger, peak_memory_bytes


def pick_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise LaunchError("train.device=cuda but no CUDA device is visible; use train.device=cpu or auto")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def default_run_dir() -> str:
    return str(Path("runs") / datetime.now().strftime("%Y%m%d-%H%M%S"))


def cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed token losses; the caller divides by the tokens of the whole global batch."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1), reduction="sum")


class Trainer:
    def __init__(self, cfg: JobConfig, *, stream=None):
        self.cfg = cfg
        self.rank, self.world_size = 0, 1
        self.device = pick_device(cfg.train.device)
        self.precision = Precision(cfg.precision, self.device)
        self.precision.configure_backends()
        self.run_dir = Path(cfg.log.run_dir or default_run_dir())
        self.ckpt_dir = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else self.run_dir / "checkpoints"
        resume_from = self._find_resume()  # before anything is written to the run folder

        # data: order from (seed, step) alone; each data-parallel rank reads its slice
        self.batch = resolve_batch(cfg.train, dp=self.world_size)
        self.data = open_data(cfg.data.path, cfg.data.verify_checksums)
        if self.data.vocab_size > cfg.model.vocab_size:
            raise DataError(f"{self.data.source}: the tokenizer has {self.data.vocab_size} tokens but "
                            f"model.vocab_size={cfg.model.vocab_size}; set model.vocab_size to at least "
                            f"{self.data.vocab_size}")
        self.dataset = WindowDataset(self.data, cfg.data.seq_len)
        self.tokens_per_step = self.batch.global_batch * cfg.data.seq_len

        # model: built on the meta device (no memory), transformed, then materialized
        torch.manual_seed(cfg.train.seed)
        with torch.device("meta"):
            model = Transformer(cfg.model)
        self.model = parallelize(model, cfg)
        self.model.to_empty(device=self.device)
        self.model.init_buffers(self.device)
        init_weights(self.model, cfg.train.seed)
        self.model.to(self.precision.param_dtype)
        self.model.train()
        self.named_params = [(canonical_name(n), p) for n, p in self.model.named_parameters()]
        self.num_params = sum(p.numel() for _, p in self.named_params)

        # optimizer: over fp32 master copies in bf16-true, else over the model's parameters
        self.master = MasterWeights(self.named_params) if self.precision.master_weights else None
        self.optim_params = self.master.named_master if self.master else self.named_params
        self.param_names = {id(p): n for n, p in self.optim_params}
        self.lr = peak_lr(cfg.optim, self.batch.global_batch)
        self.optimizer = build_optimizer(cfg.optim, self.optim_params, self.lr, self.device)
        self.schedule = LRSchedule(cfg.optim, cfg.train.steps)
        self.scaler = self.precision.scaler

        self.step = 0
        self.metrics = MetricsLogger(self.run_dir if self.rank == 0 else None, cfg.train.steps,
                                     enabled=self.rank == 0, tensorboard=cfg.log.tensorboard,
                                     progress=cfg.log.progress, stream=stream)
        if resume_from is not None:
            self._resume(resume_from)
        self._stop_signal: int | None = None
        self.flops_per_token = flops_per_token(cfg.model, cfg.data.seq_len)
        self.peak_flops, self.peak_source = device_peak_flops(
            self.device, self.precision.compute_dtype, tf32=cfg.precision.mode == "tf32")

    # ---------------------------------------------------------------------------------------
    # set-up helpers

    def _find_resume(self) -> Path | None:
        res = self.cfg.checkpoint.resume
        if res == "auto":
            return ckpt.latest_checkpoint(self.ckpt_dir)
        if res != "none":
            return Path(res)
        if ckpt.complete_checkpoints(self.ckpt_dir) or (self.run_dir / "metrics.jsonl").exists():
            raise ConfigError(f"log.run_dir {self.run_dir} already holds a run; set checkpoint.resume=auto "
                              "to continue it, or choose another log.run_dir (nothing was changed)")
        return None

    def checkpoint_tensors(self) -> dict:
        # bf16-true: the fp32 master weights are the model's true state
        model = {n: p for n, p in (self.master.named_master if self.master else self.named_params)}
        optim, _ = ckpt.optimizer_to_named(self.optimizer, self.param_names)
        return {"model": model, "optim": optim}

    def _resume(self, path: Path) -> None:
        state = ckpt.read_trainer_state(path)
        saved_model = state["config"]["model"]
        if saved_model != self.cfg.to_dict()["model"]:
            diff = [f"{k}={saved_model.get(k)!r} (now {v!r})" for k, v in self.cfg.to_dict()["model"].items()
                    if saved_model.get(k) != v]
            raise CheckpointError(f"{path} was saved for another model shape: {', '.join(diff)}; "
                                  "resume with the model config it was saved with")
        if state["data"]["global_batch"] != self.batch.global_batch or state["data"]["seed"] != self.cfg.train.seed:
            raise CheckpointError(
                f"{path} was trained with global batch {state['data']['global_batch']} and seed "
                f"{state['data']['seed']}; resuming with {self.batch.global_batch} and {self.cfg.train.seed} "
                "would change the data order; keep train.global_batch and train.seed")
        ckpt.init_optimizer_state(self.optimizer)
        ckpt.load_tensors(path, self.checkpoint_tensors())
        ckpt.restore_optimizer_extras(self.optimizer, self.param_names, state["optimizer"])
        if self.master:
            self.master.master_to_model()
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self.step = int(state["step"])
        ckpt.load_rng(path, self.rank, self.world_size, state["world_size"])
        if self.rank == 0:
            self._truncate_metrics(self.step)
        self.metrics.info(f"resumed from {path} at step {self.step}")

    def _truncate_metrics(self, step: int) -> None:
        """Drop metrics rows past the checkpoint: those steps are trained again."""
        f = self.run_dir / "metrics.jsonl"
        if f.exists():
            import json

            rows = [line for line in f.read_text().splitlines() if line.strip()]
            kept = [line for line in rows if json.loads(line)["step"] <= step]
            f.write_text("".join(line + "\n" for line in kept))

    def save(self) -> Path:
        _, skeleton = ckpt.optimizer_to_named(self.optimizer, self.param_names)
        state = {
            "step": self.step,
            "world_size": self.world_size,
            "config": self.cfg.to_dict(),
            "schedule": {"kind": self.cfg.optim.schedule, "step": self.step, "peak_lr": self.lr},
            "scaler": self.scaler.state_dict() if self.scaler else None,
            "data": {"step": self.step, "seed": self.cfg.train.seed, "global_batch": self.batch.global_batch,
                     "seq_len": self.cfg.data.seq_len, "source": self.data.source},
            "optimizer": skeleton,
        }
        return ckpt.save_checkpoint(self.ckpt_dir, self.step, self.checkpoint_tensors(), state,
                                    keep=self.cfg.checkpoint.keep)

    def _loader(self):
        b = self.batch
        sampler = StepSampler(len(self.dataset), b.global_batch, b.micro_batch, b.grad_accum,
                              dp_rank=0, dp_size=b.dp, seed=self.cfg.train.seed, start_step=self.step)
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

    def forward_backward(self, batches) -> tuple[torch.Tensor, float]:
        """Accumulate this step's gradients over its micro-batches; returns (loss, data wait)."""
        wait = 0.0
        loss_sum = torch.zeros((), device=self.device)
        for _ in range(self.batch.grad_accum):
            t0 = time.perf_counter()
            inputs, targets = next(batches)
            wait += time.perf_counter() - t0
            inputs = inputs.to(self.device, non_blocking=True)
            targets = targets.to(self.device, non_blocking=True)
            with self.precision.autocast():
                logits = self.model(inputs)  # (B, T, vocab)
            # normalise by the tokens of the whole global batch: gradients add up over
            # micro-batches (and ranks), and we want the gradient of the mean token loss
            loss = cross_entropy_sum(logits, targets) / self.tokens_per_step
            (self.scaler.scale_loss(loss) if self.scaler else loss).backward()
            loss_sum += loss.detach()
        return loss_sum, wait

    def update(self) -> tuple[torch.Tensor, bool]:
        """Unscale, clip, step, zero: returns (gradient norm before clipping, skipped)."""
        if self.master:
            self.master.grads_to_master()
        params = [p for _, p in self.optim_params]
        overflow = self.scaler.unscale_(params) if self.scaler else False
        max_norm = self.cfg.train.grad_clip or math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
        if not overflow:
            self.optimizer.step()
        if self.scaler:
            self.scaler.update(overflow)
        self.optimizer.zero_grad(set_to_none=True)
        if self.master and not overflow:
            self.master.master_to_model()
        return grad_norm, overflow

    # ---------------------------------------------------------------------------------------
    # the loop

    def fit(self) -> dict:
        cfg = self.cfg
        if self.rank == 0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.json").write_text(cfg.to_json())
        self._announce()
        self._install_signal_handlers()
        losses: list[float] = []
        batches = iter(self._loader())
        window_t0, window_wait, window_steps = time.perf_counter(), 0.0, 0
        last_saved = None
        try:
            while self.step < cfg.train.steps:
                set_lr(self.optimizer, self.lr * self.schedule(self.step))
                loss, grad_norm, skipped, wait = self.train_step(batches)
                self.step += 1
                window_wait += wait
                window_steps += 1
                if self.step % cfg.log.every == 0 or self.step in (1, cfg.train.steps):
                    elapsed = time.perf_counter() - window_t0
                    row = self._metrics_row(loss, grad_norm, elapsed, window_wait, window_steps)
                    losses.append(row["loss"])
                    self.metrics.log(row)
                    window_t0, window_wait, window_steps = time.perf_counter(), 0.0, 0
                if cfg.checkpoint.every and self.step % cfg.checkpoint.every == 0:
                    last_saved = self.save()
                if self._stop_signal is not None:
                    break
        finally:
            self._restore_signal_handlers()

        stopped = self._stop_signal
        want_final = stopped is not None or cfg.checkpoint.save_final
        if want_final and (last_saved is None or last_saved.name != f"step_{self.step:08d}"):
            last_saved = self.save()
        if stopped is not None:
            self.metrics.info(f"stopped by {signal.Signals(stopped).name} after step {self.step}; "
                              f"checkpoint saved to {last_saved}")
        extra = {"checkpoint": str(last_saved) if last_saved else "none"}
        if self.scaler:
            extra["steps skipped (fp16 overflow)"] = self.scaler.skipped_steps
        self.metrics.summary(extra)
        if stopped is None and cfg.train.sample_tokens and self.rank == 0:
            self.metrics.info("sample: " + self.sample(cfg.train.sample_prompt, cfg.train.sample_tokens))
        self.metrics.close()
        return {"losses": losses, "history": self.metrics.history, "step": self.step,
                "stopped_by": stopped, "checkpoint": str(last_saved) if last_saved else None,
                "run_dir": str(self.run_dir)}

    def _metrics_row(self, loss, grad_norm, elapsed, wait, steps) -> dict:
        tokens_per_s = self.tokens_per_step * steps / elapsed
        row = {
            "step": self.step,
            "loss": float(loss),
            "lr": get_lr(self.optimizer),
            "grad_norm": float(grad_norm),
            "tokens_per_s": tokens_per_s,
            "mfu": self.flops_per_token * tokens_per_s / (self.peak_flops * self.world_size),
            "peak_mem_bytes": peak_memory_bytes(self.device),
            "data_wait_frac": wait / elapsed,
            "step_time_s": elapsed / steps,
        }
        if self.scaler:
            row["loss_scale"] = self.scaler.scale
            row["skipped_steps"] = self.scaler.skipped_steps
        return row

    def _announce(self) -> None:
        b, cfg = self.batch, self.cfg
        self.metrics.info(
            f"scaletrain: {self.num_params / 1e6:.2f}M parameters, device {self.device}, precision "
            f"{cfg.precision.mode}, optimizer {cfg.optim.name}, activation checkpointing "
            f"{cfg.memory.activation_checkpointing}{', compiled' if cfg.train.compile else ''}")
        self.metrics.info(
            f"data: {self.data.source}, {self.data.num_tokens:,} tokens, {len(self.dataset):,} windows of "
            f"{cfg.data.seq_len}; batch {b.global_batch} = micro {b.micro_batch} x accum {b.grad_accum} "
            f"x dp {b.dp}; run folder {self.run_dir}")
        if note := self.precision.note():
            self.metrics.info(note)

    def _install_signal_handlers(self) -> None:
        self._old_handlers = {}

        def handler(signum, frame):
            self._stop_signal = signum

        try:
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old_handlers[sig] = signal.signal(sig, handler)
        except ValueError:  # not the main thread: leave the process's handlers alone
            self._old_handlers = {}

    def _restore_signal_handlers(self) -> None:
        for sig, old in self._old_handlers.items():
            signal.signal(sig, old)

    @torch.no_grad()
    def sample(self, prompt: str, new_tokens: int) -> str:
        tok = self.data.tokenizer
        ids = tok.encode(prompt) or [0]
        x = torch.tensor([ids], device=self.device)
        gen = torch.Generator(device=self.device).manual_seed(self.cfg.train.seed)
        self.model.eval()
        with self.precision.autocast():
            out = self.model.generate(x, new_tokens, window=self.cfg.data.seq_len, generator=gen)
        self.model.train()
        return tok.decode(out[0].tolist())
