"""A parameter's canonical name: the model's own, whatever wraps it.

PyTorch's wrappers insert parts into module names (activation checkpointing, compile, FSDP,
DDP); the canonical name leaves them out, so parameter names, checkpoint keys and the (seed, name)
initialisation do not change when a technique is switched on.
"""

from __future__ import annotations

WRAPPER_PARTS = ("_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module", "module")


def canonical_name(name: str) -> str:
    return ".".join(part for part in name.split(".") if part not in WRAPPER_PARTS)
