"""Quantization with torchao: post-training (ptq.py), quantization-aware training (qat.py), fp8
training (fp8.py, precision.mode=fp8), and which layers each converts (layers.py).

| scheme       | weights                 | activations             | size vs fp32 | where it pays            |
|--------------|-------------------------|-------------------------|--------------|--------------------------|
| int8-weight  | int8, a scale per row   | as they are (fp32/bf16) | ~1/4         | memory-bound decoding    |
| int8-dynamic | int8, a scale per row   | int8, a scale per token | ~1/4         | int8 matmul kernels      |
| int8-int4    | int4, a scale per 32    | int8, per token (asym.) | ~1/8         | edge runtimes (ExecuTorch)|

On a CPU without int8 kernels for these tensor types the quantized matmuls dequantize first and
run slower than fp32: the saving is memory and disk (docs/benchmarks.md has the figures).
"""

from __future__ import annotations

import logging
import warnings

from scaletrain.errors import ConfigError


def import_torchao(purpose: str, modules: tuple[str, ...] = ("torchao.quantization", "torchao.quantization.qat")):
    """`import torchao` without its import-time noise: on a machine without CUDA it logs one
    warning per GPU-only kernel library it cannot load, and torch logs a deprecation notice for
    an enum torchao registers. Neither is the user's business, so those two loggers are held at
    ERROR while torchao and `modules` import (and only then: later records pass), and the Python
    warning of that notice is filtered by its message. `purpose` names the option that needs
    torchao in the install hint."""
    quiet = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [log.level for log in quiet]
    for log in quiet:
        log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*is an Enum subclass.*")
            import importlib

            import torchao
            for name in modules:  # each registers its own enums with torch's pytree, which logs
                importlib.import_module(name)
    except ImportError:
        raise ConfigError(f"{purpose} needs torchao: pip install 'torchao>=0.18' "
                          "(or pip install 'scaletrain[lowmem]')") from None
    finally:
        for log, level in zip(quiet, levels):
            log.setLevel(level)
    return torchao
