"""OLMo 2: a Llama whose norms follow the sub-blocks (model.norm_placement=post: its
post_attention_layernorm follows attention, where Llama's precedes the MLP), with q/k norms over
the whole query and key projections (model.qk_norm_scope=projection)."""

from __future__ import annotations

from typing import Any

from scaletrain.model.config import ModelConfig
from scaletrain.model.families._common import LLAMA_BLOCK, ROTARY, RotaryFamily


class Olmo2(RotaryFamily):
    model_type = "olmo2"
    architecture = "Olmo2ForCausalLM"
    known = ROTARY | {"attention_bias"}
    defaults = dict(num_key_value_heads=None, head_dim=None, hidden_act="silu", max_position_embeddings=2048,
                    rms_norm_eps=1e-5, tie_word_embeddings=False, attention_bias=False)
    qk_norm = True
    qk_norm_scope = "projection"
    norm_placement = "post"
    output_bias_refused = True
    block = {**LLAMA_BLOCK, "attn_post_norm": "post_attention_layernorm",
             "mlp_post_norm": "post_feedforward_layernorm"}

    def hf_extra(self, cfg: ModelConfig, out: dict[str, Any]) -> None:
        out.update(attention_bias=False)


FAMILY = Olmo2()
