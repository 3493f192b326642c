"""Metrics: one JSON object per logged step in metrics.jsonl, TensorBoard, a progress line.

Steps that evaluate (train.eval_every) add val_loss and val_ppl, shown in TensorBoard as
val/loss and val/ppl beside train/*. A mixture of experts adds its balance figures (moe_*, from
its step hook): the progress line shows the worst layer's imbalance, the summary names the
worst layer.

Only rank 0 writes or prints; other ranks get a `MetricsLogger(enabled=False)` whose methods
do nothing. Everything is written to the log stream (stderr); the run's result — the summary
table and the sample — also goes to stdout when stdout is not where stderr goes, so
`scaletrain train ... > result.txt` keeps it. `StepMeter` makes a row from the steps since the
last one (tokens/s, MFU, the largest peak memory of any rank, data wait); `announce` writes the
lines that open a run's log, `report_state_bytes` the measured size of the model states.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import resource
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

import torch
import torch.distributed as dist

from scaletrain import fmt
from scaletrain.hardware import device_peak_flops

REQUIRED_KEYS = ("step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu", "peak_mem_bytes", "data_wait_frac")


# what peak_mem_bytes counts, by device type, in the words the progress line and summary use
MEMORY_COUNTED = {"cpu": ("rss", "the process's peak RSS: tensors, the Python and torch runtime, buffers"),
                  "cuda": ("mem", "the CUDA allocator's peak: tensors on the GPU")}


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this process: the CUDA allocator's peak, or the CPU process's peak RSS."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def mfu(achieved_flops: float, peak_flops: float) -> float | None:
    """Model FLOP/s utilisation, or None (shown as "n/a") when the achieved FLOP/s exceed the peak:
    then the peak (on a CPU a probe) is not a bound on what runs here, and a figure above 100%
    would state as fact what is only the probe's shortfall."""
    ratio = achieved_flops / peak_flops
    return ratio if ratio <= 1 else None


