"""Data parallelism: every rank holds (a shard of) the model and sees different data.

`parallel.zero` picks the ZeRO stage (Rajbhandari et al. 2020); with fp32 AdamW (4 + 4 + 8
bytes per parameter Ψ) and N data-parallel ranks, model states per rank are:

| zero | what                                                     | bytes/rank    | engine                 |
|------|----------------------------------------------------------|---------------|------------------------|
| 0    | DDP: replicas, bucketed all-reduce overlapped with backward | 16Ψ        | torch DDP              |
| 1    | + optimizer state sharded                                | 8Ψ + 8Ψ/N     | `parallel.zero`        |
| 2    | + gradients sharded                                      | 4Ψ + 12Ψ/N    | `parallel.zero`        |
| 3    | + parameters sharded (FSDP, per block, with prefetch)    | 16Ψ/N         | FSDP2 `fully_shard`    |

Stages 0-2 send 2Ψ(N-1)/N values per rank per step; stage 3 sends 3Ψ(N-1)/N (parameters are
all-gathered again for backward). With `parallel.dp_replicate > 1`, stages 1-3 shard within a
group of `dp_shard` ranks and replicate across groups: HSDP.

Every strategy reduces the *average* gradient over data-parallel ranks, so the trainer scales
each rank's loss by the data-parallel size (the loss is already divided by the tokens of the
whole global batch).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from scaletrain.parallel.init import canonical_name


class DataParallel:
    """One data-parallel rank: nothing to synchronise."""

    zero = None

    def __init__(self, model: nn.Module):
        self.model = model  # what to call for forward (a wrapper, or the model itself)
        self.module = model  # the plain root module

    @property
    def named_params(self) -> list[tuple[str, nn.Parameter]]:
        return [(canonical_name(n), p) for n, p in self.module.named_parameters()]

    @property
    def named_optim_params(self) -> list[tuple[str, nn.Parameter]]:
        """The parameters the optimizer steps (shards under ZeRO-1/2)."""
        return self.named_params

    def micro_step(self, last: bool) -> contextlib.AbstractContextManager:
        """Context for one micro-batch's forward/backward; gradients sync only on the last."""
        return contextlib.nullcontext()

    def finish_gradients(self) -> None:
        """Called after the last backward of a step, before clipping and the optimizer."""

    def after_optimizer_step(self) -> None:
        """Called after the optimizer stepped."""

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.zero_grad(set_to_none=True)


class DDPDataParallel(DataParallel):
    """ZeRO-0: PyTorch DDP over the flattened data-parallel axis."""

    zero = 0

    def __init__(self, model: nn.Module, group: dist.ProcessGroup, bucket_mb: float, reduce_in_fp32: bool):
        from torch.nn.parallel import DistributedDataParallel as DDP

        # no broadcasts: weights are already equal (seeded by name) and the only buffers (rotary
        # tables) are computed the same on every rank
        ddp = DDP(model, process_group=group, bucket_cap_mb=bucket_mb, gradient_as_bucket_view=True,
                  init_sync=False, forward_sync_buffers=False)
        if reduce_in_fp32:  # bf16-true: sum bf16 gradients in fp32
            ddp.register_comm_hook(group, _fp32_allreduce_hook)
        super().__init__(ddp)
        self.module = model

    def micro_step(self, last: bool):
        return contextlib.nullcontext() if last else self.model.no_sync()


def _fp32_allreduce_hook(group, bucket):  # no annotations: DDP checks them at run time
    buffer = bucket.buffer()
    wide = buffer.float().div_(group.size())
    fut = dist.all_reduce(wide, group=group, async_op=True).get_future()

    def narrow(f):
        buffer.copy_(f.value()[0])
        return buffer

    return fut.then(narrow)


