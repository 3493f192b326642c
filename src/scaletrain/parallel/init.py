"""Materialize weights so that every layout starts from the same numbers.

Each parameter's initial value is drawn from a generator seeded by (seed, canonical name) and
nothing else. A sharded parameter (a DTensor under FSDP or tensor parallelism) draws the whole
tensor on the CPU and keeps its own shard, so 8 ranks start exactly where 1 process starts.
Cost: one full-size temporary per parameter on the host at start-up; no communication.
"""

from __future__ import annotations

import hashlib

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

# Wrappers that PyTorch inserts into module names; the canonical name leaves them out, so
# names (and checkpoint keys) do not change when checkpointing or compile is switched on.
_WRAPPER_PARTS = ("_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module", "module")


def canonical_name(name: str) -> str:
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_PARTS)


def name_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def initial_value(rule, shape: torch.Size, seed: int, name: str) -> torch.Tensor:
    """The full fp32 initial value of one parameter, on the CPU."""
    if rule.kind == "zeros":
        return torch.zeros(shape)
    if rule.kind == "ones":
        return torch.ones(shape)
    if rule.kind == "normal":
        gen = torch.Generator(device="cpu").manual_seed(name_seed(seed, name))
        return torch.empty(shape).normal_(0.0, rule.std, generator=gen)
    raise ValueError(f"unknown init rule {rule.kind!r}")


@torch.no_grad()
def init_weights(model: nn.Module, seed: int, rule_of=None, only=None) -> None:
    """Fill every parameter of `model` (already on its device, e.g. after `to_empty`).

    `rule_of(name)` gives the InitRule of a canonical name; by default `model.init_rule`.
    `only(name)`: the canonical names to fill (default: all).
    """
    rule_of = rule_of or model.init_rule
    for name, param in model.named_parameters():  # shared (tied) parameters appear once
        cname = canonical_name(name)
        if only is not None and not only(cname):
            continue
        full = initial_value(rule_of(cname), param.shape, seed, cname)
        if isinstance(param, DTensor):
            # every rank holds the same full tensor: src_data_rank=None keeps the local shard
            # without any communication
            shard = distribute_tensor(full.to(param.dtype), param.device_mesh, param.placements,
                                      src_data_rank=None)
            param.to_local().copy_(shard.to_local())
        else:
            param.copy_(full)


@torch.no_grad()
def load_weights(model: nn.Module, weights, where: str, only=None) -> None:
    """Fill every parameter of `model` from `weights[canonical name]`, a full fp32 CPU tensor, as
    `init_weights` does: every layout starts from the same numbers. Weights are read when asked,
    one at a time (a rank holding some pipeline stages reads only theirs); where `weights` can
    read a part (`weights.read(name, index)`) a sharded parameter reads only its own shard.
    `only(name)`: the canonical names to fill (default: all; adapters are not in the weights)."""
    for name, param in model.named_parameters():
        cname = canonical_name(name)
        if only is not None and not only(cname):
            continue
        index = _local_index(param) if hasattr(weights, "read") else None
        if index is not None:
            param.to_local().copy_(weights.read(cname, index))
            continue
        full = full_weight(weights, cname, param.shape, where)
        if isinstance(param, DTensor):
            shard = distribute_tensor(full.to(param.dtype), param.device_mesh, param.placements, src_data_rank=None)
            param.to_local().copy_(shard.to_local())
        else:
            param.copy_(full)


def full_weight(weights, cname: str, shape: torch.Size, where: str) -> torch.Tensor:
    """`weights[cname]`, refused in one line unless it has the model's `shape`."""
    from scaletrain.errors import ConfigError

    full = weights[cname]
    if tuple(full.shape) != tuple(shape):
        raise ConfigError(f"{where}: {cname} has shape {tuple(full.shape)} but the model's is "
                          f"{tuple(shape)}; model.init_from must hold weights of this model's shape")
    return full


def _local_index(param) -> tuple[slice, ...] | None:
    """The slices of the global tensor that this rank's shard of a DTensor holds, when they are
    one contiguous block (plain Shard/Replicate placements); None otherwise (read it whole)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(param, DTensor) or any(type(p) not in (Shard, Replicate) for p in param.placements):
        return None
    sharded = [p.dim for p in param.placements if isinstance(p, Shard)]
    if len(sharded) != len(set(sharded)):  # two mesh axes splitting one dimension: not one block
        return None
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    if tuple(shape) != tuple(param.to_local().shape):
        return None
    return tuple(slice(o, o + n) for o, n in zip(offset, shape))
