"""Properties of the batch-size warm-up (schedule.py: parse_rampup, BatchSchedule; data/loader.py:
StepSampler's windows under it) for generated ramps START,INCREMENT,TOKENS that the layout accepts
(multiples of micro_batch x data-parallel ranks, global_batch - START a multiple of INCREMENT) but
whose TOKENS divide nothing: not the increments, not the sequence length, not a step's tokens.
Against a step-by-step walk of the rule: the batch is START plus INCREMENT for each 1/n of TOKENS
the sequences before the step have reached (n increments in all), and the windows of step s are
the seen(s)-th onward of the epochs' permutations, one after the other, each cut to whole batches."""

from __future__ import annotations

import numpy as np
from hypothesis import example, given
from hypothesis import strategies as st

from scaletrain.data.loader import StepSampler
from scaletrain.schedule import BatchSchedule, parse_rampup


@st.composite
def ramps(draw):
    """(global_batch, seq_len, unit, start, increment, tokens)."""
    unit = draw(st.integers(1, 4))  # micro_batch x data-parallel ranks
    start = unit * draw(st.integers(1, 4))
    increment = unit * draw(st.integers(1, 3))
    global_batch = start + increment * draw(st.integers(0, 5))  # 0 increments: start = global_batch, no ramp
    return global_batch, draw(st.integers(1, 64)), unit, start, increment, draw(st.integers(1, 5000))


def batches_by_hand(global_batch, seq_len, start, increment, tokens, steps: int) -> list[int]:
    n = (global_batch - start) // increment
    out, seen = [], 0
    for _ in range(steps):
        passed = 0
        while passed < n and seen * seq_len * n >= (passed + 1) * tokens:  # threshold k at k/n of the tokens
            passed += 1
        out.append(start + passed * increment if n else global_batch)
        seen += out[-1]
    return out


@given(ramps())
@example((8, 32, 2, 2, 2, 1000))  # thresholds at 333.3, 666.7 and 1,000 tokens (tests/train/test_batch_rampup.py)
@example((12, 7, 3, 3, 3, 21))  # the first threshold (7 tokens) reached exactly by the first step's 21
def test_each_steps_batch_follows_the_tokens_seen_before_it(ramp):
    global_batch, seq_len, unit, start, increment, tokens = ramp
    assert parse_rampup(f"{start}, {increment}, {tokens:_}") == (start, increment, tokens)
    s = BatchSchedule(global_batch, seq_len, unit, start, increment, tokens)
    # enough steps to reach the full batch: every step sees at least `start` sequences
    steps = tokens // (start * seq_len) + 3
    want = batches_by_hand(global_batch, seq_len, start, increment, tokens, steps)
    assert [s.batch(i) for i in range(steps)] == want
    assert want[-1] == global_batch and s.ramps == (start < global_batch)
    assert [s.seen(i) for i in range(steps)] == [sum(want[:i]) for i in range(steps)]
    assert [s.accum(i) * unit for i in range(steps)] == want  # whole micro-batches on every rank
    if s.ramps:
        assert s.equivalent_steps(steps) == sum(want) / global_batch


@given(ramps(), st.integers(0, 50), st.integers(0, 100))
def test_each_steps_windows_are_the_next_of_the_epochs_stream(ramp, extra, seed):
    global_batch, seq_len, unit, start, increment, tokens = ramp
    windows = global_batch + extra  # an epoch's last (windows mod global_batch) are left out
    s = BatchSchedule(global_batch, seq_len, unit, start, increment, tokens)
    sampler = StepSampler(windows, global_batch, unit, global_batch // unit, 0, 1, seed, schedule=s)
    per_epoch = windows // global_batch * global_batch
    stream = np.concatenate([np.random.default_rng([seed, e]).permutation(windows)[:per_epoch] for e in range(40)])
    steps = min(tokens // (start * seq_len) + 3, 30)
    want = batches_by_hand(global_batch, seq_len, start, increment, tokens, steps)
    seen = 0
    for step, batch in enumerate(want):
        assert sampler.global_batch_indices(step).tolist() == stream[seen:seen + batch].tolist(), step
        seen += batch
