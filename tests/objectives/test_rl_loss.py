"""RL losses (issue 50, scaletrain.model.rl): held to TRL 1.16's GRPOTrainer loss on the same per-token
log-probs (loss and gradients, fp32), known answers worked out by hand, the reduction contract over uneven
micro-batches of uneven completions, and the direction a positive advantage pushes a token."""

from __future__ import annotations

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from scaletrain.model.preference import Mean
from scaletrain.model.rl import (
    aggregate,
    clipped_surrogate,
    group_advantages,
    informative_groups,
    overlong_penalty,
    per_token_kl,
    rl_loss,
)

TOL = 1e-6
LENGTHS = [5, 1, 7, 3, 6, 2, 4]  # completion lengths, uneven; 7 completions: no even split
WIDTH, MAX_LEN = 7, 9  # the batch's padded width; the run's maximum completion length (above the width)


def batch(seed: int = 0, lengths=LENGTHS) -> dict[str, torch.Tensor]:
    """Per-token log-probs of policy, old policy and reference, near one another as after a few updates,
    with ratios both inside and outside the clip range; advantages of both signs."""
    g = torch.Generator().manual_seed(seed)
    b = len(lengths)
    mask = (torch.arange(WIDTH) < torch.tensor(lengths)[:, None]).float()
    logps = -torch.rand(b, WIDTH, generator=g) * 3
    old = logps + torch.randn(b, WIDTH, generator=g) * 0.3
    ref = logps + torch.randn(b, WIDTH, generator=g) * 0.5
    adv = torch.randn(b, generator=g)
    return {"logps": logps, "old": old, "ref": ref, "adv": adv, "mask": mask}


# ------------------------------------------------------------------------------------------
# TRL's side: GRPOTrainer._compute_loss on a stub whose forward hands back our per-token log-probs


class Accelerator:
    num_processes = 1

    def gather(self, x):
        return x

    gather_for_metrics = gather

    def reduce(self, x, reduction="sum"):
        return x


def trl_loss(b, loss_type: str, beta: float, eps_low: float, eps_high: float, logps: torch.Tensor,
             num_items=None, accumulation: int = 1):
    from trl.trainer.grpo_trainer import GRPOTrainer

    n, width = b["mask"].shape
    s = SimpleNamespace(
        loss_type=loss_type, beta=beta, epsilon_low=eps_low, epsilon_high=eps_high, top_entropy_quantile=1.0,
        off_policy_mask_threshold=None, importance_sampling_level="token", use_vllm=False,
        vllm_importance_sampling_correction=False, aux_loss_enabled=False, _entropy_bonus_enabled=False,
        model=SimpleNamespace(training=True), current_gradient_accumulation_steps=accumulation,
        max_completion_length=MAX_LEN, accelerator=Accelerator(),
        args=SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=accumulation),
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        get_high_entropy_mask=None,
        _get_per_token_logps_and_entropies=lambda *a, **k: (logps, torch.zeros_like(logps), None))
    inputs = {"prompt_ids": torch.ones(n, 2, dtype=torch.long), "prompt_mask": torch.ones(n, 2, dtype=torch.long),
              "completion_ids": torch.ones(n, width, dtype=torch.long), "completion_mask": b["mask"],
              "advantages": b["adv"], "old_per_token_logps": b["old"], "ref_per_token_logps": b["ref"],
              "num_items_in_batch": torch.tensor(float(num_items if num_items is not None else b["mask"].sum()))}
    return GRPOTrainer._compute_loss(s, None, inputs), s._metrics["train"]


OURS = {"grpo": "sequence", "dapo": "token", "bnpo": "token", "dr_grpo": "constant"}


