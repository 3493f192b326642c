"""A DeepSeek-V3-shaped model (latent attention with and without the queries' latent, YaRN, a
dense first block, sigmoid routing limited to groups, shared experts, the routing bias moving)
under ZeRO-3, tensor parallelism (heads split: the compressions replicated, the up-projections
column-parallel; with and without sequence parallelism), pipeline parallelism, expert
parallelism and context parallelism (ring, all-gather, Ulysses), on real processes (gloo on
CPU), in one launch of 2 ranks: the first step's gradients, every step's loss and gradient norm,
the final weights and the routing biases match one process.
An imported DeepSeek-V3 split over tp 2 gives transformers' logits; `scaletrain verify` passes."""

from __future__ import annotations

import pytest

from scaletrain import cli
from scaletrain.verify import TOLERANCES
from test_expert_parallel import assert_same_gradients, fit_one

from conftest import MICRO, assert_same_run, assert_same_weights, micro_cfg, micro_overrides, run_group

pytestmark = pytest.mark.multiproc

STEPS = 3
# 4 heads of 24 (16 unrotated + 8 rotated), values of 12, a latent of 20; 6 experts in 3 groups of which 2 open
MLA = {"train.steps": STEPS, "model.n_layers": 3, "model.tie_embeddings": False, "train.micro_batch": 2,
       "model.position": "rope", "model.norm": "rmsnorm", "model.activation": "swiglu", "model.head_dim": 24,
       "model.mla_kv_rank": 20, "model.mla_rope_dim": 8, "model.mla_v_dim": 12, "model.mla_q_rank": 28,
       "model.rope_scaling": "yarn", "model.rope_factor": 4.0, "model.rope_original_max_seq_len": 8,
       "model.rope_mscale": 1.0, "model.rope_mscale_all_dim": 1.0,
       "model.moe_experts": 6, "model.moe_top_k": 3, "model.moe_first_dense": 1, "model.moe_score": "sigmoid",
       "model.moe_groups": 3, "model.moe_topk_groups": 2, "model.moe_renorm": True, "model.moe_route_scale": 2.5,
       "model.moe_shared_experts": 1, "model.moe_hidden": 32, "model.moe_bias_rate": 0.05,
       # weights large enough that the latents' norms do not magnify their rows' gradients far above the rotated
       # key's (a gradient of the shared key missing a rank's share must show)
       "model.init_std": 0.1}
