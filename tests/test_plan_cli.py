"""`scaletrain plan` as a user meets it: the figures it prints (ZeRO-2 under accumulation), what
it says when nothing fits, a fixed key that keeps the search going, offloaded states against the
node's RAM, and `parallel.layout = "auto"` on a CPU."""

from __future__ import annotations

import json
import re

import pytest

from conftest import MICRO_ARGS, REPO, run_here


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


def test_auto_layout_on_a_cpu_predicts_no_throughput(tmp_path):
    r = run_here("train", *MICRO_ARGS, "--train.steps=1", "--parallel.layout=auto", f"--log.run_dir={tmp_path / 'r'}")
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stderr.splitlines() if "parallel.layout=auto chose" in x)
    assert "tokens/s," not in line and "on a CPU it predicts no tokens/s" in line
