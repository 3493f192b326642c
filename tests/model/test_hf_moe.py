"""Hugging Face mixtures of experts in and out: Mixtral, Qwen3-MoE and OLMoE. For each, a tiny
model made by transformers (from_config, save_pretrained; nothing downloaded) computes the same
logits in scaletrain after import, and transformers computes ours after export; what none of
them computes is refused in one line."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from scaletrain.config import ModelConfig, load_config  # noqa: E402
from scaletrain.errors import CheckpointError, ConfigError  # noqa: E402
from scaletrain.layout import tp_errors  # noqa: E402
from scaletrain.model.hf import from_hf_state_dict, load_hf_weights  # noqa: E402
from scaletrain.model.hf_config import hf_config_from_model, model_config_from_hf  # noqa: E402
from scaletrain.trained.export_hf import export_hf, save_hf  # noqa: E402
from test_hf import hf_logits, our_logits, ours_from  # noqa: E402

from conftest import micro_cfg, run_here  # noqa: E402

TOL = 1e-5
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, num_experts_per_tok=2)
FAMILIES = {
    # every block a mixture, top-2 of 4 renormalised, a window longer than the sequences
    "mixtral": ("MixtralConfig", dict(TINY, num_local_experts=4, sliding_window=32)),
    # a dense first block (mlp_only_layers), experts of their own width, top-k not renormalised, head_dim apart
    "qwen3-moe-dense-first": ("Qwen3MoeConfig", dict(TINY, num_hidden_layers=3, num_experts=4, moe_intermediate_size=32,
                                                     mlp_only_layers=[0], head_dim=24)),
    # every second block a mixture (decoder_sparse_step), renormalised, a tied head
    "qwen3-moe-step": ("Qwen3MoeConfig", dict(TINY, num_hidden_layers=4, num_experts=4, moe_intermediate_size=32,
                                              decoder_sparse_step=2, norm_topk_prob=True, tie_word_embeddings=True)),
    # q/k norms over the whole projections
    "olmoe": ("OlmoeConfig", dict(TINY, num_experts=4, eos_token_id=None)),
}


def hf_config(name: str, **change):
    """The transformers config make_hf builds its model from."""
    cls, kw = FAMILIES[name]
    return getattr(transformers, cls)(**{**kw, **change})


def make_hf(name: str, folder, **change):
    """A seeded tiny transformers model, its norms moved off their init and its router made
    decisive (a wrong permutation or a wrong expert must show), saved to `folder`."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(name, **change), attn_implementation="eager",
                                                          dtype=torch.float32)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(0.2 * torch.randn_like(p))
            elif n.endswith(".gate.weight"):  # the router
                p.normal_(0.0, 0.5)
            elif ".experts." in n:
                p.normal_(0.0, 0.1)
    model.eval().save_pretrained(folder)
    return model


@pytest.fixture
def tokens():
    return torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("name", FAMILIES)
def test_import_then_export_matches_transformers(name, tmp_path, tokens):
    hf = make_hf(name, tmp_path / "hf")
    ours = ours_from(tmp_path / "hf")
    ref = hf_logits(hf, tokens)
    assert ref.abs().max() > 0.1  # the comparison below is not of near-zeros
    assert (our_logits(ours, tokens) - ref).abs().max() <= TOL
    # the experts matter: routing every token to other experts changes the logits
    with torch.no_grad():
        moe = next(b.moe for b in ours.layers.values() if hasattr(b, "moe"))
        moe.router.weight.neg_()
        assert (our_logits(ours, tokens) - ref).abs().max() > 1e-2
        moe.router.weight.neg_()

    # change our weights (as training would), export, and let transformers load the folder on its own
    with torch.no_grad():
        for p in ours.parameters():
            p.add_(0.01 * torch.randn_like(p))
    save_hf(ours, tmp_path / "out")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    assert back.config.model_type == hf.config.model_type
    assert (hf_logits(back, tokens) - our_logits(ours, tokens)).abs().max() <= TOL
    # and our own import reads the export back to the same model
    assert torch.equal(our_logits(ours_from(tmp_path / "out"), tokens), our_logits(ours, tokens))


