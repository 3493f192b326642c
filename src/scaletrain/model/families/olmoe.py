"""OLMoE: an OLMo-like mixture of experts in every block (scaletrain.model.families._moe), norms
before the sub-blocks, q/k norms over the whole query and key projections
(model.qk_norm_scope=projection), the chosen experts' weights rescaled when norm_topk_prob says
so. clip_qkv (clamping q, k and v) is refused."""

from __future__ import annotations

from typing import Any

from scaletrain.model.config import ModelConfig
from scaletrain.model.families._common import ROTARY, Reader, Refuse
from scaletrain.model.families._moe import MoeFamily


class Olmoe(MoeFamily):
    model_type = "olmoe"
    architecture = "OlmoeForCausalLM"
    known = ROTARY | {"attention_bias", "clip_qkv", "num_experts", "num_local_experts", "num_experts_per_tok",
                      "norm_topk_prob"}
    defaults = dict(num_key_value_heads=None, head_dim=None, hidden_act="silu", max_position_embeddings=4096,
                    rms_norm_eps=1e-5, tie_word_embeddings=False, num_experts=64, num_experts_per_tok=8,
                    norm_topk_prob=False, clip_qkv=None)
    qk_norm = True
    qk_norm_scope = "projection"
    output_bias_refused = True
    expert_count_keys = ("num_experts", "num_local_experts")

    def moe_fields(self, get: Reader, refuse: Refuse, n_layers: int) -> dict[str, Any]:
        if get.raw("clip_qkv") is not None:
            refuse("clip_qkv", "clamps the queries, keys and values; scaletrain does not")
        return super().moe_fields(get, refuse, n_layers)

    def hf_extra(self, cfg: ModelConfig, out: dict[str, Any]) -> None:
        super().hf_extra(cfg, out)
        out.update(intermediate_size=cfg.expert_hidden)  # every block a mixture: the experts' width
        out.update(num_experts=cfg.moe_experts, norm_topk_prob=cfg.moe_renorm, clip_qkv=None, attention_bias=False)


FAMILY = Olmoe()
