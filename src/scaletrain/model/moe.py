"""A mixture-of-experts feed-forward layer, in plain PyTorch (no parallelism inside).

Each token's router scores pick `top_k` of `experts` MLPs; the token's output is the sum of
their outputs weighted by the scores (plus shared experts every token passes through). The
layer is dropless by default: tokens are grouped by expert, and one grouped matmul
(`torch._grouped_mm`) runs every expert over its group, whatever its size.

Load balancing, each optional:

* the auxiliary-loss-free expert bias (DeepSeek-V3): a per-expert bias added to the scores when
  choosing the experts (never when weighting them). After each optimizer step the bias moves by
  `bias_rate` towards an even load, from the token counts of the whole step: every micro-batch,
  every data-parallel rank (the step's hook reduces them), so any layout moves it alike.
* the Switch load-balancing loss (Fedus et al. 2021) and the router z-loss (Zoph et al. 2022).
  Both are kept as sums over tokens (the balance loss per sequence), so they add up over
  micro-batches and ranks like the token loss; their gradients join backward through
  `_AddLossGradient` with the loss's own factor (`loss_factor`, set by the step's hook).

What a layout changes is `run_experts`, the step from tokens grouped by expert to the experts'
outputs in the same order: expert parallelism replaces it on the instance with one that sends
each group to the rank holding its expert and brings the outputs back; and `sequence_counts`,
which context and sequence parallelism replace so that the Switch loss of a rank's part of a
sequence uses the whole sequence's counts (its sum over the ranks is then one process's).
"""

from __future__ import annotations

from fractions import Fraction

import torch
import torch.nn.functional as F
from torch import nn

from scaletrain.model.config import ModelConfig
from scaletrain.model.mlp import MLP, glu_of

# counters each layer keeps over an optimizer step (sums over micro-batches; the step's hook
# reduces them over ranks and clears them): tokens per expert, then the scalars below
STAT_NAMES = ("tokens", "dropped", "aux_loss", "z_loss")


def _aligned(width: int, t: torch.Tensor) -> bool:
    """Whether rows of `width` elements of `t`'s dtype are a multiple of 16 bytes, as
    `torch._grouped_mm` requires of its operands' strides."""
    return width * t.element_size() % 16 == 0


def _grouped(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, counts: list[int] | None) -> torch.Tensor:
    """x (tokens, in) grouped by expert, w (experts, out, in) -> (tokens, out): each group times
    its expert's matrix. One grouped matmul where it takes the shapes; a loop over experts otherwise."""
    wt = w.transpose(-2, -1)
    # x (tokens, in) and the transposed view of w (strides in and 1) need `in` aligned, the output `out`
    if counts is None and _aligned(x.shape[-1], x) and _aligned(w.shape[1], w):
        y = torch._grouped_mm(x, wt, offs=offsets)
        if y.requires_grad:  # its backward refuses a broadcast (stride-0) gradient; an empty one (no token)
            # counts as contiguous whatever its strides: a copy of nothing, with the strides of its shape
            y.register_hook(lambda g: g.contiguous() if g.numel() else g.clone(memory_format=torch.contiguous_format))
        return y
    counts = counts if counts is not None else torch.diff(offsets, prepend=offsets.new_zeros(1)).tolist()
    # (no token at all, an expert-parallel rank's lot at times: every part is empty, the result (0, out))
    return torch.cat([part @ wt[e] for e, part in enumerate(x.split(counts))])


@torch.compiler.disable
def _grouped_eager(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, counts: list[int] | None) -> torch.Tensor:
    """`_grouped` outside torch.compile's graph: the grouped matmul's shape function (what
    compile traces with) takes bf16 alone, while eager runs it in fp32 and fp16 too."""
    return _grouped(x, w, offsets, counts)


