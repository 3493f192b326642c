from scaletrain.model.flops import flops_per_token, matmul_params
from scaletrain.model.presets import PRESETS, preset_config
from scaletrain.model.transformer import Transformer, count_params

__all__ = ["PRESETS", "Transformer", "count_params", "flops_per_token", "matmul_params", "preset_config"]
