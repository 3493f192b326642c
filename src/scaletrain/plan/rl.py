"""What RL adds to a step (train.objective=rl, issue 50 #8): the rollout engine's key/value cache in memory,
and in time the generation of each round's completions and the forward passes before an update.

A round samples G completions of each prompt on the training ranks (colocated), then trains rl.updates steps
on them; per step the planner charges a 1/μ share of the round's generation:

    prefill   one forward over the prompts' tokens (a third of a forward and backward's work per token)
    decode    rl.max_new_tokens forwards of one token per completion: each reads the rank's weights and the
              cache (memory-bound at small batches) or computes 2 FLOPs per active parameter a token,
              whichever is slower; under tensor parallelism two all-reduces a block (latency-bound); under
              ZeRO-3 every forward gathers every weight again (the price of sampling from sharded weights)
    old pass  rl.updates > 1 or an importance-sampling correction: one forward of the step's rows (the
              policy that sampled, as the trainer has it); the reference's forward is counted as preference
              training counts it (time_model)

The cache: keys and values of every block for every completion a rank samples at once (global_batch / dp
rows of data.seq_len positions, a windowed block's bounded by its window), in the compute dtype, split by
tensor parallelism's heads. Generation and the training step's activations are not alive together: the peak
is the larger of the two.
"""

from __future__ import annotations

from scaletrain.model.config import ModelConfig
from scaletrain.model.flops import flops_per_token
from scaletrain.model.window import block_window
from scaletrain.plan.params import dtypes_for
from scaletrain.plan.spec import Cluster, Layout, Workload
from scaletrain.vocab import PEAK_KIND

HBM_EFFICIENCY = 0.8  # as time_model's: memory-bound kernels reach this share of the bandwidth
DECODE_EFFICIENCY = 0.3  # a one-token forward's matmuls (skinny GEMMs) reach this share of the peak rate


def rows_per_rank(wl: Workload, layout: Layout) -> int:
    """Completions each data-parallel rank samples and trains on per step."""
    return max(1, wl.global_batch // layout.dp)


def kv_cache_bytes(cfg: ModelConfig, wl: Workload, layout: Layout) -> float:
    """The rollout engine's cache on one rank: K and V of every block, every completion sampled at once."""
    positions = 0
    for i in range(cfg.n_layers):
        window = block_window(cfg, i)
        positions += wl.seq_len if window is None else min(wl.seq_len, window.size)
    heads = max(1, cfg.kv_heads // layout.tp)
    return 2.0 * positions * heads * cfg.head_size * rows_per_rank(wl, layout) * dtypes_for(wl).compute


def generation_seconds(cfg: ModelConfig, wl: Workload, layout: Layout, cluster: Cluster, compute_s: float,
                       params_bytes: float, gather_s: float, tp_latency_s: float) -> float:
    """One round's sampling on a rank: prefill and decode (module docstring). `compute_s`: the step's training
    compute (forward and backward of every row); `params_bytes`: the weights a rank reads each forward;
    `gather_s`: ZeRO-3's gathers of one forward (0 otherwise); `tp_latency_s`: one tp all-reduce's latency."""
    hw = cluster.hardware
    new = wl.rl_new_tokens
    prefill = compute_s / 3.0 * max(0.0, 1.0 - new / wl.seq_len)
    rows = rows_per_rank(wl, layout)
    flops = flops_per_token(cfg, wl.seq_len) / 3.0 * rows / layout.tp  # a forward's per token, this rank's share
    peak = hw.peak_flops(PEAK_KIND[wl.precision])
    read = params_bytes + kv_cache_bytes(cfg, wl, layout) / 2  # the cache half full on average
    one = max(flops / (peak * DECODE_EFFICIENCY), read / (hw.memory_GBps * 1e9 * HBM_EFFICIENCY))
    one += gather_s + (2 * cfg.n_layers * tp_latency_s if layout.tp > 1 else 0.0)
    return prefill + new * one
