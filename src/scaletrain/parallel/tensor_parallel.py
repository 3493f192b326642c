"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019) and sequence parallelism
(Korthikanti et al. 2022), with DTensor's `parallelize_module`.

Each block's matmuls are split over the `tp` ranks so that a block needs one collective in
forward and one in backward per sub-layer:

    attention   wq, wk, wv column-parallel (each rank owns n_heads/tp query heads and
                n_kv_heads/tp key/value heads; their biases split alike; q/k norms, one
                weight per head width, replicated; q/k norms over the whole projections
                (OLMo 2), their weights split like the rows, the sum of squares all-reduced
                over tp: `ProjectionNorm`) -> local attention -> wo row-parallel.
                Fewer K/V heads than tp ranks (grouped-query attention, Megatron's way): wk
                and wv are replicated, each rank computes the one K/V head its query heads
                read, and the copies' gradients are summed over tp (`ReplicatedKVStep`).
                Attention sinks (gpt-oss), one per query head, split like the query heads.
                Linear attention (model/deltanet.py): in_qkvz and in_ba column-parallel (their rows
                grouped by key head: a rank owns whole key heads with their value heads), out
                row-parallel; the per-head convolution, A_log and dt_bias replicated, each rank
                reading its heads' rows, and the norm's shared weight replicated, their gradients
                summed over tp in backward (`_own_rows`, `_CopyToRegion`)
    MLP         w1 (and w3) column-parallel -> activation -> w2 row-parallel
    MoE         router, experts and shared experts replicated (no expert-tensor parallelism),
                and each rank routes its own sequence shard: with sequence parallelism the one
                it holds; without, a slice of the replicated input, its output all-gathered after
                (so no two ranks compute the same tokens). The gradients of those weights are
                then partial sums, added over tp by `SequenceShardedMoEStep` (and the load counts
                over tp too). Expert parallelism borrows the tp ranks like data-parallel ones:
                its experts are split over ep groups that may span them, and averaged by its own
                engine (parallel/expert_parallel.py)
    embedding   rows (vocabulary) split; output head columns (vocabulary) split, and the loss is
                computed on the vocabulary shards (`loss_parallel`): the full logits never exist

Saves: parameters, gradients and optimizer state of the blocks by tp; activations inside the
blocks by tp. Costs: an all-reduce of B×T×dim per sub-layer in forward and another in backward,
on the fastest links (tp is the innermost mesh axis).

Sequence parallelism (`parallel.sp`) also splits the sequence between the tensor-parallel
regions: norms, dropout and residual adds run on T/tp tokens, and each all-reduce becomes a
reduce-scatter (into sequence shards) plus an all-gather (before the next matmuls) — the same
bytes, and the activations outside the matmuls shrink by tp as well.

Adapters (adapter.kind, model/lora.py) follow their base's split (`Colwise`, `Rowwise`): on a
column-parallel linear B's rows and DoRA's magnitude are split like the weight's rows and A is
replicated (each rank computes A x whole, its gradient a partial sum that DTensor adds over tp);
on a row-parallel one A's columns are split like the weight's and B (and the magnitude) replicated,
so B A x is a partial sum reduced with the base's output, and DoRA's row norm sums the squares of
the rows' shards over tp (DTensor's norm of a Shard(1) tensor) before the magnitude divides by it.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from scaletrain.hooks import StepHook, sum_gradients
from scaletrain.model.deltanet import GatedDeltaNet
from scaletrain.model.mla import LatentAttention
from scaletrain.model.moe import MoE
from scaletrain.parallel.moe_balance import summed_over

# where a linear's parameters go: the base's weight and bias as torch's styles put them, and the
# adapters' (model/lora.py: lora_a is rank x in, lora_b out x rank, lora_magnitude out) alike
COLWISE_SPLIT = {"weight": Shard(0), "bias": Shard(0),
                 "lora_a": Replicate(), "lora_b": Shard(0), "lora_magnitude": Shard(0)}
ROWWISE_SPLIT = {"weight": Shard(1), "bias": Replicate(),
                 "lora_a": Shard(1), "lora_b": Replicate(), "lora_magnitude": Replicate()}


def _split_linear(module: nn.Module, mesh, split: dict, src_data_rank) -> None:
    """Each of the linear's own parameters distributed as `split` says; one it does not name is an
    error (never left a plain tensor, nor replicated by default)."""
    for leaf, param in list(module.named_parameters(recurse=False)):
        if leaf not in split:
            raise NotImplementedError(f"tensor parallelism does not know how to split {type(module).__name__}."
                                      f"{leaf}; it splits {', '.join(split)}")
        module.register_parameter(leaf, nn.Parameter(
            distribute_tensor(param, mesh, [split[leaf]], src_data_rank=src_data_rank),
            requires_grad=param.requires_grad))


