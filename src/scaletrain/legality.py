"""Whether a job can run: the one legality check, asked alike by the job's settling
(scaletrain.launch.job), by `parallelize()` for a Trainer built directly, and by the planner's
search (scaletrain.plan.search), so the planner never ranks a layout that `train` refuses.

    job_errors(layout, model, techniques, seq_len=...)  ->  every problem, one sentence each

It asks `Layout.errors` for the rules of the layout and the model (sizes that divide, pipeline
schedules, context-parallel chunks, local SGD's fragments, expert parallelism's ranks), then adds
those of the techniques a job runs on top of a layout (`Techniques`): quantization-aware training,
fp8 linears, adapters and their quantized bases, a mixture of experts' capacity, a module scaletrain
did not build, and optimizer offload (on a CPU, or with Muon). Each refusal says what, why and how to fix it.

What is not a combination of settings is checked where it is met: a config key's own range (config
validation), the machine (a C++ compiler, an fp8-capable GPU, torchft installed), and the model's
actual tensors (a quantized base whose rows do not split, weights that do not fit).

This module imports no torch: the planner asks it about thousands of layouts.
"""

from __future__ import annotations

from dataclasses import dataclass

from scaletrain.errors import ConfigError
from scaletrain.layout import Layout


@dataclass(frozen=True)
class Techniques:
    """What a job runs besides its layout that changes which layouts are legal (and what they
    hold in memory: the planner plans the same ones)."""

    qat: str = "none"  # train.qat: fake-quantized linears
    fp8: bool = False  # precision.mode=fp8: float8 linears
    adapter: str = "none"  # adapter.kind: the base frozen, adapters trained
    base_dtype: str = "auto"  # adapter.base_dtype: the frozen base stored quantized (QLoRA)
    document_mask: bool = False  # data.document_mask: every rank must see a window's token ids
    custom_module: bool = False  # an nn.Module scaletrain did not build (Trainer(model=...))
    device_type: str | None = None  # where the job runs, when known ("cpu", "cuda")
    # train.objective=rl: completions per prompt (0: not RL), and whether the run samples them (the rollout
    # engine runs on tp and ZeRO ranks) or replays recorded ones (rl.rollouts: any layout)
    rl_group: int = 0
    rl_samples: bool = False
    tasks: bool = False  # eval.tasks scored during training: every rank runs whole-model forwards
    objective: str = "lm"  # train.objective: what the loss reads of the model's output
    optimizer: str = "adamw"  # optim.name

    @classmethod
    def of(cls, cfg, *, custom_module: bool = False, device_type: str | None = None) -> Techniques:
        """The techniques of a JobConfig."""
        rl = cfg.train.objective == "rl"
        return cls(qat=cfg.train.qat, fp8=cfg.precision.mode == "fp8", adapter=cfg.adapter.kind,
                   base_dtype=cfg.adapter.base_dtype, document_mask=cfg.data.document_mask,
                   custom_module=custom_module, device_type=device_type, rl_group=cfg.rl.group_size if rl else 0,
                   rl_samples=rl and not cfg.rl.rollouts, tasks=bool(cfg.eval.tasks and cfg.eval.every),
                   objective=cfg.train.objective, optimizer=cfg.optim.name)

    @property
    def quantized_base(self) -> str | None:
        """The dtype adapted linears' bases are stored in (None: as the precision keeps weights)."""
        return self.base_dtype if self.adapter != "none" and self.base_dtype != "auto" else None


def job_errors(layout: Layout, model=None, tech: Techniques = Techniques(), *, seq_len: int | None = None,
               engine: str = "scaletrain") -> list[str]:
    """Everything that stops `model` (a ModelConfig, or None: the layout alone) from training in
    `layout` with `tech` on sequences of `seq_len` tokens, one sentence each; [] when it can."""
    if tech.custom_module:  # what needs scaletrain's model first, then the layout's own rules
        e = _custom_module_errors(layout, model, tech) + layout.errors(None, engine=engine, seq_len=seq_len)
    else:
        e = layout.errors(model, engine=engine, seq_len=seq_len) + _qat_errors(layout, tech) + \
            _fp8_errors(layout, tech) + _moe_errors(layout, model) + _document_mask_errors(layout, tech) + \
            _fault_tolerance_errors(layout, model) + _linear_attention_errors(layout, model, tech) + \
            _mtp_errors(layout, model, tech)
    e += _adapter_errors(layout, tech) + _rl_errors(layout, tech) + _tasks_errors(layout, tech)
    return e + _offload_errors(layout, tech)


