"""Expert parallelism: the experts of each mixture-of-experts layer split over `ep` ranks, tokens
sent to the rank that holds their expert and back by all-to-all.

The ep ranks are borrowed from the ranks that route different tokens — data-parallel dp_shard,
context-parallel cp and tensor-parallel tp (each tp rank routes its own sequence shard,
parallel/tensor_parallel.py) — as torchtitan's dp2ep, without expert-tensor parallelism: ranks
that see different tokens also hold different experts. Rank i of an ep group holds experts
[i·E/ep, (i+1)·E/ep): `w1`, `w2`, `w3` (and their biases `b1`, `b2`, `b3` where the experts have
them, gpt-oss) become DTensors `Shard(0)` on the `ep` axis of the expert mesh
(Layout.build_expert_mesh), drawn whole from (seed, name) and cut like any sharded parameter
(parallel/init.py), and saved by DCP as one tensor (checkpoints reshard across ep sizes). Each MoE
layer's `run_experts` (model/moe.py) becomes `dispatch`:

    counts per (destination rank, local expert) exchanged -> tokens by all-to-all -> regrouped by
    local expert -> the local experts' grouped matmul -> back to arrival order -> reverse all-to-all

Gradients. The step's gradient is (1/dp) Σ over every rank of its loss's gradient: the
data-parallel engines average over dp, and the cp ranks' (and, for the MoE's replicated weights,
the tp ranks') partial gradients are summed. An expert's gradient on its rank already sums the
tokens of its whole ep group; the ranks holding the same experts (dp × cp × tp / ep of them,
`Layout.expert_dp`) average theirs. So the expert weights' gradient is scaled by cp × tp / ep
on its way back (`_ScaleGrad`), and the experts' engine averages over the ranks holding the
same experts: an all-reduce (zero 0), ZeRO-1/2's engine on the expert mesh (zero 1, 2), or at
zero 3 `ExpertZero3`, which shards the weights too and gathers a layer's experts only while they
compute (FSDP's blocks leave the experts out). The cp and tp gradient sums leave the experts alone; the non-expert
parameters keep their engine (DDP, ZeRO, FSDP), which leaves the experts alone too. The
gradient norm counts each expert once: its gradient is a DTensor sharded over ep (and the ZeRO
shards), summed over those axes only.

Each ep group lies within one pipeline stage (the expert mesh keeps that axis), so pp composes.

What it saves: the experts' weights, gradients and optimizer state per rank divided by ep. What
it costs: per MoE layer and micro-batch, two all-to-alls of top_k × tokens × dim activations
forward (and two backward), plus one of the counts; every ep rank waits for the slowest.
"""

from __future__ import annotations

import contextlib
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.tensor import DTensor, Shard

from scaletrain.model.moe import MoE, expert_mlp
from scaletrain.model.names import canonical_name
from scaletrain.parallel.data_parallel import DataParallel
from scaletrain.parallel.zero import ZeroDataParallel

EXPERT_WEIGHTS = ("w1", "w2", "w3", "b1", "b2", "b3")  # (b1, b2, b3: the experts' biases, gpt-oss)


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by `factor`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.factor, None


def shard_experts(chunk: nn.Module, ep_mesh, grad_scale: float) -> list[nn.Parameter]:
    """Split every MoE layer's experts of `chunk` (on the meta device) over `ep_mesh` and route its
    tokens through `dispatch`, the experts' gradients scaled by `grad_scale` (cp × tp / ep, the
    module docstring). Returns the expert parameters (DTensors `Shard(0)`)."""
    ep, group = ep_mesh.size(), ep_mesh.get_group()
    params = []
    for m in chunk.modules():
        if not isinstance(m, MoE):
            continue
        for name in EXPERT_WEIGHTS:
            w = getattr(m, name)
            if w is None:
                continue
            local = torch.empty(w.shape[0] // ep, *w.shape[1:], dtype=w.dtype, device=w.device)
            sharded = nn.Parameter(DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False,
                                                      shape=w.shape, stride=w.stride()))
            setattr(m, name, sharded)
            params.append(sharded)
        m.run_experts = partial(dispatch, m, group, ep, grad_scale)
    return params


def _by_expert(recv: torch.Tensor) -> torch.Tensor:
    """recv (sources, local experts): the rows that arrived, in blocks (source, expert) source-major
    -> the permutation that groups them by local expert (sources in order within each)."""
    sources, experts = recv.shape
    sizes = recv.flatten()
    starts = sizes.cumsum(0) - sizes
    blocks = torch.arange(sources * experts, device=recv.device).view(sources, experts).t().flatten()
    sizes, starts = sizes[blocks], starts[blocks]
    within = torch.arange(int(sizes.sum()), device=recv.device) - (sizes.cumsum(0) - sizes).repeat_interleave(sizes)
    return starts.repeat_interleave(sizes) + within


