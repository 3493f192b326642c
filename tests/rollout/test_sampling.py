"""The sampler against hand computations and the reference library: which tokens top-k and top-p let be
drawn (transformers' own logits warpers), how often each is drawn, and the seeds of the completions."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from scaletrain.errors import ConfigError
from scaletrain.rollout import SamplingParams
from scaletrain.rollout.sampling import completion_generator, completion_seed, draw, filtered_probs, full_logprobs

PROBS = [0.5, 0.2, 0.15, 0.1, 0.05]  # token 0 most likely


def kept(probs, **kw) -> set[int]:
    logits = torch.tensor([PROBS if probs is None else probs]).log()
    return set(torch.nonzero(filtered_probs(logits, **kw)[0]).flatten().tolist())


@pytest.mark.parametrize("kw,expected", [
    ({}, {0, 1, 2, 3, 4}),
    ({"top_k": 2}, {0, 1}),
    ({"top_k": 5}, {0, 1, 2, 3, 4}),
    ({"top_k": 9}, {0, 1, 2, 3, 4}),  # (more than the vocabulary: all)
    ({"top_p": 0.45}, {0}),  # 0.5 alone reaches 0.45
    ({"top_p": 0.65}, {0, 1}),  # 0.5 + 0.2 = 0.7 reaches 0.65
    ({"top_p": 0.8}, {0, 1, 2}),  # 0.85
    ({"top_p": 0.9}, {0, 1, 2, 3}),  # 0.95
    ({"top_p": 0.99}, {0, 1, 2, 3, 4}),
    # top-p on what top-k kept, renormalised: [0.5, 0.2, 0.15] / 0.85 = [0.588, 0.235, 0.176]
    ({"top_k": 3, "top_p": 0.6}, {0, 1}),  # (over the whole distribution 0.6 would keep {0, 1} too)
    ({"top_k": 3, "top_p": 0.55}, {0}),  # 0.588 alone reaches 0.55 (over the whole: 0.5 does not)
])
def test_which_tokens_can_be_drawn_by_hand(kw, expected):
    assert kept(None, **kw) == expected


def test_the_kept_probabilities_are_renormalised_and_the_draws_follow_them():
    logits = torch.tensor([PROBS]).log()
    probs = filtered_probs(logits, top_k=3)[0]
    torch.testing.assert_close(probs[:3], torch.tensor([0.5, 0.2, 0.15]) / 0.85)
    counts = torch.zeros(5)
    gens = [completion_generator(3, 0, j, torch.device("cpu")) for j in range(4000)]
    for tok in draw(probs.expand(4000, 5), gens):
        counts[tok] += 1
    assert counts[3:].sum() == 0  # never a token top-k left out
    freq = counts[:3] / 4000
    # binomial standard error of each frequency is at most sqrt(0.25 / 4000) = 0.008: 4 of them
    assert (freq - torch.tensor([0.5, 0.2, 0.15]) / 0.85).abs().max() < 0.032, freq


@given(st.lists(st.floats(-6, 6, allow_nan=False), min_size=2, max_size=40), st.integers(0, 45),
       st.floats(0.05, 1.0), st.floats(0.3, 2.0))
def test_the_kept_tokens_are_those_of_transformers_warpers(values, top_k, top_p, temperature):
    """Temperature, then top-k, then top-p: transformers' generate applies its warpers in this order."""
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    logits = torch.tensor([values]) / temperature
    probs = torch.softmax(logits, -1)[0]
    ours = filtered_probs(logits, top_k=top_k, top_p=top_p)[0] > 0
    theirs = logits.clone()
    if top_k:
        theirs = TopKLogitsWarper(top_k=top_k)(None, theirs)
    if top_p < 1.0:
        theirs = TopPLogitsWarper(top_p=top_p)(None, theirs)
    theirs = theirs[0] > float("-inf")
    # between tokens of equal probability either may be kept (the sorts differ): the values kept must agree
    if ours.sum() == theirs.sum() and torch.equal(probs[ours].sort().values, probs[theirs].sort().values):
        return
    # else they may only part on a token whose cumulative mass sits on top_p within rounding
    after_k = torch.softmax(logits.masked_fill(~(filtered_probs(logits, top_k=top_k)[0] > 0), -math.inf), -1)[0]
    cut = torch.sort(after_k, descending=True).values.cumsum(0)
    assert (cut - top_p).abs().min() < 1e-5, (ours, theirs, probs)


def test_log_probs_are_of_the_whole_distribution_at_the_temperature():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    tokens = torch.tensor([1])
    T = 0.7
    by_hand = 1.0 / T - math.log(sum(math.exp(v / T) for v in (2.0, 1.0, 0.5, -1.0)))
    assert full_logprobs(logits / T, tokens).item() == pytest.approx(by_hand, abs=1e-6)


def test_a_completion_seed_depends_on_seed_prompt_and_completion_alone():
    seeds = {completion_seed(s, i, j) for s in range(3) for i in range(20) for j in range(8)}
    assert len(seeds) == 3 * 20 * 8 and all(0 <= s < 2**63 for s in seeds)
    assert completion_seed(1, 2, 3) == completion_seed(1, 2, 3)


@pytest.mark.parametrize("kw,text", [
    ({"n": 0}, "sampling: n=0 must be 1 or more (completions per prompt)"),
    ({"temperature": 0.0}, "sampling: temperature=0.0 must be above 0 (for greedy use top_k=1)"),
    ({"top_p": 0.0}, "sampling: top_p=0.0 must lie in (0, 1] (1 = off)"),
    ({"top_k": -1}, "sampling: top_k=-1 must be 0 (off) or more"),
    ({"max_new_tokens": 0}, "sampling: max_new_tokens=0 must be 1 or more"),
    ({"stop_strings": ("",)}, "sampling: stop_strings holds an empty string, which would stop every completion at "
                              "once; remove it"),
])
def test_bad_sampling_params_are_one_line_each(kw, text):
    with pytest.raises(ConfigError) as e:
        SamplingParams(**kw)
    assert e.value.lines == [text]
