"""Every family's config fields away from their defaults: for each Hugging Face family scaletrain
reads, the config.json keys its reader turns into fields that change the math (rotary bases and
scaling parameters, norm epsilons, windows and which blocks slide, soft caps, the query scale,
partial rotary, routing options, no-rope blocks, the query temperature, the clamped SwiGLU) are set
away from transformers' defaults and from the value of the existing tests' tiny config. Our reader
must give each value; our logits must be transformers' within 1e-5; the same weights at the usual
values give other logits; and each field on its own bites: our model with that one field put back to
its usual value misses transformers' logits (a reader that dropped the key would be caught by the
logits, not only by the config assertion).

Fields that change the shape of the weights (which blocks hold experts, shared experts) are set in
both models, the changed and the usual one, so that the two hold the same weights; a misread shape
fails the import itself, and its value is asserted. The tiny configs are the existing tests' own
(their builders are imported here), their weights drawn wider (SHARP); the sequences (23 tokens)
fill no window or chunk evenly.
OLMo 2, GPT-NeoX and Gemma 2's rotary base, epsilons, caps and query scale: tests/model/
test_hf_families.py (OFF_DEFAULT)."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import pytest
import torch

transformers = pytest.importorskip("transformers")

import test_deepseek  # noqa: E402
import test_gpt_oss  # noqa: E402
import test_hf  # noqa: E402
import test_hf_families  # noqa: E402
import test_hf_moe  # noqa: E402
import test_llama4  # noqa: E402
from scaletrain.model.transformer import Transformer  # noqa: E402
from test_deepseek import ours_from  # noqa: E402

TOL = 1e-5
BITES = 1e-3  # a field put back to its usual value moves the logits at least this far (100 x TOL)
# in both models: weights drawn 3x wider than transformers' 0.02, so that attention is far from uniform (at
# 0.02 a tiny model's scores are so flat that a rotary field moves its logits by 1e-4 only)
SHARP = {"initializer_range": 0.06}


class Case(NamedTuple):
    build: Any  # (folder, **change) -> a saved transformers model: an existing test's builder
    change: dict[str, Any]  # config.json keys away from their defaults and the builder's values
    expected: dict[str, Any]  # ...and the ModelConfig fields our reader must make of them
    shape: dict[str, Any] = {}  # keys that change the weights' shapes: set in both models (with SHARP)
    shape_expected: dict[str, Any] = {}


def builder(module, name: str | None = None):
    """An existing test's make_hf (folder, **change) for one of its configs; its .config(**change) is the
    transformers config alone."""
    named = () if name is None else (name,)

    def build(folder, **change):
        return module.make_hf(*named, folder, **change)
    build.config = lambda **change: module.hf_config(*named, **change)
    return build


def rope(kind: str = "default", **params) -> dict[str, Any]:
    return {"rope_type": kind, **params}


EPS = {"rms_norm_eps": 1e-3}  # (the tiny configs: 1e-6 or the family's 1e-5)
CASES = {
    # Llama 3.1's rotary scaling, every parameter moved (each band of frequencies: kept, blended, divided)
    "llama-llama3": Case(builder(test_hf, "llama-rope-scaling"), dict(
        EPS, rope_scaling=rope("llama3", rope_theta=200.0, factor=3.0, low_freq_factor=0.5, high_freq_factor=3.0,
                               original_max_position_embeddings=48)),
        dict(norm_eps=1e-3, rope_theta=200.0, rope_factor=3.0, rope_low_freq_factor=0.5,
             rope_high_freq_factor=3.0, rope_original_max_seq_len=48)),
    # YaRN on a Llama: bounds, both mscales (their ratio scales cos and sin), untruncated bounds
    "llama-yarn": Case(builder(test_hf, "llama-tied-bias"), dict(
        EPS, rope_scaling=rope("yarn", rope_theta=50.0, factor=3.0, original_max_position_embeddings=48,
                               beta_fast=3.5, beta_slow=0.8, mscale=0.8, mscale_all_dim=1.3, truncate=False)),
        dict(norm_eps=1e-3, rope_theta=50.0, rope_scaling="yarn", rope_factor=3.0, rope_original_max_seq_len=48,
             rope_beta_fast=3.5, rope_beta_slow=0.8, rope_mscale=0.8, rope_mscale_all_dim=1.3, rope_truncate=False)),
    "mistral": Case(builder(test_hf, "mistral-gqa"),
                    dict(EPS, sliding_window=5, rope_parameters=rope(rope_theta=300.0)),
                    dict(norm_eps=1e-3, sliding_window=5, rope_theta=300.0)),
    # Qwen2 and 3 slide only with use_sliding_window, from max_window_layers on (0: every layer)
    "qwen2": Case(builder(test_hf, "qwen2-qkv-bias"), dict(
        EPS, use_sliding_window=True, sliding_window=6, max_window_layers=0, rope_parameters=rope(rope_theta=300.0)),
        dict(norm_eps=1e-3, sliding_window=6, rope_theta=300.0)),
    "qwen3": Case(builder(test_hf, "qwen3-head-dim-qk-norm"), dict(
        EPS, use_sliding_window=True, sliding_window=7, max_window_layers=0, rope_parameters=rope(rope_theta=400.0)),
        dict(norm_eps=1e-3, sliding_window=7, rope_theta=400.0)),
    "phi3": Case(builder(test_hf_families, "phi3"), dict(
        EPS, sliding_window=6, rope_parameters=rope(rope_theta=300.0, partial_rotary_factor=0.5)),
        dict(norm_eps=1e-3, sliding_window=6, rope_theta=300.0, rotary_fraction=0.5)),
    # Gemma 2's window and its layer pattern (a global block every 3rd, not transformers' every 2nd)
    "gemma2-window": Case(builder(test_hf_families, "gemma2"), dict(
        sliding_window=3, layer_types=["sliding_attention", "sliding_attention", "full_attention"]),
        dict(sliding_window=3, global_every=3), shape=dict(num_hidden_layers=3)),
    "gemma3": Case(builder(test_hf_families, "gemma3"), dict(
        EPS, sliding_window=6, sliding_window_pattern=3, query_pre_attn_scalar=40, final_logit_softcapping=7.0,
        rope_parameters={"full_attention": rope("linear", rope_theta=5000.0, factor=3.0),
                         "sliding_attention": rope(rope_theta=300.0)}),
        dict(norm_eps=1e-3, sliding_window=6, global_every=3, attn_scale_dim=40, logit_softcap=7.0,
             rope_theta=5000.0, rope_factor=3.0, rope_local_theta=300.0)),
    "gpt2": Case(builder(test_hf, "gpt2-untied"), dict(layer_norm_epsilon=1e-3), dict(norm_eps=1e-3)),
    "mixtral": Case(builder(test_hf_moe, "mixtral"), dict(
        EPS, num_experts_per_tok=3, sliding_window=5, rope_parameters=rope(rope_theta=300.0)),
        dict(norm_eps=1e-3, moe_top_k=3, sliding_window=5, rope_theta=300.0)),
    # experts in blocks 5 and 8 of 9 (every 3rd, block 2 left dense by mlp_only_layers), renormalised top-3
    "qwen3-moe": Case(builder(test_hf_moe, "qwen3-moe-dense-first"), dict(
        EPS, norm_topk_prob=True, num_experts_per_tok=3, use_sliding_window=True, sliding_window=6,
        rope_parameters=rope(rope_theta=300.0)),
        dict(norm_eps=1e-3, moe_renorm=True, moe_top_k=3, sliding_window=6, rope_theta=300.0),
        shape=dict(num_hidden_layers=9, decoder_sparse_step=3, mlp_only_layers=[2]),
        shape_expected=dict(n_layers=9, moe_first_dense=5, moe_every=3)),
    "olmoe": Case(builder(test_hf_moe, "olmoe"), dict(
        EPS, norm_topk_prob=True, num_experts_per_tok=3, rope_parameters=rope(rope_theta=300.0)),
        dict(norm_eps=1e-3, moe_renorm=True, moe_top_k=3, rope_theta=300.0)),
    # 6 experts in 2 groups of which 1 open (was 3 and 2), top-2, scaled by 0.6, not renormalised
    "deepseek-routing": Case(builder(test_deepseek, "plain-query-groups"), dict(
        EPS, n_group=2, topk_group=1, num_experts_per_tok=2, routed_scaling_factor=0.6, norm_topk_prob=False,
        rope_parameters=rope(rope_theta=300.0)),
        dict(norm_eps=1e-3, moe_groups=2, moe_topk_groups=1, moe_top_k=2, moe_route_scale=0.6, moe_renorm=False,
             rope_theta=300.0),
        shape=dict(first_k_dense_replace=2, n_shared_experts=2),
        shape_expected=dict(moe_first_dense=2, moe_shared_experts=2)),
    # DeepSeek's YaRN: mscale_all_dim also scales the softmax (by its mscale squared)
    "deepseek-yarn": Case(builder(test_deepseek, "query-latent-yarn"), dict(
        rope_parameters=rope("yarn", rope_theta=50.0, factor=3.0, original_max_position_embeddings=48, mscale=0.7,
                             mscale_all_dim=1.4, beta_fast=4.5, beta_slow=0.7, truncate=False)),
        dict(rope_theta=50.0, rope_factor=3.0, rope_original_max_seq_len=48, rope_mscale=0.7,
             rope_mscale_all_dim=1.4, rope_beta_fast=4.5, rope_beta_slow=0.7, rope_truncate=False)),
    # a full block every 3rd (was 2nd), a narrower window, another clamp and gate slope, top-3, YaRN moved
    "gpt-oss": Case(builder(test_gpt_oss), dict(
        EPS, swiglu_alpha=1.2, swiglu_limit=1.5, sliding_window=3, num_experts_per_tok=3,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters=rope("yarn", rope_theta=300.0, factor=3.0, beta_fast=3.0, beta_slow=2.0, truncate=False,
                             original_max_position_embeddings=48)),
        dict(norm_eps=1e-3, swiglu_alpha=1.2, swiglu_limit=1.5, sliding_window=3, global_every=3, moe_top_k=3,
             rope_theta=300.0, rope_factor=3.0, rope_beta_fast=3.0, rope_beta_slow=2.0,
             rope_original_max_seq_len=48)),
    # chunks of 3, a no-rope (and unchunked) block every 3rd with its temperature, no q/k norm, top-2, llama3 rope
    "llama4": Case(builder(test_llama4, "interleaved"), dict(
        EPS, attention_chunk_size=3, no_rope_layer_interval=3, floor_scale=5, attn_scale=0.2, use_qk_norm=False,
        num_experts_per_tok=2,
        rope_parameters=rope("llama3", rope_theta=300.0, factor=4.0, low_freq_factor=0.5, high_freq_factor=2.0,
                             original_max_position_embeddings=8)),
        dict(norm_eps=1e-3, attn_chunk=3, nope_every=3, global_every=3, attn_temperature=0.2,
             attn_temperature_floor=5, qk_l2_norm=False, moe_top_k=2, rope_theta=300.0, rope_scaling="llama3",
             rope_factor=4.0, rope_low_freq_factor=0.5, rope_high_freq_factor=2.0, rope_original_max_seq_len=8),
        shape=dict(moe_layers=[0, 3]), shape_expected=dict(moe_first_dense=0, moe_every=3)),
}


@pytest.fixture
def tokens():
    return torch.randint(0, 128, (2, 23), generator=torch.Generator().manual_seed(1))


def logits(model, tokens) -> torch.Tensor:
    with torch.no_grad():
        out = model(tokens)
    return out.logits if hasattr(out, "logits") else out


def with_field(model: Transformer, field: str, value) -> Transformer:
    """`model`'s weights in a model whose config has `field` = `value`."""
    other = Transformer(dataclasses.replace(model.cfg, **{field: value}))
    other.load_state_dict(model.state_dict())
    return other.eval()


