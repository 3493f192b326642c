"""Adapter fine-tuning as a technique of the run (the layers: scaletrain.model.lora).

parallelize() adapts the chunks (`adapt`) after qat/fp8 and before tensor parallelism and the
data-parallel engines, so the engines see a frozen base and trainable adapters; the optimizer
then takes the trainable parameters alone, and a checkpoint's weights are the adapters'.

`BaseFingerprint` is the step hook that makes such a checkpoint safe to resume: it saves the
base's name and checksum in trainer.json ("adapter" entry) and, on resume, refuses a base that
differs, in one line, before any tensor is read. The checksum is of where the base comes from,
not of its materialized shards (the same on every layout, and no gather of a sharded model):

    model.init_from   sha256 of its safetensors files' bytes (read once, on rank 0)
    from seed         sha256 of the seed and the model config (the (seed, name) rule makes the base)
    a custom module   sha256 of its frozen parameters' names and bytes (its weights are its own)
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from scaletrain.errors import CheckpointError, ConfigError
from scaletrain.hooks import StepHook
from scaletrain.model.lora import AdapterSpec, adapter_init_rule, apply_adapters, init_magnitudes, is_adapter_param

if TYPE_CHECKING:
    from scaletrain.config import JobConfig
    from scaletrain.runtime import Runtime


def quantize_plan(cfg: JobConfig, chunks: list[nn.Module], shards: int) -> str | None:
    """The base_dtype the adapted linears' bases take (None: kept as the precision mode keeps
    them), their problems refused in one line first (`shards`: ZeRO-3's ranks, else 1)."""
    from scaletrain.model.lora import LoRALinear
    from scaletrain.quant.frozen_base import base_problems

    base = cfg.adapter.base_dtype
    if base == "auto" or cfg.adapter.kind == "none":
        return None
    linears = [(n, m) for chunk in chunks for n, m in chunk.named_modules() if isinstance(m, LoRALinear)]
    if errors := base_problems(base, linears, shards):
        raise ConfigError(errors[0])
    return base


def adapt(chunks: list[nn.Module], spec: AdapterSpec) -> str:
    """Adapters on every chunk, the rest frozen; what the run's log says of them."""
    names = [n for chunk in chunks for n in apply_adapters(chunk, spec)]
    trainable = sum(p.numel() for chunk in chunks for p in chunk.parameters() if p.requires_grad)
    total = sum(p.numel() for chunk in chunks for p in chunk.parameters())
    return (f"adapter.kind={spec.kind}: rank {spec.rank} on {len(names)} linears, scale {spec.scale:g}; "
            f"{trainable:,} trainable parameters ({100 * trainable / max(total, 1):.2f}% of {total:,}), the rest "
            "frozen: checkpoints hold the adapters, their optimizer state and the base's fingerprint")


def base_fingerprint(cfg: JobConfig, rt: Runtime | None = None) -> dict:
    """{"name", "sha256"} of the run's frozen base (see the module's docstring)."""
    source = cfg.model.init_from
    if not source:
        text = json.dumps({"seed": cfg.train.seed, "model": cfg.to_dict()["model"]}, sort_keys=True)
        return {"name": f"initialised from seed {cfg.train.seed}", "sha256": hashlib.sha256(text.encode()).hexdigest()}
    digest = None
    if rt is None or rt.rank == 0:
        from scaletrain.model.hf import _weight_files

        files, _ = _weight_files(Path(source))
        h = hashlib.sha256()
        for f in files:
            with open(f, "rb") as fh:
                while block := fh.read(1 << 24):
                    h.update(block)
        digest = h.hexdigest()
    return {"name": str(Path(source).resolve()), "sha256": rt.shared(digest) if rt is not None else digest}


@torch.no_grad()
def adapt_module(module: nn.Module, spec: AdapterSpec, seed: int) -> BaseFingerprint:
    """A custom nn.Module (with its own weights, the same on every rank): adapters on the linears
    `spec.targets` chooses, from (seed, name) like every weight, the rest frozen. Before any
    wrapper (activation checkpointing, compile, FSDP), so the names are the module's own."""
    from scaletrain.parallel.init import init_weights

    apply_adapters(module, spec)
    init_weights(module, seed, adapter_init_rule(lambda name: None, spec), only=is_adapter_param)
    init_magnitudes(module)
    h = hashlib.sha256()
    for name, p in module.named_parameters():
        if not p.requires_grad:
            h.update(name.encode())
            h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return BaseFingerprint(spec, {"name": f"the {type(module).__name__} given to the Trainer",
                                  "sha256": h.hexdigest()})


class BaseFingerprint(StepHook):
    """Saves the adapters' settings and the base's fingerprint; refuses to resume them onto another base."""

    phase = "the adapters' base check"
    key = "adapter"

    def __init__(self, spec: AdapterSpec, base: dict):
        self.spec, self.base = spec, base

    def state_dict(self) -> dict:
        s = self.spec
        return {"kind": s.kind, "rank": s.rank, "alpha": s.alpha, "targets": s.targets, "rslora": s.rslora,
                "base": self.base}

    def prepare_load(self, state: dict | None) -> None:
        if state is None:
            raise CheckpointError(f"adapter.kind={self.spec.kind}: the checkpoint holds a whole model, not adapters; "
                                  "to fine-tune it with adapters, export it (scaletrain export) and start a new run "
                                  "with model.init_from set to the export")
        saved = state["base"]
        if saved["sha256"] != self.base["sha256"]:
            raise CheckpointError(f"the checkpoint's adapters were trained on the base {saved['name']} (sha256 "
                                  f"{saved['sha256'][:12]}), but this run's base is {self.base['name']} (sha256 "
                                  f"{self.base['sha256'][:12]}); set model.init_from (and train.seed) to the base "
                                  "they were trained on")
