"""Fair comparisons on a noisy machine: every runner takes its steps in the same rounds.

A runner is anything with a training step: a scaletrain Trainer under some config, or the
hand-written loop of `plain.py`. After `warmup` untimed steps of each (allocator, kernels,
compile), round r runs one timed step of every runner, starting at runner r mod n, so drift
in the machine's speed (other jobs, clocks, heat) lands on all of them alike. Figures are
medians over the rounds; ratios are ratios of those medians (speed: tokens/s, so a variant
with a larger batch compares fairly), so each can be checked against the figures beside it.

Peak memory = what the runner keeps between steps + the most one more step of it allocates
on top. What it keeps (parameters, master weights, optimizer state, DDP's gradient buckets,
...) is what its construction and first step leave allocated (hence at least one warm-up
step). Both come from the CUDA allocator's statistics or, on CPU, the profiler's record of
every allocation and free (`memory.allocated_bytes`; it sees no free of an older allocation,
so it watches the runner from its start). The process's RSS peak, which the trainer's metrics
report on CPU, only grows, so it cannot tell runners in one process apart. Memory outside the
process (loader workers) is not counted.

With `max_slowdown`, a runner whose last warm-up step (so not its first step: no compile,
no profiler) takes more than that many times the baseline's is not timed further: its row
says how slow it was.

Under several ranks every rank runs the same rounds; a step's time is the slowest rank's and
the peak the largest rank's.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from scaletrain import fmt
from scaletrain.errors import UserError
from scaletrain.train.metrics import mfu, mfu_text


@dataclass
class Runner:
    step: Callable[[], None]
    tokens_per_step: int  # over all ranks
    flops_per_token: float
    peak_flops: float  # per device, for MFU
    world_size: int = 1
    enter: Callable[[], None] = lambda: None  # process-wide settings the runner needs (matmul precision)


@dataclass
class Entry:
    """One row to measure: `make` builds its runner; a row without one is skipped for `reason`."""

    name: str
    make: Callable[[], Runner] | None = None
    reason: str = ""
    note: str = ""


@dataclass
class Row:
    name: str
    status: str  # measured | skipped | failed
    reason: str = ""
    note: str = ""
    times_s: list[float] = field(default_factory=list)
    tokens_per_step: int = 0
    median_s: float = 0.0
    tokens_per_s: float = 0.0
    mfu: float | None = 0.0  # None: the step outran the peak, no MFU stated
    peak_bytes: int = 0  # kept_bytes + the most one step allocates on top
    kept_bytes: int = 0  # what the runner keeps allocated between steps
    speed: float | None = None  # tokens/s over the baseline's
    memory: float | None = None  # peak memory over the baseline's

    def to_dict(self) -> dict:
        return dict(vars(self))


def trainer_runner(trainer) -> Runner:
    """A scaletrain Trainer's real step (loader, precision, clipping, schedule, optimizer)."""
    from scaletrain.optim import set_lr

    batches = trainer.batches()

    def step() -> None:
        set_lr(trainer.optimizer, trainer.schedule.lr(trainer.step))  # as fit() does
        trainer.train_step(batches)
        trainer.state.step += 1

    return Runner(step, trainer.meter.tokens_per_step, trainer.meter.flops_per_token, trainer.meter.peak_flops,
                  trainer.rt.world_size, trainer.precision.configure_backends)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(runner: Runner, device: torch.device) -> float:
    runner.enter()
    _sync(device)
    t0 = time.perf_counter()
    runner.step()
    _sync(device)
    return time.perf_counter() - t0


def _why(e: BaseException) -> str:
    if isinstance(e, UserError):
        return "; ".join(e.lines)
    first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


