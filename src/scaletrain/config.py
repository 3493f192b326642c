"""The config tree: one typed dataclass per section, loaded from TOML and `--section.key=value`.

Every option has one name, the same in TOML (`[train] steps = 100`), on the command line
(`--train.steps=100`) and in Python (`cfg.train.steps`); a table inside a section likewise
(`[parallel.sync] every = 10`, `--parallel.sync.every=10`, `cfg.parallel.sync.every`). Loading checks
every key and value and reports all problems at once, one line each, as a `ConfigError`. Options
that moved keep their old names as ALIASES, read with a note each.

Precedence, lowest first: built-in defaults < `model.preset` < TOML file < command line.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tomllib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scaletrain.errors import ConfigError, DataError
from scaletrain.model.config import ModelConfig, check_model
from scaletrain.model.presets import fill_shape
from scaletrain.options import build_section, option, option_table, table_class
from scaletrain.quant.layers import FP8_MIN_DIM
from scaletrain.vocab import (
    AC_MODES,
    ADAPTER_GROUPS,
    ADAPTER_KINDS,
    ADVANTAGE_SCALINGS,
    BASE_DTYPES,
    CP_METHODS,
    DP_SYNC_MODES,
    FP8_RECIPES,
    IS_CORRECTIONS,
    KL_ESTIMATORS,
    MUON_LR_ADJUST,
    MUON_NS_DTYPES,
    OBJECTIVES,
    OPTIMIZERS,
    OUTER_OPTIMIZERS,
    PP_SCHEDULES,
    PRECISIONS,
    PREFERENCE_LOSSES,
    QAT_SCHEMES,
    REFERENCE_FREE,
    REFERENCE_MODES,
    RL_AGGREGATIONS,
    RL_ALGORITHMS,
    RL_REFERENCE_MODES,
    SYNC_DTYPES,
    did_you_mean,
)

# --------------------------------------------------------------------------------------------
# Declaring options


@dataclass
class DataConfig:
    path: str = option("", "folder written by `scaletrain prepare`; empty = the text shipped with CPython, byte-level")
    mix: str = option("", "several prepared folders drawn in proportion instead of data.path: \"PATH=WEIGHT,...\", "
                          "e.g. \"data/web=70,data/code=20,data/books=10\" (weights are normalised; every folder "
                          "must share one tokenizer)")
    seq_len: int = option(128, "tokens per training window; at most model.max_seq_len", min=1)
    num_workers: int = option(0, "loader worker processes (0 = load in the training process)", min=0)
    prefetch_factor: int = option(2, "batches each worker prepares ahead (with num_workers > 0)", min=1)
    pin_memory: bool = option(True, "page-lock batches for faster host-to-GPU copies (CUDA runs only)")
    verify_checksums: bool = option(True, "check every shard's sha256 against the metadata when opening")
    loss_mask: str = option("auto", "the loss mask of chat data (prepare --chat-format): auto = use it where the "
                                    "folder has one, true = require one, false = count every token",
                            choices=("auto", "true", "false"))
    document_mask: bool = option(False, "documents packed in a window attend within themselves, their positions "
                                        "restart, the target after each separator is not counted; needs documents "
                                        "ended by one token (EOS, <|endoftext|>), not byte-level data")


@dataclass
class TrainConfig:
    steps: int = option(250, "optimizer steps to train", min=1)
    global_batch: int = option(0, "sequences per optimizer step over all ranks; 0 = derive", min=0)
    micro_batch: int = option(0, "sequences per forward pass on one rank; 0 = derive (32 if nothing is given)", min=0)
    grad_accum: int = option(0, "micro-batches accumulated per step; 0 = derive", min=0)
    batch_rampup: str = option("", "batch-size warm-up: \"START,INCREMENT,TOKENS\" grows the global batch from START "
                                   "sequences by INCREMENT each time another 1/n of TOKENS tokens is seen, up to "
                                   "global_batch (by more accumulation micro-batches; the lr schedule follows the "
                                   "tokens); empty = the full batch from the first step")
    seed: int = option(1234, "seeds weights (by parameter name) and data order (by step)", min=0, max=2**63 - 1)
    device: str = option("auto", "where to train: auto = cuda if available, else cpu", choices=("auto", "cpu", "cuda"))
    compile: bool = option(False, "torch.compile each transformer block")
    grad_clip: float = option(1.0, "clip gradients to this global L2 norm; 0 = off", min=0.0)
    max_skipped_steps: int = option(5, "steps in a row with non-finite gradients (or fp16 overflow at the "
                                       "minimum loss scale) after which the run stops", min=1)
    divergence_factor: float = option(4.0, "stop (exit 3) when the loss exceeds this multiple of its early value; "
                                      "0 = never stop on the loss", min=0.0)
    divergence_margin: float = option(1.0, "after warm-up, stop (exit 3) when the loss exceeds ln(vocab_size) + this "
                                      "(worse than guessing uniformly)", min=0.0)
    sample_tokens: int = option(200, "after training, generate this many tokens and print them", min=0)
    sample_prompt: str = option("The ", "prompt for the sample printed after training")
    eval_every: int = option(0, "every this many steps and at the end, log val_loss and val_ppl on the validation "
                                "split (prepare --val-fraction; built-in data: Python's docstrings); 0 = never", min=0)
    eval_batches: int = option(8, "validation batches of train.global_batch sequences per evaluation, the same "
                                  "windows each time; 0 = every whole batch the split holds", min=0)
    qat: str = option("none", "quantization-aware training: fake-quantize the blocks' linear layers as the "
                              "scheme will (int8 activations per token; int8 weights per channel, or int4 in "
                              "groups of 32), so `scaletrain quantize --scheme` of the checkpoint loses less",
                      choices=QAT_SCHEMES)
    objective: str = option("lm", "what the run trains: lm = next-token cross-entropy (every token, or a loss mask's); "
                                  "preference = the [preference] loss on the pairs (or KTO's unpaired examples) of a "
                                  "folder written by `scaletrain prepare --preference`; rl = reinforcement learning on "
                                  "the rewards of sampled completions ([rl])", choices=OBJECTIVES)


@dataclass
class MuonConfig:
    """Muon (optim.name=muon): orthogonalised momentum for the hidden matrices, AdamW for the rest."""

    lr: float = option(0.0, "Muon's peak learning rate; 0 = optim.lr (right with adjust_lr=match_rms_adamw, "
                            "which scales each matrix's step to AdamW's RMS)", min=0.0)
    momentum: float = option(0.95, "momentum of the gradient before it is orthogonalised", min=0.0, max=1.0,
                             open_max=True)
    nesterov: bool = option(True, "orthogonalise g + momentum * buffer (Nesterov) rather than the buffer")
    ns_steps: int = option(5, "Newton-Schulz iterations", min=1, max=99)
    ns_coefficients: str = option("3.4445,-4.7750,2.0315", "a,b,c of the quintic Newton-Schulz step "
                                                          "X <- aX + b(XX')X + c(XX')^2 X (Keller Jordan's)")
    ns_dtype: str = option("bf16", "dtype Newton-Schulz computes in (and its gathers send): bf16 as "
                                   "torch.optim.Muon, or fp32 (exact against one process across layouts)",
                           choices=MUON_NS_DTYPES)
    eps: float = option(1e-7, "floor of the norm each matrix is divided by before Newton-Schulz", min=0.0)
    adjust_lr: str = option("match_rms_adamw", "learning rate per matrix shape A x B: match_rms_adamw "
                                               "(lr * 0.2 * sqrt(max(A, B)), Moonlight), original "
                                               "(lr * sqrt(max(1, A / B)), Keller Jordan) or none",
                            choices=MUON_LR_ADJUST)
    params: str = option("auto", "which parameters Muon steps: auto (every matrix of 2 or more dimensions but "
                                 "the embeddings and the output head; an expert tensor as one matrix per "
                                 "expert), or comma-separated fnmatch patterns on parameter names")
    exclude: str = option("", "comma-separated fnmatch patterns of parameters left to AdamW although "
                              "optim.muon.params takes them (\"*.router.*\")")


def ns_coefficients(m: MuonConfig) -> tuple[float, float, float]:
    """optim.muon.ns_coefficients as three floats (a ValueError naming the key otherwise)."""
    parts = [x.strip() for x in m.ns_coefficients.split(",")]
    try:
        values = tuple(float(x) for x in parts)
    except ValueError:
        values = ()
    if len(values) != 3:
        raise ValueError(f"optim.muon.ns_coefficients={m.ns_coefficients!r}: give three numbers a,b,c, as "
                         "\"3.4445,-4.7750,2.0315\" (Keller Jordan's)")
    return values


@dataclass
class OptimConfig:
    name: str = option("adamw", "optimizer (muon: Muon for the hidden matrices, AdamW for the rest; see optim.muon)",
                       choices=OPTIMIZERS)
    lr: float = option(3e-3, "peak learning rate (at optim.reference_batch if scale_lr_with_batch)", min=0.0)
    weight_decay: float = option(0.1, "decoupled weight decay on matrices (not on norms, biases)", min=0.0)
    beta1: float = option(0.9, "first-moment decay (adamw, adamw8bit; adafactor ignores it)", min=0.0, max=1.0,
                          open_max=True)
    beta2: float = option(0.95, "second-moment decay (adamw, adamw8bit)", min=0.0, max=1.0, open_max=True)
    eps: float = option(1e-8, "denominator epsilon (adamw, adamw8bit)", min=0.0)
    momentum: float = option(0.9, "momentum (sgd)", min=0.0, max=1.0, open_max=True)
    implementation: str = option("auto", "kernel for adamw/sgd: auto = fused where the device has it, else foreach",
                                 choices=("auto", "fused", "foreach", "loop"))
    schedule: str = option("cosine", "decay after warm-up", choices=("cosine", "linear", "constant"))
    warmup_steps: int = option(25, "linear warm-up from 0 to the peak learning rate", min=0)
    min_lr_ratio: float = option(0.1, "final learning rate as a fraction of the peak (cosine, linear)",
                                 min=0.0, max=1.0)
    scale_lr_with_batch: bool = option(False, "linear scaling rule: lr *= global_batch / reference_batch")
    reference_batch: int = option(256, "global batch (sequences) at which optim.lr was tuned", min=1)
    muon: MuonConfig = option_table(MuonConfig, "Muon's options (optim.name=muon); AdamW, with optim.beta1, "
                                                "beta2, eps and weight_decay, steps what Muon does not")


@dataclass
class AdapterConfig:
    kind: str = option("none", "fine-tune low-rank adapters on a frozen base instead of every weight: none, lora, or "
                               "dora (LoRA with each output row's magnitude trained apart from its direction)",
                       choices=ADAPTER_KINDS)
    rank: int = option(8, "the adapters' rank r: each adapted linear (out x in) gains r x (in + out) parameters")
    alpha: float = option(16.0, "the adapters' update is scaled by alpha / rank (alpha / sqrt(rank) with rslora)",
                          min=0.0)
    dropout: float = option(0.0, "dropout on the adapters' input (the base's path sees none)", min=0.0, max=1.0,
                            open_max=True)
    targets: str = option("all-linear", "which linears gain adapters, comma-separated: module names or fnmatch "
                                        "patterns on them (\"layers.*.attn.wq\", \"*.wv\"), or a group: all-linear "
                                        "(every block linear, not the output head), attention, mlp")
    rslora: bool = option(False, "rank-stabilised scale alpha / sqrt(rank) (Kalajdzievski 2023) instead of "
                                 "alpha / rank")
    base_dtype: str = option("auto", "QLoRA: how the adapted linears' frozen base weights are stored, dequantized "
                                     "for each matmul: auto (as the precision mode keeps weights), nf4 (4-bit "
                                     "NormalFloat in blocks of 64, torchao), int8 (a scale per row) or bf16; only "
                                     "the adapted linears' bases: embeddings, norms and the output head stay as "
                                     "they are", choices=BASE_DTYPES)


@dataclass
class PrecisionConfig:
    mode: str = option("32-true", "numerics, with Lightning's names", choices=PRECISIONS)
    init_scale: float = option(2.0**16, "16-mixed: first loss scale", min=1.0)
    growth_factor: float = option(2.0, "16-mixed: scale multiplier after growth_interval clean steps", min=1.0)
    backoff_factor: float = option(0.5, "16-mixed: scale multiplier after an overflow", min=0.0, max=1.0, open_max=True)
    growth_interval: int = option(2000, "16-mixed: clean steps before the scale grows", min=1)
    min_scale: float = option(1.0, "16-mixed: the scale never drops below this", min=0.0)
    fp8_recipe: str = option("tensorwise", "fp8: one scale per tensor (tensorwise: the fastest, and ZeRO-3 "
                                           "all-gathers the weights in fp8) or per row (rowwise: an outlier costs "
                                           "its row's precision, not the tensor's; slower)", choices=FP8_RECIPES)
    fp8_emulate: bool = option(False, "fp8: emulate the float8 matmuls (torchao's emulate: fp8's numerics, none of "
                                      "its speed); needed on a CPU or a GPU without fp8 (before sm89)")
    fp8_min_dim: int = option(FP8_MIN_DIM, "fp8: a block linear converts when its inputs and outputs are both at "
                                           "least this many (and multiples of 16); smaller ones stay bf16, where "
                                           "fp8's scaling and casts cost more than its matmul saves", min=16)


@dataclass
class MemoryConfig:
    activation_checkpointing: str = option(
        "none", "recompute activations in backward: none, full (whole blocks) or selective "
        "(keep matmul and attention outputs, recompute element-wise ops)",
        choices=AC_MODES)
    offload_optimizer: bool = option(False, "keep parameters, gradients and optimizer state in pinned host memory "
                                            "and step there (FSDP2 CPU offload); needs parallel.zero=3 on CUDA")


@dataclass
class SyncConfig:
    """[parallel.sync]: how the data-parallel workers (the dp_replicate groups) synchronise."""
    mode: str = option("step", "how the data-parallel workers (the dp_replicate groups) synchronise: step = "
                               "gradients every step (DDP, ZeRO); local_sgd = weights averaged every sync.every "
                               "steps; diloco = an outer optimizer step on the averaged pseudo-gradient every "
                               "sync.every steps (inside a worker, gradients sync every step)",
                       choices=DP_SYNC_MODES)
    every: int = option(50, "local_sgd, diloco: inner steps between two syncs of the workers (H)", min=1)
    fragments: int = option(1, "local_sgd, diloco: the blocks split into this many fragments, synced one at a "
                               "time at staggered steps (streaming: the peak volume of a sync is the model's / F)",
                            min=1)
    delay: int = option(0, "local_sgd, diloco: inner steps a fragment's all-reduce runs in the background before "
                           "it is applied (tau; below sync.every / sync.fragments)", min=0)
    dtype: str = option("fp32", "local_sgd, diloco: pseudo-gradients on the wire: fp32, bf16, or int8 with a "
                                "scale per chunk; the outer step accumulates in fp32", choices=SYNC_DTYPES)
    outer_optimizer: str = option("nesterov", "diloco: the outer optimizer, SGD with nesterov or heavy-ball (sgd) "
                                              "momentum", choices=OUTER_OPTIMIZERS)
    outer_lr: float = option(0.7, "diloco: the outer learning rate (local_sgd is an outer lr of 1)", min=0.0)
    outer_momentum: float = option(0.9, "diloco: the outer momentum; 0 = none (local_sgd has none)", min=0.0, max=1.0,
                                   open_max=True)
    inner_lr_scale: float = option(1.0, "local_sgd, diloco: the workers' inner lr is the schedule's (for the global "
                                        "batch) times this; 0 = sqrt(1 / dp_replicate), the square-root rule", min=0.0)
    outer_on_cpu: bool = option(False, "local_sgd, diloco: keep the outer weights and momentum in host memory "
                                       "(4-8 bytes per parameter off the device)")


@dataclass
class ParallelConfig:
    layout: str = option("manual", "auto: the planner chooses the layout below (and the micro-batch and "
                                   "checkpointing) for the devices at hand", choices=("manual", "auto"))
    auto_measure_s: float = option(0.0, "layout=auto: calibrate this machine (cached) and time real steps of the best "
                                        "predicted layouts for up to about this many seconds, then train the fastest "
                                        "measured; 0 = predict only. scaletrain's launcher only (not torchrun)",
                                   min=0.0)
    dp_replicate: int = option(1, "data-parallel replica groups (the outer axis of HSDP)", min=1)
    dp_shard: int = option(-1, "data-parallel ranks that shard model states (zero >= 1); -1 = all remaining ranks",
                           min=-1)
    tp: int = option(1, "tensor-parallel ranks: attention split by heads, MLP and vocabulary split", min=1)
    sp: bool = option(False, "sequence parallel: norms and residuals on sequence shards between the tp regions")
    pp: int = option(1, "pipeline-parallel ranks (stages of layers)", min=1)
    cp: int = option(1, "context-parallel ranks: each holds 1/cp of every sequence (long sequences)", min=1)
    ep: int = option(1, "expert-parallel ranks: each holds 1/ep of every mixture-of-experts layer's experts, tokens "
                        "sent to them by all-to-all; borrowed from the dp_shard ranks (ep must divide them)", min=1)
    cp_method: str = option("ring", "context parallel attention: ring (K/V blocks passed around the cp ranks), "
                                    "allgather (K/V gathered once per layer) or ulysses (sequence shards swapped "
                                    "for head shards)", choices=CP_METHODS)
    pp_schedule: str = option("1f1b", "pipeline schedule", choices=PP_SCHEDULES)
    pp_microbatches: int = option(0, "micro-batches per step in the pipeline; 0 = train.grad_accum (they are "
                                     "the same count under pipelining)", min=0)
    pp_virtual_stages: int = option(1, "stages per pp rank (interleaved-1f1b: 2 or more; zero-bubble: 2)", min=1)
    pp_split: str = option("", "layers per stage by hand, e.g. \"3,4,4,3\"; empty = balanced by compute")
    zero: int = option(0, "ZeRO stage: 0 = DDP, 1 = shard optimizer state, 2 = + gradients, "
                          "3 = + parameters (FSDP)", min=0, max=3)
    bucket_mb: float = option(25.0, "gradient bucket size for the overlapped reductions (zero 0-2)", min=0.001)
    timeout_s: int = option(600, "a collective that waits longer than this fails the job", min=1, max=7 * 24 * 3600)
    sync: SyncConfig = option_table(SyncConfig, "local SGD and DiLoCo: how and how often the data-parallel "
                                                "workers (the dp_replicate groups) synchronise")


@dataclass
class FaultToleranceConfig:
    """[fault_tolerance]: this run as one replica group of a fault-tolerant job (torchft)."""
    enabled: bool = option(False, "this run is one replica group of a fault-tolerant job (torchft): the "
                                  "groups average their gradients every step over the groups alive, a "
                                  "group that dies costs the others that step's commit and heals from a "
                                  "live peer when it comes back (pip install 'scaletrain[ft]')")
    groups: int = option(2, "the replica groups of the job (each one `scaletrain train` with its own ranks and "
                            "fault_tolerance.replica_id)", min=1)
    replica_id: int = option(0, "this group's id, 0 to fault_tolerance.groups - 1 (the lowest id alive writes "
                                "the checkpoints)", min=0)
    lighthouse: str = option("", "the Lighthouse's address, http://HOST:PORT, as `scaletrain lighthouse` prints it")
    min_replicas: int = option(1, "the groups a step needs to commit; with fewer alive the others wait (up to "
                                  "fault_tolerance.quorum_timeout_s)", min=1)
    quorum_timeout_s: float = option(60.0, "seconds a group waits to reach the Lighthouse (at start) and for a "
                                           "quorum of groups (every step) before it fails", min=0.1)
    step_timeout_s: float = option(60.0, "seconds the groups' all-reduce and a healing transfer may take before "
                                         "that step is given up (the commit vote waits twice this, plus 10 s: a "
                                         "group's ranks may reach it that far apart)", min=0.1)


@dataclass
class CheckpointConfig:
    dir: str = option("", "where checkpoints go; empty = <log.run_dir>/checkpoints")
    every: int = option(0, "save every N steps; 0 = only at the end and on SIGINT/SIGTERM", min=0)
    keep: int = option(3, "keep the newest K complete checkpoints", min=1)
    resume: str = option("none", "none, auto (the newest complete checkpoint, if any) or a checkpoint folder")
    save_final: bool = option(True, "save a checkpoint when training ends")
    async_save: bool = option(False, "write the periodic checkpoints in the background: training waits only while "
                                     "the state is copied to CPU memory (one copy of it kept for the run)")
    allow_data_change: bool = option(False, "resume on data other than the checkpoint was trained on (its "
                                     "fingerprint differs); without it such a resume is refused")


@dataclass
class LogConfig:
    run_dir: str = option("", "folder for metrics, TensorBoard and checkpoints; empty = runs/<date-time>")
    every: int = option(10, "log metrics every N steps (and on the first and last step)", min=1)
    tensorboard: bool = option(True, "write TensorBoard event files to <run_dir>/tensorboard")
    progress: str = option("auto", "progress bar: auto = when stderr is a terminal", choices=("auto", "on", "off"))
    summary: bool = option(True, "print the run's summary table at its end (verify's runs leave it out)")
    spike_factor: float = option(3.0, "log a loss above this multiple of its running mean; 0 = off", min=0.0)
    wandb: str = option("", "Weights & Biases project to log to as well (pip install 'scaletrain[wandb]'); empty = "
                            "off; WANDB_MODE=offline writes the run under <run_dir>/wandb")
    mlflow: str = option("", "MLflow experiment to log to as well (pip install 'scaletrain[mlflow]'); empty = off")
    mlflow_uri: str = option("", "MLflow tracking URI (http://SERVER, or sqlite:///FILE); empty = "
                                 "MLFLOW_TRACKING_URI, else <run_dir>/mlflow.db")
    run_name: str = option("", "the run's name in W&B and MLflow; empty = the run folder's name")
    tags: str = option("", "comma-separated tags of the run in W&B and MLflow, e.g. \"ddp,baseline\"; in MLflow "
                           "KEY=VALUE is the tag KEY with VALUE, a bare tag has the value true")
    tracker_wait_s: float = option(30.0, "seconds to wait for W&B or MLflow to start (an unreachable server's "
                                         "retries take minutes) before the run goes on without it", min=1.0)


@dataclass
class EvalConfig:
    """[eval]: downstream tasks through lm-evaluation-harness during training (pip install 'scaletrain[eval]');
    `scaletrain eval CKPT --tasks` scores a checkpoint on the same tasks."""

    tasks: str = option("", "lm-eval task names, comma-separated, scored every eval.every steps and at the end: "
                            "lm-eval's own, eval.include's, or those shipped with scaletrain (scaletrain_choice, "
                            "scaletrain_complete); empty = none")
    every: int = option(0, "score eval.tasks every this many steps (and at the last); 0 = never during training",
                        min=0)
    limit: int = option(0, "examples of each task scored (the first ones); 0 = every example", min=0)
    include: str = option("", "a folder of lm-eval task YAML files whose tasks eval.tasks may name as well")
    download: bool = option(False, "let lm-eval download a task's data set from the Hugging Face Hub; without it a "
                                   "task whose data is neither local nor cached is refused")
    batch_size: int = option(8, "requests per forward (one sequence each) during task evaluation", min=1)


@dataclass
class PreferenceConfig:
    """[preference]: which preference loss (train.objective=preference), its coefficients (TRL 1.16's
    defaults) and where the reference model's log-probabilities come from."""

    loss: str = option("sigmoid", "the preference loss: sigmoid = DPO (cDPO with label_smoothing), robust = robust "
                                  "DPO, ipo, hinge, simpo and orpo (no reference model), kto (unpaired examples)",
                       choices=PREFERENCE_LOSSES)
    beta: float = option(0.1, "how far the policy may stray from the reference (β; IPO's τ; ORPO's weight λ of the "
                              "odds-ratio term); above 0", min=0.0)
    label_smoothing: float = option(0.0, "sigmoid, robust, simpo: the chance a preference label is flipped, "
                                         "below 0.5", min=0.0, max=0.5, open_max=True)
    gamma: float = option(0.5, "simpo: the target reward margin γ", min=0.0)
    desirable_weight: float = option(1.0, "kto: weight of the desirable examples' losses", min=0.0)
    undesirable_weight: float = option(1.0, "kto: weight of the undesirable examples' losses", min=0.0)
    reference: str = option("auto", "where the reference log-probs come from: model = a frozen copy of the starting "
                                    "weights, sharded like the policy (forward only: its weights' memory, no "
                                    "gradients or optimizer state); precomputed = one forward pass over the data "
                                    "before training, kept in the run folder (no second model); adapters = the "
                                    "policy with its adapters switched off (adapter fine-tuning; no second copy); "
                                    "auto = adapters under adapter fine-tuning, else model", choices=REFERENCE_MODES)
    reference_from: str = option("", "preference.reference=model: the reference's weights from this Hugging Face "
                                     "folder or safetensors file (the policy's shapes and tokenizer) instead of the "
                                     "weights training starts from (e.g. the SFT model, when the policy starts "
                                     "elsewhere); empty = the starting weights")

    @property
    def needs_reference(self) -> bool:
        return self.loss not in REFERENCE_FREE