def _offload_errors(lay: Layout, tech: Techniques) -> list[str]:
    """memory.offload_optimizer (FSDP2's CPU offload under ZeRO-3: the shards and the optimizer's step in host
    memory) is for a GPU run, and not with Muon: Muon's whole-matrix exchange (optim/whole.py) sends the
    shards over the GPUs' collectives (NCCL), which take no host tensors, and Newton-Schulz on the host would
    cost what offload saves. (Offload without ZeRO-3 is Layout.errors' one line.)"""
    if not (lay.offload_optimizer and lay.zero == 3):
        return []
    if tech.device_type not in (None, "cuda"):
        return ["memory.offload_optimizer moves model states from GPU memory to pinned host memory; this run is "
                f"on the {tech.device_type.upper()} already, so drop the option"]
    if tech.optimizer == "muon":
        return ["optim.name=muon with memory.offload_optimizer: not supported (Muon's whole-matrix exchange runs "
                "on the GPUs' collectives, which take no host memory); drop memory.offload_optimizer (Muon keeps "
                "one state buffer where AdamW keeps two), or use optim.name=adamw"]
    return []


def check_job(layout: Layout, model=None, tech: Techniques = Techniques(), *, seq_len: int | None = None) -> None:
    """Raise one ConfigError listing every problem of `job_errors`."""
    if problems := job_errors(layout, model, tech, seq_len=seq_len):
        raise ConfigError(*problems)


def check_config(cfg, layout: Layout, *, custom_module: bool = False, device_type: str | None = None) -> None:
    """`check_job` for a JobConfig run in `layout`."""
    tech = Techniques.of(cfg, custom_module=custom_module, device_type=device_type)
    check_job(layout, cfg.model, tech, seq_len=cfg.data.seq_len)


def data_errors(layout: Layout, *, source: str, loss_mask: bool) -> list[str]:
    """What a layout cannot train on the run's data once it is opened (`source`, `loss_mask`: whether
    its loss counts only a mask's tokens)."""
    if loss_mask and layout.fault_tolerance:
        return [f"{source} has a loss mask (chat data), and fault_tolerance.enabled averages the replica groups' "
                "gradients without weighing their counted tokens: not supported yet; set data.loss_mask=false to "
                "count every token, or fault_tolerance.enabled=false"]
    return []


def check_data(layout: Layout, *, source: str, loss_mask: bool) -> None:
    if problems := data_errors(layout, source=source, loss_mask=loss_mask):
        raise ConfigError(*problems)


# ---- the techniques' rules -------------------------------------------------------------------


def _rl_errors(lay: Layout, tech: Techniques) -> list[str]:
    """train.objective=rl: each data-parallel rank samples whole groups of completions; the rollout engine
    generates on tensor-parallel and ZeRO ranks, not yet through a pipeline or on context-parallel chunks."""
    if not tech.rl_group:
        return []
    e = []
    per_rank = lay.global_batch / lay.dp
    if per_rank != int(per_rank) or int(per_rank) % tech.rl_group:
        e.append(f"rl.group_size={tech.rl_group}: each data-parallel rank samples whole groups, and global batch "
                 f"{lay.global_batch} over dp {lay.dp} is {per_rank:g} completions a rank; make the global batch a "
                 f"multiple of dp x group_size = {lay.dp * tech.rl_group}")
    if tech.rl_samples and (lay.pp > 1 or lay.cp > 1):
        e.append(f"train.objective=rl samples its rollouts on the training ranks, and generation under "
                 f"{'pipeline' if lay.pp > 1 else 'context'} parallelism is not supported yet; use tp or ZeRO-3, or "
                 "replay recorded rollouts (rl.rollouts)")
    return e


