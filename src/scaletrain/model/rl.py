"""Reinforcement learning with verifiable rewards (issue 50): GRPO, Dr. GRPO and DAPO, the math alone.

Plain torch, no parallelism, no config. What goes in is what a rollout and a forward pass give:
per-token log-probabilities of the completions (B, T) under the policy being trained, under the policy
that sampled them ("old", the same numbers detached when there is one update per rollout) and under a
reference model, a completion mask (B, T: 1 on completion tokens, 0 on padding), and one scalar reward
per completion, the G completions of a prompt on consecutive rows.

    advantages   GRPO: (r - mean of the group) / (std of the group + eps); Dr. GRPO: r - mean, no division
    surrogate    per token, -min(ρA, clip(ρ, 1 - eps_low, 1 + eps_high)A), ρ = exp(logp - old logp);
                 eps_high > eps_low is DAPO's clip-higher
    KL           + beta x an estimate of KL(policy || reference) per token: k1 = logp - ref,
                 k3 = exp(ref - logp) - (ref - logp) - 1 (Schulman's unbiased, non-negative estimator)
    aggregation  token: the mean over the global batch's completion tokens (DAPO's token-level loss);
                 sequence: each sequence's token mean, then the mean over sequences (GRPO's paper);
                 constant: the sum over tokens / (sequences x maximum completion length) (Dr. GRPO)

The formulas are TRL 1.16's GRPOTrainer (loss_type "dapo" is our token, "grpo" sequence, "dr_grpo"
constant; tests/objectives/test_rl_loss.py holds them to it, loss and gradients).

The reduction contract is scaletrain.model.preference's: a loss comes back as a `Mean`, a sum over this
micro-batch and the count that sum is divided by in the end (tokens, sequences, or sequences x maximum
length). Add the Means of every micro-batch and rank, then divide: the value is the whole global batch's
in one piece, however it was split and however long its completions. A micro-batch's own mean divided
by the number of micro-batches is not (the bug of verl #593 and TRL #3021 with uneven lengths).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from scaletrain.model.preference import Mean, mean_of
from scaletrain.vocab import ADVANTAGE_SCALINGS, KL_ESTIMATORS, RL_AGGREGATIONS

# --------------------------------------------------------------------------------------------
# Advantages and the groups a batch keeps


def _groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """(B,) rewards as (B / G, G), refusing a batch that is not whole groups."""
    if rewards.dim() != 1 or group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)} are not whole groups of {group_size} completions")
    return rewards.view(-1, group_size)


def group_advantages(rewards: torch.Tensor, group_size: int, *, scaling: str = "group",
                     eps: float = 1e-4) -> torch.Tensor:
    """(B,) advantages of (B,) rewards, G = group_size completions of one prompt on consecutive rows.

    scaling "group" (GRPO): (r - mean_g) / (std_g + eps), std with Bessel's correction as TRL (a group of
    equal rewards gets 0, not a division by zero); "none" (Dr. GRPO): r - mean_g, whose scale is the reward's.
    Each group is normalised by itself alone, whatever else sits in the batch or on the rank."""
    if scaling not in ADVANTAGE_SCALINGS:
        raise ValueError(f"unknown advantage scaling {scaling!r}; one of {ADVANTAGE_SCALINGS}")
    if scaling == "group" and group_size < 2:
        raise ValueError(f"GRPO's advantages divide by a group's std: group_size={group_size} needs to be 2 or more")
    grouped = _groups(rewards.float(), group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if scaling == "group":
        centred = centred / (grouped.std(dim=1, keepdim=True) + eps)
    return centred.flatten()


def informative_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """DAPO's dynamic sampling: a (B,) mask, True on the rows of groups whose rewards are not all equal.

    A group whose completions all scored alike has advantages of 0 and teaches nothing; DAPO drops it and
    samples more prompts until the batch is full (the caller's loop: rows[mask])."""
    grouped = _groups(rewards, group_size)
    varied = (grouped != grouped[:, :1]).any(dim=1)
    return varied.repeat_interleave(group_size)


def overlong_penalty(lengths: torch.Tensor | Sequence[int], max_length: int, cache: int) -> torch.Tensor:
    """DAPO's soft overlong punishment (Eq. 13), a reward added to the task's: 0 up to max_length - cache
    tokens, then falling linearly to -1 at max_length, -1 beyond (a completion cut off by the limit)."""
    if cache < 0 or cache > max_length:
        raise ValueError(f"overlong cache={cache} must lie in [0, max_length={max_length}]")
    lengths = torch.as_tensor(lengths, dtype=torch.float32)
    free = max_length - cache
    ramp = (free - lengths) / max(cache, 1)
    return torch.where(lengths <= free, torch.zeros_like(lengths), torch.where(lengths <= max_length, ramp, -1.0))


# --------------------------------------------------------------------------------------------
# Per-token terms


def per_token_kl(logps: torch.Tensor, ref_logps: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """An estimate, per sampled token, of KL(policy || reference): k1 = log π/π_ref (unbiased, can be
    negative); k3 = π_ref/π - log(π_ref/π) - 1 (unbiased, never negative, lower variance)."""
    if estimator == "k1":
        return logps - ref_logps
    if estimator == "k3":
        log_ratio = ref_logps - logps
        return torch.exp(log_ratio) - log_ratio - 1
    raise ValueError(f"unknown KL estimator {estimator!r}; one of {KL_ESTIMATORS}")


def clipped_surrogate(logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor,
                      eps_low: float = 0.2, eps_high: float = 0.2) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped surrogate per token, as a loss: -min(ρA, clip(ρ, 1 - eps_low, 1 + eps_high)A).

    advantages: (B,) one per sequence, or (B, T). Returns the (B, T) losses and the tokens whose ratio
    the clip holds back (low: ρ < 1 - eps_low with A < 0; high: ρ > 1 + eps_high with A > 0)."""
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    ratio = torch.exp(logps - old_logps)
    clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high)
    losses = -torch.min(ratio * advantages, clipped * advantages)
    low = (ratio < 1 - eps_low) & (advantages < 0)
    high = (ratio > 1 + eps_high) & (advantages > 0)
    return losses, {"low": low.detach(), "high": high.detach()}


# --------------------------------------------------------------------------------------------
# Aggregation and the loss


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, mode: str,
              max_completion_length: int | None = None, row_tokens: torch.Tensor | None = None) -> Mean:
    """This micro-batch's share of the loss under an aggregation mode, as a sum and its final divisor.
    `row_tokens` (B,): each sequence's completion tokens in all, where this micro-batch holds only part of
    each (a context-parallel chunk): the sequence mode divides each part by the whole's count."""
    per_token = per_token * mask
    rows = torch.tensor(float(mask.shape[0]), device=per_token.device)
    if mode == "token":
        return Mean(per_token.sum(), mask.sum().to(per_token.dtype))
    if mode == "sequence":
        counts = mask.sum(-1) if row_tokens is None else row_tokens.to(per_token.dtype)
        return Mean((per_token.sum(-1) / counts.clamp(min=1)).sum(), rows)
    if mode == "constant":
        longest = int(mask.sum(-1).max()) if mask.numel() else 0
        if max_completion_length is None or max_completion_length < longest:
            raise ValueError(f"the constant aggregation needs max_completion_length >= the longest completion, "
                             f"{longest} tokens, got {max_completion_length}")
        return Mean(per_token.sum(), rows * max_completion_length)
    raise ValueError(f"unknown loss aggregation {mode!r}; one of {RL_AGGREGATIONS}")


@dataclass
class RLLoss:
    """One micro-batch's share of the loss and of its metrics (detached), each a sum and its count."""

    loss: Mean
    metrics: dict[str, Mean]

    def __add__(self, other: RLLoss) -> RLLoss:
        return RLLoss(self.loss + other.loss, {k: v + other.metrics[k] for k, v in self.metrics.items()})

    def value(self) -> torch.Tensor:
        return self.loss.value()


def _token_mean(values: torch.Tensor, mask: torch.Tensor) -> Mean:
    values = values.detach().to(mask.dtype)
    return Mean((values * mask).sum(), mask.sum())


def rl_loss(logps: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
            old_logps: torch.Tensor | None = None, ref_logps: torch.Tensor | None = None, beta: float = 0.0,
            kl_estimator: str = "k3", eps_low: float = 0.2, eps_high: float = 0.2, aggregation: str = "token",
            max_completion_length: int | None = None, weights: torch.Tensor | None = None,
            row_tokens: torch.Tensor | None = None) -> RLLoss:
    """The policy-gradient loss of one micro-batch: the clipped surrogate plus beta x the KL per token,
    aggregated (see the module's docstring). logps, old_logps, ref_logps, mask: (B, T); advantages (B,).

    old_logps None: the rollout's own policy (one update per rollout), logps detached, so ρ = 1 and the
    gradient is A ∇logπ. beta > 0 needs ref_logps. `weights` (B, T) or (B, 1): truncated importance weights of
    the surrogate (the trainer's policy over the sampler's, capped; see `importance_weights`). `row_tokens`:
    see `aggregate`. Metrics, each over the completion tokens: the clip fractions and, with a reference, the KL."""
    mask = mask.to(logps.dtype)
    old_logps = logps.detach() if old_logps is None else old_logps
    losses, clips = clipped_surrogate(logps, old_logps, advantages, eps_low, eps_high)
    if weights is not None:
        losses = losses * weights
    metrics = {"clip_ratio/low": _token_mean(clips["low"], mask), "clip_ratio/high": _token_mean(clips["high"], mask),
               "clip_ratio/region": _token_mean(clips["low"] | clips["high"], mask)}
    if beta != 0.0 or ref_logps is not None:
        if ref_logps is None:
            raise ValueError(f"beta={beta} weighs a KL to the reference: pass ref_logps")
        kl = per_token_kl(logps, ref_logps, kl_estimator)
        losses = losses + beta * kl
        metrics["kl"] = _token_mean(kl, mask)
    metrics["advantage"] = mean_of(advantages.detach().float())
    return RLLoss(aggregate(losses, mask, aggregation, max_completion_length, row_tokens), metrics)


def importance_weights(trainer_logps: torch.Tensor, rollout_logps: torch.Tensor, mask: torch.Tensor,
                       level: str, cap: float) -> torch.Tensor:
    """Truncated importance sampling (TIS) of completions sampled by another engine (or another precision)
    than the one trained: min(π_trainer / π_rollout, cap) per token, or per sequence from the sum of its
    tokens' log-ratios (a (B, 1) weight), detached (a sequence split over context-parallel ranks: the caller
    weighs with the sum over its parts)."""
    log_ratio = (trainer_logps - rollout_logps).detach() * mask
    if level == "token":
        return torch.exp(log_ratio).clamp(max=cap)
    if level == "sequence":
        return torch.exp(log_ratio.sum(-1, keepdim=True)).clamp(max=cap)
    raise ValueError(f"unknown importance-sampling level {level!r}; token or sequence")
