"""The mixture of experts' per-step work: the load counted over the whole step, the routing bias
moved from it, the auxiliary losses' factor, and the balance metrics.

Each MoE layer counts, during the step's forwards, the tokens routed to each expert, the
tokens dropped and its auxiliary losses (model/moe.py). After the optimizer step this hook sums
the counters over the ranks that saw different tokens: data parallel (one worker's ranks when
workers sync every few steps: each worker moves its own biases, as verify's simulation does),
context parallel, and tensor parallel under sequence parallelism (each tp rank routes its
sequence shard; without it the tp ranks route the same tokens and hold copies). So the bias
moves as it would in one process that ran the whole global batch, however the batch was cut into
micro-batches and ranks. Pipeline stages hold other layers: their counters are summed over pp
as well, for the metrics alone.

The capacity (model.moe_capacity_factor) is counted on the tokens a rank routes: under context
or sequence parallelism a rank holds part of each sequence, so scaletrain.legality refuses the pair.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from scaletrain.hooks import StepHook
from scaletrain.model.moe import STAT_NAMES, MoE
from scaletrain.model.names import canonical_name

# a layer is near collapse at this share of its ceiling (moe_experts / moe_top_k: every token on the
# same top_k experts); the note comes once it has stayed there this many optimizer steps in a row after
# the warm-up. Within the warm-up every small model's router collapses whatever the balancing: the
# router's inputs move more from one step to the next than the tokens differ, so no bias set from past
# steps can split them (docs/benchmarks.md, "The first steps")
NEAR_COLLAPSE, COLLAPSE_STEPS = 0.9, 10


def moe_layers(modules: list[nn.Module]) -> dict[str, MoE]:
    """The MoE layers of this rank's model chunks, by canonical name."""
    return {canonical_name(name): m for chunk in modules for name, m in chunk.named_modules() if isinstance(m, MoE)}


def summed_over(counts: torch.Tensor, previous, group) -> torch.Tensor:
    """A mixture of experts' `sequence_counts` where the ranks of `group` hold other tokens of
    the same sequences: the counts summed over them (counts only: nothing flows back)."""
    counts = previous(counts).detach().clone()
    dist.all_reduce(counts, group=group)
    return counts