@pytest.mark.parametrize("name", CASES)
def test_fields_off_their_defaults_are_read_and_each_bites(name, tmp_path, tokens):
    case = CASES[name]
    hf = case.build(tmp_path / "hf", **SHARP, **case.shape, **case.change)
    usual = case.build(tmp_path / "usual", **SHARP, **case.shape)  # the same seed: the same weights
    assert hf.state_dict().keys() == usual.state_dict().keys()
    assert all(torch.equal(a, usual.state_dict()[k]) for k, a in hf.state_dict().items())
    ours, ours_usual = ours_from(tmp_path / "hf"), ours_from(tmp_path / "usual")
    wanted = {**case.expected, **case.shape_expected}
    assert {k: getattr(ours.cfg, k) for k in wanted} == wanted
    assert all(getattr(ours_usual.cfg, k) != v for k, v in case.expected.items())  # each one moved

    ref, before = logits(hf, tokens), logits(usual, tokens)
    assert ref.abs().max() > 0.1  # not a comparison of near-zeros
    assert (ref - before).abs().max() > BITES  # the fields change transformers' logits
    assert (logits(ours, tokens) - ref).abs().max() <= TOL
    assert (logits(ours_usual, tokens) - before).abs().max() <= TOL
    # each field on its own: put back to its usual value, our logits miss transformers'
    missed = {field: (logits(with_field(ours, field, getattr(ours_usual.cfg, field)), tokens) - ref).abs().max().item()
              for field in case.expected}
    assert {field: gap for field, gap in missed.items() if gap <= BITES} == {}, missed