def test_the_options_land_where_the_family_puts_them(tmp_path):
    m = {}
    for name in FAMILIES:
        make_hf(name, tmp_path / name)
        m[name] = ModelConfig(**model_config_from_hf(tmp_path / name))
    mix = m["mixtral"]
    assert (mix.moe_experts, mix.moe_top_k, mix.moe_renorm, mix.moe_blocks, mix.expert_hidden) == (4, 2, True, 2, 96)
    assert (mix.sliding_window, mix.qk_norm, mix.rope_theta, mix.moe_bias_rate) == (32, False, 1e6, 0.0)
    q = m["qwen3-moe-dense-first"]
    assert (q.moe_first_dense, q.moe_every, q.moe_hidden, q.hidden_dim, q.moe_renorm) == (1, 1, 32, 96, False)
    assert (q.qk_norm, q.qk_norm_scope, q.head_size) == (True, "head", 24)
    step = m["qwen3-moe-step"]
    assert [step.is_moe_block(i) for i in range(4)] == [False, True, False, True] and step.moe_renorm
    olmoe = m["olmoe"]
    assert (olmoe.qk_norm, olmoe.qk_norm_scope, olmoe.moe_renorm, olmoe.moe_aux_loss) == (True, "projection", False, 0)
    # export writes the block pattern back as transformers reads it
    assert hf_config_from_model(q)["mlp_only_layers"] == [0]
    assert hf_config_from_model(step)["mlp_only_layers"] == [0, 2]


# the config.json of published models (Mixtral-8x7B-v0.1, Qwen3-30B-A3B, OLMoE-1B-7B-0924), as
# written by the transformers 4 of their release
COMMON = {"attention_dropout": 0.0, "hidden_act": "silu", "initializer_range": 0.02, "output_router_logits": False,
          "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True}
PUBLISHED = {
    "mixtral": dict(COMMON, architectures=["MixtralForCausalLM"], bos_token_id=1, eos_token_id=2, hidden_size=4096,
                    intermediate_size=14336, max_position_embeddings=32768, model_type="mixtral",
                    num_attention_heads=32, num_experts_per_tok=2, num_hidden_layers=32, num_key_value_heads=8,
                    num_local_experts=8, rms_norm_eps=1e-5, rope_theta=1e6, router_aux_loss_coef=0.02,
                    sliding_window=None, transformers_version="4.36.0.dev0", vocab_size=32000),
    "qwen3_moe": dict(COMMON, architectures=["Qwen3MoeForCausalLM"], attention_bias=False, bos_token_id=151643,
                      decoder_sparse_step=1, eos_token_id=151645, head_dim=128, hidden_size=2048,
                      intermediate_size=6144, max_position_embeddings=40960, max_window_layers=48, mlp_only_layers=[],
                      model_type="qwen3_moe", moe_intermediate_size=768, norm_topk_prob=True, num_attention_heads=32,
                      num_experts=128, num_experts_per_tok=8, num_hidden_layers=48, num_key_value_heads=4,
                      rms_norm_eps=1e-6, rope_scaling=None, rope_theta=1e6, router_aux_loss_coef=0.001,
                      sliding_window=None, transformers_version="4.51.0", use_sliding_window=False, vocab_size=151936),
    "olmoe": dict(COMMON, architectures=["OlmoeForCausalLM"], attention_bias=False, clip_qkv=None, eos_token_id=50279,
                  hidden_size=2048, intermediate_size=1024, max_position_embeddings=4096, model_type="olmoe",
                  norm_topk_prob=False, num_attention_heads=16, num_experts=64, num_experts_per_tok=8,
                  num_hidden_layers=16, num_key_value_heads=16, pad_token_id=1, rms_norm_eps=1e-5, rope_scaling=None,
                  rope_theta=10000.0, router_aux_loss_coef=0.01, transformers_version="4.43.0.dev0", vocab_size=50304),
}


def test_published_configs_import_whole():
    m = {k: ModelConfig(**model_config_from_hf(v)) for k, v in PUBLISHED.items()}
    assert (m["mixtral"].moe_experts, m["mixtral"].moe_top_k, m["mixtral"].expert_hidden) == (8, 2, 14336)
    assert (m["mixtral"].moe_blocks, m["mixtral"].sliding_window, m["mixtral"].rope_theta) == (32, 0, 1e6)
    q = m["qwen3_moe"]
    assert (q.moe_experts, q.moe_top_k, q.moe_hidden, q.moe_blocks, q.moe_renorm, q.head_size) == \
        (128, 8, 768, 48, True, 128)
    o = m["olmoe"]
    assert (o.moe_experts, o.moe_top_k, o.expert_hidden, o.moe_renorm, o.qk_norm_scope) == (64, 8, 1024, False,
                                                                                            "projection")
    # and each exports back to its own family with the same fields
    for name, cfg in m.items():
        back = hf_config_from_model(cfg)
        assert back["model_type"] == name and ModelConfig(**model_config_from_hf(back)) == cfg


def test_fused_expert_tensors_load_alike(tmp_path):
    """transformers 5 keeps each layer's experts fused in memory (gate_up_proj, down_proj); a
    state dict of those names gives the same parameters as the per-expert files."""
    hf = make_hf("qwen3-moe-step", tmp_path / "hf")
    cfg = ModelConfig(**model_config_from_hf(tmp_path / "hf"))
    fused = {n: p.detach() for n, p in hf.state_dict().items()}
    assert "model.layers.1.mlp.experts.gate_up_proj" in fused
    from_files, from_fused = load_hf_weights(tmp_path / "hf", cfg), from_hf_state_dict(fused, cfg)
    assert from_fused.keys() == from_files.keys()
    assert all(torch.equal(from_fused[n], from_files[n]) for n in from_files)
    # a part is read as the whole's part (how a sharded rank reads its own experts)
    part = (slice(1, 3), slice(4, 20), slice(0, 64))
    assert torch.equal(from_fused.read("layers.1.moe.w3", part), from_files["layers.1.moe.w3"][part])
    assert torch.equal(from_files.read("layers.1.moe.w3", part), from_files["layers.1.moe.w3"][part])


def test_greedy_generation_with_the_cache_matches_transformers(tmp_path):
    from scaletrain.model.generate import generate
    from scaletrain.model.kv_cache import KVCache

    hf = make_hf("mixtral", tmp_path / "hf")
    ours = ours_from(tmp_path / "hf", seq_len=32)
    prompt = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(2))
    theirs = hf.generate(prompt, max_new_tokens=10, do_sample=False, pad_token_id=0)
    mine = generate(lambda x, cache: ours(x, cache), prompt, 10, window=32, temperature=1.0, top_k=1,
                    cache=KVCache(32))
    assert mine.tolist() == theirs.tolist()


