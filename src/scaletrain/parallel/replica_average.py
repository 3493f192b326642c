"""The mean over the workers (dp_replicate groups) of a flat fp32 tensor: on the wire, and simulated.

On the wire (`parallel.sync.dtype`): each rank's pseudo-gradient is cut into one segment per
worker; an all-to-all sends each segment to its owner, which sums the workers' values in fp32
and divides by their number (a reduce-scatter); an all-gather returns the sums (2Ψ(R−1)/R values
per rank, as a ring all-reduce). The values travel as fp32, bf16, or int8 with one fp32 scale
per chunk of CHUNK values (max |x| / 127): any tensor shape, any backend with all-to-all (gloo,
NCCL). The outer step accumulates in fp32.

`ReplicaAverage` runs it over the workers' process groups (optionally on a background thread);
`reference_average` computes the same encoding, sums and rounding in one process, and
`SimulatedWorkers` uses it for verify's one-process reference of the workers.
"""

from __future__ import annotations

import math
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from scaletrain.vocab import SYNC_DTYPES, unknown

CHUNK = 2048  # values per int8 scale


# --------------------------------------------------------------------------------------------
# Compression: the same arithmetic in the distributed average and in its one-process reference


def _encode(x: torch.Tensor, dtype: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(rows, seg) fp32 values, seg a multiple of CHUNK, as they travel: (values, int8 scales)."""
    if dtype == "fp32":
        return x, None
    if dtype == "bf16":
        return x.to(torch.bfloat16), None
    if dtype != "int8":
        raise unknown("sync dtype", dtype, SYNC_DTYPES)
    chunks = x.view(x.shape[0], -1, CHUNK)
    scale = chunks.abs().amax(-1) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(chunks / scale.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    return q.view(x.shape), scale


def _decode(q: torch.Tensor, scale: torch.Tensor | None, dtype: str) -> torch.Tensor:
    if dtype == "int8":
        return (q.view(q.shape[0], -1, CHUNK).float() * scale.unsqueeze(-1)).view(q.shape)
    return q.float()


def segment_length(n: int, workers: int) -> int:
    """Values per worker's segment of an n-value buffer: ceil(n / workers), rounded up to CHUNK."""
    return math.ceil(math.ceil(n / workers) / CHUNK) * CHUNK


def _segments(flat: torch.Tensor, workers: int) -> torch.Tensor:
    seg = segment_length(flat.numel(), workers)
    out = torch.zeros(workers * seg, dtype=torch.float32, device=flat.device)
    out[:flat.numel()] = flat
    return out.view(workers, seg)


def _reduce_segment(received: torch.Tensor, scales: torch.Tensor | None, dtype: str, workers: int) -> torch.Tensor:
    """The mean over the workers of one segment (received: one row per worker, in worker order)."""
    return _decode(received, scales, dtype).sum(0).div_(workers)


def reference_average(buffers: list[torch.Tensor], dtype: str) -> torch.Tensor:
    """What `ReplicaAverage` returns on every worker when worker w holds buffers[w]: the same
    encoding, sums and rounding, in one process (verify's simulation of the workers)."""
    workers, n = len(buffers), buffers[0].numel()
    encoded = [_encode(_segments(b.reshape(-1).float(), workers), dtype) for b in buffers]
    sums, sum_scales = [], []
    for r in range(workers):
        received = torch.stack([q[r] for q, _ in encoded])
        scales = torch.stack([s[r] for _, s in encoded]) if dtype == "int8" else None
        q, s = _encode(_reduce_segment(received, scales, dtype, workers).view(1, -1), dtype)
        sums.append(q)
        sum_scales.append(s)
    out = _decode(torch.cat(sums), torch.cat(sum_scales) if dtype == "int8" else None, dtype)
    return out.view(-1)[:n].clone()


# --------------------------------------------------------------------------------------------
# Averaging over the workers


class Handle(Protocol):
    def wait(self) -> torch.Tensor | None: ...  # None: the workers did not commit this sync (fault tolerance)


class Averager(Protocol):
    """Starts the mean over the workers of a flat fp32 tensor (`ReplicaAverage`, or verify's
    one-process simulation of the workers)."""

    def start(self, flat: torch.Tensor) -> Handle: ...


@dataclass
class _Done:
    value: torch.Tensor

    def wait(self) -> torch.Tensor:
        return self.value


@dataclass
class _Background:
    future: Future

    def wait(self) -> torch.Tensor:
        return self.future.result()


class ReplicaAverage:
    """The mean over the workers of a flat fp32 tensor held by each (the ranks of one
    dp_replicate group: the same shard of the same parameters in every worker)."""

    def __init__(self, group: dist.ProcessGroup, workers: int, dtype: str, background_group=None):
        if dtype not in SYNC_DTYPES:
            raise unknown("sync dtype", dtype, SYNC_DTYPES)
        self.group, self.workers, self.dtype = group, workers, dtype
        # a delayed sync runs on a thread of its own, over a process group of its own (its
        # collectives never interleave with the trainer's on the main group)
        self.background_group = background_group
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="scaletrain-sync") \
            if background_group is not None else None

    @classmethod
    def for_mesh(cls, mesh, dtype: str, background: bool, timeout=None) -> ReplicaAverage:
        """Over the dp_replicate axis of the mesh (pp, dp_replicate, dp_shard, cp, tp)."""
        workers = mesh["dp_replicate"].size()
        extra = None
        if background:  # every rank creates every replica group, in the same order
            names = list(mesh.mesh_dim_names)
            ranks = mesh.mesh.movedim(names.index("dp_replicate"), -1).reshape(-1, workers).tolist()
            extra, _ = dist.new_subgroups_by_enumeration(ranks, timeout=timeout)
        return cls(mesh["dp_replicate"].get_group(), workers, dtype, extra)

    def start(self, flat: torch.Tensor) -> Handle:
        if self._pool is None:
            return _Done(self.average(flat, self.group))
        ready = None
        if flat.is_cuda:  # the thread's stream must see the values the main stream computed
            ready = torch.cuda.Event()
            ready.record()
        return _Background(self._pool.submit(self._average_in_background, flat, ready))

    def _average_in_background(self, flat: torch.Tensor, ready) -> torch.Tensor:
        if ready is None:
            return self.average(flat, self.background_group)
        stream = torch.cuda.Stream(device=flat.device)
        with torch.cuda.stream(stream):
            stream.wait_event(ready)
            out = self.average(flat, self.background_group)
        stream.synchronize()
        return out

    def average(self, flat: torch.Tensor, group) -> torch.Tensor:
        """Reduce-scatter (all-to-all of the encoded segments, summed in fp32 by their owner),
        then all-gather of the encoded sums."""
        workers, dtype, n = self.workers, self.dtype, flat.numel()
        q, scales = _encode(_segments(flat, workers), dtype)
        received = torch.empty_like(q)
        dist.all_to_all_single(received, q, group=group)
        received_scales = None
        if scales is not None:
            received_scales = torch.empty_like(scales)
            dist.all_to_all_single(received_scales, scales, group=group)
        mine, mine_scales = _encode(_reduce_segment(received, received_scales, dtype, workers).view(1, -1), dtype)
        every = torch.empty(workers * mine.numel(), dtype=mine.dtype, device=mine.device)
        dist.all_gather_single(every, mine.view(-1), group=group)
        every_scales = None
        if mine_scales is not None:
            every_scales = torch.empty(workers * mine_scales.numel(), dtype=mine_scales.dtype,
                                       device=mine_scales.device)
            dist.all_gather_single(every_scales, mine_scales.view(-1), group=group)
            every_scales = every_scales.view(workers, -1)
        return _decode(every.view(workers, -1), every_scales, dtype).view(-1)[:n].clone()


