"""Qwen2: a Llama with biases on q, k and v alone (model.qkv_bias), and a sliding window that
use_sliding_window turns on for the layers layer_types (or max_window_layers) marks: every layer
(a mix of sliding and full layers is refused). The export puts the window, if any, on every layer."""

from __future__ import annotations

from typing import Any

from scaletrain.model.config import ModelConfig
from scaletrain.model.families._common import ROTARY, WINDOWED, Reader, Refuse, RotaryFamily, every_layer_window


class Qwen2(RotaryFamily):
    model_type = "qwen2"
    architecture = "Qwen2ForCausalLM"
    known = ROTARY | WINDOWED
    defaults = dict(num_key_value_heads=32, head_dim=None, hidden_act="silu", max_position_embeddings=32768,
                    rms_norm_eps=1e-6, tie_word_embeddings=False, sliding_window=4096, max_window_layers=28)
    qkv_bias = True

    def window(self, get: Reader, n_layers: int, refuse: Refuse) -> int:
        """Only with use_sliding_window, on the layers layer_types marks (else those from
        max_window_layers on): all of them or none, as scaletrain's blocks slide alike."""
        window = every_layer_window(get)
        if not window or not get.raw("use_sliding_window"):
            return 0
        types, first = get.raw("layer_types"), get.raw("max_window_layers")
        if isinstance(types, list):
            slides = ["sliding_attention" == t for t in types]
            key = "layer_types"
        else:
            first = first if isinstance(first, int) else 0
            slides, key = [i >= first for i in range(n_layers)], "max_window_layers"
        if any(slides) and not all(slides):
            refuse(key, f"slides {sum(slides)} of the {len(slides)} layers; scaletrain slides every layer or "
                        "none (train it with use_sliding_window=false, or its window on every layer)")
        return window if any(slides) else 0

    def hf_extra(self, cfg: ModelConfig, out: dict[str, Any]) -> None:
        slide = bool(cfg.sliding_window)  # the window, if any, on every layer
        out.update(use_sliding_window=slide, sliding_window=cfg.sliding_window or None, max_window_layers=0,
                   layer_types=["sliding_attention" if slide else "full_attention"] * cfg.n_layers)


FAMILY = Qwen2()
