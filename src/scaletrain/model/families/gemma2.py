"""Gemma 2: embeddings scaled by sqrt(dim), a GeGLU MLP, (1 + w) RMSNorms before and after each
sub-block (model.norm_placement=both), scores scaled by query_pre_attn_scalar, soft-capped scores
and logits, and sliding-window blocks with a global one every n-th (layer_types, or the older
sliding_window_pattern). Gemma 3 (text) is this with q/k norms and a rotary base of its own for
the sliding-window blocks: scaletrain.model.families.gemma3_text."""

from __future__ import annotations

from typing import Any, ClassVar

from scaletrain.model.config import ModelConfig
from scaletrain.model.families._common import (
    GELU_TANH,
    LLAMA_BLOCK,
    ROTARY,
    Reader,
    Refuse,
    RotaryFamily,
    complete,
    positive,
    rope_fields,
    short,
)


class Gemma2(RotaryFamily):
    model_type = "gemma2"
    architecture = "Gemma2ForCausalLM"
    known = ROTARY | {"hidden_activation", "attention_bias", "query_pre_attn_scalar", "sliding_window", "layer_types",
                      "final_logit_softcapping", "attn_logit_softcapping", "use_bidirectional_attention",
                      "cache_implementation"}
    defaults = dict(num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh",
                    max_position_embeddings=8192, rms_norm_eps=1e-6, tie_word_embeddings=True, attention_bias=False,
                    query_pre_attn_scalar=256, sliding_window=4096, final_logit_softcapping=30.0,
                    attn_logit_softcapping=50.0, sliding_window_pattern=2)
    norm_placement = "both"
    # config.json's soft caps -> ours (Gemma 3 has the logits' one only: see there)
    caps: ClassVar[tuple[tuple[str, str], ...]] = (("attn_logit_softcapping", "attn_softcap"),
                                                   ("final_logit_softcapping", "logit_softcap"))
    block = {**LLAMA_BLOCK, "attn_post_norm": "post_attention_layernorm", "mlp_norm": "pre_feedforward_layernorm",
             "mlp_post_norm": "post_feedforward_layernorm"}

    def fields(self, get: Reader, refuse: Refuse, strict: bool) -> dict[str, Any]:
        dim, n_heads, head_dim = get.int("hidden_size"), get.int("num_attention_heads"), get.int("head_dim")
        n_layers, max_len = get.int("num_hidden_layers"), get.int("max_position_embeddings")
        named = "hidden_activation" if get.raw("hidden_activation") else "hidden_act"  # (the older name)
        if get.raw(named) not in GELU_TANH:
            refuse(named, f"is not supported; scaletrain's GeGLU gates by {' or '.join(GELU_TANH)}")
        if get.raw("attention_bias"):
            refuse("attention_bias", "puts biases on the attention projections; scaletrain's Gemma has none")
        if get.raw("use_bidirectional_attention"):
            refuse("use_bidirectional_attention",
                   "lets every token attend to later ones; scaletrain's attention is causal")
        scalar = get.raw("query_pre_attn_scalar")
        if isinstance(scalar, bool) or not isinstance(scalar, int) or scalar <= 0:
            refuse("query_pre_attn_scalar", "should be a positive integer (the scores are divided by its square root)")
            scalar = head_dim
        caps = {}
        for key, ours in self.caps:
            cap = get.raw(key)
            if cap is not None and not positive(cap):
                refuse(key, "should be a positive number or null")
                cap = None
            caps[ours] = float(cap or 0.0)
        types, window, every = _layer_kinds(get, refuse, n_layers)
        out = dict(
            vocab_size=get.int("vocab_size"), dim=dim, n_layers=n_layers, n_heads=n_heads,
            n_kv_heads=get.int("num_key_value_heads"), head_dim=0 if head_dim * n_heads == dim else head_dim,
            ffn_dim=get.int("intermediate_size"), norm="rmsnorm", norm_eps=get.float("rms_norm_eps"),
            norm_unit_offset=True, norm_placement="both", activation="geglu", embed_scale=True, position="rope",
            max_seq_len=max_len, tie_embeddings=get.bool("tie_word_embeddings"), bias=False,
            qk_norm=self.qk_norm, sliding_window=window, global_every=every,
            attn_scale_dim=0 if scalar == head_dim else scalar, **caps)
        if out["n_kv_heads"] == n_heads:
            out["n_kv_heads"] = 0
        local_theta = self.rotary(get, refuse, out, max_len)
        if local_theta is not None and not every and types and types[0] == "sliding_attention":
            out["rope_theta"] = float(local_theta)  # every block slides: the local base is the only one
            out["rope_scaling"], out["rope_factor"] = "none", 1.0
        elif local_theta is not None and every:
            out["rope_local_theta"] = float(local_theta)
        return complete(out)

    def rotary(self, get: Reader, refuse: Refuse, out: dict[str, Any], max_len: int) -> float | None:
        """Put the rotary fields into `out`; return the sliding-window blocks' own base (None: the same)."""
        out.update(rope_fields(get, refuse, max_len))
        return None

    def hf_extra(self, cfg: ModelConfig, out: dict[str, Any]) -> None:
        out.update(hidden_activation="gelu_pytorch_tanh", attention_bias=False,
                   query_pre_attn_scalar=cfg.attn_scale_dim or cfg.head_size,
                   attn_logit_softcapping=cfg.attn_softcap or None, final_logit_softcapping=cfg.logit_softcap or None,
                   sliding_window=cfg.sliding_window or None, use_bidirectional_attention=False,
                   layer_types=["sliding_attention" if cfg.is_local_block(i) or (cfg.sliding_window and not
                                                                                cfg.global_every) else "full_attention"
                                for i in range(cfg.n_layers)])
        del out["hidden_act"]


def _layer_kinds(get: Reader, refuse: Refuse, n_layers: int) -> tuple[list, int, int]:
    """Which blocks slide: layer_types, or (configs without it) every block but each pattern-th;
    (the kinds, the window (0: none), every how many blocks one is global (0: none))."""
    pattern = get.raw("sliding_window_pattern")
    types = get.raw("layer_types")
    if not isinstance(types, list):
        ok = isinstance(pattern, int) and not isinstance(pattern, bool) and pattern > 0
        types = ["sliding_attention" if ok and (i + 1) % pattern else "full_attention" for i in range(n_layers)]
    window = get.raw("sliding_window")
    slides = "sliding_attention" in types and isinstance(window, int) and not isinstance(window, bool) and window > 0
    every = 0
    if slides and "full_attention" in types:
        every = types.index("full_attention") + 1
        if types != ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(n_layers)]:
            refuse("layer_types", f"has its global blocks where model.global_every (every n-th block global) cannot "
                                  f"put them: {short(types)}")
    return types, window if slides else 0, every


def chosen(cfg: ModelConfig, no) -> str:
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
    if (cfg.qk_norm or cfg.rope_local_theta) and cfg.attn_softcap:
        raise no("q/k norms and a rotary base of the sliding-window blocks are Gemma 3's, whose attention has no "
                 "soft cap (transformers leaves its attn_logit_softcapping unused): model.attn_softcap=0 or Gemma 2")
    if cfg.qk_norm or cfg.rope_local_theta:
        return "gemma3_text"
    return FAMILY.model_type


FAMILY = Gemma2()