@pytest.mark.parametrize("loss_type", sorted(OURS))
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("eps", [(0.2, 0.2), (0.2, 0.28)])
def test_loss_and_gradients_equal_trl_grpo_trainer(loss_type, beta, eps):
    pytest.importorskip("trl", minversion="1.16")
    b = batch()
    theirs_in = b["logps"].clone().requires_grad_()
    theirs, their_metrics = trl_loss(b, loss_type, beta, *eps, theirs_in)
    theirs.backward()

    ours_in = b["logps"].clone().requires_grad_()
    got = rl_loss(ours_in, b["adv"], b["mask"], old_logps=b["old"], ref_logps=b["ref"] if beta else None,
                  beta=beta, eps_low=eps[0], eps_high=eps[1], aggregation=OURS[loss_type],
                  max_completion_length=MAX_LEN)
    mine = got.value()
    mine.backward()
    assert abs(mine.item() - theirs.item()) <= TOL
    assert theirs_in.grad.abs().max() > 1e-3  # gradients worth comparing
    assert (ours_in.grad - theirs_in.grad).abs().max() <= TOL
    for name in ("low", "high", "region"):
        ours_m = got.metrics[f"clip_ratio/{name}"].value().item()
        assert ours_m == pytest.approx(their_metrics[f"clip_ratio/{name}_mean"][-1], abs=TOL)
    if beta:
        assert got.metrics["kl"].value().item() == pytest.approx(their_metrics["kl"][-1], abs=TOL)
    assert got.metrics["clip_ratio/region"].value() > 0  # the clip bites on this batch


def test_token_aggregation_over_micro_batches_equals_trl_dapo_accumulated():
    """TRL's dapo divides each micro-batch's sum by the generation batch's tokens: its accumulated losses
    are the global token mean, ours the Means added up, on three uneven micro-batches."""
    pytest.importorskip("trl", minversion="1.16")
    b = batch(3)
    total_tokens = b["mask"].sum()
    splits = [slice(0, 1), slice(1, 5), slice(5, 7)]
    theirs = sum(trl_loss({k: v[s] for k, v in b.items()}, "dapo", 0.04, 0.2, 0.28, b["logps"][s],
                          num_items=total_tokens, accumulation=3)[0] for s in splits)
    ours = sum((rl_loss(b["logps"][s], b["adv"][s], b["mask"][s], old_logps=b["old"][s], ref_logps=b["ref"][s],
                        beta=0.04, eps_high=0.28).loss for s in splits), Mean(torch.tensor(0.0), torch.tensor(0.0)))
    assert abs(ours.value().item() - theirs.item()) <= TOL


# ------------------------------------------------------------------------------------------
# Known answers, by hand


def test_grpo_advantages_by_hand():
    # group [1, 0, 0]: mean 1/3, Bessel std sqrt(((2/3)² + 2(1/3)²) / 2) = sqrt(1/3); group [2, 2, 2]: all 0
    got = group_advantages(torch.tensor([1.0, 0.0, 0.0, 2.0, 2.0, 2.0]), 3)
    s = math.sqrt(1 / 3) + 1e-4
    want = [(2 / 3) / s, (-1 / 3) / s, (-1 / 3) / s, 0.0, 0.0, 0.0]
    assert got.tolist() == pytest.approx(want, abs=1e-6)


def test_dr_grpo_advantages_are_centred_rewards():
    got = group_advantages(torch.tensor([3.0, 1.0, 0.5, 0.5]), 2, scaling="none")
    assert got.tolist() == pytest.approx([1.0, -1.0, 0.0, 0.0])


def test_advantages_normalise_each_group_alone():
    """A group's advantages do not change with its neighbours in the batch (not per rank, not per batch)."""
    r = torch.tensor([0.3, 0.9, 0.1, 5.0, -2.0, 7.0])
    assert torch.equal(group_advantages(r, 3)[:3], group_advantages(r[:3], 3))


def test_trl_nanstd_is_the_std_we_divide_by():
    pytest.importorskip("trl", minversion="1.16")
    from trl.trainer.utils import nanstd

    r = torch.tensor([0.2, 1.0, 0.0, 0.7, 0.1])
    want = (r - r.mean()) / (nanstd(r) + 1e-4)
    assert torch.allclose(group_advantages(r, 5), want, atol=1e-7)


