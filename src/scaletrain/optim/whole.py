"""Whole matrices for Newton-Schulz, whatever shards them (optim.name=muon).

Muon orthogonalises each hidden matrix as a whole: Newton-Schulz multiplies the matrix by its
transpose, so a shard's result is not a shard of the whole's. What holds a slice here is a DTensor:
ZeRO-1/2's and FSDP's shards (`Shard(0)` over dp_shard, `Replicate()` over dp_replicate), tensor
parallelism's parts (`Shard(0)` or `Shard(1)` over tp), both at once (FSDP's `_StridedShard` over
dp_shard with tp's placement), and expert parallelism's experts (`Shard(0)` of the expert dimension).

A matrix's *matrix axes* are the mesh axes whose placement cuts one of its last two dimensions.

* None (a plain tensor, a DDP replica, an expert tensor cut only between experts, a replicated part):
  every matrix is whole on this rank and is orthogonalised here. Costs nothing to send; under DDP each
  replica computes the same result.
* One or two (ZeRO-1/2, FSDP, HSDP's shard axis, tp; or ZeRO/FSDP with tp): the ranks of those axes
  (one axis's group, or the group of the two flattened into one) share the matrices out. Each matrix
  gets an *owner* among them, chosen to balance Newton-Schulz's FLOPs (largest first, to the least
  loaded rank). One all-to-all sends every rank's piece of each matrix to its owner, the owner
  assembles the whole, runs Newton-Schulz, and a second all-to-all sends each rank its piece of the
  result. A piece is a block of the whole (a set of rows by a set of columns, in DTensor's order:
  strided under FSDP with tp), so two axes are no harder than one: n is then dp_shard x tp. Per step
  each matrix of M values moves (M - the owner's piece) values each way, 2M(n-1)/n for even pieces,
  in optim.muon.ns_dtype (bf16 by default: 2 bytes a value, which is what Newton-Schulz rounds to
  first, so nothing is lost); the FLOPs are split n ways.

HSDP's replicate axis and the expert and pipeline axes are never matrix axes: each replica group,
expert owner and stage works on its own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from scaletrain.model.flops import ns_flops

Orthogonalize = Callable[[torch.Tensor], torch.Tensor]  # (A, B) -> (A, B), in the exchange's dtype


@dataclass
class _Matrix:
    """One matrix of a parameter (a parameter of more than two dimensions is a stack of them)."""

    param: int  # index in the exchange's parameter list
    batch: int  # which matrix of the parameter's local stack
    rows: int
    cols: int
    owner: int = 0  # group rank


@dataclass
class _Axis:
    """The parameters whose matrix axes span the same process group (one mesh axis, or two flattened)."""

    group: dist.ProcessGroup
    n: int
    me: int
    params: list[int] = field(default_factory=list)
    # per parameter, each group rank's piece: (row indices, column indices) of the whole
    pieces: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)
    matrices: list[_Matrix] = field(default_factory=list)


def _matrix_axes(p: torch.Tensor) -> list[int]:
    """The mesh axes whose placement cuts one of p's last two dimensions."""
    if not isinstance(p, DTensor):
        return []
    return [i for i, pl in enumerate(p.placements)
            if isinstance(pl, (Shard, _StridedShard)) and pl.dim >= p.ndim - 2]  # (_StridedShard is no Shard)


def _group_over(mesh, axes: list[int]) -> dist.ProcessGroup:
    """The ranks of `mesh` that differ from this one only along `axes`: one axis's own group, or (ZeRO or
    FSDP with tp) the group of those axes flattened into one. The flattened mesh is made once, on every
    rank of the mesh at the same call (every rank builds the optimizer over the same kinds of matrices:
    a pipeline stage's blocks are cut as every other stage's), and kept by the root mesh after that."""
    if len(axes) == 1:
        return mesh.get_group(axes[0])
    names = mesh.mesh_dim_names
    assert names is not None, "a mesh that shards a matrix over two axes has named axes (Layout.build_mesh)"
    return mesh[tuple(names[a] for a in axes)]._flatten().get_group()


def _restricted(pl, dim: int):
    """The placement, on a 1-D tensor of dimension `dim`'s indices: kept where it cuts `dim`."""
    if isinstance(pl, _StridedShard) and pl.dim == dim:
        return _StridedShard(0, split_factor=pl.split_factor)
    if isinstance(pl, Shard) and pl.dim == dim:
        return Shard(0)
    return Replicate()