class SimulatedWorkers:
    """Workers that live in one process (verify's reference): worker w's k-th `start` is averaged
    with every other worker's k-th by `reference_average`, once all have started it."""

    def __init__(self, workers: int, dtype: str):
        self.workers, self.dtype = workers, dtype
        self._started: dict[int, dict[int, torch.Tensor]] = {}
        self._done: dict[int, torch.Tensor] = {}

    def member(self, worker: int) -> _SimulatedMember:
        return _SimulatedMember(self, worker)

    def _result(self, k: int) -> torch.Tensor:
        if k not in self._done:
            started = self._started.pop(k)
            if len(started) != self.workers:
                raise RuntimeError(f"sync {k}: {len(started)} of {self.workers} simulated workers have started it")
            self._done[k] = reference_average([started[w] for w in range(self.workers)], self.dtype)
        return self._done[k].clone()


@dataclass
class _SimulatedMember:
    shared: SimulatedWorkers
    worker: int
    count: int = 0

    def start(self, flat: torch.Tensor) -> Handle:
        k, self.count = self.count, self.count + 1
        self.shared._started.setdefault(k, {})[self.worker] = flat.clone()
        return _Lazy(self.shared, k)


@dataclass
class _Lazy:
    shared: SimulatedWorkers
    k: int

    def wait(self) -> torch.Tensor:
        return self.shared._result(self.k)
