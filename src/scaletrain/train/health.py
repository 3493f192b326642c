"""What stops a run, and the one line that says why.

A step runs in named phases (`enter`); `guarded` turns running out of memory, or a collective
that failed (a peer gone, a timeout), into one line that names the step, the phase and the ranks
that fell behind. The loss is watched: spikes are logged, divergence stops the run. Steps whose
gradients are not finite are skipped and counted; too many in a row stop the run, and so does
a run none of whose steps changed the weights. Every rank sees the same global loss and gradient
norm, so every rank decides alike and they stop together. A metrics row the disk refuses (it is
full) stops the run after an emergency checkpoint (`final_checkpoint`), and so does, in a single
process, a data file that fails under the run (a shard cut short while it trains). `StopSignals` catches
SIGINT and SIGTERM while a run trains: the run stops at the end of its step, with a checkpoint.
"""

from __future__ import annotations

import contextlib
import errno
import math
import signal
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from scaletrain import watchdog
from scaletrain.errors import CheckpointError, ConfigError, DataError, TrainingStopped, UserError
from scaletrain.interrupt import EarlySignals, StopWaiting


def _worker_line(line: str) -> str:
    """A DataError's own line, also where a DataLoader worker raised it (torch raises it again
    here with the worker's traceback before it)."""
    return line.rsplit("DataError: ", 1)[-1].removesuffix("\\n") if "Original Traceback" in line else line


# words of gloo's and NCCL's messages when a peer is gone or late
COMM_FAILURES = ("Timed out", "timed out", "Timeout", "Connection closed", "Connection reset", "Broken pipe",
                 "NCCL communicator was aborted", "Socket Timeout")


