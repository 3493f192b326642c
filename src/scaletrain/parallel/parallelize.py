"""The one place where the techniques that transform the model are composed, in a fixed order:

    pipeline split -> tensor/sequence parallel -> activation checkpointing -> compile -> data parallel

The model arrives plain (on the meta device) and leaves ready to be materialized.
"""

from __future__ import annotations

from torch import nn

from scaletrain.config import JobConfig
from scaletrain.memory import apply_activation_checkpointing


def parallelize(model: nn.Module, cfg: JobConfig) -> nn.Module:
    apply_activation_checkpointing(model.layers, cfg.memory.activation_checkpointing)
    if cfg.train.compile:
        for block in model.layers.values():
            block.compile()  # in place: parameter names (and checkpoint keys) stay the same
    return model
