"""Adapter fine-tuning in the memory model (adapter.kind, adapter.rank, adapter.base_dtype).

A LoRA or QLoRA run holds the whole model's weights but trains the adapters alone: only they
have gradients, master weights and optimizer state. The adapted linears' frozen bases take the
bytes their storage takes (`base_bytes_per_param`: NF4 about half a byte, int8 one, bf16 two,
auto as the precision mode keeps weights); the rest of the base (embeddings, norms, head) stays
as without adapters. Activations are the model's (the base's linears need their inputs for the
input gradient as before), plus each adapter's rank-wide intermediate and, for a quantized
base, one weight dequantized for its matmul.

Which linears: the groups of adapter.targets (all-linear, attention, mlp) over the blocks'
matrices (`layer_params`); a mixture of experts' routed experts are not nn.Linear modules and
take no adapters (attention only in its blocks). A list of names or patterns is counted as
all-linear (the most it can choose).
"""

from __future__ import annotations

import math
from typing import NamedTuple

from scaletrain.model.config import ModelConfig
from scaletrain.plan.params import ParamCounts, layer_params, rank_blocks
from scaletrain.plan.spec import Layout, Workload

NF4_BLOCK, NF4_SCALER_BLOCK = 64, 256  # as scaletrain.quant.frozen_base (imported there with torch)


def base_bytes_per_param(base_dtype: str, in_features: int, plain: float) -> float:
    """Bytes a frozen adapted base weight takes per parameter (`plain`: as the engine keeps
    weights). NF4: 4-bit codes, an int8 scale per block of 64, an fp32 factor per group of up to
    256 scales within a row; int8: a byte and an fp32 scale per row of `in_features`."""
    if base_dtype == "nf4":
        group = math.gcd(NF4_SCALER_BLOCK, max(1, in_features // NF4_BLOCK))
        return 0.5 + 1 / NF4_BLOCK + 4 / (NF4_BLOCK * group)
    if base_dtype == "int8":
        return 1 + 4 / in_features
    if base_dtype == "bf16":
        return 2.0
    return plain


class AdapterCounts(NamedTuple):
    """One rank's parameters under adapters."""

    trainable: ParamCounts  # the adapters: gradients, masters and optimizer state
    base: int  # the adapted linears' frozen weights
    base_bytes: float  # ... and the bytes they take (at `plain` bytes a parameter for auto)
    frozen: int  # every other frozen parameter (embeddings, norms, head, unadapted linears)
    per_block: tuple[int, float, int] = (0, 0.0, 0)  # one block's (base parameters, their bytes, adapters)


def _block_mats(cfg: ModelConfig, tp: int, moe: bool, ep: int, targets: str) -> list[tuple[int, int]]:
    mats = list(layer_params(cfg, tp, moe, ep).matrices)
    attention, rest = mats[:4], mats[4:]
    if moe:  # the router and the experts take none
        rest = []
    group = targets if targets in ("attention", "mlp") else "all-linear"
    return {"attention": attention, "mlp": rest, "all-linear": attention + rest}[group]


def adapter_counts(cfg: ModelConfig, wl: Workload, layout: Layout, pp_rank: int, counts: ParamCounts,
                   plain: float) -> AdapterCounts:
    """`counts` (the rank's parameters) split into trainable adapters and the frozen base."""
    r = wl.adapter_rank
    trainable = base = 0
    base_bytes = 0.0
    mats_all = []
    worst = (0, 0.0, 0)
    for n, moe in zip(rank_blocks(cfg, layout, pp_rank), (False, True)):
        if not n:
            continue
        mats = _block_mats(cfg, layout.tp, moe, layout.ep, wl.adapter_targets)
        block_base = sum(rows * cols for rows, cols in mats)
        block_bytes = sum(rows * cols * base_bytes_per_param(wl.base_dtype, cols, plain) for rows, cols in mats)
        block_adapters = sum(r * (rows + cols) for rows, cols in mats)
        trainable += n * block_adapters
        base += n * block_base
        base_bytes += n * block_bytes
        mats_all += [m for rows, cols in mats for m in ((r, cols), (rows, r))] * n
        worst = max(worst, (block_base, block_bytes, block_adapters))
    adapters = ParamCounts(trainable, 0, trainable, tuple(mats_all))
    return AdapterCounts(adapters, base, base_bytes, counts.total - base, worst)


def adapter_activation_bytes(cfg: ModelConfig, wl: Workload, layout: Layout, compute: int) -> float:
    """One block's extra activations under adapters, per micro-batch: each adapted linear's
    rank-wide intermediate A x, kept for B's gradient."""
    tokens = layout.micro_batch * wl.seq_len / layout.cp
    linears = len(_block_mats(cfg, layout.tp, False, layout.ep, wl.adapter_targets))
    return tokens * wl.adapter_rank * linears * compute


def dequantized_bytes(cfg: ModelConfig, wl: Workload, layout: Layout, compute: int) -> float:
    """A quantized base is dequantized for each matmul, forward and backward: the largest
    adapted weight in the compute dtype, alive beside the activations (the NF4 decoding's own
    temporaries, shorter-lived, are not counted)."""
    mats = _block_mats(cfg, layout.tp, False, layout.ep, wl.adapter_targets)
    return max((rows * cols for rows, cols in mats), default=0) * compute
