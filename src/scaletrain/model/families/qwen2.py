"""Qwen2: a Llama with biases on q, k and v alone (model.qkv_bias), and a sliding window that
use_sliding_window turns on for the layers layer_types (or max_window_layers) marks. The export
puts the window, if any, on every layer."""

from __future__ import annotations

from typing import Any

from scaletrain.model.config import ModelConfig
from scaletrain.model.families._common import ROTARY, WINDOWED, Reader, RotaryFamily, every_layer_window


class Qwen2(RotaryFamily):
    model_type = "qwen2"
    architecture = "Qwen2ForCausalLM"
    known = ROTARY | WINDOWED
    defaults = dict(num_key_value_heads=32, head_dim=None, hidden_act="silu", max_position_embeddings=32768,
                    rms_norm_eps=1e-6, tie_word_embeddings=False, sliding_window=4096, max_window_layers=28)
    qkv_bias = True

    def window(self, get: Reader, n_layers: int) -> int:
        """Only with use_sliding_window, and only if some layer slides (layer_types, else the layers
        from max_window_layers on)."""
        window = every_layer_window(get)
        if not window or not get.raw("use_sliding_window"):
            return 0
        types, first = get.raw("layer_types"), get.raw("max_window_layers")
        if isinstance(types, list):
            return window if "sliding_attention" in types else 0
        return window if not isinstance(first, int) or first < n_layers else 0

    def hf_extra(self, cfg: ModelConfig, out: dict[str, Any], rope: dict[str, Any]) -> None:
        slide = bool(cfg.sliding_window)  # the window, if any, on every layer
        out.update(use_sliding_window=slide, sliding_window=cfg.sliding_window or None, max_window_layers=0,
                   layer_types=["sliding_attention" if slide else "full_attention"] * cfg.n_layers)


FAMILY = Qwen2()
