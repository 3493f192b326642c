"""A Qwen3-Next-shaped model (linear-attention blocks of two key heads with two value heads each,
gated full-attention blocks with a partial rotary and zero-centred q/k norms, experts with a gated
shared expert after a dense first block) trains like one process, step by step, under ZeRO-3,
tensor parallelism (the key heads split, the convolution's channels and the per-head decay
parameters with them; and sequence parallelism), pipeline parallelism and expert parallelism;
`scaletrain verify` passes it; context parallelism is refused in one line through the one
legality check. Its one-process logits are transformers' (test_qwen3_next.py beside it)."""

from __future__ import annotations

import pytest

from scaletrain import cli
from test_window_parallel import _toml

from conftest import MICRO, assert_group_trains_alike, fit_reference, micro_cfg, micro_overrides

pytestmark = pytest.mark.multiproc

# a delta-rule chunk (5) that divides neither the sequence (32) nor a sequence-parallel half; weights
# large enough that the decay and the gates matter at the first steps; SGD without clipping: each
# update is the gradient itself, so a gradient that misses a rank's share shows in the final weights
QWEN3NEXT = {"model.norm": "rmsnorm", "model.norm_unit_offset": True, "model.activation": "swiglu",
             "model.position": "rope", "model.rotary_fraction": 0.5, "model.n_kv_heads": 2, "model.head_dim": 16,
             "model.n_layers": 4, "model.tie_embeddings": False, "model.attn_gate": True, "model.qk_norm": True,
             "model.linear_heads": 2, "model.linear_value_heads": 4, "model.linear_head_dim": 8,
             "model.linear_value_dim": 12, "model.full_every": 2, "model.linear_chunk": 5, "model.moe_experts": 4,
             "model.moe_top_k": 2, "model.moe_renorm": True, "model.moe_shared_experts": 1,
             "model.moe_shared_hidden": 40, "model.moe_shared_gate": True, "model.moe_hidden": 24,
             "model.moe_first_dense": 1, "model.moe_bias_rate": 0.0, "model.init_std": 0.1}
RUN = {"train.steps": 3, "train.global_batch": 4, "train.micro_batch": 2, "optim.name": "sgd", "optim.lr": 0.1,
       "train.grad_clip": 0.0}
LAYOUTS = {
    "zero3": {"parallel.dp_shard": 2, "parallel.zero": 3},
    "tp2": {"parallel.tp": 2},
    "tp2-sp": {"parallel.tp": 2, "parallel.sp": True},
    "pp2": {"parallel.pp": 2},
    "ep2": {"parallel.ep": 2, "parallel.zero": 3},
}


@pytest.mark.slow
def test_a_qwen3_next_shaped_model_trains_alike_on_every_layout(tmp_path):
    ref = fit_reference(micro_cfg(tmp_path / "one", **QWEN3NEXT, **RUN))
    assert_group_trains_alike(2, tmp_path, [(name, micro_overrides(tmp_path / name, **QWEN3NEXT, **RUN, **extra), ref)
                                            for name, extra in LAYOUTS.items()], steps=3)


@pytest.mark.slow
@pytest.mark.usefixtures("forked_launches")
# verify's command on this model, at one layout: how each layout trains it (ZeRO-3, tp 2, pp 2 too) is
# test_a_qwen3_next_shaped_model_trains_alike_on_every_layout's, step by step and in the final weights
@pytest.mark.parametrize("layout", [["--parallel.dp_shard=2", "--parallel.ep=2"]], ids=["ep2"])
def test_verify_passes_a_qwen3_next_shaped_model(tmp_path, capfd, layout):
    config = tmp_path / "verify.toml"
    config.write_text(_toml({**MICRO, **QWEN3NEXT, "train.micro_batch": 2, "log.run_dir": str(tmp_path / "userrun")}))
    code = cli.main(["verify", "--config", str(config), "--steps=3", *layout])
    out = "".join(capfd.readouterr())
    assert code == 0, out
    line = next(line for line in out.splitlines() if line.startswith("largest relative difference"))
    assert line.endswith("(precision 32-true): PASS"), line


def test_context_parallelism_and_packed_documents_are_refused_in_one_line(tmp_path):
    """The one legality check (train's settling, verify, parallelize() and the planner's search ask it)
    refuses cp for linear attention, packed documents, and a tp that cuts its key heads; the CLI
    exits 2 with one line, before any rank starts."""
    from scaletrain.layout import Layout
    from scaletrain.legality import Techniques, job_errors

    from conftest import one_line_exit_2, run_here

    model = micro_cfg(tmp_path, **QWEN3NEXT).model
    assert job_errors(Layout(cp=2), model) == [
        "parallel.cp=2 with linear attention (model.linear_heads=2): each rank would need the recurrent state of the "
        "ranks before it, which is not passed between them; run without cp (parallel.cp=1)"]
    assert job_errors(Layout(), model, Techniques(document_mask=True)) == [
        "data.document_mask with linear attention (model.linear_heads) is not supported: its state would carry from "
        "one document into the next; set data.document_mask=false"]
    assert any("must divide model.linear_heads=2" in e for e in job_errors(Layout(tp=4), model))
    assert job_errors(Layout(tp=2), model) == []
    args = [f"--{k}={v}" for k, v in {**MICRO, **QWEN3NEXT}.items()]
    r = run_here("train", "--nproc", "2", *args, f"--log.run_dir={tmp_path / 'run'}", "--parallel.cp=2")
    one_line_exit_2(r, "parallel.cp=2 with linear attention", "run without cp (parallel.cp=1)")
    r = run_here("verify", *args, f"--log.run_dir={tmp_path / 'verify'}", "--parallel.cp=2")  # (said once, no rank)
    one_line_exit_2(r, "parallel.cp=2 with linear attention", "run without cp (parallel.cp=1)")


def imported_qwen3_next(folder) -> str:
    """A tiny Qwen3-Next made by transformers (two value heads per key head, full attention every
    2nd block, experts in every block), saved to `folder`."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen3NextConfig(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=24, shared_expert_intermediate_size=40, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12, full_attention_interval=2)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    return str(folder)


@pytest.mark.slow
def test_an_imported_qwen3_next_trains_alike_from_its_weights(tmp_path):
    """Its shape from config.json and its first weights from the safetensors, each rank reading its
    own slices of the translated tensors (the gated q rows that cut heads, the reordered convolution,
    the experts' shards)."""
    from scaletrain.config import load_config

    folder = imported_qwen3_next(tmp_path / "hf")
    run = {**RUN, "model.from_hf": folder, "model.init_from": folder, "model.max_seq_len": 64,
           "model.linear_chunk": 5}

    def overrides(run_dir, extra):
        values = micro_overrides(run_dir, **run, **extra)
        return {k: v for k, v in values.items() if not k.startswith(("model.dim", "model.n_"))}

    ref = fit_reference(load_config(None, overrides(tmp_path / "one", {})))
    assert_group_trains_alike(2, tmp_path, [(f"imported {name}", overrides(tmp_path / name, LAYOUTS[name]), ref)
                                            for name in ("zero3", "tp2", "pp2", "ep2")], steps=3)
