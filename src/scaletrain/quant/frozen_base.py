"""QLoRA: the frozen base of adapted linears kept in fewer bytes (adapter.base_dtype).

Only the bases of the linears that adapters were put on (`LoRALinear`) are converted; the
embeddings, norms and output head stay as the precision mode keeps them. The adapters train in
the precision mode's dtype; the base is dequantized for each matmul, forward and backward, and
only its quantized form is saved for backward (never a dequantized copy per layer).

    nf4   torchao's NF4Tensor (Dettmers et al. 2023): 4-bit NormalFloat codes in blocks of 64
          values along each row, each block's absmax scale itself quantized to int8 in groups
          (double quantization). ~0.52 bytes a parameter. The scale groups never cross a row
          (`nf4_scaler_block`), so FSDP2's row shards (ZeRO-3) quantize exactly as the whole
          tensor does, and torchao's NF4 all-gather gathers the codes, not floats.
    int8  per-output-row symmetric int8 (scale = row absmax / 127, fp32): ~1 byte a parameter.
    bf16  a bf16 copy: 2 bytes a parameter (under 32-true the adapters stay fp32).

The weight keeps its name (`layers.0.attn.wq.weight`): checkpoints hold the adapters alone and
the base's fingerprint is of its unquantized source, so resuming is as without quantization.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from scaletrain.errors import ConfigError

NF4_BLOCK = 64  # values per NF4 scale (QLoRA's)
NF4_SCALER_BLOCK = 256  # NF4 scales per second-level scale, at most (QLoRA's); a divisor of a row's blocks


def nf4_scaler_block(in_features: int) -> int:
    """The NF4 scales grouped per double-quantization scale: the largest power of two up to 256
    dividing a row's blocks, so that a group never spans two rows (a row shard quantizes alone)."""
    return math.gcd(NF4_SCALER_BLOCK, in_features // NF4_BLOCK)


def base_problems(base_dtype: str, named_linears: list[tuple[str, nn.Linear]], shards: int = 1) -> list[str]:
    """What keeps these linears' weights from `base_dtype`: NF4 needs whole blocks of 64 in each
    row, and under ZeRO-3 (`shards` ranks) rows that split evenly over the ranks."""
    errors = []
    if base_dtype != "nf4":
        return errors
    for name, lin in named_linears:
        if lin.in_features % NF4_BLOCK:
            errors.append(f"adapter.base_dtype=nf4: {name} has {lin.in_features} in-features, not a multiple of "
                          f"NF4's block of {NF4_BLOCK} (allowed: {NF4_BLOCK}, {2 * NF4_BLOCK}, {3 * NF4_BLOCK}, ...); "
                          "leave it out of adapter.targets, or use adapter.base_dtype=int8 or bf16")
        elif shards > 1 and lin.out_features % shards:
            errors.append(f"adapter.base_dtype=nf4 with parallel.zero=3 over {shards} ranks: {name} has "
                          f"{lin.out_features} rows, which do not split evenly over the ranks; leave it out of "
                          "adapter.targets, or use a number of ranks that divides it")
    return errors


# --------------------------------------------------------------------------------------------
# The base's matmul: y = x deq(W)^T forward, g deq(W) for the input's gradient, each one op that
# dequantizes inside. Opaque to torch.compile on purpose: traced as plain ops, the forward's and
# the backward's dequantization are one expression, and the compiled graph then keeps the dense
# weight of every adapted linear for backward (QLoRA's saving gone). Autograd saves the stored
# tensors alone (the parameter's own storage: nothing new is kept).


def _dense(kind: str, parts: list[torch.Tensor], sizes: list[int], stored: torch.dtype,
           dtype: torch.dtype) -> torch.Tensor:
    """The dense weight (out x in, `dtype`) that `parts` store. nf4: torchao's layout, dequantized
    in its order of operations (bit for bit its `get_original_weight()`), then cast."""
    if kind == "int8":
        q, scale = parts
        return (q.float() * scale.unsqueeze(1)).to(dtype)
    if kind == "bf16":
        return parts[0].to(dtype)
    codes, scalers, factors, mean, levels = parts  # two 4-bit codes a byte; int8 block scales, their factors
    rows, cols, block, group = sizes
    scales = (scalers.view(-1, group) / factors.unsqueeze(-1)).flatten().to(stored) + mean  # one per 64 values
    scales = scales.unsqueeze(-1).expand(scales.shape[0], block // 2).flatten()  # one per byte
    high, low = levels[(codes >> 4).long()] * scales, levels[(codes & 0b1111).long()] * scales
    return torch.stack([high, low], dim=-1).reshape(rows, cols).to(dtype)


@torch.library.custom_op("scaletrain::frozen_linear", mutates_args=())
def _frozen_linear(x: torch.Tensor, kind: str, parts: list[torch.Tensor], sizes: list[int],
                   stored: torch.dtype) -> torch.Tensor:
    with torch.autocast(x.device.type, enabled=False):  # x is in the compute dtype already
        return F.linear(x, _dense(kind, parts, sizes, stored, x.dtype))


@_frozen_linear.register_fake
def _(x, kind, parts, sizes, stored):
    return x.new_empty((*x.shape[:-1], sizes[0]))


@torch.library.custom_op("scaletrain::frozen_linear_grad", mutates_args=())
def _frozen_linear_grad(grad: torch.Tensor, kind: str, parts: list[torch.Tensor], sizes: list[int],
                        stored: torch.dtype) -> torch.Tensor:
    with torch.autocast(grad.device.type, enabled=False):
        return grad @ _dense(kind, parts, sizes, stored, grad.dtype)


@_frozen_linear_grad.register_fake
def _(grad, kind, parts, sizes, stored):
    return grad.new_empty((*grad.shape[:-1], sizes[1]))


def _save_parts(ctx, inputs, output):
    _, ctx.kind, parts, ctx.sizes, ctx.stored = inputs
    ctx.save_for_backward(*parts)


def _input_grad(ctx, grad):  # the weight is frozen: the input's gradient alone
    parts = list(ctx.saved_tensors)
    return _frozen_linear_grad(grad, ctx.kind, parts, ctx.sizes, ctx.stored), None, [None] * len(parts), None, None


_frozen_linear.register_autograd(_input_grad, setup_context=_save_parts)


def _stored_parts(w: torch.Tensor) -> tuple[str, list[torch.Tensor], list[int]]:
    """(kind, the tensors, the sizes) a quantized base weight is stored as."""
    if isinstance(w, FrozenWeight):
        return ("bf16", [w.qdata], list(w.shape)) if w.scale is None else ("int8", [w.qdata, w.scale], list(w.shape))
    return "nf4", [w.quantized_data, w.quantized_scalers, w.quantization_factor, w.scaler_mean, w.nf4], \
        [*w.shape, w.block_size, w.scaler_block_size]


def frozen_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` through a quantized base weight (FrozenWeight or NF4Tensor), in
    autocast's dtype where it is on (as `F.linear` would be); a `LoRALinear`'s base matmul."""
    dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
    kind, parts, sizes = _stored_parts(weight)
    y = _frozen_linear(x.to(dtype), kind, parts, sizes, weight.dtype)
    if bias is None:
        return y
    return y + (bias if kind == "nf4" else bias.to(y.dtype))  # nf4: as torchao's NF4 linear adds it


# --------------------------------------------------------------------------------------------
# int8 and bf16: a frozen weight in fewer bytes, dequantized per matmul


class FrozenWeight(torch.Tensor):
    """A frozen weight stored as `data` (int8 or bf16) with per-row `scale` (int8; None for bf16),
    seen as a tensor of the original dtype and shape. `F.linear` on it is `frozen_linear`;
    converting it to a dtype (`.float()`, `.to(dtype)`) dequantizes."""

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype):
        return torch.Tensor._make_wrapper_subclass(cls, data.shape, dtype=dtype, device=data.device,
                                                   requires_grad=False)

    def __init__(self, data, scale, dtype):
        self.qdata, self.scale = data, scale

    @classmethod
    @torch.no_grad()
    def quantize(cls, w: torch.Tensor, kind: str) -> FrozenWeight:
        if kind == "bf16":
            return cls(w.detach().to(torch.bfloat16), None, w.dtype)
        wide = w.detach().float()
        scale = wide.abs().amax(dim=1).clamp_min(1e-12) / 127.0
        q = torch.round(wide / scale.unsqueeze(1)).clamp_(-127, 127).to(torch.int8)
        return cls(q, scale, w.dtype)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        dtype = dtype or self.dtype
        if self.scale is None:
            return self.qdata.to(dtype)
        return (self.qdata.float() * self.scale.unsqueeze(1)).to(dtype)

    def __tensor_flatten__(self):
        return (["qdata"] if self.scale is None else ["qdata", "scale"]), self.dtype

    @staticmethod
    def __tensor_unflatten__(inner, dtype, outer_size, outer_stride):
        return FrozenWeight(inner["qdata"], inner.get("scale"), dtype)

    def __repr__(self):
        kind = "bf16" if self.scale is None else "int8"
        return f"FrozenWeight({kind}, {tuple(self.shape)}, dequantized to {self.dtype})"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            return frozen_linear(args[0], args[1], args[2] if len(args) > 2 else kwargs.get("bias"))
        if func is torch.Tensor.float:  # even to its own dtype: a plain tensor, as NF4's
            return args[0].dequantize(torch.float32)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        aten = torch.ops.aten
        w = args[0]
        if func in (aten.detach.default, aten.alias.default):
            return FrozenWeight(w.qdata, w.scale, w.dtype)
        if func is aten.clone.default:
            return FrozenWeight(w.qdata.clone(), None if w.scale is None else w.scale.clone(), w.dtype)
        if func is aten._to_copy.default:  # .float(), .to(dtype), .to(device)
            out = w.dequantize(kwargs.get("dtype") or w.dtype)
            return out.to(kwargs["device"]) if kwargs.get("device") is not None else out
        if func is aten._has_compatible_shallow_copy_type.default:
            return False
        if func is aten.empty_like.default:  # `to_empty`: a placeholder from the meta device, filled later
            device = kwargs.get("device") or w.device
            return FrozenWeight(torch.empty_like(w.qdata, device=device),
                                None if w.scale is None else torch.empty_like(w.scale, device=device), w.dtype)
        raise NotImplementedError(f"{func} on a quantized frozen base weight (adapter.base_dtype): it is frozen and "
                                  "only dequantized for matmuls")


# --------------------------------------------------------------------------------------------
# Quantizing a model's adapted linears


def _lora_linears(model: nn.Module):
    from scaletrain.model.lora import LoRALinear

    return [(n, m) for n, m in model.named_modules() if isinstance(m, LoRALinear)]


def _nf4(w: torch.Tensor):
    from scaletrain.quant import import_torchao

    import_torchao("adapter.base_dtype=nf4", modules=("torchao.quantization",))
    from torchao.quantization import to_nf4

    return to_nf4(w.detach().contiguous(), NF4_BLOCK, nf4_scaler_block(w.shape[1]))


def quantized(w: torch.Tensor, base_dtype: str) -> torch.Tensor:
    """`w` (a plain full or local tensor) as `base_dtype` stores it."""
    return _nf4(w) if base_dtype == "nf4" else FrozenWeight.quantize(w, base_dtype)


@torch.no_grad()
def quantize_base(model: nn.Module, base_dtype: str, device: torch.device | None = None,
                  dtype: torch.dtype | None = None) -> int:
    """Replace the base weight of every adapted linear of `model` (materialized, plain tensors)
    by its `base_dtype` form, frozen, one weight at a time: put on `device` and cast to `dtype`
    first (where given), as moving and casting the whole model would; the bytes the bases take now."""
    stored = 0
    for _, m in _lora_linears(model):
        w = m.weight.data.to(device)
        _put_base(m, quantized(w if dtype is None else w.to(dtype), base_dtype))
        del w  # the dense weight goes before the next one comes
        stored += stored_bytes(m.weight)
    return stored


def _put_base(m: nn.Module, weight: torch.Tensor) -> None:
    """A LoRALinear's base becomes `weight` (quantized), frozen, and its matmul `frozen_linear`."""
    m.weight = nn.Parameter(weight, requires_grad=False)
    m.base_linear = frozen_linear


def stored_bytes(t: torch.Tensor) -> int:
    from scaletrain.memory import holding_tensors

    return sum(x.untyped_storage().nbytes() for x in holding_tensors(t))


def is_quantized(t: torch.Tensor) -> bool:
    """Whether `t` (a plain tensor or a DTensor's local one) is a quantized base weight."""
    local = t.to_local() if hasattr(t, "to_local") else t
    return isinstance(local, FrozenWeight) or type(local).__name__ == "NF4Tensor"


@torch.no_grad()
def bases_on_meta(model: nn.Module, base_dtype: str, dtype: torch.dtype | None = None) -> None:
    """The adapted linears' bases (on the meta device) become `base_dtype` placeholders of `dtype`
    (default: the weight's), so that materializing the model (`to_empty`) allocates them quantized
    and no dense base ever exists whole: `fill_bases` (one process) or `fill_nf4_shards` (ZeRO-3)
    then quantize one weight at a time. Under ZeRO-3 they are NF4 tensors of fp32, which FSDP2
    shards by rows and all-gathers as NF4."""
    for _, m in _lora_linears(model):
        empty = torch.empty(m.weight.shape, dtype=dtype or m.weight.dtype, device="meta")
        _put_base(m, quantized(empty, base_dtype))


@torch.no_grad()
def fill_bases(model: nn.Module, full_value, base_dtype: str) -> None:
    """One process (DDP, ZeRO-1/2 alike): each adapted linear's placeholder (`bases_on_meta`, then
    materialized) replaced by its whole base weight (`full_value(canonical name)`, fp32) quantized,
    one weight at a time: the fp32 value put on the device, rounded to the placeholder's dtype
    there, quantized there — the numbers a dense model materialized, cast and then quantized holds."""
    from scaletrain.model.names import canonical_name

    for name, m in _lora_linears(model):
        p = m.weight
        device = p.quantized_data.device if type(p).__name__ == "NF4Tensor" else p.device
        dense = full_value(canonical_name(f"{name}.weight" if name else "weight"))
        dense = dense.to(device=device, dtype=torch.float32).to(p.dtype)
        _put_base(m, quantized(dense, base_dtype))
        del p, dense  # the placeholder and the dense value go before the next weight comes


@torch.no_grad()
def fill_nf4_shards(model: nn.Module, full_value) -> set[str]:
    """Under FSDP2: quantize each adapted linear's whole base weight (`full_value(canonical
    name)`, fp32) and keep this rank's rows of the NF4 codes and scales: the same numbers as one
    process quantizing the whole tensor. Returns the canonical names filled."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from scaletrain.model.names import canonical_name

    done = set()
    for name, m in _lora_linears(model):
        p = m.weight
        cname = canonical_name(f"{name}.weight" if name else "weight")
        whole = _nf4(full_value(cname).to(device=_local(p).quantized_data.device, dtype=p.dtype))
        local = _local(p)
        if isinstance(p, DTensor):
            shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
            rows = shape[0]
            if rows != local.shape[0] or rows == 0 or p.shape[0] % rows:
                raise ConfigError(f"adapter.base_dtype=nf4: {cname}'s shard of {rows} rows does not split its "
                                  f"{p.shape[0]} rows evenly; choose a number of ranks that divides them")
            whole = whole.split(rows)[offset[0] // rows]
        for attr in ("quantized_data", "quantized_scalers", "quantization_factor"):  # FSDP's storages
            getattr(local, attr).copy_(getattr(whole, attr))
        local.scaler_mean, local.nf4 = whole.scaler_mean.clone(), whole.nf4.clone()  # never sharded
        done.add(cname)
    return done


def _local(p):
    """The tensor a DTensor holds, itself (`to_local()` may return a new NF4Tensor object, whose
    attributes FSDP2 would never see)."""
    return p._local_tensor if hasattr(p, "_local_tensor") else p