class Health:
    """The run's state of health: the step and phase running, the loss's history, the skipped
    steps (counted in the run's TrainState `state`, which checkpoints keep, as its early loss).
    `custom_loss`: the loss need not be a cross-entropy (no ln(vocab_size) bound); `loss_scale_free`: nor
    positive, nor comparable with its early value (an RL policy loss, about 0): no divergence or spike check."""

    def __init__(self, cfg, layout, rt, metrics, state, *, precision, param_names: dict[int, str], custom_loss: bool,
                 loss_scale_free: bool = False):
        self.cfg, self.layout, self.rt, self.metrics, self.state = cfg, layout, rt, metrics, state
        self.rank, self.world_size, self.device = rt.rank, rt.world_size, rt.device
        # fp16's loss scaler (None in other modes): it says whether a skipped step overflowed, at its minimum
        self.scaler, self.param_names, self.custom_loss = precision.scaler, param_names, custom_loss
        self.loss_scale_free = loss_scale_free
        self.phase = "start-up"  # what the step is doing, named when a collective times out
        self.current_step = 0
        self.consecutive_skips = self.spikes = self.applied_steps = 0
        self.loss_mean: float | None = None
        self.early_losses: list[float] = []  # the first steps' losses: the divergence check's yardstick
        self.said_empty = False  # a step without a counted target was reported
        self.fault: str | None = None  # an I/O failure that stops the run after an emergency save
        self.fault_fix = ""  # what to do before resuming from that save
        self.signals = StopSignals(rt.rank)  # SIGINT / SIGTERM: the run stops at a step's end, saved
        # why a technique voted the step away, when it did (the step hooks' skip_reason): None otherwise
        self.skip_reason: Callable[[], str | None] = lambda: None

    def begin_step(self, step: int) -> None:
        self.current_step = step
        if self.rt.progress is not None:
            self.rt.progress.step = step

    def resuming(self, step: int) -> None:
        """A restarted rank loading the checkpoint of `step`: it has done those steps, and says so
        (not step 0 and start-up) to a peer that waits for it."""
        self.current_step = step
        if self.rt.progress is not None:
            self.rt.progress.step = step
        self.enter(f"start-up, resuming from the checkpoint of step {step}")

    def enter(self, phase: str) -> None:
        self.phase = phase
        if self.rt.progress is not None:
            self.rt.progress.phase = phase

    # ---------------------------------------------------------------------------------------
    # failures: out of memory, a peer gone, a full disk

    def guarded(self, fn, *args):
        """Run one phase of a step; turn a communication failure into one line that names the
        ranks that stopped participating and the collective it happened in. A data file that
        fails under a single-process run (`DataError`: a shard cut short) becomes the run's
        `fault` and the phase returns None: the run stops, saving the steps it finished."""
        try:
            return fn(*args)
        except DataError as e:
            if self.rt.distributed:  # the other ranks wait in this step's collectives: no save they could join
                raise
            self.fault = f"step {self.current_step}: {_worker_line(e.lines[0])}"
            self.fault_fix = "resume from it once the data is restored"
            return None
        except (RuntimeError, dist.DistError) as e:
            text = str(e)
            if isinstance(e, torch.OutOfMemoryError) or "out of memory" in text or "can't allocate memory" in text:
                raise ConfigError(self.describe_oom()) from None
            if not self.rt.distributed or not any(k in text for k in COMM_FAILURES):
                raise
            raise TrainingStopped(self.describe_comm_failure(text)) from None

    def describe_oom(self) -> str:
        b = self.layout
        where = f"step {self.current_step}: out of {self.device.type} memory on rank {self.rank} during {self.phase}"
        if self.phase.startswith("forward"):
            ac = self.cfg.memory.activation_checkpointing
            fix = f"lower train.micro_batch (now {b.micro_batch}; gradient accumulation keeps the global batch)"
            if ac != "full":
                more = "full" if ac == "selective" else "selective or full"
                fix += f", or set memory.activation_checkpointing={more}"
            return f"{where} (activations of micro-batch {b.micro_batch} x data.seq_len {self.cfg.data.seq_len}); {fix}"
        return (f"{where}; the model states do not fit: shard them (parallel.zero=2 or 3, tp, pp) or use a smaller "
                "optimizer (optim.name=adafactor or adamw8bit); `scaletrain plan --config FILE` finds a layout")

    def describe_comm_failure(self, text: str) -> str:
        step = self.current_step
        timed_out = any(k in text for k in ("Timed out", "timed out", "Timeout", "timeout"))
        what = (f"a collective did not complete within parallel.timeout_s={self.cfg.parallel.timeout_s} s"
                if timed_out else "a peer closed its connection")
        lagging = watchdog.lagging(self.rt.progress.store, self.world_size) if self.rt.progress else []
        if not lagging:
            return f"step {step}: {what} during {self.phase}; no rank is behind: another rank failed (see its error)"
        names = ", ".join(str(r.rank) for r in lagging)
        return (f"step {step}: rank {names} stopped participating: {what} (rank {self.rank} waited in "
                f"{self.phase}); " + "; ".join(str(r) for r in lagging))

    def final_checkpoint(self, save: Callable[[], Path] | None, last_saved: Path | None) -> Path | None:
        """The checkpoint the run ends with: `save()`'s, or (`save` None: none is due) `last_saved`.
        After a failure of the file system (`fault`) this is an emergency save, and the run then
        stops with one line that names the checkpoint to resume."""
        if save is not None:
            try:
                last_saved = save()
            except CheckpointError as e:
                if self.fault:
                    raise UserError(f"{self.fault}; the emergency checkpoint failed too: {e.lines[0]}") from None
                raise
        if self.fault:
            raise UserError(f"{self.fault}; checkpoint {last_saved} was saved first, {self.fault_fix}")
        return last_saved

    def log_row(self, row: dict, step: int, path: Path) -> None:
        """Write a metrics row; if the file system refuses it (a full disk), the run stops after
        this step with an emergency checkpoint, which every rank takes part in."""
        if self.fault:
            return
        try:
            self.metrics.log(row)
        except OSError as e:
            what = "the disk is full" if e.errno in (errno.ENOSPC, errno.EDQUOT) else (e.strerror or str(e))
            self.fault = f"step {step}: writing metrics to {path} failed: {what}"
            self.fault_fix = "resume from it once there is room"
            self.metrics.enabled = False

    # ---------------------------------------------------------------------------------------
    # the loss

    def watch_loss(self, step: int, loss: float, skipped: bool) -> None:
        """Log a loss above log.spike_factor × its running mean; stop a run whose loss diverged:
        above train.divergence_factor × its early value (the mean of the first 5 steps), or,
        after warm-up, above ln(vocab_size) + train.divergence_margin, which is worse than a
        model that guesses every token uniformly. Every rank sees the same global loss."""
        if loss is None:  # no target counted in the step's batch: kept out of every statistic, said once
            if not self.said_empty:
                self.said_empty = True
                self.metrics.info(f"step {step}: no token of its batch is a training target (the loss mask marks "
                                  "none: every window holds prompt tokens only), so the step trains nothing and "
                                  "reports no loss; lengthen data.seq_len, or shorten the prompts, so that answers "
                                  "fall in the windows")
            return
        if skipped or not math.isfinite(loss) or self.loss_scale_free:
            return
        if self.cfg.train.divergence_factor:
            self._check_divergence(step, loss)
        factor = self.cfg.log.spike_factor
        if factor and self.loss_mean is not None and step > 10 and loss > factor * self.loss_mean:
            self.spikes += 1
            self.metrics.info(f"loss spike at step {step}: {loss:.4f} is {loss / self.loss_mean:.1f}x the "
                              f"running mean {self.loss_mean:.4f} (log.spike_factor={factor:g})")
        self.loss_mean = loss if self.loss_mean is None else 0.98 * self.loss_mean + 0.02 * loss

    def _check_divergence(self, step: int, loss: float) -> None:
        train, state = self.cfg.train, self.state
        if state.early_loss is None:
            self.early_losses.append(loss)
            if len(self.early_losses) == 5:
                state.early_loss = sum(self.early_losses) / 5
        elif loss > train.divergence_factor * state.early_loss:
            raise TrainingStopped(
                f"step {step}: the loss {loss:.4f} is {loss / state.early_loss:.1f}x its early value "
                f"{state.early_loss:.4f} (train.divergence_factor={train.divergence_factor:g}): the run diverged; "
                "lower optim.lr, raise optim.warmup_steps, or resume from an earlier checkpoint")
        # multi-token prediction adds mtp_loss_weight times the depths' mean, each over no more positions than
        # the main loss counts: a uniform guess scores at most (1 + weight) ln(vocab_size)
        share = 1 + (self.cfg.model.mtp_loss_weight if self.cfg.model.mtp_depth else 0.0)
        uniform = share * math.log(self.cfg.model.vocab_size)
        if not self.custom_loss and step > self.cfg.optim.warmup_steps and \
                loss > uniform + train.divergence_margin:  # a custom loss need not be a cross-entropy
            raise TrainingStopped(
                f"step {step}: after warm-up the loss {loss:.4f} is above "
                f"{'' if share == 1 else f'{share:g} x '}ln(vocab_size) + "
                f"train.divergence_margin = {uniform:.4f} + {train.divergence_margin:g}, worse than guessing "
                f"each of {self.cfg.model.vocab_size} tokens uniformly: the run diverged; lower optim.lr, "
                "raise optim.warmup_steps, or resume from an earlier checkpoint")

    # ---------------------------------------------------------------------------------------
    # skipped steps

    def step_done(self, step: int, skipped: bool, params) -> None:
        """Count an applied or a skipped optimizer step (fp16: whether the loss scaler saw an overflow,
        and at its minimum scale, is the scaler's to say)."""
        if skipped:
            scaler = self.scaler
            self.step_skipped(step, params, scaler is not None and scaler.overflow,
                              scaler is not None and scaler.at_minimum)
        else:
            self.consecutive_skips = 0
            self.applied_steps += 1

    def step_skipped(self, step: int, params, overflow: bool, at_minimum: bool) -> None:
        """Count a skipped step; stop after train.max_skipped_steps in a row (for fp16, in a row
        at the minimum loss scale: above it, the scaler backs off and tries again)."""
        limit = self.cfg.train.max_skipped_steps
        self.state.skipped_steps += 1
        if (reason := self.skip_reason()) is not None:  # not the gradients' fault: no streak toward a stop
            self.metrics.info(f"step {step}: {reason}; step skipped, weights untouched")
            return
        if overflow and self.scaler is not None:
            self.consecutive_skips = self.consecutive_skips + 1 if at_minimum else 0
            if self.consecutive_skips < limit:
                return
            raise TrainingStopped(
                f"step {step}: the fp16 loss scale collapsed to its minimum (precision.min_scale="
                f"{self.scaler.min_scale:g}) and gradients still overflow, {self.consecutive_skips} steps in a row; "
                "fp16's range is too small for this run: train with precision.mode=bf16-mixed")
        self.consecutive_skips += 1
        name = self.first_nonfinite_gradient(params)
        self.metrics.info(f"step {step}: non-finite gradient (first in {name}); step skipped, weights untouched")
        if self.consecutive_skips >= limit:
            raise TrainingStopped(
                f"step {step}: {self.consecutive_skips} steps in a row had non-finite gradients (the first in "
                f"{name}); stopping (train.max_skipped_steps={limit}). Lower optim.lr, check the data near this "
                "step, or resume from an earlier checkpoint")

    def first_nonfinite_gradient(self, params) -> str:
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

    def check_weights_changed(self, steps_run: int) -> None:
        """Stop a run of which every step was skipped: it trained nothing."""
        if steps_run > 0 and self.applied_steps == 0:
            raise TrainingStopped(
                f"every one of the {steps_run} steps of this run was skipped (non-finite gradients"
                f"{' or fp16 overflow' if self.scaler else ''}): the weights never changed; "
                + ("lower precision.init_scale or train with precision.mode=bf16-mixed" if self.scaler else
                   "lower optim.lr, or check the data and the model's initialisation"))


