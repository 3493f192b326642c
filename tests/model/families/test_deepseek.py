"""DeepSeek-V3 in and out: multi-head latent attention (scaletrain.model.mla), YaRN, the sigmoid
router with group-limited top-k, routed scaling, the routing bias (e_score_correction_bias),
shared experts and the first dense blocks. A tiny model made by transformers (from_config; nothing
downloaded) computes the same logits in scaletrain after import, transformers computes ours after
export; generation caches the latents alone and equals the full forward; what we do not import
is one line."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from scaletrain.config import ModelConfig, load_config  # noqa: E402
from scaletrain.errors import ConfigError  # noqa: E402
from scaletrain.model.hf_config import hf_config_from_model  # noqa: E402
from scaletrain.model.kv_cache import KVCache  # noqa: E402
from scaletrain.model.transformer import Transformer  # noqa: E402
from scaletrain.plan.params import latent_cache_bytes  # noqa: E402
from scaletrain.trained.export_hf import save_hf  # noqa: E402

from conftest import model_from_hf, run_here  # noqa: E402

TOL = 1e-5
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_attention_heads=4,
            num_key_value_heads=4, max_position_embeddings=64, qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=10,
            kv_lora_rank=24)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 8,
        "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}
SHAPES = {
    # one query projection, 6 experts in 3 groups of which 2 open, top-3, one dense block first
    "plain-query-groups": dict(TINY, num_hidden_layers=3, q_lora_rank=None, n_routed_experts=6, n_group=3,
                               topk_group=2, num_experts_per_tok=3, first_k_dense_replace=1),
    # the queries' own latent, two dense blocks, YaRN (sequences 2x its original context) with mscale on the softmax
    "query-latent-yarn": dict(TINY, num_hidden_layers=4, q_lora_rank=20, n_routed_experts=8, n_group=4, topk_group=2,
                              num_experts_per_tok=2, first_k_dense_replace=2, rope_parameters=YARN),
    # 5 experts (no groups), two shared, top-k not renormalised, a tied head, value heads wider than the keys' nope
    "ungrouped-tied": dict(TINY, num_hidden_layers=2, q_lora_rank=16, n_routed_experts=5, n_group=1, topk_group=1,
                           num_experts_per_tok=2, first_k_dense_replace=1, n_shared_experts=2, norm_topk_prob=False,
                           tie_word_embeddings=True, v_head_dim=14, routed_scaling_factor=1.5),
}


def hf_config(name: str, **change):
    """The transformers config make_hf builds its model from."""
    return transformers.DeepseekV3Config(**{**SHAPES[name], **change})


def make_hf(name: str, folder, **change):
    """A seeded tiny DeepseekV3ForCausalLM, its norms off their init, its router decisive and its
    routing bias set (a wrong permutation, expert or group must show), saved to `folder`."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(name, **change), attn_implementation="eager",
                                                          dtype=torch.float32)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(0.2 * torch.randn_like(p))
            elif n.endswith(".gate.weight"):
                p.normal_(0.0, 0.5)
            elif ".experts." in n:
                p.normal_(0.0, 0.1)
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn_like(b))
    model.eval().save_pretrained(folder)
    return model


def ours_from(folder, seq_len: int = 32) -> Transformer:
    return model_from_hf(folder, seq_len)


def logits(model, tokens):
    with torch.no_grad():
        out = model(tokens)
    return out.logits if hasattr(out, "logits") else out


@pytest.fixture
def tokens():
    return torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("name", SHAPES)
def test_import_then_export_matches_transformers(name, tmp_path, tokens):
    hf = make_hf(name, tmp_path / "hf")
    ours = ours_from(tmp_path / "hf")
    ref = logits(hf, tokens)
    assert ref.abs().max() > 0.1
    assert (logits(ours, tokens) - ref).abs().max() <= TOL
    # the routing bias matters (it picks other experts): without it the logits differ
    moe = next(b.moe for b in ours.layers.values() if hasattr(b, "moe"))
    saved = moe.expert_bias.clone()
    moe.expert_bias.zero_()
    assert (logits(ours, tokens) - ref).abs().max() > 1e-3
    moe.expert_bias.copy_(saved)

    # change the weights (as training would) and the bias (as model.moe_bias_rate would), export,
    # and let transformers load the folder on its own
    with torch.no_grad():
        for p in ours.parameters():
            p.add_(0.01 * torch.randn_like(p))
        moe.expert_bias.add_(0.05)
    save_hf(ours, tmp_path / "out")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    assert back.config.model_type == "deepseek_v3"
    assert (logits(back, tokens) - logits(ours, tokens)).abs().max() <= TOL
    assert torch.equal(logits(ours_from(tmp_path / "out"), tokens), logits(ours, tokens))


