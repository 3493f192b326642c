from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from scaletrain import fmt, hardware
from scaletrain.train.metrics import MetricsLogger
from scaletrain.train.trainer import Trainer

from conftest import MICRO_ARGS, REPO, micro_cfg, read_metrics, run_here, train_micro


def row(step, loss=2.0):
    return {"step": step, "loss": loss, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_s": 1000.0, "mfu": 0.1,
            "peak_mem_bytes": 2**20, "data_wait_frac": 0.01}


def test_progress_bar_with_eta_and_summary(tmp_path):
    out = io.StringIO()
    log = MetricsLogger(tmp_path, total_steps=4, tensorboard=False, progress="on", stream=out)
    for s in range(1, 5):
        log.log(row(s, loss=3.0 - s * 0.1))
    log.summary({"checkpoint": "none"})
    log.close()
    text = out.getvalue()
    assert "eta" in text and "\r" in text and "[########################]" in text
    assert "final loss" in text and "2.6000" in text
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2, 3, 4]


def test_disabled_logger_writes_and_prints_nothing(tmp_path):
    out = io.StringIO()
    log = MetricsLogger(None, total_steps=2, enabled=False, stream=out)
    log.info("hello")
    log.log(row(1))
    log.summary()
    assert out.getvalue() == "" and not list(tmp_path.iterdir())


def test_cpu_peak_is_probed_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls = []
    monkeypatch.setattr(hardware, "measure_matmul_peak", lambda device, dtype: calls.append(dtype) or 1e11)
    assert hardware.cpu_peak_flops(torch.float32) == 1e11
    assert hardware.cpu_peak_flops(torch.float32) == 1e11
    assert calls == [torch.float32]
    assert (tmp_path / "scaletrain" / "cpu_peak.json").is_file()


def test_gpu_catalog_names():
    h100 = hardware.lookup("h100-sxm")
    assert h100.peak_flops("bf16") == 989.4e12 and h100.memory_GB == 80
    for name in ("V100-32GB", "A100-40GB", "A100-80GB", "H100-SXM", "H100-PCIe", "H200", "B200",
                 "RTX-3090", "RTX-4090"):
        assert hardware.lookup(name).peak_tflops


# --------------------------------------------------------------------------------------------
# The progress line and the summary


def test_progress_line_and_summary_say_what_memory_counts_in_binary_units(tmp_path):
    """The peak RSS in MiB or, past 1 GiB (the CI machine's run crossed it), GiB -- never MB."""
    r = run_here("train", *MICRO_ARGS, "--train.steps=2", f"--log.run_dir={tmp_path / 'run'}")
    assert r.returncode == 0, r.stderr
    step = next(line for line in r.stderr.splitlines() if line.startswith("step 2/2"))
    peak = read_metrics(tmp_path / "run")[-1]["peak_mem_bytes"]
    assert f"rss {fmt.size(peak)}" in step, step
    assert fmt.size(peak).endswith(("MiB", "GiB")) and "MB" not in step
    summary = next(line for line in r.stderr.splitlines() if line.startswith("peak memory"))
    assert summary.endswith(f"{fmt.size(peak)} (the process's peak RSS: tensors, the Python and torch "
                            "runtime, buffers)")


@pytest.mark.slow
def test_summary_after_a_signal_reports_the_step_it_stopped_at_on_stdout_too(tmp_path):
    """Ctrl-C between logged rows: the summary says the step the run stopped (and saved) at, not
    the last logged row; `train ... > out.txt` keeps the summary (stderr stays the whole log)."""
    run_dir = tmp_path / "run"
    out_file = tmp_path / "out.txt"
    args = [sys.executable, "-m", "scaletrain", "train", *MICRO_ARGS, "--train.steps=100000", "--log.every=1000",
            "--checkpoint.every=3", f"--log.run_dir={run_dir}"]
    with out_file.open("w") as out:
        proc = subprocess.Popen(args, cwd=REPO, stdout=out, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
        # steps past the one logged row (step 1): its step-3 checkpoint says so however slow the
        # machine is (a fixed sleep once saw no step finish on a busy one)
        deadline = time.time() + 600  # an event, not a time: the bound only ends a broken run
        while time.time() < deadline and not (run_dir / "checkpoints" / "step_00000003").is_dir():
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGINT, err
    stopped = int(re.search(r"stopped by SIGINT after step (\d+)", err).group(1))
    assert stopped > 1
    rows = read_metrics(run_dir)
    assert rows[-1]["step"] == stopped  # the step it stopped at is logged
    summary = out_file.read_text()
    assert re.search(rf"^steps\s+{stopped}$", summary, re.M), summary
    assert re.search(rf"^final loss\s+{rows[-1]['loss']:.4f}$", summary, re.M), summary
    assert f"step_{stopped:08d}" in summary
    assert "step 1/" not in summary and "steps" in err  # progress stays on stderr, the summary is in both


def test_a_torn_last_metrics_row_is_tolerated_on_resume(tmp_path):
    train_micro(tmp_path, **{"train.steps": 4, "checkpoint.every": 2, "checkpoint.save_final": False})
    metrics = tmp_path / "run" / "metrics.jsonl"
    with metrics.open("a") as f:
        f.write('{"step": 5, "loss": 3.1')  # the crash cut this write short
    log = io.StringIO()
    Trainer(micro_cfg(tmp_path, **{"checkpoint.resume": "auto", "train.steps": 6}), stream=log).fit()
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2, 3, 4, 5, 6]
    assert "dropped 1 unreadable row(s)" in log.getvalue()
