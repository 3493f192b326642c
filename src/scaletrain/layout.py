"""The layout of a run, resolved once: how many ranks take part in each kind of parallelism,
how each step's batch is cut, and the rules that follow from those numbers.

    world = pp × dp_replicate × dp_shard × cp × tp
    global_batch = micro_batch × grad_accum × dp          (dp = dp_replicate × dp_shard)

A `Layout`'s fields are the config keys of the same names ([parallel], train.micro_batch and
train.grad_accum, memory.activation_checkpointing and memory.offload_optimizer; dp_sync and
sync_* are parallel.sync.mode and its keys, fault_tolerance is fault_tolerance.enabled) after
derivation, their defaults the config's: `parallel.dp_shard = -1` becomes the remaining ranks,
the batch triad is completed (`parallel.pp_microbatches` is the accumulation count under
pipelining). The trainer, `parallelize`, `verify`, `bench` and the planner (its search, memory
and time models) read the layout from here, and `errors()` / `check()` is the one place that
says whether it can train a model on a sequence length: the tp, pp and cp sizes a model allows
(`tp_errors`, the pipeline's stages and schedules, the cp chunks of a sequence), ZeRO's ranks
and local SGD's fragments (`fragment_errors`).

Facts about the ranks, each answered by one member:
  world            pp × dp_replicate × dp_shard × cp × tp (`config_world`: a config's own axes)
  global_batch     micro_batch × grad_accum × dp
  chunks_per_rank  pipeline chunks each pp rank runs (interleaved schedules: pp_virtual_stages)
  dp_engine        which data-parallel engine runs: none, ddp, zero1, zero2, fsdp (ZeRO-3, HSDP
                   with dp_replicate > 1) or replicate (zero 0 under tp: DDP cannot take DTensors)
  keeps_fp32_weights  the engine keeps fp32 weights itself (FSDP, replicate, ZeRO-1/2 shards), so
                   the precision policy adds no master copy of its own
  step_dp          the ranks whose gradients are reduced every step: all dp ranks, or, when the
                   workers (dp_replicate groups) sync every sync_every steps (dp_sync = local_sgd,
                   diloco), the dp_shard ranks of one worker
  shard_ranks      the ranks each model-state shard is split over (ZeRO's N), for scaletrain's
                   engines and for the engines the planner compares against

Mesh axes, outermost first: pp, dp_replicate, dp_shard, cp, tp. Tensor parallelism is innermost
so its ranks are neighbours (one node, the fastest links); context parallelism next (it passes
keys and values every layer); pipeline stages are outermost because they exchange the least.
Context-parallel ranks read the same batch (each its own chunks of every sequence) and hold the
same weights: their gradients are summed, and the data-parallel engines shard over dp_shard only.

Expert parallelism (`ep`) adds no ranks: it borrows them from the ranks that see different tokens
within a replica group — dp_shard × cp × tp, as torchtitan's dp2ep (the tp ranks route each its own
sequence shard of a mixture-of-experts block, parallel/tensor_parallel.py). Those ranks, flattened
in mesh order, are cut into groups of ep neighbours (tp first, then cp, then dp_shard), each group
splitting every MoE layer's experts (parallel/expert_parallel.py, on the mesh of
`build_expert_mesh`). The experts' gradients are averaged over the `expert_dp` = dp × cp × tp / ep
ranks that hold the same experts, their ZeRO shards split over the dp_shard × cp × tp / ep of them.

This module imports no torch at load time: the planner enumerates thousands of layouts.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from scaletrain.config import FaultToleranceConfig, MemoryConfig, ParallelConfig, SyncConfig, TrainConfig
from scaletrain.errors import ConfigError
from scaletrain.schedule import BatchSchedule, parse_rampup
from scaletrain.vocab import CP_METHODS, is_multi_chunk, unknown

MESH_AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
EXPERT_MESH_AXES = ("pp", "dp_replicate", "dp_shard", "ep")  # dp_shard here: dp_shard × cp × tp / ep
PIPELINE_ONLY = ("parallel.pp_virtual_stages, pp_split and pp_microbatches describe pipeline stages; "
                 "they need parallel.pp > 1")


def chunks_per_rank(schedule: str, virtual: int) -> int:
    return virtual if is_multi_chunk(schedule) else 1


@dataclass(frozen=True)
class OuterSync:
    """How copies of the model trained apart are synced (parallel.sync): `mode` local_sgd or diloco,
    every `every` steps, in `fragments` (streaming), `delay` steps late, weights sent in `dtype`; the
    `workers` are the job's dp_replicate groups (1 per job under fault tolerance: the groups are its
    workers, each a job of its own)."""

    mode: str
    every: int
    fragments: int
    delay: int
    dtype: str
    workers: int

    @property
    def outer_momentum(self) -> bool:
        """DiLoCo keeps an outer optimizer's momentum beside the outer weights; local SGD averages."""
        return self.mode == "diloco"