def test_surrogate_by_hand():
    # ratio e^0.5 = 1.6487 > 1.28 with A = 2: clipped, loss -1.28 x 2; ratio e^-0.5 = 0.6065 < 0.8 with
    # A = -1: min(-0.6065, -0.8) = -0.8, loss 0.8; ratio 1.1 in range, A = 3: loss -3.3
    logps = torch.tensor([[0.5], [-0.5], [math.log(1.1)]])
    losses, clips = clipped_surrogate(logps, torch.zeros(3, 1), torch.tensor([2.0, -1.0, 3.0]), 0.2, 0.28)
    assert losses.flatten().tolist() == pytest.approx([-2.56, 0.8, -3.3], abs=1e-6)
    assert clips["high"].flatten().tolist() == [True, False, False]
    assert clips["low"].flatten().tolist() == [False, True, False]


def test_kl_estimators_by_hand():
    logps, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])
    assert per_token_kl(logps, ref, "k1").tolist() == pytest.approx([0.5, -1.0])
    # k3 = e^{ref - logp} - (ref - logp) - 1: e^-0.5 + 0.5 - 1, e^1 - 1 - 1
    assert per_token_kl(logps, ref, "k3").tolist() == pytest.approx([math.exp(-0.5) - 0.5, math.e - 2])
    assert per_token_kl(ref, ref, "k3").abs().max() == 0


