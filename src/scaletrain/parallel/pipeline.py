"""Pipeline parallelism with `torch.distributed.pipelining`: the stack of blocks is cut into
stages, one (or, interleaved, several) per `pp` rank; micro-batches flow through them.

Saves: each rank holds only its stages' parameters, gradients and optimizer state (~1/pp of the
model). Costs: point-to-point sends of B×T×dim activations between neighbouring stages (little),
and the bubble: with p stages and m micro-batches, a fraction (p-1)/(m+p-1) of each rank's time
idles — (p-1)/m relative to the useful work — and (p-1)/(v·m) with v interleaved stages per rank.

Schedules (`parallel.pp_schedule`):
    gpipe             all forwards, then all backwards; activations of all m micro-batches live
    1f1b              one forward, one backward in steady state: at most p micro-batches live
    interleaved-1f1b  v chunks per rank (loop order), a v-times smaller bubble, v-times more sends
    zero-bubble       backward split into input- and weight-gradients that fill the bubble
                      (PyTorch's ZBV schedule: 2 chunks per rank in a V shape)

The model is split by layer ranges: the first stage also holds the embedding, the last the final
norm and the output head; the split balances an estimate of each stage's compute (or follows
`parallel.pp_split`). Each chunk is a copy of the model with the other layers deleted, so its
parameter names, and the checkpoint keys, are those of the whole model.

One training step (`forward_backward`) or one validation batch (`eval_loss_sum`) feeds all of its
micro-batches to the schedule at once; the last stage computes the losses, the others none.

A mixture of experts' auxiliary losses join backward inside their stage, with the factor the
schedule's loss function applies to the token loss (the Trainer's loss_factor, given to both), so
no loss travels between stages. The split by compute counts a MoE block's active parameters
(model/flops.py), the average block's when dense and MoE blocks are mixed.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from functools import lru_cache

import torch
from torch import nn

from scaletrain.hooks import StepHook, sum_gradients
from scaletrain.layout import balanced_split_counts, chunks_per_rank  # noqa: F401 - re-exported
from scaletrain.model.config import ModelConfig
from scaletrain.model.moe import MoE
from scaletrain.model.names import canonical_name
from scaletrain.parallel.tensor_parallel import whole
from scaletrain.vocab import PP_SCHEDULES, unknown


def head_cost_in_blocks(cfg: ModelConfig) -> float:
    """The output head's matmul FLOPs in units of one block's matmul FLOPs."""
    from scaletrain.model.flops import block_matmul_params

    return cfg.vocab_size * cfg.dim / block_matmul_params(cfg)


def layer_ranges(cfg: ModelConfig, chunks: int, split: str) -> list[range]:
    counts = [int(x) for x in split.split(",")] if split else \
        balanced_split_counts(cfg.n_layers, chunks, head_cost_in_blocks(cfg))
    ranges, start = [], 0
    for c in counts:
        ranges.append(range(start, start + c))
        start += c
    return ranges


@lru_cache(maxsize=4096)
def stage_indices(schedule: str, pp_rank: int, pp: int, virtual: int) -> list[int]:
    """Which of the pp × v chunks this rank runs: loop order, or a V for zero-bubble."""
    if schedule == "zero-bubble":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + i * pp for i in range(chunks_per_rank(schedule, virtual))]


def split_model(model: nn.Module, stages: list[int], ranges: list[range]) -> list[nn.Module]:
    """Copies of `model` (on the meta device: free) that keep only the given stages' layers."""
    last = len(ranges) - 1
    chunks = []
    for s in stages:
        chunk = copy.deepcopy(model)
        keep = {str(i) for i in ranges[s]}
        for name in list(chunk.layers.keys()):
            if name not in keep:
                del chunk.layers[name]
        if s != 0:
            # tied embeddings (Megatron's way): the last stage keeps the embedding's weight, its
            # head; the two copies' gradients are summed every step (`tied_weight_group`)
            if not (s == last and model.cfg.tie_embeddings):
                chunk.tok_emb = None
            chunk.pos_emb = None
        if s != last:
            chunk.norm = None
            chunk.output = None
        chunks.append(chunk)
    return chunks


