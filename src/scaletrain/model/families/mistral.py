"""Mistral: a Llama whose every layer attends within sliding_window (when set)."""

from __future__ import annotations

from typing import Any

from scaletrain.model.config import ModelConfig
from scaletrain.model.families._common import ROTARY, Reader, Refuse, RotaryFamily, every_layer_window


class Mistral(RotaryFamily):
    model_type = "mistral"
    architecture = "MistralForCausalLM"
    known = ROTARY | {"sliding_window"}
    defaults = dict(num_key_value_heads=8, head_dim=None, hidden_act="silu", max_position_embeddings=131072,
                    rms_norm_eps=1e-6, tie_word_embeddings=False, sliding_window=4096)

    def window(self, get: Reader, n_layers: int, refuse: Refuse) -> int:
        return every_layer_window(get)

    def hf_extra(self, cfg: ModelConfig, out: dict[str, Any]) -> None:
        out.update(sliding_window=cfg.sliding_window or None)


FAMILY = Mistral()
