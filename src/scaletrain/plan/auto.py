"""`parallel.layout = "auto"`: the planner picks the layout for the devices at hand.

It searches the layouts of `world` ranks of this machine's device (a known GPU from the
catalog, or the CPU measured here), keeps the global batch and precision of the config, and
fills in `[parallel]`, the micro-batch and accumulation, and `[memory]`.
"""

from __future__ import annotations

import dataclasses

import torch

from scaletrain.config import JobConfig, ParallelConfig, from_dict, resolve_batch
from scaletrain.errors import ConfigError

CHOSEN = ("dp_replicate", "dp_shard", "tp", "pp", "zero", "sp", "pp_schedule", "pp_virtual_stages")


def auto_layout(cfg: JobConfig, world: int, device: torch.device, gpus_per_node: int | None = None):
    """(the config with the planner's layout, the planner's evaluation of it)."""
    from scaletrain.plan import plan
    from scaletrain.plan.hardware import local_hardware

    defaults = ParallelConfig()
    set_by_hand = [k for k in CHOSEN if getattr(cfg.parallel, k) != getattr(defaults, k)]
    if set_by_hand:
        raise ConfigError(f"parallel.layout=auto chooses the layout itself; leave parallel."
                          f"{', parallel.'.join(set_by_hand)} at their defaults, or set parallel.layout=manual")
    global_batch = cfg.train.global_batch or resolve_batch(cfg.train, world).global_batch
    per_node = gpus_per_node or (min(world, torch.cuda.device_count()) if device.type == "cuda" else world)
    nodes = max(1, world // per_node)
    result = plan(cfg.model, hardware=local_hardware(device), nodes=nodes, gpus_per_node=world // nodes,
                  seq_len=cfg.data.seq_len, global_batch=global_batch, precision=cfg.precision.mode,
                  optimizer=cfg.optim.name, gpu=device.type == "cuda", top_k=1)
    best = result["layouts"][0]
    if not best.fits:
        raise ConfigError(f"parallel.layout=auto: no layout of {world} rank(s) fits — the leanest "
                          f"({best.layout.describe()}) {best.why_not[0]}")
    lay = best.layout
    raw = cfg.to_dict()
    raw["parallel"].update(layout="manual", dp_replicate=lay.dp_replicate, dp_shard=lay.dp_shard, tp=lay.tp,
                           pp=lay.pp, zero=lay.zero, sp=lay.sp,
                           pp_schedule=lay.schedule if lay.pp > 1 else defaults.pp_schedule,
                           pp_virtual_stages=lay.virtual if lay.pp > 1 else 1, pp_microbatches=0)
    raw["train"].update(global_batch=global_batch, micro_batch=lay.micro_batch, grad_accum=lay.grad_accum)
    raw["memory"].update(activation_checkpointing=lay.ac, offload_optimizer=lay.offload)
    return from_dict(raw), best
