"""The training loss: what the trainer, evaluation and the planner's traced count share."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed token losses; the caller divides by the tokens of the whole global batch."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1), reduction="sum")