def test_aggregations_by_hand():
    # two sequences: [1, 2, pad] and [4, pad, pad]
    per_token = torch.tensor([[1.0, 2.0, 9.0], [4.0, 9.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert aggregate(per_token, mask, "token").value().item() == pytest.approx(7 / 3)
    assert aggregate(per_token, mask, "sequence").value().item() == pytest.approx((1.5 + 4) / 2)
    assert aggregate(per_token, mask, "constant", max_completion_length=5).value().item() == pytest.approx(7 / 10)


def test_overlong_penalty_by_hand_and_against_trl():
    # max 10, cache 4: free up to 6, then (6 - L) / 4, -1 beyond 10
    lengths = [0, 6, 7, 9, 10, 11, 40]
    want = [0.0, 0.0, -0.25, -0.75, -1.0, -1.0, -1.0]
    assert overlong_penalty(lengths, 10, 4).tolist() == pytest.approx(want)
    trl_rewards = pytest.importorskip("trl.rewards")
    theirs = trl_rewards.get_soft_overlong_punishment(10, 4)([[1] * n for n in lengths])
    assert overlong_penalty(lengths, 10, 4).tolist() == pytest.approx(theirs)


def test_dynamic_sampling_drops_groups_of_equal_rewards():
    r = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.5, 0.5, 0.4])
    assert informative_groups(r, 3).tolist() == [False] * 3 + [True] * 3 + [False] * 3 + [True] * 3


# ------------------------------------------------------------------------------------------
# The reduction contract: any split of the batch adds up to the batch in one piece


def split_at(b, cuts):
    edges = [0, *sorted(set(cuts)), len(b["adv"])]
    return [{k: v[lo:hi] for k, v in b.items()} for lo, hi in zip(edges, edges[1:]) if hi > lo]


def loss_of(b, logps, aggregation):
    return rl_loss(logps, b["adv"], b["mask"], old_logps=b["old"], ref_logps=b["ref"], beta=0.1,
                   kl_estimator="k3", eps_high=0.28, aggregation=aggregation, max_completion_length=MAX_LEN)


@settings(max_examples=30, deadline=None)
@given(cuts=st.lists(st.integers(1, len(LENGTHS) - 1), max_size=4),
       aggregation=st.sampled_from(["token", "sequence", "constant"]), seed=st.integers(0, 5))
def test_micro_batches_add_up_to_the_whole_batch(cuts, aggregation, seed):
    b = batch(seed)
    whole_in = b["logps"].clone().requires_grad_()
    whole = loss_of(b, whole_in, aggregation)
    whole.value().backward()

    parts_in = b["logps"].clone().requires_grad_()
    parts = [dict(p, logps=chunk) for p, chunk in zip(split_at(b, cuts), parts_in.split(
        [len(p["adv"]) for p in split_at(b, cuts)]))]
    shares = [loss_of(p, p["logps"], aggregation) for p in parts]
    count = sum(s.loss.count for s in shares)  # the global divisor, known before any backward
    for s in shares:
        (s.loss.total / count).backward()  # each micro-batch's backward alone, as under accumulation
    total = shares[0]
    for s in shares[1:]:
        total = total + s
    assert torch.allclose(total.value(), whole.value(), atol=TOL, rtol=0)
    assert torch.allclose(parts_in.grad, whole_in.grad, atol=TOL, rtol=0)
    for name, m in whole.metrics.items():
        assert torch.allclose(total.metrics[name].value(), m.value(), atol=TOL, rtol=0), name


def test_a_micro_batch_mean_is_not_the_batch_mean():
    """The mutant the contract guards against: each micro-batch's token mean averaged over micro-batches."""
    b = batch(1)
    whole = loss_of(b, b["logps"], "token").value()
    parts = split_at(b, [1])
    averaged = sum(loss_of(p, p["logps"], "token").value() for p in parts) / len(parts)
    assert abs(averaged - whole) > 1e-2


# ------------------------------------------------------------------------------------------
# Direction: a gradient step on the loss raises the log-prob of tokens with a positive advantage


@pytest.mark.parametrize("aggregation", ["token", "sequence", "constant"])
def test_a_positive_advantage_raises_the_tokens_log_prob(aggregation):
    logps = torch.full((2, 3), -1.0, requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    rl_loss(logps, torch.tensor([1.5, -0.5]), mask, aggregation=aggregation, max_completion_length=4).value().backward()
    step = -logps.grad  # gradient descent's direction
    assert (step[0] > 0).all() and (step[1, :2] < 0).all() and step[1, 2] == 0  # padding untouched


def test_the_kl_pulls_towards_the_reference():
    logps = torch.tensor([[-1.0, -3.0]], requires_grad=True)
    ref = torch.tensor([[-2.0, -2.0]])
    rl_loss(logps, torch.zeros(1), torch.ones(1, 2), ref_logps=ref, beta=0.5).value().backward()
    assert logps.grad[0, 0] > 0 and logps.grad[0, 1] < 0  # descent lowers the first, raises the second


# ------------------------------------------------------------------------------------------
# Bad input: one line that says what is wrong


def test_bad_inputs_are_refused_in_one_line():
    with pytest.raises(ValueError, match=r"rewards of shape \(5,\) are not whole groups of 2 completions"):
        group_advantages(torch.zeros(5), 2)
    with pytest.raises(ValueError, match="group_size=1 needs to be 2 or more"):
        group_advantages(torch.zeros(4), 1)
    with pytest.raises(ValueError, match=r"unknown advantage scaling 'batch'; one of \('group', 'none'\)"):
        group_advantages(torch.zeros(4), 2, scaling="batch")
    with pytest.raises(ValueError, match=r"unknown KL estimator 'k2'; one of \('k1', 'k3'\)"):
        per_token_kl(torch.zeros(2), torch.zeros(2), "k2")
    with pytest.raises(ValueError, match="unknown loss aggregation 'seq'"):
        aggregate(torch.zeros(1, 2), torch.ones(1, 2), "seq")
    with pytest.raises(ValueError, match="needs max_completion_length >= the longest completion, 3 tokens, got 2"):
        aggregate(torch.zeros(1, 3), torch.ones(1, 3), "constant", max_completion_length=2)
    with pytest.raises(ValueError, match="beta=0.1 weighs a KL to the reference: pass ref_logps"):
        rl_loss(torch.zeros(1, 2), torch.zeros(1), torch.ones(1, 2), beta=0.1)
    with pytest.raises(ValueError, match=r"overlong cache=12 must lie in \[0, max_length=10\]"):
        overlong_penalty([3], 10, 12)