def mfu_text(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def mean_mfu_text(rows: list[dict]) -> str:
    """The summary's mean MFU over the rows that have one (and how many had none)."""
    known = [r["mfu"] for r in rows if r["mfu"] is not None]
    if not known:
        return "n/a (the run outran the peak MFU is measured against)"
    missing = len(rows) - len(known)
    return mfu_text(sum(known) / len(known)) + (f" ({missing} of {len(rows)} rows n/a)" if missing else "")


def perplexity(loss: float) -> float:
    """exp(mean token loss): the number of tokens the model is as unsure between as a uniform guess."""
    return math.exp(loss) if loss < 709 else math.inf  # exp overflows a double past ~709.78


class MetricsLogger:
    def __init__(self, run_dir: Path | None, total_steps: int, *, enabled: bool = True,
                 tensorboard: bool = True, progress: str = "auto", stream: IO[str] | None = None,
                 result_stream: IO[str] | None = None, device_type: str = "cpu", summary: bool = True):
        """`stream`: the log (stderr); `result_stream`: where the result also goes (stdout), unless
        it is the log's own destination; `device_type`: what peak memory counts (MEMORY_COUNTED)."""
        self.enabled, self.show_summary = enabled, summary
        self.total_steps = total_steps
        self.stream = stream or sys.stderr
        self.result_stream = result_stream or sys.stdout
        self.memory_label, self.memory_counted = MEMORY_COUNTED.get(device_type, MEMORY_COUNTED["cuda"])
        self.history: list[dict] = []
        self._jsonl = None
        self._tb = None
        self._t0 = time.perf_counter()
        self._bar = progress == "on" or (progress == "auto" and self.stream.isatty())
        self._run_dir = run_dir
        self._want_tb = tensorboard
        self.trackers = None  # W&B, MLflow (scaletrain.train.trackers): started with the run, rank 0
        assert run_dir is not None or not enabled

    def start_trackers(self, cfg, run_id: str, stopping=lambda: False) -> None:
        """W&B and MLflow, as log.wandb and log.mlflow ask (rank 0; one line each at start-up),
        each waited for log.tracker_wait_s at most, or until `stopping()` (a signal came)."""
        if self.enabled and (cfg.log.wandb or cfg.log.mlflow):
            from scaletrain.train.trackers import Trackers

            self.trackers = Trackers(cfg, self._run_dir, run_id, self.info, stopping)

    def _open(self) -> None:
        """Files are created at the first logged step, so that building a trainer writes nothing."""
        self._run_dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = (self._run_dir / "metrics.jsonl").open("a", buffering=1)
        if self._want_tb:
            from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: only when asked

            self._tb = SummaryWriter(str(self._run_dir / "tensorboard"))

    def info(self, line: str) -> None:
        if self.enabled:
            if self._bar:
                self.stream.write("\r\033[K")
            self.stream.write(line + "\n")
            self.stream.flush()

    def result(self, line: str) -> None:
        """A line of the run's result (summary, sample): in the log, and on stdout when that is
        somewhere else (a file, a pipe)."""
        if not self.enabled:
            return
        self.info(line)
        if not _same_destination(self.stream, self.result_stream):
            self.result_stream.write(line + "\n")
            self.result_stream.flush()

    def log(self, row: dict) -> None:
        """Record one step's figures (rank 0 only)."""
        if not self.enabled:
            return
        if self._jsonl is None:
            self._open()
        self.history.append(row)
        self._jsonl.write(json.dumps(row) + "\n")
        if self._tb is not None:
            for key, value in row.items():
                if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                    tag = f"val/{key[4:]}" if key.startswith("val_") else key if key.startswith("tasks/") \
                        else f"train/{key}"  # (task scores, eval.tasks: tasks/TASK/METRIC)
                    self._tb.add_scalar(tag, value, row["step"])
        if self.trackers is not None:
            self.trackers.log(row)
        self._show(row)

    def _show(self, row: dict) -> None:
        step = row["step"]
        elapsed = time.perf_counter() - self._t0
        eta = elapsed / max(step, 1) * (self.total_steps - step)
        loss = "n/a" if row["loss"] is None else f"{row['loss']:.4f}"  # (no target counted)
        text = (f"step {step}/{self.total_steps}  loss {loss}  lr {row['lr']:.2e}  "
                f"gnorm {row['grad_norm']:.3f}  {fmt.count(row['tokens_per_s'])} tok/s  "
                f"mfu {mfu_text(row['mfu'])}  {self.memory_label} {fmt.size(row['peak_mem_bytes'])}  "
                f"wait {100 * row['data_wait_frac']:.0f}%")
        if "loss_scale" in row:
            text += f"  scale {row['loss_scale']:g}"
        if "moe_imbalance" in row:  # the worst MoE layer's max / mean tokens per expert
            text += f"  imbalance {row['moe_imbalance']:.2f}"
            if row.get("moe_dropped"):
                text += f"  dropped {100 * row['moe_dropped']:.1f}%"
        if "rewards/accuracies" in row:  # a preference run: the pairs its rewards rank right, and their margin
            text += f"  acc {100 * row['rewards/accuracies']:.0f}%  margin {row['rewards/margins']:.3f}"
        if "pass_rate" in row:  # an RL run: its rollouts' mean reward and pass rate
            text += f"  reward {row['reward']:.3f}  pass {100 * row['pass_rate']:.0f}%"
        if "val_reward" in row:  # (its val_loss is the held-out reward, negated: said as the reward)
            text += f"  val_reward {row['val_reward']:.3f}  val_pass {100 * row['val_pass_rate']:.0f}%"
        elif "val_loss" in row:
            text += f"  val_loss {row['val_loss']:.4f}"
            text += f"  val_ppl {row['val_ppl']:.2f}" if "val_ppl" in row else ""
            if "val_rewards/accuracies" in row:
                text += f"  val_acc {100 * row['val_rewards/accuracies']:.1f}%"
        if self._bar:
            width = 24
            filled = int(width * step / self.total_steps)
            bar = "#" * filled + "." * (width - filled)
            self.stream.write(f"\r\033[K[{bar}] {text}  eta {fmt.clock(eta)}")
            if step == self.total_steps:
                self.stream.write("\n")
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def summary(self, extra: dict | None = None) -> None:
        """The table printed at the end of a run (unless log.summary is off)."""
        if not self.enabled or not self.history or not self.show_summary:
            return
        rows = self.history
        steady = rows[1:] or rows  # the first step includes warm-up (and compile)
        elapsed = time.perf_counter() - self._t0
        table = [
            ("steps", f"{rows[-1]['step']}"),
            ("final loss", _loss_text([r for r in rows if r["loss"] is not None][-1:])),
            ("first logged loss", _loss_text([r for r in rows if r["loss"] is not None][:1])),
        ]
        evaluated = [r for r in rows if "val_loss" in r]
        if evaluated:
            last = evaluated[-1]
            ppl = f"ppl {last['val_ppl']:.2f}, " if "val_ppl" in last else ""
            table.append(("validation loss", f"{last['val_loss']:.4f} ({ppl}step {last['step']})"))
        table += [
            ("wall time", fmt.clock(elapsed)),
            ("tokens/s (mean)", fmt.count(sum(r["tokens_per_s"] for r in steady) / len(steady))),
            ("MFU (mean)", mean_mfu_text(steady)),
            ("peak memory", f"{fmt.size(max(r['peak_mem_bytes'] for r in rows))} ({self.memory_counted})"),
            ("data wait (mean)", f"{100 * sum(r['data_wait_frac'] for r in steady) / len(steady):.1f}%"),
        ]
        table += moe_summary(rows)
        table += [(k, str(v)) for k, v in (extra or {}).items()]
        width = max(len(k) for k, _ in table)
        self.result("-" * (width + 16))
        for k, v in table:
            self.result(f"{k:<{width}}  {v}")
        self.result("-" * (width + 16))

    def close(self) -> None:
        """Close the files and the trackers' runs (idempotent); a flush the disk refuses (it is
        full) loses only that row."""
        if self.trackers is not None:
            self.trackers.close()
            self.trackers = None
        for f in (self._jsonl, self._tb):
            if f is not None:
                try:
                    f.close()
                except OSError:
                    pass
        self._jsonl = self._tb = None


def moe_summary(rows: list[dict]) -> list[tuple[str, str]]:
    """The summary's mixture-of-experts lines: the worst layer's load imbalance (max / mean tokens
    per expert) at the last logged step and the largest over the logged steps, each naming its
    layer, and the mean share of routed tokens dropped when a capacity drops any. Nothing for a
    dense run."""
    logged = [r for r in rows if "moe_imbalance" in r]
    if not logged:
        return []

    def worst(row: dict) -> tuple[float, str]:
        layers = {k.partition("/")[2]: v for k, v in row.items() if k.startswith("moe_imbalance/")}
        name = max(layers, key=layers.get) if layers else "?"
        return row["moe_imbalance"], name

    value, layer = worst(logged[-1])
    top = max(logged, key=lambda r: r["moe_imbalance"])
    top_value, top_layer = worst(top)
    out = [("MoE imbalance (max/mean)", f"{value:.2f} in {layer} at the last logged step ({logged[-1]['step']}); "
                                        f"largest over the logged steps {top_value:.2f} in {top_layer} "
                                        f"(step {top['step']})")]
    dropped = [r.get("moe_dropped", 0.0) for r in logged]
    if any(dropped):
        out.append(("MoE tokens dropped (mean)",
                    f"{100 * sum(dropped) / len(dropped):.2f}% of routed tokens over the logged steps"))
    return out


def _same_destination(a: IO[str], b: IO[str]) -> bool:
    """Whether two streams write to the same file, pipe or terminal."""
    if a is b:
        return True
    try:
        sa, sb = os.fstat(a.fileno()), os.fstat(b.fileno())
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        return False
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


class StepMeter:
    """The measured figures of a metrics row, over the steps since the last row (its window):
    tokens/s, model FLOP/s against the device's peak (MFU; a CPU's probed peak is shared by its
    local ranks: each is measured against its share), the largest peak memory of any rank (one
    all-reduce, its phase named with `enter`), the share of time spent waiting for data. A window
    that outruns the peak gets no MFU (`mfu`), and `say` tells why, once."""

    def __init__(self, rt, *, tokens_per_step: int, flops_per_token: float, compute_dtype: torch.dtype,
                 tf32: bool, enter: Callable[[str], None], say: Callable[[str], None] = lambda line: None):
        self.device, self.world_size, self.distributed = rt.device, rt.world_size, rt.distributed
        self.tokens_per_step, self.flops_per_token, self.compute_dtype = tokens_per_step, flops_per_token, compute_dtype
        self.tokens_trained = 0  # targets the loss counted, since this process started (stepped's `counted`)
        self.state_bytes: dict[str, int] | None = None  # this rank's model states, measured in the first step
        peak, source = device_peak_flops(self.device, compute_dtype, tf32=tf32)
        # the ranks on one CPU share its cores: each rank's peak is its share of the CPU's
        self.sharing = rt.local_world_size if self.device.type == "cpu" else 1
        self.peak_flops = peak / self.sharing
        self.peak_source = (f"MFU is measured against {source}: {fmt.flops(peak)}"
                            + (f", shared by the {self.sharing} ranks on it" if self.sharing > 1 else ""))
        self.enter, self.say, self.outran = enter, say, False
        self.new_window()

    def new_window(self) -> None:
        self.t0, self.wait, self.steps, self.tokens = time.perf_counter(), 0.0, 0, 0

    def stepped(self, wait: float, tokens: int | None = None, counted: int | None = None) -> None:
        """One more step in the window (of `tokens` tokens, or tokens_per_step), `wait` seconds of
        it spent waiting for data; `counted`: the targets its loss counted (of a loss mask), which
        the rows add up as tokens_trained (since this process started)."""
        self.wait += wait
        self.steps += 1
        self.tokens += self.tokens_per_step if tokens is None else tokens
        self.tokens_trained += (self.tokens_per_step if tokens is None else tokens) if counted is None else counted

    @contextlib.contextmanager
    def paused(self):
        """Time that is not training (evaluation): tokens/s leaves it out."""
        t = time.perf_counter()
        yield
        self.t0 += time.perf_counter() - t

    def row(self, step: int, loss: float, grad_norm, lr: float, skipped_steps: int,
            loss_scale: float | None = None) -> dict:
        elapsed = time.perf_counter() - self.t0
        peak = peak_memory_bytes(self.device)
        if self.distributed:  # the largest peak of any rank
            self.enter("the metrics all-reduce")
            t = torch.tensor([peak], device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            peak = int(t.item())
        tokens_per_s = self.tokens / elapsed
        achieved = self.flops_per_token * tokens_per_s / self.world_size  # model FLOP/s per rank
        row = {
            "step": step,
            "tokens": step * self.tokens_per_step,  # trained on so far (the x axis of `scaletrain plot`)
            "loss": None if loss is None else float(loss),  # None: no target counted in the step
            "lr": lr,
            "grad_norm": float(grad_norm),
            "tokens_per_s": tokens_per_s,
            "tokens_per_s_per_device": tokens_per_s / self.world_size,
            "mfu": mfu(achieved, self.peak_flops),
            "peak_mem_bytes": peak,
            "data_wait_frac": self.wait / elapsed,
            "step_time_s": elapsed / self.steps,
            "skipped_steps": skipped_steps,
        }
        if loss_scale is not None:
            row["loss_scale"] = loss_scale
        row["tokens_trained"] = self.tokens_trained  # the targets counted: a loss mask's, else every token
        if row["mfu"] is None and not self.outran:
            self.outran = True
            self.say(f"MFU n/a: this rank reached {fmt.flops(achieved)} of model FLOPs, above the peak it is "
                     f"measured against ({fmt.flops(self.peak_flops)}), so that peak bounds nothing here")
        return row


def _loss_text(rows: list[dict]) -> str:
    """A logged row's loss (the rows of steps without a counted target have none)."""
    return f"{rows[0]['loss']:.4f}" if rows else "n/a (no step counted a target)"


def report_state_bytes(say: Callable[[str], None], rank: int, b: dict[str, int], num_params: int) -> None:
    """The model states this rank holds, as measured in the first step."""
    total = b["params"] + b["grads"] + b["optimizer"]
    say(f"model states on rank {rank} (measured): parameters {b['params'] / 2**20:.2f} MiB, gradients "
        f"{b['grads'] / 2**20:.2f} MiB, optimizer {b['optimizer'] / 2**20:.2f} MiB, total {total / 2**20:.2f} MiB "
        f"= {total / num_params:.2f} bytes/param")


def announce(t) -> None:
    """The lines that open a run's log: the model and how it trains, the layout, the data, the
    validation windows, the precision's note. `t`: the Trainer (read only)."""
    b, cfg, say = t.layout, t.cfg, t.metrics.info
    say(f"scaletrain: {t.pm.num_params / 1e6:.2f}M parameters, device {t.rt.device}, precision "
        f"{cfg.precision.mode}, optimizer {cfg.optim.name}, activation checkpointing "
        f"{cfg.memory.activation_checkpointing}{', compiled' if cfg.train.compile else ''}"
        f"{f'; weights from {cfg.model.init_from}' if cfg.model.init_from and t.state.resumed_from is None else ''}")
    if t.rt.distributed:
        stages = f"; rank 0 holds stages {t.pm.stage_ids} of {t.pm.num_stages}" if b.pp > 1 else ""
        say(f"layout: {b.explain()}{stages}; backend {dist.get_backend()}")
    # what the run reads: windows of tokens, or an objective's examples (pairs, prompts)
    what = f"{t.data.corpus.num_tokens:,} tokens, {len(t.data.dataset):,} windows of {cfg.data.seq_len}" \
        if t.objective is None else t.objective.describe()
    say(f"data: {t.data.corpus.source}, {what}; batch {b.global_batch} = micro "
        f"{b.micro_batch} x accum {b.grad_accum} x dp {b.dp}; run folder {t.folder.run_dir}")
    if t.data.batch_schedule.ramps:
        say(f"batch-size warm-up (train.batch_rampup={cfg.train.batch_rampup}): {t.data.batch_schedule.describe()}; "
            "more accumulation micro-batches, the learning rate at the tokens seen")
    if b.outer is not None:
        sync = cfg.parallel.sync
        outer = (f"outer {sync.outer_optimizer} lr {sync.outer_lr:g} momentum {sync.outer_momentum:g}"
                 if b.dp_sync == "diloco" else "the workers' weights averaged")
        if (scale := t.schedule.scale) != 1.0:
            outer += f"; inner lr {scale:.3g} x optim.lr"
        if b.fault_tolerance:  # each replica group is a worker; its metrics are its own
            say(f"workers: the replica groups ({b.describe_sync()}; {outer}), each reading its {b.global_batch} "
                f"sequences a step; gradients reduced every step over the {b.dp_shard} rank(s) of this group; loss, "
                "tokens/s and grad norm are this group's")
        else:
            say(f"workers: {b.dp_replicate} ({b.describe_sync()}; {outer}), each reading its "
                f"{b.global_batch // b.dp_replicate} sequences of every step's {b.global_batch}; gradients reduced "
                f"every step over the {b.dp_shard} rank(s) of a worker; loss and tokens/s are the global batch's, "
                f"grad norm the root mean square of the workers'")
    for v in t.data.val_sets:
        n, data = len(v.batches), v.dataset.data
        say(f"validation: {data.source}, {data.num_tokens:,} tokens; {n} batch(es) = "
            f"{n * b.global_batch:,} windows every {cfg.train.eval_every} steps and at the end"
            + (f" (logged as val_loss/{v.name})" if v.name else ""))
    if t.data.val_sets and t.data.val_sets[0].name:
        missing = [n for n in t.data.corpus.names if n not in {v.name for v in t.data.val_sets}]
        say("validation: val_loss is the mean of the sources' losses weighted as the mix"
            + (f"; {', '.join(missing)} has no validation split (prepare --val-fraction)" if missing else ""))
    say(t.meter.peak_source)
    if note := t.precision.note():
        say(note)


def print_sample(t) -> None:
    """The sample that closes a run's log (train.sample_tokens), or why there is none. `t`: the
    Trainer."""
    say = t.metrics.info
    if t.pm.micro_schedule is not None:
        say("sample: skipped, the model is split into pipeline stages (export the checkpoint and sample it whole)")
    elif t.layout.cp > 1:
        say("sample: skipped, the model's attention is split over the context-parallel ranks (export the "
            "checkpoint and sample it whole)")
    elif t.pm.custom:
        say("sample: skipped, the model is a custom module (its outputs need not be logits)")
    elif t.rt.rank == 0 or t.pm.sharded_forward:
        from scaletrain.model.generate import Interrupted

        try:
            t.metrics.result("sample: " + t.sample(t.cfg.train.sample_prompt, t.cfg.train.sample_tokens))
        except Interrupted:
            say("sample: interrupted by a signal (training finished and was saved)")
