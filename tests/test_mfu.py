"""Honest CPU MFU: the probe keeps its best measurement and is cached; what a run achieves never
changes it (issue 23: tests/test_day_one.py holds the shared-cores peak and its line)."""

from __future__ import annotations

import json
import time

import pytest
import torch

from scaletrain import hardware
from scaletrain.train.trainer import Trainer

from conftest import micro_cfg, read_metrics


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
    t0 = time.perf_counter()
    peak = hardware.measure_matmul_peak(torch.device("cpu"), torch.bfloat16)  # slow on most CPUs
    took = time.perf_counter() - t0
    assert peak > 0
    assert took < 4.0, f"the probe took {took:.1f}s; its budget is ~1.2s"


def test_cpu_peak_flops_caches_the_probe(cache, monkeypatch):
    calls = []
    monkeypatch.setattr(hardware, "measure_matmul_peak", lambda device, dtype: calls.append(dtype) or 2e10)
    assert hardware.cpu_peak_flops(torch.float32) == 2e10
    assert hardware.cpu_peak_flops(torch.float32) == 2e10
    assert calls == [torch.float32]
    assert list(json.loads(cache.read_text()).values()) == [2e10]
