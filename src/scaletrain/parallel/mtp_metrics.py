"""Multi-token prediction's metrics (model/mtp.py): each depth's mean cross-entropy over the positions it
predicts, summed over the data-parallel ranks that saw different tokens, for the logged step.

What it costs: one all-reduce of 2 x depth numbers on a logged step; nothing on the others."""

from __future__ import annotations

import torch
import torch.distributed as dist

from scaletrain.hooks import StepHook
from scaletrain.model.mtp import MTPLoss


class MTPMetrics(StepHook):
    """`mtp_loss/K` in the metrics row: depth K's summed losses over its counted positions, this step's."""

    phase = "multi-token prediction's metrics all-reduce"

    def __init__(self, loss: MTPLoss, groups: list):
        """`groups`: the process groups whose ranks see different tokens (data parallel)."""
        self.loss, self.groups = loss, groups

    def begin_step(self, loss_factor: float) -> None:
        self.loss.take()  # what the steps since the last row summed is not this step's

    def metrics(self) -> dict[str, float]:
        taken = self.loss.take()
        if taken is None:
            return {}
        both = torch.cat(taken)
        for group in self.groups:
            dist.all_reduce(both, group=group)
        sums, counts = both.double().cpu().chunk(2)
        return {f"mtp_loss/{k}": float(s / c) if c else float("nan")
                for k, (s, c) in enumerate(zip(sums, counts, strict=True), start=1)}
