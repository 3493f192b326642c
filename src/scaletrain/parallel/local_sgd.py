"""Local SGD and DiLoCo: data-parallel workers that synchronise every H steps, not every step.

The workers are the `dp_replicate` groups. Inside a worker everything trains as in synchronous
data parallelism (gradients reduced over its `dp_shard` ranks every step: DDP, ZeRO 1-3, with
tensor and pipeline parallelism, any precision); between workers nothing moves for
`parallel.sync.every` = H inner steps. Then each worker's pseudo-gradient
Δ = θ_outer − θ_local (how far its inner steps took it from the last synchronised weights) is
averaged over the workers, and

    local_sgd:  θ_outer ← θ_outer − mean Δ          (the average of the workers' weights)
    diloco:     θ_outer ← an outer optimizer step on mean Δ: SGD with Nesterov momentum,
                lr 0.7, momentum 0.9 (Douillard et al. 2023), or heavy-ball momentum

after which every worker continues from θ_outer. Each worker keeps its inner optimizer state, and
takes its inner steps at the schedule's learning rate times parallel.sync.inner_lr_scale (0: the
square-root rule for its 1/R of the batch; scaletrain.schedule.worker_lr_scale). Across the replica
groups of a fault-tolerant job the groups are the workers: fault_tolerance.ReplicaGroupsOuter drives
an OuterSync whose average is torchft's, and a sync not committed there is discarded (`_apply`).

Streaming (Douillard et al. 2025): `parallel.sync.fragments` = F splits the blocks into F
contiguous fragments (parameters before the first block, the embedding, go with the first;
those after the blocks, final norm and head, with the last). Fragment f syncs at the inner
steps s with s ≡ (f + 1)·H/F (mod H): each fragment every H steps, one fragment at a time.
With `parallel.sync.delay` = τ the average of a fragment is computed on a background thread
(on its own process group) while the next τ inner steps compute, and applied at step s + τ
as θ ← θ_outer' + (θ_local(s + τ) − θ_local(s)): the new outer weights plus what the worker
learnt meanwhile.

On the wire: scaletrain.parallel.replica_average (fp32, bf16 or int8 with a scale per chunk).

Saves: communication between workers. Per rank, every H steps, 2Ψ_rank(R−1)/R values: DDP's
bytes ÷ H in fp32, ÷ 2H in bf16, ÷ 4H in int8 (plus 4 bytes of scale per replica_average.CHUNK values); with
fragments the peak volume of one sync is the model's ÷ F.
Costs: the outer weights (4 bytes per parameter of this rank's shard) and, for diloco with
momentum, the outer momentum (4 more), on the device or in host memory
(`parallel.sync.outer_on_cpu`); with a delay, one fragment's pseudo-gradient twice while it is in
flight. Quality: the workers drift apart between syncs (docs/benchmarks.md measures how much).

`LocalSGD.for_run` builds the trainer's step hook: after every optimizer step it counts the
inner step and starts or applies the syncs due (the trainer then refreshes what the model
computes with); it makes the workers skip a step together, reports the root mean square of the
workers' gradient norms, and keeps its state (outer weights, momentum, a fragment in flight, the
step count) in checkpoints.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from scaletrain.config import SyncConfig
from scaletrain.errors import ConfigError
from scaletrain.hooks import OuterLoop
from scaletrain.parallel.replica_average import Averager, Handle, ReplicaAverage
from scaletrain.vocab import LOCAL_SYNC_MODES, unknown

_BLOCK = re.compile(r"(?:^|\.)(?:layers|h|blocks)\.(\d+)\.")


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
                 fragments: int, delay: int, n_blocks: int, comm: Averager,
                 outer_optimizer: str = SyncConfig.outer_optimizer, outer_lr: float = SyncConfig.outer_lr,
                 outer_momentum: float = SyncConfig.outer_momentum, on_cpu: bool = SyncConfig.outer_on_cpu):
        if mode not in LOCAL_SYNC_MODES:
            raise unknown("local sync mode", mode, LOCAL_SYNC_MODES)
        assert fragments <= n_blocks, "LocalSGD.for_run and Layout.fragment_errors refuse more fragments than blocks"
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
        if average is None:  # the sync was not committed (a replica group failed in it): the window is discarded,
            for p in self._members(sync.fragment):  # the weights back to the last synced ones, no outer step
                p.local.copy_(p.outer.to(p.local.device, non_blocking=True))
            return
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


# --------------------------------------------------------------------------------------------
# The trainer's step hook


class LocalSGD(OuterLoop):
    """parallel.sync.mode = local_sgd | diloco in a run: the workers' sync after every inner step,
    the skip they agree on, the norm they report, and the checkpoint's outer state."""

    phase = "the workers' sync (parallel.sync.mode)"
    key = "outer"

    def __init__(self, outer: OuterSync, layout, mesh=None):
        self.outer, self.layout, self.mesh = outer, layout, mesh
        self.worker = mesh["dp_replicate"].get_local_rank() if mesh is not None else 0

    @classmethod
    def for_run(cls, named_params, layout, par, *, n_blocks: int, mesh=None, comm: Averager | None = None,
                ) -> LocalSGD | None:
        """The hook of a run whose layout syncs the workers every few steps (None otherwise), over
        `named_params` (what the inner optimizer steps). The workers average over `mesh`'s
        dp_replicate axis, or through `comm` (verify's simulated workers)."""
        if layout.outer is None or layout.fault_tolerance:  # (replica groups: fault_tolerance.ReplicaGroupsOuter)
            return None
        # (the config's model was checked with its layout; a custom module's blocks are counted here)
        if problems := layout.fragment_errors(n_blocks, of_config=False):
            raise ConfigError(*problems)
        if comm is None:
            comm = ReplicaAverage.for_mesh(mesh, layout.sync_dtype, background=layout.sync_delay > 0,
                                           timeout=timedelta(seconds=par.timeout_s))
        outer = OuterSync(named_params, mode=layout.dp_sync, sync_every=layout.sync_every,
                          fragments=layout.sync_fragments, delay=layout.sync_delay,
                          outer_optimizer=par.sync.outer_optimizer, outer_lr=par.sync.outer_lr,
                          outer_momentum=par.sync.outer_momentum, on_cpu=par.sync.outer_on_cpu, n_blocks=n_blocks,
                          comm=comm)
        return cls(outer, layout, mesh)

    def agree_to_skip(self, skip: bool) -> bool:
        """Each worker has its own gradient norm: a step is skipped by all or by none."""
        if self.mesh is None:
            return skip
        flag = torch.tensor(float(skip), device=self.mesh.device_type)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag > 0)

    def after_optimizer_step(self, applied: bool) -> bool:
        return self.outer.after_step()

    def reported_norm(self, grad_norm):
        """The root mean square of the workers' norms (every rank of a worker holds its norm)."""
        if self.mesh is None:
            return grad_norm
        ranks_per_worker = self.mesh.size() // self.layout.dp_replicate
        t = torch.as_tensor(grad_norm, device=self.mesh.device_type).float().reshape(()) ** 2 / ranks_per_worker
        dist.all_reduce(t)
        return (t / self.layout.dp_replicate).sqrt()

    def checkpoint_tensors(self, tensors: dict) -> dict:
        """The checkpoint's model is the outer (synchronised) weights; each worker's own weights
        and inner optimizer state are kept under its index."""
        shared, own = self.outer.tensors()
        return {"model": self.outer.outer_weights(), "outer": shared,
                "workers": {str(self.worker): {**tensors, "outer": own}}}

    def state_dict(self) -> dict:
        return {**self.outer.state(), "dp_sync": self.layout.dp_sync, "workers": self.layout.dp_replicate}

    def prepare_load(self, state: dict | None) -> None:
        self.outer.prepare_load(state)

    def load_state_dict(self, state: dict | None) -> None:
        self.outer.load_state(state)
