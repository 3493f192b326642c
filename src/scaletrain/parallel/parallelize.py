"""The one place where the techniques that transform the model are composed, in a fixed order,
`STEPS` (a function each, run in turn on one `Composition`):

    split_pipeline -> apply_qat | apply_fp8 (linears converted) -> apply_adapters (base frozen, maybe quantized)
        -> apply_tp (tensor/sequence parallel) -> apply_ep (expert parallel) -> activation checkpointing, compile
        -> apply_sharding_engines (FSDP2, replicate: on the meta device) -> materialize_weights (then context
        parallel attention: its positions are cut from the materialized rotary tables)
        -> apply_wrapping_engines (DDP, ZeRO-1/2, the experts' engine, pipeline stages) -> register_step_hooks

Expert parallelism's experts (DTensors on the ep axis) are left alone by the data-parallel
engine of the rest; an engine of their own joins it (parallel/expert_parallel.py).

Before tensor parallelism, the linears that train.qat or precision.mode=fp8 choose become
fake-quantized or float8 ones (same names), so everything after wraps them. Then adapter.kind
(model/lora.py) replaces the targeted linears by adapted ones (the base's names unchanged) and
freezes every other parameter: the engines and the optimizer take the trainable ones alone.

The model arrives plain, on the meta device; it leaves as this rank's chunks (one, or its
pipeline stages), materialized and initialized from (seed, parameter name) or loaded from given
weights (each rank keeping its shard), wrapped for their data-parallel strategy, with the step
hooks of the techniques applied (scaletrain/hooks.py: the per-step work the Trainer calls).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from scaletrain.config import JobConfig
from scaletrain.errors import ConfigError
from scaletrain.hooks import StepHook, StepHooks
from scaletrain.legality import check_config
from scaletrain.memory import apply_activation_checkpointing, block_items
from scaletrain.model.lora import AdapterSpec
from scaletrain.model.loss import cross_entropy_sum
from scaletrain.model.mtp import MTPLoss
from scaletrain.model.transformer import count_params
from scaletrain.parallel import pipeline
from scaletrain.parallel.adapters import (
    BaseFingerprint,
    adapt,
    adapt_module,
    base_fingerprint,
    quantize_plan,
)
from scaletrain.parallel.checks import check_compiler
from scaletrain.parallel.context_parallel import ContextParallelStep, apply_context_parallel
from scaletrain.parallel.data_parallel import (
    DataParallel,
    DDPDataParallel,
    FSDPDataParallel,
    ReplicateDataParallel,
    apply_fsdp,
    apply_replicate,
    clip_gradients,
    model_state_bytes,
)
from scaletrain.parallel.expert_parallel import expert_engine, hide_from_ddp, shard_experts
from scaletrain.parallel.init import Materialize, materialize, move
from scaletrain.parallel.moe_balance import MoEBalance
from scaletrain.parallel.mtp_metrics import MTPMetrics
from scaletrain.parallel.outer import outer_loop
from scaletrain.parallel.tensor_parallel import ReplicatedKVStep, SequenceShardedMoEStep, apply_tensor_parallel, whole
from scaletrain.parallel.zero import ZeroDataParallel
from scaletrain.precision import MasterWeights, Precision
from scaletrain.quant.fp8 import Fp8ScaleStep, check_fp8_device, convert_fp8
from scaletrain.quant.frozen_base import bases_on_meta, quantize_base
from scaletrain.quant.layers import describe, layer_plan
from scaletrain.quant.qat import prepare_qat
from scaletrain.vocab import DP_ENGINES, unknown

if TYPE_CHECKING:  # passed in, never imported: the runtime is the caller's
    from scaletrain.runtime import Runtime


@dataclass
class ParallelModel:
    dp: DataParallel  # this rank's chunks and their data-parallel strategy
    stages: list = field(default_factory=list)  # PipelineStage per chunk when pp > 1
    stage_ids: list[int] = field(default_factory=lambda: [0])
    num_stages: int = 1
    keeps_fp32_weights: bool = False  # the sharding engine keeps fp32 (master) weights itself
    hooks: list[StepHook] = field(default_factory=list)  # the applied techniques' per-step work, in order
    notes: list[str] = field(default_factory=list)  # what the run's log says of the conversions (qat, fp8)
    vocab_parallel: bool = False  # tensor parallel: the logits stay split by vocabulary
    # what every forward's length must be a multiple of (sequence parallelism cuts it in tp equal shards):
    # generation pads to it (model.generate.forward_logits)
    length_multiple: int = 1
    n_blocks: int = 1  # the whole model's repeated blocks (local SGD's fragments split them)
    num_params: int = 0  # the whole model's parameters (before pipeline split and sharding)
    expert_parallel: bool = False  # the experts' tokens travel by all-to-all: every rank runs each forward
    master: MasterWeights | None = None  # bf16-true without an engine keeping fp32: the optimizer's fp32 copies
    norm_group: object = None  # the pipeline's stages: the global gradient norm spans them
    norm_copies: Callable[[], tuple] = tuple  # parameters another stage holds too (a tied embedding's)
    micro_schedule: object = None  # the pipeline schedule the step's micro-batches go through (schedule())
    custom: bool = False  # a user's module (parallelize_module): its outputs need not be logits
    # this rank's share of a batch's (inputs, targets), cut in the data loader (None: all of it; context
    # parallel: its chunks of every sequence); a picklable function, as the loader's workers call it
    batch_share: Callable | None = None
    # the sum of a micro-batch's token losses from the model's output (multi-token prediction's: model/mtp.py)
    loss_fn: Callable = cross_entropy_sum

    # ---- what the Trainer asks of the parallel model (it imports no technique) ----

    def schedule(self, name: str, micro_batches: int, loss_fn):
        """The pipeline schedule that runs this rank's stages (kept as `micro_schedule`); None without
        pipeline parallelism."""
        self.micro_schedule = pipeline.build_schedule(self.stages, name, micro_batches, loss_fn) if self.stages \
            else None
        return self.micro_schedule

    def through_schedule(self, schedule, batches, micro_batches: int, **kw) -> tuple[torch.Tensor, float]:
        """A step's micro-batches through the pipeline schedule at once (pipeline.forward_backward)."""
        return pipeline.forward_backward(self, schedule, batches, micro_batches, **kw)

    def clip_gradients(self, params, max_norm: float):
        """The global gradient norm (every shard and stage, a weight two stages hold counted once),
        gradients clipped to `max_norm`."""
        return clip_gradients(params, max_norm, self.norm_group, copies=self.norm_copies())

    def state_bytes(self, params, optimizer) -> dict[str, int]:
        """This rank's model states, measured (parameters, gradients, optimizer state)."""
        return model_state_bytes(self.dp, params, optimizer)

    @staticmethod
    def whole(loss: torch.Tensor) -> torch.Tensor:
        """A loss computed on vocabulary shards (tensor parallel) as a plain tensor."""
        return whole(loss)

    @property
    def optim_params(self) -> list[tuple[str, nn.Parameter]]:
        """What the optimizer steps: the fp32 masters, the engine's shards (ZeRO-1/2) or the parameters."""
        return self.master.named_master if self.master is not None else self.dp.named_optim_params

    def loss_context(self):
        """Where the loss (and its backward) is computed: under tensor parallelism on the logits'
        vocabulary shards, never gathering the full logits."""
        if self.vocab_parallel:
            from torch.distributed.tensor.parallel import loss_parallel

            return loss_parallel()
        return contextlib.nullcontext()

    @property
    def sharded_forward(self) -> bool:
        """Every rank takes part in each forward (ZeRO-3 gathers, tensor-parallel collectives)."""
        return self.dp.zero == 3 or self.vocab_parallel or self.expert_parallel

    @property
    def first(self) -> bool:  # holds the embedding: feeds inputs
        return 0 in self.stage_ids

    @property
    def last(self) -> bool:  # holds the head: computes the loss
        return self.num_stages - 1 in self.stage_ids


