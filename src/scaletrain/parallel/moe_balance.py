"""The mixture of experts' per-step work: the load counted over the whole step, the routing bias
moved from it, the auxiliary losses' factor, and the balance metrics.

Each MoE layer counts, during the step's forwards, the tokens routed to each expert, the
tokens dropped and its auxiliary losses (model/moe.py). After the optimizer step this hook sums
the counters over the ranks that saw different tokens (data parallel and context parallel;
tensor-parallel ranks hold copies, pipeline stages hold other layers), so the bias moves as it
would in one process that ran the whole global batch, however the batch was cut into
micro-batches and ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from scaletrain.model.moe import STAT_NAMES, MoE
from scaletrain.parallel.hooks import StepHook
from scaletrain.parallel.init import canonical_name


def moe_layers(modules: list[nn.Module]) -> dict[str, MoE]:
    """The MoE layers of this rank's model chunks, by canonical name."""
    return {canonical_name(name): m for chunk in modules for name, m in chunk.named_modules() if isinstance(m, MoE)}


class MoEBalance(StepHook):
    """Sums each layer's counters over `groups` after every optimizer step, moves the routing
    biases by `bias_rate` towards an even load (DeepSeek-V3's sign rule), keeps the step's
    metrics, and saves the biases in checkpoints."""

    phase = "the mixture-of-experts load counts' all-reduce"

    def __init__(self, layers: dict[str, MoE], groups: list, bias_rate: float, top_k: int):
        self.layers, self.groups, self.bias_rate, self.top_k = layers, [g for g in groups if g is not None], \
            bias_rate, top_k
        self.last: dict[str, float] = {}

    @classmethod
    def for_model(cls, modules: list[nn.Module], groups: list, bias_rate: float, top_k: int) -> MoEBalance | None:
        layers = moe_layers(modules)
        return cls(layers, groups, bias_rate, top_k) if layers else None

    def begin_step(self, loss_factor: float) -> None:
        for m in self.layers.values():
            m.loss_factor = loss_factor

    def after_optimizer_step(self, applied: bool) -> bool:
        stats = torch.stack([m.stats for m in self.layers.values()])  # (layers, experts + counters)
        for g in self.groups:
            dist.all_reduce(stats, group=g)
        imbalance = {}
        for (name, m), s in zip(self.layers.items(), stats):
            load = s[:m.num_experts]
            if applied and self.bias_rate:  # underloaded experts up, overloaded ones down
                m.expert_bias += self.bias_rate * torch.sign(load.mean() - load)
            imbalance[name] = float(load.max() / load.mean()) if load.sum() else 1.0
            m.stats.zero_()
        totals = stats[:, -(len(STAT_NAMES) - 1):].sum(0)
        tokens = float(stats[0, :self.layers[next(iter(self.layers))].num_experts].sum()) / self.top_k
        self.last = {"moe_imbalance": max(imbalance.values()),
                     **{f"moe_imbalance/{n}": v for n, v in imbalance.items()}}
        if totals[0]:
            self.last["moe_dropped"] = float(totals[0]) / max(tokens * self.top_k, 1.0) / len(self.layers)
        if totals[1]:
            self.last["moe_aux_loss"] = float(totals[1]) / max(tokens, 1.0) / len(self.layers)
        if totals[2]:
            self.last["moe_z_loss"] = float(totals[2]) / max(tokens, 1.0) / len(self.layers)
        return False

    def metrics(self) -> dict[str, float]:
        return dict(self.last)

    def checkpoint_tensors(self, tensors: dict) -> dict:
        # the biases are buffers, not parameters: saved beside the weights, resharding-free (replicated)
        tensors["model"].update({f"{name}.expert_bias": m.expert_bias for name, m in self.layers.items()})
        return tensors
