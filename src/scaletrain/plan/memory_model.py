"""Memory per rank, component by component, in closed form.

Model states follow the ZeRO paper (Rajbhandari et al. 2020, section 5): with Ψ parameters on
a rank, p/g/m/o bytes per parameter for parameters, gradients, fp32 master weights and optimizer
state, and N ranks sharding them, stage 1 divides o and m by N, stage 2 also g, stage 3 also p.

Activations per transformer layer come from two sources:

* `korthikanti_layer_bytes`: the textbook GPT layer of Korthikanti et al. 2022 ("Reducing
  Activation Recomputation in Large Transformer Models", section 4 and Table 2):
  sbh(34 + 5as/h) bytes in 16-bit, sbh(10 + 24/t + 5as/(ht)) with tensor parallelism,
  sbh/t(34 + 5as/h) with sequence parallelism as well, 34sbh/t (or sbh(10 + 24/t) without
  sequence parallelism) with selective recomputation, 2sbh with full recomputation.
* `layer_activation_bytes`: the same accounting for scaletrain's own layer, tensor by tensor:
  what each of its operations saves for backward (memory-efficient attention keeps q, k, v, its
  output and a log-sum-exp instead of the s×s scores; no dropout masks; DTensor keeps the
  all-gathered input of a column-parallel matmul under sequence parallelism; autocast keeps the
  low-precision copy of each weight). `scaletrain.plan.trace` checks it by counting the saved
  tensors of the real layer under fake tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from scaletrain.config import ParallelConfig
from scaletrain.model.config import ModelConfig
from scaletrain.plan.activations import (
    attention_backward_bytes,
    first_layer_extra_bytes,
    formula_activation_bytes,
    in_flight,
    mlp_half_bytes,
    moe_half_bytes,
)
from scaletrain.plan.adapters import adapter_activation_bytes, adapter_counts, dequantized_bytes
from scaletrain.plan.params import (
    Dtypes,
    ParamCounts,
    dtypes_for,
    expert_shard_ranks,
    layer_params,
    optimizer_bytes,
    rank_blocks,
    rank_params,
    stage_layers,
)
from scaletrain.plan.spec import Cluster, Layout, Workload

GiB = 2**30


# --------------------------------------------------------------------------------------------
# The whole rank


def model_state_bytes(params: float, d: Dtypes, optimizer_bytes_per_param: float, zero: int,
                      n: int) -> tuple[float, float, float, float]:
    """(parameters, gradients, master weights, optimizer state) per rank for `params` parameters
    sharded over n ranks at ZeRO stage `zero` (Rajbhandari et al. 2020, section 5.1)."""
    return (params * d.param / (n if zero >= 3 else 1),
            params * d.grad / (n if zero >= 2 else 1),
            params * d.master / (n if zero >= 1 else 1),
            params * optimizer_bytes_per_param / (n if zero >= 1 else 1))


@dataclass
class MemoryBreakdown:
    params: float = 0.0
    grads: float = 0.0
    master: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0
    logits_loss: float = 0.0
    comm_buffers: float = 0.0
    reserve: float = 0.0
    host: float = 0.0  # offloaded to host memory (not counted against the device)
    stage: int = 0  # the pipeline rank this breakdown is for (the worst)
    notes: list[str] = field(default_factory=list)
    # the most alive at once, reserve aside, where not every component is alive at the same
    # time (scaletrain's engine, `_peak`); None: the components' sum
    peak: float | None = None

    COMPONENTS = ("params", "grads", "master", "optimizer", "activations", "logits_loss", "comm_buffers", "reserve")

    @property
    def model_states(self) -> float:
        return self.params + self.grads + self.master + self.optimizer

    @property
    def total(self) -> float:
        if self.peak is not None:
            return self.peak + self.reserve
        return sum(getattr(self, c) for c in self.COMPONENTS)

    def as_dict(self) -> dict[str, int]:
        return {c: int(getattr(self, c)) for c in self.COMPONENTS} | {"total": int(self.total), "host": int(self.host)}


RESERVE_FRACTION = 0.05  # caching-allocator fragmentation, stated in the report
RUNTIME_BYTES_GPU = 1.0 * GiB  # CUDA context, NCCL and cuBLAS workspaces


def estimate_memory(cfg: ModelConfig, wl: Workload, layout: Layout, cluster: Cluster | None = None, *,
                    bucket_mb: float = ParallelConfig.bucket_mb, gpu: bool = True,
                    activations: str = "formula") -> MemoryBreakdown:
    """Per-rank memory of `layout`, for its worst pipeline rank: the first (most micro-batches
    in flight, the embedding), the last (the head and loss) or the one with the most layers."""
    worst = None
    layers = [sum(c) for c in stage_layers(cfg, layout)]
    for pp_rank in sorted({0, layout.pp - 1, layers.index(max(layers))}):
        m = _rank_memory(cfg, wl, layout, pp_rank, bucket_mb, gpu, activations)
        if worst is None or m.total > worst.total:
            worst = m
    return worst


def _rank_memory(cfg, wl, layout: Layout, pp_rank: int, bucket_mb: float, gpu: bool, activations: str):
    d = dtypes_for(wl)
    ours = wl.engine == "scaletrain"
    counts = rank_params(cfg, layout, pp_rank)
    sh = sharding(wl, layout)
    extra_grads = 0.0
    adapters = None
    if wl.adapter != "none":  # the base frozen: model states of the adapters, the base's bytes beside them
        adapters = adapter_counts(cfg, wl, layout, pp_rank, counts, 4 if sh.fsdp_like else d.param)
        out = model_state_memory(adapters.trainable, wl, layout, sh=sh)
        frozen = adapters.base_bytes + adapters.frozen * (4 if sh.fsdp_like else d.param)
        out.params += frozen / (sh.n if sh.zero >= 3 else 1)
        out.notes.append(f"adapter.kind={wl.adapter}: {adapters.trainable.total:,} trainable parameters on this rank "
                         f"(gradients and optimizer state), the base frozen"
                         f"{'' if wl.base_dtype == 'auto' else f', its adapted linears stored as {wl.base_dtype}'}")
        counts = adapters.trainable
    else:
        if ours and layout.tp > 1 and not sh.fsdp_like and sh.grad_zero < 2 and pp_rank == 0:
            # the vocabulary-parallel embedding's gradient arrives replicated (DTensor's embedding
            # backward), full size on every tensor-parallel rank, in the parameters' dtype
            extra_grads = cfg.vocab_size * cfg.dim * (1 - 1 / layout.tp) * d.grad
        out = model_state_memory(counts, wl, layout, extra_grads=extra_grads, sh=sh)
    out.stage = pp_rank
    if wl.reference == "model":  # a frozen copy of the starting weights, sharded like the policy's parameters
        reference = model_state_memory(rank_params(cfg, layout, pp_rank), wl, layout, sh=sh).params
        out.params += reference
        out.notes.append(f"{'rl' if wl.objective == 'rl' else 'preference'}.reference=model: the reference's weights, "
                         f"{reference / GiB:.2f} GiB on this rank (no gradients or optimizer state), are in the "
                         "parameters")

    # activations: per micro-batch on this rank's layers (dense and mixture-of-experts blocks),
    # times the micro-batches in flight
    kinds = [(n, moe) for n, moe in zip(rank_blocks(cfg, layout, pp_rank), (False, True)) if n]
    from scaletrain.parallel.pipeline import stage_indices

    stages = stage_indices(layout.pp_schedule, pp_rank, layout.pp, layout.pp_virtual_stages) if layout.pp > 1 else [0]
    last = layout.num_stages - 1
    flight = in_flight(layout.pp_schedule, layout.pp, layout.grad_accum, layout.pp_virtual_stages)[pp_rank]
    b, tp, sp, ac, cp, ep = (layout.micro_batch, layout.tp, layout.sp, layout.activation_checkpointing, layout.cp,
                             layout.ep)
    if activations == "traced":
        if not ours or layout.cp > 1:
            raise ValueError("traced activations count scaletrain's own layer (engine scaletrain, cp 1)")
        if cfg.moe_experts:
            from scaletrain.errors import ConfigError

            raise ConfigError("--activations traced: fake tensors cannot route tokens (a mixture of experts' groups "
                              "depend on the data); use --activations formula")
        from scaletrain.plan.trace import traced_activation_bytes

        per_layer, head = traced_activation_bytes(cfg, wl, b, tp, sp, ac)
        per_kind = {False: per_layer}
    elif activations == "formula":
        per_kind = {moe: formula_activation_bytes(cfg, wl, b, tp, sp, ac, sh.fsdp_like, cp, moe, ep)[0]
                    for _, moe in kinds}
        head = formula_activation_bytes(cfg, wl, b, tp, sp, ac, sh.fsdp_like, cp)[1]
    else:
        raise ValueError(f"unknown activation source {activations!r}")
    out.activations = sum(n * per_kind[moe] for n, moe in kinds) * flight
    if adapters is not None and ac != "full":  # each adapter's rank-wide intermediate
        out.activations += sum(n for n, _ in kinds) * adapter_activation_bytes(cfg, wl, layout, d.compute) * flight
    if adapters is not None and wl.base_dtype in ("nf4", "int8"):  # one base weight dequantized at a time
        out.activations += dequantized_bytes(cfg, wl, layout, d.compute)
    if 0 in stages and activations == "formula":
        out.activations += first_layer_extra_bytes(cfg, wl, layout.micro_batch, layout.tp, layout.sp,
                                                   layout.activation_checkpointing, layout.cp) * flight
    if last in stages:
        # the head's activations live from the last forward of a micro-batch to its backward:
        # one micro-batch at a time on the last stage
        out.logits_loss = head

    if wl.objective == "rl":  # the rollouts' cache, alive while sampling, when the step's activations are not
        from scaletrain.plan.rl import kv_cache_bytes

        kv = kv_cache_bytes(cfg, wl, layout)
        out.notes.append(f"rl: the rollout engine's key/value cache, {kv / GiB:.2f} GiB on this rank "
                         f"({wl.global_batch // layout.dp} completions of {wl.seq_len} positions), while sampling: "
                         f"{'above' if kv > out.activations else 'within'} the step's activations "
                         f"({out.activations / GiB:.2f} GiB), the larger counted")
        out.activations = max(out.activations, kv)

    recompute = 0.0
    if ours and ac != "none":  # backward rebuilds one layer's activations at a time
        recompute = max(formula_activation_bytes(cfg, wl, b, tp, sp, "none", sh.fsdp_like, 1, moe, ep)[0]
                        - formula_activation_bytes(cfg, wl, b, tp, sp, ac, sh.fsdp_like, 1, moe, ep)[0]
                        for _, moe in kinds)
    moments = None
    if ours and activations == "formula" and last in stages:
        moe_last = cfg.is_moe_block(cfg.n_layers - 1)
        moments = backward_moments(cfg, wl, layout, d, per_kind.get(moe_last, max(per_kind.values())))
        if adapters is not None:  # the head and the layers' matrices are frozen: the adapters' gradients, small
            moments = moments._replace(grads_at_attention=0.0, grads_at_start=0.0)
    # FSDP gathers block by block (a mixture's block with its experts, but not the experts
    # expert parallelism holds: FSDP leaves those to their own engine); the root (embedding and
    # head) stays gathered
    block = max(layer_params(cfg, tp, moe, ep).sharded + layer_params(cfg, tp, moe, ep).replicated
                + (layer_params(cfg, tp, moe, ep).expert if ep == 1 else 0) for _, moe in kinds)
    root = (cfg.vocab_size * cfg.dim // layout.tp) * (1 if cfg.tie_embeddings else 2)
    gathered = None
    if adapters is not None:  # FSDP gathers a block's frozen base (quantized: as stored) and its adapters
        base, base_bytes, adapter_params = adapters.per_block
        c = d.compute if d.compute < 4 else 4
        stored = base_bytes if wl.base_dtype != "auto" else base * c
        gathered = ((block - base + adapter_params) * c + stored, adapter_params)
    return buffers_and_peak(out, counts, wl, layout, block_params=block, root_params=root,
                            recompute=recompute, moments=moments, bucket_mb=bucket_mb, gpu=gpu, sh=sh,
                            gathered=gathered)


class BackwardMoments(NamedTuple):
    """Backward's moments on the last pipeline stage, for scaletrain's engine (`backward_moments`)."""

    attention: float  # the last layer's attention backward: the bytes beyond every activation in flight
    grads_at_attention: float  # the gradients made by then (without accumulation)
    grads_at_start: float  # the gradients the head's backward makes
    first_layer: float  # the activations of one layer (the first, whose backward ends the pass)


def backward_moments(cfg: ModelConfig, wl: Workload, layout: Layout, d: Dtypes, per_layer: float) -> BackwardMoments:
    """In the last layer's attention backward, `attention_backward_bytes` are held while what the
    layer's MLP half and its output projection's input kept is freed; the gradients made by
    then are the head's (a tied embedding's share: its gradient's buffer) and the final norm's,
    and the last layer's MLP matrices and norm. `per_layer`: one layer's activations."""
    b, tp, sp, cp = layout.micro_batch, layout.tp, layout.sp, layout.cp
    scratch = attention_backward_bytes(cfg, wl, b, tp, cp, layout.cp_method)
    wo_in = b * wl.seq_len / cp * cfg.n_heads * cfg.head_size / tp * d.compute
    n_ffn = 3 if cfg.gated else 2
    head = (cfg.vocab_size * cfg.dim / tp + cfg.dim) * d.grad
    if cfg.is_moe_block(cfg.n_layers - 1):  # a mixture: its router's, shared and routed experts' gradients
        freed = moe_half_bytes(cfg, wl, b, tp, sp, cp, layout.ep) + wo_in
        shared = n_ffn * cfg.dim * cfg.shared_hidden
        mlp = (cfg.moe_experts * cfg.dim + shared + layer_params(cfg, tp, True, layout.ep).expert + cfg.dim) * d.grad
    else:
        freed = mlp_half_bytes(cfg, wl, b, tp, sp, cp) + wo_in
        mlp = (n_ffn * cfg.dim * cfg.hidden_dim / tp + cfg.dim) * d.grad
    return BackwardMoments(scratch - freed, head + mlp, head, per_layer)


@dataclass(frozen=True)
class Sharding:
    """How a layout's data-parallel engine holds the model states of a rank."""

    n: int  # ranks each state is sharded over: Layout.shard_ranks of the engine
    zero: int  # the ZeRO stage in effect (0 with nothing to shard over)
    grad_zero: int  # the stage the gradients' peak follows (ZeRO-2 under pipelining holds them whole: 1)
    fsdp_like: bool  # scaletrain's FSDP (zero 3) or FSDP-based replication (zero 0 under tp)


