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
all-gathered again for backward). With K micro-steps of gradient accumulation, stage 2 keeps its
memory promise by reduce-scattering every micro-step: Ψ(N-1)/N·(K+1) per rank per step. With
`parallel.dp_replicate > 1`, stages 1-3 shard within a group of `dp_shard` ranks and replicate
across groups: HSDP.

Every strategy reduces the *average* gradient over data-parallel ranks, so the trainer scales
each rank's loss by the data-parallel size (the loss is already divided by the tokens of the
whole global batch).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from scaletrain.model.names import canonical_name


class DataParallel:
    """One data-parallel rank: nothing to synchronise. Holds this rank's model chunks (one, or
    several pipeline stages) and what forward goes through for each."""

    zero = None

    def __init__(self, chunks: list[nn.Module]):
        self.modules = list(chunks)  # the plain chunk roots
        self.models = list(chunks)  # what forward calls: a wrapper, or the chunk itself

    @property
    def model(self) -> nn.Module:
        return self.models[0]

    @property
    def module(self) -> nn.Module:
        return self.modules[0]

    @property
    def named_params(self) -> list[tuple[str, nn.Parameter]]:
        return [(canonical_name(n), p) for m in self.modules for n, p in m.named_parameters()]

    @property
    def named_optim_params(self) -> list[tuple[str, nn.Parameter]]:
        """The parameters the optimizer steps (shards under ZeRO-1/2): the trainable ones (a frozen
        base, under adapters, has no gradient and no optimizer state)."""
        return [(n, p) for n, p in self.named_params if p.requires_grad]

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
    """ZeRO-0: PyTorch DDP over the flattened data-parallel axis, one DDP per chunk."""

    zero = 0

    def __init__(self, chunks: list[nn.Module], group: dist.ProcessGroup, bucket_mb: float, reduce_in_fp32: bool):
        from torch.nn.parallel import DistributedDataParallel as DDP

        super().__init__(chunks)
        self.models = []
        for chunk in chunks:
            # no broadcasts: weights are already equal (seeded by name) and the only buffers
            # (rotary tables) are computed the same on every rank
            ddp = DDP(chunk, process_group=group, bucket_cap_mb=bucket_mb, gradient_as_bucket_view=True,
                      init_sync=False, forward_sync_buffers=False)
            if reduce_in_fp32:  # bf16-true: sum bf16 gradients in fp32
                ddp.register_comm_hook(group, _fp32_allreduce_hook)
            self.models.append(ddp)

    def micro_step(self, last: bool):
        stack = contextlib.ExitStack()
        if not last:
            for ddp in self.models:
                stack.enter_context(ddp.no_sync())
        return stack


def _fp32_allreduce_hook(group, bucket):  # no annotations: DDP checks them at run time
    buffer = bucket.buffer()
    wide = buffer.float().div_(group.size())
    fut = dist.all_reduce(wide, group=group, async_op=True).get_future()

    def narrow(f):
        buffer.copy_(f.value()[0])
        return buffer

    return fut.then(narrow)


class FSDPDataParallel(DataParallel):
    """ZeRO-3: FSDP2, already applied to the chunks before materialization. Gradients are
    reduce-scattered after every micro-batch (accumulating into the shards: no full-size
    gradient is kept between micro-batches)."""

    zero = 3


class ReplicateDataParallel(DataParallel):
    """ZeRO-0 for tensor-parallel (DTensor) parameters, which DDP cannot take: PyTorch's
    FSDP2-based `replicate`, all-reducing each block's gradients as soon as they are ready."""

    zero = 0

    def micro_step(self, last: bool):
        for module in self.modules:
            for m in module.modules():
                if hasattr(m, "set_requires_gradient_sync"):
                    m.set_requires_gradient_sync(last, recurse=False)
        return contextlib.nullcontext()


