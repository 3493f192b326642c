"""Numerical precision, with Lightning's names.

| mode       | parameters | matmuls         | saves                         | costs                         |
|------------|------------|-----------------|-------------------------------|-------------------------------|
| 32-true    | fp32       | fp32            | nothing                       | the slowest matmuls           |
| tf32       | fp32       | TF32 (CUDA)     | ~8x matmul speed on Ampere+   | 10-bit mantissa in matmuls    |
| 16-mixed   | fp32       | fp16 (autocast) | half the activation memory    | loss scaling; overflow skips  |
| bf16-mixed | fp32       | bf16 (autocast) | half the activation memory    | 8-bit mantissa in matmuls     |
| bf16-true  | bf16       | bf16            | half of weights + activations | an fp32 master copy (4 B/param)|
| fp8        | fp32       | fp8 / bf16 [1]  | 2x matmul peak, large layers  | casts, scales; 3-bit mantissa  |

[1] fp8 for the block linears that quant/layers.py's rule converts (sm89+ GPUs), bf16 for the rest.

fp16 has a narrow exponent, so small gradients underflow to zero: `16-mixed` multiplies the loss
by a large scale before backward and divides the gradients by it after, lowering the scale
(and skipping the step) when a gradient overflows and raising it after a run of clean steps.
`bf16-true` keeps an fp32 master copy of the weights for the optimizer, because adding a small
update to a bf16 weight often rounds back to the same weight.
`fp8` is bf16-mixed whose large block linears run their three matmuls in float8 through torchao
(scaletrain.quant.fp8 says how, quant/layers.py which layers).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from scaletrain.config import PrecisionConfig
from scaletrain.hooks import StepHook

COMPUTE_DTYPES = {
    "32-true": torch.float32,
    "tf32": torch.float32,
    "16-mixed": torch.float16,
    "bf16-mixed": torch.bfloat16,
    "bf16-true": torch.bfloat16,
    "fp8": torch.bfloat16,  # around the float8 linears (which cast to fp8 themselves)
}


class Precision:
    """What a precision mode means for the model, the autocast region and the optimizer."""

    def __init__(self, cfg: PrecisionConfig, device: torch.device):
        if cfg.mode not in COMPUTE_DTYPES:
            raise ValueError(f"unknown precision mode {cfg.mode!r}")
        self.mode = cfg.mode
        self.device = device
        self.compute_dtype = COMPUTE_DTYPES[cfg.mode]
        # bf16-true stores parameters in bf16; every other mode keeps fp32 parameters
        self.param_dtype = torch.bfloat16 if cfg.mode == "bf16-true" else torch.float32
        self.uses_autocast = cfg.mode in ("16-mixed", "bf16-mixed", "fp8")
        self.master_weights = cfg.mode == "bf16-true"
        self.scaler = DynamicLossScaler(cfg) if cfg.mode == "16-mixed" else None

    def configure_backends(self) -> None:
        """Process-wide matmul settings; called once at start-up."""
        precision = "high" if self.mode == "tf32" else "highest"
        torch.set_float32_matmul_precision(precision)
        if self.device.type == "cuda":
            torch.backends.cudnn.allow_tf32 = self.mode == "tf32"

    def autocast(self) -> contextlib.AbstractContextManager:
        if not self.uses_autocast:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

    def loss_scale(self) -> float | None:
        """The scale the loss is multiplied by in place of the data-parallel mean's factor dp (fp16's
        loss scaler multiplies dp back when it unscales the gradients); None in other modes."""
        return self.scaler.scale if self.scaler is not None else None

    def note(self) -> str | None:
        """A line for the log when a mode behaves differently on this device."""
        if self.mode == "tf32" and self.device.type != "cuda":
            return "precision tf32: TF32 is a CUDA matmul mode; on CPU matmuls stay fp32 (same as 32-true)"
        return None


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class DynamicLossScaler(StepHook):
    """Dynamic loss scaling for fp16 (Micikevicius et al. 2018, "Mixed Precision Training").

    Works for plain and sharded (DTensor) gradients: each rank checks its own gradients for
    inf/NaN and the verdict is all-reduced over `group`, so every rank skips the same steps.

    As a step hook it comes last (it unscales the gradients every other hook has reduced): the loss
    is multiplied by the scale in place of the data-parallel mean's factor dp (`Precision.loss_scale`), the
    gradients unscaled and checked (`reduce_gradients`, dp multiplied back), a step with an overflow
    skipped and the scale backed off or grown (`agree_to_skip`); its state is the checkpoint's
    "scaler" entry.
    """

    phase = "the fp16 unscale and overflow check"
    key = "scaler"

    def __init__(self, cfg: PrecisionConfig):
        self.scale = float(cfg.init_scale)
        self.growth_factor = cfg.growth_factor
        self.backoff_factor = cfg.backoff_factor
        self.growth_interval = cfg.growth_interval
        self.min_scale = cfg.min_scale
        self.clean_steps = 0  # consecutive steps without overflow
        self.skipped_steps = 0  # total steps skipped for overflow
        self.times = 1.0  # the data-parallel ranks the gradients were averaged over (the run sets it)
        self.overflow = False  # the last step's gradients overflowed somewhere
        self.at_minimum = False  # ...with the scale already at its minimum (backing off cannot cure it)

    # ---- as the run's step hook ----

    def reduce_gradients(self, named) -> None:
        self.overflow = self.unscale_([p for _, p in named], times=self.times)

    def agree_to_skip(self, skip: bool) -> bool:
        self.at_minimum = self.update(self.overflow)  # back off, or grow
        return skip or self.overflow

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale

    @torch.no_grad()
    def unscale_(self, params: Iterable[torch.Tensor], group: dist.ProcessGroup | None = None,
                 times: float = 1.0) -> bool:
        """Divide gradients by the scale (and multiply by `times`) in place; True if any gradient
        anywhere is not finite."""
        grads: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for p in params:
            if p.grad is not None:
                g = _local(p.grad)
                grads.setdefault((g.device, g.dtype), []).append(g)
        found = torch.zeros(1)
        for (device, _), gs in grads.items():
            found_dev = torch.zeros(1, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(
                gs, found_dev, torch.full((1,), times / self.scale, device=device))
            found += found_dev.cpu()
        if dist.is_available() and dist.is_initialized():
            backend_device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
            found = found.to(backend_device)
            dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group)
        return bool(found.item() > 0)

    def update(self, found_inf: bool) -> bool:
        """Back off after an overflow, grow after growth_interval clean steps; returns whether the
        scale was already at its minimum (an overflow there cannot be cured by backing off)."""
        at_minimum = self.scale <= self.min_scale
        if found_inf:
            self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            self.clean_steps = 0
            self.skipped_steps += 1
        else:
            self.clean_steps += 1
            if self.clean_steps == self.growth_interval:
                self.scale *= self.growth_factor
                self.clean_steps = 0
        return at_minimum

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict | None) -> None:
        if not state:  # a checkpoint of a run without fp16
            return
        self.scale = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])
        self.skipped_steps = int(state["skipped_steps"])


class MasterWeights(StepHook):
    """fp32 master copies of bf16 parameters for `bf16-true`.

    The optimizer steps the fp32 copies; after each step they are rounded into the bf16 model.
    Costs 4 bytes per parameter (the copy) plus an fp32 gradient per parameter at step time.
    As a step hook it comes first: the other hooks reduce the masters' gradients.
    """

    phase = "the gradients to the fp32 master weights"

    def __init__(self, params: list[tuple[str, torch.nn.Parameter]]):
        params = [(n, p) for n, p in params if p.requires_grad]  # a frozen base keeps no master copy
        self.model_params = [p for _, p in params]
        self.master = [torch.nn.Parameter(_local_clone_fp32(p)) for p in self.model_params]
        self.named_master = [(n, m) for (n, _), m in zip(params, self.master)]

    @torch.no_grad()
    def grads_to_master(self) -> None:
        for p, m in zip(self.model_params, self.master):
            m.grad = None if p.grad is None else p.grad.float()
            p.grad = None

    @torch.no_grad()
    def master_to_model(self) -> None:
        for p, m in zip(self.model_params, self.master):
            p.copy_(m)

    def reduce_gradients(self, named) -> None:
        self.grads_to_master()

    def refresh_weights(self) -> None:
        self.master_to_model()


def _local_clone_fp32(p: torch.Tensor) -> torch.Tensor:
    return p.detach().float().clone()