def expert_mlp(x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor | None,
               loop: bool = False, *, biases: tuple = (None, None, None), glu=None) -> torch.Tensor:
    """The experts' MLPs over tokens grouped by expert: x (tokens, dim), counts (experts,) the
    size of each group; w1, w3 (experts, hidden, dim), w2 (experts, dim, hidden), and `biases`
    (b1, b2, b3) of (experts, out) each or None. Gated when w3 is given (`glu`(gate, up), SwiGLU
    if None), GELU otherwise. `loop`: a per-expert loop instead of the grouped matmul (the
    reference the benchmark compares against)."""
    offsets = counts.cumsum(0).to(torch.int32)
    split = counts.tolist() if loop else None
    if torch.is_autocast_enabled(x.device.type):  # a grouped matmul is not on autocast's lists
        dtype = torch.get_autocast_dtype(x.device.type)
        x, w1, w2, w3 = (t.to(dtype) if t is not None else None for t in (x, w1, w2, w3))
        biases = tuple(b.to(dtype) if b is not None else None for b in biases)
    grouped = _grouped_eager if torch.compiler.is_compiling() and x.dtype != torch.bfloat16 else _grouped
    expert = torch.arange(len(counts), device=x.device).repeat_interleave(counts) if any(
        b is not None for b in biases) else None  # each row's expert, for its bias

    def linear(t: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        y = grouped(t, w, offsets, split)
        return y if b is None else y + b[expert]

    h = linear(x, w1, biases[0])
    if w3 is not None:
        up = linear(x, w3, biases[2])
        h = glu(h, up) if glu is not None else F.silu(h) * up
    else:
        h = F.gelu(h, approximate="tanh")
    return linear(h, w2, biases[1])


class _AddLossGradient(torch.autograd.Function):
    """Returns `out` unchanged; in backward, gives `loss` the gradient `factor` (d total / d loss),
    so a loss computed inside a layer joins backward without travelling to the loss function
    (through pipeline stages, activation checkpointing, compile)."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, loss: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        return grad_out, torch.full((), ctx.factor, device=grad_out.device), None


class MoE(nn.Module):
    """Router, routed experts (w1, w2, w3 stacked over experts) and optional shared experts."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_experts, self.top_k = cfg.moe_experts, cfg.moe_top_k
        self.score, self.renorm, self.route_scale = cfg.moe_score, cfg.moe_renorm, cfg.moe_route_scale
        self.groups, self.topk_groups = cfg.moe_groups, cfg.moe_topk_groups
        self.scale_input = cfg.moe_scale_input  # Llama 4: the weight scales the expert's input, not its output
        self.capacity_factor = cfg.moe_capacity_factor
        # the factor as the decimal it was written as (1.1 = 11/10), so that the capacity is computed in
        # integers: 1.1 over an even share of 10 keeps 11 (in floats 11.000000000000002, and 12 were kept)
        self.capacity_ratio = Fraction(str(cfg.moe_capacity_factor)).as_integer_ratio()
        self.aux_coef, self.z_coef = cfg.moe_aux_loss, cfg.moe_z_loss
        E, d, h = cfg.moe_experts, cfg.dim, cfg.expert_hidden
        self.router = nn.Linear(d, E, bias=cfg.moe_bias)
        self.w1 = nn.Parameter(torch.empty(E, h, d))
        self.w2 = nn.Parameter(torch.empty(E, d, h))
        self.w3 = nn.Parameter(torch.empty(E, h, d)) if cfg.gated else None
        # gpt-oss: a bias per expert on each matrix's output (b1 with w1, b2 with w2, b3 with w3)
        self.b1 = nn.Parameter(torch.empty(E, h)) if cfg.moe_bias else None
        self.b2 = nn.Parameter(torch.empty(E, d)) if cfg.moe_bias else None
        self.b3 = nn.Parameter(torch.empty(E, h)) if cfg.moe_bias and cfg.gated else None
        self.glu = glu_of(cfg)
        self.shared = MLP(cfg, hidden=cfg.shared_hidden) if cfg.moe_shared_experts else None
        # Qwen3-Next: the shared experts' output scaled by sigmoid(shared_gate(token)), one number a token
        self.shared_gate = nn.Linear(d, 1, bias=False) if cfg.moe_shared_gate else None
        # the routing bias is state (saved, resumed); the step's counters are not
        self.register_buffer("expert_bias", torch.zeros(E), persistent=True)
        self.register_buffer("stats", torch.zeros(E + len(STAT_NAMES) - 1), persistent=False)
        self.loss_factor = 1.0  # d total loss / d (sum of token losses): the step's hook sets it

    def reset_state(self) -> None:
        """Zero the routing bias and the counters (after `to_empty` from the meta device)."""
        with torch.no_grad():
            self.expert_bias.zero_()
            self.stats.zero_()

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (tokens, dim) -> (router logits (tokens, experts) fp32, chosen experts (tokens, top_k),
        their weights (tokens, top_k) fp32). The router runs in fp32 whatever the precision: a
        bf16 score tie decides an expert."""
        with torch.autocast(x.device.type, enabled=False):  # autocast would run the matmul in bf16
            bias = self.router.bias.float() if self.router.bias is not None else None
            logits = F.linear(x.float(), self.router.weight.float(), bias)
        scores = logits.softmax(-1) if self.score == "softmax" else logits.sigmoid()
        # the bias steers the choice only; the weights are the scores themselves
        biased = scores.detach() + self.expert_bias
        if self.groups:
            biased = self.open_groups(biased)
        chosen = torch.topk(biased, self.top_k, dim=-1).indices
        weights = scores.gather(-1, chosen)
        if self.renorm:
            weights = weights / weights.sum(-1, keepdim=True)
        return logits, chosen, weights * self.route_scale

    def open_groups(self, biased: torch.Tensor) -> torch.Tensor:
        """Group-limited routing (DeepSeek-V3): biased scores (tokens, experts) with every expert
        outside the token's best topk_groups groups set to -inf. A group (of consecutive experts)
        scores the sum of its two best biased scores."""
        T, E = biased.shape
        grouped = biased.view(T, self.groups, E // self.groups)
        group_score = grouped.topk(2, dim=-1).values.sum(-1)  # (tokens, groups)
        best = group_score.topk(self.topk_groups, dim=-1).indices
        open_ = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, best, True)
        return grouped.masked_fill(~open_.unsqueeze(-1), float("-inf")).view(T, E)

    def run_experts(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Tokens grouped by expert (counts: the size of each expert's group) -> their outputs in the
        same order. Expert parallelism replaces this method on the instance."""
        return expert_mlp(x, counts, self.w1, self.w2, self.w3, biases=(self.b1, self.b2, self.b3), glu=self.glu)

    def sequence_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """counts (sequences, experts): this process's tokens' choices of each expert, per
        sequence -> those of the whole sequences (the Switch loss's share). Context and sequence
        parallelism, whose ranks hold parts of each sequence, replace this method on the
        instance with a sum over their ranks."""
        return counts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        flat = x.reshape(-1, D)
        logits, chosen, weights = self.route(flat)
        slots = chosen.flatten()  # token i's k-th choice at i * top_k + k
        order = slots.argsort(stable=True)  # slots grouped by expert, tokens in order within each
        counts = torch.bincount(slots, minlength=self.num_experts)
        routed = counts
        if self.capacity_factor:  # each expert keeps its first `capacity` tokens, drops the rest
            num, den = self.capacity_ratio  # ceil(factor * slots / experts), exactly
            capacity = -(-num * len(slots) // (den * self.num_experts))
            starts = counts.cumsum(0) - counts
            rank_in_expert = torch.arange(len(slots), device=x.device) - starts.repeat_interleave(counts)
            order = order[rank_in_expert < capacity]
            counts = counts.clamp(max=capacity)
        token = order // self.top_k
        weight = weights.flatten()[order].unsqueeze(-1)  # (routed slots, 1) fp32
        if self.scale_input:  # Llama 4: each expert sees its tokens times their weights
            y = self.run_experts((flat[token] * weight).to(flat.dtype), counts)
        else:
            y = self.run_experts(flat[token], counts)
            y = y * weight.to(y.dtype)
        out = torch.zeros(flat.shape, dtype=y.dtype, device=x.device).index_add_(0, token, y)
        if self.shared is not None:
            shared = self.shared(flat)
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(flat)) * shared
            out = out + shared
        if self.training and torch.is_grad_enabled():
            out = self._balance(out, logits, chosen.view(B, -1), routed, routed.sum() - counts.sum())
        return out.view(B, T, D).to(x.dtype)

    def _balance(self, out: torch.Tensor, logits: torch.Tensor, chosen: torch.Tensor, routed: torch.Tensor,
                 dropped: torch.Tensor) -> torch.Tensor:
        """Count the step's load and add the auxiliary losses' gradients (training forward only).
        A forward recomputed in backward (activation checkpointing) counts nothing twice: its
        losses' gradients are those of the forward it repeats. `chosen`: (sequences, T * top_k)."""
        B, E = chosen.shape[0], self.num_experts
        T = logits.shape[0] // B
        recomputed = torch._C._current_graph_task_id() != -1
        loss = logits.new_zeros(())
        z = aux = None
        if self.z_coef:  # sum over tokens of logsumexp(logits)^2
            z = logits.logsumexp(-1).square().sum()
            loss = loss + self.z_coef * z
        if self.aux_coef:
            # per sequence: E * sum_e (share of its choices routed to e) * (mean score of e), times its
            # length T. The share is a constant in backward, so this is E / (T k) * sum_e c_e * sum_t p_te:
            # linear in the tokens' scores once c_e (the sequence's counts) and T are those of the
            # whole sequence, which `sequence_counts` gives when a rank holds part of it
            counts = torch.zeros(B, E, device=logits.device).scatter_add_(
                1, chosen, torch.ones(chosen.shape, device=logits.device))
            counts = self.sequence_counts(counts)
            choices = counts.sum(-1, keepdim=True)  # T * top_k of the whole sequence
            probs = logits.softmax(-1).view(B, T, E)
            aux = E * (counts / choices * probs.sum(1)).sum()
            loss = loss + self.aux_coef * aux
        if not recomputed:
            with torch.no_grad():
                self.stats[:E] += routed
                self.stats[E] += dropped
                if aux is not None:
                    self.stats[E + 1] += aux.detach()
                if z is not None:
                    self.stats[E + 2] += z.detach()
        if z is None and aux is None:
            return out
        return _AddLossGradient.apply(out, loss, self.loss_factor)
