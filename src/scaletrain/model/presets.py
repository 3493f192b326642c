"""Built-in model shapes. `model.preset = "NAME"` starts from one; keys set beside it win
(`fill_shape`, which also takes a shape from model.from_hf).

The shapes follow the published configs of each family; the sources are named beside them.
"""

from __future__ import annotations

from typing import Any

from scaletrain.errors import ConfigError
from scaletrain.model.config import MODEL_SHAPE
from scaletrain.vocab import did_you_mean

PRESETS: dict[str, dict[str, Any]] = {
    # The default: a 3.2M-parameter byte-level GPT that learns CPython's docs on a laptop CPU.
    "tiny": dict(vocab_size=256, dim=256, n_layers=4, n_heads=4, max_seq_len=128,
                 norm="layernorm", activation="gelu", position="learned", tie_embeddings=True,
                 bias=False),
    # GPT-2 small (Radford et al. 2019; Hugging Face `gpt2` config.json); the vocabulary is
    # padded from 50257 to a multiple of 64 as nanoGPT does, for faster matmuls.
    "gpt2-124m": dict(vocab_size=50304, dim=768, n_layers=12, n_heads=12, max_seq_len=1024,
                      norm="layernorm", norm_eps=1e-5, activation="gelu", position="learned",
                      tie_embeddings=True, bias=True),
    # Llama 3.2 1B (meta-llama/Llama-3.2-1B config.json): GQA with 8 KV heads, tied embeddings.
    "llama-1b": dict(vocab_size=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8,
                     ffn_dim=8192, max_seq_len=8192, norm="rmsnorm", norm_eps=1e-5,
                     activation="swiglu", position="rope", rope_theta=500000.0,
                     tie_embeddings=True, bias=False),
    # Llama 3 70B (meta-llama/Meta-Llama-3-70B config.json).
    "llama-70b": dict(vocab_size=128256, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8,
                      ffn_dim=28672, max_seq_len=8192, norm="rmsnorm", norm_eps=1e-5,
                      activation="swiglu", position="rope", rope_theta=500000.0,
                      tie_embeddings=False, bias=False),
    # Llama 3 8B (meta-llama/Meta-Llama-3-8B config.json).
    "llama-8b": dict(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                     ffn_dim=14336, max_seq_len=8192, norm="rmsnorm", norm_eps=1e-5,
                     activation="swiglu", position="rope", rope_theta=500000.0,
                     tie_embeddings=False, bias=False),
}


def preset_config(name: str, **overrides: Any):
    """The ModelConfig of a preset, validated like a config file's model section."""
    from scaletrain.errors import ConfigError
    from scaletrain.model.config import model_config
    from scaletrain.vocab import did_you_mean

    if name not in PRESETS:
        raise ConfigError(f"model.preset: unknown preset {name!r}{did_you_mean(name, PRESETS)}; "
                          f"choose one of {', '.join(PRESETS)}")
    return model_config({**PRESETS[name], "preset": name, **overrides})


def fill_shape(values: dict[str, Any], errors: list[str]) -> dict[str, Any]:
    """The model section's values with the shape its source gives filled in: `preset` (a built-in
    shape) or `from_hf` (a Hugging Face config.json); the keys given explicitly win. What is wrong
    goes to `errors`."""
    preset = values.get("preset", "")
    if preset and isinstance(preset, str):  # a preset of another type is reported with the other keys
        if preset not in PRESETS:
            errors.append(f"model.preset: unknown preset {preset!r}{did_you_mean(preset, PRESETS)}; "
                          f"choose one of {', '.join(PRESETS)}")
        else:
            values = {**PRESETS[preset], **values}
    from_hf = values.get("from_hf", "")
    if from_hf and isinstance(from_hf, str):
        if preset:
            errors.append("model.preset and model.from_hf both give the model's shape; keep one of them")
        elif any(f.name not in values for f in MODEL_SHAPE):  # a saved config gives them all
            from scaletrain.model.hf_config import model_config_from_hf  # local: keeps plain config loads light

            try:
                values = {**model_config_from_hf(from_hf), **values}
            except ConfigError as e:
                errors.extend(f"model.from_hf: {line}" for line in e.lines)
    return values
