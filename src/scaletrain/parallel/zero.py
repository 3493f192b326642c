"""ZeRO stages 1 and 2 (Rajbhandari et al. 2020) for replicated parameters.

Every data-parallel rank keeps the whole model (4 bytes/param in fp32) but owns only a 1/N
shard of each parameter's rows: the optimizer steps that shard (its Adam moments, 8 bytes/param,
exist for the shard only), and the updated shards are all-gathered back into every replica.

* Stage 1 (optimizer state sharded): full gradients are kept (4 B/param), accumulated over the
  micro-steps of a step and reduce-scattered once, after the last one.   8Ψ + 8Ψ/N per rank
* Stage 2 (gradients sharded too): every micro-step reduce-scatters each bucket as soon as backward
  has filled it, adds the reduced rows into the shard's gradient (which accumulates over the
  micro-steps) and frees the bucket's full gradients at once. Only the shard's gradient outlives a
  bucket, so at any moment a rank holds the shard gradients plus the gradients of the bucket
  being filled and at most two buckets' send buffers.                    4Ψ + 12Ψ/N per rank

Communication per step without accumulation is that of DDP, 2Ψ(N-1)/N per rank, split into a
reduce-scatter of gradients (during backward, bucketed, overlapped) and an all-gather of
parameters (after the step). With K micro-steps per step, stage 1 still reduce-scatters once
(it trades memory for communication) while stage 2 reduce-scatters K times: Ψ(N-1)/N · (K + 1)
per rank per step (under HSDP, K all-reduces of the shard over replicas too). Under pipeline
parallelism the schedule runs every micro-batch's backward in one go, so both stages reduce once
after it (stage 2 then holds full gradients during the schedule, as stage 1 does).

Shards are DTensors placed `Shard(0)` over the `dp_shard` axis (and `Replicate()` over
`dp_replicate` for HSDP), exactly as FSDP2 places ZeRO-3's, so optimizer checkpoints reshard
between every stage. In fp32 a shard is a view into its replica's rows (no copy); with
`bf16-true` (fp32 master shards for bf16 replicas) it is its own fp32 tensor.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from scaletrain.parallel.data_parallel import DataParallel


@dataclass
class _Slot:
    """One parameter's place in a bucket."""

    name: str
    param: nn.Parameter  # the replica (a DTensor under tensor parallelism)
    data: torch.Tensor  # its local values: the whole parameter, or this rank's tensor-parallel part
    shard: nn.Parameter  # the DTensor this rank's optimizer steps
    rows: int  # the parameter's rows (dim 0)
    chunk_rows: int  # rows per rank, padded (ceil(rows / N))
    row_numel: int
    is_view: bool  # the shard is a view into the replica's rows (no master copy)
    offset: int = 0  # in the bucket's per-rank segment

    @property
    def chunk_numel(self) -> int:
        return self.chunk_rows * self.row_numel


@dataclass
class _Bucket:
    slots: list[_Slot] = field(default_factory=list)
    shard_numel: int = 0  # per-rank segment size
    ready: int = 0
    work: dist.Work | None = None
    out: torch.Tensor | None = None
    recv: torch.Tensor | None = None  # gloo: every rank's contribution to this rank's segment
    flat: torch.Tensor | None = None  # what this rank sends, alive until the reduction is done