@dataclass(frozen=True)
class Layout:
    # the defaults are the config's (its dataclasses are their one home); sizes and the batch
    # triad default to 1, where the config's -1 and 0 ask for derivation
    dp_replicate: int = ParallelConfig.dp_replicate
    dp_shard: int = 1
    tp: int = ParallelConfig.tp
    pp: int = ParallelConfig.pp
    cp: int = ParallelConfig.cp  # context parallel: each rank holds 1/cp of every sequence
    ep: int = ParallelConfig.ep  # expert parallel: ranks borrowed from dp_shard × cp × tp, each 1/ep of the experts
    cp_method: str = ParallelConfig.cp_method  # ring, allgather or ulysses (scaletrain.parallel.context_parallel)
    zero: int = ParallelConfig.zero
    sp: bool = ParallelConfig.sp
    pp_schedule: str = ParallelConfig.pp_schedule
    pp_virtual_stages: int = ParallelConfig.pp_virtual_stages
    pp_split: str = ParallelConfig.pp_split
    micro_batch: int = 1
    grad_accum: int = 1
    activation_checkpointing: str = MemoryConfig.activation_checkpointing
    offload_optimizer: bool = MemoryConfig.offload_optimizer
    # parallel.sync.mode, every, fragments, delay, dtype
    dp_sync: str = SyncConfig.mode  # step, local_sgd or diloco (the dp_replicate groups are the workers)
    sync_every: int = SyncConfig.every
    sync_fragments: int = SyncConfig.fragments
    sync_delay: int = SyncConfig.delay
    sync_dtype: str = SyncConfig.dtype
    # "START,INCREMENT,TOKENS": the global batch grows to global_batch (BatchSchedule)
    batch_rampup: str = TrainConfig.batch_rampup
    # one replica group of a fault-tolerant job: with local SGD / DiLoCo the groups are the workers
    fault_tolerance: bool = FaultToleranceConfig.enabled

    # ---- from a config ------------------------------------------------------------------------

    @classmethod
    def from_config(cls, cfg, world_size: int) -> Layout:
        """The layout of `cfg` (a JobConfig) on `world_size` ranks: dp_shard = -1 resolved, the
        batch triad derived or checked. Raises ConfigError when the numbers do not add up; the
        model-dependent checks are `check()`."""
        par, train, sync = cfg.parallel, cfg.train, cfg.parallel.sync
        fixed = cls.fixed_ranks(par)
        cp_name, cp_size = (" × cp", f" × {par.cp}") if par.cp > 1 else ("", "")
        if par.dp_shard == 0:
            raise ConfigError("parallel.dp_shard=0 is not a size; use -1 for all remaining ranks or a positive number")
        if par.dp_shard == -1:
            if world_size % fixed:
                raise ConfigError(
                    f"the layout needs a multiple of dp_replicate × tp × pp{cp_name} = {par.dp_replicate} × "
                    f"{par.tp} × {par.pp}{cp_size} = {fixed} ranks, but the world has {world_size}; change the layout "
                    f"or the number of processes (--nproc)")
            dp_shard = world_size // fixed
        else:
            dp_shard = par.dp_shard
            if fixed * dp_shard != world_size:
                raise ConfigError(
                    f"the layout pp × dp_replicate × dp_shard{cp_name} × tp = {par.pp} × {par.dp_replicate} × "
                    f"{dp_shard}{cp_size} × {par.tp} = {fixed * dp_shard} ranks, but the world has {world_size}; "
                    f"set parallel.dp_shard=-1 to use the remaining ranks, or launch {fixed * dp_shard} processes")
        if par.pp == 1 and par.pp_microbatches:
            raise ConfigError(PIPELINE_ONLY)
        micro, accum = resolve_batch(train.global_batch, train.micro_batch, train.grad_accum,
                                     par.dp_replicate * dp_shard, par.pp_microbatches)
        return cls(dp_replicate=par.dp_replicate, dp_shard=dp_shard, tp=par.tp, pp=par.pp, cp=par.cp, ep=par.ep,
                   cp_method=par.cp_method, zero=par.zero, sp=par.sp,
                   pp_schedule=par.pp_schedule, pp_virtual_stages=par.pp_virtual_stages, pp_split=par.pp_split,
                   micro_batch=micro, grad_accum=accum,
                   activation_checkpointing=cfg.memory.activation_checkpointing,
                   offload_optimizer=cfg.memory.offload_optimizer, dp_sync=sync.mode, sync_every=sync.every,
                   sync_fragments=sync.fragments, sync_delay=sync.delay, sync_dtype=sync.dtype,
                   batch_rampup=train.batch_rampup, fault_tolerance=cfg.fault_tolerance.enabled)

    # ---- sizes --------------------------------------------------------------------------------

    @staticmethod
    def fixed_ranks(par) -> int:
        """Ranks of every axis but dp_shard that a config's [parallel] (a ParallelConfig) names:
        dp_replicate × tp × pp × cp. parallel.dp_shard = -1 takes the world's remaining ranks."""
        return par.dp_replicate * par.tp * par.pp * par.cp

    @classmethod
    def config_world(cls, par) -> int:
        """The world a config's [parallel] names by itself: its axes' product, dp_shard = -1
        (all remaining ranks) counted as 1."""
        return cls.fixed_ranks(par) * max(par.dp_shard, 1)

    @property
    def dp(self) -> int:
        """Data-parallel size: ranks that see different data."""
        return self.dp_replicate * self.dp_shard

    @property
    def local_sync(self) -> bool:
        """The workers (dp_replicate groups) sync every sync_every steps, not every step."""
        return self.dp_sync != "step"

    @property
    def outer(self) -> OuterSync | None:
        """The outer sync of copies trained apart between syncs (the run's outer loop: local SGD,
        DiLoCo, streaming), or None when every data-parallel rank syncs every step."""
        if not self.local_sync:
            return None
        return OuterSync(self.dp_sync, self.sync_every, self.sync_fragments, self.sync_delay, self.sync_dtype,
                         self.dp_replicate)

    @property
    def step_dp(self) -> int:
        """Ranks whose gradients are reduced every step: every dp rank, or one worker's."""
        return self.dp_shard if self.local_sync else self.dp

    @property
    def step_axis(self) -> str:
        """The mesh axis whose ranks reduce gradients every step: `dp` (every data-parallel rank,
        flattened), or `dp_shard` (one worker's) when the workers sync every sync_every steps."""
        return "dp_shard" if self.local_sync else "dp"

    @property
    def step_replicas(self) -> int:
        """The dp_replicate ranks inside each step's reduction (HSDP's and ZeRO's replica groups):
        all of them, or 1 when they are workers that sync every sync_every steps."""
        return 1 if self.local_sync else self.dp_replicate

    @property
    def shard_axes(self) -> tuple[str, ...]:
        """The mesh axes FSDP shards over: dp_shard, or (HSDP) dp_replicate × dp_shard."""
        return ("dp_replicate", "dp_shard") if self.step_replicas > 1 else ("dp_shard",)

    @property
    def expert_step_axis(self) -> str:
        """The expert mesh's axis whose ranks reduce the experts' gradients every step: `expert_dp`
        (every rank that holds the same experts), or one worker's (`dp_shard`) under local sync."""
        return "dp_shard" if self.local_sync else "expert_dp"

    @property
    def expert_shard_ranks(self) -> int:
        """Ranks of one replica group that hold the same experts (the expert mesh's dp_shard axis):
        dp_shard × cp × tp / ep; ZeRO shards the experts' states over them."""
        return self.dp_shard * self.token_ranks // self.ep

    def stride(self, axis: str) -> int:
        """Ranks between neighbours of `axis` in the mesh (MESH_AXES, outermost first): the product
        of the sizes of the axes inside it."""
        inner = MESH_AXES[MESH_AXES.index(axis) + 1:]
        sizes = dict(zip(MESH_AXES, self.mesh_shape))
        out = 1
        for name in inner:
            out *= sizes[name]
        return out

    @property
    def expert_dp(self) -> int:
        """Ranks that hold the same experts under expert parallelism and reduce their gradients
        every step (step_dp × cp × tp / ep: one worker's under local SGD / DiLoCo, whose workers
        sync every sync_every steps); their expert states are sharded by ZeRO over the
        dp_shard × cp × tp / ep of them."""
        return self.step_dp * self.token_ranks // self.ep

    @property
    def expert_zero(self) -> int:
        """The ZeRO stage of the experts' own engine under expert parallelism (over the
        expert_dp ranks): the layout's (parallel/expert_parallel.py: ExpertZero3 for 3)."""
        return self.zero

    @property
    def token_ranks(self) -> int:
        """Ranks of one data-parallel rank that route different tokens through a mixture of
        experts: its cp ranks (their chunks of the sequences) times its tp ranks (each its
        sequence shard). ep borrows from these and the dp_shard ranks."""
        return self.cp * self.tp

    @property
    def loss_copies(self) -> int:
        """Ranks of one data-parallel rank and pipeline stage that hold the same loss: its tensor-parallel
        ranks (the logits' vocabulary shards reduce to one loss on each), summed over and divided out."""
        return self.tp

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.grad_accum * self.dp

    @property
    def chunks_per_rank(self) -> int:
        return chunks_per_rank(self.pp_schedule, self.pp_virtual_stages) if self.pp > 1 else 1

    @property
    def num_stages(self) -> int:
        return self.pp * self.chunks_per_rank

    # ---- the engines it implies ---------------------------------------------------------------

    @property
    def dp_engine(self) -> str:
        """The engine that reduces gradients every step over the step_dp ranks."""
        if self.step_dp == 1:
            return "none"
        if self.zero == 3:
            return "fsdp"
        if self.zero == 0:
            return "replicate" if self.tp > 1 else "ddp"
        return f"zero{self.zero}"

    @property
    def keeps_fp32_weights(self) -> bool:
        return self.dp_engine in ("fsdp", "replicate", "zero1", "zero2")

    def shard_ranks(self, engine: str = "scaletrain") -> int:
        """Ranks each model-state shard (parameters, gradients, optimizer state under ZeRO) is
        split over: ZeRO's N. scaletrain's engines shard over the dp_shard ranks of the step
        alone — its context-parallel ranks hold whole copies of the shards and sum their
        gradients; the engines the planner compares against (Megatron's distributed optimizer,
        torchtitan's FSDP over dp × cp) also shard over the cp ranks, which hold the same weights."""
        return (self.dp_shard if self.step_dp > 1 else 1) * (self.cp if engine != "scaletrain" else 1)

    # ---- checks -------------------------------------------------------------------------------

    def errors(self, model=None, *, engine: str = "scaletrain", seq_len: int | None = None) -> list[str]:
        """Everything wrong with training `model` (a ModelConfig, or None for the layout alone)
        in this layout on sequences of `seq_len` tokens (None: not known), one sentence each; []
        when it can train."""
        e = []
        if self.zero >= 1 and self.shard_ranks(engine) == 1:
            more = " (launch them with --nproc N)" if self.world == 1 else ""
            e.append(f"parallel.zero={self.zero} shards model states over the dp_shard ranks, but there is only 1 "
                     f"({self.describe_ranks()}); use parallel.zero=0, or more data-parallel ranks{more}")
        if self.sp and self.tp == 1:
            e.append("parallel.sp=true splits the sequence over the tensor-parallel ranks; it needs parallel.tp > 1")
        if self.offload_optimizer and self.zero != 3:
            e.append("memory.offload_optimizer offloads the sharded model states of parallel.zero=3; it does nothing "
                     f"at zero={self.zero}; set parallel.zero=3 or drop the offload")
        if self.local_sync and self.dp_replicate == 1 and not self.fault_tolerance:
            e.append(f"parallel.sync.mode={self.dp_sync} syncs the workers, which are the dp_replicate groups, every "
                     f"sync.every steps; with parallel.dp_replicate=1 there is one worker; set parallel.dp_replicate "
                     f"to the number of workers (2 or more), or sync.mode=step")
        streamed = [f"parallel.sync.{k}={v}" for k, v, ok in (("fragments", self.sync_fragments, 1),
                    ("delay", self.sync_delay, 0), ("dtype", self.sync_dtype, "fp32")) if v != ok]
        if self.fault_tolerance and self.local_sync and streamed:  # the groups are the workers (ReplicaGroupsOuter)
            e.append(f"fault_tolerance.enabled syncs the replica groups' {self.dp_sync} whole, in fp32, with no "
                     f"delay: {', '.join(streamed)} across groups is not supported yet; leave sync.fragments at 1, "
                     "sync.delay at 0 and sync.dtype at fp32")
        if self.batch_rampup:
            e += self._rampup_errors()
        if self.ep > 1:
            e += self._ep_errors(model)
        if self.cp > 1:
            # every engine cuts the sequence into 2 × cp load-balanced chunks; the methods and
            # their model rules are scaletrain's
            e += self._seq_errors(seq_len) if engine != "scaletrain" else self._cp_errors(model, seq_len)
        if self.pp > 1:
            e += self._schedule_errors(model.n_layers if model is not None else None)
        elif self.pp_virtual_stages != 1 or self.pp_split:
            e.append(PIPELINE_ONLY)
        if model is not None:
            if self.pp > 1 and model.tie_embeddings and self.pp_schedule == "zero-bubble":
                e.append("model.tie_embeddings=true keeps the shared weight on the first and the last pipeline "
                         "stage, which the zero-bubble V puts on one rank; use another pp_schedule, or set "
                         "model.tie_embeddings=false")
            if self.tp > 1:
                e += tp_errors(model, self.tp)
            e += self.fragment_errors(model.n_layers)
        return e

    def fragment_errors(self, n_blocks: int, *, of_config: bool = True) -> list[str]:
        """Why local SGD / DiLoCo cannot split a model of `n_blocks` blocks into this layout's
        sync_fragments ([] if it can, or without local sync). `of_config`: the blocks are the
        config's model.n_layers (else a module's own blocks, counted)."""
        if not self.local_sync or self.sync_fragments <= n_blocks:
            return []
        has = f"model.n_layers={n_blocks}" if of_config else f"it has {n_blocks}"
        return [f"parallel.sync.fragments={self.sync_fragments} splits the model's blocks into fragments, but {has}; "
                f"use at most {n_blocks} fragments"]

    def check(self, model=None, *, engine: str = "scaletrain", seq_len: int | None = None) -> Layout:
        """Raise one ConfigError listing every problem of `errors()`; returns self."""
        problems = self.errors(model, engine=engine, seq_len=seq_len)
        if problems:
            raise ConfigError(*problems)
        return self

    def _ep_errors(self, model) -> list[str]:
        """Why this layout's expert parallelism cannot train `model` (None: the layout alone)."""
        ep, e = self.ep, []
        borrows = self.dp_shard * self.token_ranks
        if borrows == 1:  # nothing to borrow: one rank routes every token
            e.append(f"parallel.ep={ep} borrows its ranks from the dp_shard × cp × tp ranks, but there is only 1 "
                     f"({self.describe_ranks()}); launch {ep} or a multiple (--nproc {ep}), or set parallel.ep=1")
        elif borrows % ep:
            e.append(f"parallel.ep={ep} borrows its ranks from the dp_shard × cp × tp ranks, so it must divide "
                     f"dp_shard × cp × tp = {self.dp_shard} × {self.cp} × {self.tp} = {borrows}; use an ep in "
                     f"{[d for d in range(2, borrows + 1) if borrows % d == 0]}, or more of those ranks")
        if model is not None:
            experts = getattr(model, "moe_experts", 0)
            if not experts:
                e.append(f"parallel.ep={ep} splits the experts of a mixture of experts, but the model is dense "
                         "(model.moe_experts=0); set model.moe_experts or parallel.ep=1")
            elif experts % ep:
                e.append(f"parallel.ep={ep} must divide model.moe_experts={experts} (each rank holds the same number "
                         f"of experts); use ep in {[d for d in range(1, experts + 1) if experts % d == 0]}")
        return e

    def _cp_errors(self, model, seq_len: int | None) -> list[str]:
        """Why this layout's context parallelism cannot train `model` on `seq_len` tokens."""
        cp, method = self.cp, self.cp_method
        if method not in CP_METHODS:
            return [str(unknown("parallel.cp_method", method, CP_METHODS))]
        e = self._seq_errors(seq_len)
        if model is not None:
            heads = model.n_heads // self.tp if model.n_heads % self.tp == 0 else None
            if method == "ulysses" and heads is not None and heads % cp:
                e.append(f"parallel.cp_method=ulysses swaps sequence shards for head shards: the {heads} attention "
                         f"heads of each tensor-parallel rank (model.n_heads={model.n_heads} / tp {self.tp}) must "
                         f"divide by parallel.cp={cp}; use cp_method=ring or allgather, or a cp that divides {heads}")
            if model.dropout > 0:
                e.append(f"model.dropout={model.dropout:g}: attention dropout is not supported under context "
                         "parallelism (parallel.cp > 1); set model.dropout=0")
            changed = [f"model.{k}={getattr(model, k):g}" for k in ("attn_softcap", "attn_scale_dim")
                       if getattr(model, k, 0)]
            if changed:
                e.append(f"{' and '.join(changed)} change the attention scores, which context parallelism's "
                         "attention (parallel.cp > 1) computes unchanged; train this model with parallel.cp=1")
            if getattr(model, "mla_kv_rank", 0) and model.mla_v_dim > model.head_dim:
                e.append(f"model.mla_v_dim={model.mla_v_dim} is wider than model.head_dim={model.head_dim}: context "
                         "parallelism (parallel.cp > 1) sends latent attention's values padded to the keys' width, "
                         "not wider; train this model with parallel.cp=1")
        return e

    def _seq_errors(self, seq_len: int | None) -> list[str]:
        """Why context parallelism cannot cut sequences of `seq_len` tokens (None: not known)."""
        cp = self.cp
        if seq_len is None or cp == 1:
            return []
        # every method uses the load-balanced causal split: rank i holds chunks i and 2cp-1-i
        if seq_len < 2 * cp:
            return [f"parallel.cp={cp} splits each sequence into 2 × cp = {2 * cp} chunks, but data.seq_len="
                    f"{seq_len} has fewer tokens; lower parallel.cp to at most {max(seq_len // 2, 1)}"]
        if seq_len % (2 * cp):
            return [f"parallel.cp={cp} splits each sequence into 2 × cp = {2 * cp} equal chunks (rank i holds "
                    f"chunks i and {2 * cp - 1}-i, to balance causal attention), but data.seq_len={seq_len} is "
                    f"not a multiple of {2 * cp}; use a seq_len that is"]
        return []

    def _rampup_errors(self) -> list[str]:
        try:
            start, inc, tokens = parse_rampup(self.batch_rampup)
        except ValueError as e:
            return [str(e)]
        e, unit, g = [], self.micro_batch * self.dp, self.global_batch
        if self.pp > 1:
            e.append("train.batch_rampup grows the batch by accumulation micro-batches, but a pipeline schedule runs "
                     "a fixed number of them (parallel.pp > 1); ramp the batch without pipelining")
        if start >= g:
            e.append(f"train.batch_rampup starts at {start} sequences, not below train.global_batch={g}; start lower, "
                     "or drop the ramp")
        elif start % unit or inc % unit:
            e.append(f"train.batch_rampup={self.batch_rampup!r}: the start ({start}) and the increment ({inc}) must be "
                     f"multiples of micro_batch × data-parallel size = {self.micro_batch} × {self.dp} = {unit} (the "
                     "batch grows by whole micro-batches on every rank)")
        elif (g - start) % inc:
            e.append(f"train.batch_rampup={self.batch_rampup!r}: global_batch - start = {g - start} "
                     f"is not a multiple of the increment {inc}; choose an increment that divides it")
        return e

    def batch_schedule(self, seq_len: int) -> BatchSchedule:
        """The global batch of every step (constant without train.batch_rampup)."""
        if not self.batch_rampup:
            return BatchSchedule(self.global_batch, seq_len, self.micro_batch * self.dp)
        start, inc, tokens = parse_rampup(self.batch_rampup)
        return BatchSchedule(self.global_batch, seq_len, self.micro_batch * self.dp, start, inc, tokens)

    def _schedule_errors(self, n_layers: int | None) -> list[str]:
        e, schedule, virtual, pp, m = [], self.pp_schedule, self.pp_virtual_stages, self.pp, self.grad_accum
        if not is_multi_chunk(schedule) and virtual != 1:
            e.append(f"parallel.pp_virtual_stages={virtual} needs an interleaved schedule "
                     f"(interleaved-1f1b or zero-bubble), not {schedule}")
        if schedule == "interleaved-1f1b" and virtual < 2:
            e.append("parallel.pp_schedule=interleaved-1f1b needs parallel.pp_virtual_stages >= 2")
        if schedule == "zero-bubble" and virtual != 2:
            e.append("parallel.pp_schedule=zero-bubble (V shape) needs parallel.pp_virtual_stages=2")
        if schedule != "gpipe" and m < pp:
            e.append(f"{schedule} needs at least parallel.pp={pp} micro-batches per step, got {m}; "
                     "raise train.grad_accum (or parallel.pp_microbatches), or use pp_schedule=gpipe, which "
                     "also runs one micro-batch (plain model parallelism, the other stages idle)")
        if schedule in ("interleaved-1f1b", "zero-bubble") and m % pp:
            e.append(f"{schedule} needs the micro-batches per step ({m}) to be a multiple of parallel.pp={pp}")
        if n_layers is None:
            return e
        chunks = self.num_stages
        if chunks > n_layers:
            e.append(f"{chunks} pipeline stages (pp {pp} × {chunks // pp} per rank) need at least {chunks} "
                     f"layers, but model.n_layers={n_layers}; lower parallel.pp or pp_virtual_stages")
        if self.pp_split:
            try:
                counts = [int(x) for x in self.pp_split.split(",")]
            except ValueError:
                counts = []
            if len(counts) != chunks or sum(counts) != n_layers or min(counts, default=0) < 1:
                example = ",".join(map(str, balanced_split_counts(n_layers, chunks)))
                e.append(f"parallel.pp_split={self.pp_split!r} must list {chunks} positive layer counts summing to "
                         f"model.n_layers={n_layers}, e.g. {example}")
        return e

    # ---- words and config ---------------------------------------------------------------------

    def describe_ranks(self) -> str:
        cp = f" × cp {self.cp}" if self.cp > 1 else ""
        ep = f" (ep {self.ep} of dp_shard{' × cp' if cp else ''} × tp)" if self.ep > 1 else ""
        return (f"{self.world} rank(s) = pp {self.pp} × dp_replicate {self.dp_replicate} × "
                f"dp_shard {self.dp_shard}{cp} × tp {self.tp}{ep}")

    def explain(self) -> str:
        """The layout in one line of words: ranks per axis, what runs on them, the batch."""
        parts = [self.describe_ranks()]
        if self.local_sync:
            workers = "the replica groups as workers" if self.fault_tolerance else f"{self.dp_replicate} workers"
            parts.append(f"{workers} ({self.describe_sync()})")
        if self.step_dp > 1:
            zero = {0: "DDP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3 (FSDP)"}[self.zero]
            within = " within each worker" if self.local_sync else ""
            hsdp = ", HSDP" if self.dp_replicate > 1 and self.zero and not self.local_sync else ""
            parts.append(f"data parallel {zero}{within}{hsdp}")
        if self.tp > 1:
            parts.append(f"tensor parallel{' + sequence parallel' if self.sp else ''}")
        if self.ep > 1:
            parts.append(f"expert parallel {self.ep} (experts ZeRO-{self.expert_zero}; {self.expert_dp} ranks hold "
                         "the same ones)"
                         if self.zero and self.expert_dp > 1 else f"expert parallel {self.ep}")
        if self.cp > 1:
            parts.append(f"context parallel {self.cp_method}")
        if self.pp > 1:
            virtual = f" × {self.pp_virtual_stages} virtual" if self.pp_virtual_stages > 1 else ""
            parts.append(f"pipeline {self.pp_schedule}{virtual}")
        if self.activation_checkpointing != "none":
            parts.append(f"activation checkpointing {self.activation_checkpointing}")
        parts.append(f"batch {self.global_batch} = micro {self.micro_batch} × accum {self.grad_accum} × dp {self.dp}")
        return "; ".join(parts)

    def describe(self) -> str:
        """Short, for tables: 'dp 4 zero3, tp 2+sp, pp 2 1f1b, mb 1x8, ac selective'."""
        parts = []
        if self.dp > 1:
            dp = f"dp {self.dp_replicate}x{self.dp_shard}" if self.dp_replicate > 1 else f"dp {self.dp}"
            parts.append(f"{dp} zero{self.zero}")
        if self.local_sync:
            parts.append(self.describe_sync(short=True))
        if self.tp > 1:
            parts.append(f"tp {self.tp}{'+sp' if self.sp else ''}")
        if self.ep > 1:
            parts.append(f"ep {self.ep}")
        if self.cp > 1:
            parts.append(f"cp {self.cp}" + (f" {self.cp_method}" if self.cp_method != "ring" else ""))
        if self.pp > 1:
            v = f" v{self.pp_virtual_stages}" if self.pp_virtual_stages > 1 else ""
            parts.append(f"pp {self.pp} {self.pp_schedule}{v}")
        parts.append(f"mb {self.micro_batch}x{self.grad_accum}")
        if self.activation_checkpointing != "none":
            parts.append(f"ac {self.activation_checkpointing}")
        if self.offload_optimizer:
            parts.append("offload")
        return ", ".join(parts)

    def describe_sync(self, short: bool = False) -> str:
        """'diloco every 50 steps, 4 fragments, delay 2, int8' (short: 'diloco H50 F4 d2 int8')."""
        if short:
            extra = (f" F{self.sync_fragments}" if self.sync_fragments > 1 else "") + \
                (f" d{self.sync_delay}" if self.sync_delay else "") + \
                (f" {self.sync_dtype}" if self.sync_dtype != "fp32" else "")
            return f"{self.dp_sync} H{self.sync_every}{extra}"
        words = [f"{self.dp_sync} every {self.sync_every} steps"]
        if self.sync_fragments > 1:
            words.append(f"{self.sync_fragments} fragments")
        if self.sync_delay:
            words.append(f"delay {self.sync_delay}")
        words.append(self.sync_dtype)
        return ", ".join(words)

    def config_overrides(self) -> dict[str, Any]:
        """The same layout as `--section.key=value` options of `scaletrain train`."""
        out = {"parallel.dp_replicate": self.dp_replicate, "parallel.dp_shard": self.dp_shard,
               "parallel.tp": self.tp, "parallel.pp": self.pp, "parallel.zero": self.zero, "parallel.sp": self.sp,
               "train.micro_batch": self.micro_batch, "train.grad_accum": self.grad_accum,
               "train.global_batch": self.global_batch,
               "memory.activation_checkpointing": self.activation_checkpointing,
               "memory.offload_optimizer": self.offload_optimizer, "parallel.sync.mode": self.dp_sync,
               "parallel.sync.every": self.sync_every, "parallel.sync.fragments": self.sync_fragments,
               "parallel.sync.delay": self.sync_delay, "parallel.sync.dtype": self.sync_dtype}
        if self.cp > 1:
            out.update({"parallel.cp": self.cp, "parallel.cp_method": self.cp_method})
        if self.ep > 1:
            out["parallel.ep"] = self.ep
        if self.pp > 1:
            out.update({"parallel.pp_schedule": self.pp_schedule, "parallel.pp_virtual_stages": self.pp_virtual_stages})
            if self.pp_split:
                out["parallel.pp_split"] = self.pp_split
        if self.batch_rampup:
            out["train.batch_rampup"] = self.batch_rampup
        return out

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    # ---- the device mesh ----------------------------------------------------------------------

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp)

    def build_mesh(self, device_type: str):
        """The 5-D device mesh (every axis present, size 1 or more) and the flattened `dp` mesh."""
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device_type, self.mesh_shape, mesh_dim_names=MESH_AXES)
        return mesh, mesh["dp_replicate", "dp_shard"]._flatten("dp")

    def build_expert_mesh(self, device_type: str):
        """Expert parallelism's mesh over the same ranks: dp_shard × cp × tp (flattened in mesh
        order) cut into (dp_shard × cp × tp / ep, ep), ep innermost (neighbouring ranks exchange
        tokens), named EXPERT_MESH_AXES: its `dp_shard` axis is the ranks that hold the same
        experts within a replica group."""
        from torch.distributed.device_mesh import init_device_mesh

        shape = (self.pp, self.dp_replicate, self.expert_shard_ranks, self.ep)
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=EXPERT_MESH_AXES)
        mesh["dp_replicate", "dp_shard"]._flatten("expert_dp")  # the ranks holding the same experts
        return mesh


