"""Preference optimization losses (issue 49): DPO and its family, on per-sequence log-probabilities.

Plain torch, no parallelism. Each loss takes what a forward pass over prompt + completion gives
per sequence, the sum of the completion tokens' log-probabilities and how many tokens that sum
covers, never the logits: a tensor-parallel run whose vocabulary is split over ranks reduces its
per-token log-probabilities first and hands over the same sums (`masked_sums`).

The formulas and default coefficients are TRL 1.16's (DPOTrainer, the experimental CPOTrainer and
ORPOTrainer, KTOTrainer); tests/model/test_preference.py holds them to TRL's trainers, loss and
gradients.

The reduction contract. A loss comes back as sums, not means (`Mean`: a sum over this micro-batch's
pairs and how many pairs it covers). The loss of a global batch split over micro-batches and ranks is
every micro-batch's sum added up, divided by the pairs of the whole global batch:

    loss = sum over micro-batches and ranks of loss.total / sum of loss.count

so that uneven micro-batches weigh each pair once, as the whole batch in one piece would. ORPO adds
a second term with its own divisor, the tokens of its NLL (`PreferenceLoss.nll`). A caller that
divides each micro-batch's sum by the global count before backward gets the same gradients.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from scaletrain.vocab import PREFERENCE_LOSSES as LOSSES  # noqa: F401
from scaletrain.vocab import REFERENCE_FREE  # noqa: F401

# --------------------------------------------------------------------------------------------
# Log-probabilities of the completions


def token_logps(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, T) log-probability in fp32 of each target under its logits, 0 where `mask` is 0.

    logits: (B, T, V), already aligned with targets (position t predicts targets[:, t]);
    a masked target may hold anything (a pad, -100)."""
    targets = targets.masked_fill(mask == 0, 0)
    # cross_entropy is -log_softmax gathered at the target, without keeping the (B, T, V) log-softmax
    nll = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="none")
    return -nll.view(targets.shape) * mask


