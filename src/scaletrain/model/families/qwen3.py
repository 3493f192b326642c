"""Qwen3: Qwen2's window, no q/k/v biases, and an RMSNorm on each head's queries and keys
(model.qk_norm)."""

from __future__ import annotations

from typing import Any

from scaletrain.model.config import ModelConfig
from scaletrain.model.families._common import ROTARY, WINDOWED
from scaletrain.model.families.qwen2 import Qwen2


class Qwen3(Qwen2):
    model_type = "qwen3"
    architecture = "Qwen3ForCausalLM"
    known = ROTARY | WINDOWED | {"attention_bias"}
    defaults = dict(num_key_value_heads=32, head_dim=128, hidden_act="silu", max_position_embeddings=32768,
                    rms_norm_eps=1e-6, tie_word_embeddings=False, sliding_window=4096, max_window_layers=28)
    qkv_bias = False
    qk_norm = True
    output_bias_refused = True

    def hf_extra(self, cfg: ModelConfig, out: dict[str, Any]) -> None:
        super().hf_extra(cfg, out)
        out.update(attention_bias=False)


FAMILY = Qwen3()