class Colwise(ColwiseParallel):
    """torch's ColwiseParallel, whose linear split also takes a LoRALinear's adapters (B's rows and
    DoRA's magnitude split with the weight's rows, A replicated); a plain linear splits as torch's."""

    def _partition_linear_fn(self, name, module, device_mesh):
        _split_linear(module, device_mesh, COLWISE_SPLIT, self.src_data_rank)


class Rowwise(RowwiseParallel):
    """torch's RowwiseParallel, whose linear split also takes a LoRALinear's adapters (A's columns
    split with the weight's, B and DoRA's magnitude replicated); a plain linear splits as torch's."""

    def _partition_linear_fn(self, name, module, device_mesh):
        _split_linear(module, device_mesh, ROWWISE_SPLIT, self.src_data_rank)


def apply_tensor_parallel(model: nn.Module, tp_mesh, *, sequence_parallel: bool, first_block: str | None) -> None:
    """Shard `model` (a whole model or one pipeline chunk) over `tp_mesh` in place.

    Between blocks the residual stream is Replicate, or Shard(1) (sequence) with sequence
    parallelism. `first_block` is the name of the model's very first block, which turns the
    replicated embedding output into sequence shards (None if this chunk does not hold it).
    """
    # torch's SequenceParallel makes a norm's weight a new Parameter that requires grad: a frozen base
    # (adapter fine-tuning) stays frozen whatever the styles below put in its place
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    _split(model, tp_mesh, sequence_parallel, first_block)
    for name, p in model.named_parameters():
        if name in frozen:
            p.requires_grad_(False)


def _split(model: nn.Module, tp_mesh, sequence_parallel: bool, first_block: str | None) -> None:
    between = Shard(1) if sequence_parallel else Replicate()
    if model.tok_emb is not None:
        # vocabulary-parallel embedding: each rank looks up its rows, the partial sums are
        # all-reduced; its output stays replicated because learned positions are added next
        parallelize_module(model, tp_mesh, {"tok_emb": RowwiseParallel(input_layouts=Replicate(),
                                                                       output_layouts=Replicate())})
    if model.output is not None:
        head = Colwise(input_layouts=between, output_layouts=Shard(-1), use_local_output=False)
        plan = {"output": head}
        if model.norm is not None and sequence_parallel:
            plan["norm"] = SequenceParallel()
        parallelize_module(model, tp_mesh, plan)
        if model.cfg.tie_embeddings and model.tok_emb is not None:
            model.output.weight = model.tok_emb.weight  # both are vocabulary rows: Shard(0)

    for name, block in model.layers.items():
        _split_block(block, model.cfg, tp_mesh, sequence_parallel)
        if sequence_parallel and name == first_block:
            # the residual stream enters the first block replicated and leaves it in sequence shards
            parallelize_module(block, tp_mesh, PrepareModuleInput(
                input_layouts=(Replicate(), None), desired_input_layouts=(Shard(1), None), use_local_output=True))
    # multi-token prediction's blocks (model/mtp.py; without sequence parallelism, which legality refuses with
    # it): split as the others, their inputs and outputs replicated; the norms and eh_proj around them replicated
    for depth in (model.mtp.values() if getattr(model, "mtp", None) is not None else ()):
        _split_block(depth.block, model.cfg, tp_mesh, sequence_parallel)


def _split_block(block: nn.Module, cfg, tp_mesh, sequence_parallel: bool) -> None:
    """One block split over `tp_mesh` by its plan, with what its attention and experts need besides."""
    replicated_kv = cfg.kv_heads < tp_mesh.size()
    moe = isinstance(block.ffn, MoE)
    parallelize_module(block, tp_mesh, _block_plan(block, moe, replicated_kv, sequence_parallel))
    if isinstance(block.attn, LatentAttention):  # its shared rotated key feeds every rank's heads
        block.attn.shared_key = partial(_copy_to_region, group=tp_mesh.get_group())
    elif isinstance(block.attn, GatedDeltaNet):  # each rank its key heads' rows of the replicated conv and decay
        block.attn.own = partial(_own_rows, group=tp_mesh.get_group(), rank=tp_mesh.get_local_rank(),
                                 size=tp_mesh.size())
        block.attn.whole = partial(_copy_to_region, group=tp_mesh.get_group())
    elif replicated_kv:
        _select_kv_head(block.attn, tp_mesh, cfg.kv_heads, cfg.head_size)
    if getattr(block.attn, "sinks", None) is not None:  # (latent attention has none)
        _split_sinks(block.attn, tp_mesh)
    if moe:  # the Switch loss's counts are those of whole sequences
        block.moe.sequence_counts = partial(summed_over, previous=block.moe.sequence_counts,
                                            group=tp_mesh.get_group())


