"""data.mix: several prepared folders drawn in proportion, from (seed, step) alone, distinct
windows on every rank, an exact resume, the proportions drawn logged and held to the weights,
one tokenizer for all, validation loss per source."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from scaletrain.config import load_config, parse_mix
from scaletrain.data.loader import rank_slices
from scaletrain.data.mix import MixData, MixDataset, MixSampler, floor_sum
from scaletrain.data.prepare import prepare
from scaletrain.errors import ConfigError, DataError
from scaletrain.train.trainer import Trainer

from conftest import micro_cfg, read_metrics, run_here, run_until

TEXTS = {
    "web": "The quick brown fox jumps over the lazy dog. ",
    "code": "def f(x):\n    return x * 2 + 1\n",
    "books": "It was the best of times, it was the worst of times. ",
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("mix")
    for i, (name, text) in enumerate(TEXTS.items()):
        src = root / f"{name}.jsonl"
        src.write_text("".join(json.dumps({"text": f"{k} {text * (3 + k % 5)}"}) + "\n" for k in range(60 + 30 * i)))
        prepare([src], root / name, val_fraction=0.2, workers=1)
    prepare([root / "web.jsonl"], root / "bpe", tokenizer="bpe", vocab_size=300, workers=1)
    return root


def mix_of(folders, weights: dict[str, float]) -> str:
    return ",".join(f"{folders / name}={w}" for name, w in weights.items())


def sampler(folders, weights, *, global_batch=32, micro=4, accum=2, dp_rank=0, dp=4, seed=7, start=0):
    data = MixData(parse_mix(mix_of(folders, weights)))
    ds = MixDataset(data, 16)
    return MixSampler(ds, data.weights, global_batch, micro, accum, dp_rank, dp, seed, start), ds


def test_floor_sum_matches_the_sum():
    rng = np.random.default_rng(0)
    for _ in range(200):
        n, m, a, b = int(rng.integers(1, 300)), int(rng.integers(1, 1000)), int(rng.integers(0, 5000)), \
            int(rng.integers(0, 5000))
        assert floor_sum(n, m, a, b) == sum((a * i + b) // m for i in range(n))


def test_proportions_drawn_follow_the_weights_at_every_step(folders):
    weights = {"web": 70, "code": 20, "books": 10}
    s, ds = sampler(folders, weights)
    ids = np.concatenate([s.global_batch_indices(step) for step in range(300)])
    which = np.searchsorted(ds.offsets, ids, side="right") - 1
    for step in (1, 10, 50, 300):
        seen = np.bincount(which[:step * 32], minlength=3)
        assert s.drawn(step) == seen.tolist()  # the closed form counts what was drawn
        # within a few windows of the weights from the very first steps
        assert np.abs(seen - np.array([0.7, 0.2, 0.1]) * step * 32).max() <= 3, (step, seen)
    # windows within a source: each epoch of it is a permutation of its windows
    web = ids[which == 0][:ds.sizes[0]]
    assert sorted(web.tolist()) == list(range(ds.sizes[0]))


def test_order_depends_on_seed_and_step_alone_and_ranks_read_distinct_windows(folders):
    weights = {"web": 1, "code": 1}
    fresh, _ = sampler(folders, weights)
    late, _ = sampler(folders, weights, start=41)
    assert np.array_equal(late.global_batch_indices(41), fresh.global_batch_indices(41))
    assert next(iter(late)) == fresh.rank_micro_batches(41)[0]  # the loader starts at the resumed step
    other_seed, _ = sampler(folders, weights, seed=8)
    assert not np.array_equal(other_seed.global_batch_indices(3), fresh.global_batch_indices(3))
    batch = fresh.global_batch_indices(5)
    per_rank = [sum(rank_slices(batch, 4, 2, r, 4), []) for r in range(4)]
    flat = sum(per_rank, [])
    assert sorted(flat) == sorted(batch.tolist()) and len(set(flat)) == len(flat) == 32


def test_bad_mixes_are_one_line(folders, tmp_path):
    for text, fragment in [(f"{folders / 'web'}=0,{folders / 'code'}=1", "weight 0 of"),
                           (f"{folders / 'web'}=-2,{folders / 'code'}=1", "must be above 0"),
                           (f"{folders / 'web'}=1", "at least two sources"),
                           (f"{folders / 'web'}", "is not PATH=WEIGHT")]:
        r = run_here("train", f"--data.mix={text}", "--train.steps=1", f"--log.run_dir={tmp_path / 'r'}")
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1 and fragment in r.stderr, r.stderr
    with pytest.raises(ConfigError, match="data.path and data.mix both name the data"):
        load_config(None, {"data.path": str(folders / "web"), "data.mix": mix_of(folders, {"web": 1, "code": 1})})
    # sources prepared with different tokenizers
    r = run_here("train", f"--data.mix={mix_of(folders, {'web': 1, 'bpe': 1})}", "--train.steps=1",
                 "--model.vocab_size=300", f"--log.run_dir={tmp_path / 'r'}")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert f"data.mix: {folders / 'bpe'} was prepared with another tokenizer than {folders / 'web'} " \
           "(tokenizer.json, vocabulary " in r.stderr and "against byte, vocabulary 256)" in r.stderr
    assert "every source of a mix must share one: prepare them with the same --tokenizer" in r.stderr
    with pytest.raises(DataError, match="another tokenizer"):
        MixData(parse_mix(mix_of(folders, {"web": 1, "bpe": 1})))


def test_training_on_a_mix_logs_proportions_and_validation_per_source_and_resumes_exactly(folders, tmp_path):
    base = {"data.mix": mix_of(folders, {"web": 70, "code": 20, "books": 10}), "train.steps": 8,
            "checkpoint.every": 4, "train.eval_every": 4, "train.eval_batches": 1, "data.seq_len": 16}
    straight = Trainer(micro_cfg(tmp_path / "a", **base)).fit()
    rows = read_metrics(tmp_path / "a" / "run")
    last = rows[-1]
    assert abs(last["mix/web"] - 0.7) < 0.05 and abs(last["mix/code"] - 0.2) < 0.05 and \
        abs(last["mix/books"] - 0.1) < 0.05
    assert sum(last[f"mix/{n}"] for n in TEXTS) == pytest.approx(1.0)
    per_source = {n: last[f"val_loss/{n}"] for n in TEXTS}
    assert len(set(per_source.values())) == 3  # three sources, three losses
    assert last["val_loss"] == pytest.approx(0.7 * per_source["web"] + 0.2 * per_source["code"]
                                             + 0.1 * per_source["books"])
    # stopped after step 4 and resumed: the same losses, step for step
    cfg = micro_cfg(tmp_path / "b", **{**base, "checkpoint.resume": "auto"})
    run_until(cfg, stop_after=4)
    resumed = Trainer(cfg)
    assert resumed.step == 4
    resumed.fit()
    assert [r["loss"] for r in read_metrics(tmp_path / "b" / "run")] == straight["losses"]
    # scaletrain eval of the mix's checkpoint: each source, and their weighted mean
    r = run_here("eval", str(tmp_path / "a" / "run" / "checkpoints" / "step_00000008"), "--json")
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    assert result["val_loss"] == pytest.approx(last["val_loss"], rel=1e-4)
    assert result["sources"] == pytest.approx(per_source, rel=1e-4)


def test_weights_of_any_size_normalise_without_overflow():
    """Weights are relative shares: 1e308 twice is an even mix (their sum overflowed to inf and
    logged "0%, 0%", every window drawn from the second source); a weight too small beside the
    largest to get any share is refused."""
    assert parse_mix("a=1e308,b=1e308") == [("a", 0.5), ("b", 0.5)]
    assert [w for _, w in parse_mix("a=3e307,b=1e308,c=1e308")] == pytest.approx([3 / 23, 10 / 23, 10 / 23])
    assert [w for _, w in parse_mix("a=1e-300,b=3e-300")] == pytest.approx([0.25, 0.75])
    with pytest.raises(ValueError, match="the weight of b is too small beside the largest"):
        parse_mix("a=1e308,b=1e-300")


# --------------------------------------------------------------------------------------------------
# From test_mixture_catch.py (merged here):
#
# data.mix's sampler (data/mix.py) past a small source's epochs and with weights that do not sum
# to 1: the windows of every step written out here from the mix's definition (the golden-ratio
# sequence, each source's epochs of permutations), a sampler resumed at a step (built fresh there)
# against one that ran straight through, and the same mix given as shares or as larger numbers.

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


def sized_sampler(weights, dp_rank: int = 0, start: int = 0, sizes: list[int] = SIZES) -> MixSampler:
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
    s = sized_sampler(WEIGHTS)
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
        straight = iter(sized_sampler(WEIGHTS, rank))
        read = [next(straight) for _ in range(STEPS * ACCUM)]
        assert read == [mb for batch in want for mb in micro_batches(batch, rank)], rank
        for start in sorted(firsts | {f + 1 for f in firsts}):
            resumed = iter(sized_sampler(WEIGHTS, rank, start))
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
        s = sized_sampler(weights, sizes=sizes)
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
    s = sized_sampler(weights, sizes=[50, 50])
    ids = np.concatenate([s.global_batch_indices(step) for step in range(20)])
    assert (ids < 50).all() and s.drawn(20) == [160, 0]


def test_the_closed_form_counts_agree_with_the_slots_far_into_a_run():
    """drawn(s) (a floor sum, not a replay) counts what step s's slots draw, 10^12 steps in."""
    s = sized_sampler(WEIGHTS)
    for step in (10**6, 10**9 + 7, 10**12 + 3):
        before, after = s.drawn(step), s.drawn(step + 1)
        slots = np.bincount(s.sources(step * GLOBAL, GLOBAL), minlength=3)
        assert [a - b for a, b in zip(after, before)] == slots.tolist()
        assert sum(after) == (step + 1) * GLOBAL
