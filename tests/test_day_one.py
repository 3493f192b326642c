"""Day one (issue 23): what a new user trips over, each point tested as the user meets it —
through the CLI (in this process where no ranks start), on real files, with real signals."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from scaletrain import hardware
from scaletrain.train.metrics import MetricsLogger, StepMeter

from conftest import MICRO, REPO, read_metrics, run_cli, run_here

MICRO_ARGS = [f"--{key}={value}" for key, value in MICRO.items()]


# --------------------------------------------------------------------------------------------
# Wrong numbers: the planner


def test_zero2_under_accumulation_counts_sharded_gradients():
    """The README's planner example: ZeRO-2 at 4Ψ + 12Ψ/N, although 8 micro-steps accumulate."""
    r = run_here("plan", "llama-8b", "--hardware", "H100-SXM", "--nodes", "1", "--gpus-per-node", "8",
                 "--seq-len", "8192", "--global-batch", "64")
    assert r.returncode == 0, r.stderr
    psi = 8_030_261_248
    states = (4 * psi + 12 * psi / 8) / 2**30
    assert f"model states alone {states:.1f} GiB" in r.stdout, r.stdout  # 41.1 GiB, not 67.3
    # the README shows what it prints today
    readme = (REPO / "README.md").read_text()
    best = next(line for line in r.stdout.splitlines() if line.startswith("ZeRO-3 because"))
    assert best.split(";")[0] in readme
    first = next(line for line in r.stdout.splitlines() if line.startswith("  1  "))
    assert " ".join(first.split()) in " ".join(readme.split())
    # a fixed ZeRO-2 layout under accumulation: gradient shards, as without accumulation
    args = ["plan", "llama-8b", "--hardware", "H100-SXM", "--seq-len", "4096", "--zero", "2", "--json"]
    one = json.loads(run_here(*args, "--global-batch", "8", "--micro-batch", "1").stdout)["layouts"][0]
    eight = json.loads(run_here(*args, "--global-batch", "64", "--micro-batch", "1").stdout)["layouts"][0]
    assert eight["layout"]["grad_accum"] == 8 and one["layout"]["grad_accum"] == 1
    assert eight["memory"]["grads"] == one["memory"]["grads"] == pytest.approx(4 * psi / 8, rel=0.01)


def test_when_nothing_fits_the_leanest_leads_and_the_exit_code_is_1():
    r = run_here("plan", "llama-8b", "--hardware", "RTX-4090", "--gpus-per-node", "1")
    assert r.returncode == 1
    rows = [line.split() for line in r.stdout.splitlines() if re.match(r"\s+\d+\s{2}", line)]
    totals = [float(row[row.index("NO") - 1]) for row in rows]
    assert totals == sorted(totals)  # leanest first
    assert "No layout fits: the leanest (mb 1x256, ac full) needs 129.8 GiB per rank" in r.stdout, r.stdout
    fixed = run_here("plan", "llama-8b", "--hardware", "RTX-4090", "--gpus-per-node", "1", "--micro-batch", "1",
                     "--ac", "full")
    assert fixed.returncode == 1 and "needs 129.8 GiB per rank" in fixed.stdout


def test_a_fixed_key_keeps_searching_the_others():
    """--zero 2 alone derives micro-batch 32 without checkpointing; the planner then searches the
    layouts that keep zero 2 and prints the options of the fastest that fits."""
    base = ["plan", "llama-8b", "--hardware", "RTX-4090"]
    r = run_here(*base, "--zero", "2")
    assert r.returncode == 1
    assert "dp 8 zero2, mb 32x1: needs 586.3 GiB" in r.stdout
    line = next(x for x in r.stdout.splitlines() if x.startswith("Keeping parallel.zero=2, "))
    options = line.split(" that keep them: ")[1].split()
    assert "--memory.activation_checkpointing=full" in options
    fits = run_here(*base, "--zero", "2", *options)
    assert fits.returncode == 0, fits.stdout
    assert "fits" in fits.stdout.splitlines()[-1]
    # nothing that keeps the keys fits: the leanest of them, said so
    r = run_here(*base, "--gpus-per-node", "2", "--zero", "2", "--micro-batch", "8")
    assert r.returncode == 1
    assert "No layout that keeps train.micro_batch=8, parallel.zero=2 fits: the leanest of" in r.stdout