def _qat_errors(lay: Layout, tech: Techniques) -> list[str]:
    """train.qat composes with data parallelism (DDP, ZeRO 0-3), every precision, accumulation,
    activation checkpointing and compile; tensor and pipeline parallelism are refused."""
    if tech.qat == "none":
        return []
    e = []
    if lay.tp > 1:
        e.append(f"train.qat={tech.qat} with parallel.tp={lay.tp}: torchao's fake-quantized linear quantizes whole "
                 "weight rows and token rows, which tensor parallelism splits across ranks (per-row scales would "
                 "differ from the quantized model's); set parallel.tp=1")
    if lay.pp > 1:
        e.append(f"train.qat={tech.qat} with parallel.pp={lay.pp}: not supported yet (the pipeline stages are "
                 "untested with fake-quantized linears); set parallel.pp=1")
    return e


def _tasks_errors(lay: Layout, tech: Techniques) -> list[str]:
    """eval.tasks during training runs the model on whole token windows on every rank: each rank must
    produce every position's logits (not a pipeline stage's activations, not a chunk of the window)."""
    if not tech.tasks:
        return []
    return [f"eval.tasks with parallel.{axis}={size}: {why} (not supported yet); score the checkpoint with "
            "`scaletrain eval CKPT --tasks ...`, or set eval.every=0"
            for axis, size, why in (("pp", lay.pp, "each rank holds one pipeline stage, not the whole model"),
                                    ("cp", lay.cp, "each rank holds chunks of a window")) if size > 1]


def _fp8_errors(lay: Layout, tech: Techniques) -> list[str]:
    """fp8 composes with data parallelism (DDP and ZeRO-3 checked against one process; ZeRO-1/2
    and HSDP wrap the converted model like any other), accumulation, activation checkpointing,
    compile and checkpoints; the model-parallel axes are refused."""
    if not tech.fp8:
        return []
    return [f"precision.mode=fp8 with parallel.{axis}={size}: not supported yet ({why}); set parallel.{axis}=1 or "
            "train with precision.mode=bf16-mixed"
            for axis, size, why in (("tp", lay.tp, "its column/row plans would need torchao's Float8ColwiseParallel "
                                     "and Float8RowwiseParallel, which scaletrain does not apply yet"),
                                    ("pp", lay.pp, "the pipeline stages are untested with float8 linears"),
                                    ("cp", lay.cp, "context parallelism is untested with float8 linears"))
            if size > 1]


def _adapter_errors(lay: Layout, tech: Techniques) -> list[str]:
    """Adapters compose with every layout but expert parallelism (tensor parallelism splits them
    like their base; pipeline stages adapt their own linears; context and data parallelism see
    plain parameters). A quantized base (QLoRA) composes with one process, DDP, ZeRO-1/2, ZeRO-3
    (nf4: FSDP2 shards and all-gathers NF4 tensors) and pipeline stages, not with tensor
    parallelism: a row-parallel split cuts through the rows that int8's scale and NF4's
    double-quantized scale groups span, so a shard quantized alone would differ from the whole's."""
    kind, e = tech.adapter, []
    if kind == "none":
        return e
    if lay.ep > 1:
        e.append(f"adapter.kind={kind} with parallel.ep={lay.ep}: not supported yet (the adapters are not in the ep "
                 "plan); set parallel.ep=1")
    if (base := tech.quantized_base) is not None:
        if lay.tp > 1:
            e.append(f"adapter.base_dtype={base} with parallel.tp={lay.tp}: not supported (tensor parallelism would "
                     "split the quantized base weights, whose scales span whole rows); set parallel.tp=1 (ZeRO-3 or "
                     "pp shard the model instead), or adapter.base_dtype=auto")
        if lay.dp_engine == "fsdp" and base != "nf4":
            e.append(f"adapter.base_dtype={base} with parallel.zero=3: FSDP2 shards a quantized base as NF4 only; "
                     "use adapter.base_dtype=nf4, or parallel.zero=2")
    if tech.qat != "none" or tech.fp8:
        what = f"train.qat={tech.qat}" if tech.qat != "none" else "precision.mode=fp8"
        e.append(f"adapter.kind={kind} with {what}: adapters go on plain linears, and {what} converts them; drop "
                 "one of them")
    return e


