"""Which Hugging Face family an export picks (model/families/_choose.py and each family's `chosen`),
and the line it refuses with when none computes the model: each option that sends a model to a family
or away from it, one at a time, from a model the import made of a family test's tiny config (so that
every other field is that family's). Each refusal names the nearest family and what it lacks; the lines
below were read when written. The families the tiny configs themselves export to:
test_config_round_trip.py."""

from __future__ import annotations

import pytest

from scaletrain.errors import ConfigError
from scaletrain.model.config import ModelConfig
from scaletrain.model.hf_config import hf_family, model_config_from_hf
from test_config_round_trip import CONFIGS


def model(base: str, change: dict) -> ModelConfig:
    return ModelConfig(**{**model_config_from_hf(CONFIGS[base]().to_dict()), **change})


# (a tiny config's model, fields changed) -> the family it exports as
CHOSEN = [
    ("llama-rope-scaling", {"attn_chunk": 8}, "llama4_text"),
    ("llama-rope-scaling", {"nope_every": 2}, "llama4_text"),
    ("llama-rope-scaling", {"qk_l2_norm": True}, "llama4_text"),
    ("qwen2-qkv-bias", {"bias": True}, "llama"),
    ("mistral-gqa", {}, "mistral"),
    ("llama-tied-bias", {}, "llama"),
    ("qwen3-moe-step", {}, "qwen3_moe"),
    ("gemma3", {"attn_softcap": 0.0}, "gemma3_text"),
    ("neox-parallel", {"activation": "gelu_exact"}, "gpt_neox"),
    ("qwen3_next:dense", {}, "qwen3_next"),
]


@pytest.mark.parametrize("base,change,family", CHOSEN)
def test_a_model_exports_as_the_family_that_computes_it(base, change, family):
    assert hf_family(model(base, change)) == family


