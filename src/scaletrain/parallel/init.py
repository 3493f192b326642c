"""Materialize weights so that every layout starts from the same numbers.

Each parameter's initial value is drawn from a generator seeded by (seed, canonical name) and
nothing else. A sharded parameter (a DTensor under FSDP or tensor parallelism) draws the whole
tensor on the CPU and keeps its own shard, so 8 ranks start exactly where 1 process starts.
Cost: one full-size temporary per parameter on the host at start-up; no communication.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from scaletrain.model.names import canonical_name


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
    for name, buffer in model.named_buffers():  # the routing biases a checkpoint stores (DeepSeek-V3's)
        cname = canonical_name(name)
        if cname.endswith(".expert_bias") and cname in weights:
            buffer.copy_(full_weight(weights, cname, buffer.shape, where))


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


# --------------------------------------------------------------------------------------------
# Materializing a model built on the meta device (parallelize's step, after the engines that shard)


@dataclass
class Materialize:
    """What a chunk's weights come from: `weights` (full tensors by canonical name, e.g. model.init_from,
    read lazily) or (seed, name); adapters drawn from (seed, name) either way; the adapted linears'
    bases quantized to `base_dtype` (None: not quantized) one whole weight at a time."""

    seed: int
    device: torch.device
    param_dtype: torch.dtype  # what the model keeps its weights in (when no engine keeps fp32 storage)
    engine_keeps_fp32: bool  # FSDP / replicate: fp32 storage, cast for compute by the engine
    fsdp: bool
    offload: bool  # FSDP's states on the host
    weights: object = None
    where: str = "the weights"
    adapters: object = None  # AdapterSpec
    base_dtype: str | None = None


def materialize(chunk: nn.Module, m: Materialize) -> None:
    """Allocate `chunk` (on the meta device, maybe sharded) on its device and fill every parameter:
    the same numbers on every layout."""
    from scaletrain.model.lora import adapter_init_rule, init_magnitudes, is_adapter_param
    from scaletrain.quant.frozen_base import fill_bases, fill_nf4_shards

    chunk.to_empty(device="cpu" if (m.fsdp and m.offload) else m.device)
    chunk.init_buffers(m.device)
    rule_of = adapter_init_rule(chunk.init_rule, m.adapters) if m.adapters is not None else None
    quantized = m.base_dtype is not None  # the bases filled apart, one whole weight quantized at a time
    plain = _not_quantized(chunk) if quantized else (lambda n: True)
    if m.weights is not None:
        base_only = None if m.adapters is None else lambda n: not is_adapter_param(n) and plain(n)
        load_weights(chunk, m.weights, m.where, only=base_only)
        if m.adapters is not None:  # the adapters are not in the weights: from (seed, name)
            init_weights(chunk, m.seed, rule_of, only=is_adapter_param)
    else:
        init_weights(chunk, m.seed, rule_of, only=None if not quantized else plain)
    if quantized:
        base_value = _full_values(chunk, m.weights, m.where, rule_of, m.seed)
        if m.fsdp:
            fill_nf4_shards(chunk, base_value)
    if m.adapters is not None:
        init_magnitudes(chunk)  # DoRA: from the base, once it holds its values
    if not m.engine_keeps_fp32:  # those keep fp32 storage and cast for compute themselves
        move(chunk, dtype=m.param_dtype)  # the quantized bases are of that dtype already
        if quantized:  # the placeholders replaced by the quantized values, one weight at a time
            fill_bases(chunk, base_value, m.base_dtype)
    elif m.param_dtype != torch.float32:  # ...but start from the rounded weights the others keep
        _round_weights(chunk, m.param_dtype)
    chunk.train()


@torch.no_grad()
def _round_weights(chunk: nn.Module, dtype: torch.dtype) -> None:
    """Round the fp32 weights an engine keeps to `dtype` and back, so they start where the rounded
    weights of the other layouts start (a quantized base is quantized from the fp32 values)."""
    from scaletrain.quant.frozen_base import is_quantized

    for p in chunk.parameters():
        if is_quantized(p):
            continue
        local = p.to_local() if hasattr(p, "to_local") else p
        local.copy_(local.to(dtype))


def move(module: nn.Module, device: torch.device | None = None, dtype: torch.dtype | None = None) -> None:
    """`module.to(device, dtype)` (the same conversion of each tensor), the quantized bases left as they
    are (`to` would dequantize them)."""
    from scaletrain.quant.frozen_base import is_quantized

    module._apply(lambda t: t if is_quantized(t) else
                  t.to(device, dtype if t.is_floating_point() or t.is_complex() else None))


def _not_quantized(chunk: nn.Module):
    """name -> whether the canonical parameter name is not a quantized base weight of `chunk`."""
    from scaletrain.quant.frozen_base import is_quantized

    bases = {canonical_name(n) for n, p in chunk.named_parameters() if is_quantized(p)}
    return lambda name: name not in bases


def _full_values(chunk: nn.Module, weights, where: str, rule_of, seed: int):
    """canonical name -> the full fp32 value of one of `chunk`'s parameters, read from `weights`
    (checked against the model's shape) or drawn from (seed, name): one tensor at a time."""
    if weights is not None:
        return lambda name: full_weight(weights, name, _param_shape(chunk, name), where)
    return lambda name: initial_value(rule_of(name), _param_shape(chunk, name), seed, name)


def _param_shape(chunk: nn.Module, cname: str) -> torch.Size:
    return next(p.shape for n, p in chunk.named_parameters() if canonical_name(n) == cname)