def preference_reference(cfg) -> str:
    """Where a run's reference log-probs come from: model, adapters or precomputed; "none" for a reference-free
    loss (simpo, orpo) or a run that is not train.objective=preference. auto = adapters under adapter fine-tuning,
    else model."""
    p = cfg.preference
    if cfg.train.objective != "preference" or not p.needs_reference:
        return "none"
    if p.reference == "auto":
        return "adapters" if cfg.adapter.kind != "none" else "model"
    return p.reference


def check_preference(p: PreferenceConfig) -> list[str]:
    errors = []
    if p.beta <= 0:
        errors.append(f"preference.beta={p.beta:g} must be above 0: it divides the margin (1/β, 1/(2β)); 0.1 is usual")
    if p.label_smoothing and p.loss not in ("sigmoid", "robust", "simpo"):
        errors.append(f"preference.label_smoothing={p.label_smoothing:g} is read by the sigmoid, robust and simpo "
                      f"losses, not by preference.loss={p.loss}; drop it")
    if p.loss == "kto" and p.desirable_weight == 0 and p.undesirable_weight == 0:
        errors.append("preference.desirable_weight and undesirable_weight are both 0: KTO would learn nothing")
    return errors


def preference_config(values: Mapping[str, Any]) -> PreferenceConfig:
    """A validated PreferenceConfig from a mapping of its keys: every problem at once, a line each."""
    errors: list[str] = []
    p = build_section("preference", PreferenceConfig, values, set(), errors)
    errors += [] if errors else check_preference(p)
    if errors:
        raise ConfigError(*errors)
    return p