def test_the_multi_token_prediction_modules_are_left_out_as_transformers_does(tmp_path, tokens):
    """A checkpoint as DeepSeek ships it, with its multi-token prediction module as the block after
    the last (model.layers.{n}: enorm, hnorm, eh_proj, shared_head and a whole block): the import
    leaves those tensors out, as transformers' DeepseekV3ForCausalLM does, and computes its logits;
    the export says it has no such module."""
    from safetensors.torch import load_file, save_file

    hf = make_hf("plain-query-groups", tmp_path)
    n = hf.config.num_hidden_layers
    tensors = load_file(tmp_path / "model.safetensors")
    last = {k: v for k, v in tensors.items() if k.startswith(f"model.layers.{n - 1}.")}
    mtp = {k.replace(f"layers.{n - 1}.", f"layers.{n}."): v + 0.1 for k, v in last.items()}
    d = hf.config.hidden_size
    mtp.update({f"model.layers.{n}.enorm.weight": torch.ones(d), f"model.layers.{n}.hnorm.weight": torch.ones(d),
                f"model.layers.{n}.eh_proj.weight": torch.randn(d, 2 * d),
                f"model.layers.{n}.shared_head.norm.weight": torch.ones(d),
                f"model.layers.{n}.shared_head.head.weight": tensors["lm_head.weight"].clone(),
                f"model.layers.{n}.embed_tokens.weight": tensors["model.embed_tokens.weight"].clone()})
    save_file({**tensors, **mtp}, tmp_path / "model.safetensors", metadata={"format": "pt"})
    ours = ours_from(tmp_path)
    assert (logits(ours, tokens) - logits(hf, tokens)).abs().max() <= TOL
    assert hf_config_from_model(ours.cfg)["num_nextn_predict_layers"] == 0


def test_the_options_land_where_the_family_puts_them(tmp_path):
    make_hf("query-latent-yarn", tmp_path / "a")
    m = load_config(None, {"model.from_hf": str(tmp_path / "a"), "data.seq_len": 32}).model
    assert (m.mla_kv_rank, m.mla_q_rank, m.mla_rope_dim, m.head_size, m.value_dim) == (24, 20, 8, 20, 10)
    assert (m.moe_experts, m.moe_groups, m.moe_topk_groups, m.moe_top_k, m.moe_first_dense) == (8, 4, 2, 2, 2)
    assert (m.moe_score, m.moe_renorm, m.moe_route_scale, m.moe_shared_experts, m.moe_bias_rate) == \
        ("sigmoid", True, 2.5, 1, 0.0)
    assert (m.rope_scaling, m.rope_factor, m.rope_original_max_seq_len, m.rope_mscale_all_dim) == ("yarn", 4.0, 8, 1.0)
    hf = hf_config_from_model(m)
    assert (hf["q_lora_rank"], hf["kv_lora_rank"], hf["qk_nope_head_dim"], hf["v_head_dim"], hf["n_group"]) == \
        (20, 24, 12, 10, 4)
    assert hf["rope_parameters"]["rope_type"] == "yarn" and hf["first_k_dense_replace"] == 2


