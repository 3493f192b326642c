"""Low-rank adapters on frozen linears: LoRA (Hu et al. 2021) and DoRA (Liu et al. 2024).

A chosen `nn.Linear` (out x in) is replaced in place by a `LoRALinear` that keeps the base's
`weight` and `bias` under their names (`layers.0.attn.wq.weight` stays that: loading, init from
(seed, name) and checkpoints see the base as before), frozen, and adds

    lora_a          (rank, in)   normal(0, 1/rank), from (seed, name) like every weight
    lora_b          (out, rank)  zeros: the adapted model starts exactly at the base
    lora_magnitude  (out,)       DoRA only: the base weight's row norms (`init_magnitudes`, once
                                 the base holds its values)

LoRA:  y = W x + b + B (s · A dropout(x)),                  s = alpha / rank (alpha / √rank: rslora)
DoRA:  y = m / ‖W + s·B A‖_row · (W + s·B A) x + b, the norm treated as a constant in backward
       (the paper's section 4.3: it saves the norm's graph at little cost in accuracy).

Which linears: `adapter.targets`, comma-separated module names, fnmatch patterns on them, or a
group (`all-linear`: every linear in the repeated blocks, no output head or MoE router;
`attention`, `mlp`). The module is plain torch: any nn.Module's linears can be adapted.
"""

from __future__ import annotations

import contextlib
import fnmatch
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from scaletrain.errors import ConfigError
from scaletrain.vocab import ADAPTER_GROUPS, did_you_mean

ADAPTER_LEAVES = ("lora_a", "lora_b", "lora_magnitude")
# the name segments that put a linear in the attention or the MLP group (scaletrain's own names,
# and those common in other models: Hugging Face's self_attn, feed_forward)
_GROUP_WORDS = {"attention": ("attn", "attention", "self_attn"), "mlp": ("mlp", "ffn", "feed_forward", "shared")}
_BLOCK_LISTS = ("layers", "h", "blocks")  # where the repeated blocks live (as parallelize.find_blocks)


@dataclass(frozen=True)
class AdapterSpec:
    """What adapters to add: adapter.* of the config, as plain values (the model package reads no config)."""

    kind: str = "lora"  # "lora" | "dora"
    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: str = "all-linear"
    rslora: bool = False

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)

    @classmethod
    def of(cls, cfg) -> AdapterSpec | None:
        """From an AdapterConfig; None for adapter.kind=none."""
        if cfg.kind == "none":
            return None
        return cls(cfg.kind, cfg.rank, cfg.alpha, cfg.dropout, cfg.targets, cfg.rslora)


