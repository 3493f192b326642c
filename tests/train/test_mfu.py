"""Honest CPU MFU: the probe keeps its best measurement and is cached; what a run achieves never
changes it (on the cores the ranks share, said in one line)."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest
import torch

from scaletrain import hardware
from scaletrain.train.metrics import StepMeter

from conftest import MICRO_ARGS, read_metrics, run_here


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """The CPU peak cache file, in tmp_path instead of ~/.cache."""
    monkeypatch.setattr(hardware, "_cache_dir", lambda: tmp_path / "cache")
    return tmp_path / "cache" / "cpu_peak.json"


def test_probe_returns_the_best_of_its_measurements(monkeypatch):
    values = iter([5.0, 9.0, 2.0, 7.0, 30.0, 1.0, 4.0, 12.0, 3.0, 8.0, 6.0, 0.5])
    sizes = []

    def fake(a, b):
        sizes.append(a.shape[0])
        return next(values)

    monkeypatch.setattr(hardware, "_matmul_flops", fake)
    peak = hardware.measure_matmul_peak(torch.device("cpu"), torch.float32, sizes=(8, 16, 32), runs=3, seconds=60)
    # per size: one warm-up (not counted) and three runs; the warm-ups here are 5, 30 and 3
    assert sizes == [8] * 4 + [16] * 4 + [32] * 4
    assert peak == 12.0


def test_probe_skips_sizes_that_cannot_end_in_time(monkeypatch):
    sizes = []

    def slow(a, b):  # pretend each run takes 0.05 s, whatever the size
        sizes.append(a.shape[0])
        time.sleep(0.05)
        return float(a.shape[0])

    monkeypatch.setattr(hardware, "_matmul_flops", slow)
    # 8x bigger matrices take ~512x longer: 4 x 0.05 s x 512 cannot fit in 1 s
    peak = hardware.measure_matmul_peak(torch.device("cpu"), torch.float32, sizes=(8, 64), runs=3, seconds=1.0)
    assert sizes == [8] * 4 and peak == 8.0


def test_real_cpu_probe_is_bounded_and_positive():
    # this process's CPU seconds, not the wall clock's: other work on the machine stretches the
    # wall time of the sizes the probe measures, while its deadline (wall clock) only cuts its work
    t0 = time.process_time()
    peak = hardware.measure_matmul_peak(torch.device("cpu"), torch.bfloat16)  # slow on most CPUs
    took = time.process_time() - t0
    assert peak > 0
    assert took < 4.0, f"the probe used {took:.1f} CPU s; its budget is ~1.2 s"


def test_cpu_peak_flops_caches_the_probe(cache, monkeypatch):
    calls = []
    monkeypatch.setattr(hardware, "measure_matmul_peak", lambda device, dtype: calls.append(dtype) or 2e10)
    assert hardware.cpu_peak_flops(torch.float32) == 2e10
    assert hardware.cpu_peak_flops(torch.float32) == 2e10
    assert calls == [torch.float32]
    assert list(json.loads(cache.read_text()).values()) == [2e10]


# --------------------------------------------------------------------------------------------
# The shared cores' peak


def test_cpu_peak_is_probed_on_the_shared_cores_and_no_run_changes_it(cache, monkeypatch, tmp_path):
    threads = []

    def probe(device, dtype):
        threads.append(torch.get_num_threads())
        return 1e6  # 1 MFLOP/s: every training step beats it

    monkeypatch.setattr(hardware, "measure_matmul_peak", probe)
    before = torch.get_num_threads()
    r = run_here("train", *MICRO_ARGS, "--train.steps=3", f"--log.run_dir={tmp_path / 'run'}")
    assert r.returncode == 0, r.stderr
    assert threads == [hardware.cpu_cores()] and torch.get_num_threads() == before
    assert list(json.loads(cache.read_text()).values()) == [1e6]  # not raised by the run
    assert "MFU is measured against the CPU's fp32 matmul peak on its" in r.stderr
    assert "1.0 MFLOP/s" in r.stderr
    rows = read_metrics(tmp_path / "run")
    assert all(row["mfu"] is None for row in rows)  # above that peak: no MFU stated (never above 100%)
    r2 = run_here("train", *MICRO_ARGS, "--train.steps=3", f"--log.run_dir={tmp_path / 'run2'}")
    assert r2.returncode == 0 and threads == [hardware.cpu_cores()]  # cached: probed once


def test_ranks_on_one_cpu_share_its_peak(cache, monkeypatch):
    monkeypatch.setattr(hardware, "measure_matmul_peak", lambda device, dtype: 2e11)
    rt = SimpleNamespace(device=torch.device("cpu"), world_size=2, local_world_size=2, distributed=False)
    meter = StepMeter(rt, tokens_per_step=1000, flops_per_token=1e6, compute_dtype=torch.float32, tf32=False,
                      enter=lambda phase: None)
    assert meter.peak_flops == 1e11  # each rank's share of the CPU, not 2 × a one-thread peak
    assert "200.0 GFLOP/s, shared by the 2 ranks on it" in meter.peak_source
