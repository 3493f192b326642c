"""The training schedule: each step's global batch and learning rate, from the step alone.

The batch: constant, or growing by accumulation micro-batches over the first tokens
(train.batch_rampup, GPT-3's and Megatron's batch-size warm-up). The learning rate: the peak
(after the linear scaling rule, optim.scale_lr_with_batch) times a warm-up and a decay
(optim.schedule), the decay running over full-batch steps, so that a ramp moves it by the
tokens seen, not by the steps taken. `TrainSchedule` answers both for a run.
"""

from __future__ import annotations

import math

RAMPUP_FORMAT = "START,INCREMENT,TOKENS (sequences, sequences, tokens), e.g. \"8,8,1000000\""


def parse_rampup(text: str) -> tuple[int, int, int]:
    """train.batch_rampup's (start, increment, tokens); ValueError naming the option otherwise."""
    parts = [p.strip().replace("_", "") for p in text.split(",")]
    try:
        start, inc, tokens = (int(p) for p in parts)
    except ValueError:
        raise ValueError(f"train.batch_rampup={text!r} is not {RAMPUP_FORMAT}") from None
    if start < 1 or inc < 1 or tokens < 1:
        raise ValueError(f"train.batch_rampup={text!r}: start, increment and tokens must be at least 1; "
                         f"give {RAMPUP_FORMAT}")
    return start, inc, tokens


