"""Which family computes a given model, for export (`choose`): GPT-2 for learned positions, a
Llama-like by its biases, q/k norms and window, a mixture of experts by its router and q/k norms,
and the families with options GPT-2 and the Llama-likes lack (OLMo 2, GPT-NeoX, Phi-3, Gemma 2
and 3) by those options. Each refusal says what the nearest family lacks."""

from __future__ import annotations

from scaletrain.errors import ConfigError
from scaletrain.model.config import ModelConfig
from scaletrain.model.families import deepseek_v3, gemma2, gpt_neox, gpt_oss, llama4_text, phi3, qwen3_next


def _no(why: str) -> ConfigError:
    return ConfigError(f"this model has no Hugging Face family: {why}")


def choose(cfg: ModelConfig) -> str:
    """The Hugging Face model_type that computes what `cfg` computes, or ConfigError."""
    no = _no
    own = [name for name, parts in (
        ("DeepSeek-V3's latent attention (model.mla_kv_rank)", cfg.mla_kv_rank),
        ("gpt-oss's sinks, expert biases or clamped SwiGLU (model.attn_sinks, moe_bias, activation=swiglu_clamped)",
         cfg.attn_sinks or cfg.moe_bias or cfg.activation == "swiglu_clamped"),
        ("Llama 4's chunks, no-rope blocks, weightless q/k norm or input-scaled experts (model.attn_chunk, "
         "nope_every, qk_l2_norm, moe_scale_input)",  # (attn_temperature: nope_every)
         cfg.attn_chunk or cfg.nope_every or cfg.qk_l2_norm or cfg.moe_scale_input),
        ("Qwen3-Next's linear attention, output gate or gated shared expert (model.linear_heads, attn_gate, "
         "moe_shared_gate)", cfg.linear_heads or cfg.attn_gate or cfg.moe_shared_gate)) if parts]
    if len(own) > 1:
        raise no(f"it has {own[0]} and {own[1]}, each of a family of its own")
    if cfg.mla_kv_rank:
        return deepseek_v3.FAMILY.chosen(cfg, no)
    if cfg.attn_sinks or cfg.moe_bias or cfg.activation == "swiglu_clamped":
        return gpt_oss.chosen(cfg, no)
    if cfg.attn_chunk or cfg.nope_every or cfg.qk_l2_norm or cfg.moe_scale_input:
        return llama4_text.FAMILY.chosen(cfg, no)
    if cfg.linear_heads or cfg.attn_gate or cfg.moe_shared_gate:
        return qwen3_next.FAMILY.chosen(cfg, no)
    if uses_newer_options(cfg):
        return newer_family(cfg, no)
    if cfg.export_as == phi3.FAMILY.export_as:
        return phi3.FAMILY.chosen(cfg, no)
    if cfg.position == "learned" and cfg.norm == "layernorm" and cfg.activation == "gelu":
        if cfg.kv_heads != cfg.n_heads or cfg.head_size * cfg.n_heads != cfg.dim:
            raise no("GPT-2 has neither grouped-query attention nor a head_dim apart from dim / n_heads")
        if cfg.qk_norm:
            raise no("GPT-2 has no q/k norms (model.qk_norm)")
        if cfg.sliding_window:
            raise no("GPT-2 has no sliding window (model.sliding_window)")
        return "gpt2"
    if not (cfg.position == "rope" and cfg.norm == "rmsnorm" and cfg.activation == "swiglu"):
        raise no(f"position={cfg.position}, norm={cfg.norm}, activation={cfg.activation}; GPT-2 is learned, "
                 "layernorm, gelu, Llama-likes are rope, rmsnorm, swiglu and GPT-NeoX is rope, layernorm with "
                 "biases (model.bias=true)")
    if cfg.moe_experts:
        return _moe_family(cfg, no)
    if cfg.qk_norm and cfg.qk_norm_scope != "head":
        raise no("q/k norms over the whole projections (model.qk_norm_scope=projection) are exported for OLMoE, "
                 "a mixture of experts, only")
    if cfg.qk_norm:
        if cfg.bias or cfg.qkv_bias:
            raise no("Qwen3 (q/k norms) has no q/k/v-only nor MLP biases (model.qkv_bias, model.bias)")
        return "qwen3"
    if cfg.qkv_bias and not cfg.bias:
        return "qwen2"
    if cfg.bias:
        if cfg.sliding_window:
            raise no("Llama (biases everywhere) has no sliding window (model.sliding_window)")
        return "llama"
    return "mistral" if cfg.sliding_window else "llama"