class LoRALinear(nn.Linear):
    """A frozen linear plus a trainable low-rank update (see the module's docstring)."""

    # the base's matmul, F.linear's signature: a quantized base (QLoRA) brings its own, which
    # dequantizes inside (scaletrain.quant.frozen_base.frozen_linear)
    base_linear = staticmethod(F.linear)
    enabled = True  # False inside adapters_off()

    def __init__(self, base: nn.Linear, spec: AdapterSpec):
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight  # the same Parameter objects: names and values unchanged
        self.bias = base.bias
        for p in (self.weight, self.bias):
            if p is not None:
                p.requires_grad_(False)
        device = base.weight.device
        self.lora_a = nn.Parameter(torch.empty(spec.rank, self.in_features, device=device))
        self.lora_b = nn.Parameter(torch.empty(self.out_features, spec.rank, device=device))
        self.lora_magnitude = nn.Parameter(torch.empty(self.out_features, device=device)) \
            if spec.kind == "dora" else None
        self.scale = spec.scale
        self.dropout = nn.Dropout(spec.dropout) if spec.dropout else nn.Identity()

    def delta_weight(self) -> torch.Tensor:
        """s · B A, the update of the base weight (out x in)."""
        return self.scale * (self.lora_b @ self.lora_a)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.enabled:  # adapters_off: the base alone (a preference run's reference)
            rows = x.reshape(-1, x.shape[-1])
            return self.base_linear(rows, self.weight, self.bias).view(*x.shape[:-1], self.out_features)
        dropping = self.training and isinstance(self.dropout, nn.Dropout)
        if self.lora_magnitude is None:
            return self._lora(x, dropping)
        xd = self.dropout(x) if dropping else x
        update = F.linear(F.linear(xd, self.lora_a.to(x.dtype)), self.lora_b.to(x.dtype))
        y = F.linear(x, self.weight)
        yd = F.linear(xd, self.weight) if dropping else y  # dropout: the magnitude's part sees the dropped input
        with torch.no_grad():  # the row norm is a constant of backward (DoRA, section 4.3)
            norm = torch.linalg.vector_norm(self.weight.float() + self.delta_weight().float(), dim=1)
        g = (self.lora_magnitude.float() / norm).to(y.dtype)
        out = y + (g - 1) * yd + g * self.scale * update
        return out if self.bias is None else out + self.bias

    def _lora(self, x: torch.Tensor, dropping: bool) -> torch.Tensor:
        """W x + b + B (s · A dropout(x)). The scale multiplies the rank-r intermediate, not the wide
        output, and B's product is accumulated into the base's output by its matmul (addmm_): no
        pass over the wide output, forward or backward, beyond the two matmuls. The rows are
        flattened first so that the base's output is no view and may be added into in place."""
        rows = x.reshape(-1, x.shape[-1])
        y = self.base_linear(rows, self.weight, self.bias)
        h = F.linear(self.dropout(rows) if dropping else rows, self.lora_a.to(x.dtype)) * self.scale
        y = y.addmm_(h.to(y.dtype), self.lora_b.to(y.dtype).t())
        return y.view(*x.shape[:-1], y.shape[-1])

    @torch.no_grad()
    def merged_weight(self) -> torch.Tensor:
        """The plain linear's weight that computes what this one does (no dropout)."""
        w = self.weight.float() + self.delta_weight().float()
        if self.lora_magnitude is not None:
            w = w * (self.lora_magnitude.float() / torch.linalg.vector_norm(w, dim=1)).unsqueeze(1)
        return w.to(self.weight.dtype)

    def extra_repr(self) -> str:
        dora = ", dora" if self.lora_magnitude is not None else ""
        return f"{self.in_features}, {self.out_features}, rank={self.lora_a.shape[0]}, scale={self.scale:g}{dora}"


@contextlib.contextmanager
def adapters_off(modules):
    """The adapted linears of `modules` compute their frozen base alone inside this block (the model the
    adapters started from: a preference run's reference, with no second copy of the weights)."""
    adapted = [m for module in modules for m in module.modules() if isinstance(m, LoRALinear)]
    for m in adapted:
        m.enabled = False
    try:
        yield
    finally:
        for m in adapted:
            del m.enabled  # back to the class's True