PLAIN_QUERY = {**MLA, "model.mla_q_rank": 0}
REFERENCES = {"mla": MLA, "plain-query": PLAIN_QUERY}
LAYOUTS = [
    ("zero3", MLA, {"parallel.dp_shard": 2, "parallel.zero": 3}),
    ("tp2", MLA, {"parallel.tp": 2}),
    ("tp2-plain-query", PLAIN_QUERY, {"parallel.tp": 2}),
    ("tp2-sp", MLA, {"parallel.tp": 2, "parallel.sp": True}),
    ("pp2", MLA, {"parallel.pp": 2}),
    ("ep2", MLA, {"parallel.ep": 2, "parallel.zero": 0}),
    *[(f"cp2-{m}", MLA, {"parallel.cp": 2, "parallel.cp_method": m}) for m in ("ring", "allgather", "ulysses")],
]


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    return {name: fit_one(micro_cfg(tmp_path_factory.mktemp(name), **model)) for name, model in REFERENCES.items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("deepseek-mp")
    jobs = [{"overrides": micro_overrides(tmp / name, **{**model, **extra}), "probe": "test_expert_parallel:probe"}
            for name, model, extra in LAYOUTS]
    code, results, err = run_group(2, jobs, tmp)
    assert code == 0, err
    return {name: r for (name, _, _), r in zip(LAYOUTS, results, strict=True)}


@pytest.mark.slow
@pytest.mark.parametrize("name,model", [(n, m) for n, m, _ in LAYOUTS], ids=[n for n, _, _ in LAYOUTS])
def test_deepseek_shaped_model_trains_like_one_process(runs, references, name, model):
    ref = references[next(name for name, m in REFERENCES.items() if m is model)]
    got = runs[name]
    grads, biases = {}, {}
    for rank in got["ranks"]:
        grads.update(rank["probe"]["grads"])
        biases.update(rank["probe"]["biases"])
    assert_same_gradients(grads, ref["grads"], name)
    assert_same_run(got["history"], ref["history"], steps=STEPS, tol=TOLERANCES["32-true"], what=name)
    assert_same_weights(got["weights"], ref["weights"], tol=1e-3, what=name)
    assert any(any(b) for b in ref["biases"].values()), "the biases never moved in the reference"
    assert sorted(biases) == sorted(ref["biases"])
    for layer, want in ref["biases"].items():
        assert biases[layer] == pytest.approx(want, abs=1e-6), f"{name}: the bias of {layer} differs"


def test_imported_deepseek_under_tp_gives_transformers_logits(tmp_path):
    """A DeepSeek-V3 made by transformers, imported and split over tp 2 (and with sequence
    parallelism): the sharded model's logits, gathered, are transformers' within 1e-5."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.DeepseekV3Config(
        vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64, qk_rope_head_dim=8,
        qk_nope_head_dim=12, v_head_dim=10, kv_lora_rank=24, q_lora_rank=20, n_routed_experts=4, n_group=2,
        topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1)
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if "norm" in n:
                p.add_(0.2 * torch.randn_like(p))
    hf.eval().save_pretrained(tmp_path / "hf")
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        ref = hf(tokens).logits
    run = {"model.from_hf": str(tmp_path / "hf"), "model.init_from": str(tmp_path / "hf"), "model.max_seq_len": 64,
           "train.steps": 1, "train.global_batch": 2, "train.micro_batch": 2}
    layouts = {"tp2": {"parallel.tp": 2}, "tp2-sp": {"parallel.tp": 2, "parallel.sp": True}}
    jobs = [{"overrides": {k: v for k, v in micro_overrides(tmp_path / name, **run, **extra).items()
                           if not k.startswith(("model.dim", "model.n_"))},
             "probe": "test_window_parallel:full_logits"} for name, extra in layouts.items()]
    code, results, err = run_group(2, jobs, tmp_path)
    assert code == 0, err
    for name, result in zip(layouts, results, strict=True):
        mine = torch.tensor(result["ranks"][0]["probe"])
        assert mine.shape == ref.shape and ref.abs().max() > 0.1
        assert (mine - ref).abs().max() <= 1e-5, (name, (mine - ref).abs().max())


@pytest.mark.slow
@pytest.mark.usefixtures("forked_launches")
# verify's command on this model, at one layout: how each layout trains it (tp 2, pp 2, ZeRO-3, cp 2 ring
# too) is test_deepseek_shaped_model_trains_like_one_process's, step by step and in the final weights
@pytest.mark.parametrize("layout", [["--parallel.dp_shard=2", "--parallel.ep=2"]], ids=["ep2"])
def test_verify_passes_a_deepseek_shaped_model(tmp_path, capfd, layout):
    from test_window_parallel import _toml

    config = tmp_path / "verify.toml"
    config.write_text(_toml({**MICRO, **MLA, "log.run_dir": str(tmp_path / "userrun")}))
    code = cli.main(["verify", "--config", str(config), "--steps=3", *layout])
    out = "".join(capfd.readouterr())
    assert code == 0, out
    line = next(line for line in out.splitlines() if line.startswith("largest relative difference"))
    assert line.endswith("(precision 32-true): PASS"), line


def test_context_parallel_refuses_values_wider_than_keys_in_one_line(tmp_path):
    from conftest import run_here

    wide = {**MLA, "model.mla_v_dim": 32, "parallel.cp": 2}
    args = [f"--{k}={v}" for k, v in {**MICRO, **wide, "log.run_dir": tmp_path}.items()]
    r = run_here("train", "--nproc", "2", *args)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "model.mla_v_dim=32 is wider than model.head_dim=24" in lines[0], lines