def _moe_family(cfg: ModelConfig, no) -> str:
    """Mixtral, Qwen3-MoE or OLMoE, whichever computes what the mixture of experts `cfg` computes."""
    unlike = [why for why, differs in (
        ("shared experts (model.moe_shared_experts)", cfg.moe_shared_experts),
        ("sigmoid scores (model.moe_score)", cfg.moe_score != "softmax"),
        ("routed scale (model.moe_route_scale)", cfg.moe_route_scale != 1.0),
        ("expert capacity (model.moe_capacity_factor): they are dropless", cfg.moe_capacity_factor),
        ("biases (model.bias, model.qkv_bias)", cfg.bias or cfg.qkv_bias)) if differs]
    if unlike:
        raise no(f"Mixtral, Qwen3-MoE and OLMoE have no {unlike[0]}")
    every_block = cfg.moe_blocks == cfg.n_layers
    if cfg.qk_norm and cfg.qk_norm_scope == "head":
        return "qwen3_moe"
    if cfg.qk_norm:
        if not every_block or cfg.sliding_window or cfg.head_size * cfg.n_heads != cfg.dim:
            raise no("OLMoE (q/k norms over the whole projections) has experts in every block, no sliding window "
                     "and head_dim = dim / n_heads")
        return "olmoe"
    if not every_block or not cfg.moe_renorm:
        raise no("Mixtral (no q/k norms) has experts in every block and rescales the chosen experts' weights to "
                 "sum to 1 (model.moe_renorm=true)")
    return "mixtral"


def uses_newer_options(cfg: ModelConfig) -> bool:
    """Whether `cfg` uses an option only these families have (rope with LayerNorm and biases: GPT-NeoX)."""
    return bool(cfg.norm_placement != "pre" or cfg.norm_unit_offset or cfg.parallel_residual or cfg.embed_scale
                or cfg.rotary_fraction != 1.0 or cfg.activation in ("gelu_exact", "geglu")
                or (cfg.position == "rope" and cfg.norm == "layernorm" and cfg.bias) or cfg.attn_softcap
                or cfg.logit_softcap or cfg.attn_scale_dim or cfg.global_every or cfg.rope_local_theta)


def newer_family(cfg: ModelConfig, no) -> str:
    """OLMo 2, GPT-NeoX, Phi-3 or Gemma, whichever computes what `cfg` (with one of the options
    GPT-2 and the Llama-likes lack) computes."""
    llama_like = cfg.position == "rope" and cfg.norm == "rmsnorm" and cfg.activation == "swiglu"
    if llama_like and cfg.norm_placement == "pre" and not (cfg.parallel_residual or cfg.embed_scale
                                                           or cfg.norm_unit_offset or cfg.attn_softcap
                                                           or cfg.logit_softcap or cfg.attn_scale_dim
                                                           or cfg.global_every or cfg.rope_local_theta):
        return phi3.FAMILY.chosen(cfg, no)  # a Llama that rotates part of each head
    if cfg.norm_placement == "both":
        return gemma2.chosen(cfg, no)
    gemma_only = [k for k in ("attn_softcap", "logit_softcap", "attn_scale_dim", "global_every", "rope_local_theta")
                  if getattr(cfg, k)]
    if gemma_only:
        raise no(f"model.{gemma_only[0]} is Gemma's, which also has norms before and after each sub-block "
                 "(model.norm_placement=both)")
    if cfg.norm_placement == "post":
        plain = llama_like and not (cfg.norm_unit_offset or cfg.parallel_residual or cfg.embed_scale or cfg.bias
                                    or cfg.qkv_bias or cfg.sliding_window or cfg.moe_experts)
        if not plain or cfg.rotary_fraction != 1.0 or not cfg.qk_norm or cfg.qk_norm_scope != "projection" \
                or cfg.head_size * cfg.n_heads != cfg.dim:
            raise no("norms after the sub-blocks (model.norm_placement=post) are OLMo 2's, which is rope, rmsnorm, "
                     "swiglu with q/k norms over the whole projections (qk_norm_scope=projection), full rotary, "
                     "head_dim = dim / n_heads, no biases, window, experts, embed_scale nor norm_unit_offset")
        return "olmo2"
    if cfg.position == "rope" and cfg.norm == "layernorm":
        return gpt_neox.FAMILY.chosen(cfg, no)
    raise no("no family computes this combination of model.norm_placement, norm_unit_offset, parallel_residual, "
             "embed_scale, rotary_fraction and activation")