@dataclass
class RLConfig:
    """[rl]: reinforcement learning with verifiable rewards (train.objective=rl): GRPO, Dr. GRPO and DAPO on
    completions the run samples from its own policy (scaletrain.rollout), scored by Python reward functions.
    rl.algorithm sets the knobs left at auto (docs/guides/rl.md has the table)."""

    algorithm: str = option("grpo", "grpo = group-normalised advantages, each sequence's token mean; dr_grpo = no std "
                                    "division, a constant normaliser; dapo = clip-higher (eps_high 0.28), dynamic "
                                    "sampling, the token mean over the batch", choices=RL_ALGORITHMS)
    prompts: str = option("", "the training prompts: a jsonl or parquet file, a row a prompt (`prompt`, text) with "
                              "the fields its rewards read (e.g. `answer`)")
    eval_prompts: str = option("", "held-out prompts (as rl.prompts), scored every train.eval_every steps: one greedy "
                                   "completion each, the rewards' mean (val_reward) and pass rate")
    eval_temperature: float = option(0.0, "rl.eval_prompts are answered greedily (0), or sampled at this temperature "
                                          "(the same draws at every evaluation)", min=0.0)
    rewards: str = option("answer_match", "the reward functions, comma-separated: `module:function` or a built-in "
                                          "(answer_match, format_match, overlong_penalty), each `*WEIGHT` optionally "
                                          "(default 1)")
    reward_args: str = option("", "the rewards' keyword arguments as JSON, by function name: "
                                  "{\"answer_match\": {\"extractor\": \"last_number\"}}")
    group_size: int = option(4, "completions sampled per prompt (G); a step's rows are train.global_batch "
                                "completions, global_batch / G prompts", min=1)
    max_new_tokens: int = option(32, "the longest completion, in tokens; prompt + completion fits data.seq_len", min=1)
    temperature: float = option(1.0, "sampling temperature (the log-probs are of the logits divided by it, in "
                                     "rollout and training alike)", min=0.0)
    top_p: float = option(1.0, "nucleus sampling: draw from the smallest set of tokens whose probability reaches "
                               "this; 1 = off", min=0.0, max=1.0)
    top_k: int = option(0, "draw from the k likeliest tokens; 0 = off", min=0)
    stop: str = option("", "text that ends a completion besides the tokenizer's end of text, backslash escapes "
                           "read (\\n: a newline); empty = none")
    updates: int = option(1, "optimizer steps on each batch of rollouts (μ); above 1 the policy moves from the one "
                             "that sampled and the clip acts", min=1)
    beta: float = option(0.0, "weight of the KL to the reference model, per token (0 = no reference model)", min=0.0)
    kl_estimator: str = option("k3", "the per-token KL estimate: k1 = log ratio, k3 = Schulman's non-negative "
                                     "estimator", choices=KL_ESTIMATORS)
    eps_low: float = option(0.2, "the clip below: the ratio to the sampling policy held above 1 - eps_low", min=0.0)
    eps_high: float = option(0.0, "the clip above (1 + eps_high); 0 = the algorithm's (dapo: 0.28, else eps_low)",
                             min=0.0)
    aggregation: str = option("auto", "how the token losses become one: token = their mean over the global "
                                      "batch, sequence = each sequence's mean then the mean, constant = sum / "
                                      "(sequences x rl.max_new_tokens); auto = the algorithm's",
                              choices=("auto", *RL_AGGREGATIONS))
    advantage_scaling: str = option("auto", "group = (r - group mean) / group std; none = r - group mean; auto = "
                                            "the algorithm's", choices=("auto", *ADVANTAGE_SCALINGS))
    dynamic_sampling: str = option("auto", "drop groups whose rewards are all equal and sample again to fill "
                                           "the batch (DAPO); auto = on for dapo", choices=("auto", "on", "off"))
    sampling_rounds: int = option(4, "dynamic sampling: rollout rounds at most per step to fill it with groups "
                                     "that teach; what stays unfilled trains on the groups found", min=1)
    mask_truncated: bool = option(False, "completions cut by rl.max_new_tokens get no loss (DAPO's overlong "
                                         "filtering)")
    is_correction: str = option("none", "truncated importance sampling when the rollout's log-probs differ from "
                                        "the trainer's (bf16, another engine): per token or per sequence",
                                choices=IS_CORRECTIONS)
    is_cap: float = option(2.0, "the importance weights' cap (rl.is_correction)", min=1.0)
    reference: str = option("auto", "the reference model of the KL (rl.beta > 0): model = a frozen copy of the "
                                    "starting weights, sharded like the policy; adapters = the policy with its "
                                    "adapters off; auto = adapters under adapter fine-tuning, else model",
                            choices=RL_REFERENCE_MODES)
    reference_from: str = option("", "rl.reference=model: the reference's weights from this Hugging Face folder or "
                                     "safetensors file; empty = the starting weights")
    rollouts: str = option("", "replay the rollouts recorded in this file (rl.record) instead of sampling: a "
                               "layout's losses against one process's on the same completions (verify)")
    record: str = option("", "write every step's rollouts (tokens, rewards, log-probs) to this file")

    def settings(self) -> dict[str, Any]:
        """The knobs rl.algorithm decides where they are left at auto."""
        algo = self.algorithm
        return {"aggregation": self.aggregation if self.aggregation != "auto" else
                {"grpo": "sequence", "dr_grpo": "constant", "dapo": "token"}[algo],
                "advantage_scaling": self.advantage_scaling if self.advantage_scaling != "auto" else
                ("none" if algo == "dr_grpo" else "group"),
                "eps_high": self.eps_high or (0.28 if algo == "dapo" else self.eps_low),
                "dynamic_sampling": self.dynamic_sampling == "on" or (self.dynamic_sampling == "auto" and
                                                                      algo == "dapo")}


