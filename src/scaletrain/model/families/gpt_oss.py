"""gpt-oss (OpenAI, 2025): a mixture of experts in every block whose parts none of the other
families has, each a model option of its own:

* attention sinks (model.attn_sinks): a learned logit per query head in every softmax's
  denominator (`self_attn.sinks`);
* biases on q, k, v and o (attention_bias: model.bias, which puts none elsewhere here: RMSNorm has
  none and every MLP is a mixture);
* sliding-window and full blocks alternating (layer_types: model.sliding_window with
  model.global_every=2, the first block sliding);
* the router with a bias, softmax over the top-k logits (= renormalised top-k of the softmax:
  model.moe_renorm) and experts with biases (model.moe_bias), gated by the clamped SwiGLU
  (model.activation=swiglu_clamped, swiglu_alpha, swiglu_limit);
* YaRN rotary scaling (model.rope_scaling=yarn).

Its checkpoints keep each layer's experts in one tensor per kind, stored (in, out), the gate and
up columns interleaved (`mlp.experts.gate_up_proj` (experts, dim, 2·hidden), gate first in each
pair, `gate_up_proj_bias`, `down_proj` (experts, hidden, dim), `down_proj_bias`) and the router as
`mlp.router` (scaletrain.model.hf_packed converts them)."""

from __future__ import annotations

from typing import Any

from scaletrain.model.config import ModelConfig
from scaletrain.model.families._common import ROTARY, Reader, Refuse, short
from scaletrain.model.families._moe import MoeFamily


class GptOss(MoeFamily):
    model_type = "gpt_oss"
    architecture = "GptOssForCausalLM"
    known = ROTARY | {"sliding_window", "layer_types", "num_local_experts", "num_experts", "num_experts_per_tok",
                      "swiglu_alpha", "swiglu_limit", "attention_bias"}
    defaults = dict(num_key_value_heads=8, head_dim=64, hidden_act="silu", max_position_embeddings=131072,
                    rms_norm_eps=1e-5, tie_word_embeddings=False, sliding_window=128, num_local_experts=128,
                    num_experts_per_tok=4, swiglu_alpha=1.702, swiglu_limit=7.0, attention_bias=True,
                    rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                                     "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096})
    expert_style = "packed"

    def fields(self, get: Reader, refuse: Refuse, strict: bool) -> dict[str, Any]:
        out = super().fields(get, refuse, strict)
        out.update(attn_sinks=True, activation="swiglu_clamped", swiglu_alpha=get.float("swiglu_alpha"),
                   swiglu_limit=get.float("swiglu_limit"), moe_bias=bool(out.get("moe_experts")))
        out.update(self._layer_kinds(get, refuse, out["n_layers"], out["max_seq_len"]))
        return out

    def renorm(self, get: Reader) -> bool:
        return True  # softmax over the chosen logits: the chosen experts' softmax rescaled to sum to one

    def biases(self, out: dict[str, Any], attention_bias: bool, mlp_bias: bool, refuse: Refuse) -> None:
        out["bias"] = attention_bias  # q, k, v and o; no other linear layer of gpt-oss is an nn.Linear with one

    def _layer_kinds(self, get: Reader, refuse: Refuse, n_layers: int, max_len: int) -> dict[str, Any]:
        """sliding_window and global_every from layer_types (transformers' default: every second
        block full, the first sliding)."""
        types = get.raw("layer_types")
        if types is None:
            types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n_layers)]
        window = get.raw("sliding_window")
        if not isinstance(types, list) or len(types) != n_layers or \
                not set(types) <= {"sliding_attention", "full_attention"}:
            refuse("layer_types", f"should list sliding_attention or full_attention for each of the {n_layers} "
                                  f"layers, got {short(types)}")
            return {}
        if "sliding_attention" not in types or not isinstance(window, int) or isinstance(window, bool) or \
                window <= 0 or window >= max_len:
            return dict(sliding_window=0, global_every=0)  # every layer attends to the whole sequence
        if "full_attention" not in types:
            return dict(sliding_window=window, global_every=0)
        every = types.index("full_attention") + 1
        if types != ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(n_layers)]:
            refuse("layer_types", f"has its full-attention layers where model.global_every (every n-th block full) "
                                  f"cannot put them: {short(types)}")
        return dict(sliding_window=window, global_every=every)

    def hf_extra(self, cfg: ModelConfig, out: dict[str, Any]) -> None:
        super().hf_extra(cfg, out)
        slides = [bool(cfg.sliding_window) and (cfg.is_local_block(i) or not cfg.global_every)
                  for i in range(cfg.n_layers)]
        out.update(intermediate_size=cfg.expert_hidden, num_local_experts=cfg.moe_experts,
                   swiglu_alpha=cfg.swiglu_alpha, swiglu_limit=cfg.swiglu_limit, attention_bias=cfg.bias,
                   # (transformers builds the sliding mask whatever the layers: a window it never uses)
                   sliding_window=cfg.sliding_window or cfg.max_seq_len,
                   layer_types=["sliding_attention" if s else "full_attention" for s in slides])
        del out["hidden_act"]  # (its experts' activation is the clamped SwiGLU, whatever hidden_act says)


def chosen(cfg: ModelConfig, no) -> str:
    """gpt-oss, if it computes what `cfg` (with sinks, expert biases or the clamped SwiGLU) computes."""
    unlike = [why for why, differs in (
        ("is rope, rmsnorm with norms before the sub-blocks and the clamped SwiGLU (model.activation="
         "swiglu_clamped)", not (cfg.position == "rope" and cfg.norm == "rmsnorm" and cfg.norm_placement == "pre"
                                 and cfg.activation == "swiglu_clamped" and not cfg.norm_unit_offset)),
        ("has attention sinks (model.attn_sinks=true)", not cfg.attn_sinks),
        ("has experts with biases in every block (model.moe_bias=true)",
         not cfg.moe_bias or cfg.moe_blocks != cfg.n_layers),
        ("routes by a renormalised softmax (model.moe_renorm=true) without shared experts, scale nor capacity",
         cfg.moe_score != "softmax" or not cfg.moe_renorm or cfg.moe_shared_experts or cfg.moe_route_scale != 1.0
         or cfg.moe_capacity_factor),
        ("has no q/k norms, soft-caps, partial rotary nor q/k/v-only biases",
         cfg.qk_norm or cfg.attn_softcap or cfg.logit_softcap or cfg.rotary_fraction != 1.0 or cfg.qkv_bias
         or cfg.attn_scale_dim or cfg.rope_local_theta or cfg.embed_scale or cfg.parallel_residual)) if differs]
    if unlike:
        raise no(f"attention sinks, expert biases and the clamped SwiGLU are gpt-oss's, which {unlike[0]}")
    return FAMILY.model_type


FAMILY = GptOss()
