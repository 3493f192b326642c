"""The model: its config (scaletrain.model.config, no torch), the transformer, presets, FLOPs,
Hugging Face mapping, sampling. Names are imported on first use, so that loading a config
does not load torch."""

_NAMES = {"flops_per_token": "flops", "matmul_params": "flops", "PRESETS": "presets", "preset_config": "presets",
          "Transformer": "transformer", "count_params": "transformer"}


def __getattr__(name):
    if name not in _NAMES:
        raise AttributeError(name)
    import importlib

    return getattr(importlib.import_module(f"scaletrain.model.{_NAMES[name]}"), name)


__all__ = sorted(_NAMES)