def rl_reference(cfg) -> str:
    """Where an RL run's reference log-probs come from: model, adapters, or "none" (rl.beta = 0, or not RL)."""
    if cfg.train.objective != "rl" or cfg.rl.beta == 0:
        return "none"
    if cfg.rl.reference == "auto":
        return "adapters" if cfg.adapter.kind != "none" else "model"
    return cfg.rl.reference


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "data": DataConfig,
    "train": TrainConfig,
    "optim": OptimConfig,
    "precision": PrecisionConfig,
    "memory": MemoryConfig,
    "parallel": ParallelConfig,
    "fault_tolerance": FaultToleranceConfig,
    "checkpoint": CheckpointConfig,
    "log": LogConfig,
    "adapter": AdapterConfig,
    "preference": PreferenceConfig,
    "rl": RLConfig,
    "eval": EvalConfig,
}


@dataclass
class JobConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    adapter: AdapterConfig = field(default_factory=AdapterConfig)
    preference: PreferenceConfig = field(default_factory=PreferenceConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    def to_toml(self) -> str:
        """The config as TOML that `--config` reads back to the same config (every key written)."""
        lines = []
        for section, values in self.to_dict().items():
            tables = {key: value for key, value in values.items() if isinstance(value, dict)}
            lines.append(f"[{section}]")
            lines += [f"{key} = {_toml_value(value)}" for key, value in values.items() if key not in tables]
            lines.append("")
            for key, table in tables.items():  # [parallel.sync] after [parallel]'s own keys
                lines.append(f"[{section}.{key}]")
                lines += [f"{name} = {_toml_value(value)}" for name, value in table.items()]
                lines.append("")
        return "\n".join(lines)

    def replace(self, **dotted: Any) -> JobConfig:
        """A validated copy with some options changed: `cfg.replace(**{"train.steps": 10})`."""
        return from_dict(self.to_dict(), overrides=dotted)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value) if value == value and abs(value) != float("inf") else \
            ("nan" if value != value else "inf" if value > 0 else "-inf")
    if isinstance(value, str):  # a JSON string is a TOML basic string (the escapes agree)
        return json.dumps(value, ensure_ascii=False)
    raise TypeError(f"no TOML form for {value!r}")


