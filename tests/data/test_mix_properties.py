"""Properties of a mixture's sampler (data/mix.py: MixSampler) for generated mixes: 1 to 4 sources
of 1 to 30 windows (the small ones run through many epochs), weights of any size that do not sum
to 1, global batches and step counts that divide nothing. The sampler is deterministic, so each
step's windows are checked exactly against the mix's definition walked slot by slot in Python
integers, and the closed-form counts (`drawn`) against that walk; the proportions drawn against
the weights within a bound derived below from the golden ratio's continued fraction."""

from __future__ import annotations

import hashlib
from fractions import Fraction

import numpy as np
from hypothesis import example, given
from hypothesis import strategies as st

from scaletrain.data.mix import MixSampler

M = 2**64
PHI = 11400714819323198485  # floor(2**64 / golden ratio), odd


class Sources:
    """What the sampler reads of a MixDataset: each source's window count and offset."""

    def __init__(self, sizes: list[int]):
        self.sizes = sizes
        self.offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)

    def __len__(self) -> int:
        return int(self.offsets[-1])


@st.composite
def mixes(draw):
    n = draw(st.integers(1, 4))
    weights = draw(st.lists(st.floats(1e-3, 1e3) | st.integers(1, 100).map(float), min_size=n, max_size=n))
    sizes = draw(st.lists(st.integers(1, 30), min_size=n, max_size=n))
    return weights, sizes, draw(st.integers(1, 12)), draw(st.integers(1, 20)), draw(st.integers(0, 2**32))


def walk(weights, sizes, global_batch: int, steps: int, seed: int) -> tuple[list[list[int]], list[int]]:
    """Each step's windows by the definition: slot p draws from the source whose share of [0, 2**64)
    holds (c + p * PHI) mod 2**64, and the k-th window drawn from source d is the (k mod size)-th
    of the permutation of its epoch k // size, seeded by (seed, d, epoch). Returns the batches and
    the windows drawn from each source."""
    c = int.from_bytes(hashlib.sha256(f"scaletrain.mix:{seed}".encode()).digest()[:8], "big")
    total, running, edges = sum(weights), 0.0, []
    for w in weights[:-1]:
        running += w
        edges.append(round(running / total * M))
    offsets = [sum(sizes[:d]) for d in range(len(sizes))]
    drawn = [0] * len(sizes)
    batches = []
    for step in range(steps):
        batch = []
        for p in range(step * global_batch, (step + 1) * global_batch):
            x = (c + p * PHI) % M
            d = sum(x >= e for e in edges)
            epoch, k = divmod(drawn[d], sizes[d])
            batch.append(offsets[d] + int(np.random.default_rng([seed, d, epoch]).permutation(sizes[d])[k]))
            drawn[d] += 1
        batches.append(batch)
    return batches, drawn


@given(mixes())
@example(([0.7, 0.2, 0.1], [200, 7, 3], 8, 20, 11))  # tests/data/test_mix.py's mix
@example(([1.0], [1], 1, 3, 0))  # one source of one window: it every time
def test_each_steps_windows_are_the_definitions(mix):
    weights, sizes, global_batch, steps, seed = mix
    s = MixSampler(Sources(sizes), np.array(weights), global_batch, global_batch, 1, 0, 1, seed)
    want, drawn = walk(weights, sizes, global_batch, steps, seed)
    assert [s.global_batch_indices(step).tolist() for step in range(steps)] == want
    assert s.drawn(steps) == drawn


def golden_bound(n: int) -> int:
    """How far, at most, a source's count over the first n slots is from n times its share.
    x_p = frac(c + p * a), a = PHI / 2**64, whose continued fraction is [0; 1, 1, 1, ...] as the
    golden ratio's for its first 44 terms (checked below): denominators up to 1.1e9 slots. For
    p < n, the count of frac(p * a) in an interval is within n * D_n of n times its length, and
    n * D_n <= a_1 + ... + a_(l+1) = l + 1 where q_l <= n < q_(l+1), q the denominators of the
    convergents (Ostrowski's bound: Kuipers and Niederreiter, Uniform Distribution of Sequences,
    1974, ch. 2 section 3). Doubled (the shift by c can split a source's interval in two), doubled
    again in case the bound is taken as the star discrepancy's, and 1 more for the share's
    rounding to 64 bits. Loose (53 at 240 slots, where 2,000 random mixes deviate by 2.6 at most),
    but it grows as log n: at 1.2e7 slots (checked through the closed-form counts) it is 141, so a
    sampler that drifts from its weights by 0.002% of the slots leaves it."""
    q_prev, q, index = 1, 1, 1  # q_0 = 1, q_1 = a_1 = 1: q_index <= n
    while q_prev + q <= n:
        q_prev, q, index = q, q_prev + q, index + 1
    assert index < 44, "past the golden ratio's terms that 64 bits hold"
    return 4 * (index + 1) + 1


def test_the_golden_bound_holds_its_premise():
    """The first 44 partial quotients of PHI / 2**64 are 1, as the golden ratio's all are (the 45th,
    past 1.1e9 slots, is not: 64 bits hold no more of it)."""
    x, quotients = Fraction(PHI, M), []
    for _ in range(45):
        whole = x.numerator // x.denominator
        quotients.append(whole)
        x = 1 / (x - whole)
    assert quotients == [0] + [1] * 44


@given(mixes())
def test_each_source_is_drawn_in_its_share_over_any_first_steps(mix):
    weights, sizes, global_batch, steps, seed = mix
    s = MixSampler(Sources(sizes), np.array(weights), global_batch, global_batch, 1, 0, 1, seed)
    shares = np.array(weights) / sum(weights)
    for step in [*range(1, steps + 1), 1000, 10**5 + steps, 10**6 - 1]:  # far steps by `drawn`'s closed form
        n = step * global_batch
        gap = np.abs(np.array(s.drawn(step)) - n * shares).max()
        assert gap <= golden_bound(n), (step, gap, golden_bound(n))
