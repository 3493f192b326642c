"""The one place where the techniques that transform the model are composed, in a fixed order:

    pipeline split -> (qat | fp8 linears) -> adapters (base frozen) -> tensor/sequence parallel -> expert parallel
        -> activation checkpointing -> compile -> data parallel (sharding engines) -> materialize weights
        -> context parallel attention (its positions are cut from the materialized rotary tables) -> data parallel
        (wrapping engines) -> step hooks

Expert parallelism's experts (DTensors on the ep axis) are left alone by the data-parallel
engine of the rest; an engine of their own joins it (parallel/expert_parallel.py).

Before tensor parallelism, the linears that train.qat or precision.mode=fp8 choose become
fake-quantized or float8 ones (same names), so everything after wraps them. Then adapter.kind
(model/lora.py) replaces the targeted linears by adapted ones (the base's names unchanged) and
freezes every other parameter: the engines and the optimizer take the trainable ones alone.

The model arrives plain, on the meta device; it leaves as this rank's chunks (one, or its
pipeline stages), materialized and initialized from (seed, parameter name) or loaded from given
weights (each rank keeping its shard), wrapped for their data-parallel strategy, with the step
hooks of the techniques applied (parallel/hooks.py: the per-step work the Trainer calls).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from scaletrain.config import JobConfig
from scaletrain.errors import ConfigError, LaunchError
from scaletrain.memory import apply_activation_checkpointing, block_items
from scaletrain.model.lora import AdapterSpec, adapter_init_rule, init_magnitudes, is_adapter_param
from scaletrain.model.transformer import count_params
from scaletrain.parallel import pipeline
from scaletrain.parallel.adapters import (
    BaseFingerprint,
    adapt,
    adapt_module,
    base_fingerprint,
    check_adapters,
    quantize_plan,
)
from scaletrain.parallel.checks import check_compiler, check_fp8, check_qat
from scaletrain.parallel.context_parallel import ContextParallelStep, apply_context_parallel
from scaletrain.parallel.data_parallel import (
    DataParallel,
    DDPDataParallel,
    FSDPDataParallel,
    ReplicateDataParallel,
    apply_fsdp,
    apply_replicate,
)
from scaletrain.parallel.expert_parallel import expert_engine, hide_from_ddp, shard_experts
from scaletrain.parallel.hooks import StepHook
from scaletrain.parallel.init import full_weight, init_weights, initial_value, load_weights
from scaletrain.parallel.moe_balance import MoEBalance, check_moe
from scaletrain.parallel.tensor_parallel import ReplicatedKVStep, SequenceShardedMoEStep, apply_tensor_parallel
from scaletrain.parallel.zero import ZeroDataParallel
from scaletrain.precision import Precision
from scaletrain.quant.fp8 import Fp8ScaleStep, convert_fp8
from scaletrain.quant.frozen_base import bases_on_meta, fill_bases, fill_nf4_shards, is_quantized, quantize_base
from scaletrain.quant.layers import describe, layer_plan
from scaletrain.quant.qat import prepare_qat
from scaletrain.vocab import DP_ENGINES, unknown

if TYPE_CHECKING:  # passed in, never imported: the runtime is the caller's
    from scaletrain.launch.runtime import Runtime


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
    n_blocks: int = 1  # the whole model's repeated blocks (local SGD's fragments split them)
    num_params: int = 0  # the whole model's parameters (before pipeline split and sharding)
    expert_parallel: bool = False  # the experts' tokens travel by all-to-all: every rank runs each forward

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


def parallelize(model: nn.Module, cfg: JobConfig, rt: Runtime, precision: Precision,
                weights=None) -> ParallelModel:
    """`weights`: full tensors by canonical parameter name (e.g. `model.init_from`, read lazily),
    loaded instead of the (seed, name) initialisation."""
    lay = rt.layout
    check_moe(cfg.model, lay)
    if cfg.train.compile:
        check_compiler(rt.device)
    compute_bf16 = precision.compute_dtype if precision.compute_dtype == torch.bfloat16 else None

    # 1. pipeline: this rank's stages, each a copy of the model with the other layers deleted
    if lay.pp > 1:
        num_stages = lay.num_stages
        ranges = pipeline.layer_ranges(cfg.model, num_stages, lay.pp_split)
        stage_ids = pipeline.stage_indices(lay.pp_schedule, rt.axis("pp").get_local_rank(), lay.pp,
                                           lay.chunks_per_rank)
        chunks = pipeline.split_model(model, stage_ids, ranges)
    else:
        num_stages, stage_ids, chunks = 1, [0], [model]

    # quantization-aware training: the chosen linears become fake-quantized ones (same names)
    notes = []
    if cfg.train.qat != "none":
        check_qat(cfg, lay)
        notes += describe(layer_plan(model, cfg.train.qat), f"train.qat={cfg.train.qat}")  # the rule, said once
        for chunk in chunks:
            prepare_qat(chunk, cfg.train.qat)
    # fp8: the chosen linears become torchao's Float8Linear (same names), before everything
    # that wraps them; with tensorwise scales FSDP2 will gather them in fp8
    fp8_all_gather = False
    if precision.mode == "fp8":
        check_fp8(lay, rt.device, cfg.precision.fp8_emulate)
        pc = cfg.precision
        fp8_all_gather = pc.fp8_recipe == "tensorwise" and lay.dp_engine == "fsdp"
        plans = [convert_fp8(chunk, pc.fp8_recipe, emulate=pc.fp8_emulate, fp8_min_dim=pc.fp8_min_dim,
                             fp8_all_gather=fp8_all_gather) for chunk in chunks]
        notes += describe(plans[0], f"precision.mode=fp8 ({pc.fp8_recipe} scales"
                                    f"{', emulated' if pc.fp8_emulate else ''}"
                                    f"{', fp8 all-gather' if fp8_all_gather else ''})")

    # adapters: the targeted linears gain low-rank updates, every other parameter is frozen
    adapters = AdapterSpec.of(cfg.adapter)
    if adapters is not None:
        check_adapters(cfg, lay)
        notes.append(adapt(chunks, adapters))
    # QLoRA: the adapted linears' bases stored quantized, placeholders on the meta device until their values
    # come one weight at a time (never the dense base whole); under ZeRO-3 as NF4 of fp32 that FSDP2 shards,
    # else of the dtype the precision mode keeps weights in (one process quantizes the rounded weights)
    base_dtype = quantize_plan(cfg, chunks, lay.shard_ranks("scaletrain") if lay.dp_engine == "fsdp" else 1)
    if base_dtype is not None:
        for chunk in chunks:
            bases_on_meta(chunk, base_dtype, None if lay.dp_engine == "fsdp" else precision.param_dtype)

    experts = []  # expert parallelism's sharded expert weights (their own data-parallel engine)
    for chunk in chunks:
        # 2. tensor (and sequence) parallel over the innermost axis
        if lay.tp > 1:
            apply_tensor_parallel(chunk, rt.axis("tp"), sequence_parallel=lay.sp,
                                  first_block="0" if "0" in chunk.layers else None)
        # expert parallel: each rank holds 1/ep of the experts, tokens travel by all-to-all
        if lay.ep > 1:
            experts += shard_experts(chunk, rt.expert_mesh()["ep"], grad_scale=lay.token_ranks / lay.ep)
        # 3. activation checkpointing, 4. compile, block by block
        apply_activation_checkpointing(chunk.layers, lay.activation_checkpointing)
        if cfg.train.compile:
            for _, block in block_items(chunk.layers):
                block.compile()  # in place: parameter names (and checkpoint keys) stay the same

    # 5. data parallel engines that shard or replicate DTensors, applied on the meta device
    if lay.offload_optimizer and rt.device.type != "cuda":
        raise LaunchError("memory.offload_optimizer moves model states from GPU memory to pinned host memory; "
                          "this run is on the CPU already, so drop the option")
    fsdp, replicate = lay.dp_engine == "fsdp", lay.dp_engine == "replicate"  # DDP cannot take DTensor parameters
    if fsdp:
        for chunk in chunks:
            apply_fsdp(chunk, _shard_mesh(rt), param_dtype=compute_bf16, offload=lay.offload_optimizer,
                       ignored_params=set(experts))
    elif replicate:
        for chunk in chunks:
            apply_replicate(chunk, rt.axis(_step_dp_axis(rt)), param_dtype=compute_bf16, ignored_params=set(experts))

    # 6. materialize: every parameter from (seed, name), the same numbers on every layout
    with _weights_fit(count_params(cfg.model), rt):
        for chunk in chunks:
            chunk.to_empty(device="cpu" if (fsdp and lay.offload_optimizer) else rt.device)
            chunk.init_buffers(rt.device)
            rule_of = adapter_init_rule(chunk.init_rule, adapters) if adapters is not None else None
            quantized = base_dtype is not None  # the bases filled apart, one whole weight quantized at a time
            plain = _not_quantized(chunk) if quantized else (lambda n: True)
            if weights is not None:
                base_only = None if adapters is None else lambda n, plain=plain: not is_adapter_param(n) and plain(n)
                load_weights(chunk, weights, cfg.model.init_from or "the weights", only=base_only)
                if adapters is not None:  # the adapters are not in the weights: from (seed, name)
                    init_weights(chunk, cfg.train.seed, rule_of, only=is_adapter_param)
            else:
                init_weights(chunk, cfg.train.seed, rule_of, only=None if not quantized else plain)
            if quantized:
                base_value = _full_values(chunk, weights, cfg.model.init_from or "the weights", rule_of,
                                          cfg.train.seed)
                if fsdp:
                    fill_nf4_shards(chunk, base_value)
            if adapters is not None:
                init_magnitudes(chunk)  # DoRA: from the base, once it holds its values
            if not (fsdp or replicate):  # those keep fp32 storage and cast for compute themselves
                _move(chunk, dtype=precision.param_dtype)  # the quantized bases are of that dtype already
                if quantized:  # the placeholders replaced by the quantized values, one weight at a time
                    fill_bases(chunk, base_value, base_dtype)
            elif precision.param_dtype != torch.float32:  # ...but start from the rounded weights the others keep
                with torch.no_grad():
                    for p in chunk.parameters():
                        if is_quantized(p):
                            continue  # quantized from the fp32 values (one process quantizes the rounded ones)
                        local = p.to_local() if hasattr(p, "to_local") else p
                        local.copy_(local.to(precision.param_dtype))
            chunk.train()
            # context parallel: attention over the cp ranks, positions those of this rank's chunks
            # (after materializing: it cuts the rotary tables to this rank's rows)
            if lay.cp > 1:
                apply_context_parallel(chunk, rt.axis("cp"), lay.cp_method, cfg.data.seq_len)

    # 7. data parallel engines that wrap materialized weights (the experts: an engine of their own)
    if experts and lay.dp_engine == "ddp":
        for chunk in chunks:
            hide_from_ddp(chunk, experts)
    dp = _engine(chunks, cfg, rt, precision, experts={id(p) for p in experts})
    if experts:
        dp = expert_engine(dp, chunks, experts, rt, bucket_mb=cfg.parallel.bucket_mb,
                           master_dtype=torch.float32 if precision.master_weights else None)
    result = ParallelModel(dp, stage_ids=stage_ids, num_stages=num_stages, keeps_fp32_weights=lay.keeps_fp32_weights,
                           notes=notes, vocab_parallel=lay.tp > 1, n_blocks=cfg.model.n_layers,
                           num_params=count_params(cfg.model), expert_parallel=bool(experts))
    if lay.pp > 1:
        result.stages = pipeline.build_stages(dp.models, stage_ids, num_stages, rt.device, rt.group("pp"))

    # 8. the per-step work of what was applied, in the order the step runs it
    if adapters is not None:  # the base's fingerprint in checkpoints, checked on resume
        result.hooks.append(BaseFingerprint(adapters, base_fingerprint(cfg, rt)))
    # the experts as the hooks see them (their engine's: ZeRO's shards, or themselves)
    expert_ids = frozenset(id(p) for _, p in dp.experts.named_optim_params) if experts else frozenset()
    if lay.cp > 1:
        result.hooks.append(ContextParallelStep(rt.axis("cp"), exclude=expert_ids))
    if lay.tp > 1 and (kv := ReplicatedKVStep.needed(cfg.model, rt.axis("tp"))):
        result.hooks.append(kv)
    if lay.pp > 1 and (tied := pipeline.TiedEmbeddingStep.needed(cfg.model, rt.mesh, result)):
        result.hooks.append(tied)
    if fp8_all_gather:
        result.hooks.append(Fp8ScaleStep(dp.models))
    if lay.tp > 1 and (moe_tp := SequenceShardedMoEStep.needed(cfg.model, rt.axis("tp"), expert_ids)):
        result.hooks.append(moe_tp)
    if cfg.model.moe_experts:  # the load over the ranks that saw different tokens: dp, cp, tp
        groups = [rt.group(axis) for axis, size in ((_step_dp_axis(rt), lay.dp), ("cp", lay.cp),
                                                     ("tp", lay.tp)) if size > 1]
        if balance := MoEBalance.for_model(dp.models, cfg.model, groups, rt.group("pp") if lay.pp > 1 else None,
                                           rt.device):
            result.hooks.append(balance)
    return result


def _not_quantized(chunk: nn.Module):
    """name -> whether the canonical parameter name is not a quantized base weight of `chunk`."""
    from scaletrain.parallel.init import canonical_name

    bases = {canonical_name(n) for n, p in chunk.named_parameters() if is_quantized(p)}
    return lambda name: name not in bases


def _move(module: nn.Module, device: torch.device | None = None, dtype: torch.dtype | None = None) -> None:
    """`module.to(device, dtype)` (the same conversion of each tensor), the quantized bases left as they
    are (`to` would dequantize them)."""
    module._apply(lambda t: t if is_quantized(t) else
                  t.to(device, dtype if t.is_floating_point() or t.is_complex() else None))


def _full_values(chunk: nn.Module, weights, where: str, rule_of, seed: int):
    """canonical name -> the full fp32 value of one of `chunk`'s parameters, read from `weights`
    (checked against the model's shape) or drawn from (seed, name): one tensor at a time."""
    if weights is not None:
        return lambda name: full_weight(weights, name, _param_shape(chunk, name), where)
    return lambda name: initial_value(rule_of(name), _param_shape(chunk, name), seed, name)


def _param_shape(chunk: nn.Module, cname: str) -> torch.Size:
    from scaletrain.parallel.init import canonical_name

    return next(p.shape for n, p in chunk.named_parameters() if canonical_name(n) == cname)


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


def _shard_mesh(rt: Runtime):
    """FSDP's mesh: dp_shard, or (HSDP) dp_replicate × dp_shard. When the workers (dp_replicate
    groups) sync every sync_every steps (parallel/local_sgd.py), each worker shards on its own."""
    hsdp = rt.layout.dp_replicate > 1 and not rt.layout.local_sync
    return rt.mesh["dp_replicate", "dp_shard"] if hsdp else rt.mesh["dp_shard"]


def _step_dp_axis(rt: Runtime) -> str:
    """The mesh axis whose ranks reduce gradients every step: all data-parallel ranks, or, when
    the workers sync every sync_every steps, the dp_shard ranks of one worker."""
    return "dp_shard" if rt.layout.local_sync else "dp"


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
        return DDPDataParallel(chunks, rt.group(_step_dp_axis(rt)), bucket_mb,
                               reduce_in_fp32=precision.param_dtype != torch.float32)
    if engine not in ("zero1", "zero2"):  # never take a name we do not know for ZeRO
        raise unknown("data-parallel engine", engine, DP_ENGINES)
    # a frozen parameter (adapter fine-tuning's base) has no gradient to reduce and no optimizer state
    params = [(n, p) for n, p in DataParallel(chunks).named_params if id(p) not in experts and p.requires_grad]
    return ZeroDataParallel(chunks, rt.mesh, stage=lay.zero, bucket_mb=bucket_mb,
                            dp_replicate=1 if lay.local_sync else lay.dp_replicate,
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
    if lay.ep > 1:
        raise ConfigError(f"parallel.ep={lay.ep}: expert parallelism splits the experts of scaletrain's own "
                          "mixture-of-experts layers; a custom nn.Module's are its own: set parallel.ep=1")
    if lay.cp > 1:
        raise ConfigError(f"parallel.cp={lay.cp}: context parallelism splits the attention of models scaletrain "
                          f"builds (its own transformer, or one taken with model.from_hf); a custom nn.Module's "
                          f"attention is its own: set parallel.cp=1")
    if lay.tp > 1 or lay.pp > 1:
        raise ConfigError(f"parallel.tp={lay.tp}, parallel.pp={lay.pp}: tensor and pipeline parallelism split "
                          "models scaletrain knows (its own transformer, or one taken with model.from_hf and "
                          "model.init_from); a custom nn.Module trains with data parallelism (DDP, ZeRO 0-3), any "
                          "precision, activation checkpointing and compile: set parallel.tp=1 and parallel.pp=1")
    if cfg.train.qat != "none":
        raise ConfigError(f"train.qat={cfg.train.qat} fake-quantizes scaletrain's own transformer (its layer rule "
                          "knows which linears convert); for a custom nn.Module apply torchao's QATConfig to it "
                          "before handing it to the Trainer, and set train.qat=none")
    if precision.mode == "fp8":
        raise ConfigError("precision.mode=fp8 converts scaletrain's own transformer (its layer rule knows which "
                          "linears convert); for a custom nn.Module apply torchao's convert_to_float8_training to it "
                          "before handing it to the Trainer, and set precision.mode=bf16-mixed")
    if cfg.model.moe_experts:
        raise ConfigError(f"model.moe_experts={cfg.model.moe_experts} builds mixture-of-experts blocks into "
                          "scaletrain's own transformer; a custom nn.Module's are its own: set model.moe_experts=0")
    if cfg.model.init_from:
        raise ConfigError("model.init_from loads weights into scaletrain's own model; a custom nn.Module brings "
                          "its own weights: load them into the module before handing it to the Trainer")
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
        _move(module, rt.device)
    if fsdp:
        compute_bf16 = precision.compute_dtype if precision.compute_dtype == torch.bfloat16 else None
        apply_fsdp(module, _shard_mesh(rt), param_dtype=compute_bf16, offload=lay.offload_optimizer,
                   blocks=[b for _, b in block_items(blocks)])
    else:
        _move(module, dtype=precision.param_dtype)
    module.train()
    return ParallelModel(_engine([module], cfg, rt, precision), keeps_fp32_weights=lay.keeps_fp32_weights,
                         n_blocks=len(blocks) if blocks is not None else 1, hooks=[adapters] if adapters else [],
                         num_params=sum(p.numel() for p in module.parameters()))