# Old names of options that moved (issue 46: ParallelConfig split by job). Each still works where a
# key is given (TOML, --section.key=value, cfg.replace, a saved run's config.json or checkpoint),
# mapped to its new name with a one-line note; giving both names of one option is an error.
ALIASES: dict[str, str] = {
    "parallel.dp_sync": "parallel.sync.mode",
    "parallel.sync_every": "parallel.sync.every",
    "parallel.sync_fragments": "parallel.sync.fragments",
    "parallel.sync_delay": "parallel.sync.delay",
    "parallel.sync_dtype": "parallel.sync.dtype",
    "parallel.outer_optimizer": "parallel.sync.outer_optimizer",
    "parallel.outer_lr": "parallel.sync.outer_lr",
    "parallel.outer_momentum": "parallel.sync.outer_momentum",
    "parallel.inner_lr_scale": "parallel.sync.inner_lr_scale",
    "parallel.outer_on_cpu": "parallel.sync.outer_on_cpu",
    "parallel.fault_tolerance": "fault_tolerance.enabled",
    "parallel.ft_groups": "fault_tolerance.groups",
    "parallel.ft_replica_id": "fault_tolerance.replica_id",
    "parallel.ft_lighthouse": "fault_tolerance.lighthouse",
    "parallel.ft_min_replicas": "fault_tolerance.min_replicas",
    "parallel.ft_quorum_timeout_s": "fault_tolerance.quorum_timeout_s",
    "parallel.ft_step_timeout_s": "fault_tolerance.step_timeout_s",
}


def alias_note(old: str) -> str:
    return f"{old} is now {ALIASES[old]}; the old name still works"


def _both_names(old: str, where: str) -> str:
    return f"{old} and {ALIASES[old]} are one option{where}; keep {ALIASES[old]} ({old} is its old name)"


def upgrade(raw: Mapping[str, Any], errors: list[str], used: dict[str, None], where: str = "") -> dict[str, Any]:
    """A copy of a nested config `raw` (a TOML file, a saved config) with its old names (ALIASES)
    moved to their new places; each old name found goes into `used`, both names of one option is
    an error. Its tables are copied: `raw` stays as it was."""
    out = {k: ({n: dict(v) if isinstance(v, Mapping) else v for n, v in body.items()}
               if isinstance(body, Mapping) else body) for k, body in raw.items()}
    for old, new in ALIASES.items():
        section, _, name = old.partition(".")
        body = out.get(section)
        if not isinstance(body, dict) or name not in body:
            continue
        *path, leaf = new.split(".")
        table = out
        for part in path:
            table = table.setdefault(part, {})
            if not isinstance(table, dict):
                break  # `sync = 3`: reported as it is built, and the old name with it
        else:
            used[old] = None
            value = body.pop(name)
            if leaf in table:
                errors.append(_both_names(old, where))
            else:
                table[leaf] = value
    return out


def _dotted_aliases(dotted: Mapping[str, Any], errors: list[str], used: dict[str, None]) -> dict[str, Any]:
    """Dotted overrides with their old names (ALIASES) renamed; both names of one option is an error."""
    out: dict[str, Any] = {}
    for key, value in dotted.items():
        new = ALIASES.get(key)
        if new is None:
            out[key] = value
            continue
        used[key] = None
        if new in dotted:
            errors.append(_both_names(key, " given twice"))
            continue
        out[new] = value
    return out


def _tables(cls: type) -> set[str]:
    """The names of a section's sub-tables (`option_table` fields)."""
    return {f.name for f in dataclasses.fields(cls) if table_class(f) is not None}


