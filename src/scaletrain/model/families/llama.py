"""Llama: the plain rotary family every other Llama-like starts from (scaletrain.model.families.
_common.RotaryFamily). Its own: attention_bias and mlp_bias, which together are our model.bias
(a bias on every linear layer) and alone are refused."""

from __future__ import annotations

from typing import Any

from scaletrain.model.config import ModelConfig
from scaletrain.model.families._common import ROTARY, RotaryFamily


class Llama(RotaryFamily):
    model_type = "llama"
    architecture = "LlamaForCausalLM"
    known = ROTARY | {"attention_bias", "mlp_bias", "pretraining_tp"}
    defaults = dict(num_key_value_heads=None, head_dim=None, hidden_act="silu", max_position_embeddings=2048,
                    rms_norm_eps=1e-6, tie_word_embeddings=False)

    def biases(self, out, attention_bias, mlp_bias, refuse) -> None:
        if attention_bias and mlp_bias:
            out["bias"] = True  # every linear layer has one, as model.bias gives (RMSNorm has none)
        elif attention_bias:
            refuse("attention_bias", "puts a bias on the output projection too, without mlp_bias; scaletrain has "
                                     "biases on q/k/v only (qkv_bias) or on every linear layer (bias)")
        elif mlp_bias:
            refuse("mlp_bias", "puts biases on the MLP alone; scaletrain has them on every linear layer or none")

    def hf_extra(self, cfg: ModelConfig, out: dict[str, Any]) -> None:
        out.update(attention_bias=cfg.bias, mlp_bias=cfg.bias)


FAMILY = Llama()