@dataclass
class Composition:
    """What the steps of `parallelize` hand on to each other: the run's settings, this rank's chunks
    as they are transformed, and what the steps found (notes for the log, the experts' weights)."""

    cfg: JobConfig
    rt: Runtime
    precision: Precision
    weights: object  # full tensors by canonical name (model.init_from), or None: from (seed, name)
    chunks: list[nn.Module]
    stage_ids: list[int] = field(default_factory=lambda: [0])
    num_stages: int = 1
    notes: list[str] = field(default_factory=list)
    adapters: AdapterSpec | None = None
    base_dtype: str | None = None  # the adapted linears' bases stored quantized (QLoRA)
    fp8_all_gather: bool = False  # FSDP2 gathers the float8 linears' weights in fp8
    experts: list = field(default_factory=list)  # expert parallelism's weights (an engine of their own)
    dp: DataParallel | None = None
    result: ParallelModel | None = None

    @property
    def lay(self):
        return self.rt.layout


def parallelize(model: nn.Module, cfg: JobConfig, rt: Runtime, precision: Precision,
                weights=None) -> ParallelModel:
    """`weights`: full tensors by canonical parameter name (e.g. `model.init_from`, read lazily),
    loaded instead of the (seed, name) initialisation. The steps run in the order they compose: the
    order of STEPS is the documentation."""
    check_config(cfg, rt.layout, device_type=rt.device.type)  # as settle did (a Trainer may be built directly)
    if cfg.train.compile:
        check_compiler(rt.device)
    c = Composition(cfg, rt, precision, weights, chunks=[model])
    for step in STEPS:
        step(c)
    return c.result