def flat_keys(values: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"section.key": value} of a config tree (`to_dict()`), a sub-table's keys as
    "section.table.key"."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, Mapping):
            out.update(flat_keys(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def option_fields() -> dict[str, dataclasses.Field]:
    """Every option by its dotted name ("train.steps", "parallel.sync.every")."""
    out: dict[str, dataclasses.Field] = {}

    def walk(prefix: str, cls: type) -> None:
        for f in dataclasses.fields(cls):
            if (inner := table_class(f)) is not None:
                walk(f"{prefix}{f.name}.", inner)
            else:
                out[f"{prefix}{f.name}"] = f
    for name, cls in SECTIONS.items():
        walk(f"{name}.", cls)
    return out


# the config `scaletrain train` runs without --config: the demo (configs/tiny.toml, shipped inside
# the package)
DEMO_CONFIG = Path(__file__).with_name("demo.toml")


def parse_mix(text: str) -> list[tuple[str, float]]:
    """data.mix as (path, weight) pairs, the weights normalised to sum to 1; ValueError (one
    line) for a malformed entry, a weight that is not above 0, or a folder named twice."""
    pairs: list[tuple[str, float]] = []
    for item in (part.strip() for part in text.split(",")):
        path, eq, weight = item.rpartition("=")
        if not item or not eq or not path.strip():
            raise ValueError(f"entry {item!r} is not PATH=WEIGHT; write data.mix as \"data/web=70,data/code=30\"")
        try:
            w = float(weight)
        except ValueError:
            raise ValueError(f"weight {weight!r} of {path.strip()} is not a number") from None
        if not w > 0 or w == float("inf"):  # also refuses NaN
            raise ValueError(f"weight {weight.strip()} of {path.strip()} must be above 0 (and finite); give each "
                             "source a positive share, or leave it out of the mix")
        pairs.append((path.strip(), w))
    paths = [p for p, _ in pairs]
    if dup := next((p for p in paths if paths.count(p) > 1), None):
        raise ValueError(f"{dup} is named twice; give each folder once with its whole weight")
    if len(pairs) < 2:
        raise ValueError("a mix needs at least two sources; for one folder set data.path instead")
    # normalised by the largest weight first: a sum of huge weights (1e308 + 1e308) overflows
    top = max(w for _, w in pairs)
    scaled = [(p, w / top) for p, w in pairs]
    if starved := next((p for p, w in scaled if w == 0.0 or w / len(scaled) == 0.0), None):
        raise ValueError(f"the weight of {starved} is too small beside the largest ({top:g}) to give it any share; "
                         "give weights of comparable size (they are relative shares)")
    total = sum(w for _, w in scaled)
    return [(p, w / total) for p, w in scaled]


def data_paths(cfg_data) -> list[str]:
    """The prepared folders a run reads: data.mix's, or data.path (empty: the built-in text)."""
    return [p for p, _ in parse_mix(cfg_data.mix)] if cfg_data.mix else [cfg_data.path]


def map_data_folders(data: Mapping[str, Any], change: Callable[[str], str]) -> dict[str, str]:
    """The folders a data section names, `change`d: {"path": ..., "mix": ...} for those it sets
    (data.mix's weights kept as written; the built-in data, "", names no folder)."""
    out = {}
    if isinstance(path := data.get("path"), str) and path:
        out["path"] = change(path)
    if isinstance(mix := data.get("mix"), str) and mix:
        entries = []
        for item in mix.split(","):
            folder, eq, weight = item.strip().rpartition("=")
            entries.append(f"{change(folder.strip())}={weight.strip()}" if eq and folder.strip() else item)
        out["mix"] = ",".join(entries)
    return out


MODEL_PATHS = ("from_hf", "init_from")  # the model's config and weights, when they are local files or folders


def with_absolute_data(cfg: JobConfig) -> JobConfig:
    """`cfg` with its data folders and local model paths (MODEL_PATHS) absolute: the config a run
    saves (config.json, every checkpoint) then names them whatever folder a later command (a resume,
    eval, export) runs in."""
    absolute = map_data_folders(cfg.to_dict()["data"], os.path.abspath)
    changed = {f"data.{key}": value for key, value in absolute.items() if value != getattr(cfg.data, key)}
    for key in MODEL_PATHS:
        if (value := getattr(cfg.model, key)) and os.path.exists(value) and not os.path.isabs(value):
            changed[f"model.{key}"] = os.path.abspath(value)
    return cfg.replace(**changed) if changed else cfg


def relative_data(data: Mapping[str, Any], base: str | Path) -> dict[str, str]:
    """The folders a data section names, relative to the folder `base` (a checkpoint's): what
    finds them again once `base` has moved with its data (`locate_data`)."""
    return map_data_folders(data, lambda folder: os.path.relpath(folder, base))


def locate_data(config: dict, recorded: Mapping | None, base: Path, *, what: str, fix: str | None = None,
                report: Callable[[str], None] | None = None) -> dict:
    """Saved `config` (a dict) with its data folders found: each is taken where it is recorded
    (absolute), else where `recorded` (`relative_data`) puts it relative to `base` (the folder
    moved with its data; said through `report`). A folder in neither place: a DataError that
    says so, naming `what` config it is and ending with `fix`, or (fix None) left as it is."""
    data = config.get("data") if isinstance(config.get("data"), dict) else {}
    recorded = recorded if isinstance(recorded, Mapping) else {}
    found = {}
    for key, value in map_data_folders(data, lambda folder: folder).items():
        if all(_exists(folder) for folder in _folders_of(key, value)):
            continue
        there = None
        if isinstance(rel := recorded.get(key), str) and rel:
            there = map_data_folders({key: rel}, lambda folder: os.path.abspath(base / folder))[key]
            if all(_exists(folder) for folder in _folders_of(key, there)):
                found[key] = there
                if report is not None:
                    report(f"data.{key} {value} of {what} is not there; using {there}, which lies where it did "
                           f"relative to {base} (moved with it)")
                continue
        if fix is not None:
            beside = f", nor at {there}, where it lay relative to {base}" if there else ""
            raise DataError(f"data.{key} {value} of {what} was not found{beside}; {fix}")
    return {**config, "data": {**data, **found}} if found else config


def _folders_of(key: str, value: str) -> list[str]:
    folders: list[str] = []
    map_data_folders({key: value}, lambda folder: folders.append(folder) or folder)
    return folders


# --------------------------------------------------------------------------------------------
# Loading


def load_config(path: str | Path | None = None,
                overrides: Mapping[str, Any] | Sequence[str] = (), *,
                notes: Callable[[str], None] | None = None) -> JobConfig:
    """Load a TOML file (or nothing: the built-in default) and apply overrides.

    `overrides` is either a mapping {"section.key": value} (Python values, or strings that are
    parsed like the command line) or a list of `--section.key=value` arguments. `notes`: where
    the lines about old option names used go (one per name; see ALIASES).
    """
    raw: dict[str, Any] = {}
    if path is not None:
        raw = read_config_file(path)
    return from_dict(raw, overrides=overrides, source=str(path) if path else "defaults", notes=notes)


def read_config_file(path: str | Path) -> dict[str, Any]:
    """A config file's sections: TOML, or (a name ending in .json) the JSON a run saves as its
    config.json (`--print-config=json`)."""
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"config {p} is a folder; give a TOML file such as configs/tiny.toml")
    if not p.is_file():
        raise ConfigError(f"config file {p} not found; give a TOML file such as configs/tiny.toml")
    if p.suffix.lower() == ".json":
        try:
            raw = json.loads(p.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{p}: not valid JSON ({e}); give a run's config.json or a TOML file") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{p}: expected a JSON object of sections (a run's config.json), "
                              f"got {type(raw).__name__}")
        return raw
    try:
        with p.open("rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{p}: not valid TOML ({e}); fix the syntax at that line") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{p}: not valid TOML (not UTF-8 text); give a TOML file such as configs/tiny.toml") from None



def parse_override_args(args: Iterable[str]) -> tuple[dict[str, str], list[str]]:
    """`--section.key=value` or `--section.key value` pairs; returns (overrides, errors)."""
    out: dict[str, str] = {}
    errors: list[str] = []
    items = list(args)
    i = 0
    while i < len(items):
        arg = items[i]
        i += 1
        if not arg.startswith("--") or "." not in arg.split("=", 1)[0]:
            errors.append(f"unexpected argument {arg!r}; options look like --section.key=value "
                          f"(sections: {', '.join(SECTIONS)})")
            continue
        if "=" in arg:
            key, value = arg[2:].split("=", 1)
        elif i < len(items) and not items[i].startswith("--"):
            key, value = arg[2:], items[i]
            i += 1
        else:
            errors.append(f"--{arg[2:]} needs a value: --{arg[2:]}=VALUE")
            continue
        out[key] = value
    return out, errors