def sharding(wl: Workload, layout: Layout) -> Sharding:
    n = layout.shard_ranks(wl.engine)  # the engine's ZeRO group (cp ranks: in the others', not scaletrain's)
    zero = layout.zero if n > 1 else 0
    # scaletrain's FSDP (zero 3) and FSDP-based replication (zero 0 with tp) keep fp32 weights
    # (the masters) and cast into compute-dtype buffers of their own
    fsdp_like = wl.engine == "scaletrain" and layout.step_dp > 1 and (zero == 3 or (zero == 0 and layout.tp > 1))
    # the ZeRO-2 engine reduce-scatters every micro-step's gradients into the shards, with or
    # without accumulation; only under pipelining, where the schedule runs every micro-batch's
    # backward before the one reduction, does it hold full gradients: its peak is then ZeRO-1's
    grad_zero = 1 if zero == 2 and layout.grad_accum > 1 and layout.pp > 1 else zero
    return Sharding(n, zero, grad_zero, fsdp_like)


def expert_sharding(wl: Workload, layout: Layout, sh: Sharding) -> Sharding:
    """How the engine holds the routed experts' model states: without ep like the other
    parameters. Under scaletrain's ep the experts have an engine of their own over the ranks
    holding the same experts (`scaletrain.parallel.expert_parallel.expert_engine`): none or an
    average (zero 0, or one such rank), else ZeRO at the layout's stage over `expert_shard_ranks`
    (`Layout.expert_zero`; at zero 3 their weights are sharded too, gathered a layer at a time
    as FSDP's are). Another engine's ZeRO shards them like the others, over its own expert group."""
    n = expert_shard_ranks(layout, wl.engine)
    if layout.ep == 1 and n == sh.n:
        return sh
    zero = layout.zero if n > 1 else 0
    if wl.engine == "scaletrain" and layout.ep > 1:
        zero = min(zero, layout.expert_zero)
    grad_zero = 1 if zero == 2 and layout.grad_accum > 1 and layout.pp > 1 else zero
    return Sharding(n, zero, grad_zero, sh.fsdp_like)


