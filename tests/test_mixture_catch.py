"""data.mix's sampler (data/mix.py) past a small source's epochs and with weights that do not sum
to 1: the windows of every step written out here from the mix's definition (the golden-ratio
sequence, each source's epochs of permutations), a sampler resumed at a step (built fresh there)
against one that ran straight through, and the same mix given as shares or as larger numbers."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from scaletrain.config import parse_mix
from scaletrain.data.mix import MixSampler

PHI = 11400714819323198485  # floor(2**64 / golden ratio), odd
SIZES = [200, 7, 3]  # windows of each source: the small ones run through many epochs
GLOBAL, MICRO, ACCUM, DP, SEED = 8, 2, 2, 2, 11


class Sources:
    """What the sampler reads of a MixDataset: each source's window count and offset."""

    def __init__(self, sizes: list[int]):
        self.sizes = sizes
        self.offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)

    def __len__(self) -> int:
        return int(self.offsets[-1])


def by_hand(weights: list[float], steps: int, sizes: list[int] = SIZES, seed: int = SEED) -> list[list[int]]:
    """Each step's global batch by the mix's definition: slot p draws from the source whose share
    of [0, 2**64) holds (c + p·PHI) mod 2**64, and the k-th window drawn from source d is the
    (k mod size)-th of its epoch k // size's permutation seeded by (seed, d, epoch)."""
    c = int.from_bytes(hashlib.sha256(f"scaletrain.mix:{seed}".encode()).digest()[:8], "big")
    total = sum(weights)
    edges = [round(sum(weights[:d + 1]) / total * 2**64) for d in range(len(weights) - 1)]
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    drawn = [0] * len(sizes)
    batches = []
    for step in range(steps):
        batch = []
        for p in range(step * GLOBAL, (step + 1) * GLOBAL):
            x = (c + p * PHI) % 2**64
            d = sum(x >= e for e in edges)
            epoch, k = divmod(drawn[d], sizes[d])
            batch.append(int(offsets[d] + np.random.default_rng([seed, d, epoch]).permutation(sizes[d])[k]))
            drawn[d] += 1
        batches.append(batch)
    return batches


def sampler(weights, dp_rank: int = 0, start: int = 0, sizes: list[int] = SIZES) -> MixSampler:
    return MixSampler(Sources(sizes), np.array(weights, dtype=np.float64), GLOBAL, MICRO, ACCUM, dp_rank, DP, SEED,
                      start)


def micro_batches(batch: list[int], rank: int) -> list[list[int]]:
    """Rank r's micro-batches of a global batch: micro-step k reads slice k·DP + r."""
    return [batch[(k * DP + rank) * MICRO:(k * DP + rank + 1) * MICRO] for k in range(ACCUM)]


STEPS = 24
WEIGHTS = [w for _, w in parse_mix("big=0.7,small=0.2,tiny=0.1")]


def epoch_ends(source: int) -> list[int]:
    """The steps that read the first window of the source's 2nd and of its 3rd epoch."""
    ends = np.cumsum(SIZES)
    drawn = np.cumsum([sum(int(np.searchsorted(ends, w, side="right")) == source for w in batch)
                       for batch in by_hand(WEIGHTS, STEPS)])  # windows of it read by the end of each step
    return [int(np.argmax(drawn > SIZES[source] * e)) for e in (1, 2)]


def test_every_steps_windows_follow_the_definition_through_many_epochs_of_a_small_source():
    want = by_hand(WEIGHTS, STEPS)
    s = sampler(WEIGHTS)
    assert [s.global_batch_indices(step).tolist() for step in range(STEPS)] == want
    drawn = s.drawn(STEPS)
    assert drawn[1] > 4 * SIZES[1] and drawn[2] > 4 * SIZES[2]  # the small sources went round 4 times and more
    assert sum(drawn) == STEPS * GLOBAL


def test_a_sampler_resumed_past_a_small_sources_epochs_reads_what_a_straight_one_does():
    """On both ranks, the micro-batches of a sampler built fresh at each step that first reads a
    small source's 2nd or 3rd epoch, and at the step after, equal those of one that ran from
    step 0, and both equal the definition's."""
    firsts = {*epoch_ends(1), *epoch_ends(2)}
    assert len(firsts) >= 2 and all(0 < f < STEPS - 3 for f in firsts), firsts
    want = by_hand(WEIGHTS, STEPS)
    for rank in range(DP):
        straight = iter(sampler(WEIGHTS, rank))
        read = [next(straight) for _ in range(STEPS * ACCUM)]
        assert read == [mb for batch in want for mb in micro_batches(batch, rank)], rank
        for start in sorted(firsts | {f + 1 for f in firsts}):
            resumed = iter(sampler(WEIGHTS, rank, start))
            assert [next(resumed) for _ in range((STEPS - start) * ACCUM)] == read[start * ACCUM:], (rank, start)


@pytest.mark.parametrize("given", ["a=0.7,b=0.2,c=0.1", "a=70,b=20,c=10", "a=7,b=2,c=1", "a=1.4,b=0.4,c=0.2"])
def test_weights_summing_to_one_or_more_draw_the_same_windows_in_proportion(given):
    """A mix's weights are proportions: 0.7/0.2/0.1, 70/20/10 (sum 100) and 1.4/0.4/0.2 (sum 2)
    are one mix, drawn window for window alike and, over any first steps, within a few windows of
    70%, 20% and 10%; as data.mix gives them (normalised) and as the numbers themselves."""
    normalised = [w for _, w in parse_mix(given)]
    assert sum(normalised) == pytest.approx(1.0)
    sizes = [400, 300, 200]
    want = by_hand([0.7, 0.2, 0.1], 60, sizes)
    for weights in (normalised, [float(part.split("=")[1]) for part in given.split(",")]):
        s = sampler(weights, sizes=sizes)
        batches = [s.global_batch_indices(step) for step in range(60)]
        assert [b.tolist() for b in batches] == want, weights
        which = np.searchsorted(np.cumsum(sizes), np.concatenate(batches), side="right")
        for steps in (1, 5, 20, 60):
            seen = np.bincount(which[:steps * GLOBAL], minlength=3)
            assert s.drawn(steps) == seen.tolist()
            assert np.abs(seen - np.array([0.7, 0.2, 0.1]) * steps * GLOBAL).max() <= 3, (steps, seen)


def test_a_share_too_small_for_64_bits_is_drawn_as_none():
    """data.mix=a=1,b=1e-17: b's share rounds away in 64 bits; the sampler draws a alone (it
    crashed on a bound of 2**64, which uint64 does not hold)."""
    weights = [w for _, w in parse_mix("a=1,b=1e-17")]
    s = sampler(weights, sizes=[50, 50])
    ids = np.concatenate([s.global_batch_indices(step) for step in range(20)])
    assert (ids < 50).all() and s.drawn(20) == [160, 0]


def test_the_closed_form_counts_agree_with_the_slots_far_into_a_run():
    """drawn(s) (a floor sum, not a replay) counts what step s's slots draw, 10^12 steps in."""
    s = sampler(WEIGHTS)
    for step in (10**6, 10**9 + 7, 10**12 + 3):
        before, after = s.drawn(step), s.drawn(step + 1)
        slots = np.bincount(s.sources(step * GLOBAL, GLOBAL), minlength=3)
        assert [a - b for a, b in zip(after, before)] == slots.tolist()
        assert sum(after) == (step + 1) * GLOBAL