def _moe_errors(lay: Layout, model) -> list[str]:
    """A mixture of experts with a capacity keeps each expert's first tokens of the micro-batch;
    under context or sequence parallelism a rank holds part of each sequence, so it would keep
    other tokens than one process does."""
    capacity = getattr(model, "moe_capacity_factor", 0) if getattr(model, "moe_experts", 0) else 0
    if not capacity:
        return []
    return [f"model.moe_capacity_factor={capacity} with parallel.{axis}: each rank would keep its experts' first "
            f"tokens among its own part of every sequence, not among the micro-batch's (one process drops other "
            f"tokens); set model.moe_capacity_factor=0 (dropless), or parallel.{axis} off"
            for axis, on in (("cp", lay.cp > 1), ("sp", lay.tp > 1 and lay.sp)) if on]


def _linear_attention_errors(lay: Layout, model, tech: Techniques) -> list[str]:
    """Linear attention (model.linear_heads, model/deltanet.py) carries a state along the sequence:
    a context-parallel rank would need the state of the ranks before it (not built), and packed
    documents would leak it from one document into the next. Tensor parallelism splits its key heads."""
    heads = getattr(model, "linear_heads", 0)
    if not heads:
        return []
    e = []
    if lay.cp > 1:
        e.append(f"parallel.cp={lay.cp} with linear attention (model.linear_heads={heads}): each rank would need the "
                 "recurrent state of the ranks before it, which is not passed between them; run without cp "
                 "(parallel.cp=1)")
    if tech.document_mask:
        e.append("data.document_mask with linear attention (model.linear_heads) is not supported: its state would "
                 "carry from one document into the next; set data.document_mask=false")
    if heads % lay.tp:
        e.append(f"parallel.tp={lay.tp} must divide model.linear_heads={heads}: tensor parallelism splits the "
                 "linear attention's key heads (with their value heads); choose tp among "
                 f"{[d for d in range(1, heads + 1) if heads % d == 0]}")
    return e


def _document_mask_errors(lay: Layout, tech: Techniques) -> list[str]:
    """data.document_mask finds a window's documents from its token ids: every rank must see them
    (and replica groups' averages do not weigh their counted tokens)."""
    if not tech.document_mask:
        return []
    e = ["data.document_mask with fault_tolerance.enabled is not supported: the replica groups' average does "
         "not weigh their counted tokens; set data.document_mask=false"] if lay.fault_tolerance else []
    for axis, size, why in (("pp", lay.pp, "later pipeline stages get hidden states, not the token ids the "
                                           "documents are found from"),
                            ("cp", lay.cp, "each rank holds chunks of a window, not the token ids before them")):
        if size > 1:
            e.append(f"data.document_mask with parallel.{axis}={size} is not supported: {why}; set "
                     f"parallel.{axis}=1 or data.document_mask=false")
    return e


def _mtp_errors(lay: Layout, model, tech: Techniques) -> list[str]:
    """model.mtp_depth (model/mtp.py): each depth reads the embeddings of the tokens ahead of every position
    and the main model's last hidden states, and its logits join the main head's in the loss."""
    depth = getattr(model, "mtp_depth", 0)
    if not depth:
        return []
    e = [f"model.mtp_depth={depth} with parallel.{axis}={size} is not supported: {why}; set parallel.{axis}=1 or "
         "model.mtp_depth=0" for axis, size, why in (
             ("pp", lay.pp, "the last stage, which holds the prediction modules, gets hidden states, not the token "
                            "ids whose embeddings they read"),
             ("cp", lay.cp, "each rank holds chunks of a window, and the tokens ahead of a chunk's end are on "
                            "another rank"),
             ("ep", lay.ep, "the prediction modules' experts are not split over the expert-parallel ranks yet"))
         if size > 1]
    if lay.tp > 1 and lay.sp:
        e.append(f"model.mtp_depth={depth} with parallel.sp=true is not supported yet: the prediction modules take "
                 "whole sequences; set parallel.sp=false")
    if tech.objective != "lm":
        e.append(f"model.mtp_depth={depth} is a language-modelling loss; train.objective={tech.objective} reads "
                 "the next-token logits alone: set model.mtp_depth=0")
    return e


