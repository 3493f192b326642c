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
"""

from __future__ import annotations

import copy
from functools import lru_cache

from torch import nn

from scaletrain.config import ModelConfig
from scaletrain.layout import SCHEDULES, balanced_split_counts, chunks_per_rank  # noqa: F401 - re-exported


def head_cost_in_blocks(cfg: ModelConfig) -> float:
    """The output head's matmul FLOPs in units of one block's matmul FLOPs."""
    d, kv, q = cfg.dim, cfg.kv_heads * cfg.head_size, cfg.n_heads * cfg.head_size
    block = 2 * d * q + 2 * d * kv + (3 if cfg.activation == "swiglu" else 2) * d * cfg.hidden_dim
    return cfg.vocab_size * d / block


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
            chunk.tok_emb = None
            chunk.pos_emb = None
        if s != last:
            chunk.norm = None
            chunk.output = None
        chunks.append(chunk)
    return chunks


def build_schedule(stages, schedule: str, n_microbatches: int, loss_fn):
    from torch.distributed.pipelining import (Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                              ScheduleZBVZeroBubble)

    # our loss is already divided by the tokens of the global batch: no extra scaling
    if schedule == "gpipe":
        return ScheduleGPipe(stages[0], n_microbatches, loss_fn=loss_fn, scale_grads=False)
    if schedule == "1f1b":
        return Schedule1F1B(stages[0], n_microbatches, loss_fn=loss_fn, scale_grads=False)
    if schedule == "interleaved-1f1b":
        return ScheduleInterleaved1F1B(stages, n_microbatches, loss_fn=loss_fn, scale_grads=False)
    if schedule == "zero-bubble":
        return ScheduleZBVZeroBubble(stages, n_microbatches, loss_fn=loss_fn, scale_grads=False)
    raise ValueError(f"unknown pipeline schedule {schedule!r}; expected one of {SCHEDULES}")