def split_pipeline(c: Composition) -> None:
    """1. pipeline: this rank's stages, each a copy of the model with the other layers deleted."""
    lay = c.lay
    if lay.pp == 1:
        return
    c.num_stages = lay.num_stages
    ranges = pipeline.layer_ranges(c.cfg.model, c.num_stages, lay.pp_split)
    c.stage_ids = pipeline.stage_indices(lay.pp_schedule, c.rt.axis("pp").get_local_rank(), lay.pp,
                                         lay.chunks_per_rank)
    c.chunks = pipeline.split_model(c.chunks[0], c.stage_ids, ranges)


def apply_qat(c: Composition) -> None:
    """Quantization-aware training: the chosen linears become fake-quantized ones (same names)."""
    if (scheme := c.cfg.train.qat) == "none":
        return
    c.notes += describe(layer_plan(c.chunks[0], scheme), f"train.qat={scheme}")  # the rule, said once
    for chunk in c.chunks:
        prepare_qat(chunk, scheme)


def apply_fp8(c: Composition) -> None:
    """fp8: the chosen linears become torchao's Float8Linear (same names), before everything that
    wraps them; with tensorwise scales FSDP2 will gather them in fp8 (a step hook refreshes the scales)."""
    if c.precision.mode != "fp8":
        return
    pc = c.cfg.precision
    check_fp8_device(c.rt.device, pc.fp8_emulate)  # the machine's part; the layout's is legality's
    c.fp8_all_gather = pc.fp8_recipe == "tensorwise" and c.lay.dp_engine == "fsdp"
    plans = [convert_fp8(chunk, pc.fp8_recipe, emulate=pc.fp8_emulate, fp8_min_dim=pc.fp8_min_dim,
                         fp8_all_gather=c.fp8_all_gather) for chunk in c.chunks]
    c.notes += describe(plans[0], f"precision.mode=fp8 ({pc.fp8_recipe} scales"
                                  f"{', emulated' if pc.fp8_emulate else ''}"
                                  f"{', fp8 all-gather' if c.fp8_all_gather else ''})")