def _block_plan(block: nn.Module, moe: bool, replicated_kv: bool, sequence_parallel: bool) -> dict:
    """One block's tensor-parallel plan: attention and MLP column- then row-parallel, K/V split unless
    each is replicated (fewer heads than ranks), norms sequence-parallel under sp."""
    between = Shard(1) if sequence_parallel else Replicate()
    latent = isinstance(block.attn, LatentAttention)
    kv_plan = {} if replicated_kv else {"attn.wk": Colwise(), "attn.wv": Colwise()}
    plan = _latent_plan(block.attn) if latent else {"attn.wq": Colwise(), **kv_plan}
    plan["attn.wo"] = Rowwise(output_layouts=between)
    if isinstance(block.attn, GatedDeltaNet):
        plan = {"attn.in_qkvz": Colwise(), "attn.in_ba": Colwise(), "attn.out": Rowwise(output_layouts=between)}
    if not moe:
        plan.update({"mlp.w1": Colwise(), "mlp.w2": Rowwise(output_layouts=between)})
        if block.mlp.w3 is not None:
            plan["mlp.w3"] = Colwise()
    if getattr(block.attn, "q_norm", None) is not None and block.attn.norm_heads:
        # q/k norms (Qwen3) act on each head: the rank's own heads are shards of dim 2, and
        # their replicated weight gets its gradient summed over the ranks' heads
        plan["attn.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        plan["attn.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    elif getattr(block.attn, "q_norm", None) is not None:  # over the whole projections (OLMo 2, OLMoE)
        plan["attn.q_norm"] = ProjectionNorm()
        plan["attn.k_norm"] = ProjectionNorm()
    if sequence_parallel:
        # pre-norms hand their output to the gathering input plans below as DTensors; post-norms
        # (OLMo 2, Gemma) sit on the residual stream, which stays a plain sequence shard
        plan.update({n: SequenceParallel() for n in ("attn_norm", "mlp_norm") if getattr(block, n) is not None})
        plan.update({n: SequenceParallel(use_local_output=True) for n in ("attn_post_norm", "mlp_post_norm")
                     if getattr(block, n) is not None})
        plan.update({
            # gather the sequence before the column-parallel matmuls (rope tables pass as is); latent
            # attention's replicated compressions take it as a plain tensor, whose gradient the
            # up-projections' inputs (and `shared_key`) have summed over tp already
            "attn": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None),
                                       use_local_output=latent),
            # a mixture of experts routes the rank's own tokens: its sequence shard, as a plain tensor
            "moe" if moe else "mlp": PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Shard(1) if moe else Replicate(),),
                use_local_output=moe),
        })
    elif moe:  # each rank routes a slice of the replicated tokens, the outputs gathered after
        plan["moe"] = PrepareModuleInputOutput(
            input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_input=True,
            output_layouts=(Shard(1),), desired_output_layouts=(Replicate(),), use_local_output=True)
    return plan


def _latent_plan(attn: nn.Module) -> dict:
    """Latent attention (model/mla.py): the compressions (wq_a, q_a_norm, wkv_a, kv_a_norm) stay
    plain and replicated, each rank computing them whole from the replicated input; the
    up-projections (wq or wq_b, wkv_b) column-parallel by heads. A column-parallel linear's
    replicated input gets its gradient summed over tp (torch's ColwiseParallel), so the
    compressions' gradients are whole on every rank and need no step of their own."""
    up = "attn.wq_b" if hasattr(attn, "wq_b") else "attn.wq"
    return {up: Colwise(), "attn.wkv_b": Colwise()}


def _copy_to_region(x: torch.Tensor, group) -> torch.Tensor:
    return _CopyToRegion.apply(x, group)


def _own_rows(t: torch.Tensor, group, rank: int, size: int) -> torch.Tensor:
    """The rank's share of a replicated per-head parameter's rows (rank r: the r-th of `size` equal
    parts, the heads of its column-parallel projections); its gradient summed over the group."""
    n = t.shape[0] // size
    return _CopyToRegion.apply(t, group)[rank * n:(rank + 1) * n]


def _split_sinks(attn: nn.Module, tp_mesh) -> None:
    """The sinks (one per query head) split as wq's rows are, by heads: Shard(0); the rank's
    attention reads its own heads' as a plain tensor (their gradient lands in the shard)."""
    sinks = attn.sinks
    attn.register_parameter("sinks", nn.Parameter(distribute_tensor(sinks, tp_mesh, [Shard(0)]),
                                                  requires_grad=sinks.requires_grad))
    attn.sink_logits = partial(_local_sinks, attn)