def test_yarn_matches_transformers_by_hand():
    """YaRN's frequencies and factors against a hand computation (DeepSeek-V3's own numbers:
    factor 40, original 4096, beta 32/1, rope dim 64): the fastest pair keeps its speed, the
    slowest is divided by 40, and the softmax scale gains (1 + 0.1 ln 40)^2."""
    import math

    from scaletrain.model.mla import LatentAttention
    from scaletrain.model.transformer import rope_frequencies

    cfg = ModelConfig(dim=64, n_heads=4, head_dim=192, mla_kv_rank=32, mla_rope_dim=64, position="rope",
                      norm="rmsnorm", activation="swiglu", rope_scaling="yarn", rope_factor=40.0,
                      rope_original_max_seq_len=4096, rope_mscale=1.0, rope_mscale_all_dim=1.0, max_seq_len=64)
    freq = rope_frequencies(cfg)
    plain = 1.0 / 10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64)
    # pairs turning more than 32 times over 4096 positions: i < 64 ln(4096 / (32 2π)) / (2 ln 10^4) = 10.1 -> 10
    assert torch.equal(freq[:10], plain[:10])
    # fewer than once: i > 64 ln(4096 / 2π) / (2 ln 10^4) = 22.5 -> 23
    assert torch.allclose(freq[23:], plain[23:] / 40, rtol=1e-6)
    assert LatentAttention(cfg).scale == pytest.approx(192 ** -0.5 * (1 + 0.1 * math.log(40)) ** 2)


