"""Local SGD and DiLoCo: data-parallel workers that synchronise every H steps, not every step.

The workers are the `dp_replicate` groups. Inside a worker everything trains as in synchronous
data parallelism (gradients reduced over its `dp_shard` ranks every step: DDP, ZeRO 1-3, with
tensor and pipeline parallelism, any precision); between workers nothing moves for
`parallel.sync_every` = H inner steps. Then each worker's pseudo-gradient
Δ = θ_outer − θ_local (how far its inner steps took it from the last synchronised weights) is
averaged over the workers, and

    local_sgd:  θ_outer ← θ_outer − mean Δ          (the average of the workers' weights)
    diloco:     θ_outer ← an outer optimizer step on mean Δ: SGD with Nesterov momentum,
                lr 0.7, momentum 0.9 (Douillard et al. 2023), or heavy-ball momentum

after which every worker continues from θ_outer. Each worker keeps its inner optimizer state.

Streaming (Douillard et al. 2025): `parallel.sync_fragments` = F splits the blocks into F
contiguous fragments (parameters before the first block, the embedding, go with the first;
those after the blocks, final norm and head, with the last). Fragment f syncs at the inner
steps s with s ≡ (f + 1)·H/F (mod H): each fragment every H steps, one fragment at a time.
With `parallel.sync_delay` = τ the average of a fragment is computed on a background thread
(on its own process group) while the next τ inner steps compute, and applied at step s + τ
as θ ← θ_outer' + (θ_local(s + τ) − θ_local(s)): the new outer weights plus what the worker
learnt meanwhile.

On the wire (`parallel.sync_dtype`): each rank's pseudo-gradient is cut into one segment per
worker; an all-to-all sends each segment to its owner, which sums the workers' values in fp32
and divides by their number (a reduce-scatter); an all-gather returns the sums (2Ψ(R−1)/R values
per rank, as a ring all-reduce). The values travel as fp32, bf16, or int8 with one fp32 scale
per chunk of CHUNK values (max |x| / 127): any tensor shape, any backend with all-to-all (gloo,
NCCL). The outer step accumulates in fp32.

Saves: communication between workers. Per rank, every H steps, 2Ψ_rank(R−1)/R values: DDP's
bytes ÷ H in fp32, ÷ 2H in bf16, ÷ 4H in int8 (plus 4 bytes of scale per CHUNK values); with
fragments the peak volume of one sync is the model's ÷ F.
Costs: the outer weights (4 bytes per parameter of this rank's shard) and, for diloco with
momentum, the outer momentum (4 more), on the device or in host memory
(`parallel.outer_on_cpu`); with a delay, one fragment's pseudo-gradient twice while it is in
flight. Quality: the workers drift apart between syncs (docs/benchmarks.md measures how much).

The trainer calls `after_step()` after every optimizer step and refreshes what the model
computes with when it returns True. The state (outer weights, momentum, a fragment in flight,
the step count) goes into checkpoints through `tensors()` and `state()`.
"""

from __future__ import annotations

import math
import re
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from scaletrain.vocab import LOCAL_SYNC_MODES, SYNC_DTYPES, unknown

CHUNK = 2048  # values per int8 scale
_BLOCK = re.compile(r"(?:^|\.)(?:layers|h|blocks)\.(\d+)\.")


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
    def wait(self) -> torch.Tensor: ...


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
    def for_mesh(cls, mesh, dtype: str, background: bool, timeout=None) -> "ReplicaAverage":
        """Over the dp_replicate axis of the 4-D mesh (pp, dp_replicate, dp_shard, tp)."""
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

    def member(self, worker: int) -> "_SimulatedMember":
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


# --------------------------------------------------------------------------------------------
# The outer state


@dataclass
class _Param:
    name: str
    param: nn.Parameter  # what the inner optimizer steps (a DTensor shard, or a plain tensor)
    local: torch.Tensor  # its local values (fp32)
    outer: torch.Tensor  # the outer weights, fp32, on the device or the host
    momentum: torch.Tensor | None
    fragment: int


@dataclass
class _InFlight:
    fragment: int
    apply_at: int  # the inner step after which the average is applied
    mine: torch.Tensor  # this worker's pseudo-gradient (flat fp32, the fragment's parameters in order)
    handle: Handle | None = None
    average: torch.Tensor | None = None  # the mean over the workers, once received

    def result(self) -> torch.Tensor:
        if self.average is None:
            self.average = self.handle.wait()
            self.handle = None
        return self.average