def model_state_memory(counts: ParamCounts, wl: Workload, layout: Layout, *, extra_grads: float = 0.0,
                       sh: Sharding | None = None) -> MemoryBreakdown:
    """Parameters, gradients, master weights and optimizer state of a rank holding `counts`
    (`extra_grads`: gradient bytes beside them), as the layout's engine shards them
    (`sh`: `sharding(wl, layout)`, if at hand; a mixture's routed experts by `expert_sharding`),
    and what offloading moves to the host."""
    d = dtypes_for(wl)
    sh = sh or sharding(wl, layout)
    out = MemoryBreakdown()
    # FSDP-like engines store fp32 parameters (the masters) and gradients
    dtypes = Dtypes(4, 4, 0, d.compute, d.residual, False) if sh.fsdp_like else d
    dense, experts = counts.parts()
    for part, how in ((dense, sh), (experts, expert_sharding(wl, layout, sh))):
        P, n, zero, grad_zero = part.total, how.n, how.zero, how.grad_zero
        if not P:
            continue
        params, _, master, optimizer = model_state_bytes(P, dtypes, optimizer_bytes(wl.optimizer, part) / P, zero, n)
        grads = model_state_bytes(P, dtypes, 0.0, grad_zero, n)[1]
        if wl.engine == "scaletrain" and d.master and not sh.fsdp_like:
            # bf16-true keeps fp32 gradients for its fp32 masters: at step time the bf16 gradients
            # have been moved into them (one process, DDP), reduce-scattered into fp32 shards
            # (ZeRO-2), or sit beside the fp32 shards (ZeRO-1, and ZeRO-2 while accumulating)
            grads = {0: P * 4, 1: P * d.grad + P * 4 / n, 2: P * 4 / n}[grad_zero]
        if (sync := layout.outer) is not None:  # the outer weights (fp32) and DiLoCo's momentum, of the shard
            optimizer += P / (n if zero >= 1 else 1) * (8 if sync.outer_momentum else 4)
        out.params += params
        out.master += master
        out.optimizer += optimizer
        out.grads += grads
    zero = sh.zero
    out.grads += extra_grads
    if (sync := layout.outer) is not None:
        out.notes.append(f"{sync.mode}: the outer weights{' and momentum' if sync.outer_momentum else ''} "
                         "count as optimizer state")
    if layout.offload_optimizer and zero == 3:
        out.host = out.params + out.grads + out.optimizer
        out.params = out.grads = out.optimizer = 0.0
        out.notes.append("parameters, gradients and optimizer state live in host memory (offload)")
    return out