def test_gemma3_leaves_the_scores_uncapped_as_transformers_does(tmp_path, tokens):
    """Gemma 3's config holds attn_logit_softcapping, which transformers' Gemma3Attention never
    applies: the import reads it as no cap (it read 0.5 once, 0.09 away from transformers' logits),
    and the export refuses a cap Gemma 3 would drop."""
    from scaletrain.config import ModelConfig
    from scaletrain.errors import ConfigError
    from scaletrain.model.hf_config import hf_family

    capped = test_hf_families.make_hf("gemma3", tmp_path / "capped", **SHARP, attn_logit_softcapping=0.5)
    plain = test_hf_families.make_hf("gemma3", tmp_path / "plain", **SHARP)
    assert torch.equal(logits(capped, tokens), logits(plain, tokens))  # transformers: the key changes nothing
    ours = ours_from(tmp_path / "capped")
    assert ours.cfg.attn_softcap == 0.0
    assert (logits(ours, tokens) - logits(capped, tokens)).abs().max() <= TOL

    gemma3 = dict(position="rope", norm="rmsnorm", norm_unit_offset=True, norm_placement="both", activation="geglu",
                  embed_scale=True, qk_norm=True)
    assert hf_family(ModelConfig(**gemma3)) == "gemma3_text"
    with pytest.raises(ConfigError, match=r"Gemma 3's, whose attention has no soft cap \(transformers leaves its "
                                          r"attn_logit_softcapping unused\): model.attn_softcap=0 or Gemma 2"):
        hf_family(ModelConfig(**gemma3, attn_softcap=5.0))
    assert hf_family(ModelConfig(**{**gemma3, "qk_norm": False}, attn_softcap=5.0)) == "gemma2"


def test_llama4_no_rope_blocks_from_the_interval_alone(tmp_path, tokens):
    """transformers 5 writes no_rope_layers out, which then wins; a config.json with it empty (as
    Meta's published ones) places the no-rope blocks by no_rope_layer_interval alone (3 here, not
    its default 4): read so, and transformers' logits from that very file (a reader taking the
default 4 misses them)."""
    import json

    case = CASES["llama4"]
    case.build(tmp_path, **SHARP, **case.shape, **case.change)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["no_rope_layers"] == [1, 1, 0, 1]  # (what the interval gives: block 2 has no rotary)
    del config["layer_types"]  # (derived from the no-rope blocks too)
    (tmp_path / "config.json").write_text(json.dumps({**config, "no_rope_layers": []}))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    ours = ours_from(tmp_path)
    assert (ours.cfg.nope_every, ours.cfg.global_every) == (3, 3)
    assert (logits(ours, tokens) - logits(hf, tokens)).abs().max() <= TOL