# (a tiny config's model, each of several changes on its own) -> the refusal, after "this model has no
# Hugging Face family: "
REFUSED = [
    ("deepseek:plain-query-groups",
     [{"attn_sinks": True}, {"activation": "swiglu_clamped"}],
     "it has DeepSeek-V3's latent attention (model.mla_kv_rank) and gpt-oss's sinks, expert biases or clamped "
     "SwiGLU (model.attn_sinks, moe_bias, activation=swiglu_clamped), each of a family of its own"),
    ("gpt_oss:alternating",
     [{"attn_chunk": 4, "nope_every": 2, "global_every": 2}, {"moe_scale_input": True}],
     "it has gpt-oss's sinks, expert biases or clamped SwiGLU (model.attn_sinks, moe_bias, "
     "activation=swiglu_clamped) and Llama 4's chunks, no-rope blocks, weightless q/k norm or input-scaled "
     "experts (model.attn_chunk, nope_every, qk_l2_norm, moe_scale_input), each of a family of its own"),
    ("llama4:interleaved",
     [{"attn_gate": True}, {"linear_heads": 2}],
     "it has Llama 4's chunks, no-rope blocks, weightless q/k norm or input-scaled experts (model.attn_chunk, "
     "nope_every, qk_l2_norm, moe_scale_input) and Qwen3-Next's linear attention, output gate or gated shared "
     "expert (model.linear_heads, attn_gate, moe_shared_gate), each of a family of its own"),
    ("qwen3_next:moe-grouped-values",
     [{"moe_bias": True}],
     "it has gpt-oss's sinks, expert biases or clamped SwiGLU (model.attn_sinks, moe_bias, "
     "activation=swiglu_clamped) and Qwen3-Next's linear attention, output gate or gated shared expert "
     "(model.linear_heads, attn_gate, moe_shared_gate), each of a family of its own"),
    ("qwen3_next:moe-grouped-values",
     [{"qk_l2_norm": True}],
     "it has Llama 4's chunks, no-rope blocks, weightless q/k norm or input-scaled experts (model.attn_chunk, "
     "nope_every, qk_l2_norm, moe_scale_input) and Qwen3-Next's linear attention, output gate or gated shared "
     "expert (model.linear_heads, attn_gate, moe_shared_gate), each of a family of its own"),
    ("gpt_oss:alternating",
     [{"moe_shared_gate": True, "moe_shared_experts": 1}],
     "it has gpt-oss's sinks, expert biases or clamped SwiGLU (model.attn_sinks, moe_bias, "
     "activation=swiglu_clamped) and Qwen3-Next's linear attention, output gate or gated shared expert "
     "(model.linear_heads, attn_gate, moe_shared_gate), each of a family of its own"),
    ("deepseek:plain-query-groups",
     [{"attn_chunk": 8}],
     "it has DeepSeek-V3's latent attention (model.mla_kv_rank) and Llama 4's chunks, no-rope blocks, weightless "
     "q/k norm or input-scaled experts (model.attn_chunk, nope_every, qk_l2_norm, moe_scale_input), each of a "
     "family of its own"),
    ("mixtral",
     [{"moe_bias": True}],
     "attention sinks, expert biases and the clamped SwiGLU are gpt-oss's, which is rope, rmsnorm with norms "
     "before the sub-blocks and the clamped SwiGLU (model.activation=swiglu_clamped)"),
    ("llama-rope-scaling",
     [{"activation": "swiglu_clamped"}],
     "attention sinks, expert biases and the clamped SwiGLU are gpt-oss's, which has attention sinks "
     "(model.attn_sinks=true)"),
    ("llama-rope-scaling",
     [{"attn_sinks": True}],
     "attention sinks, expert biases and the clamped SwiGLU are gpt-oss's, which is rope, rmsnorm with norms "
     "before the sub-blocks and the clamped SwiGLU (model.activation=swiglu_clamped)"),
    ("mixtral",
     [{"moe_scale_input": True}],
     "Llama 4 has no weighted q/k norm (model.qk_norm), sliding window nor soft-capping"),
    ("llama-rope-scaling",
     [{"attn_gate": True}],
     "linear attention and the gated full attention are Qwen3-Next's, which is rope, zero-centred rmsnorm "
     "(model.norm_unit_offset), swiglu with norms before the sub-blocks"),
    ("mixtral",
     [{"moe_shared_gate": True, "moe_shared_experts": 1}],
     "linear attention and the gated full attention are Qwen3-Next's, which is rope, zero-centred rmsnorm "
     "(model.norm_unit_offset), swiglu with norms before the sub-blocks"),
    ("gpt2-tied",
     [{"n_kv_heads": 2}, {"head_dim": 32}],
     "GPT-2 has neither grouped-query attention nor a head_dim apart from dim / n_heads"),
    ("gpt2-tied",
     [{"qk_norm": True}],
     "GPT-2 has no q/k norms (model.qk_norm)"),
    ("gpt2-tied",
     [{"sliding_window": 8}],
     "GPT-2 has no sliding window (model.sliding_window)"),
    ("gpt2-tied",
     [{"norm": "rmsnorm"}],
     "position=learned, norm=rmsnorm, activation=gelu; GPT-2 is learned, layernorm, gelu, Llama-likes are rope, "
     "rmsnorm, swiglu and GPT-NeoX is rope, layernorm with biases (model.bias=true)"),
    ("gpt2-tied",
     [{"activation": "swiglu"}],
     "position=learned, norm=layernorm, activation=swiglu; GPT-2 is learned, layernorm, gelu, Llama-likes are "
     "rope, rmsnorm, swiglu and GPT-NeoX is rope, layernorm with biases (model.bias=true)"),
    ("llama-rope-scaling",
     [{"position": "learned"}],
     "position=learned, norm=rmsnorm, activation=swiglu; GPT-2 is learned, layernorm, gelu, Llama-likes are "
     "rope, rmsnorm, swiglu and GPT-NeoX is rope, layernorm with biases (model.bias=true)"),
    ("llama-rope-scaling",
     [{"norm": "layernorm"}],
     "position=rope, norm=layernorm, activation=swiglu; GPT-2 is learned, layernorm, gelu, Llama-likes are rope, "
     "rmsnorm, swiglu and GPT-NeoX is rope, layernorm with biases (model.bias=true)"),
    ("llama-rope-scaling",
     [{"activation": "gelu"}],
     "position=rope, norm=rmsnorm, activation=gelu; GPT-2 is learned, layernorm, gelu, Llama-likes are rope, "
     "rmsnorm, swiglu and GPT-NeoX is rope, layernorm with biases (model.bias=true)"),
    ("llama-rope-scaling",
     [{"qk_norm": True, "qk_norm_scope": "projection"}],
     "q/k norms over the whole projections (model.qk_norm_scope=projection) are exported for OLMoE, a mixture of "
     "experts, only"),
    ("qwen3-head-dim-qk-norm",
     [{"bias": True}, {"qkv_bias": True}],
     "Qwen3 (q/k norms) has no q/k/v-only nor MLP biases (model.qkv_bias, model.bias)"),
    ("llama-tied-bias",
     [{"sliding_window": 8}],
     "Llama (biases everywhere) has no sliding window (model.sliding_window)"),
    ("mixtral",
     [{"moe_shared_experts": 1}],
     "Mixtral, Qwen3-MoE and OLMoE have no shared experts (model.moe_shared_experts)"),
    ("mixtral",
     [{"moe_score": "sigmoid"}],
     "Mixtral, Qwen3-MoE and OLMoE have no sigmoid scores (model.moe_score)"),
    ("mixtral",
     [{"moe_route_scale": 2.0}],
     "Mixtral, Qwen3-MoE and OLMoE have no routed scale (model.moe_route_scale)"),
    ("mixtral",
     [{"moe_capacity_factor": 1.25}],
     "Mixtral, Qwen3-MoE and OLMoE have no expert capacity (model.moe_capacity_factor): they are dropless"),
    ("mixtral",
     [{"bias": True}, {"qkv_bias": True}],
     "Mixtral, Qwen3-MoE and OLMoE have no biases (model.bias, model.qkv_bias)"),
    ("mixtral",
     [{"moe_renorm": False}, {"moe_first_dense": 1}],
     "Mixtral (no q/k norms) has experts in every block and rescales the chosen experts' weights to sum to 1 "
     "(model.moe_renorm=true)"),
    ("olmoe",
     [{"moe_first_dense": 1}, {"sliding_window": 8}, {"head_dim": 24}],
     "OLMoE (q/k norms over the whole projections) has experts in every block, no sliding window and head_dim = "
     "dim / n_heads"),
    ("olmo2",
     [{"qk_norm": False, "qk_norm_scope": "head"}, {"qk_norm_scope": "head"}, {"rotary_fraction": 0.5},
      {"head_dim": 24}, {"bias": True}, {"qkv_bias": True}, {"sliding_window": 8}, {"activation": "geglu"},
      {"norm_unit_offset": True}, {"embed_scale": True}, {"parallel_residual": True}],
     "norms after the sub-blocks (model.norm_placement=post) are OLMo 2's, which is rope, rmsnorm, swiglu with "
     "q/k norms over the whole projections (qk_norm_scope=projection), full rotary, head_dim = dim / n_heads, no "
     "biases, window, experts, embed_scale nor norm_unit_offset"),
    ("llama-rope-scaling",
     [{"attn_softcap": 5.0}],
     "model.attn_softcap is Gemma's, which also has norms before and after each sub-block "
     "(model.norm_placement=both)"),
    ("llama-rope-scaling",
     [{"logit_softcap": 5.0}],
     "model.logit_softcap is Gemma's, which also has norms before and after each sub-block "
     "(model.norm_placement=both)"),
    ("llama-rope-scaling",
     [{"attn_scale_dim": 8}],
     "model.attn_scale_dim is Gemma's, which also has norms before and after each sub-block "
     "(model.norm_placement=both)"),
    ("llama-rope-scaling",
     [{"global_every": 2, "sliding_window": 8}, {"rope_local_theta": 100.0, "global_every": 2, "sliding_window": 8}],
     "model.global_every is Gemma's, which also has norms before and after each sub-block "
     "(model.norm_placement=both)"),
    ("llama-rope-scaling",
     [{"parallel_residual": True}, {"activation": "gelu_exact"}],
     "no family computes this combination of model.norm_placement, norm_unit_offset, parallel_residual, "
     "embed_scale, rotary_fraction and activation"),
    ("gpt2-tied",
     [{"norm_unit_offset": True}],
     "no family computes this combination of model.norm_placement, norm_unit_offset, parallel_residual, "
     "embed_scale, rotary_fraction and activation"),
    ("gemma2",
     [{"position": "learned"}, {"norm": "layernorm"}, {"norm_unit_offset": False}, {"activation": "swiglu"},
      {"embed_scale": False}],
     "norms before and after each sub-block are Gemma's, which is rope, rmsnorm with the (1 + w) weight, geglu "
     "and scaled embeddings"),
    ("gemma2",
     [{"bias": True}, {"qkv_bias": True}, {"parallel_residual": True}, {"rotary_fraction": 0.5}],
     "norms before and after each sub-block are Gemma's, which has no biases, experts, parallel residual nor "
     "partial rotary"),
    ("gemma2",
     [{"qk_norm": True, "qk_norm_scope": "projection"}],
     "norms before and after each sub-block are Gemma's, which has q/k norms of each head only"),
    ("gemma2",
     [{"qk_norm": True}, {"rope_local_theta": 100.0, "global_every": 2}],
     "q/k norms and a rotary base of the sliding-window blocks are Gemma 3's, whose attention has no soft cap "
     "(transformers leaves its attn_logit_softcapping unused): model.attn_softcap=0 or Gemma 2"),
    ("llama-rope-scaling",
     [{"rotary_fraction": 0.5}],
     "a share of each head rotated (model.rotary_fraction=0.5) is Phi-3's, which scales rope by longrope only, "
     "which scaletrain lacks (model.rope_scaling=none)"),
    ("llama-tied-bias",
     [{"rotary_fraction": 0.5}],
     "a share of each head rotated (model.rotary_fraction=0.5) is Phi-3's, which has no biases, q/k norms nor "
     "experts"),
    ("llama-rope-scaling",
     [{"rotary_fraction": 0.5, "head_dim": 24}],
     "a share of each head rotated (model.rotary_fraction=0.5) is Phi-3's, which has no head_dim apart from dim "
     "/ n_heads"),
    ("phi3",
     [{"export_as": "phi3", "activation": "gelu"}, {"export_as": "phi3", "position": "learned"},
      {"export_as": "phi3", "norm": "layernorm"}],
     "model.export_as=phi3, but Phi-3 is rope, rmsnorm, swiglu"),
    ("phi3",
     [{"export_as": "phi3", "norm_placement": "post"}],
     "norms after the sub-blocks (model.norm_placement=post) are OLMo 2's, which is rope, rmsnorm, swiglu with "
     "q/k norms over the whole projections (qk_norm_scope=projection), full rotary, head_dim = dim / n_heads, no "
     "biases, window, experts, embed_scale nor norm_unit_offset"),
    ("phi3",
     [{"export_as": "phi3", "activation": "geglu"}, {"export_as": "phi3", "parallel_residual": True},
      {"export_as": "phi3", "embed_scale": True}, {"export_as": "phi3", "norm_unit_offset": True}],
     "no family computes this combination of model.norm_placement, norm_unit_offset, parallel_residual, "
     "embed_scale, rotary_fraction and activation"),
    ("phi3",
     [{"export_as": "phi3", "bias": True}, {"export_as": "phi3", "qkv_bias": True},
      {"export_as": "phi3", "qk_norm": True}, {"export_as": "phi3", "moe_experts": 4}],
     "model.export_as=phi3, but Phi-3 has no biases, q/k norms nor experts"),
    ("phi3",
     [{"export_as": "phi3", "head_dim": 24}],
     "model.export_as=phi3, but Phi-3 has no head_dim apart from dim / n_heads"),
    ("phi3",
     [{"export_as": "phi3", "rope_scaling": "linear", "rope_factor": 2.0}],
     "model.export_as=phi3, but Phi-3 scales rope by longrope only, which scaletrain lacks "
     "(model.rope_scaling=none)"),
    ("neox-parallel",
     [{"bias": False}],
     "rope with layernorm is GPT-NeoX's, which needs biases on every linear layer and LayerNorm "
     "(model.bias=true)"),
    ("neox-parallel",
     [{"activation": "swiglu"}],
     "rope with layernorm is GPT-NeoX's, which needs activation gelu or gelu_exact, not swiglu"),
    ("neox-parallel",
     [{"n_kv_heads": 2}, {"head_dim": 24}],
     "rope with layernorm is GPT-NeoX's, which needs one K/V head per query head and head_dim = dim / n_heads"),
    ("neox-parallel",
     [{"qk_norm": True}, {"qkv_bias": True}, {"sliding_window": 8}, {"moe_experts": 4}, {"embed_scale": True},
      {"norm_unit_offset": True}],
     "rope with layernorm is GPT-NeoX's, which needs no q/k norms, q/k/v-only biases, sliding window, experts, "
     "embed_scale nor norm_unit_offset"),
    ("neox-parallel",
     [{"rope_scaling": "linear", "rope_factor": 2.0}],
     "rope with layernorm is GPT-NeoX's, which needs no rope scaling (model.rope_scaling=none)"),
    ("deepseek:plain-query-groups",
     [{"norm_placement": "post"}, {"activation": "geglu"}],
     "latent attention (model.mla_kv_rank) is DeepSeek-V3's, which is rope, rmsnorm, swiglu with norms before "
     "the sub-blocks"),
    ("deepseek:plain-query-groups",
     [{"parallel_residual": True}, {"embed_scale": True}, {"norm_unit_offset": True}, {"logit_softcap": 5.0}],
     "latent attention (model.mla_kv_rank) is DeepSeek-V3's, which has no parallel residual, embed_scale, "
     "norm_unit_offset nor soft caps"),
    ("deepseek:plain-query-groups",
     [{"moe_score": "softmax"}],
     "latent attention (model.mla_kv_rank) is DeepSeek-V3's, which routes by sigmoid scores "
     "(model.moe_score=sigmoid)"),
    ("deepseek:plain-query-groups",
     [{"moe_every": 2}],
     "latent attention (model.mla_kv_rank) is DeepSeek-V3's, which has experts in every block after the first "
     "dense ones (model.moe_every=1)"),
    ("deepseek:plain-query-groups",
     [{"moe_capacity_factor": 1.25}],
     "latent attention (model.mla_kv_rank) is DeepSeek-V3's, which has no expert capacity "
     "(model.moe_capacity_factor): it is dropless"),
    ("gpt_oss:alternating",
     [{"activation": "swiglu"}, {"norm_placement": "post"}, {"norm_unit_offset": True}],
     "attention sinks, expert biases and the clamped SwiGLU are gpt-oss's, which is rope, rmsnorm with norms "
     "before the sub-blocks and the clamped SwiGLU (model.activation=swiglu_clamped)"),
    ("gpt_oss:alternating",
     [{"attn_sinks": False}],
     "attention sinks, expert biases and the clamped SwiGLU are gpt-oss's, which has attention sinks "
     "(model.attn_sinks=true)"),
    ("gpt_oss:alternating",
     [{"moe_bias": False}, {"moe_first_dense": 1}],
     "attention sinks, expert biases and the clamped SwiGLU are gpt-oss's, which has experts with biases in "
     "every block (model.moe_bias=true)"),
    ("gpt_oss:alternating",
     [{"moe_score": "sigmoid"}, {"moe_renorm": False}, {"moe_shared_experts": 1}, {"moe_route_scale": 2.0},
      {"moe_capacity_factor": 1.25}],
     "attention sinks, expert biases and the clamped SwiGLU are gpt-oss's, which routes by a renormalised "
     "softmax (model.moe_renorm=true) without shared experts, scale nor capacity"),
    ("gpt_oss:alternating",
     [{"qk_norm": True}, {"attn_softcap": 5.0}, {"logit_softcap": 5.0}, {"rotary_fraction": 0.5}, {"qkv_bias": True},
      {"attn_scale_dim": 8}, {"rope_local_theta": 100.0}, {"embed_scale": True}, {"parallel_residual": True}],
     "attention sinks, expert biases and the clamped SwiGLU are gpt-oss's, which has no q/k norms, soft-caps, "
     "partial rotary nor q/k/v-only biases"),
    ("llama4:interleaved",
     [{"norm_placement": "post"}, {"bias": True}, {"qkv_bias": True}],
     "Llama 4 is rope, rmsnorm, swiglu with norms before the sub-blocks and no biases"),
    ("llama4:interleaved",
     [{"qk_norm": True}, {"sliding_window": 8}, {"attn_softcap": 5.0}, {"logit_softcap": 5.0}, {"attn_scale_dim": 8}],
     "Llama 4 has no weighted q/k norm (model.qk_norm), sliding window nor soft-capping"),
    ("llama4:interleaved",
     [{"global_every": 0}],
     "Llama 4 chunks exactly the rotary blocks (model.global_every = nope_every with attn_chunk)"),
    ("llama4:interleaved",
     [{"embed_scale": True}, {"norm_unit_offset": True}, {"parallel_residual": True}, {"rotary_fraction": 0.5},
      {"rope_local_theta": 100.0}],
     "Llama 4 has none of Gemma's and GPT-NeoX's options (embed_scale, norm_unit_offset, parallel_residual, "
     "rotary_fraction, rope_local_theta)"),
    ("llama4:interleaved",
     [{"moe_score": "softmax"}, {"moe_scale_input": False, "qk_l2_norm": True}, {"moe_renorm": True},
      {"moe_shared_experts": 2}, {"moe_route_scale": 2.0}, {"moe_capacity_factor": 1.25}],
     "Llama 4 routes by a sigmoid scaling the experts' input, one shared expert as wide, dropless, no rescaling"),
    ("qwen3_next:moe-grouped-values",
     [{"norm_unit_offset": False}, {"norm_placement": "post"}],
     "linear attention and the gated full attention are Qwen3-Next's, which is rope, zero-centred rmsnorm "
     "(model.norm_unit_offset), swiglu with norms before the sub-blocks"),
    ("qwen3_next:moe-grouped-values",
     [{"attn_gate": False}, {"qk_norm": False}, {"qk_norm_scope": "projection"}],
     "linear attention and the gated full attention are Qwen3-Next's, which gates its full attention's output "
     "(model.attn_gate) and has q/k norms of each head"),
    ("qwen3_next:moe-grouped-values",
     [{"bias": True}, {"qkv_bias": True}, {"sliding_window": 8}, {"attn_softcap": 5.0}, {"logit_softcap": 5.0},
      {"attn_scale_dim": 8}, {"global_every": 2}, {"embed_scale": True}, {"parallel_residual": True}],
     "linear attention and the gated full attention are Qwen3-Next's, which has no biases, window, soft caps, "
     "sinks nor Gemma's options"),
    ("qwen3_next:moe-grouped-values",
     [{"moe_score": "sigmoid"}, {"moe_shared_experts": 2}, {"moe_shared_gate": False}, {"moe_route_scale": 2.0},
      {"moe_capacity_factor": 1.25}],
     "linear attention and the gated full attention are Qwen3-Next's, which routes by a softmax to experts with "
     "one gated shared expert (model.moe_shared_experts=1, moe_shared_gate), dropless, no routed scale"),
]


@pytest.mark.parametrize("base,change,line", [(b, c, line) for b, changes, line in REFUSED for c in changes])
def test_a_model_no_family_computes_is_refused_with_the_nearest_family_and_what_it_lacks(base, change, line):
    with pytest.raises(ConfigError) as e:
        hf_family(model(base, change))
    assert str(e.value) == f"this model has no Hugging Face family: {line}"
