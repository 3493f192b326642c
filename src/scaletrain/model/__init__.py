"""The model: its config (config.py, light), presets, FLOP counts, and the transformer (torch).

The transformer is imported when first asked for, so that reading a config or the command line
does not load torch (a Ctrl-C during that import then reaches the CLI, which says it in a line)."""

from scaletrain.model.flops import flops_per_token, matmul_params
from scaletrain.model.presets import PRESETS, preset_config

__all__ = ["PRESETS", "Transformer", "count_params", "flops_per_token", "matmul_params", "preset_config"]


def __getattr__(name):
    if name in ("Transformer", "count_params"):
        from scaletrain.model import transformer

        return getattr(transformer, name)
    raise AttributeError(f"module 'scaletrain.model' has no attribute {name!r}")