def build_stages(models: list[nn.Module], stage_ids: list[int], num_stages: int, device: torch.device, group) -> list:
    """A PipelineStage per chunk. The schedule's first step (and the first after an evaluation)
    runs each stage's forward once more to learn its shapes: a mixture of experts must not count
    that forward's tokens in the step's load, so its counters are put back as they were."""
    from torch.distributed.pipelining import PipelineStage

    stages = [PipelineStage(m, sid, num_stages, device, group=group) for m, sid in zip(models, stage_ids)]
    for stage, model in zip(stages, models):
        assert hasattr(stage, "_prepare_backward_infra"), "torch.distributed.pipelining renamed its shape inference"
        stage._prepare_backward_infra = _inferring(stage._prepare_backward_infra)
        counters = [m.stats for m in model.modules() if isinstance(m, MoE)]
        if counters:
            assert hasattr(stage, "_prepare_forward_infra"), "torch.distributed.pipelining renamed its shape inference"
            stage._prepare_forward_infra = _counters_kept(stage._prepare_forward_infra, counters)
    return stages


_INFERRING = [0]  # > 0 while a stage learns its gradients' shapes


def inferring() -> bool:
    """Whether the loss function is called by a stage's shape inference (the schedule's first step, and
    the first after an evaluation), on the first micro-batch's output, not as a micro-batch's loss: a loss
    that counts its calls (the preference objective's, which hands each its reference) must not count it."""
    return _INFERRING[0] > 0


def _inferring(infer: Callable) -> Callable:
    def run(*args, **kwargs):
        _INFERRING[0] += 1
        try:
            return infer(*args, **kwargs)
        finally:
            _INFERRING[0] -= 1
    return run


def _counters_kept(infer: Callable, counters: list[torch.Tensor]) -> Callable:
    def run(*args, **kwargs):
        saved = [c.clone() for c in counters]
        try:
            return infer(*args, **kwargs)
        finally:
            with torch.no_grad():
                for c, s in zip(counters, saved):
                    c.copy_(s)
    return run


def build_schedule(stages, schedule: str, n_microbatches: int, loss_fn):
    """The schedule that runs this rank's `stages`; `loss_fn(logits, targets)` is a micro-batch's
    loss as backward should see it."""
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B, ScheduleZBVZeroBubble

    # our loss is already divided by the tokens of the global batch: no extra scaling
    if schedule == "gpipe":
        return ScheduleGPipe(stages[0], n_microbatches, loss_fn=loss_fn, scale_grads=False)
    if schedule == "1f1b":
        return Schedule1F1B(stages[0], n_microbatches, loss_fn=loss_fn, scale_grads=False)
    if schedule == "interleaved-1f1b":
        return ScheduleInterleaved1F1B(stages, n_microbatches, loss_fn=loss_fn, scale_grads=False)
    if schedule == "zero-bubble":
        return ScheduleZBVZeroBubble(stages, n_microbatches, loss_fn=loss_fn, scale_grads=False)
    raise unknown("pipeline schedule", schedule, PP_SCHEDULES)


def _feed(pm, parts, device, non_blocking: bool) -> tuple[tuple, dict, list[torch.Tensor]]:
    """The schedule's arguments for these (inputs, targets) micro-batches on this rank's stages:
    the first stage takes the inputs, the last the targets and a list that collects the losses."""
    inputs = torch.cat([x for x, _ in parts]).to(device, non_blocking=non_blocking)
    targets = torch.cat([y for _, y in parts]).to(device, non_blocking=non_blocking)
    losses: list[torch.Tensor] = []
    args = (inputs,) if pm.first else ()
    kwargs = {"target": targets, "losses": losses} if pm.last else {}
    return args, kwargs, losses