def is_adapter_param(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in ADAPTER_LEAVES


def adapter_init_rule(base_rule, spec: AdapterSpec):
    """`base_rule` (name -> InitRule) extended to the adapters' parameters."""
    from scaletrain.model.transformer import InitRule

    def rule(name: str):
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "lora_a":
            return InitRule("normal", 1.0 / spec.rank)
        if leaf == "lora_b":
            return InitRule("zeros")
        if leaf == "lora_magnitude":
            return InitRule("ones")  # a placeholder: init_magnitudes sets the base's row norms
        return base_rule(name)

    return rule


def _in_blocks(name: str) -> bool:
    parts = name.split(".")
    return any(p in _BLOCK_LISTS for p in parts[:-1])


def _in_group(name: str, group: str) -> bool:
    if name.rsplit(".", 1)[-1] == "router" or not _in_blocks(name):  # a MoE router stays frozen and plain
        return False
    if group == "all-linear":
        return True
    return any(p in _GROUP_WORDS[group] for p in name.split(".")[:-1] + [name.rsplit(".", 1)[-1]])


def resolve_targets(model: nn.Module, targets: str) -> list[str]:
    """The names of `model`'s linears that `targets` chooses, in the model's order. A target that
    chooses none is a ConfigError that lists the linears there are."""
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    chosen: set[str] = set()
    for target in (t.strip() for t in targets.split(",")):
        if not target:
            continue
        if target in ADAPTER_GROUPS:
            hits = [n for n in linears if _in_group(n, target)]
        else:
            hits = [n for n in linears if n == target or fnmatch.fnmatchcase(n, target)]
        if not hits:
            shown = _list_linears(linears)
            misspelt = target not in ADAPTER_GROUPS and not any(c in target for c in ".*?[")  # not a group, a pattern
            hint = did_you_mean(target, ADAPTER_GROUPS) if misspelt else ""
            raise ConfigError(f"adapter.targets: {target!r} matches no linear of the model{hint}; its linears are "
                              f"{shown or 'none'}; name them, a pattern such as \"layers.*.attn.wq\", or a group: "
                              f"{', '.join(ADAPTER_GROUPS)}")
        chosen.update(hits)
    return [n for n in linears if n in chosen]


def _list_linears(names: list[str]) -> str:
    """Every linear's name, a block's index written * (each block's linears said once)."""
    blocks = sorted({int(p) for n in names for p in n.split(".") if p.isdigit()})
    shapes = list(dict.fromkeys(".".join("*" if p.isdigit() else p for p in n.split(".")) for n in names))
    if not shapes:
        return ""
    return ", ".join(shapes) + (f" (* = block {blocks[0]} to {blocks[-1]})" if blocks else "")


def apply_adapters(model: nn.Module, spec: AdapterSpec) -> list[str]:
    """Replace the targeted linears of `model` by LoRALinear (in place, on whatever device the model
    is: the meta device before materializing) and freeze every other parameter. Returns the
    adapted linears' names."""
    names = resolve_targets(model, spec.targets)
    for name in names:
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        base = getattr(parent, leaf)
        if isinstance(base, LoRALinear):
            continue
        if type(base) is not nn.Linear:  # a converted linear (fake-quantized, float8) computes otherwise
            raise ConfigError(f"adapter.kind={spec.kind}: {name} is a {type(base).__name__}, not a plain linear; "
                              "adapters go on plain linears (train.qat=none, precision.mode other than fp8)")
        setattr(parent, leaf, LoRALinear(base, spec))
    for pname, p in model.named_parameters():
        p.requires_grad_(is_adapter_param(pname))
    return names


@torch.no_grad()
def init_magnitudes(model: nn.Module) -> None:
    """DoRA: each magnitude starts at its base weight's row norms (with B = 0, ‖W + s·B A‖ = ‖W‖), so
    the adapted model starts at the base. A row-sharded weight (ZeRO-3, a column-parallel linear)
    and its magnitude hold the same rows on each rank: the local rows' norms are the local magnitude;
    a weight whose columns are split (a row-parallel linear) sums its rows' squares over that split."""
    for m in model.modules():
        if isinstance(m, LoRALinear) and m.lora_magnitude is not None:
            w, mag = m.weight, m.lora_magnitude
            w_local = w.to_local() if hasattr(w, "to_local") else w
            mag_local = mag.to_local() if hasattr(mag, "to_local") else mag
            norms = torch.linalg.vector_norm(w_local.float(), dim=1)
            for axis, placement in enumerate(getattr(w, "placements", ())):
                if placement.is_shard(1):  # the row's other columns are on the other ranks of this axis
                    squares = norms.square()
                    torch.distributed.all_reduce(squares, group=w.device_mesh.get_group(axis))
                    norms = squares.sqrt()
            if norms.shape != mag_local.shape:
                raise ValueError(f"DoRA magnitude shard {tuple(mag_local.shape)} does not hold the rows of its "
                                 f"weight shard {tuple(w_local.shape)}")
            mag_local.copy_(norms.to(mag_local.dtype))


def adapter_summary(model: nn.Module) -> tuple[int, int]:
    """(trainable, frozen) parameter counts."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trainable, sum(p.numel() for p in model.parameters()) - trainable