def from_dict(raw: Mapping[str, Any], overrides: Mapping[str, Any] | Sequence[str] = (),
              source: str = "config", *, own_model: bool = True,
              notes: Callable[[str], None] | None = None) -> JobConfig:
    """Build and validate a JobConfig from a nested dict plus dotted overrides. `own_model=False`:
    the model these settings go with is given elsewhere (the planner's MODEL argument), so the
    checks of the settings against the model's shape (train.qat, precision.mode=fp8) are left out.
    Old option names (ALIASES) are read as their new ones, a line each to `notes`."""
    errors: list[str] = []
    if isinstance(overrides, Mapping):
        dotted = dict(overrides)
    else:
        dotted, errors = parse_override_args(overrides)
    used: dict[str, None] = {}  # the old names given, in order
    raw = upgrade(raw, errors, used, f" in {source}")
    dotted = _dotted_aliases(dotted, errors, used)
    if notes is not None:
        for old in used:
            notes(alias_note(old))

    merged: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
    from_cli: set[tuple[str, str]] = set()  # values that arrive as text and need parsing

    for section, body in raw.items():
        if section not in SECTIONS:
            errors.append(f"{source}: unknown section [{section}]{did_you_mean(section, SECTIONS)}; "
                          f"sections are {', '.join(SECTIONS)}")
            continue
        if not isinstance(body, Mapping):
            errors.append(f"{source}: [{section}] must be a table of key = value lines, got {body!r}")
            continue
        merged[section].update(body)

    for key, value in dotted.items():
        section, _, name = key.partition(".")
        if section not in SECTIONS or not name:
            errors.append(f"unknown option --{key}{did_you_mean(section, SECTIONS, suffix='.' + name)}; "
                          f"options look like --section.key=value (sections: {', '.join(SECTIONS)})")
            continue
        table, target = section, merged[section]
        sub, _, leaf = name.partition(".")
        if leaf and sub in _tables(SECTIONS[section]):  # --parallel.sync.every: a key of [parallel.sync]
            inner = target.get(sub)
            target[sub] = dict(inner) if isinstance(inner, Mapping) else {}
            table, name, target = f"{section}.{sub}", leaf, target[sub]
        target[name] = value
        if isinstance(value, str):
            from_cli.add((table, name))

    # The model's shape has one source, model.preset or model.from_hf: one given on the command
    # line replaces the other's from the file below it (a layer replaces a lower layer's choice)
    for given, other in (("preset", "from_hf"), ("from_hf", "preset")):
        if dotted.get(f"model.{given}") and f"model.{other}" not in dotted and isinstance(raw.get("model"), Mapping) \
                and raw["model"].get(other):
            merged["model"].pop(other, None)
    merged["model"] = fill_shape(merged["model"], errors)  # from model.preset or model.from_hf
    # model.vocab_size = 0: the vocabulary the data was prepared with (only its meta.json is read)
    vocab = merged["model"].get("vocab_size")
    if isinstance(vocab, (int, str)) and not isinstance(vocab, bool) and str(vocab).strip() == "0":
        from scaletrain.data.prepare import recorded_vocab_size  # local: keeps plain config loads light

        del merged["model"]["vocab_size"]  # if it cannot be resolved, report that alone
        from_cli.discard(("model", "vocab_size"))
        path, mix = merged["data"].get("path", ""), merged["data"].get("mix", "")
        if isinstance(mix, str) and mix:  # every source shares one tokenizer (checked when the data opens)
            try:
                path = parse_mix(mix)[0][0]
            except ValueError:
                path = None  # reported with the data keys
        if isinstance(path, str):  # another type is reported with the data keys
            try:
                merged["model"]["vocab_size"] = recorded_vocab_size(path)
            except DataError as e:
                errors.append(f"model.vocab_size=0 takes the vocabulary from data.path, but {e}; "
                              "set model.vocab_size, or data.path to a folder written by scaletrain prepare")

    sections: dict[str, Any] = {}
    for name, cls in SECTIONS.items():
        sections[name] = build_section(name, cls, merged[name], from_cli, errors)

    cfg = JobConfig(**sections)
    if not errors:
        errors.extend(check_combinations(cfg, own_model=own_model))
    if errors:
        raise ConfigError(*errors)
    return cfg


# --------------------------------------------------------------------------------------------
# Checks across keys


def check_combinations(cfg: JobConfig, own_model: bool = True) -> list[str]:
    """Problems that involve more than one key. Checks of the layout, which needs the world size, are
    scaletrain.layout.Layout.check."""
    m, errors = cfg.model, check_model(cfg.model)
    if cfg.data.seq_len > m.max_seq_len:
        errors.append(f"data.seq_len={cfg.data.seq_len} exceeds model.max_seq_len={m.max_seq_len}; "
                      f"lower data.seq_len or raise model.max_seq_len")
    if cfg.train.sample_tokens and not cfg.train.sample_prompt:
        errors.append("train.sample_prompt is empty: the sample after training continues a prompt; give it some "
                      "text, or train.sample_tokens=0 for no sample")
    if cfg.data.mix:
        try:
            parse_mix(cfg.data.mix)
        except ValueError as e:
            errors.append(f"data.mix: {e}")
        if cfg.data.path:
            errors.append("data.path and data.mix both name the data; keep one of them (data.mix for several folders)")
    res = cfg.checkpoint.resume
    if res not in ("none", "auto") and not _exists(res):
        errors.append(f"checkpoint.resume: folder {res} does not exist; "
                      "use none, auto, or an existing checkpoint folder")
    if cfg.precision.mode == "16-mixed" and cfg.precision.min_scale > cfg.precision.init_scale:
        errors.append(f"precision.min_scale={cfg.precision.min_scale} is above precision.init_scale="
                      f"{cfg.precision.init_scale}")
    if cfg.train.batch_rampup and cfg.data.mix:
        errors.append("train.batch_rampup grows the batch of one data.path; with data.mix the batch stays fixed "
                      "(the mix sampler draws whole global batches): drop one of them")
    if cfg.train.batch_rampup:
        from scaletrain.schedule import parse_rampup

        try:
            parse_rampup(cfg.train.batch_rampup)
        except ValueError as e:
            errors.append(str(e))
    sync = cfg.parallel.sync
    if sync.mode != "step" and sync.fragments > sync.every:
        errors.append(f"parallel.sync.fragments={sync.fragments} must be at most parallel.sync.every={sync.every}: "
                      "each fragment syncs at a step of its own in every sync.every steps")
    elif sync.mode != "step" and sync.delay and sync.delay * sync.fragments >= sync.every:
        errors.append(f"parallel.sync.delay={sync.delay} must be below sync.every / sync.fragments = "
                      f"{sync.every} / {sync.fragments}: a fragment's sync must land before the next "
                      f"fragment's begins; lower sync.delay or sync.fragments, or raise sync.every")
    if sync.mode == "step" and sync.inner_lr_scale != 1.0:
        errors.append(f"parallel.sync.inner_lr_scale={sync.inner_lr_scale:g} scales the inner learning rate of the "
                      "workers of parallel.sync.mode=local_sgd or diloco; with sync.mode=step every rank steps at "
                      "optim.lr: set optim.lr instead, or leave sync.inner_lr_scale at 1")
    if cfg.fault_tolerance.enabled:
        from scaletrain.ft_checks import fault_tolerance_problems  # torch-free

        errors.extend(fault_tolerance_problems(cfg.fault_tolerance))
    if cfg.data.document_mask:
        from scaletrain.data.documents import document_mask_problems  # torch-free

        errors.extend(document_mask_problems(cfg))
    if cfg.train.qat != "none" and own_model:
        from scaletrain.quant.layers import qat_problems  # torch-free

        errors.extend(qat_problems(m, cfg.train.qat))
    if cfg.precision.mode == "fp8":
        from scaletrain.quant.layers import fp8_problems  # torch-free

        errors.extend(fp8_problems(m if own_model else None, cfg.precision.fp8_min_dim, cfg.train.qat))
    errors.extend(adapter_problems(cfg.adapter))
    errors.extend(preference_problems(cfg))
    errors.extend(rl_problems(cfg))
    if cfg.eval.every and not cfg.eval.tasks.strip(", "):
        errors.append(f"eval.every={cfg.eval.every} scores eval.tasks, and it names none; give task names (e.g. "
                      "eval.tasks=scaletrain_choice), or eval.every=0")
    if cfg.optim.name == "adamw8bit" and cfg.optim.implementation not in ("auto",):
        errors.append("optim.implementation applies to adamw and sgd; leave it at auto for adamw8bit")
    errors.extend(muon_problems(cfg.optim))
    return errors