def resolve_batch(global_batch: int, micro_batch: int, grad_accum: int, dp: int,
                  pp_microbatches: int = 0) -> tuple[int, int]:
    """(micro_batch, grad_accum) from the batch triad's given members (0 = derive it).

    Under pipelining the accumulated micro-batches are the pipeline's micro-batches, so
    `parallel.pp_microbatches`, when given, is the accumulation count."""
    g, m, a = global_batch, micro_batch, grad_accum
    if pp_microbatches:
        if a and a != pp_microbatches:
            raise ConfigError(f"train.grad_accum={a} and parallel.pp_microbatches={pp_microbatches} name the same "
                              "count under pipelining (micro-batches per step); give one of them")
        a = pp_microbatches
    if not g and not m:
        m = DEFAULT_MICRO_BATCH
    if m and a:
        if g and g != m * a * dp:
            raise ConfigError(
                f"train.global_batch={g} but micro_batch × grad_accum × data-parallel size = "
                f"{m} × {a} × {dp} = {m * a * dp}; change one of them or set one to 0 to derive it")
    elif g and m:
        if g % (m * dp):
            raise ConfigError(
                f"train.global_batch={g} is not divisible by micro_batch × data-parallel size = "
                f"{m} × {dp}; choose a global batch that is a multiple of {m * dp}")
        a = g // (m * dp)
    elif g:
        a = a or 1
        if g % (a * dp):
            raise ConfigError(
                f"train.global_batch={g} is not divisible by grad_accum × data-parallel size = "
                f"{a} × {dp}; choose a global batch that is a multiple of {a * dp}")
        m = g // (a * dp)
    else:
        a = a or 1
    return m, a