def apply_replicate(chunk: nn.Module, dp_mesh, *, param_dtype: torch.dtype | None, blocks=None,
                    ignored_params: set | None = None) -> None:
    """Replicate each block and the chunk root over `dp_mesh` (gradient all-reduce, fp32).
    `ignored_params`: left alone (expert parallelism's experts, which have an engine of their own)."""
    from torch.distributed._composable.replicate_with_fsdp import replicate
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for block in chunk.layers.values() if blocks is None else blocks:
        replicate(block, mesh=dp_mesh, mp_policy=mp, ignored_params=ignored_params)
    replicate(chunk, mesh=dp_mesh, mp_policy=mp, ignored_params=ignored_params)


def apply_fsdp(model: nn.Module, dp_mesh, *, param_dtype: torch.dtype | None, offload: bool, blocks=None,
               ignored_params: set | None = None) -> None:
    """Shard each transformer block, then the root (embedding, final norm, head), over `dp_mesh`
    (1-D: FSDP; 2-D replicate × shard: HSDP). Gradients are reduced in fp32. Each block's
    parameters are all-gathered one block ahead of use, forward and backward. `ignored_params`:
    left alone (expert parallelism's experts, which have an engine of their own)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    offload_policy = CPUOffloadPolicy() if offload else OffloadPolicy()
    blocks = list(model.layers.values() if blocks is None else blocks)  # each wrapped on its own
    for block in blocks:
        fully_shard(block, mesh=dp_mesh, mp_policy=mp, offload_policy=offload_policy, reshard_after_forward=True,
                    ignored_params=ignored_params)
    # the root's parameters are used first in forward and last in backward: keep them
    # gathered across the step instead of gathering them twice
    fully_shard(model, mesh=dp_mesh, mp_policy=mp, offload_policy=offload_policy, reshard_after_forward=False,
                ignored_params=ignored_params)
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


def global_grad_norm(params: list[torch.Tensor], pp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The L2 norm of all gradients of the model, over every shard, stage and rank.

    Plain gradients and DTensor gradients (sharded by FSDP, ZeRO or tensor parallelism) are
    mixed freely: each contributes its local sum of squares, summed over the mesh axes it is
    sharded on (not those it is replicated on); pipeline stages then add theirs."""
    sums: dict[tuple, torch.Tensor] = {}
    device = None
    for p in params:
        g = p.grad
        if g is None:
            continue
        groups: tuple = ()
        if isinstance(g, DTensor):
            if any(pl.is_partial() for pl in g.placements):  # sum the partial values first
                g = g.redistribute(placements=[Replicate() if pl.is_partial() else pl for pl in g.placements])
            # sharded on an axis: anything but Replicate (FSDP + TP use _StridedShard, which is
            # not `is_shard()`)
            groups = tuple(g.device_mesh.get_group(i) for i, pl in enumerate(g.placements) if not pl.is_replicate())
            g = g.to_local()
        device = g.device
        sq = g.detach().float().pow(2).sum()
        sums[groups] = sums[groups] + sq if groups in sums else sq
    total = torch.zeros((), device=device or "cpu")
    for groups, sq in sums.items():
        for group in groups:
            dist.all_reduce(sq, group=group)
        total = total + sq
    if pp_group is not None:
        dist.all_reduce(total, group=pp_group)
    return total.sqrt()


@torch.no_grad()
def clip_gradients(params: list[torch.Tensor], max_norm: float, pp_group: dist.ProcessGroup | None = None,
                   copies: tuple[torch.Tensor, ...] = ()) -> torch.Tensor:
    """Scale all gradients so that their global norm is at most `max_norm` (0: only measure).
    A non-finite norm leaves the gradients as they are, so the caller can find the culprit.
    `copies`: parameters of `params` that another pipeline stage holds too (a tied embedding on
    the last stage): scaled, but counted in the norm once, there."""
    norm = global_grad_norm([p for p in params if not any(p is c for c in copies)], pp_group)
    if max_norm:
        coef = torch.where(torch.isfinite(norm), (max_norm / (norm + 1e-6)).clamp(max=1.0), 1.0)
        for p in params:
            if p.grad is not None:  # scaling each local piece scales the whole (also partial sums)
                (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).mul_(coef)
    return norm