def dispatch(m: MoE, group, ep: int, grad_scale: float, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """`MoE.run_experts` under expert parallelism: x (tokens, dim) grouped by expert, counts (experts,)
    -> the experts' outputs in the same order, each group computed on the rank holding its expert.
    Under ZeRO-3 (`m.expert_shards`, an ExpertZero3) the rank's experts are gathered for the
    experts' matmuls and freed after them, forward and backward."""
    local = m.num_experts // ep
    send = counts.view(ep, local)  # [rank, its expert]: rows this rank sends
    recv = torch.empty_like(send)  # [source rank, my expert]: rows that arrive
    dist.all_to_all_single(recv, send.contiguous(), group=group)
    send_sizes, recv_sizes = send.sum(1).tolist(), recv.sum(1).tolist()
    # (the functional all-to-all: differentiable, its backward the reverse exchange)
    arrived = all_to_all_single_autograd(x.contiguous(), recv_sizes, send_sizes, group)
    order = _by_expert(recv)
    shards = getattr(m, "expert_shards", None)
    if shards is not None:
        shards.gather(m)
    # each rank's expert gradient holds the tokens of all ep ranks; the ranks holding the same
    # experts average theirs: cp·tp/ep makes that the step's gradient (module docstring)
    weights = [_ScaleGrad.apply(w.to_local(), grad_scale).to(x.dtype) if w is not None else None
               for w in (m.w1, m.w2, m.w3, m.b1, m.b2, m.b3)]
    y = expert_mlp(arrived[order], recv.sum(0), *weights[:3], biases=tuple(weights[3:]), glu=m.glu)
    if shards is not None and torch._C._current_graph_task_id() == -1:
        # (a forward recomputed in backward, activation checkpointing, keeps them for the backward
        # that follows; they are freed once their gradients are accumulated)
        shards.free(m)
        if y.requires_grad:  # backward needs the weights again: gathered before the experts' backward
            y.register_hook(partial(shards.gather_for_backward, m))
    back = y[torch.argsort(order)]  # arrival order again: blocks (source, expert)
    return all_to_all_single_autograd(back.contiguous(), send_sizes, recv_sizes, group)


# --------------------------------------------------------------------------------------------
# the expert weights' data parallelism over the ranks holding the same experts


class ExpertAverage(DataParallel):
    """Zero 0 for the experts: their gradients averaged (one all-reduce after the step's last
    backward) over `group`, the ranks holding the same experts."""

    zero = 0

    def __init__(self, named: list[tuple[str, nn.Parameter]], group):
        super().__init__([])
        self.named, self.group = named, group

    @property
    def named_optim_params(self):
        return self.named

    def finish_gradients(self) -> None:
        grads = [p.grad.to_local() for _, p in self.named if p.grad is not None]
        if not grads or self.group is None:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.group)
        flat.div_(dist.get_world_size(self.group))
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


class ExpertZero3(ZeroDataParallel):
    """ZeRO-3 for the experts, over the ranks holding the same experts: ZeRO-2's sharded
    gradients and optimizer state (bucketed reduce-scatter in backward), and the replicas'
    storage freed except while a layer's experts compute — gathered from the shards for its
    forward, freed after it, gathered again for its backward (a hook on the experts' output)
    and freed once its gradients are accumulated. After the optimizer step nothing is gathered:
    the next use gathers the updated shards. Between uses a rank holds 1/N of its experts'
    weights, as FSDP would; at most one MoE layer's experts are whole at a time (plus the
    copies autocast keeps for backward)."""

    def __init__(self, chunks, mesh, *, dp_replicate: int, bucket_mb: float, master_dtype, params):
        super().__init__(chunks, mesh, stage=2, dp_replicate=dp_replicate, bucket_mb=bucket_mb,
                         master_dtype=master_dtype, params=params, own_shards=True)
        self.zero = 3
        self.slots_of: dict[int, list] = {}  # id(MoE module) -> its slots
        by_param = {id(s.param): s for s in self.slots}
        for c in chunks:
            for m in c.modules():
                if isinstance(m, MoE):
                    self.slots_of[id(m)] = [by_param[id(w)] for w in (m.w1, m.w2, m.w3, m.b1, m.b2, m.b3)
                                            if w is not None and id(w) in by_param]
                    m.expert_shards = self
        for s in self.slots:  # freed after each backward that filled its gradient
            s.param.register_post_accumulate_grad_hook(partial(_free_slot, s))
            _free_slot(s)

    @torch.compiler.disable
    @torch.no_grad()
    def gather(self, m: MoE) -> None:
        """The layer's experts whole again, from every rank's shard (an all-gather over the
        shard group; under HSDP the replicas hold the same shards)."""
        for s in self.slots_of[id(m)]:
            storage = s.data.untyped_storage()
            if storage.nbytes():
                continue  # already gathered (a recomputed forward, or backward right after forward)
            storage.resize_(s.data.numel() * s.data.element_size())
            local = s.shard.to_local()
            mine = torch.zeros(s.chunk_rows, s.row_numel, dtype=s.data.dtype, device=s.data.device)
            mine[:local.shape[0]] = local.reshape(local.shape[0], -1)
            everyone = torch.empty(self.n * s.chunk_rows, s.row_numel, dtype=s.data.dtype, device=s.data.device)
            dist.all_gather_into_tensor(everyone, mine, group=self.shard_group)
            # written without bumping the version autograd checks: the values it saved are the ones
            # gathered again
            with torch.autograd._unsafe_preserve_version_counter(s.data):
                s.data.view(s.rows, -1).copy_(everyone[:s.rows])

    @torch.compiler.disable
    def free(self, m: MoE) -> None:
        for s in self.slots_of[id(m)]:
            _free_slot(s)

    @torch.compiler.disable
    def gather_for_backward(self, m: MoE, grad: torch.Tensor) -> torch.Tensor:
        self.gather(m)
        return grad

    def _gather_parameters(self) -> None:
        """(ZeRO-1/2 gathers every replica after the step; here the next use does.)"""


