"""Every vocabulary of the config, defined once: the names a user may write, and what follows
from them. config, layout, memory, plan, bench and cli import these; none types them again.

This module imports nothing heavy (no torch): the config and the planner load it.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

# precision modes, with Lightning's names (scaletrain.precision gives each its dtypes), and fp8:
# bf16-mixed with the large block linears' matmuls in float8 (scaletrain.quant.fp8)
PRECISIONS = ("32-true", "tf32", "16-mixed", "bf16-mixed", "bf16-true", "fp8")
# the planner's name for the peak FLOP/s a precision computes at (scaletrain.hardware's catalog keys);
# fp8's is that of the layers it keeps in bf16 (the converted ones run at the fp8 peak)
PEAK_KIND = {"32-true": "fp32", "tf32": "tf32", "16-mixed": "fp16", "bf16-mixed": "bf16", "bf16-true": "bf16",
             "fp8": "bf16"}
# fp8 scaling recipes (torchao's names): one scale per tensor, or one per row of each operand
FP8_RECIPES = ("tensorwise", "rowwise")

# post-training quantization schemes (`scaletrain quantize --scheme`, scaletrain.quant.ptq): int8
# weights alone, int8 activations and weights, int8 activations and int4 weights in groups
QUANT_SCHEMES = ("int8-weight", "int8-dynamic", "int8-int4")
# quantization-aware training (train.qat): "none", or a scheme whose activations are quantized too,
# fake-quantized during training (scaletrain.quant.qat)
QAT_SCHEMES = ("none", "int8-dynamic", "int8-int4")
OBJECTIVES = ("lm", "preference", "rl")  # train.objective
PREFERENCE_LOSSES = ("sigmoid", "robust", "ipo", "hinge", "simpo", "orpo", "kto")
REFERENCE_FREE = ("simpo", "orpo")  # the preference losses that need no reference model
REFERENCE_MODES = ("auto", "model", "precomputed", "adapters")  # preference.reference
# RL with verifiable rewards (scaletrain.model.rl): how the per-token losses become one number (token:
# the mean over the global batch's tokens; sequence: each sequence's token mean, then their mean;
# constant: Dr. GRPO's sum over tokens / (sequences x maximum completion length)), the per-token KL
# estimators, and the advantages' scaling (group: GRPO's division by the group's std; none: Dr. GRPO)
RL_AGGREGATIONS = ("token", "sequence", "constant")
KL_ESTIMATORS = ("k1", "k3")
ADVANTAGE_SCALINGS = ("group", "none")
# rl.algorithm: a preset of the knobs below it (GRPO, Dr. GRPO, DAPO as their papers and TRL 1.16 set them)
RL_ALGORITHMS = ("grpo", "dr_grpo", "dapo")
RL_REFERENCE_MODES = ("auto", "model", "adapters")  # rl.reference (auto: none when rl.beta is 0)
IS_CORRECTIONS = ("none", "token", "sequence")  # rl.is_correction: truncated importance sampling's level

OPTIMIZERS = ("adamw", "sgd", "adafactor", "adamw8bit", "muon")
# optim.muon.adjust_lr: how Muon scales its learning rate by a matrix's shape (A x B): Moonlight's
# 0.2 * sqrt(max(A, B)), which matches AdamW's update RMS (so optim.lr carries over), Keller Jordan's
# original sqrt(max(1, A / B)), or none; torch.optim.Muon's names
MUON_LR_ADJUST = ("match_rms_adamw", "original", "none")
MUON_NS_DTYPES = ("bf16", "fp32")  # optim.muon.ns_dtype: what Newton-Schulz computes (and sends) in

# adapters (adapter.kind, scaletrain.model.lora): none, low-rank updates of frozen linears (LoRA),
# or LoRA with each output row's magnitude learned apart from its direction (DoRA)
ADAPTER_KINDS = ("none", "lora", "dora")
BASE_DTYPES = ("auto", "nf4", "int8", "bf16")  # adapter.base_dtype: how a frozen base is stored (QLoRA)
# adapter.targets' named groups of linears (besides module names and fnmatch patterns)
ADAPTER_GROUPS = ("all-linear", "attention", "mlp")

# activation checkpointing: keep everything, recompute element-wise work, recompute whole blocks
AC_MODES = ("none", "full", "selective")

# pipeline schedules; the interleaved ones run several chunks (virtual stages) on each pp rank
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble")
MULTI_CHUNK_SCHEDULES = ("interleaved-1f1b", "zero-bubble")

# context parallelism: how the ranks of one sequence see each other's keys and values: passed
# around a ring (merged by log-sum-exp), gathered once per layer, or swapped for heads (Ulysses)
CP_METHODS = ("ring", "allgather", "ulysses")

ZERO_STAGES = (0, 1, 2, 3)  # 0 = DDP; 1 shards optimizer state, 2 + gradients, 3 + parameters (FSDP)

# the data-parallel engine a layout runs (scaletrain.layout.Layout.dp_engine): none (one dp
# rank), ddp, zero1, zero2, fsdp (ZeRO-3 and HSDP) or replicate (zero 0 under tp: DDP cannot take
# DTensor parameters, FSDP2's replicate can)
DP_ENGINES = ("none", "ddp", "zero1", "zero2", "fsdp", "replicate")

# how the data-parallel workers (the dp_replicate groups) synchronise: gradients every step (DDP,
# ZeRO), weights averaged every H steps (local SGD), or an outer optimizer step on the averaged
# pseudo-gradient every H steps (DiLoCo); scaletrain.parallel.local_sgd runs the last two
DP_SYNC_MODES = ("step", "local_sgd", "diloco")
LOCAL_SYNC_MODES = ("local_sgd", "diloco")
# DiLoCo's outer optimizer: SGD with Nesterov momentum (the paper's), or with heavy-ball momentum
OUTER_OPTIMIZERS = ("nesterov", "sgd")
# what a pseudo-gradient is sent as: fp32, bf16, or int8 with one fp32 scale per chunk
SYNC_DTYPES = ("fp32", "bf16", "int8")

# whose memory habits and collectives the planner models (scaletrain.plan.params.ENGINES)
PLAN_ENGINES = ("scaletrain", "megatron", "deepspeed")


# names users bring from elsewhere for one of ours: Lightning's short precision names (its "bf16"
# and "16" are the mixed modes, which spelling alone would not find)
MEANT = {"bf16": "bf16-mixed", "16": "16-mixed", "fp16": "16-mixed", "half": "16-mixed", "32": "32-true",
         "fp32": "32-true", "float32": "32-true", "bfloat16": "bf16-mixed"}


def did_you_mean(word: str, choices: Iterable[str], prefix: str = "", suffix: str = "") -> str:
    """' (did you mean X?)' for what `word` most likely means among `choices`, or '': a name
    known to mean one of them (MEANT), the same name in another case, the choices it begins (up
    to three, those about as close as the closest: `H100` -> H100-SXM or H100-PCIe), else the
    closest spelling."""
    choices = [str(c) for c in choices]
    w = str(word).strip().lower()
    folded = {c.lower(): c for c in choices}
    if MEANT.get(w) in choices:
        found = [MEANT[w]]
    elif w in folded:
        found = [folded[w]]
    elif len(w) >= 2 and 1 <= len(begun := [c for c in choices if c.lower().startswith(w)]) <= 3:
        close = {c: difflib.SequenceMatcher(None, w, c.lower()).ratio() for c in begun}
        found = [c for c in begun if close[c] >= max(close.values()) - 0.1]  # adam: adamw, not adamw8bit
    else:
        found = [folded[m] for m in difflib.get_close_matches(w, list(folded), n=1, cutoff=0.6)]
    return f" (did you mean {' or '.join(f'{prefix}{c}{suffix}' for c in found)}?)" if found else ""


def unknown(kind: str, value, choices: Iterable) -> ValueError:
    """The error for a name outside its vocabulary (raise it: a mode that is not known is never
    taken for another)."""
    choices = tuple(choices)
    return ValueError(f"unknown {kind} {value!r}{did_you_mean(value, choices)}; "
                      f"known: {', '.join(str(c) for c in choices)}")


def is_multi_chunk(schedule: str) -> bool:
    if schedule not in PP_SCHEDULES:
        raise unknown("pipeline schedule", schedule, PP_SCHEDULES)
    return schedule in MULTI_CHUNK_SCHEDULES
