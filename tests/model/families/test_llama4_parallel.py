"""A Llama 4-shaped model (experts every other block, top-1 by a sigmoid that scales each expert's
input, a shared expert; chunked rotary blocks with the weightless q/k norm, global no-rope blocks
with the query temperature) trains like one process, step by step, under ZeRO-3, tensor
parallelism (and sequence parallelism), pipeline parallelism, expert parallelism and context
parallelism (ring, allgather, Ulysses: the temperature's table cut to the rank's positions like
the rotary ones); and `scaletrain verify` passes it. Its one-process logits are transformers'
(test_llama4.py beside it)."""

from __future__ import annotations

import pytest

from scaletrain import cli
from test_window_parallel import _toml

from conftest import MICRO, assert_group_trains_alike, fit_reference, micro_cfg, micro_overrides

pytestmark = pytest.mark.multiproc

# a chunk that divides neither the sequence (32) nor its cp chunks; a temperature step of 3
# positions, so that the factor changes inside every sequence, and weights large enough that the
# scores (and so the temperature) matter at the first steps; SGD without clipping: each update is
# the gradient itself, so a gradient that misses a rank's share shows in the final weights
LLAMA4 = {"model.norm": "rmsnorm", "model.activation": "swiglu", "model.position": "rope", "model.n_kv_heads": 2,
          "model.n_layers": 4, "model.tie_embeddings": False, "model.attn_chunk": 6, "model.global_every": 2,
          "model.nope_every": 2, "model.qk_l2_norm": True, "model.attn_temperature": 2.0,
          "model.attn_temperature_floor": 3, "model.moe_experts": 4, "model.moe_top_k": 1,
          "model.moe_score": "sigmoid", "model.moe_scale_input": True, "model.moe_shared_experts": 1,
          "model.moe_hidden": 48, "model.moe_first_dense": 1, "model.moe_every": 2, "model.moe_bias_rate": 0.0,
          "model.init_std": 0.1}
RUN = {"train.steps": 3, "train.global_batch": 4, "train.micro_batch": 2, "optim.name": "sgd", "optim.lr": 0.1,
       "train.grad_clip": 0.0}
LAYOUTS = {
    "zero3": {"parallel.dp_shard": 2, "parallel.zero": 3},
    "tp2": {"parallel.tp": 2},
    "tp2-sp": {"parallel.tp": 2, "parallel.sp": True},
    "pp2": {"parallel.pp": 2},
    "ep2": {"parallel.ep": 2, "parallel.zero": 3},
    "cp2-ring": {"parallel.cp": 2, "parallel.cp_method": "ring"},
    "cp2-allgather": {"parallel.cp": 2, "parallel.cp_method": "allgather"},
    "cp2-ulysses": {"parallel.cp": 2, "parallel.cp_method": "ulysses"},
}


@pytest.mark.slow
def test_a_llama4_shaped_model_trains_alike_on_every_layout(tmp_path):
    ref = fit_reference(micro_cfg(tmp_path / "one", **LLAMA4, **RUN))
    assert_group_trains_alike(2, tmp_path, [(name, micro_overrides(tmp_path / name, **LLAMA4, **RUN, **extra), ref)
                                            for name, extra in LAYOUTS.items()], steps=3)


@pytest.mark.slow
@pytest.mark.usefixtures("forked_launches")
# verify's command on this model, at one layout: how each layout trains it (ZeRO-3, tp 2, pp 2, cp 2 ring
# too) is test_a_llama4_shaped_model_trains_alike_on_every_layout's, step by step and in the final weights
@pytest.mark.parametrize("layout", [["--parallel.dp_shard=2", "--parallel.ep=2"]], ids=["ep2"])
def test_verify_passes_a_llama4_shaped_model(tmp_path, capfd, layout):
    config = tmp_path / "verify.toml"
    config.write_text(_toml({**MICRO, **LLAMA4, "train.micro_batch": 2, "log.run_dir": str(tmp_path / "userrun")}))
    code = cli.main(["verify", "--config", str(config), "--steps=3", *layout])
    out = "".join(capfd.readouterr())
    assert code == 0, out
    line = next(line for line in out.splitlines() if line.startswith("largest relative difference"))
    assert line.endswith("(precision 32-true): PASS"), line


def imported_llama4(folder) -> str:
    """A tiny Llama 4 made by transformers (chunks of 6 under sequences of 32, experts every other
    block), saved to `folder`."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.Llama4TextConfig(
        vocab_size=256, hidden_size=64, intermediate_size=48, intermediate_size_mlp=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64, num_local_experts=4,
        interleave_moe_layer_step=2, attention_chunk_size=6, no_rope_layer_interval=2, floor_scale=3, attn_scale=0.5)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    return str(folder)


@pytest.mark.slow
def test_an_imported_llama4_trains_alike_from_its_weights(tmp_path):
    """Its shape from config.json and its first weights from the safetensors, each rank reading its
    own slices of the translated tensors (q/k rows that cut heads, the experts' shards)."""
    from scaletrain.config import load_config

    folder = imported_llama4(tmp_path / "hf")
    run = {**RUN, "model.from_hf": folder, "model.init_from": folder, "model.max_seq_len": 64}

    def overrides(run_dir, extra):
        values = micro_overrides(run_dir, **run, **extra)
        return {k: v for k, v in values.items() if not k.startswith(("model.dim", "model.n_"))}

    ref = fit_reference(load_config(None, overrides(tmp_path / "one", {})))
    assert_group_trains_alike(2, tmp_path, [(f"imported {name}", overrides(tmp_path / name, LAYOUTS[name]), ref)
                                            for name in ("zero3", "tp2", "pp2", "ep2")], steps=3)