def buffers_and_peak(out: MemoryBreakdown, counts: ParamCounts, wl: Workload, layout: Layout, *, block_params: float,
                     root_params: float, recompute: float = 0.0, moments: BackwardMoments | None = None,
                     bucket_mb: float = ParallelConfig.bucket_mb, gpu: bool = True,
                     sh: Sharding | None = None, gathered: tuple[float, float] | None = None) -> MemoryBreakdown:
    """Complete `out` (model states and activations filled in) with the communication buffers,
    scaletrain's peak and the reserve. FSDP gathers units of `block_params` parameters, the
    root's `root_params` stay gathered; `recompute`: the bytes checkpointing rebuilds at once;
    `moments`: backward's moments on the last stage (`backward_moments`); `gathered`: (bytes of
    a gathered block, its parameters that take gradients) where not `block_params` of each
    (adapters: a frozen, maybe quantized base)."""
    d = dtypes_for(wl)
    ours = wl.engine == "scaletrain"
    sh = sh or sharding(wl, layout)
    n, zero, grad_zero, fsdp_like = sh.n, sh.zero, sh.grad_zero, sh.fsdp_like
    P = counts.total
    bucket = min(bucket_mb * 2**20, P * 4)
    if n > 1 and zero in (1, 2):
        # ZeRO-1/2 engine: at most two gradient buckets in flight (never more than the
        # gradients themselves), each with its flat send buffer and (gloo) receive buffer, in
        # the reduction dtype
        out.comm_buffers = 2 * min(2 * bucket, P * 4)
    elif fsdp_like:
        c = d.compute if d.compute < 4 else 4
        # two blocks gathered (current + prefetched), the root kept gathered, one block's
        # unsharded fp32 gradients waiting for their reduce-scatter
        out.comm_buffers = (2 * block_params + root_params) * c + block_params * 4
        if gathered is not None:
            out.comm_buffers = 2 * gathered[0] + root_params * c + gathered[1] * 4
    elif zero == 3:  # another engine's ZeRO-3: two blocks gathered, one block's gradients
        out.comm_buffers = 2 * block_params * d.compute + block_params * d.grad
    if ours:
        grads_in_backward = out.grads
        if d.master and not fsdp_like:  # bf16-true: fp32 gradients exist at step time only
            grads_in_backward = P * d.grad / (n if grad_zero >= 2 else 1) + (out.grads - min(out.grads, P * 4))
        out.peak = _peak(out, layout, zero, n, fsdp_like, grads_in_backward, recompute, bucket, P * 4, moments)
    out.reserve = RESERVE_FRACTION * (out.peak if out.peak is not None else
                                      out.model_states + out.activations + out.logits_loss + out.comm_buffers)
    if gpu:
        out.reserve += RUNTIME_BYTES_GPU
    return out


