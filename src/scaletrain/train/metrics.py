"""Metrics: one JSON object per logged step in metrics.jsonl, TensorBoard, a progress line.

Steps that evaluate (train.eval_every) add val_loss and val_ppl, shown in TensorBoard as
val/loss and val/ppl beside train/*.

Only rank 0 writes or prints; other ranks get a `MetricsLogger(enabled=False)` whose methods
do nothing.
"""

from __future__ import annotations

import json
import math
import resource
import sys
import time
from pathlib import Path
from typing import IO

import torch

REQUIRED_KEYS = ("step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu", "peak_mem_bytes", "data_wait_frac")


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this process: the CUDA allocator's peak, or the CPU process's peak RSS."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def perplexity(loss: float) -> float:
    """exp(mean token loss): the number of tokens the model is as unsure between as a uniform guess."""
    return math.exp(loss) if loss < 709 else math.inf  # exp overflows a double past ~709.78


def _fmt_num(x: float) -> str:
    for unit, div in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= div:
            return f"{x / div:.1f}{unit}"
    return f"{x:.0f}"


def _fmt_time(s: float) -> str:
    s = int(max(0, s))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


class MetricsLogger:
    def __init__(self, run_dir: Path | None, total_steps: int, *, enabled: bool = True,
                 tensorboard: bool = True, progress: str = "auto", stream: IO[str] | None = None):
        self.enabled = enabled
        self.total_steps = total_steps
        self.stream = stream or sys.stderr
        self.history: list[dict] = []
        self._jsonl = None
        self._tb = None
        self._t0 = time.perf_counter()
        self._bar = progress == "on" or (progress == "auto" and self.stream.isatty())
        self._run_dir = run_dir
        self._want_tb = tensorboard
        assert run_dir is not None or not enabled

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
                    tag = f"val/{key[4:]}" if key.startswith("val_") else f"train/{key}"
                    self._tb.add_scalar(tag, value, row["step"])
        self._show(row)

    def _show(self, row: dict) -> None:
        step = row["step"]
        elapsed = time.perf_counter() - self._t0
        eta = elapsed / max(step, 1) * (self.total_steps - step)
        text = (f"step {step}/{self.total_steps}  loss {row['loss']:.4f}  lr {row['lr']:.2e}  "
                f"gnorm {row['grad_norm']:.3f}  {_fmt_num(row['tokens_per_s'])} tok/s  "
                f"mfu {100 * row['mfu']:.1f}%  mem {_fmt_num(row['peak_mem_bytes'])}B  "
                f"wait {100 * row['data_wait_frac']:.0f}%")
        if "loss_scale" in row:
            text += f"  scale {row['loss_scale']:g}"
        if "val_loss" in row:
            text += f"  val_loss {row['val_loss']:.4f}  val_ppl {row['val_ppl']:.2f}"
        if self._bar:
            width = 24
            filled = int(width * step / self.total_steps)
            bar = "#" * filled + "." * (width - filled)
            self.stream.write(f"\r\033[K[{bar}] {text}  eta {_fmt_time(eta)}")
            if step == self.total_steps:
                self.stream.write("\n")
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def summary(self, extra: dict | None = None) -> None:
        """The table printed at the end of a run."""
        if not self.enabled or not self.history:
            return
        rows = self.history
        steady = rows[1:] or rows  # the first step includes warm-up (and compile)
        elapsed = time.perf_counter() - self._t0
        table = [
            ("steps", f"{rows[-1]['step']}"),
            ("final loss", f"{rows[-1]['loss']:.4f}"),
            ("first logged loss", f"{rows[0]['loss']:.4f}"),
        ]
        evaluated = [r for r in rows if "val_loss" in r]
        if evaluated:
            last = evaluated[-1]
            table.append(("validation loss", f"{last['val_loss']:.4f} (ppl {last['val_ppl']:.2f}, step {last['step']})"))
        table += [
            ("wall time", _fmt_time(elapsed)),
            ("tokens/s (mean)", _fmt_num(sum(r["tokens_per_s"] for r in steady) / len(steady))),
            ("MFU (mean)", f"{100 * sum(r['mfu'] for r in steady) / len(steady):.1f}%"),
            ("peak memory", f"{_fmt_num(max(r['peak_mem_bytes'] for r in rows))}B"),
            ("data wait (mean)", f"{100 * sum(r['data_wait_frac'] for r in steady) / len(steady):.1f}%"),
        ]
        table += [(k, str(v)) for k, v in (extra or {}).items()]
        width = max(len(k) for k, _ in table)
        self.info("-" * (width + 16))
        for k, v in table:
            self.info(f"{k:<{width}}  {v}")
        self.info("-" * (width + 16))

    def close(self) -> None:
        """Close the files (idempotent); a flush the disk refuses (it is full) loses only that row."""
        for f in (self._jsonl, self._tb):
            if f is not None:
                try:
                    f.close()
                except OSError:
                    pass
        self._jsonl = self._tb = None
