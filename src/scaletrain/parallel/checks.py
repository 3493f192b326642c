"""What the machine must have for a job: a C++ compiler for torch.compile on the CPU. Checked where
the job is settled, once, before any rank starts (scaletrain.launch.job), and again by parallelize
for a Trainer built directly. Nothing here builds a model: a launcher imports this, not the model's
modules (torch's compiler among them, a second of start-up). Which combinations of settings a job
may run is scaletrain.legality's.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from scaletrain.errors import ConfigError

if TYPE_CHECKING:
    import torch


def check_compiler(device: torch.device) -> None:
    """torch.compile on the CPU builds its kernels with a C++ compiler; without one the first
    step fails deep inside inductor. Look for it the way inductor does (env CXX, else g++ on
    PATH) and refuse up front."""
    if device.type != "cpu":
        return
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler
    except ImportError:  # a PyTorch that finds its compiler some other way: let it
        return
    try:
        get_cpp_compiler()  # cached: inductor gets the same answer later
    except Exception:  # noqa: BLE001 - InvalidCxxCompiler, or a CXX that cannot even be started
        cxx = os.environ.get("CXX")
        looked = f"CXX={cxx!r}" if cxx is not None else "g++ on PATH (or env CXX)"
        raise ConfigError(f"train.compile=true on the CPU needs a C++ compiler and none works here (looked for "
                          f"{looked}); set train.compile=false, or install g++ / point CXX at a compiler") from None
