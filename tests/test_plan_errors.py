"""`scaletrain plan` refuses bad input in one line (tests/conftest.py: assert_one_clear_line)."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import Case, assert_one_clear_line, with_toml, write

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
