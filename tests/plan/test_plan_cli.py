"""`scaletrain plan` as a user meets it: the figures it prints (ZeRO-2 under accumulation), what
it says when nothing fits, a fixed key that keeps the search going, offloaded states against the
node's RAM, and `parallel.layout = "auto"` on a CPU."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from conftest import MICRO_ARGS, REPO, Case, assert_one_clear_line, run_here, with_toml, write


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


# --------------------------------------------------------------------------------------------------
# From test_plan_errors.py (merged here):
#
# `scaletrain plan` refuses bad input in one line (tests/conftest.py: assert_one_clear_line).

# a small mixture of experts: 6 experts, 2 per token
MOE = "[model]\ndim = 64\nn_layers = 2\nn_heads = 4\nvocab_size = 256\nmoe_experts = 6\nmoe_top_k = 2\n"

BAD_INPUT = [
    Case("plan-unknown-gpu", ["plan", "tiny", "--hardware", "H900"], ("unknown hardware 'H900'", "H100-SXM")),
    Case("plan-zero-gpus", ["plan", "tiny", "--gpus-per-node", "0"], ("--gpus-per-node must be at least 1",)),
    Case("plan-zero-nodes", ["plan", "tiny", "--nodes", "0"], ("--nodes and --gpus-per-node must be at least 1",)),
    Case("plan-unknown-model", ["plan", "gpt9"], ("unknown model 'gpt9'", "not a preset")),
    Case("plan-workers-without-link", ["plan", "tiny", "--workers", "2"],
         ("--workers 2 splits the cluster into sites; give the link between them: --workers-link GBPS",)),
    Case("plan-workers-not-dividing", ["plan", "tiny", "--workers", "3", "--workers-link", "1"],
         ("--workers 3 does not divide the cluster's 8 GPUs",)),
    Case("plan-no-model", ["plan"], ("plan needs a model",)),
    Case("plan-hf-config-not-an-object", ["plan", "config.json"],
         ("expected a JSON object",), write("config.json", "[1]")),
    Case("plan-hf-config-incomplete", ["plan", "config.json"],
         ("no 'vocab_size'",), write("config.json", '{"n_embd": 64}')),
    Case("plan-tp-zero", ["plan", "tiny", "--tp", "0"], ("layout sizes must be at least 1, got tp=0",)),
    Case("plan-micro-batch-zero", ["plan", "tiny", "--micro-batch", "0"], ("got micro_batch=0",)),
    Case("plan-tp-not-dividing-gpus", ["plan", "tiny", "--tp", "3"],
         ("tp 3 × pp 1 does not divide the cluster's 8 GPUs",)),
    Case("plan-top-zero", ["plan", "tiny", "--top", "0"], ("--top must be at least 1",)),
    Case("plan-global-batch-zero", ["plan", "tiny", "--global-batch", "0"], ("global batch must be at least 1",)),
    Case("plan-zero-stage-five", ["plan", "tiny", "--zero", "5"], ("argument --zero: invalid choice: 5",)),
    Case("plan-chart-folder-missing", ["plan", "tiny", "--chart", "nodir/c.png"], ("the folder nodir does not exist",)),
    Case("plan-bad-training-config", ["plan", "--config", "c.toml"], ("train.steps: 0 is below the minimum 1",),
         with_toml("[train]\nsteps = 0\n")),
    Case("plan-unknown-engine", ["plan", "tiny", "--engine", "colossal"],
         ("argument --engine: invalid choice: 'colossal'", "megatron")),
    Case("plan-cp-zero", ["plan", "tiny", "--engine", "megatron", "--cp", "0"], ("got cp=0",)),
    Case("plan-fp8-without-fp8-peak", ["plan", "tiny", "--hardware", "A100-80GB", "--fp8"],
         ("--fp8: hardware A100-80GB has no fp8 peak",)),
    Case("plan-precision-fp8-without-fp8-peak", ["plan", "tiny", "--hardware", "A100-80GB", "--precision", "fp8"],
         ("--fp8 (or --precision fp8): hardware A100-80GB has no fp8 peak",)),
    Case("plan-measure-other-engine", ["plan", "tiny", "--engine", "megatron", "--measure"],
         ("--measure runs scaletrain's trainer", "--engine megatron")),
    # a mixture of experts' options
    Case("plan-ep-on-a-dense-model", ["plan", "tiny", "--ep", "2"],
         ("parallel.ep=2 splits the experts of a mixture of experts", "model.moe_experts=0",
          "set model.moe_experts or parallel.ep=1")),
    Case("plan-ep-not-dividing-experts", ["plan", "moe.toml", "--ep", "4"],
         ("parallel.ep=4 must divide model.moe_experts=6", "use ep in [1, 2, 3, 6]"), with_toml(MOE, "moe.toml")),
    Case("plan-ep-not-dividing-ranks", ["plan", "moe.toml", "--gpus-per-node", "4", "--ep", "6"],
         ("parallel.ep=6 borrows its ranks from the dp_shard × cp × tp ranks, so it must divide",
          "use an ep in [2, 4]"),
         with_toml(MOE, "moe.toml")),
    Case("plan-ep-zero", ["plan", "moe.toml", "--ep", "0"], ("layout sizes must be at least 1, got ep=0",),
         with_toml(MOE, "moe.toml")),
    Case("plan-moe-imbalance-below-1", ["plan", "moe.toml", "--moe-imbalance", "0.5"],
         ("argument --moe-imbalance", "at least 1 (1 = balanced), got 0.5"), with_toml(MOE, "moe.toml")),
    Case("plan-moe-imbalance-not-a-number", ["plan", "moe.toml", "--moe-imbalance", "lots"],
         ("argument --moe-imbalance", "expected a number", "'lots'"), with_toml(MOE, "moe.toml")),
    Case("plan-moe-imbalance-on-a-dense-model", ["plan", "tiny", "--moe-imbalance", "1.5"],
         ("--moe-imbalance 1.5 is a mixture of experts' load", "tiny is dense", "drop it")),
]


@pytest.mark.parametrize("case", BAD_INPUT, ids=[c.id for c in BAD_INPUT])
def test_bad_input_gives_one_clear_line(case: Case, workdir: Path, capsys):
    assert_one_clear_line(case, workdir, capsys)