def one_line(excinfo) -> str:
    assert len(excinfo.value.lines) == 1, excinfo.value.lines
    return excinfo.value.lines[0]


@pytest.mark.parametrize("name,change,words", [
    ("mixtral", {"router_jitter_noise": 0.1}, "router_jitter_noise=0.1 scales the router's input"),
    ("olmoe", {"clip_qkv": 8.0}, "clip_qkv=8.0 clamps"),
    ("olmoe", {"attention_bias": True}, "attention_bias=true puts a bias on the output projection"),
    ("qwen3-moe-step", {"decoder_sparse_step": 1, "mlp_only_layers": [2]},
     "mlp_only_layers=[2] with decoder_sparse_step=1 makes blocks [0, 1, 3] mixtures of experts"),
    ("qwen3-moe-step", {"num_experts": 8}, "num_experts=8 differs from num_local_experts=4"),
    ("qwen3-moe-step", {"shared_expert_intermediate_size": 64}, "shared_expert_intermediate_size=64 is unknown"),
])
def test_hf_options_we_do_not_compute_are_refused(tmp_path, name, change, words):
    make_hf(name, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ConfigError) as e:
        load_config(None, {"model.from_hf": str(tmp_path), "data.seq_len": 16})
    line = one_line(e)
    assert line.startswith(f"model.from_hf: {tmp_path / 'config.json'}: ") and words in line, line


def test_deepseek_v2_is_refused_in_one_line_exit_2(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "deepseek_v2", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "vocab_size": 128, "intermediate_size": 96, "kv_lora_rank": 16, "q_lora_rank": 24, "n_routed_experts": 4}))
    r = run_here("train", "--print-config", f"--model.from_hf={tmp_path}")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "model_type='deepseek_v2' attends by multi-head latent attention" in lines[0]
    assert "import a DeepSeek-V3 model" in lines[0]
    # the planner still reads its size (a dense guess, as for any other decoder)
    assert model_config_from_hf(tmp_path, strict=False)["dim"] == 64


def test_export_refuses_what_no_family_computes():
    moe = dict(position="rope", norm="rmsnorm", activation="swiglu", moe_experts=4, moe_renorm=True, dim=64,
               n_heads=4, moe_score="softmax")  # Mixtral's scores (the default is DeepSeek-V3's sigmoid)
    for change, words in (({"moe_shared_experts": 1}, "have no shared experts"),
                          ({"moe_score": "sigmoid"}, "have no sigmoid scores"),
                          ({"moe_capacity_factor": 1.25}, "have no expert capacity (model.moe_capacity_factor)"),
                          ({"moe_renorm": False}, "Mixtral (no q/k norms) has experts in every block"),
                          ({"moe_first_dense": 1, "n_layers": 2}, "Mixtral (no q/k norms) has experts in every block"),
                          ({"qk_norm": True, "qk_norm_scope": "projection", "sliding_window": 16},
                           "OLMoE (q/k norms over the whole projections)")):
        with pytest.raises(ConfigError, match="no Hugging Face family") as e:
            hf_config_from_model(ModelConfig(**{**moe, **change}))
        assert words in one_line(e), (change, one_line(e))
    with pytest.raises(ConfigError, match="exported for OLMoE, a mixture of experts, only"):
        hf_config_from_model(ModelConfig(position="rope", norm="rmsnorm", activation="swiglu", qk_norm=True,
                                         qk_norm_scope="projection"))
    assert hf_config_from_model(ModelConfig(**moe))["model_type"] == "mixtral"
    assert hf_config_from_model(ModelConfig(**moe, qk_norm=True))["model_type"] == "qwen3_moe"