def masked_sums(per_token_logps: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sequence: the sum of the log-probabilities where `mask` is 1 and how many there are.

    per_token_logps: (B, T) from anywhere (token_logps, or the vocabulary shards' reduction)."""
    mask = mask.to(per_token_logps.dtype)
    return (per_token_logps * mask).sum(-1), mask.sum(-1)


def sequence_logps(logits: torch.Tensor, targets: torch.Tensor,
                   mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sequence, the summed log-probability of the completion tokens (mask = 1; the prompt and
    padding are 0) and their count, the count for the losses that normalise by length."""
    return masked_sums(token_logps(logits, targets, mask), mask)


# --------------------------------------------------------------------------------------------
# The reduction contract


@dataclass
class Mean:
    """A sum over some examples and how many there were: add micro-batches' and ranks' Means, then divide."""

    total: torch.Tensor
    count: torch.Tensor

    def __add__(self, other: Mean) -> Mean:
        return Mean(self.total + other.total, self.count + other.count)

    def value(self) -> torch.Tensor:
        return self.total / self.count.clamp(min=1)


def mean_of(values: torch.Tensor) -> Mean:
    return Mean(values.sum(), torch.tensor(float(values.numel()), device=values.device))


@dataclass
class PreferenceLoss:
    """One micro-batch's share of the loss: `loss` over pairs (or, for KTO, examples); ORPO's NLL over
    tokens; the metrics, detached, each over its own examples."""

    loss: Mean
    metrics: dict[str, Mean]
    nll: Mean | None = None

    def __add__(self, other: PreferenceLoss) -> PreferenceLoss:
        nll = None if self.nll is None else self.nll + other.nll
        return PreferenceLoss(self.loss + other.loss, {k: v + other.metrics[k] for k, v in self.metrics.items()}, nll)

    def value(self) -> torch.Tensor:
        """The loss of the examples added so far, each pair weighed once."""
        return self.loss.value() + (0 if self.nll is None else self.nll.value())


def combined(parts: Iterable[PreferenceLoss]) -> PreferenceLoss:
    """Micro-batches' losses added up: `.value()` of this is the loss of the batch they make together."""
    parts = iter(parts)
    total = next(parts)
    for part in parts:
        total = total + part
    return total


def pair_metrics(chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor) -> dict[str, Mean]:
    chosen_rewards, rejected_rewards = chosen_rewards.detach(), rejected_rewards.detach()
    return {"rewards/chosen": mean_of(chosen_rewards), "rewards/rejected": mean_of(rejected_rewards),
            "rewards/margins": mean_of(chosen_rewards - rejected_rewards),
            "rewards/accuracies": mean_of((chosen_rewards > rejected_rewards).float())}


# --------------------------------------------------------------------------------------------
# The losses. Arguments: the policy's summed log-probabilities of the chosen and rejected
# completions (B,), the reference model's (None: reference-free, as zeros), and the completions'
# token counts (B,) where a loss normalises by length.


def _logratios(chosen, rejected, ref_chosen, ref_rejected):
    if ref_chosen is None:
        return chosen, rejected
    return chosen - ref_chosen, rejected - ref_rejected


def _conservative_sigmoid(logits: torch.Tensor, label_smoothing: float) -> torch.Tensor:
    """-log σ(logits) when the label is right, weighed 1 - ε, plus -log σ(-logits), weighed ε (cDPO)."""
    return -(1 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)


def dpo_loss(chosen, rejected, ref_chosen=None, ref_rejected=None, *, beta: float = 0.1,
             label_smoothing: float = 0.0) -> PreferenceLoss:
    """DPO (Rafailov et al. 2023): -log σ(β Δ), Δ the chosen's log-ratio to the reference less the rejected's.

    With label_smoothing ε > 0 it is conservative DPO (cDPO: ε is the chance a label is flipped, the loss
    the expectation over it), as TRL's DPOTrainer computed it before 1.0 and its CPOTrainer still does;
    TRL 1.16's DPOTrainer reads label_smoothing only for robust, EXO and AOT."""
    chosen_lr, rejected_lr = _logratios(chosen, rejected, ref_chosen, ref_rejected)
    losses = _conservative_sigmoid(beta * (chosen_lr - rejected_lr), label_smoothing)
    return PreferenceLoss(mean_of(losses), pair_metrics(beta * chosen_lr, beta * rejected_lr))


def robust_dpo_loss(chosen, rejected, ref_chosen=None, ref_rejected=None, *, beta: float = 0.1,
                    label_smoothing: float = 0.0) -> PreferenceLoss:
    """Robust DPO (Chowdhury et al. 2024): an unbiased loss under labels flipped with chance ε < 1/2,
    [(1 - ε)(-log σ(βΔ)) - ε(-log σ(-βΔ))] / (1 - 2ε); ε = 0 is DPO."""
    chosen_lr, rejected_lr = _logratios(chosen, rejected, ref_chosen, ref_rejected)
    z = beta * (chosen_lr - rejected_lr)
    losses = (-(1 - label_smoothing) * F.logsigmoid(z) + label_smoothing * F.logsigmoid(-z)) / (1 - 2 * label_smoothing)
    return PreferenceLoss(mean_of(losses), pair_metrics(beta * chosen_lr, beta * rejected_lr))


def hinge_loss(chosen, rejected, ref_chosen=None, ref_rejected=None, *, beta: float = 0.1) -> PreferenceLoss:
    """SLiC's hinge (Zhao et al. 2023): max(0, 1 - βΔ); zero once the margin Δ reaches 1/β."""
    chosen_lr, rejected_lr = _logratios(chosen, rejected, ref_chosen, ref_rejected)
    losses = torch.relu(1 - beta * (chosen_lr - rejected_lr))
    return PreferenceLoss(mean_of(losses), pair_metrics(beta * chosen_lr, beta * rejected_lr))


def ipo_loss(chosen, rejected, ref_chosen, ref_rejected, chosen_tokens, rejected_tokens, *,
             beta: float = 0.1) -> PreferenceLoss:
    """IPO (Azar et al. 2023, Eq. 17): (Δ - 1/(2τ))², τ = beta. As in TRL, each log-ratio is first divided by
    its completion's token count, so that the square does not grow with length (a normalisation the
    IPO authors confirmed to TRL)."""
    chosen_lr, rejected_lr = _logratios(chosen, rejected, ref_chosen, ref_rejected)
    delta = chosen_lr / chosen_tokens.clamp(min=1) - rejected_lr / rejected_tokens.clamp(min=1)
    losses = (delta - 1 / (2 * beta)) ** 2
    return PreferenceLoss(mean_of(losses), pair_metrics(beta * chosen_lr, beta * rejected_lr))


def simpo_loss(chosen, rejected, chosen_tokens, rejected_tokens, *, beta: float = 0.1, gamma: float = 0.5,
               label_smoothing: float = 0.0) -> PreferenceLoss:
    """SimPO (Meng et al. 2024): reference-free, the reward β × the mean token log-probability, and a
    target margin γ: -log σ(β(mean_c - mean_r) - γ). TRL: CPOTrainer, loss_type="simpo", cpo_alpha=0
    (simpo_gamma defaults to 0.5, beta to 0.1; the SimPO paper tunes β ≈ 2-2.5)."""
    chosen_mean, rejected_mean = chosen / chosen_tokens.clamp(min=1), rejected / rejected_tokens.clamp(min=1)
    losses = _conservative_sigmoid(beta * (chosen_mean - rejected_mean) - gamma, label_smoothing)
    return PreferenceLoss(mean_of(losses), pair_metrics(beta * chosen_mean, beta * rejected_mean))


def _log1m_exp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - e^x) for x < 0, without cancellation either side of -log 2 (Mächler 2012)."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def orpo_loss(chosen, rejected, chosen_tokens, rejected_tokens, nll_sum, nll_tokens, *,
              beta: float = 0.1) -> PreferenceLoss:
    """ORPO (Hong et al. 2024): the NLL of the chosen plus λ (= beta, TRL's name) × -log σ(log odds ratio),
    where odds(y) = p / (1 - p) of the mean token probability p = exp(mean log-prob) of each completion.

    nll_sum, nll_tokens: the chosen sequences' summed token NLL and its token count, a term divided by the
    global batch's tokens (PreferenceLoss.nll). TRL's ORPOTrainer counts the prompt's tokens in it too
    (every attended token but the first), a token mean over the batch; pass the same to match it."""
    chosen_mean = (chosen / chosen_tokens.clamp(min=1)).float()
    rejected_mean = (rejected / rejected_tokens.clamp(min=1)).float()
    log_odds = (chosen_mean - rejected_mean) - (_log1m_exp(chosen_mean) - _log1m_exp(rejected_mean))
    losses = -beta * F.logsigmoid(log_odds)
    metrics = pair_metrics(beta * chosen_mean, beta * rejected_mean)
    metrics["log_odds_ratio"] = mean_of(F.logsigmoid(log_odds).detach())
    metrics["log_odds_chosen"] = mean_of(log_odds.detach())
    nll = Mean(nll_sum, torch.as_tensor(nll_tokens, dtype=torch.float32, device=nll_sum.device))
    return PreferenceLoss(mean_of(losses), metrics, nll)


def kl_completions(completions: list) -> list:
    """KTO's mismatched pairs: the completions rotated by one, (x_1, y_n), (x_2, y_1), ..., (x_n, y_{n-1}),
    so that the set of completions of the KL estimate is the set whose rewards are taken (as TRL's KTOTrainer
    builds them, per device batch)."""
    return completions[-1:] + completions[:-1]


def kto_kl(kl_logps: torch.Tensor, ref_kl_logps: torch.Tensor) -> Mean:
    """The policy's log-ratio to the reference on the mismatched pairs, summed and counted (detached):
    add it up over micro-batches or ranks as far as the KL estimate should reach, then pass
    kl=.value().clamp(min=0) to kto_loss. (TRL averages each rank's mean, the same when ranks hold as
    many examples each.)"""
    return mean_of((kl_logps - ref_kl_logps).detach())


def kto_loss(logps, ref_logps, desirable, kl, *, beta: float = 0.1, desirable_weight: float = 1.0,
             undesirable_weight: float = 1.0) -> PreferenceLoss:
    """KTO (Ethayarajh et al. 2024, Eq. 7): unpaired examples, each desirable (label True) or not.
    A desirable one costs w_d (1 - σ(β(r - KL))), an undesirable one w_u (1 - σ(β(KL - r))), r its
    log-ratio to the reference, KL the batch's estimate (kto_kl), a constant to the gradient. The loss is
    over examples, desirable and undesirable together; the rewards are each over its own kind."""
    desirable = desirable.bool()
    logratios = logps - ref_logps
    losses = torch.where(desirable, desirable_weight * (1 - torch.sigmoid(beta * (logratios - kl))),
                         undesirable_weight * (1 - torch.sigmoid(beta * (kl - logratios))))
    rewards = beta * logratios.detach()
    return PreferenceLoss(mean_of(losses), {"rewards/chosen": mean_of(rewards[desirable]),
                                            "rewards/rejected": mean_of(rewards[~desirable])})


def preference_loss(cfg, policy: Mapping[str, torch.Tensor],
                    reference: Mapping[str, torch.Tensor] | None = None) -> PreferenceLoss:
    """The configured loss (cfg: a scaletrain.config.PreferenceConfig) of paired sums: policy and reference
    each {"chosen", "rejected"} (summed log-probabilities), policy also {"chosen_tokens", "rejected_tokens"},
    and for ORPO {"nll", "nll_tokens"}. No reference: reference-free, the log-ratios the policy's
    log-probabilities alone. KTO's examples are unpaired: call kto_loss."""
    ref = reference or {}
    c, r, rc, rr = policy["chosen"], policy["rejected"], ref.get("chosen"), ref.get("rejected")
    match cfg.loss:
        case "sigmoid":
            return dpo_loss(c, r, rc, rr, beta=cfg.beta, label_smoothing=cfg.label_smoothing)
        case "robust":
            return robust_dpo_loss(c, r, rc, rr, beta=cfg.beta, label_smoothing=cfg.label_smoothing)
        case "hinge":
            return hinge_loss(c, r, rc, rr, beta=cfg.beta)
        case "ipo":
            return ipo_loss(c, r, rc, rr, policy["chosen_tokens"], policy["rejected_tokens"], beta=cfg.beta)
        case "simpo":
            return simpo_loss(c, r, policy["chosen_tokens"], policy["rejected_tokens"], beta=cfg.beta,
                              gamma=cfg.gamma, label_smoothing=cfg.label_smoothing)
        case "orpo":
            return orpo_loss(c, r, policy["chosen_tokens"], policy["rejected_tokens"], policy["nll"],
                             policy["nll_tokens"], beta=cfg.beta)
        case _:
            raise ValueError(f"preference.loss={cfg.loss} is not a paired loss (kto: call kto_loss)")