def apply_adapters(c: Composition) -> None:
    """Adapters: the targeted linears gain low-rank updates, every other parameter is frozen. QLoRA:
    the adapted linears' bases stored quantized, placeholders on the meta device until their values
    come one weight at a time (never the dense base whole); under ZeRO-3 as NF4 of fp32 that FSDP2
    shards, else of the dtype the precision mode keeps weights in."""
    c.adapters = AdapterSpec.of(c.cfg.adapter)
    if c.adapters is None:
        return
    c.notes.append(adapt(c.chunks, c.adapters))
    fsdp = c.lay.dp_engine == "fsdp"
    c.base_dtype = quantize_plan(c.cfg, c.chunks, c.lay.shard_ranks("scaletrain") if fsdp else 1)
    if c.base_dtype is not None:
        for chunk in c.chunks:
            bases_on_meta(chunk, c.base_dtype, None if fsdp else c.precision.param_dtype)


def apply_tp(c: Composition) -> None:
    """2. tensor (and sequence) parallel over the innermost axis."""
    if c.lay.tp > 1:
        for chunk in c.chunks:
            apply_tensor_parallel(chunk, c.rt.axis("tp"), sequence_parallel=c.lay.sp,
                                  first_block="0" if "0" in chunk.layers else None)


def apply_ep(c: Composition) -> None:
    """Expert parallel: each rank holds 1/ep of the experts, tokens travel by all-to-all."""
    if c.lay.ep > 1:
        for chunk in c.chunks:
            c.experts += shard_experts(chunk, c.rt.expert_mesh()["ep"], grad_scale=c.lay.token_ranks / c.lay.ep)


def apply_checkpointing_and_compile(c: Composition) -> None:
    """3. activation checkpointing, 4. compile, block by block (in place: parameter names, and so
    checkpoint keys, stay the same)."""
    for chunk in c.chunks:
        apply_activation_checkpointing(chunk.layers, c.lay.activation_checkpointing)
        if c.cfg.train.compile:
            for _, block in block_items(chunk.layers):
                block.compile()


def apply_sharding_engines(c: Composition) -> None:
    """5. the data-parallel engines that shard or replicate DTensors, applied on the meta device
    (DDP cannot take DTensor parameters: zero 0 under tp replicates)."""
    lay, rt, compute_bf16 = c.lay, c.rt, _compute_bf16(c.precision)
    if lay.dp_engine == "fsdp":
        for chunk in c.chunks:
            apply_fsdp(chunk, rt.shard_mesh(), param_dtype=compute_bf16, offload=lay.offload_optimizer,
                       ignored_params=set(c.experts))
    elif lay.dp_engine == "replicate":
        for chunk in c.chunks:
            apply_replicate(chunk, rt.step_mesh(), param_dtype=compute_bf16,
                            ignored_params=set(c.experts))


def materialize_weights(c: Composition) -> None:
    """6. materialize: every parameter from (seed, name) or the given weights, the same numbers on
    every layout; then context parallel attention over the cp ranks, whose positions are this rank's
    chunks of the sequence (after materializing: it cuts the rotary tables to this rank's rows)."""
    lay, cfg = c.lay, c.cfg
    spec = Materialize(cfg.train.seed, c.rt.device, c.precision.param_dtype,
                       engine_keeps_fp32=lay.dp_engine in ("fsdp", "replicate"), fsdp=lay.dp_engine == "fsdp",
                       offload=lay.offload_optimizer, weights=c.weights, where=cfg.model.init_from or "the weights",
                       adapters=c.adapters, base_dtype=c.base_dtype)
    with _weights_fit(count_params(cfg.model), c.rt):
        for chunk in c.chunks:
            materialize(chunk, spec)
            if lay.cp > 1:
                apply_context_parallel(chunk, c.rt.axis("cp"), lay.cp_method, cfg.data.seq_len)


