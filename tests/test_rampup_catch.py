"""The batch-size warm-up (schedule.BatchSchedule, data.loader.StepSampler) where its boundaries
land exactly: the tokens seen equal to an increment's threshold, a step that reaches two at
once, and a ramp whose batches run into an epoch's end, with each step's windows written out
from the epochs' permutations here."""

from __future__ import annotations

import numpy as np
import pytest

from scaletrain.data.loader import StepSampler
from scaletrain.schedule import BatchSchedule

# (global batch, seq_len, start, increment, tokens) -> the batch of steps 0, 1, ..., worked out by hand
BY_HAND = {
    # thresholds at 256, 512, 768 tokens, reached exactly: 4 steps of 64 tokens, 2 of 128, then
    # 512 + 2 x 192 = 896 >= 768
    (8, 32, 2, 2, 768): [2, 2, 2, 2, 4, 4, 6, 6, 8, 8],
    # one token further (256.3, 512.7, 769): each threshold passed one step later, or in the
    # same step where the batch overshoots it (320 and 576 tokens seen)
    (8, 32, 2, 2, 769): [2, 2, 2, 2, 2, 4, 4, 6, 6, 8],
    # thresholds 64, 128, 192: step 1 starts exactly on the first; 64 + 128 = 192 lands exactly
    # on the last, so the batch skips 6
    (8, 32, 2, 2, 192): [2, 4, 8, 8],
    # a sequence of 48 tokens, thresholds 384, 768, 1152: 2 x 192, then 384, then 768 + 576
    (16, 48, 4, 4, 1152): [4, 4, 8, 12, 16, 16],
}


@pytest.mark.parametrize("case", list(BY_HAND), ids=["g{}-seq{}-{}+{}-{}tok".format(*c) for c in BY_HAND])
def test_each_steps_batch_where_the_tokens_land_on_a_threshold(case):
    global_batch, seq, start, inc, tokens = case
    s = BatchSchedule(global_batch, seq, start, start=start, increment=inc, tokens=tokens)
    want = BY_HAND[case]
    assert [s.batch(i) for i in range(len(want))] == want
    assert [s.seen(i) for i in range(len(want))] == [sum(want[:i]) for i in range(len(want))]
    # the same from the rule itself: increments passed = floor(tokens seen × n / tokens)
    n, seen = (global_batch - start) // inc, 0
    for i in range(len(want)):
        assert s.batch(i) == start + inc * min(n, seen * seq * n // tokens), i
        seen += s.batch(i)
    assert s.equivalent_steps(len(want)) == sum(want) / global_batch


def test_the_first_threshold_reached_exactly_is_where_the_describe_line_says():
    s = BatchSchedule(8, 32, 2, start=2, increment=2, tokens=768)
    assert s.describe() == "2 from step 1, 4 from step 5, 6 from step 7, 8 from step 9"
    assert [s.accum(i) for i in (3, 4, 6, 8)] == [1, 2, 3, 4]


SEED, WINDOWS = 5, 21  # 21 windows: 2 full batches of 8 an epoch, 5 left out of each epoch


def stream_by_hand(epochs: int) -> np.ndarray:
    """The ramp's stream of windows: each epoch's permutation (seeded by (seed, epoch)) cut to
    its whole full batches (16 of 21), one epoch after the other."""
    return np.concatenate([np.random.default_rng([SEED, e]).permutation(WINDOWS)[:16] for e in range(epochs)])


def ramp_sampler(dp_rank: int, start_step: int = 0) -> StepSampler:
    # micro-batches of 1 on 2 ranks (2 sequences per accumulation step): 2, 2, 2, 2, 4, 4, 6, 6, 8, ...
    schedule = BatchSchedule(8, 32, 2, start=2, increment=2, tokens=768)
    return StepSampler(WINDOWS, 8, 1, 4, dp_rank=dp_rank, dp_size=2, seed=SEED, start_step=start_step,
                       schedule=schedule)


def test_a_ramp_across_epoch_ends_reads_each_steps_windows_in_order():
    """Steps 0-5 read 16 windows: the first epoch ends exactly after step 5; step 7 (windows 22-27)
    and step 8 (28-35) run from the second epoch into the third. Each step's windows, and each
    rank's micro-batches, are those of the stream by hand."""
    batches = [2, 2, 2, 2, 4, 4, 6, 6, 8, 8, 8, 8]
    stream = stream_by_hand(5)
    samplers = [ramp_sampler(r) for r in range(2)]
    seen = 0
    for step, batch in enumerate(batches):
        want = stream[seen:seen + batch]
        got = samplers[0].global_batch_indices(step)
        assert got.tolist() == want.tolist(), (step, seen)
        for r, sampler in enumerate(samplers):
            # micro-step k of rank r reads the k-th pair's r-th window
            assert sampler.rank_micro_batches(step) == [[int(want[2 * k + r])] for k in range(batch // 2)], (step, r)
        seen += batch
    assert seen > 3 * 16  # into a fourth epoch
    # an epoch's windows are a permutation's first 16: no window twice within an epoch
    for e in range(3):
        assert len(set(stream[16 * e:16 * (e + 1)].tolist())) == 16


@pytest.mark.parametrize("start_step", [6, 7, 8, 9])
def test_a_sampler_started_mid_ramp_past_an_epoch_end_reads_what_a_straight_one_does(start_step):
    """The loader's order from a resumed step (its sampler built fresh at that step) equals the
    order of one that ran from step 0, micro-batch for micro-batch, on both ranks."""
    accums = [1, 1, 1, 1, 2, 2, 3, 3, 4, 4, 4, 4, 4]
    for r in range(2):
        straight = iter(ramp_sampler(r))
        for _ in range(sum(accums[:start_step])):
            next(straight)
        resumed = iter(ramp_sampler(r, start_step))
        ahead = sum(accums[start_step:])
        assert [next(resumed) for _ in range(ahead)] == [next(straight) for _ in range(ahead)], r