class ZeroDataParallelStrategy(DataParallel):
    """ZeRO-1/2: replicated parameters, sharded optimizer state (and gradients)."""

    def __init__(self, model: nn.Module, mesh, *, stage: int, dp_replicate: int, bucket_mb: float,
                 master_dtype: torch.dtype | None):
        from scaletrain.parallel.zero import ZeroDataParallel

        super().__init__(model)
        self.zero = stage
        self.engine = ZeroDataParallel(self.named_params, mesh, stage=stage, dp_replicate=dp_replicate,
                                       bucket_bytes=int(bucket_mb * 2**20), master_dtype=master_dtype)

    @property
    def named_optim_params(self):
        return self.engine.named_shards

    @contextlib.contextmanager
    def micro_step(self, last: bool):
        self.engine.sync = last
        yield

    def finish_gradients(self) -> None:
        self.engine.finish_gradients()

    def after_optimizer_step(self) -> None:
        self.engine.gather_parameters()

    def zero_grad(self, optimizer) -> None:
        self.engine.zero_grad()


class FSDPDataParallel(DataParallel):
    """ZeRO-3: FSDP2, already applied to the model before materialization."""

    zero = 3


def apply_fsdp(model: nn.Module, dp_mesh, *, param_dtype: torch.dtype | None, offload: bool) -> None:
    """Shard each transformer block, then the root (embedding, final norm, head), over `dp_mesh`
    (1-D: FSDP; 2-D replicate × shard: HSDP). Gradients are reduced in fp32. Each block's
    parameters are all-gathered one block ahead of use, forward and backward."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    offload_policy = CPUOffloadPolicy() if offload else OffloadPolicy()
    blocks = list(model.layers.values())
    for block in blocks:
        fully_shard(block, mesh=dp_mesh, mp_policy=mp, offload_policy=offload_policy, reshard_after_forward=True)
    # the root's parameters are used first in forward and last in backward: keep them
    # gathered across the step instead of gathering them twice
    fully_shard(model, mesh=dp_mesh, mp_policy=mp, offload_policy=offload_policy, reshard_after_forward=False)
    for prev, nxt in zip(blocks, blocks[1:]):
        prev.set_modules_to_forward_prefetch([nxt])
        nxt.set_modules_to_backward_prefetch([prev])
    if dist.get_backend(dp_mesh.get_group(dp_mesh.ndim - 1)) == "gloo":
        for module in [*blocks, model]:
            module.set_custom_reduce_scatter(AllToAllReduceScatter())


class AllToAllReduceScatter:
    """Reduce-scatter as all-to-all plus a local sum: on gloo, whose own reduce-scatter sends the
    whole buffer from every rank, this sends the (N-1)/N of it that a reduce-scatter should.
    (Implements FSDP2's `ReduceScatter` comm interface.)"""

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        n = group.size()
        received = torch.empty_like(input_tensor)
        dist.all_to_all_single(received, input_tensor, group=group)
        torch.sum(received.view(n, -1), dim=0, out=output_tensor)
        if op == dist.ReduceOp.AVG:
            output_tensor.div_(n)
        elif op != dist.ReduceOp.SUM:
            raise ValueError(f"AllToAllReduceScatter supports SUM and AVG, not {op}")
        return None


# --------------------------------------------------------------------------------------------
# Measured model-state bytes and the global gradient norm


def _storage_bytes(tensors) -> int:
    from scaletrain.optim import tensor_bytes

    return tensor_bytes(t for t in tensors if t is not None)


def model_state_bytes(strategy: DataParallel, optim_params: list[nn.Parameter],
                      optimizer: torch.optim.Optimizer | None) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state held by this rank, from live tensors
    (each storage counted once: ZeRO shards that are views of replicas add nothing)."""
    from scaletrain.optim import optimizer_state_bytes

    params = [p for _, p in strategy.named_params] + list(optim_params)
    return {
        "params": _storage_bytes(params),
        "grads": _storage_bytes(p.grad for p in params),
        "optimizer": optimizer_state_bytes(optimizer) if optimizer is not None else 0,
    }


def global_grad_norm(params: list[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of all gradients, over every shard on every rank."""
    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads, foreach=True)
    if isinstance(norm, DTensor):  # sharded gradients: the norm is partial until reduced
        norm = norm.full_tensor()
    return norm


def clip_gradients(params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    norm = global_grad_norm(params)
    if max_norm and max_norm < float("inf"):
        torch.nn.utils.clip_grads_with_norm_([p for p in params if p.grad is not None], max_norm, norm,
                                             foreach=True)
    return norm