def test_yarn_on_ordinary_attention_matches_transformers(tmp_path, tokens):
    """YaRN is not DeepSeek's alone (Qwen3's long contexts, gpt-oss): a Llama with it, at sequences
    4x its original context, computes transformers' logits (no softmax mscale there)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                       "original_max_position_embeddings": 8})
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    hf.eval().save_pretrained(tmp_path)
    ours = ours_from(tmp_path)
    assert ours.cfg.rope_scaling == "yarn" and ours.cfg.rope_mscale == 0.0
    assert (logits(ours, tokens) - logits(hf, tokens)).abs().max() <= TOL


def test_generation_caches_the_latent_and_equals_the_full_forward(tmp_path):
    make_hf("query-latent-yarn", tmp_path / "hf")
    model = ours_from(tmp_path / "hf")
    cfg = model.cfg
    tokens = torch.randint(0, 128, (2, 30), generator=torch.Generator().manual_seed(3))
    cache = KVCache(32)
    with torch.no_grad():
        full = model(tokens)
        parts = [model(tokens[:, :11], cache), model(tokens[:, 11:12], cache), model(tokens[:, 12:19], cache)]
        parts += [model(tokens[:, t:t + 1], cache) for t in range(19, 30)]
    assert (torch.cat(parts, dim=1) - full).abs().max() <= TOL
    # per block and position: the latent (kv_rank) and the rotated shared key (rope_dim), fp32; ordinary
    # attention would keep n_heads x (head_dim + v_dim): 3.75x as much at these widths, 71x at DeepSeek-V3's
    held = sum(t.numel() * t.element_size() for kv in cache._kv.values() for t in kv)
    assert held == cfg.n_layers * 2 * 32 * (24 + 8) * 4 == latent_cache_bytes(cfg, 2, 32, bytes_per_value=4)
    assert held * 3 < cfg.n_layers * 2 * 32 * cfg.n_heads * (cfg.head_size + cfg.value_dim) * 4


def _write(folder, **change) -> None:
    config = {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], **SHAPES["plain-query-groups"],
              **change}
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("change,words", [
    ({"rope_interleave": False}, "rope_interleave=false pairs the rotated coordinates by halves"),
    ({"attention_bias": True}, "attention_bias=true puts biases on q_a_proj, kv_a_proj_with_mqa and o_proj"),
    ({"num_key_value_heads": 2}, "num_key_value_heads=2 differs from num_attention_heads=4"),
    ({"scoring_func": "softmax"}, "scoring_func='softmax' is not DeepSeek-V3's 'sigmoid'"),
    ({"rope_parameters": dict(YARN, truncate="no")}, "needs true or false for truncate in rope_type yarn"),
    ({"n_group": 4}, "n_group=4 must cut n_routed_experts=6 into groups of at least 2 experts"),
])
def test_what_we_do_not_import_is_one_line_exit_2(tmp_path, change, words):
    _write(tmp_path, **change)
    r = run_here("train", "--print-config", f"--model.from_hf={tmp_path}")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0], lines


@pytest.mark.parametrize("values,words", [
    ({"mla_kv_rank": 16, "head_dim": 8, "mla_rope_dim": 8}, "needs model.head_dim (each query/key head's width) above"),
    ({"mla_q_rank": 16}, "model.mla_q_rank shape latent attention, but model.mla_kv_rank=0"),
    ({"mla_kv_rank": 16, "head_dim": 24, "mla_rope_dim": 8, "sliding_window": 4},
     "model.sliding_window: not implemented with latent attention"),
    ({"moe_experts": 6, "moe_score": "sigmoid", "moe_groups": 4, "moe_topk_groups": 2},
     "model.moe_groups=4 must divide model.moe_experts=6 into groups of at least 2"),
    ({"moe_experts": 6, "moe_score": "sigmoid", "moe_groups": 3, "moe_topk_groups": 1, "moe_top_k": 3},
     "model.moe_top_k=3 is more than the 1 open groups of 2 experts hold"),
    ({"mtp_loss_weight": 0.1}, "model.mtp_loss_weight=0.1 weighs multi-token prediction, but model.mtp_depth=0"),
])
def test_bad_shapes_are_one_line(values, words):
    base = {"model.position": "rope", "model.norm": "rmsnorm", "model.activation": "swiglu"}
    with pytest.raises(ConfigError) as e:
        load_config(None, {**base, **{f"model.{k}": v for k, v in values.items()}})
    assert any(words in line for line in e.value.lines), e.value.lines


@pytest.mark.slow
@pytest.mark.parametrize("targets", ["attention", "all-linear"])
def test_lora_on_the_latent_projections_exports_to_peft(tmp_path, targets):
    """LoRA on the attention's linears (the compressions wq_a, wkv_a, the up-projections wq_b, wkv_b,
    and wo) or on every linear of the blocks (the dense and shared MLPs too; never the stacked
    experts nor the router), trained from an imported DeepSeek-V3: the merged export computes our
    logits in transformers; the PEFT folder loads onto the transformers base with them. PEFT
    reads the MLPs' gate_proj/up_proj/down_proj of a mixture of experts as the fused experts, so
    adapters there are refused for PEFT in one line (exit 2)."""
    peft = pytest.importorskip("peft")
    from scaletrain.train.trainer import Trainer
    from scaletrain.trained.adapters import adapted_from_checkpoint

    from conftest import micro_cfg

    make_hf("ungrouped-tied", tmp_path / "hf", vocab_size=256, tie_word_embeddings=False)
    run = {"model.from_hf": str(tmp_path / "hf"), "model.init_from": str(tmp_path / "hf"), "data.seq_len": 16,
           "model.max_seq_len": 64, "train.steps": 3, "optim.lr": 0.01, "checkpoint.save_final": True,
           "adapter.kind": "lora", "adapter.targets": targets}
    saved = Trainer(micro_cfg(tmp_path, **run)).fit()["checkpoint"]
    ours, _ = adapted_from_checkpoint(saved)
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))
    want = logits(ours, x)
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert (want - logits(base, x)).abs().max() > 0.05  # the adapters changed the model
    r = run_here("export", saved, "--format", "hf", "--out", str(tmp_path / "merged"))
    assert r.returncode == 0, r.stderr
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    assert (logits(merged, x) - want).abs().max() <= TOL

    r = run_here("export", saved, "--format", "peft", "--out", str(tmp_path / "peft"))
    if targets == "all-linear":
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and "model.layers.0.mlp.down_proj is adapted, but PEFT reads " \
            "gate_proj, up_proj and down_proj of a mixture of experts as its fused experts' parameters" in lines[0]
        return
    assert r.returncode == 0, r.stderr
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert set(config["target_modules"]) == {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"}
    adapted = peft.PeftModel.from_pretrained(base, str(tmp_path / "peft")).eval()
    assert (logits(adapted, x) - want).abs().max() <= TOL


PLANNED = {"position": "rope", "norm": "rmsnorm", "activation": "swiglu", "head_dim": 24, "mla_kv_rank": 20,
           "mla_rope_dim": 8, "mla_v_dim": 12, "n_layers": 3, "tie_embeddings": False, "dim": 64, "n_heads": 4,
           "vocab_size": 256}


MOE = {"mla_q_rank": 28, "moe_experts": 6, "moe_first_dense": 1, "moe_shared_experts": 1, "moe_hidden": 32,
       "moe_score": "sigmoid"}


@pytest.mark.parametrize("extra", [{}, {"mla_q_rank": 28}, MOE], ids=["plain-query", "query-latent", "moe"])
def test_the_planner_counts_latent_attention_as_the_model_holds_it(extra):
    """The planner's parameters per rank: the model's own count on one rank; on each of 2 tp ranks
    the compressions (and their norms) whole and every split matrix halved, counted from the model."""
    from scaletrain.layout import Layout
    from scaletrain.model.transformer import count_params
    from scaletrain.plan.params import rank_params

    cfg = ModelConfig(**PLANNED, **extra)
    assert rank_params(cfg, Layout(), 0).total == count_params(cfg)
    split = ("attn.wq.", "attn.wq_b.", "attn.wkv_b.", "attn.wo.", "mlp.w", "tok_emb.", "output.")
    by_hand = sum(p.numel() // 2 if n.startswith("layers.") and any(s in n for s in split) or
                  n.startswith(("tok_emb", "output")) else p.numel() for n, p in Transformer(cfg).named_parameters())
    assert rank_params(cfg, Layout(tp=2), 0).total == by_hand


def test_flops_per_token_of_latent_attention_by_hand():
    """6 per matmul parameter a token multiplies (the compressions, the up-projections, wo, the MLP,
    the head) plus the scores at the query/key width and the weighted sum at the value width."""
    from scaletrain.model.flops import flops_per_token

    cfg = ModelConfig(**PLANNED, mla_q_rank=28)
    d, H, T = 64, 4, 32
    attn = d * 28 + 28 * H * 24 + d * (20 + 8) + 20 * H * (16 + 12) + H * 12 * d
    mlp = 3 * d * cfg.hidden_dim
    want = 6 * (3 * (attn + mlp) + d * 256) + 3 * 6 * H * (24 + 12) * T
    assert flops_per_token(cfg, T) == want


def test_the_planner_keeps_latent_attentions_own_widths_by_hand():
    """Saved activations per token: q and k at nope + rope a head, v and the output at mla_v_dim; the
    compression's output (kv_rank + rope), the normalised latent and its 1/rms, the up-projection's output
    (heads x (nope + v)), the query latent's two copies and 1/rms; context parallelism sends keys and values
    at the keys' width (the values padded, parallel/context_parallel.py)."""
    from scaletrain.layout import Layout
    from scaletrain.plan.activations import attention_widths, latent_bytes_per_token
    from scaletrain.plan.spec import Workload
    from scaletrain.plan.time_model import cp_traffic

    cfg = ModelConfig(**{**PLANNED, "mla_q_rank": 28})
    assert attention_widths(cfg) == (4 * 24, 4 * 24, 4 * 12)
    c = 2  # bf16: and each latent norm's fp32 copy of its input
    assert latent_bytes_per_token(cfg, 1, c) == (28 + 20 + 8 + 20 + 4 * (16 + 12) + 28) * c + 2 * 4 + (20 + 28) * 4
    assert latent_bytes_per_token(cfg, 2, c, selective=True) == (20 + 8 + 2 * (16 + 12) + 28) * c
    wl = Workload(seq_len=32, global_batch=8, precision="bf16-mixed")
    (_, bytes_, calls, _), = cp_traffic(cfg, wl, Layout(cp=2, micro_batch=2, cp_method="ring"))
    assert bytes_ == 2 * 16 * 2 * 4 * 24 * 2 and calls == 3


@pytest.mark.slow
def test_the_planners_latent_attention_activations_are_near_the_traced_count():
    """The closed form against the real layer's saved tensors (fake tensors, scaletrain.plan.trace): within
    10% in fp32 and bf16-mixed, without and with selective recomputation."""
    from scaletrain.plan.activations import formula_activation_bytes
    from scaletrain.plan.spec import Workload
    from scaletrain.plan.trace import traced_activation_bytes

    wide = ModelConfig(**{**PLANNED, "dim": 128, "head_dim": 48, "mla_kv_rank": 64, "mla_rope_dim": 16,
                          "mla_v_dim": 24, "mla_q_rank": 96})
    for precision in ("32-true", "bf16-mixed"):
        for ac in ("none", "selective"):
            w = Workload(seq_len=32, global_batch=4, precision=precision)
            traced = traced_activation_bytes(wide, w, 2, 1, False, ac)[0]
            assert abs(formula_activation_bytes(wide, w, 2, 1, False, ac)[0] / traced - 1) <= 0.1, (precision, ac)