def _peak(m: MemoryBreakdown, layout: Layout, zero: int, n: int, fsdp_like: bool, grads_in_backward: float,
          recompute: float, bucket: float, grad_bytes: float, moments: BackwardMoments | None = None) -> float:
    """The most scaletrain's engine holds at once: parameters, masters and optimizer state
    always, plus the larger of two moments.

    * Backward: every activation in flight, with the head's (whose backward runs first) or,
      after it, the layer being recomputed; the gradients as backward keeps them (bf16-true:
      in bf16). Where `moments` are known and each gradient is made once in the step (one
      micro-batch, no pipelining, no data-parallel engine holding buffers of its own), the
      activations fall as the gradients grow: the largest is at one end — the start (every
      activation, the head's gradients) or the end (every gradient, the first layer's
      activations). FSDP's gathered blocks
      are in use then; its persistent gradients, like ZeRO-2's without accumulation, are 1/n
      shards that the reduce-scatters create as backward frees the activations, so they are
      not there yet.
    * The last layer's attention in backward (where context parallelism's ring and allgather
      recompute their score tiles): every activation in flight but the layer's MLP half, with
      the attention's backward buffers (`moments.attention`: their excess over the MLP half),
      and the gradients made by then (all of them when earlier micro-batches made them).
    * The end of backward and the optimizer step: the gradients at their largest.

    ZeRO-1/2 buckets are sent once their gradients are complete, by when backward has freed
    the activations of the layers they hold: with k of the G gradient bytes' buckets of size B
    sent, (1 - kB/G) of the activations remain beside at most two buckets' send and receive
    buffers."""
    states = m.params + m.master + m.optimizer
    acts = m.activations + max(m.logits_loss, recompute)
    sharded_by_reduction = fsdp_like or (zero == 2 and layout.grad_accum == 1)
    grads = 0.0 if sharded_by_reduction else grads_in_backward
    gathered = m.comm_buffers if fsdp_like else 0.0
    backward = grads + acts + gathered
    if moments is not None:
        once = layout.grad_accum == 1 and layout.pp == 1 and layout.dp == 1
        if once:
            backward = max(min(grads, moments.grads_at_start) + acts,
                           grads + moments.first_layer + recompute) + gathered
        made = min(grads, moments.grads_at_attention) if once else grads
        backward = max(backward, made + m.activations + recompute + moments.attention + gathered)
    if n > 1 and zero in (1, 2):
        for k in (1, 2):
            if k * bucket <= grad_bytes:
                backward = max(backward, grads + m.activations * (1 - k * bucket / grad_bytes) +
                               2 * min(k, 2) * bucket)
    step = m.grads + (m.comm_buffers if fsdp_like else 0.0)
    return states + max(backward, step)


def module_memory(counts: ParamCounts, wl: Workload, layout: Layout, activations: float, *, gpu: bool = True,
                  bucket_mb: float = ParallelConfig.bucket_mb) -> MemoryBreakdown:
    """Per-rank memory of a model known only by its parameters and the activations traced on
    it (an arbitrary nn.Module, data parallel only): model states, buffers, peak and reserve
    as for any model under the layout's engine. FSDP's unit is the whole module (its blocks
    are unknown here): it is gathered whole."""
    out = model_state_memory(counts, wl, layout)
    out.activations = activations
    return buffers_and_peak(out, counts, wl, layout, block_params=0, root_params=counts.total, bucket_mb=bucket_mb,
                            gpu=gpu)
