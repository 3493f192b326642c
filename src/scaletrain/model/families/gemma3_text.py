"""Gemma 3 (text): Gemma 2 (scaletrain.model.families.gemma2) with an RMSNorm on each head's
queries and keys, and a rotary base of its own for the sliding-window blocks
(rope_local_base_freq; in transformers 5 one set of rotary parameters per kind of block), and no
soft cap on the attention scores (attn_logit_softcapping is in its config, unused by transformers)."""

from __future__ import annotations

from typing import Any

from scaletrain.model.config import ModelConfig
from scaletrain.model.families._common import Reader, Refuse, positive, rope_fields, short
from scaletrain.model.families.gemma2 import Gemma2


class Gemma3Text(Gemma2):
    model_type = "gemma3_text"
    architecture = "Gemma3ForCausalLM"
    known = Gemma2.known | {"rope_local_base_freq", "sliding_window_pattern", "_sliding_window_pattern"}
    defaults = dict(num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh",
                    max_position_embeddings=131072, rms_norm_eps=1e-6, tie_word_embeddings=True,
                    attention_bias=False, query_pre_attn_scalar=256, sliding_window=4096,
                    final_logit_softcapping=None, attn_logit_softcapping=None, rope_theta=1000000.0,
                    rope_local_base_freq=10000.0, sliding_window_pattern=6)
    qk_norm = True
    # transformers' Gemma3Attention keeps attn_logit_softcapping but never hands it to the attention (Gemma 3
    # put q/k norms where Gemma 2 capped the scores): a value there changes no logit, and is read as none
    caps = (("final_logit_softcapping", "logit_softcap"),)

    def rotary(self, get: Reader, refuse: Refuse, out: dict[str, Any], max_len: int) -> float | None:
        params = get.raw("rope_parameters")
        if not (isinstance(params, dict) and "full_attention" in params):
            out.update(rope_fields(get, refuse, max_len))
            return _base(get.raw("rope_local_base_freq"), refuse, "rope_local_base_freq", "")
        # transformers 5: one set of rotary parameters per kind of block
        glob, local = params.get("full_attention") or {}, params.get("sliding_attention") or {}
        out.update(rope_fields(Reader({"rope_parameters": glob}, {"rope_theta": 1000000.0}, get.where), refuse,
                               max_len))
        local_kind = local.get("rope_type", local.get("type", "default")) if isinstance(local, dict) else None
        if local_kind != "default" or set(local) - {"rope_type", "type", "rope_theta"}:  # (not a dict: kind None)
            refuse("rope_parameters", f"scales the sliding-window blocks' rotary ({short(local)}); scaletrain "
                                      "scales the global blocks' only")
            return None
        return _base(local.get("rope_theta", 10000.0), refuse, "rope_parameters",
                     "has sliding_attention's rope_theta=")

    def hf_extra(self, cfg: ModelConfig, out: dict[str, Any]) -> None:
        super().hf_extra(cfg, out)
        rope = out["rope_parameters"]
        local = {"rope_type": "default", "rope_theta": cfg.rope_local_theta or cfg.rope_theta}
        if not cfg.rope_local_theta and cfg.rope_scaling != "none":
            local = rope  # every block alike
        out.update(rope_parameters={"full_attention": rope, "sliding_attention": local}, rope_scaling=None)
        del out["rope_theta"]


def _base(theta: Any, refuse: Refuse, key: str, said: str) -> float | None:
    """`theta`, the sliding-window blocks' rotary base, if a positive number (None: the global blocks' own)."""
    if theta is None:
        return None
    if not positive(theta):
        said = f"{said}{short(theta)}, which " if said else ""
        refuse(key, f"{said}should be a positive number, the sliding-window blocks' rotary base")
        return None
    return float(theta)


FAMILY = Gemma3Text()
