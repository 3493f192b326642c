"""Quantization-aware training (train.qat): the blocks' linear layers train through torchao's
fake quantization, so the weights learn to live with the rounding that `scaletrain quantize`
applies afterwards.

Each chosen nn.Linear becomes torchao's FakeQuantizedLinear (`QATConfig(step="prepare")`): in
the forward, activations and weights are quantized and dequantized again (the values rounded to
the int8/int4 grid, still in float), and the backward passes gradients straight through the
rounding. The scheme's rounding is mirrored: int8-dynamic rounds activations per token to
asymmetric int8 and weights per row to symmetric int8; int8-int4 rounds activations the same
way and weights to symmetric int4 in groups of 32 (torchao derives both from the PTQ config).

What it costs: a quantize-dequantize of every activation and weight each step (~10-30% on a CPU
step here), and no memory: the weights stay fp32 and the module keeps torchao's names (weight,
bias), so checkpoints and their resume are those of a plain run. What it saves: given a long enough
fine-tune, most of the perplexity PTQ loses (int8-int4 on the trained demo: 76% recovered by 64
steps, nothing measurable by 16; docs/benchmarks.md). The convert step is `scaletrain quantize` of the
checkpoint with the same scheme.
"""

from __future__ import annotations

import torch
from torch import nn

from scaletrain.errors import ConfigError
from scaletrain.quant import import_torchao
from scaletrain.quant.layers import layer_plan
from scaletrain.vocab import QAT_SCHEMES, unknown


def qat_config(scheme: str):
    """torchao's QAT prepare config for `scheme`."""
    # QATConfig's prepare step imports these two itself: import them while the noise is held
    import_torchao(f"train.qat={scheme}", modules=("torchao.quantization.qat", "torchao.prototype.qat",
                                                   "torchao.prototype.mx_formats"))
    from torchao.quantization.qat import IntxFakeQuantizeConfig, QATConfig

    if scheme == "int8-dynamic":  # as ptq.torchao_config's Int8DynamicActivationInt8WeightConfig quantizes
        act = IntxFakeQuantizeConfig(torch.int8, "per_token", is_symmetric=False)
        weight = IntxFakeQuantizeConfig(torch.int8, "per_channel", is_symmetric=True)
        return QATConfig(activation_config=act, weight_config=weight, step="prepare")
    if scheme == "int8-int4":
        from scaletrain.quant.ptq import torchao_config

        return QATConfig(torchao_config(scheme), step="prepare")
    raise unknown("train.qat scheme", scheme, QAT_SCHEMES[1:])


def prepare_qat(model: nn.Module, scheme: str) -> dict[str, str | None]:
    """Swap `model`'s chosen linears (quant/layers.py's rule) for fake-quantized ones, in place,
    on any device (the meta device included: weights are materialized later). Returns the plan."""
    plan = layer_plan(model, scheme)
    convert = {n for n, why in plan.items() if why is None}
    if not convert:
        raise ConfigError(f"train.qat={scheme}: no linear layer of this model qualifies (see the layer rule in "
                          "scaletrain.quant.layers); set train.qat=none")
    config = qat_config(scheme)  # imports torchao quietly
    from torchao.quantization import quantize_

    quantize_(model, config, filter_fn=lambda m, fqn: type(m) is nn.Linear and fqn in convert)
    return plan
