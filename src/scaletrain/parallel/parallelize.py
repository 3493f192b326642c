"""The one place where the techniques that transform the model are composed, in a fixed order:

    pipeline split -> tensor/sequence parallel -> activation checkpointing -> compile
        -> data parallel -> materialize weights

The model arrives plain, on the meta device; it leaves materialized, initialized from
(seed, parameter name), and wrapped for its data-parallel strategy.
"""

from __future__ import annotations

import torch
from torch import nn

from scaletrain.config import JobConfig
from scaletrain.errors import LaunchError
from scaletrain.memory import apply_activation_checkpointing
from scaletrain.parallel.data_parallel import (DataParallel, DDPDataParallel, FSDPDataParallel,
                                               ZeroDataParallelStrategy, apply_fsdp)
from scaletrain.parallel.init import init_weights
from scaletrain.parallel.launch import Runtime
from scaletrain.precision import Precision


def parallelize(model: nn.Module, cfg: JobConfig, rt: Runtime, precision: Precision) -> DataParallel:
    dims, zero = rt.dims, cfg.parallel.zero

    apply_activation_checkpointing(model.layers, cfg.memory.activation_checkpointing)
    if cfg.train.compile:
        for block in model.layers.values():
            block.compile()  # in place: parameter names (and checkpoint keys) stay the same

    if cfg.memory.offload_optimizer and rt.device.type != "cuda":
        raise LaunchError("memory.offload_optimizer moves model states from GPU memory to pinned host memory; "
                          "this run is on the CPU already, so drop the option")
    if zero == 3:  # FSDP2 shards the parameters while they are still on the meta device
        dp_mesh = rt.mesh["dp_replicate", "dp_shard"] if dims.dp_replicate > 1 else rt.mesh["dp_shard"]
        compute = precision.compute_dtype if precision.compute_dtype == torch.bfloat16 else None
        apply_fsdp(model, dp_mesh, param_dtype=compute, offload=cfg.memory.offload_optimizer)

    # materialize: every parameter from (seed, name), on every rank the same numbers
    model.to_empty(device="cpu" if (zero == 3 and cfg.memory.offload_optimizer) else rt.device)
    model.init_buffers(rt.device)
    init_weights(model, cfg.train.seed)
    if zero != 3:  # under FSDP the fp32 shards are the master weights; compute dtype is its policy's
        model.to(precision.param_dtype)
    model.train()

    if not rt.distributed or dims.dp == 1:
        return DataParallel(model)
    if zero == 0:
        return DDPDataParallel(model, rt.group("dp"), cfg.parallel.bucket_mb,
                               reduce_in_fp32=precision.param_dtype != torch.float32)
    if zero in (1, 2):
        return ZeroDataParallelStrategy(
            model, rt.mesh, stage=zero, dp_replicate=dims.dp_replicate, bucket_mb=cfg.parallel.bucket_mb,
            master_dtype=torch.float32 if precision.master_weights else None)
    strategy = FSDPDataParallel(model)
    return strategy