DEFAULT_MICRO_BATCH = 32


def tp_errors(model, tp: int) -> list[str]:
    """Why `model` cannot be split over `tp` tensor-parallel ranks ([] if it can)."""
    e = []
    if model.n_heads % tp:
        e.append(f"parallel.tp={tp} must divide model.n_heads={model.n_heads}: each rank owns whole heads; "
                 f"use tp in {[d for d in range(1, model.n_heads + 1) if model.n_heads % d == 0]}")
    elif model.kv_heads % tp and tp % model.kv_heads:
        # (kv_heads divides n_heads: when tp misses n_heads it misses kv_heads too). Fewer K/V heads
        # than tp: each is replicated on the tp / kv_heads ranks whose query heads read it
        kv = model.kv_heads
        fit = [d for d in range(1, model.n_heads + 1) if model.n_heads % d == 0 and (kv % d == 0 or d % kv == 0)]
        e.append(f"parallel.tp={tp} must divide the key/value heads ({kv}), or be a multiple of them (each K/V "
                 f"head then replicated on tp / {kv} ranks): use tp in {fit}")
    if model.qk_norm and model.qk_norm_scope == "projection" and model.kv_heads < tp:
        e.append(f"parallel.tp={tp} is more than the {model.kv_heads} key/value heads, which then sit whole on every "
                 "rank, but model.qk_norm_scope=projection normalises the key projection across the tp ranks; use "
                 f"tp at most {model.kv_heads}")
    if model.vocab_size % tp:
        e.append(f"parallel.tp={tp} must divide model.vocab_size={model.vocab_size} (the vocabulary is split); "
                 "pad the vocabulary to a multiple of tp")
    return e


def balanced_split_counts(n_layers: int, chunks: int, head_cost: float = 0.0) -> list[int]:
    """Layers per chunk that minimise the largest chunk's cost, where a block costs 1 and the
    last chunk also pays for the output head (`head_cost`, in blocks). The embedding lookup of
    the first chunk costs next to nothing."""
    if chunks == 1:
        return [n_layers]
    best = None
    for last in range(n_layers - chunks + 1, 0, -1):  # ties: the most layers on the last chunk
        base, extra = divmod(n_layers - last, chunks - 1)
        cost = max(base + (1 if extra else 0), last + head_cost)
        if best is None or cost < best[0] - 1e-9:
            best = (cost, [base + (1 if i < extra else 0) for i in range(chunks - 1)] + [last])
    return best[1]