def _local_sinks(attn: nn.Module) -> torch.Tensor:
    return attn.sinks.to_local()


class ProjectionNorm(ParallelStyle):
    """An RMSNorm over a whole column-parallel projection (the q/k norms of OLMo 2 and OLMoE,
    model.qk_norm_scope=projection): its weight split like the projection's rows, and its input,
    the rank's columns, seen as the column shard it is, so that DTensor sums the squares over the
    tp ranks (one all-reduce of B×T numbers per norm, forward and backward) before the mean."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        weight = module.weight
        module.register_parameter("weight", nn.Parameter(distribute_tensor(weight, device_mesh, [Shard(0)]),
                                                         requires_grad=weight.requires_grad))
        module.register_forward_pre_hook(
            lambda m, args: (DTensor.from_local(args[0], device_mesh, [Shard(args[0].dim() - 1)]),))
        module.register_forward_hook(lambda m, args, out: out.to_local())
        return module


# --------------------------------------------------------------------------------------------
# Fewer K/V heads than tensor-parallel ranks


class _CopyToRegion(torch.autograd.Function):
    """Identity forward; backward sums the gradient over the group (each rank's computation
    from the replicated input contributed only its part)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def _select_kv_head(attn: nn.Module, tp_mesh, kv_heads: int, head_dim: int) -> None:
    """wk and wv stay whole on every rank; each rank keeps the K/V head of its query heads (rank
    r of tp owns query heads r·H/tp ..., which read K/V head r·kv_heads/tp)."""
    group, tp = tp_mesh.get_group(), tp_mesh.size()
    head = tp_mesh.get_local_rank() * kv_heads // tp
    cols = slice(head * head_dim, (head + 1) * head_dim)

    def replicated_input(module, args):
        x = args[0]
        if isinstance(x, DTensor):  # sequence parallel: the gathered input, its gradient a partial sum here
            return (x.to_local(grad_placements=[Partial()]),) + args[1:]
        return (_CopyToRegion.apply(x, group),) + args[1:]

    for linear in (attn.wk, attn.wv):
        linear.register_forward_pre_hook(replicated_input)
        linear.register_forward_hook(lambda module, args, out: out[..., cols])


def whole(t: torch.Tensor) -> torch.Tensor:
    """A replicated DTensor (the loss under tensor parallelism) as the tensor it holds; others as they are."""
    return t.full_tensor() if isinstance(t, DTensor) else t


class ReplicatedKVStep(StepHook):
    """K/V heads fewer than tp: every tp rank holds wk and wv whole and uses in part (its head's
    rows); the copies' gradients are summed over tp each step, so they stay equal."""

    phase = "the replicated K/V projections' gradient all-reduce (tp)"
    NAMES = tuple(f"attn.{w}.{leaf}" for w in ("wk", "wv")
                  for leaf in ("weight", "bias", "lora_a", "lora_b", "lora_magnitude"))  # adapters: used in part too

    def __init__(self, tp_mesh):
        self.group = tp_mesh.get_group()

    @classmethod
    def needed(cls, model_cfg, tp_mesh) -> ReplicatedKVStep | None:
        return cls(tp_mesh) if tp_mesh.size() > 1 and model_cfg.kv_heads < tp_mesh.size() else None

    def reduce_gradients(self, named) -> None:
        sum_gradients([p for n, p in named if n.endswith(self.NAMES)], self.group)


class SequenceShardedMoEStep(StepHook):
    """Mixtures of experts under tp: the router and the experts are replicated over tp (no
    expert-tensor parallelism) and each tp rank routes its own sequence shard, so their
    gradients are partial sums, summed over tp each step (then the copies stay equal). Experts
    split by expert parallelism (`exclude`, ids) are not copies: their engine averages them."""

    phase = "the mixture-of-experts gradients' all-reduce (tp)"

    def __init__(self, tp_mesh, exclude: frozenset[int] = frozenset()):
        self.group, self.exclude = tp_mesh.get_group(), exclude

    @classmethod
    def needed(cls, model_cfg, tp_mesh, exclude: frozenset[int] = frozenset()) -> SequenceShardedMoEStep | None:
        return cls(tp_mesh, exclude) if tp_mesh.size() > 1 and model_cfg.moe_experts else None

    def reduce_gradients(self, named) -> None:
        sum_gradients([p for n, p in named if ".moe." in n and id(p) not in self.exclude], self.group)