class BatchSchedule:
    """The global batch of each step, growing as GPT-3 and Megatron's rampup-batch-size grow it:
    from `start` sequences by `increment` each time the tokens seen pass another 1/n of
    `tokens` (n = (global_batch - start) / increment increments), up to global_batch. A step's
    batch depends on the tokens seen before it, hence on the step alone. Without a ramp every
    step has global_batch sequences.

    The batch grows by accumulation micro-batches (`unit` = micro_batch × data-parallel ranks
    sequences each), never by a larger micro-batch."""

    def __init__(self, global_batch: int, seq_len: int, unit: int, start: int | None = None, increment: int = 0,
                 tokens: int = 0):
        self.global_batch, self.seq_len, self.unit = global_batch, seq_len, unit
        # phases: (first step, batch, sequences seen before that step)
        self.phases: list[tuple[int, int, int]] = [(0, global_batch, 0)]
        if start is None or start >= global_batch:
            return
        n = (global_batch - start) // increment
        self.phases, step, seen = [], 0, 0
        while True:
            # the increments passed: floor(tokens seen / (tokens / n)), in integers
            k = min(n, seen * seq_len * n // tokens)
            batch = start + k * increment
            self.phases.append((step, batch, seen))
            if k == n:
                break
            need = (k + 1) * tokens - seen * seq_len * n  # > 0: tokens × n still to see before increment k + 1
            steps = -(-need // (batch * seq_len * n))
            step, seen = step + steps, seen + steps * batch

    @property
    def ramps(self) -> bool:
        return len(self.phases) > 1

    def _phase(self, step: int) -> tuple[int, int, int]:
        for phase in reversed(self.phases):
            if phase[0] <= step:
                return phase
        raise ValueError(f"step {step} is negative")

    def batch(self, step: int) -> int:
        """Sequences of step `step` (0-based), over all ranks."""
        return self._phase(step)[1]

    def accum(self, step: int) -> int:
        """Micro-batches each rank accumulates at step `step`."""
        return self.batch(step) // self.unit

    def seen(self, step: int) -> int:
        """Sequences seen before step `step`."""
        first, batch, seen = self._phase(step)
        return seen + (step - first) * batch

    def equivalent_steps(self, step: int) -> float:
        """Steps of the full batch that see as many tokens as the steps before `step`: where the
        learning-rate schedule stands (exactly `step` without a ramp)."""
        return self.seen(step) / self.global_batch if self.ramps else step

    def describe(self) -> str:
        if not self.ramps:
            return f"batch {self.global_batch}"
        return ", ".join(f"{b} from step {s + 1}" for s, b, _ in self.phases)


def peak_lr(cfg, global_batch: int) -> float:
    """The peak learning rate, after the linear scaling rule if asked (Goyal et al. 2017)."""
    if cfg.scale_lr_with_batch:
        return cfg.lr * global_batch / cfg.reference_batch
    return cfg.lr


def worker_lr_scale(par) -> float:
    """The factor on the learning rate of a run's inner optimizer (`par`: its [parallel]). Local SGD
    and DiLoCo workers each step on 1/dp_replicate of the global batch that optim.lr is set for:
    parallel.sync.inner_lr_scale, or with 0 the square-root rule, sqrt(worker batch / global batch) =
    1/sqrt(dp_replicate) (Adam's noise scales with 1/sqrt(batch): Malladi et al. 2022). 1 for
    workers that sync every step."""
    if par.sync.mode == "step":
        return 1.0
    return par.sync.inner_lr_scale or 1.0 / math.sqrt(par.dp_replicate)


class LRSchedule:
    """Multiplier of the peak learning rate at a step: linear warm-up, then decay to min_lr_ratio."""

    def __init__(self, cfg, total_steps: int):  # cfg: the optim section
        self.kind = cfg.schedule
        self.warmup = cfg.warmup_steps
        self.total = total_steps
        self.floor = cfg.min_lr_ratio

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        if self.kind == "constant":
            return 1.0
        progress = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        if self.kind == "cosine":
            return self.floor + (1.0 - self.floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
        if self.kind == "linear":
            return 1.0 - (1.0 - self.floor) * progress
        raise ValueError(f"unknown schedule {self.kind!r}")


class TrainSchedule:
    """A run's batch and learning rate at each step. The decay runs to `total_steps` (the run's
    train.steps; verify passes the whole run's to a shorter check); `peak` is the learning rate at
    the full global batch; `scale` multiplies every step's (a local SGD worker's: `worker_lr_scale`)."""

    def __init__(self, optim_cfg, batch: BatchSchedule, total_steps: int, peak: float | None = None,
                 scale: float = 1.0):
        self.optim_cfg, self.batch, self.scale = optim_cfg, batch, scale
        self.peak = (peak_lr(optim_cfg, batch.global_batch) if peak is None else peak) * scale
        self.decay = LRSchedule(optim_cfg, batch.equivalent_steps(total_steps))

    def lr(self, step: int) -> float:
        """The learning rate of step `step` (0-based): the schedule at the full-batch steps seen,
        the linear scaling rule at the step's batch."""
        if not self.batch.ramps:
            return self.peak * self.decay(step)
        return peak_lr(self.optim_cfg, self.batch.batch(step)) * self.scale * self.decay(
            self.batch.equivalent_steps(step))

    @classmethod
    def for_job(cls, cfg, batch: BatchSchedule, total_steps: int) -> TrainSchedule:
        """A run's schedule (`cfg`: its JobConfig): optim's, its workers' inner lr scaled (worker_lr_scale)."""
        return cls(cfg.optim, batch, total_steps, scale=worker_lr_scale(cfg.parallel))

    def warmup_note(self, steps: int) -> str | None:
        """A line for a run of `steps` steps that ends inside its warm-up: its learning rate never
        reaches the peak (None when the warm-up ends first)."""
        warmup = self.optim_cfg.warmup_steps
        if not warmup or warmup < steps:
            return None
        return (f"optim.warmup_steps={warmup} is not shorter than train.steps={steps}: the learning rate never "
                f"reaches its peak ({self.peak:.2e}) and this run trains at a fraction of it; lower "
                f"optim.warmup_steps (e.g. to {max(1, steps // 10)})")

    def tokens(self, step: int) -> int:
        """Tokens of step `step`'s global batch (fewer during a batch-size warm-up)."""
        return self.batch.batch(step) * self.batch.seq_len
