from __future__ import annotations

import io
import json

import torch

from scaletrain import hardware
from scaletrain.train.metrics import MetricsLogger


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