def _all_ok(ok: bool, device: torch.device) -> bool:
    """True when every rank succeeded (a single process: its own answer)."""
    if not dist.is_initialized():
        return ok
    t = torch.tensor([0.0 if ok else 1.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item() == 0.0


def _max_over_ranks(values: list[float], device: torch.device) -> list[float]:
    if not dist.is_initialized() or not values:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _build(entry: Entry, device: torch.device) -> tuple[Runner, int]:
    """The runner after its first step, and the bytes it keeps allocated from then on."""
    from scaletrain.memory import allocated_bytes

    box = []

    def first_step() -> None:
        box.append(entry.make())
        _timed(box[0], device)

    gc.collect()  # garbage of earlier runners is not freed inside this one's record
    _, kept = allocated_bytes(first_step, device)
    return box[0], kept


def _rounds(runners: dict[int, Runner], count: int, device: torch.device, on_step) -> None:
    """`count` rounds of one step of each runner, starting one further along each round."""
    for r in range(count):
        order = list(runners)
        for i in order[r % len(order):] + order[:r % len(order)]:
            on_step(i, _timed(runners[i], device))


def run(entries: list[Entry], *, steps: int, warmup: int, device: torch.device,
        tolerate_failures: bool = False, max_slowdown: float | None = None,
        progress: Callable[[str], None] | None = None) -> list[Row]:
    """Measure every entry, interleaved; the first is the baseline of the ratios. A runner that
    fails to build or in its first step becomes a `failed` row when `tolerate_failures`, else
    raises. The warm-up is interleaved too: its first step (under the profiler, with any
    compile) is taken as each runner is built, the rest in rounds."""
    if steps < 1 or warmup < 1:
        raise UserError(f"--steps and --warmup must be at least 1 (the first step allocates the optimizer state), "
                        f"got {steps} and {warmup}")
    say = progress or (lambda text: None)
    rows = [Row(e.name, "skipped" if e.make is None else "measured", e.reason, e.note) for e in entries]
    runners: dict[int, Runner] = {}
    kept: dict[int, int] = {}
    for i, e in enumerate(entries):
        if e.make is None:
            continue
        say(f"building {e.name} (its first step is under the profiler)")
        error = None
        try:
            runners[i], kept[i] = _build(e, device)
        except Exception as ex:  # noqa: BLE001 - reported in the row, or raised below
            if not tolerate_failures or i == 0:
                raise
            error = ex
        if not _all_ok(error is None, device):
            runners.pop(i, None)
            rows[i].status, rows[i].reason = "failed", _why(error) if error else "failed on another rank"

    # the rest of the warm-up (at least one step, to compare speeds without the profiler)
    say("warming up")
    last: dict[int, float] = {}
    _rounds(runners, max(warmup - 1, 1 if max_slowdown else 0), device, last.__setitem__)
    if max_slowdown:
        # the baseline once more: the start of the round can be slowed for all (compile workers starting)
        last[0] = min(last[0], _timed(runners[0], device))
        slowest = dict(zip(last, _max_over_ranks(list(last.values()), device)))
        reference = slowest[0]
        for i, t in slowest.items():
            if t > max_slowdown * reference:
                del runners[i]
                rows[i].status = "skipped"
                rows[i].reason = (f"too slow here: a step took {fmt.seconds(t)}, {t / reference:.0f}x the baseline's "
                                  f"{fmt.seconds(reference)}; not timed further (limit {max_slowdown:g}x)")

    say(f"timing {steps} rounds")
    _rounds(runners, steps, device, lambda i, t: rows[i].times_s.append(t))
    say("measuring peak memory")
    from scaletrain.memory import peak_allocated_bytes

    for i, runner in runners.items():
        row = rows[i]
        row.times_s = _max_over_ranks(row.times_s, device)
        runner.enter()
        peak = kept[i] + peak_allocated_bytes(runner.step, device)
        row.peak_bytes, row.kept_bytes = (int(x) for x in _max_over_ranks([float(peak), float(kept[i])], device))
        row.tokens_per_step = runner.tokens_per_step
        row.median_s = statistics.median(row.times_s)
        row.tokens_per_s = row.tokens_per_step / row.median_s
        row.mfu = mfu(runner.flops_per_token * row.tokens_per_s / runner.world_size, runner.peak_flops)
        if row.mfu is None:  # say why rather than print an impossible figure
            row.note = "; ".join(filter(None, [row.note, "MFU n/a: the device's peak for this dtype (on CPU a "
                                               "matmul probe) is below what the step reached"]))
    base = rows[0]
    for row in rows:
        if row.status == "measured":
            row.speed = row.tokens_per_s / base.tokens_per_s
            row.memory = row.peak_bytes / base.peak_bytes if base.peak_bytes else None
    return rows


# ------------------------------------------------------------------------------------------
# plain-text tables


def text_table(header: list[str], body: list[list[str]], left: int = 1) -> str:
    """Columns aligned with two spaces between; the first `left` columns flush left, the rest
    right. A row shorter than the header ends in a note that spans the remaining columns."""
    n = len(header)
    every, full = [header, *body], [r for r in [header, *body] if len(r) == n]
    widths = [max(len(r[c]) for r in (every if c < left else full) if c < len(r)) for c in range(n)]

    def line(cells: list[str]) -> str:
        out = []
        for k, c in enumerate(cells):
            if len(cells) < n and k == len(cells) - 1:
                out.append(c)
            else:
                out.append(c.ljust(widths[k]) if k < left else c.rjust(widths[k]))
        return "  ".join(out).rstrip()

    return "\n".join(line(r) for r in every)


def rows_table(rows: list[Row]) -> str:
    """The common table of `bench step` and `bench techniques`."""
    header = ["variant", "median step", "tokens/s", "MFU", "peak mem", "speed x", "memory x"]
    body, notes = [], []
    for row in rows:
        if row.status != "measured":
            body.append([row.name, f"{row.status}: {row.reason}"])
            continue
        memory = "n/a" if row.memory is None else f"{row.memory:.3f}"
        body.append([row.name, fmt.seconds(row.median_s), fmt.count(row.tokens_per_s), mfu_text(row.mfu),
                     fmt.size(row.peak_bytes), f"{row.speed:.3f}", memory])
        if row.note:
            notes.append(f"  {row.name}: {row.note}")
    return "\n".join([text_table(header, body), *(["notes:", *notes] if notes else [])])