def forward_backward(pm, schedule, batches, n_microbatches: int, *, device: torch.device,
                     autocast: Callable[[], AbstractContextManager], loss_context: Callable[[], AbstractContextManager],
                     ) -> tuple[torch.Tensor, float]:
    """One training step's micro-batches (drawn from `batches`) through the schedule at once.
    Returns the sum of the losses as the schedule's loss function computed them (zero on all
    but the last stage) and the seconds spent waiting for data."""
    t0 = time.perf_counter()
    parts = [next(batches) for _ in range(n_microbatches)]
    wait = time.perf_counter() - t0
    args, kwargs, losses = _feed(pm, parts, device, non_blocking=True)
    # the schedule decides when each stage's gradients are final; sharding engines reduce after it
    with pm.dp.micro_step(last=False), loss_context(), autocast():
        schedule.step(*args, return_outputs=False, **kwargs)
    pm.dp.finish_gradients()
    loss_sum = torch.stack([whole(x.detach()).float() for x in losses]).sum() if losses else \
        torch.zeros((), device=device)
    return loss_sum, wait


def eval_loss_sum(pm, schedule, parts, *, device: torch.device, loss_factor: float,
                  autocast: Callable[[], AbstractContextManager],
                  loss_context: Callable[[], AbstractContextManager]) -> torch.Tensor:
    """One validation batch's (inputs, targets) micro-batches through the schedule's forward-only
    pass: the sum of its token losses (float64) on the last stage, zero elsewhere."""
    args, kwargs, losses = _feed(pm, parts, device, non_blocking=False)
    with loss_context(), autocast():
        schedule.eval(*args, return_outputs=False, **kwargs)
    total = torch.zeros((), dtype=torch.float64, device=device)
    for loss in losses:  # the schedule's loss function carries the training scale: take it off
        total += whole(loss).double() / loss_factor
    return total


def tied_weight_group(mesh):
    """The 2-rank group of this rank's first and last pipeline stage (the same tp, cp and dp
    coordinates), over which a tied embedding's gradients are summed; None on a middle stage.
    Every rank calls it (group creation is collective)."""
    import torch.distributed as dist

    pp_mesh = mesh["pp"]
    if pp_mesh.size() == 2:
        return pp_mesh.get_group()
    ranks = mesh.mesh.reshape(pp_mesh.size(), -1)  # (pp, every other coordinate)
    mine = None
    for line in range(ranks.shape[1]):
        ends = [int(ranks[0, line]), int(ranks[-1, line])]
        group = dist.new_group(ends)
        if dist.get_rank() in ends:
            mine = group
    return mine


class TiedEmbeddingStep(StepHook):
    """A tied embedding under pipelining: the first stage's embedding and the last stage's head
    are two copies of one weight. They start equal (one name, one initial value), get the sum of
    both stages' gradients every step (its shards under ZeRO-1/2, its fp32 master under bf16-true:
    the same on both stages), and so stay equal; the norm counts the last stage's copy once."""

    phase = "the tied embedding's gradient all-reduce (first and last pipeline stage)"

    def __init__(self, group, last_copy: bool):
        self.group, self.last_copy = group, last_copy
        self.tied: list[torch.Tensor] = []

    @classmethod
    def needed(cls, model_cfg, mesh, pm) -> TiedEmbeddingStep | None:
        """Every rank calls it (the groups are created collectively); None on a middle stage."""
        if mesh["pp"].size() == 1 or not model_cfg.tie_embeddings:
            return None
        group = tied_weight_group(mesh)
        return None if group is None else cls(group, last_copy=not pm.first)

    def reduce_gradients(self, named) -> None:
        self.tied = [p for n, p in named if canonical_name(n) == "tok_emb.weight"]
        sum_gradients(self.tied, self.group)

    def copies(self) -> tuple[torch.Tensor, ...]:
        """The last stage's copy of the tied weight (this step's): the global norm counts it once."""
        return tuple(self.tied) if self.last_copy else ()