class ZeroDataParallel(DataParallel):
    """ZeRO-1/2: replicated parameters (this rank's chunks), sharded optimizer state (stage 1)
    and gradients (stage 2)."""

    def __init__(self, chunks: list[nn.Module], mesh: DeviceMesh, *, stage: int, dp_replicate: int,
                 bucket_mb: float, master_dtype: torch.dtype | None = None,
                 params: list[tuple[str, nn.Parameter]] | None = None, own_shards: bool = False):
        if stage not in (1, 2):
            raise ValueError(f"ZeroDataParallel handles stages 1 and 2, not {stage}")
        super().__init__(chunks)
        # `params`: the ones this engine reduces and shards (default: all of the chunks'; expert
        # parallelism gives the experts to an engine of their own, on its mesh)
        named_params, bucket_bytes = params if params is not None else self.named_params, int(bucket_mb * 2**20)
        self.zero = self.stage = stage
        self.shard_group = mesh["dp_shard"].get_group()
        self.n = mesh["dp_shard"].size()
        self.rank = mesh["dp_shard"].get_local_rank()
        self.rep_group = mesh["dp_replicate"].get_group() if dp_replicate > 1 else None
        self.dp = self.n * dp_replicate
        if dp_replicate > 1:
            self.shard_mesh = mesh["dp_replicate", "dp_shard"]
            placements = (Replicate(), Shard(0))
        else:
            self.shard_mesh = mesh["dp_shard"]
            placements = (Shard(0),)
        self.sync = True  # reduce gradients in this backward (False on non-final micro-steps)
        # gloo's reduce-scatter sends the whole buffer from every rank; an all-to-all followed by
        # a local sum sends the (N-1)/N a reduce-scatter should (NCCL's is already optimal)
        self.all_to_all = dist.get_backend(self.shard_group) == "gloo"

        slots = [self._slot(name, p, mesh, dp_replicate, placements, master_dtype, own_shards)
                 for name, p in named_params]
        self.slots = slots
        self.buckets = self._buckets(slots, bucket_bytes)
        self._bucket_of = {id(s.param): b for b in self.buckets for s in b.slots}
        self._next = 0  # buckets are launched in order, the same on every rank
        self._in_flight: list[_Bucket] = []
        self._hooks = [s.param.register_post_accumulate_grad_hook(self._grad_ready) for s in slots]
        # stage 2 keeps no full gradient between micro-steps: each micro-step's backward
        # reduce-scatters into the shards. A pipeline schedule runs all its micro-batches'
        # backwards inside one micro_step(last=False), so there it reduces once, after them.
        pipelined = "pp" in (mesh.mesh_dim_names or ()) and mesh["pp"].size() > 1
        self.reduce_every_micro_step = stage == 2 and not pipelined

    def _slot(self, name: str, p: nn.Parameter, mesh, dp_replicate: int, placements, master_dtype,
              own_shards: bool) -> _Slot:
        """Parameter `p`'s shard on this rank: rows [rank × ceil(rows / n), ...) of its first dimension,
        a view of the replica (or its own fp32 master copy), as a DTensor of the whole's shape."""
        data = _local(p.detach())
        rows = data.shape[0] if data.ndim else 1
        chunk_rows = math.ceil(rows / self.n)
        start, stop = min(rows, self.rank * chunk_rows), min(rows, (self.rank + 1) * chunk_rows)
        local = data.view(rows, -1)[start:stop].view(stop - start, *data.shape[1:])
        dtype = master_dtype or p.dtype
        is_view = dtype == p.dtype and not own_shards  # (own_shards: the replicas are freed between uses)
        if not is_view:
            local = local.to(dtype=dtype, copy=True)  # its own fp32 master copy
        mesh_of, where = self._placement(p, mesh, dp_replicate, placements)
        shard = nn.Parameter(DTensor.from_local(local, mesh_of, where, run_check=False,
                                                shape=p.shape, stride=p.stride()))
        return _Slot(name, p, data, shard, rows, chunk_rows, data[0].numel() if data.ndim else 1, is_view)

    def _buckets(self, slots: list[_Slot], bucket_bytes: int) -> list[_Bucket]:
        """The slots cut into buckets of about `bucket_bytes` of full gradient each, in reverse order:
        gradients of the last layers are ready first."""
        buckets, bucket = [], _Bucket()
        for slot in reversed(slots):
            elem = slot.data.element_size()
            if bucket.slots and (bucket.shard_numel + slot.chunk_numel) * self.n * elem > bucket_bytes:
                buckets.append(bucket)
                bucket = _Bucket()
            slot.offset = bucket.shard_numel
            bucket.slots.append(slot)
            bucket.shard_numel += slot.chunk_numel
        if bucket.slots:
            buckets.append(bucket)
        return buckets

    def _placement(self, p, mesh, dp_replicate, dp_placements):
        """Where a shard lives. A tensor-parallel (or expert-parallel) parameter's shard is sharded
        on both axes: our rows of its part on its axis (`tp`, or `ep`). When that axis also split
        the rows, those are strided rows of the whole (as FSDP2 places them)."""
        if not isinstance(p, DTensor):
            return self.shard_mesh, dp_placements
        from torch.distributed.tensor.placement_types import _StridedShard

        (tp_placement,) = p.placements
        tp, axis = p.device_mesh.size(), p.device_mesh.mesh_dim_names[0]
        row_split = tp_placement.is_shard() and tp_placement.dim == 0
        dp_placement = _StridedShard(0, split_factor=tp) if row_split else Shard(0)
        if dp_replicate > 1:
            return mesh["dp_replicate", "dp_shard", axis], (Replicate(), dp_placement, tp_placement)
        return mesh["dp_shard", axis], (dp_placement, tp_placement)

    @property
    def named_optim_params(self) -> list[tuple[str, nn.Parameter]]:
        """The shards: what the optimizer steps."""
        return [(s.name, s.shard) for s in self.slots]

    @contextlib.contextmanager
    def micro_step(self, last: bool):
        self.sync = last or self.reduce_every_micro_step
        yield
        if self.reduce_every_micro_step:
            self._reduce()  # this micro-batch's gradients are in the shards now

    def finish_gradients(self) -> None:
        if not self.reduce_every_micro_step:
            self._reduce()

    def after_optimizer_step(self) -> None:
        self._gather_parameters()

    # ---- backward: bucketed reduce-scatter, overlapped with the rest of backward

    def _grad_ready(self, param: nn.Parameter) -> None:
        if not self.sync:
            return
        bucket = self._bucket_of[id(param)]
        bucket.ready += 1
        while self._next < len(self.buckets) and self.buckets[self._next].ready == len(self.buckets[self._next].slots):
            self._launch(self.buckets[self._next])
            self._next += 1

    def _launch(self, bucket: _Bucket) -> None:
        # like DDP, at most two buckets' buffers in flight: finish the oldest before sending another
        while len(self._in_flight) >= 2:
            self._complete(self._in_flight.pop(0))
        slot0 = bucket.slots[0]
        dtype = torch.float32 if slot0.shard.dtype == torch.float32 else slot0.data.dtype
        # (N, shard_numel): row r is what rank r receives; each parameter's rows split into N
        # chunks of chunk_rows, the last ones zero-padded
        flat = torch.zeros(self.n, bucket.shard_numel, dtype=dtype, device=slot0.data.device)
        for s in bucket.slots:
            if s.param.grad is None:
                continue  # unused parameter: contributes zeros
            g = _local_grad(s.param).reshape(s.rows, -1)
            chunks = flat[:, s.offset:s.offset + s.chunk_numel].view(self.n, s.chunk_rows, s.row_numel)
            whole, rest = divmod(s.rows, s.chunk_rows)
            chunks[:whole] = g[:whole * s.chunk_rows].view(whole, s.chunk_rows, s.row_numel)
            if rest:
                chunks[whole, :rest] = g[whole * s.chunk_rows:]
            if self.stage == 2:
                s.param.grad = None  # stage 2: the full gradient is not kept
        bucket.flat = flat
        self._in_flight.append(bucket)
        if self.all_to_all:
            bucket.recv = torch.empty_like(flat)
            bucket.work = dist.all_to_all_single(bucket.recv.view(-1), flat.view(-1), group=self.shard_group,
                                                 async_op=True)
        else:
            bucket.out = torch.empty(bucket.shard_numel, dtype=dtype, device=flat.device)
            bucket.work = dist.reduce_scatter_single(bucket.out, flat.view(-1), group=self.shard_group,
                                                     async_op=True)

    def _reduce(self) -> None:
        """Reduce what the last backward(s) left and wait for every bucket: once per step (stage 1,
        and stage 2 under pipelining) or once per micro-step (stage 2)."""
        while self._next < len(self.buckets):  # buckets with unused parameters
            self._launch(self.buckets[self._next])
            self._next += 1
        while self._in_flight:
            self._complete(self._in_flight.pop(0))
        self._next = 0

    def _complete(self, bucket: _Bucket) -> None:
        """Wait for one bucket's reduction and hand each of its shards the averaged gradient."""
        bucket.work.wait()
        if bucket.recv is not None:
            bucket.out, bucket.recv = bucket.recv.sum(0), None
        if self.rep_group is not None:  # HSDP: sum the shards over the replicas too
            dist.all_reduce(bucket.out, group=self.rep_group)
        # every rank's loss carries a factor dp (see the trainer): each reduction, of one
        # micro-step or of the whole step, is divided once, so the accumulated sum is the mean
        bucket.out.div_(self.dp)
        for s in bucket.slots:
            local_rows = s.shard.to_local().shape[0]
            reduced = bucket.out[s.offset:s.offset + s.chunk_numel].view(s.chunk_rows, *s.data.shape[1:])
            reduced = reduced[:local_rows]
            if self.stage == 1 and s.is_view and s.param.grad is not None:
                # stage 1 keeps the full gradient: the reduced shard goes into its own rows,
                # and the shard's gradient is a view of them (no extra memory)
                view = _row_slice(_local(s.param.grad), self.rank * s.chunk_rows, local_rows)
                view.copy_(reduced)
                reduced = view
            if self.stage == 2 and s.shard.grad is not None:  # an earlier micro-step's: accumulate
                s.shard.grad.to_local().add_(reduced)
                continue
            grad = reduced.to(dtype=s.shard.dtype)
            s.shard.grad = DTensor.from_local(grad, s.shard.device_mesh, s.shard.placements, run_check=False,
                                              shape=s.shard.shape, stride=s.shard.stride())
        bucket.work, bucket.out, bucket.flat, bucket.ready = None, None, None, 0

    # ---- after the optimizer step: every replica gets the updated rows

    @torch.no_grad()
    def _gather_parameters(self) -> None:
        for bucket in self.buckets:
            slot0 = bucket.slots[0]
            dtype, device = slot0.data.dtype, slot0.data.device
            mine = torch.zeros(bucket.shard_numel, dtype=dtype, device=device)
            for s in bucket.slots:
                local = s.shard.to_local()
                mine[s.offset:s.offset + local.numel()] = local.reshape(-1)
            everyone = torch.empty(self.n, bucket.shard_numel, dtype=dtype, device=device)
            dist.all_gather_single(everyone.view(-1), mine, group=self.shard_group)
            for s in bucket.slots:
                rows = everyone[:, s.offset:s.offset + s.chunk_numel].reshape(self.n * s.chunk_rows, s.row_numel)
                s.data.view(s.rows, -1).copy_(rows[:s.rows])

    def zero_grad(self, optimizer) -> None:
        for s in self.slots:
            s.param.grad = None
            s.shard.grad = None


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _local_grad(param: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter's gradient, laid out like the parameter. Under tensor
    parallelism a gradient can arrive partial (summed over tp ranks only when redistributed) or
    replicated where the parameter is sharded (the vocabulary-parallel embedding)."""
    g = param.grad
    if isinstance(g, DTensor):
        if g.placements != param.placements:
            g = g.redistribute(placements=param.placements)
        g = g.to_local()
    return g.detach()


def _row_slice(t: torch.Tensor, start: int, rows: int) -> torch.Tensor:
    total = t.shape[0] if t.ndim else 1
    start = min(start, total)
    return t.view(total, -1)[start:start + rows].view(rows, *t.shape[1:])