def _free_slot(slot, *_) -> None:
    slot.data.untyped_storage().resize_(0)


class ExpertParallelData(DataParallel):
    """The run's data parallelism under expert parallelism: `main`, the layout's engine for every
    parameter but the experts, and `experts`, the experts' engine over the ranks holding them."""

    def __init__(self, main: DataParallel, experts: DataParallel, expert_params: list[nn.Parameter]):
        super().__init__(main.modules)
        self.models, self.zero = main.models, main.zero
        self.main, self.experts = main, experts
        self._ids = {id(p) for p in expert_params}

    @property
    def named_optim_params(self):
        return [(n, p) for n, p in self.main.named_optim_params if id(p) not in self._ids] + \
            self.experts.named_optim_params

    @property
    def named_params(self):
        """Under ZeRO-3 the experts' replicas are freed between uses: their shards stand for them."""
        if not isinstance(self.experts, ExpertZero3):
            return super().named_params
        shards = {id(s.param): s.shard for s in self.experts.slots}
        return [(n, shards.get(id(p), p)) for n, p in super().named_params]

    def micro_step(self, last: bool):
        stack = contextlib.ExitStack()
        stack.enter_context(self.main.micro_step(last))
        stack.enter_context(self.experts.micro_step(last))
        return stack

    def finish_gradients(self) -> None:
        self.main.finish_gradients()
        self.experts.finish_gradients()

    def after_optimizer_step(self) -> None:
        self.main.after_optimizer_step()
        self.experts.after_optimizer_step()

    def zero_grad(self, optimizer) -> None:
        self.main.zero_grad(optimizer)
        self.experts.zero_grad(optimizer)


def expert_engine(main: DataParallel, chunks: list[nn.Module], expert_params: list[nn.Parameter], rt, *,
                  bucket_mb: float, master_dtype) -> ExpertParallelData:
    """`main` joined by the experts' engine: none when each rank's experts are its own (ep = dp),
    an average (zero 0), or ZeRO-1/2 over the expert mesh's dp_shard (and dp_replicate) ranks."""
    lay = rt.layout
    ids = {id(p) for p in expert_params}
    named = [(canonical_name(n), p) for c in chunks for n, p in c.named_parameters() if id(p) in ids]
    if lay.expert_dp == 1:
        experts = ExpertAverage(named, None)
    elif lay.zero == 0:  # (local SGD / DiLoCo workers: within the worker; the workers sync every H steps)
        experts = ExpertAverage(named, rt.expert_step_mesh().get_group())
    elif lay.expert_zero == 3:
        experts = ExpertZero3(chunks, rt.expert_mesh(), bucket_mb=bucket_mb, master_dtype=master_dtype, params=named,
                              dp_replicate=lay.step_replicas)
    else:
        experts = ZeroDataParallel(chunks, rt.expert_mesh(), stage=lay.expert_zero, bucket_mb=bucket_mb,
                                   dp_replicate=lay.step_replicas, master_dtype=master_dtype,
                                   params=named)
    return ExpertParallelData(main, experts, expert_params)


def hide_from_ddp(chunk: nn.Module, expert_params: list[nn.Parameter]) -> None:
    """DDP takes no DTensor and must not average the experts over all dp ranks: it skips them."""
    ids = {id(p) for p in expert_params}
    chunk._ddp_params_and_buffers_to_ignore = [n for n, p in chunk.named_parameters() if id(p) in ids]