class StopSignals:
    """SIGINT and SIGTERM while a run trains (between `install` and `restore`): the first is
    kept in `received`, and the run stops at the end of its step, saved; another says the run is
    already stopping. `received` may be set by hand (every rank stops alike: see the trainer's
    end of step). Inside `interruptible()` a wait before a step is cut short instead."""

    def __init__(self, rank: int):
        self.rank = rank
        self.received: int | None = None
        self._old: dict = {}
        self._waiting = False

    def _handler(self, signum, frame) -> None:
        if self.received is not None:
            if self.rank == 0:
                print(f"scaletrain: {signal.Signals(signum).name} again: already stopping; the checkpoint "
                      "save finishes first (SIGKILL would lose it)", file=sys.stderr, flush=True)
        self.received = self.received or signum
        if self._waiting:
            self._waiting = False
            raise StopWaiting(signal.Signals(signum).name)

    @contextlib.contextmanager
    def interruptible(self):
        """Around a wait of the main thread for other processes before a step begins (a quorum of
        replica groups, which may take minutes): a stop signal, now or already received, raises
        StopWaiting there, and the run stops before that step, saved, instead of after it. (Python
        runs the handler inside the wait: a lock's acquire is interrupted by signals on POSIX.)"""
        if self.received is not None:
            raise StopWaiting(signal.Signals(self.received).name)
        self._waiting = True
        try:
            yield
        finally:
            self._waiting = False

    def install(self) -> None:
        self._old = {}
        try:
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handler)
        except ValueError:  # not the main thread: leave the process's handlers alone
            self._old = {}
        early = getattr(self._old.get(signal.SIGINT), "__self__", None)
        if isinstance(early, EarlySignals) and early.received is not None:  # one that came while the run started
            self.received = self.received or early.received

    def restore(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)  # the caller's own (the CLI ignores later signals after a stop)
