"""What a job's layout refuses, checked from its config alone where the job is settled, once and
before any rank starts (scaletrain.launch.job); parallelize checks again for a Trainer built
directly. Nothing here builds a model: a launcher imports this, not the model's modules (torch's
compiler among them, a second of start-up).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from scaletrain.errors import ConfigError
from scaletrain.parallel.adapters import check_adapters
from scaletrain.quant.fp8 import check_fp8_device

if TYPE_CHECKING:
    import torch

    from scaletrain.config import JobConfig


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


def check_techniques(cfg: JobConfig, lay) -> None:
    """The layouts QAT and fp8 refuse, checked where the job is settled, before any rank starts
    (one line, not one per rank); parallelize checks them again for a Trainer built directly."""
    if cfg.train.qat != "none":
        check_qat(cfg, lay)
    if cfg.precision.mode == "fp8":
        _fp8_layout(lay)
    if cfg.adapter.kind != "none":
        check_adapters(cfg, lay)


def check_qat(cfg: JobConfig, lay) -> None:
    """train.qat composes with data parallelism (DDP, ZeRO 0-3), every precision, accumulation,
    activation checkpointing and compile; tensor and pipeline parallelism are refused."""
    if lay.tp > 1:
        raise ConfigError(f"train.qat={cfg.train.qat} with parallel.tp={lay.tp}: torchao's fake-quantized linear "
                          "quantizes whole weight rows and token rows, which tensor parallelism splits across ranks "
                          "(per-row scales would differ from the quantized model's); set parallel.tp=1")
    if lay.pp > 1:
        raise ConfigError(f"train.qat={cfg.train.qat} with parallel.pp={lay.pp}: not supported yet (the pipeline "
                          "stages are untested with fake-quantized linears); set parallel.pp=1")


def check_fp8(lay, device: torch.device, emulate: bool) -> None:
    """fp8 composes with data parallelism (DDP and ZeRO-3 checked against one process; ZeRO-1/2
    and HSDP wrap the converted model like any other), accumulation, activation checkpointing,
    compile and checkpoints; the model-parallel axes are refused."""
    _fp8_layout(lay)
    check_fp8_device(device, emulate)


def _fp8_layout(lay) -> None:
    for axis, size, why in (("tp", lay.tp, "its column/row plans would need torchao's Float8ColwiseParallel and "
                             "Float8RowwiseParallel, which scaletrain does not apply yet"),
                            ("pp", lay.pp, "the pipeline stages are untested with float8 linears"),
                            ("cp", lay.cp, "context parallelism is untested with float8 linears")):
        if size > 1:
            raise ConfigError(f"precision.mode=fp8 with parallel.{axis}={size}: not supported yet ({why}); set "
                              f"parallel.{axis}=1 or train with precision.mode=bf16-mixed")