def piece_indices(p: DTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, cols): which rows and columns of each whole matrix this rank's piece of p holds, as
    DTensor places them (the same rule ZeRO's and FSDP's shards follow). No communication."""
    out = []
    for dim in (p.ndim - 2, p.ndim - 1):
        index = torch.arange(p.shape[dim], device=p.to_local().device)
        where = [_restricted(pl, dim) for pl in p.placements]
        out.append(distribute_tensor(index, p.device_mesh, where, src_data_rank=None).to_local())
    return out[0], out[1]


def _stacked(t: torch.Tensor) -> torch.Tensor:
    """t (..., A, B) as (matrices, A, B); a piece may be empty."""
    return t.reshape(t.shape[:-2].numel(), *t.shape[-2:])


def _each(stack: torch.Tensor, fn: Orthogonalize) -> torch.Tensor:
    """fn on each matrix of a stack (..., A, B), which may hold none."""
    if stack.ndim == 2:
        return fn(stack)
    done = [fn(m) for m in _stacked(stack)]
    return torch.stack(done).view(stack.shape) if done else torch.empty_like(stack)


class WholeMatrices:
    """Runs a function on the whole of every matrix of `params` and hands each rank its piece of the
    result. Built once, on every rank at once (it exchanges which piece each rank holds)."""

    def __init__(self, params: list[torch.Tensor], dtype: torch.dtype):
        self.dtype = dtype
        self.local: list[int] = []  # whole on this rank
        self.axes: list[_Axis] = []
        self.sent_bytes = 0  # values this rank sent to others (not to itself), accumulated
        by_group: dict[int, _Axis] = {}
        for i, p in enumerate(params):
            axes = _matrix_axes(p)
            if not axes:
                self.local.append(i)
                continue
            group = _group_over(p.device_mesh, axes)
            if id(group) not in by_group:
                by_group[id(group)] = _Axis(group, group.size(), dist.get_rank(group))
            by_group[id(group)].params.append(i)
        self.axes = list(by_group.values())
        for axis in self.axes:
            self._plan(axis, params)

    def _plan(self, axis: _Axis, params: list[torch.Tensor]) -> None:
        """Every rank's pieces (one all-gather of indices, now) and the owners, balanced by FLOPs."""
        mine = [piece_indices(params[i]) for i in axis.params]
        everyone: list = [None] * axis.n
        dist.all_gather_object(everyone, [(r.tolist(), c.tolist()) for r, c in mine], group=axis.group)
        for k, i in enumerate(axis.params):
            device = params[i].to_local().device  # (indices where the matrices are: a GPU's, under NCCL)
            axis.pieces[i] = [tuple(torch.tensor(ix, dtype=torch.long, device=device) for ix in ranks[k])
                              for ranks in everyone]
            p = params[i]
            stack = p.to_local().shape[:-2].numel()  # the same on every rank of the axis
            axis.matrices += [_Matrix(i, b, p.shape[-2], p.shape[-1]) for b in range(stack)]
        load = [0.0] * axis.n
        for m in sorted(axis.matrices, key=lambda m: -ns_flops(m.rows, m.cols)):  # (stable: ties in order)
            m.owner = min(range(axis.n), key=lambda r: load[r])
            load[m.owner] += ns_flops(m.rows, m.cols)

    def apply(self, updates: list[torch.Tensor], fn: Orthogonalize, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """fn on each whole matrix of `updates` (this rank's pieces, laid out as `params`' local parts);
        returns this rank's pieces of the results, in self.dtype."""
        out: list[torch.Tensor | None] = [None] * len(updates)
        for i in self.local:
            out[i] = _each(updates[i].to(self.dtype), fn)
        for axis in self.axes:
            self._exchange(axis, updates, fn, out)
        return out

    def _exchange(self, axis: _Axis, updates, fn, out) -> None:
        """Pieces to owners, Newton-Schulz on the owners, pieces of the results back."""
        me = axis.me
        send = [[] for _ in range(axis.n)]
        for m in axis.matrices:
            send[m.owner].append(self._matrix_piece(updates[m.param], m))
        received = self._all_to_all(axis, send, [[self._piece_numel(axis, m, r) for m in axis.matrices
                                                 if m.owner == me] for r in range(axis.n)])
        results = [[] for _ in range(axis.n)]
        owned = [m for m in axis.matrices if m.owner == me]
        for k, m in enumerate(owned):
            whole = torch.empty(m.rows, m.cols, dtype=self.dtype, device=updates[m.param].device)
            for r in range(axis.n):
                rows, cols = axis.pieces[m.param][r]
                whole[rows[:, None], cols[None, :]] = received[r][k].view(len(rows), len(cols))
            done = fn(whole)
            for r in range(axis.n):
                rows, cols = axis.pieces[m.param][r]
                results[r].append(done[rows][:, cols])
        back = self._all_to_all(axis, results, [[self._piece_numel(axis, m, me) for m in axis.matrices
                                                 if m.owner == r] for r in range(axis.n)])
        for i in axis.params:
            out[i] = torch.empty(updates[i].shape, dtype=self.dtype, device=updates[i].device)
        for r in range(axis.n):
            for m, piece in zip([m for m in axis.matrices if m.owner == r], back[r], strict=True):
                target = out[m.param]
                _stacked(target)[m.batch].copy_(piece.view(target.shape[-2:]))

    def _matrix_piece(self, u: torch.Tensor, m: _Matrix) -> torch.Tensor:
        return _stacked(u)[m.batch].to(self.dtype)

    @staticmethod
    def _piece_numel(axis: _Axis, m: _Matrix, r: int) -> int:
        rows, cols = axis.pieces[m.param][r]
        return len(rows) * len(cols)

    def _all_to_all(self, axis: _Axis, send: list[list[torch.Tensor]], recv_numels: list[list[int]]):
        """send[r]: the tensors for group rank r; returns, per rank r, the tensors r sent here (of
        recv_numels[r] values each). One all_to_all_single of the flat concatenations."""
        device = next((t.device for ts in send for t in ts), torch.device("cpu"))
        flat = torch.cat([t.reshape(-1) for ts in send for t in ts]) if any(send) else torch.empty(0)
        flat = flat.to(device=device, dtype=self.dtype)
        in_splits = [sum(t.numel() for t in ts) for ts in send]
        out_splits = [sum(ns) for ns in recv_numels]
        got = torch.empty(sum(out_splits), dtype=self.dtype, device=device)
        # as bytes: gloo's all-to-all takes no bfloat16
        size = flat.element_size()
        dist.all_to_all_single(got.view(torch.uint8), flat.view(torch.uint8), [k * size for k in out_splits],
                               [k * size for k in in_splits], group=axis.group)
        self.sent_bytes += (sum(in_splits) - in_splits[axis.me]) * size
        result, start = [], 0
        for ns in recv_numels:
            mine = []
            for k in ns:
                mine.append(got[start:start + k])
                start += k
            result.append(mine)
        return result
