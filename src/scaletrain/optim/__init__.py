"""Optimizers (the learning-rate schedule is scaletrain.schedule).

Optimizer state per parameter (fp32 parameters):

| optimizer  | state                                  | bytes/param | note                              |
|------------|----------------------------------------|-------------|-----------------------------------|
| adamw      | m, v in fp32                           | 8           | fused kernel where the device has it |
| sgd        | momentum buffer in fp32                | 4           | needs more tuning than AdamW      |
| adamw8bit  | m, v block-quantized to 8 bits         | ~2          | torchao; small tensors stay fp32  |
| adafactor  | row and column second moments, no m    | << 1        | Shazeer & Stern 2018; torch.optim |
| muon       | matrices: momentum in fp32; the rest: AdamW's | 4 / 8    | optim/muon.py, optim/whole.py     |
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor

from scaletrain.config import OptimConfig
from scaletrain.vocab import OPTIMIZERS, unknown


def param_groups(named_params: Iterable[tuple[str, torch.nn.Parameter]], weight_decay: float) -> list[dict]:
    """Decay matrices (linear weights, embeddings); leave norms and biases alone. Sharded
    (DTensor) and plain parameters go into separate groups: a multi-tensor kernel takes one kind."""
    groups: dict[tuple[bool, bool], list] = {}
    for _, p in named_params:
        groups.setdefault((p.ndim >= 2, isinstance(p, DTensor)), []).append(p)
    return [{"params": ps, "weight_decay": weight_decay if decay else 0.0}
            for (decay, _), ps in sorted(groups.items(), key=lambda kv: (not kv[0][0], kv[0][1]))]


def build_optimizer(cfg: OptimConfig, named_params: list[tuple[str, torch.nn.Parameter]],
                    lr: float, device: torch.device) -> torch.optim.Optimizer:
    """The optimizer of cfg over `named_params` (in that order: checkpoints rely on it)."""
    groups = param_groups(named_params, cfg.weight_decay)
    impl = _kernel_flags(cfg.implementation, named_params)
    if cfg.name == "adamw":
        return torch.optim.AdamW(groups, lr=lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, **impl)
    if cfg.name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=cfg.momentum, **impl)
    if cfg.name == "adafactor":
        return torch.optim.Adafactor(groups, lr=lr, foreach=True)
    if cfg.name == "adamw8bit":
        return _adamw8bit(groups, lr, cfg)
    if cfg.name == "muon":
        return _muon(cfg, named_params, lr)
    raise unknown("optimizer", cfg.name, OPTIMIZERS)


def _muon(cfg: OptimConfig, named_params: list[tuple[str, torch.nn.Parameter]], lr: float) -> torch.optim.Optimizer:
    from scaletrain.optim.muon import Muon, describe_split, muon_split

    muon, rest = muon_split(named_params, cfg.muon)
    fallback = None
    if rest:
        fallback = torch.optim.AdamW(param_groups(rest, cfg.weight_decay), lr=lr, betas=(cfg.beta1, cfg.beta2),
                                     eps=cfg.eps, **_kernel_flags(cfg.implementation, rest))
    # Muon's peak learning rate over AdamW's: the schedule scales both
    ratio = cfg.muon.lr / cfg.lr if cfg.muon.lr and cfg.lr else 1.0
    optimizer = Muon([p for _, p in muon], fallback, lr=lr, cfg=cfg.muon, weight_decay=cfg.weight_decay,
                     lr_ratio=ratio)
    optimizer.note = describe_split(muon, rest)
    return optimizer


def _kernel_flags(implementation: str, named_params) -> dict:
    if implementation == "fused":
        return {"fused": True}
    if implementation == "foreach":
        return {"foreach": True}
    if implementation == "loop":
        return {"foreach": False}
    # auto: the fused kernel runs on CUDA and on CPU for plain tensors; sharded (DTensor)
    # parameters on CPU take the foreach path, which every backend supports.
    devices = {(p.to_local() if isinstance(p, DTensor) else p).device.type for _, p in named_params}
    sharded = any(isinstance(p, DTensor) for _, p in named_params)
    if devices == {"cuda"} or (devices == {"cpu"} and not sharded):
        return {"fused": True}
    return {"foreach": True}


def _adamw8bit(groups: list[dict], lr: float, cfg: OptimConfig) -> torch.optim.Optimizer:
    from scaletrain.quant import import_torchao  # without the GPU-kernel noise of a CPU machine

    import_torchao("optim.name=adamw8bit", modules=("torchao.optim",))
    from torchao.optim import AdamW8bit

    return AdamW8bit(groups, lr=lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        if isinstance(group["lr"], torch.Tensor):  # torchao keeps lr as a tensor (compiled step)
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr


def get_lr(optimizer: torch.optim.Optimizer) -> float:
    return float(optimizer.param_groups[0]["lr"])


@torch.no_grad()
def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's state tensors (so that a checkpoint, or a peer's state, can be loaded
    into them) by taking one step with zero gradients and a zero learning rate; the weights do not move."""
    if all(p in optimizer.state and optimizer.state[p] for g in optimizer.param_groups for p in g["params"]):
        return
    saved_lr = get_lr(optimizer)
    set_lr(optimizer, 0.0)
    for g in optimizer.param_groups:
        for p in g["params"]:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
    optimizer.step()
    set_lr(optimizer, saved_lr)
    optimizer.zero_grad(set_to_none=True)


def _inner_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors that hold a (possibly subclassed or sharded) tensor's data."""
    if isinstance(t, DTensor):
        t = t.to_local()
    # (a parameter may be a subclass too: FSDP's fp8 all-gather keeps torchao's fp8-casting weight)
    if hasattr(t, "__tensor_flatten__") and type(t) is not torch.Tensor:
        names, _ = t.__tensor_flatten__()
        return [x for n in names for x in _inner_tensors(getattr(t, n))]
    return [t]


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the storages behind `tensors` on this rank, each storage counted once."""
    seen: dict[int, int] = {}
    for t in tensors:
        for inner in _inner_tensors(t):
            st = inner.untyped_storage()
            seen[st.data_ptr() or id(st)] = st.nbytes()
    return sum(seen.values())


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of optimizer state on this rank, measured from the live tensors."""
    return tensor_bytes(v for state in optimizer.state.values() for v in state.values()
                        if isinstance(v, torch.Tensor))