def test_offloaded_states_are_checked_against_the_nodes_ram(tmp_path):
    r = run_here("plan", "llama-70b", "--hardware", "RTX-4090", "--top", "3")
    assert r.returncode == 1
    assert "in host memory (offload)" in r.stdout and "— DOES NOT FIT" in r.stdout
    assert "of host memory per GPU for the offloaded model states" in r.stdout
    hw = tmp_path / "hw.toml"
    hw.write_text('[[hardware]]\nname = "big-4090"\nmemory_GB = 24\nhost_memory_GB = 4096\n'
                  'peak_tflops = {fp32 = 82.6, bf16 = 165.2}\nmemory_GBps = 1008\nintra_node_GBps = 32\n'
                  'inter_node_GBps = 12.5\nefficiency = 0.65\n')
    r = run_here("plan", "llama-70b", "--hardware", "big-4090", "--hardware-file", str(hw), "--top", "3")
    assert r.returncode == 0, r.stdout
    assert "offload" in r.stdout.splitlines()[4]  # the best layout offloads, into RAM that holds it
    # the explanation no longer hides the host's share behind "model states 0.0 GiB"
    assert "offloaded to host memory" in r.stdout or "ZeRO-3 because" not in r.stdout


# --------------------------------------------------------------------------------------------
# Wrong numbers: MFU and memory in the progress line


@pytest.fixture
def peak_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(hardware, "_cache_dir", lambda: tmp_path / "cache")
    return tmp_path / "cache" / "cpu_peak.json"


def test_cpu_peak_is_probed_on_the_shared_cores_and_no_run_changes_it(peak_cache, monkeypatch, tmp_path):
    threads = []

    def probe(device, dtype):
        threads.append(torch.get_num_threads())
        return 1e6  # 1 MFLOP/s: every training step beats it

    monkeypatch.setattr(hardware, "measure_matmul_peak", probe)
    before = torch.get_num_threads()
    r = run_here("train", *MICRO_ARGS, "--train.steps=3", f"--log.run_dir={tmp_path / 'run'}")
    assert r.returncode == 0, r.stderr
    assert threads == [hardware.cpu_cores()] and torch.get_num_threads() == before
    assert list(json.loads(peak_cache.read_text()).values()) == [1e6]  # not raised by the run
    assert "MFU is measured against the CPU's fp32 matmul peak on its" in r.stderr
    assert "1.0 MFLOP/s" in r.stderr
    rows = read_metrics(tmp_path / "run")
    assert all(row["mfu"] > 1 for row in rows)  # honest against that peak: the same figure every run
    r2 = run_here("train", *MICRO_ARGS, "--train.steps=3", f"--log.run_dir={tmp_path / 'run2'}")
    assert r2.returncode == 0 and threads == [hardware.cpu_cores()]  # cached: probed once


def test_ranks_on_one_cpu_share_its_peak(peak_cache, monkeypatch):
    monkeypatch.setattr(hardware, "measure_matmul_peak", lambda device, dtype: 2e11)
    rt = SimpleNamespace(device=torch.device("cpu"), world_size=2, local_world_size=2, distributed=False)
    meter = StepMeter(rt, tokens_per_step=1000, flops_per_token=1e6, compute_dtype=torch.float32, tf32=False,
                      enter=lambda phase: None)
    assert meter.peak_flops == 1e11  # each rank's share of the CPU, not 2 × a one-thread peak
    assert "200.0 GFLOP/s, shared by the 2 ranks on it" in meter.peak_source


def test_progress_line_and_summary_say_what_memory_counts_in_mib(tmp_path):
    r = run_here("train", *MICRO_ARGS, "--train.steps=2", f"--log.run_dir={tmp_path / 'run'}")
    assert r.returncode == 0, r.stderr
    step = next(line for line in r.stderr.splitlines() if line.startswith("step 2/2"))
    peak = read_metrics(tmp_path / "run")[-1]["peak_mem_bytes"]
    assert f"rss {peak / 2**20:.1f} MiB" in step, step
    assert "MB" not in step
    summary = next(line for line in r.stderr.splitlines() if line.startswith("peak memory"))
    assert summary.endswith(f"{peak / 2**20:.1f} MiB (the process's peak RSS: tensors, the Python and torch "
                            "runtime, buffers)")