class MoEBalance(StepHook):
    """Sums each layer's counters over `groups` after every optimizer step, moves the routing
    biases by `bias_rate` towards an even load (DeepSeek-V3's sign rule), keeps the step's
    metrics, says once (in the run's log) each layer that stays near collapse after the `warmup` (the
    optimizer steps of the learning rate's warm-up, counted from this process's start), and saves the
    biases in checkpoints.

    `names`: every MoE layer of the model, in order. Under pipelining a rank holds some of them;
    the counters of the others come as zeros, and the pipeline group (`pp_group`) is summed over
    too, so that every rank's metrics cover every layer (every pp rank has this hook, even one
    whose stages hold no MoE layer). `device`: where the counters are summed, the run's (NCCL sums
    GPU tensors only); `aux_loss`: the run's model.moe_aux_loss, which the collapse note names."""

    phase = "the mixture-of-experts load counts' all-reduce"

    def __init__(self, layers: dict[str, MoE], names: list[str], groups: list, *, experts: int, bias_rate: float,
                 top_k: int, aux_loss: float, device: torch.device | str, warmup: int = 0, pp_group=None):
        self.layers, self.names, self.experts, self.device = layers, names, experts, device
        self.groups = [g for g in (*groups, pp_group) if g is not None]
        self.bias_rate, self.top_k, self.aux_loss, self.warmup = bias_rate, top_k, aux_loss, warmup
        self.steps = 0  # optimizer steps applied since this process started
        self.last: dict[str, float] = {}
        self.window_worst = 0.0  # the worst imbalance of any step since the last metrics row
        self.near = dict.fromkeys(names, 0)  # each layer's optimizer steps in a row near collapse
        self.noted: set[str] = set()  # the layers whose collapse was noted (once each)

    @classmethod
    def for_model(cls, modules: list[nn.Module], model_cfg, groups: list, pp_group=None, *,
                  device: torch.device | str, warmup: int = 0) -> MoEBalance | None:
        """The hook of a model built from `model_cfg` (this rank's chunks `modules`), or None for a dense
        one; `warmup`: the optimizer steps of the learning rate's warm-up."""
        names = [f"layers.{i}.moe" for i in range(model_cfg.n_layers) if model_cfg.is_moe_block(i)]
        # multi-token prediction's blocks (model/mtp.py), numbered after the last
        names += [f"mtp.{j}.block.moe" for j in range(model_cfg.mtp_depth)
                  if model_cfg.is_moe_block(model_cfg.n_layers + j)]
        if not names:
            return None
        layers = moe_layers(modules)
        assert set(layers) <= set(names), f"MoE layers {sorted(layers)} outside the config's {names}"
        return cls(layers, names, groups, experts=model_cfg.moe_experts, bias_rate=model_cfg.moe_bias_rate,
                   top_k=model_cfg.moe_top_k, aux_loss=model_cfg.moe_aux_loss, warmup=warmup, pp_group=pp_group,
                   device=device)

    def begin_step(self, loss_factor: float) -> None:
        for m in self.layers.values():
            m.loss_factor = loss_factor

    def after_optimizer_step(self, applied: bool) -> bool:
        E = self.experts
        self.steps += applied
        stats = torch.zeros(len(self.names), E + len(STAT_NAMES) - 1, device=self.device)  # (layers, counters)
        for i, name in enumerate(self.names):
            if name in self.layers:
                stats[i] = self.layers[name].stats
        for g in self.groups:
            dist.all_reduce(stats, group=g)
        stats = stats.double()  # the ratios in float64: 36 / 10 in fp32 falls below 0.9 * 4, the threshold
        loads = stats[:, :E]
        for i, name in enumerate(self.names):
            if name in self.layers:
                m = self.layers[name]
                if applied and self.bias_rate:  # underloaded experts up, overloaded ones down
                    m.expert_bias += self.bias_rate * torch.sign(loads[i].mean() - loads[i])
                m.stats.zero_()
        # one copy to the host for the step's figures (a GPU would sync once, not per layer)
        ratio = torch.where(loads.sum(1) > 0, loads.max(1).values / loads.mean(1), torch.ones_like(loads[:, 0]))
        *ratios, dropped, aux, z, choices = torch.cat([ratio, stats[:, E:].sum(0), loads[0].sum()[None]]).tolist()
        imbalance = dict(zip(self.names, ratios))  # choices: tokens × top_k (each layer routes every token)
        tokens, n = choices / self.top_k, len(self.names)
        self.last = {"moe_imbalance": max(imbalance.values()),
                     **{f"moe_imbalance/{name}": v for name, v in imbalance.items()}}
        if dropped:
            self.last["moe_dropped"] = dropped / max(choices, 1.0) / n
        if aux:
            self.last["moe_aux_loss"] = aux / max(tokens, 1.0) / n
        if z:
            self.last["moe_z_loss"] = z / max(tokens, 1.0) / n
        self.window_worst = max(self.window_worst, self.last["moe_imbalance"])
        self.watch_collapse(imbalance)
        return False

    def watch_collapse(self, imbalance: dict[str, float]) -> None:
        """Count each layer's steps in a row near its ceiling (moe_experts / moe_top_k) after the warm-up,
        and note the layers that reach COLLAPSE_STEPS of them, once each, in one line."""
        ceiling = self.experts / self.top_k
        for name, value in imbalance.items():
            near = value >= NEAR_COLLAPSE * ceiling and self.steps > self.warmup
            self.near[name] = self.near[name] + 1 if near else 0
        new = [name for name in self.names if self.near[name] >= COLLAPSE_STEPS and name not in self.noted]
        if not new:
            return
        self.noted.update(new)
        layers = ", ".join(f"{name} at {imbalance[name]:.2f}" for name in new)
        self.say(
            f"MoE router collapse: {layers} (max / mean tokens per expert) for the last {COLLAPSE_STEPS} steps "
            f"after the warm-up, near the ceiling {ceiling:g} (moe_experts {self.experts} / moe_top_k {self.top_k}: "
            f"every token on the same {self.top_k} experts); raise model.moe_bias_rate (now {self.bias_rate:g}) or "
            f"model.moe_aux_loss (now {self.aux_loss:g}); a softmax router (model.moe_score) balances worse than "
            f"a sigmoid one (docs/benchmarks.md, \"The first steps\")")

    def metrics(self) -> dict[str, float]:
        """The logged step's figures, and the worst imbalance of the steps since the last row
        (`log.every` > 1 would otherwise hide the steps between rows)."""
        row = {**self.last, "moe_imbalance_window_max": self.window_worst}
        self.window_worst = 0.0
        return row

    def checkpoint_tensors(self, tensors: dict) -> dict:
        # the biases are buffers, not parameters: saved beside the weights, resharding-free (replicated)
        tensors["model"].update({f"{name}.expert_bias": m.expert_bias for name, m in self.layers.items()})
        return tensors
