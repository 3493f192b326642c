"""fp8 training (precision.mode=fp8): the large block linears compute in float8 through torchao.

Each chosen nn.Linear (quant/layers.py's rule: block projections at least precision.fp8_min_dim
wide, multiples of 16) becomes torchao's Float8Linear (`convert_to_float8_training`). Its three
matmuls (output, input gradient, weight gradient) cast both operands to float8 first: e4m3 for
activations and weights, e5m2 for gradients, each scaled so that its largest value lands near
fp8's largest, and multiply on the GPU's fp8 tensor cores (sm89+: L4, L40S, H100, B200). The rest
of the model runs as in bf16-mixed: fp32 weights, bf16 autocast.

| recipe     | scales                          | where it pays                                         |
|------------|---------------------------------|-------------------------------------------------------|
| tensorwise | one per tensor                  | the fastest; ZeRO-3 all-gathers the weights in fp8    |
| rowwise    | one per row of each operand     | an outlier costs only its own row's precision         |

What it saves: up to 2x matmul throughput on the converted layers (the fp8 peak is twice the
bf16 one) and, with tensorwise under ZeRO-3, half the all-gather bytes. What it costs: an
absolute-max reduction and a cast per operand per matmul, which small layers do not win back
(hence the rule), and a 3-bit mantissa in the matmuls. The weights, gradients, optimizer state
and checkpoints stay those of bf16-mixed (Float8Linear keeps nn.Linear's parameter names).

`precision.fp8_emulate` runs the same casts and scales but multiplies in high precision: the
numerics of fp8 on a CPU (the tests) or an older GPU, with none of its speed.
"""

from __future__ import annotations

import torch
from torch import nn

from scaletrain.errors import ConfigError
from scaletrain.hooks import StepHook
from scaletrain.quant import import_torchao
from scaletrain.quant.layers import layer_plan

FP8_CAPABILITY = (8, 9)  # CUDA compute capability with fp8 tensor cores (Ada, Hopper and later)


def check_fp8_device(device: torch.device, emulate: bool) -> None:
    """Refuse fp8 where its matmuls cannot run: a CPU, or a GPU before sm89, without emulation."""
    if emulate:
        return
    if device.type != "cuda":
        raise ConfigError(f"precision.mode=fp8 on {device.type}: fp8 matmuls need a CUDA GPU of compute capability "
                          "8.9+; set precision.fp8_emulate=true for fp8's numerics without its speed, or train "
                          "with precision.mode=bf16-mixed")
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_CAPABILITY:
        raise ConfigError(f"precision.mode=fp8: {torch.cuda.get_device_name(device)} is sm{capability[0]}"
                          f"{capability[1]}, and fp8 matmuls need sm89+ (L4, L40S, H100, ...); train with "
                          "precision.mode=bf16-mixed, or set precision.fp8_emulate=true for fp8's numerics only")


def float8_config(recipe: str, emulate: bool, fp8_all_gather: bool):
    """torchao's Float8LinearConfig for `recipe`; `fp8_all_gather`: FSDP2 gathers the weights
    already cast to fp8 (tensorwise only: one scale per weight survives the sharding)."""
    import_torchao(f"precision.mode=fp8 (precision.fp8_recipe={recipe})", modules=("torchao.float8",))
    import dataclasses

    from torchao.float8 import Float8LinearConfig

    config = Float8LinearConfig.from_recipe_name(recipe)
    return dataclasses.replace(config, emulate=emulate, enable_fsdp_float8_all_gather=fp8_all_gather)


def convert_fp8(model: nn.Module, recipe: str, *, emulate: bool, fp8_min_dim: int,
                fp8_all_gather: bool) -> dict[str, str | None]:
    """Swap `model`'s chosen linears for Float8Linear, in place, on any device (the meta device
    included: weights are materialized later). Returns the plan (quant/layers.py's rule)."""
    plan = layer_plan(model, "fp8", fp8_min_dim=fp8_min_dim)
    convert = {n for n, why in plan.items() if why is None}
    config = float8_config(recipe, emulate, fp8_all_gather)
    from torchao.float8 import convert_to_float8_training

    convert_to_float8_training(model, config=config, module_filter_fn=lambda m, fqn: fqn in convert)
    return plan


def precompute_fp8_scales(modules: list[nn.Module]) -> None:
    """After an optimizer step under ZeRO-3 with fp8 all-gather: every sharded weight's fp8 scale
    in one all-reduce (otherwise each weight's all-gather computes its own, one all-reduce each)."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    for m in modules:
        precompute_float8_dynamic_scale_for_fsdp(m)


class Fp8ScaleStep(StepHook):
    """ZeRO-3 gathering fp8 weights (tensorwise scales): whenever the weights change (an applied
    optimizer step, a resume, a heal from a replica group's peer), the scales of the next step's
    all-gathers, for every sharded weight at once."""

    phase = "the fp8 weights' scales (one all-reduce)"

    def __init__(self, modules: list[nn.Module]):
        self.modules = modules

    def refresh_weights(self) -> None:
        precompute_fp8_scales(self.modules)