def apply_wrapping_engines(c: Composition) -> None:
    """7. the data-parallel engines that wrap materialized weights (the experts: an engine of their
    own), and the pipeline's stages over them."""
    lay, cfg = c.lay, c.cfg
    if c.experts and lay.dp_engine == "ddp":
        for chunk in c.chunks:
            hide_from_ddp(chunk, c.experts)
    c.dp = _engine(c.chunks, cfg, c.rt, c.precision, experts={id(p) for p in c.experts})
    if c.experts:
        c.dp = expert_engine(c.dp, c.chunks, c.experts, c.rt, bucket_mb=cfg.parallel.bucket_mb,
                             master_dtype=torch.float32 if c.precision.master_weights else None)
    c.result = ParallelModel(c.dp, stage_ids=c.stage_ids, num_stages=c.num_stages,
                             keeps_fp32_weights=lay.keeps_fp32_weights, notes=c.notes, vocab_parallel=lay.tp > 1,
                             length_multiple=lay.tp if lay.sp else 1,
                             n_blocks=cfg.model.n_layers, num_params=count_params(cfg.model),
                             expert_parallel=bool(c.experts))
    if lay.pp > 1:
        c.result.stages = pipeline.build_stages(c.dp.models, c.stage_ids, c.num_stages, c.rt.device,
                                                c.rt.group("pp"))
        c.result.norm_group = c.rt.group("pp")


def apply_master_weights(c: Composition) -> None:
    """8. bf16-true: the optimizer steps fp32 master copies of the weights, unless the engine keeps fp32
    weights itself (FSDP, replicate, ZeRO-1/2's shards)."""
    c.result.master = _master_weights(c.result, c.precision)


def _master_weights(pm: ParallelModel, precision: Precision) -> MasterWeights | None:
    return MasterWeights(pm.dp.named_params) if precision.master_weights and not pm.keeps_fp32_weights else None


def register_step_hooks(c: Composition) -> None:
    """9. the per-step work of what was applied, in the order the step runs it: the masters first (the
    others reduce the masters' gradients)."""
    cfg, lay, rt, dp, hooks = c.cfg, c.lay, c.rt, c.dp, c.result.hooks
    if c.result.master is not None:
        hooks.append(c.result.master)
    if c.adapters is not None:  # the base's fingerprint in checkpoints, checked on resume
        hooks.append(BaseFingerprint(c.adapters, base_fingerprint(cfg, rt)))
    # the experts as the hooks see them (their engine's: ZeRO's shards, or themselves)
    expert_ids = frozenset(id(p) for _, p in dp.experts.named_optim_params) if c.experts else frozenset()
    if lay.cp > 1:
        hooks.append(cp := ContextParallelStep(rt.axis("cp"), exclude=expert_ids))
        c.result.batch_share = cp.batch_share  # each cp rank's tokens, cut in the data loader
    if lay.tp > 1 and (kv := ReplicatedKVStep.needed(cfg.model, rt.axis("tp"))):
        hooks.append(kv)
    if lay.pp > 1 and (tied := pipeline.TiedEmbeddingStep.needed(cfg.model, rt.mesh, c.result)):
        hooks.append(tied)
        c.result.norm_copies = tied.copies
    if c.fp8_all_gather:
        hooks.append(Fp8ScaleStep(dp.models))
    if lay.tp > 1 and (moe_tp := SequenceShardedMoEStep.needed(cfg.model, rt.axis("tp"), expert_ids)):
        hooks.append(moe_tp)
    if cfg.model.moe_experts:  # the load over the ranks that saw different tokens: dp, cp, tp
        groups = [rt.group(axis) for axis, size in ((lay.step_axis, lay.step_dp), ("cp", lay.cp),
                                                     ("tp", lay.tp)) if size > 1]
        if balance := MoEBalance.for_model(dp.models, cfg.model, groups, rt.group("pp") if lay.pp > 1 else None,
                                           device=rt.device, warmup=cfg.optim.warmup_steps):
            hooks.append(balance)
    if cfg.model.mtp_depth:  # its loss, and each depth's in the metrics
        c.result.loss_fn = MTPLoss(cfg.model.mtp_depth, cfg.model.mtp_loss_weight)
        hooks.append(MTPMetrics(c.result.loss_fn, [rt.group(lay.step_axis)] if lay.step_dp > 1 else []))


def initial_weights(cfg: JobConfig, *, resuming: bool):
    """The weights a run of scaletrain's model starts from: model.init_from (names and shapes checked,
    each tensor read when used), or None (from (seed, name)). A resumed run takes the checkpoint's,
    but for a frozen base (adapters), which its checkpoints do not hold."""
    if not cfg.model.init_from or (resuming and AdapterSpec.of(cfg.adapter) is None):
        return None
    from scaletrain.data.tokenizer import check_same_tokenizer
    from scaletrain.model.hf import load_hf_weights

    check_same_tokenizer(cfg.model.init_from, cfg.data.path)  # the ids must mean the same text
    return load_hf_weights(cfg.model.init_from, cfg.model)