def muon_problems(o: OptimConfig) -> list[str]:
    """optim.muon's own checks; and [optim.muon] keys given to an 8-bit or factored optimizer, which would
    otherwise be dropped without a word: Muon with such a state is not built."""
    if o.name == "muon":
        try:
            ns_coefficients(o.muon)
        except ValueError as e:
            return [str(e)]
        return []
    given = [f"optim.muon.{f.name}" for f in dataclasses.fields(MuonConfig) if getattr(o.muon, f.name) != f.default]
    if o.name in ("adamw8bit", "adafactor") and given:
        return [f"optim.name={o.name} with {', '.join(given)}: Muon with an 8-bit or factored state is not built, "
                f"and {o.name} has no Muon part; use optim.name=muon (its matrices keep one fp32 buffer, half of "
                f"AdamW's state), or drop the optim.muon keys"]
    return []


def preference_problems(cfg: JobConfig) -> list[str]:
    """[preference] and what train.objective=preference cannot be combined with (yet)."""
    p = cfg.preference
    if cfg.train.objective != "preference":
        return []
    errors = check_preference(p)
    if p.reference == "adapters" and cfg.adapter.kind == "none":
        errors.append("preference.reference=adapters takes the reference log-probs from the policy with its adapters "
                      "switched off, and adapter.kind=none trains no adapters; set adapter.kind=lora, or "
                      "preference.reference=model or precomputed")
    if p.reference_from and preference_reference(cfg) != "model":
        errors.append(f"preference.reference_from={p.reference_from} gives the weights of a frozen reference copy "
                      f"(preference.reference=model); with reference {preference_reference(cfg)} there is none: set "
                      "preference.reference=model, or drop preference.reference_from")
    elif p.reference_from and not _exists(p.reference_from):
        errors.append(f"preference.reference_from: {p.reference_from} does not exist; give a Hugging Face model folder "
                      "or a .safetensors file")
    if cfg.fault_tolerance.enabled:
        errors.append("fault_tolerance.enabled with train.objective=preference is not supported yet (the replica "
                      "groups' losses are weighed by tokens, a preference loss by pairs); set fault_tolerance."
                      "enabled=false")
    for key, value, why in (("data.mix", cfg.data.mix, "one preference folder (data.path)"),
                            ("train.batch_rampup", cfg.train.batch_rampup, "a fixed number of examples per step"),
                            ("data.document_mask", cfg.data.document_mask, "one example per row, nothing packed")):
        if value:
            errors.append(f"{key} is not used by train.objective=preference, which trains {why}; drop {key}")
    return errors


def completion_room_problem(seq_len: int, max_new_tokens: int) -> str | None:
    """A completion as long as a row leaves no room for its prompt (the trainer and the planner ask)."""
    if max_new_tokens < seq_len:
        return None
    return (f"rl.max_new_tokens={max_new_tokens} leaves no room for a prompt in data.seq_len={seq_len} (prompt + "
            "completion fit one row); raise data.seq_len or lower rl.max_new_tokens")


def rl_problems(cfg: JobConfig) -> list[str]:
    """[rl] and what train.objective=rl cannot be combined with (yet); what needs the data or the layout is
    checked where they are known (rl.prompts given and its prompts short enough: the trainer; whole groups per
    rank, and the layouts that can sample: the legality check, which the planner asks too)."""
    r = cfg.rl
    if cfg.train.objective != "rl":
        return []
    errors, settings = [], r.settings()
    if settings["advantage_scaling"] == "group" and r.group_size < 2:
        errors.append(f"rl.group_size={r.group_size}: {r.algorithm}'s advantages divide by the std of a prompt's group "
                      "of completions, which needs 2 or more; set rl.group_size to 2 or more (4-16 are usual)")
    if r.group_size < 2 and settings["dynamic_sampling"]:
        errors.append("rl.dynamic_sampling keeps groups whose rewards differ, and one completion per prompt never "
                      "differs; set rl.group_size to 2 or more")
    for key in ("prompts", "eval_prompts", "rollouts"):
        if getattr(r, key) and not _exists(getattr(r, key)):
            errors.append(f"rl.{key}: {getattr(r, key)} does not exist; give the path of the file")
    if r.reward_args:
        try:
            args = json.loads(r.reward_args)
            if not isinstance(args, dict) or not all(isinstance(v, dict) for v in args.values()):
                raise ValueError("not an object of objects")
        except ValueError as e:
            errors.append(f"rl.reward_args is not a JSON object of each reward's arguments ({e}); write e.g. "
                          '{"answer_match": {"extractor": "last_number"}}')
    if r.beta > 0 and r.reference == "adapters" and cfg.adapter.kind == "none":
        errors.append("rl.reference=adapters takes the reference log-probs from the policy with its adapters switched "
                      "off, and adapter.kind=none trains none; set adapter.kind=lora, or rl.reference=model")
    if r.reference_from and rl_reference(cfg) != "model":
        errors.append(f"rl.reference_from gives a frozen reference copy's weights, and this run has reference "
                      f"{rl_reference(cfg)} (rl.beta={r.beta:g}); set rl.beta above 0 and rl.reference=model, or drop "
                      "rl.reference_from")
    if r.rollouts and r.record:
        errors.append("rl.rollouts replays recorded rollouts and rl.record records new ones; set one of them")
    if cfg.fault_tolerance.enabled:
        errors.append("fault_tolerance.enabled with train.objective=rl is not supported yet; set "
                      "fault_tolerance.enabled=false")
    for key, value, why in (("data.mix", cfg.data.mix, "on rl.prompts"),
                            ("train.batch_rampup", cfg.train.batch_rampup, "a fixed number of completions per step"),
                            ("data.document_mask", cfg.data.document_mask, "one completion per row, nothing packed"),
                            ("parallel.sync.mode", cfg.parallel.sync.mode != "step", "every step synchronous")):
        if value:
            errors.append(f"{key} is not used by train.objective=rl, which trains {why}; drop {key}")
    return errors


def adapter_problems(a: AdapterConfig) -> list[str]:
    """adapter.*'s own problems (whether the targets name modules is known once the model is built)."""
    errors = []
    if a.rank <= 0:
        errors.append(f"adapter.rank={a.rank}: the adapters' rank must be at least 1 (8 or 16 are usual)")
    if a.kind != "none" and not [t for t in a.targets.split(",") if t.strip()]:
        errors.append(f"adapter.targets is empty: name the linears to adapt, or a group: {', '.join(ADAPTER_GROUPS)}")
    if a.base_dtype != "auto" and a.kind == "none":
        errors.append(f"adapter.base_dtype={a.base_dtype} stores the frozen base of adapted linears, but adapter.kind="
                      "none trains every weight; set adapter.kind=lora (QLoRA), or drop adapter.base_dtype")
    if a.base_dtype != "auto" and a.kind == "dora":
        errors.append(f"adapter.kind=dora with adapter.base_dtype={a.base_dtype}: not supported (DoRA's row norms "
                      "read the dense base weight); use adapter.kind=lora, or adapter.base_dtype=auto")
    return errors


def _exists(path: str) -> bool:
    try:
        return Path(path).exists()
    except (OSError, ValueError):  # a name too long for the file system, or with a NUL byte
        return False


def describe_options() -> str:
    """Every option with its default and reason, for `scaletrain train --help-config`."""
    lines = []

    def table(name: str, cls: type) -> None:
        lines.append(f"[{name}]")
        inner = []
        for f in dataclasses.fields(cls):
            if (sub := table_class(f)) is not None:
                inner.append((f"{name}.{f.name}", sub))  # after this table's own keys, as in TOML
                continue
            choices = f.metadata.get("choices")
            extra = f" ({' | '.join(choices)})" if choices else ""
            lines.append(f"  {f.name} = {f.default!r}{extra}  # {f.metadata['help']}")
        for args in inner:
            table(*args)

    for section, cls in SECTIONS.items():
        table(section, cls)
    lines.append("# old names, still read (with a note each): " +
                 ", ".join(f"{old} = {new}" for old, new in ALIASES.items()))
    return "\n".join(lines)
