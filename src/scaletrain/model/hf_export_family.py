"""Which Hugging Face family computes a model that uses the options GPT-2 and the Llama-likes lack
(OLMo 2, GPT-NeoX, Phi-3, Gemma 2 and 3), for export; scaletrain.model.hf_config asks it. `no`
turns a reason into the ConfigError that says the model has no family."""

from __future__ import annotations

from scaletrain.model.config import ModelConfig


def uses_newer_options(cfg: ModelConfig) -> bool:
    """Whether `cfg` uses an option only these families have (rope with LayerNorm and biases: GPT-NeoX)."""
    return bool(cfg.norm_placement != "pre" or cfg.norm_unit_offset or cfg.parallel_residual or cfg.embed_scale
                or cfg.rotary_fraction != 1.0 or cfg.activation in ("gelu_exact", "geglu")
                or (cfg.position == "rope" and cfg.norm == "layernorm" and cfg.bias) or cfg.attn_softcap
                or cfg.logit_softcap or cfg.attn_scale_dim or cfg.global_every or cfg.rope_local_theta)


def phi3_family(cfg: ModelConfig, no) -> str:
    """Phi-3 (and Phi-4), if it computes what `cfg` computes: a Llama with its projections fused."""
    unlike = [why for why, differs in (
        ("is rope, rmsnorm, swiglu with norms before the sub-blocks",
         not (cfg.position == "rope" and cfg.norm == "rmsnorm" and cfg.activation == "swiglu"
              and cfg.norm_placement == "pre")),
        ("has no biases, q/k norms nor experts", cfg.bias or cfg.qkv_bias or cfg.qk_norm or cfg.moe_experts),
        ("has no head_dim apart from dim / n_heads", cfg.head_size * cfg.n_heads != cfg.dim),
        ("scales rope by longrope only, which scaletrain lacks (model.rope_scaling=none)", cfg.rope_scaling != "none"),
        ("has no parallel residual, embed_scale nor norm_unit_offset",
         cfg.parallel_residual or cfg.embed_scale or cfg.norm_unit_offset)) if differs]
    if unlike:
        raise no(f"model.export_as=phi3, but Phi-3 {unlike[0]}")
    return "phi3"


def gemma_family(cfg: ModelConfig, no) -> str:
    """Gemma 2 or Gemma 3 (text), if one computes what `cfg` (norms before and after) computes."""
    unlike = [why for why, differs in (
        ("is rope, rmsnorm with the (1 + w) weight, geglu and scaled embeddings",
         not (cfg.position == "rope" and cfg.norm == "rmsnorm" and cfg.norm_unit_offset and cfg.activation == "geglu"
              and cfg.embed_scale)),
        ("has no biases, experts, parallel residual nor partial rotary",
         cfg.bias or cfg.qkv_bias or cfg.moe_experts or cfg.parallel_residual or cfg.rotary_fraction != 1.0),
        ("has q/k norms of each head only", cfg.qk_norm and cfg.qk_norm_scope != "head")) if differs]
    if unlike:
        raise no(f"norms before and after each sub-block are Gemma's, which {unlike[0]}")
    if cfg.qk_norm or cfg.rope_local_theta:
        return "gemma3_text"
    return "gemma2"


def newer_family(cfg: ModelConfig, no) -> str:
    """OLMo 2, GPT-NeoX or Phi-3, whichever computes what `cfg` (with one of the options GPT-2 and
    the Llama-likes lack) computes."""
    llama_like = cfg.position == "rope" and cfg.norm == "rmsnorm" and cfg.activation == "swiglu"
    if llama_like and cfg.norm_placement == "pre" and not (cfg.parallel_residual or cfg.embed_scale
                                                           or cfg.norm_unit_offset or cfg.attn_softcap
                                                           or cfg.logit_softcap or cfg.attn_scale_dim
                                                           or cfg.global_every or cfg.rope_local_theta):
        return phi3_family(cfg, no)  # a Llama that rotates part of each head
    if cfg.norm_placement == "both":
        return gemma_family(cfg, no)
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
        unlike = [why for why, differs in (
            ("biases on every linear layer and LayerNorm (model.bias=true)", not cfg.bias),
            (f"activation gelu or gelu_exact, not {cfg.activation}", cfg.activation not in ("gelu", "gelu_exact")),
            ("one K/V head per query head and head_dim = dim / n_heads",
             cfg.kv_heads != cfg.n_heads or cfg.head_size * cfg.n_heads != cfg.dim),
            ("no q/k norms, q/k/v-only biases, sliding window, experts, embed_scale nor norm_unit_offset",
             cfg.qk_norm or cfg.qkv_bias or cfg.sliding_window or cfg.moe_experts or cfg.embed_scale
             or cfg.norm_unit_offset), ("no rope scaling (model.rope_scaling=none)", cfg.rope_scaling != "none"))
            if differs]
        if unlike:
            raise no(f"rope with layernorm is GPT-NeoX's, which needs {unlike[0]}")
        return "gpt_neox"
    raise no("no family computes this combination of model.norm_placement, norm_unit_offset, parallel_residual, "
             "embed_scale, rotary_fraction and activation")