# The composition, in its order: what each step wraps was made by the steps before it.
STEPS = (split_pipeline, apply_qat, apply_fp8, apply_adapters, apply_tp, apply_ep,
         apply_checkpointing_and_compile, apply_sharding_engines, materialize_weights, apply_wrapping_engines,
         apply_master_weights, register_step_hooks)


def step_hooks(pm: ParallelModel, cfg: JobConfig, rt: Runtime, *, optimizer, state, refresh,
               precision: Precision) -> StepHooks:
    """Every step hook of the run, in the order the step calls them: those parallelize registered (the
    masters, then each technique's), the outer loop (local SGD / DiLoCo / replica groups), which sees
    the stepped weights, and last fp16's loss scaler (precision's, if any), which unscales the
    gradients all the others reduced. `optimizer` steps `pm.optim_params`; `state`, `refresh` and the
    scaler are what a replica group heals from a peer."""
    scaler = precision.scaler
    outer = outer_loop(pm.optim_params, cfg, rt, n_blocks=pm.n_blocks, optimizer=optimizer, state=state,
                       refresh=refresh, scaler=scaler, hooks=pm.hooks)
    if scaler is not None:  # the loss was scaled in place of dp, the mean's factor: unscaling multiplies it back
        scaler.times = rt.layout.dp
    return StepHooks([*pm.hooks, outer, scaler], outer=outer)


def _compute_bf16(precision: Precision):
    """The dtype the sharding engines cast weights to for compute: bf16 under bf16 modes, else none."""
    return precision.compute_dtype if precision.compute_dtype == torch.bfloat16 else None


@contextlib.contextmanager
def _weights_fit(num_params: int, rt: Runtime):
    """Allocating the weights: running out of memory there is one line that says what to do."""
    try:
        yield
    except RuntimeError as e:  # torch.OutOfMemoryError included
        if "out of memory" not in str(e) and "can't allocate memory" not in str(e):
            raise
        raise ConfigError(f"the model's weights ({num_params / 1e6:,.1f}M parameters) do not fit in {rt.device} "
                          f"memory on rank {rt.rank}; shrink the model, or shard it (parallel.zero=3, tp, pp): "
                          "`scaletrain plan --config FILE` finds a layout") from None


def _engine(chunks: list[nn.Module], cfg: JobConfig, rt: Runtime, precision: Precision,
            experts: set[int] = frozenset()) -> DataParallel:
    """The layout's data-parallel engine over this rank's materialized (and, for FSDP, sharded)
    chunks; ZeRO-1/2 leaves the parameters in `experts` (ids) to expert parallelism's engine."""
    lay, bucket_mb = rt.layout, cfg.parallel.bucket_mb
    engine = lay.dp_engine
    if engine == "none":
        return DataParallel(chunks)
    if engine == "fsdp":
        return FSDPDataParallel(chunks)
    if engine == "replicate":
        return ReplicateDataParallel(chunks)
    if engine == "ddp":
        return DDPDataParallel(chunks, rt.group(rt.layout.step_axis), bucket_mb,
                               reduce_in_fp32=precision.param_dtype != torch.float32)
    if engine not in ("zero1", "zero2"):  # never take a name we do not know for ZeRO
        raise unknown("data-parallel engine", engine, DP_ENGINES)
    # a frozen parameter (adapter fine-tuning's base) has no gradient to reduce and no optimizer state
    params = [(n, p) for n, p in DataParallel(chunks).named_params if id(p) not in experts and p.requires_grad]
    return ZeroDataParallel(chunks, rt.mesh, stage=lay.zero, bucket_mb=bucket_mb,
                            dp_replicate=lay.step_replicas,
                            master_dtype=torch.float32 if precision.master_weights else None, params=params)