def test_projection_qk_norm_options_are_checked():
    with pytest.raises(ConfigError, match="model.qk_norm_scope=projection says what the q/k norms cover, but "
                                          "model.qk_norm=false"):
        load_config(None, {"model.qk_norm_scope": "projection"})
    olmoe = ModelConfig(qk_norm=True, qk_norm_scope="projection", n_heads=4, n_kv_heads=2)
    assert tp_errors(olmoe, 2) == []  # the sum of squares over the tp ranks (tests/parallel/test_window_parallel.py)
    (line,) = tp_errors(olmoe, 4)
    assert line == ("parallel.tp=4 is more than the 2 key/value heads, which then sit whole on every rank, but model."
                    "qk_norm_scope=projection normalises the key projection across the tp ranks; use tp at most 2")
    assert tp_errors(ModelConfig(qk_norm=True), 2) == []


def test_fine_tune_from_the_import_then_export(tmp_path, tokens):
    """HF Qwen3-MoE -> model.init_from -> scaletrain trains -> export --format hf -> transformers
    computes the checkpoint's logits. A routing bias moved in training is refused at export."""
    from scaletrain.train.trainer import Trainer
    from scaletrain.trained.export import load_model_from_checkpoint

    make_hf("qwen3-moe-dense-first", tmp_path / "hf", vocab_size=256)  # the built-in data's bytes
    start = ours_from(tmp_path / "hf")
    runs, hf = {}, str(tmp_path / "hf")
    for name, extra in (("plain", {}), ("biased", {"model.moe_bias_rate": 0.01})):
        cfg = micro_cfg(tmp_path / name, **{"model.from_hf": hf, "model.init_from": hf, "data.seq_len": 16,
                                            "model.n_layers": 3, "train.steps": 3, "train.global_batch": 4,
                                            "optim.lr": 1e-3, "checkpoint.save_final": True, **extra})
        result = Trainer(cfg).fit()
        assert len(result["history"]) == 3
        runs[name] = next((tmp_path / name / "run" / "checkpoints").glob("step_*"))
    ours = load_model_from_checkpoint(runs["plain"]).eval()
    # it trained, from the imported weights (a few small steps away; a fresh init is far off)
    assert (our_logits(ours, tokens) - our_logits(start, tokens)).abs().max() > 1e-4
    first = dict(start.named_parameters())
    assert max((p - first[n]).abs().max().item() for n, p in ours.named_parameters()) < 0.01
    out = export_hf(runs["plain"], tmp_path / "export")
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert back.config.model_type == "qwen3_moe"
    assert (hf_logits(back, tokens) - our_logits(ours, tokens)).abs().max() <= TOL
    with pytest.raises(CheckpointError, match=r"layers\.1\.moe\.expert_bias is not zero .* qwen3_moe routes without"):
        export_hf(runs["biased"], tmp_path / "export-biased")
    assert not (tmp_path / "export-biased").exists()


@pytest.mark.multiproc
@pytest.mark.usefixtures("forked_launches")  # verify's ranks forked (conftest.forked_launches)
@pytest.mark.parametrize("family,layout", [
    ("olmoe", ["--parallel.zero=3", "--parallel.ep=2"]), ("mixtral", ["--parallel.zero=3", "--parallel.ep=2"]),
    ("qwen3-moe-dense-first", ["--parallel.zero=3", "--parallel.ep=2"]),
    # OLMoE's q/k norms over the whole projections: the sum of squares over the tp ranks
    ("olmoe", ["--parallel.tp=2", "--parallel.sp=true"])], ids=["olmoe", "mixtral", "qwen3-moe-dense-first",
                                                                "olmoe-tp2-sp"])
def test_fine_tuning_an_imported_mixture_passes_verify(tmp_path, family, layout):
    """Each family's imported weights train under expert parallelism 2 × ZeRO-3 (experts split over
    the 2 ranks, the rest sharded), and OLMoE under tp 2 with sequence parallelism, as in one
    process: `scaletrain verify` compares every step's loss and gradient norm."""
    from conftest import MICRO

    make_hf(family, tmp_path / "hf", vocab_size=256)
    hf = str(tmp_path / "hf")
    args = [f"--{k}={v}" for k, v in {**MICRO, "model.from_hf": hf, "model.init_from": hf}.items()
            if not k.startswith(("log.", "checkpoint.", "model.dim", "model.n_"))]
    r = run_here("verify", "--steps=3", *args, "--nproc=2", *layout)
    verdict = r.stdout.strip().splitlines()[-1]  # verify's last line is its verdict
    assert r.returncode == 0 and verdict.startswith("largest relative difference: loss ") and \
        verdict.endswith(" (precision 32-true): PASS"), f"{r.stdout}{r.stderr}"
