"""Batch-size warm-up (train.batch_rampup): the batch of every step, a run against one
process doing the same ramp by hand, resuming mid-ramp, the bad inputs."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from scaletrain.data.loader import StepSampler
from scaletrain.layout import Layout
from scaletrain.schedule import BatchSchedule
from scaletrain.train.trainer import Trainer

from conftest import CKPT, Case, assert_one_clear_line, micro_cfg, train_args

SEQ = 32
# from 2 sequences by 2 up to 8 over 1,000 tokens: increments at 333.3, 666.7 and 1,000 tokens
RAMP = {"train.batch_rampup": "2,2,1000", "train.micro_batch": 2, "train.steps": 12}


def test_the_batch_grows_with_the_tokens_seen():
    s = BatchSchedule(8, SEQ, 2, start=2, increment=2, tokens=1000)
    # step 0 sees 0 tokens: 2 sequences (64 tokens) a step until 333.3 (6 steps: 384), then 4
    # (128 a step) until 666.7 (3 steps: 768), then 6 (192) until 1000 (2 steps: 1152), then 8
    assert [s.batch(i) for i in range(14)] == [2] * 6 + [4] * 3 + [6] * 2 + [8] * 3
    assert [s.accum(i) for i in (0, 6, 9, 11)] == [1, 2, 3, 4]
    assert s.seen(11) == 6 * 2 + 3 * 4 + 2 * 6 and s.seen(13) == s.seen(11) + 2 * 8
    assert s.equivalent_steps(11) == 36 / 8
    assert s.describe() == "2 from step 1, 4 from step 7, 6 from step 10, 8 from step 12"
    flat = BatchSchedule(8, SEQ, 2)
    assert not flat.ramps and flat.batch(5) == 8 and flat.equivalent_steps(5) == 5


def hand_ramp(cfg, steps: int) -> list[float]:
    """The same ramp by hand: plain model and AdamW, the windows taken from the epochs'
    permutations one after the other, the batch from the tokens seen, the learning rate's
    schedule at the full-batch steps seen."""
    from scaletrain.data.dataset import WindowDataset, open_data
    from scaletrain.model.loss import cross_entropy_sum
    from scaletrain.model.transformer import Transformer
    from scaletrain.optim import param_groups
    from scaletrain.parallel.init import init_weights

    torch.manual_seed(0)
    model = Transformer(cfg.model)
    model.init_buffers("cpu")
    init_weights(model, cfg.train.seed)
    o = cfg.optim
    opt = torch.optim.AdamW(param_groups(model.named_parameters(), o.weight_decay), lr=o.lr,
                            betas=(o.beta1, o.beta2), eps=o.eps, fused=True)
    data = WindowDataset(open_data("", True), SEQ)
    g, (start, inc, tokens) = cfg.train.global_batch, (2, 2, 1000)
    n_inc = (g - start) // inc
    per_epoch = len(data) // g * g
    stream = np.concatenate([np.random.default_rng([cfg.train.seed, e]).permutation(len(data))[:per_epoch]
                             for e in range(2)])
    total = None
    seen_at = [0]  # sequences seen before each step
    for _ in range(steps):
        seen_at.append(seen_at[-1] + min(g, start + inc * math.floor(seen_at[-1] * SEQ / (tokens / n_inc))))
    total = seen_at[steps] / g  # the run's length in full-batch steps
    losses = []
    for step in range(steps):
        batch = seen_at[step + 1] - seen_at[step]
        eq = seen_at[step] / g
        warm = o.warmup_steps
        mult = (eq + 1) / warm if eq < warm else \
            o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1, (eq - warm) / (total - warm))))
        for group in opt.param_groups:
            group["lr"] = o.lr * mult
        windows = stream[seen_at[step]:seen_at[step + 1]]
        step_loss = 0.0
        for k in range(batch // 2):  # micro-batches of 2
            x, y = data[windows[2 * k:2 * k + 2].tolist()]
            loss = cross_entropy_sum(model(x), y) / (batch * SEQ)
            loss.backward()
            step_loss += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(step_loss)
    return losses


def test_a_ramp_trains_like_one_process_doing_it_by_hand(tmp_path):
    cfg = micro_cfg(tmp_path, **RAMP)
    result = Trainer(cfg).fit()
    rows = result["history"]
    assert [r["global_batch"] for r in rows] == [2] * 6 + [4] * 3 + [6] * 2 + [8]  # the batch of each step
    assert rows[0]["tokens_per_s"] > 0
    hand = hand_ramp(cfg, 12)
    worst = max(abs(r["loss"] - h) / h for r, h in zip(rows, hand))
    assert worst < 1e-5, worst


def test_resuming_mid_ramp_is_bitwise(tmp_path):
    whole = Trainer(micro_cfg(tmp_path / "a", **RAMP)).fit()["history"]
    Trainer(micro_cfg(tmp_path / "b", **{**RAMP, "train.steps": 7, "checkpoint.save_final": True})).fit()
    resumed = Trainer(micro_cfg(tmp_path / "b", **{**RAMP, "checkpoint.resume": "auto"})).fit()["history"]
    assert [r["step"] for r in resumed] == list(range(8, 13))
    assert [(r["loss"], r["grad_norm"], r["lr"], r["global_batch"]) for r in resumed] == \
        [(r["loss"], r["grad_norm"], r["lr"], r["global_batch"]) for r in whole[7:]]


def test_the_linear_scaling_rule_follows_the_batch(tmp_path):
    t = Trainer(micro_cfg(tmp_path, **RAMP, **{"optim.scale_lr_with_batch": True, "optim.reference_batch": 8,
                                               "optim.warmup_steps": 0, "optim.schedule": "constant"}))
    assert [t.schedule.lr(s) for s in (0, 6, 9, 11)] == pytest.approx([t.cfg.optim.lr * b / 8 for b in (2, 4, 6, 8)])


@pytest.mark.parametrize("value,nproc,words", [
    ("2,2", 1, "is not START,INCREMENT,TOKENS"),
    ("0,2,100", 1, "must be at least 1"),
    ("8,2,100", 1, "starts at 8 sequences, not below train.global_batch=8"),
    ("3,2,100", 1, "must be multiples of micro_batch × data-parallel size = 2 × 1 = 2"),
    ("2,4,100", 1, "global_batch - start = 6 is not a multiple of the increment 4"),
])
def test_bad_ramps_are_one_line(tmp_path, value, nproc, words):
    from scaletrain.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        cfg = micro_cfg(tmp_path, **{**RAMP, "train.batch_rampup": value})
        Layout.from_config(cfg, nproc).check(cfg.model)
    assert len(e.value.lines) == 1 and words in e.value.lines[0], e.value.lines


def test_a_ramp_under_pipelining_is_refused(tmp_path):
    cfg = micro_cfg(tmp_path, **{**RAMP, "model.tie_embeddings": False, "parallel.pp": 2,
                                 "parallel.pp_schedule": "gpipe"})
    assert any("a pipeline schedule runs a fixed number" in e for e in Layout.from_config(cfg, 2).errors(cfg.model))


# --------------------------------------------------------------------------------------------
# Bad input


BAD_INPUT = [
    Case("batch-rampup-two-numbers", train_args("--train.batch_rampup=2,2"),
         ("train.batch_rampup='2,2' is not START,INCREMENT,TOKENS",)),
    Case("batch-rampup-from-the-full-batch", train_args("--train.batch_rampup=8,8,1000"),
         ("train.batch_rampup starts at 8 sequences, not below train.global_batch=8",)),
    Case("resume-other-batch-rampup", train_args(f"--checkpoint.resume={CKPT}", "--train.batch_rampup=4,4,1000",
                                                 "--train.micro_batch=4"),
         ("was trained with train.batch_rampup=''", "keep train.batch_rampup")),
]


@pytest.mark.parametrize("case", BAD_INPUT, ids=[c.id for c in BAD_INPUT])
def test_bad_input_gives_one_clear_line(case: Case, workdir: Path, capsys):
    assert_one_clear_line(case, workdir, capsys)


# --------------------------------------------------------------------------------------------------
# From test_rampup_catch.py (merged here):
#
# The batch-size warm-up (schedule.BatchSchedule, data.loader.StepSampler) where its boundaries
# land exactly: the tokens seen equal to an increment's threshold, a step that reaches two at
# once, and a ramp whose batches run into an epoch's end, with each step's windows written out
# from the epochs' permutations here.

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