# --------------------------------------------------------------------------------------------
# Any nn.Module


def find_blocks(module: nn.Module) -> nn.ModuleList | nn.ModuleDict | None:
    """The module's repeated blocks, the unit of FSDP sharding, activation checkpointing and
    compile: `module.layers` if it is a ModuleList/ModuleDict, else the first such container named
    `layers`, `h` or `blocks` anywhere inside (Hugging Face's model.layers, GPT-2's transformer.h,
    nanoGPT's transformer.h)."""
    if isinstance(getattr(module, "layers", None), (nn.ModuleList, nn.ModuleDict)):
        return module.layers
    for name, sub in module.named_modules():
        if isinstance(sub, (nn.ModuleList, nn.ModuleDict)) and name.rsplit(".", 1)[-1] in ("layers", "h", "blocks") \
                and len(sub):
            return sub
    return None


def parallelize_module(module: nn.Module, cfg: JobConfig, rt: Runtime, precision: Precision) -> ParallelModel:
    """A model scaletrain did not build, with its own weights: data parallel (DDP, ZeRO-1/2/3,
    HSDP), every precision, activation checkpointing and compile, block by block. Tensor and
    pipeline parallelism need to know how to split the model: they are refused.

    The protocol: `module(inputs)` takes token ids (B, T) and returns what the trainer's loss
    function turns into the sum of the micro-batch's token losses; its repeated blocks are an
    nn.ModuleList/ModuleDict named `layers` (or `h`, `blocks`: `find_blocks`), the unit of ZeRO-3
    sharding, activation checkpointing and compile."""
    lay = rt.layout
    check_config(cfg, lay, custom_module=True, device_type=rt.device.type)
    blocks = find_blocks(module)
    if blocks is None and (lay.activation_checkpointing != "none" or lay.dp_engine == "fsdp"):
        raise ConfigError(f"{type(module).__name__} has no repeated blocks scaletrain can find (an nn.ModuleList or "
                          "ModuleDict named layers, h or blocks) for activation checkpointing and ZeRO-3; name "
                          "its block list `layers`")
    if rt.distributed:  # every rank starts from rank 0's weights, whatever each built
        import torch.distributed as dist

        with torch.no_grad():
            for t in [*module.parameters(), *module.buffers()]:
                dist.broadcast(t.data, src=0)
    # adapters: on the module's own names, before any wrapper; the base's bytes fingerprinted
    adapters = adapt_module(module, spec, cfg.train.seed) if (spec := AdapterSpec.of(cfg.adapter)) else None
    # QLoRA: the module's weights are its own, known now: quantized whole (FSDP2 then shards NF4 by rows)
    base_dtype = quantize_plan(cfg, [module], lay.shard_ranks("scaletrain") if lay.dp_engine == "fsdp" else 1)
    if blocks is not None:
        apply_activation_checkpointing(blocks, lay.activation_checkpointing)
    if cfg.train.compile:
        check_compiler(rt.device)
        for _, block in (block_items(blocks) if blocks is not None else [(None, module)]):
            block.compile()
    fsdp = lay.dp_engine == "fsdp"
    with _weights_fit(sum(p.numel() for p in module.parameters()), rt):
        if base_dtype is not None:  # each base put on the device and quantized there, one weight at a time
            quantize_base(module, base_dtype, rt.device, None if fsdp else precision.param_dtype)
        move(module, rt.device)
    if fsdp:
        apply_fsdp(module, rt.shard_mesh(), param_dtype=_compute_bf16(precision), offload=lay.offload_optimizer,
                   blocks=[b for _, b in block_items(blocks)])
    else:
        move(module, dtype=precision.param_dtype)
    module.train()
    pm = ParallelModel(_engine([module], cfg, rt, precision), keeps_fp32_weights=lay.keeps_fp32_weights, custom=True,
                       n_blocks=len(blocks) if blocks is not None else 1,
                       num_params=sum(p.numel() for p in module.parameters()))
    pm.master = _master_weights(pm, precision)
    pm.hooks = [h for h in (pm.master, adapters) if h is not None]
    return pm