def _fault_tolerance_errors(lay: Layout, model) -> list[str]:
    """Every replica group has the same layout and rank i of each group pairs with rank i of the others
    (its all-reduce, and what it sends a healing peer), so each rank's local tensors (its ZeRO-3 or
    tensor-parallel shard, its pipeline stages, its experts) line up with the same ones in the other
    groups: with sync.mode=step any layout inside a group is protected (tests/test_ft_layouts.py). With
    local SGD / DiLoCo the groups are the workers, one level of them."""
    if not lay.fault_tolerance or lay.dp_sync == "step":
        return []
    e = []
    if model is not None and getattr(model, "moe_experts", 0) and model.moe_bias_rate:
        e.append(f"fault_tolerance.enabled with parallel.sync.mode={lay.dp_sync} and model.moe_bias_rate="
                 f"{model.moe_bias_rate:g}: each group, a worker, would move its experts' routing biases by its own "
                 "tokens' load between syncs, and the workers' models would drift apart; set model.moe_bias_rate=0 "
                 "(balance with model.moe_aux_loss instead), or use parallel.sync.mode=step")
    if lay.dp_replicate != 1:
        e.append(f"fault_tolerance.enabled with parallel.sync.mode={lay.dp_sync} does not protect "
                 f"parallel.dp_replicate={lay.dp_replicate}: the replica groups are the workers, and workers inside "
                 "them would be a second level; leave dp_replicate at 1 (ZeRO, tp, pp, cp and ep work inside a "
                 "group), or use parallel.sync.mode=step")
    return e


def _custom_module_errors(lay: Layout, model, tech: Techniques) -> list[str]:
    """A model scaletrain did not build trains with data parallelism (DDP, ZeRO-1/2/3, HSDP), every
    precision, activation checkpointing and compile; what needs to know the model is refused."""
    e = []
    if lay.ep > 1:
        e.append(f"parallel.ep={lay.ep}: expert parallelism splits the experts of scaletrain's own mixture-of-experts "
                 "layers; a custom nn.Module's are its own: set parallel.ep=1")
    if lay.cp > 1:
        e.append(f"parallel.cp={lay.cp}: context parallelism splits the attention of models scaletrain builds (its "
                 "own transformer, or one taken with model.from_hf); a custom nn.Module's attention is its own: set "
                 "parallel.cp=1")
    if lay.tp > 1 or lay.pp > 1:
        e.append(f"parallel.tp={lay.tp}, parallel.pp={lay.pp}: tensor and pipeline parallelism split models "
                 "scaletrain knows (its own transformer, or one taken with model.from_hf and model.init_from); a "
                 "custom nn.Module trains with data parallelism (DDP, ZeRO 0-3), any precision, activation "
                 "checkpointing and compile: set parallel.tp=1 and parallel.pp=1")
    if tech.qat != "none":
        e.append(f"train.qat={tech.qat} fake-quantizes scaletrain's own transformer (its layer rule knows which "
                 "linears convert); for a custom nn.Module apply torchao's QATConfig to it before handing it to the "
                 "Trainer, and set train.qat=none")
    if tech.fp8:
        e.append("precision.mode=fp8 converts scaletrain's own transformer (its layer rule knows which linears "
                 "convert); for a custom nn.Module apply torchao's convert_to_float8_training to it before handing "
                 "it to the Trainer, and set precision.mode=bf16-mixed")
    if model is not None and getattr(model, "moe_experts", 0):
        e.append(f"model.moe_experts={model.moe_experts} builds mixture-of-experts blocks into scaletrain's own "
                 "transformer; a custom nn.Module's are its own: set model.moe_experts=0")
    if model is not None and getattr(model, "init_from", ""):
        e.append("model.init_from loads weights into scaletrain's own model; a custom nn.Module brings its own "
                 "weights: load them into the module before handing it to the Trainer")
    return e