def fragments_of(names: list[str], n_blocks: int, fragments: int) -> list[int]:
    """The fragment of each parameter: block i of n_blocks in fragment i·F // n_blocks; a
    parameter outside the blocks goes with the first fragment if it comes before every block
    parameter (the embedding), else with the last (final norm, head)."""
    out, seen_block = [], False
    for name in names:
        m = _BLOCK.search(name)
        if m:
            seen_block = True
            out.append(min(int(m.group(1)), n_blocks - 1) * fragments // n_blocks)
        else:
            out.append(fragments - 1 if seen_block else 0)
    return out


class OuterSync:
    """The workers' periodic synchronisation, as one rank sees it (see the module's docstring)."""

    def __init__(self, named_params: list[tuple[str, nn.Parameter]], *, mode: str, sync_every: int,
                 fragments: int, delay: int, outer_optimizer: str = "nesterov", outer_lr: float = 0.7,
                 outer_momentum: float = 0.9, on_cpu: bool = False, n_blocks: int, comm: "Averager"):
        if mode not in LOCAL_SYNC_MODES:
            raise unknown("local sync mode", mode, LOCAL_SYNC_MODES)
        if fragments > n_blocks:
            raise ValueError(f"parallel.sync_fragments={fragments} but the model has {n_blocks} blocks")
        self.mode, self.every, self.fragments, self.delay = mode, sync_every, fragments, delay
        diloco = mode == "diloco"
        self.lr = outer_lr if diloco else 1.0  # local SGD: θ_outer − mean Δ is the mean of the weights
        self.momentum = outer_momentum if diloco else 0.0
        self.nesterov = outer_optimizer == "nesterov"
        self.on_cpu = on_cpu
        self.comm = comm
        self.steps = 0  # inner steps done
        self.in_flight: list[_InFlight] = []
        names = [n for n, _ in named_params]
        self.params: list[_Param] = []
        with torch.no_grad():
            for (name, p), frag in zip(named_params, fragments_of(names, n_blocks, fragments)):
                local = p.to_local() if isinstance(p, DTensor) else p.data
                outer = local.detach().to(device="cpu" if on_cpu else local.device, dtype=torch.float32, copy=True)
                momentum = torch.zeros_like(outer) if self.momentum else None
                self.params.append(_Param(name, p, local, outer, momentum, frag))

    # ---- the schedule -----------------------------------------------------------------------

    def offset(self, fragment: int) -> int:
        """Fragment f syncs after the inner steps s with s % H == offset(f)."""
        return (fragment + 1) * self.every // self.fragments % self.every

    def due(self, step: int) -> list[int]:
        return [f for f in range(self.fragments) if step % self.every == self.offset(f)]

    def _members(self, fragment: int) -> list[_Param]:
        return [p for p in self.params if p.fragment == fragment]

    # ---- after each inner step ----------------------------------------------------------------

    def after_step(self) -> bool:
        """Count an inner step; start the syncs due now, apply those due now. True when the
        weights changed (the caller refreshes what the model computes with)."""
        self.begin()
        return self.finish()

    def begin(self) -> None:
        self.steps += 1
        for f in self.due(self.steps):
            members = self._members(f)
            if not members:  # this pipeline rank holds none of the fragment
                continue
            with torch.no_grad():
                mine = torch.cat([(p.outer.to(p.local.device, non_blocking=True) - p.local).reshape(-1)
                                  for p in members])
            sync = _InFlight(f, self.steps + self.delay, mine)
            sync.handle = self.comm.start(mine)
            self.in_flight.append(sync)

    def finish(self) -> bool:
        due = [s for s in self.in_flight if s.apply_at == self.steps]
        for sync in due:
            self._apply(sync)
            self.in_flight.remove(sync)
        return bool(due)

    @torch.no_grad()
    def _apply(self, sync: _InFlight) -> None:
        average, offset = sync.result(), 0
        for p in self._members(sync.fragment):
            n = p.local.numel()
            delta = average[offset:offset + n].view(p.local.shape).to(p.outer.device, non_blocking=True)
            mine = sync.mine[offset:offset + n].view(p.local.shape)
            offset += n
            if self.delay:  # what the worker learnt since the sync began: θ_local(now) − θ_local(s)
                drift = p.local - (p.outer.to(p.local.device) - mine)
            if p.momentum is not None:
                p.momentum.mul_(self.momentum).add_(delta)
                update = delta.add(p.momentum, alpha=self.momentum) if self.nesterov else p.momentum
            else:
                update = delta
            p.outer.sub_(update, alpha=self.lr)
            outer = p.outer.to(p.local.device, non_blocking=True)
            p.local.copy_(outer + drift if self.delay else outer)

    # ---- checkpoints ---------------------------------------------------------------------------

    def _as_param(self, p: _Param, t: torch.Tensor) -> torch.Tensor:
        """`t` (laid out like p's local values) placed as p is: DCP saves the global tensor."""
        if isinstance(p.param, DTensor):
            return DTensor.from_local(t, p.param.device_mesh, p.param.placements, run_check=False,
                                      shape=p.param.shape, stride=p.param.stride())
        return t

    def outer_weights(self) -> dict[str, torch.Tensor]:
        return {p.name: self._as_param(p, p.outer) for p in self.params}

    def tensors(self) -> tuple[dict, dict]:
        """(shared, own): this rank's part of the outer momentum and of the average of a sync in
        flight, the same in every worker, and of its own pseudo-gradient in flight, for DCP. The
        outer weights are `outer_weights()` (the checkpoint's model)."""
        shared: dict = {}
        own: dict = {}
        if self.momentum:
            shared["momentum"] = {p.name: self._as_param(p, p.momentum) for p in self.params}
        for sync in self.in_flight:
            average, offset, mine, avg = sync.result(), 0, {}, {}
            for p in self._members(sync.fragment):
                n = p.local.numel()
                mine[p.name] = self._as_param(p, sync.mine[offset:offset + n].view(p.local.shape))
                avg[p.name] = self._as_param(p, average[offset:offset + n].view(p.local.shape))
                offset += n
            shared[f"in_flight_{sync.fragment}"] = avg
            own[f"in_flight_{sync.fragment}"] = mine
        return shared, own

    def state(self) -> dict:
        """What a resume needs besides the tensors (JSON)."""
        return {"steps": self.steps, "in_flight": [{"fragment": s.fragment, "apply_at": s.apply_at}
                                                  for s in self.in_flight]}

    def prepare_load(self, state: dict) -> None:
        """Allocate what a checkpoint's `state` holds in flight, so that `tensors()` can be
        loaded into; then `load_state`."""
        self.in_flight = []
        for entry in state.get("in_flight", []):
            f = int(entry["fragment"])
            n = sum(p.local.numel() for p in self._members(f))
            device = self.params[0].local.device
            sync = _InFlight(f, int(entry["apply_at"]), torch.zeros(n, device=device))
            sync.average = torch.zeros(n, device=device)
            self.in_flight.append(sync)

    def load_state(self, state: dict) -> None:
        self.steps = int(state["steps"])
