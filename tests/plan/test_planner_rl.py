"""The planner knows an RL run (issue 50 #8): the rollout engine's key/value cache in memory (counted by hand
here), the generation of each round in the step time (growing with the completions' length, shared by the
round's updates, paying ZeRO-3's gathers every token), the forward before an update, and only the layouts
`train` can sample on (the one legality check)."""

from __future__ import annotations

import dataclasses

import pytest

from scaletrain.hardware import lookup
from scaletrain.model.presets import preset_config
from scaletrain.plan import Layout
from scaletrain.plan.rl import kv_cache_bytes
from scaletrain.plan.search import evaluate, layout_errors
from scaletrain.plan.spec import Cluster, Workload

from conftest import run_here

H100 = lookup("H100-SXM")
CLUSTER = Cluster(H100, 1, 8)


def rl(**extra) -> Workload:
    values = dict(seq_len=1536, global_batch=256, precision="bf16-mixed", objective="rl", rl_group=8,
                  rl_new_tokens=1024, rl_updates=1)
    return Workload(**{**values, **extra})


def test_the_cache_is_keys_and_values_of_every_block_for_every_completion_of_a_rank():
    cfg = preset_config("llama-8b")  # 32 blocks, 8 key/value heads of 128
    layout = Layout(tp=4, dp_shard=2, micro_batch=8, grad_accum=16)
    # 2 (K and V) x 32 blocks x 1536 positions x 8 / 4 heads x 128 x 128 completions (256 / dp 2) x 2 bytes (bf16)
    assert kv_cache_bytes(cfg, rl(), layout) == 2 * 32 * 1536 * 2 * 128 * 128 * 2
    windowed = dataclasses.replace(cfg, sliding_window=512)  # every block's cache bounded by its window
    assert kv_cache_bytes(windowed, rl(), layout) == 2 * 32 * 512 * 2 * 128 * 128 * 2


def test_the_rollouts_cost_time_that_grows_with_the_completions_and_is_shared_by_the_updates():
    cfg = preset_config("llama-8b")
    layout = Layout(tp=4, dp_shard=2, micro_batch=8, grad_accum=16)
    lm = evaluate(cfg, Workload(seq_len=1536, global_batch=256, precision="bf16-mixed"), CLUSTER, layout)
    # prompts of 512 tokens, completions of at most 256, 512 or 1024: the same prefill, then a forward per token
    # (each reading a cache a little longer): 512 more tokens cost about twice what 256 more do
    short, mid, long = (evaluate(cfg, rl(rl_new_tokens=n, seq_len=512 + n), CLUSTER, layout) for n in (256, 512, 1024))
    assert lm.time.rollout_s == 0 and short.time.rollout_s > 0
    ratio = (long.time.rollout_s - mid.time.rollout_s) / (mid.time.rollout_s - short.time.rollout_s)
    assert 1.9 < ratio < 2.6, ratio
    assert long.time.step_time_s == pytest.approx(lm.time.step_time_s + long.time.rollout_s)
    four = evaluate(cfg, rl(rl_updates=4), CLUSTER, layout)  # a round feeds 4 steps: a quarter of it a step
    assert four.time.rollout_s == pytest.approx(long.time.rollout_s / 4)
    old = evaluate(cfg, rl(rl_updates=4, rl_old_pass=True), CLUSTER, layout)  # + a forward of the step's rows
    assert old.time.rollout_s > four.time.rollout_s
    zero3 = evaluate(cfg, rl(), CLUSTER, Layout(dp_shard=8, zero=3, micro_batch=2, grad_accum=16))
    zero1 = evaluate(cfg, rl(), CLUSTER, Layout(dp_shard=8, zero=1, micro_batch=2, grad_accum=16))
    assert zero3.time.rollout_s > 2 * zero1.time.rollout_s  # every generated token gathers the weights again


def test_the_cache_counts_in_memory_where_it_exceeds_the_steps_activations():
    cfg = preset_config("llama-8b")
    layout = Layout(tp=4, dp_shard=2, micro_batch=1, grad_accum=128, activation_checkpointing="full")
    lm = evaluate(cfg, Workload(seq_len=1536, global_batch=256, precision="bf16-mixed"), CLUSTER, layout)
    got = evaluate(cfg, rl(), CLUSTER, layout)
    kv = kv_cache_bytes(cfg, rl(), layout)
    assert lm.memory.activations < kv
    assert got.memory.activations == kv
    assert any("key/value cache" in note for note in got.memory.notes)


def test_layouts_that_cannot_sample_or_split_a_group_are_not_ranked():
    cfg = preset_config("llama-8b")
    pp = layout_errors(cfg, rl(), CLUSTER, Layout(pp=2, dp_shard=4, micro_batch=4, grad_accum=16))
    assert any("pipeline parallelism is not supported yet" in e for e in pp)
    groups = layout_errors(cfg, rl(global_batch=96, rl_group=16), CLUSTER, Layout(dp_shard=8, micro_batch=4,
                                                                                  grad_accum=3))
    assert any("samples whole groups" in e for e in groups)


def test_plan_states_the_cache_and_the_rollouts_for_an_8b_grpo_on_8_h100():
    out = run_here("plan", "llama-8b", "--gpus", "8", "--hardware", "H100-SXM", "--seq-len", "1536",
                   "--train.objective=rl", "--rl.group_size=8", "--rl.max_new_tokens=1024", "--global-batch", "256",
                   "--rl.beta=0.04")
    assert out.returncode == 0, out.stderr
    assert "32 prompts x 8, at most 1024 new tokens each" in out.stdout
    assert "rollouts (sampling, old pass)" in out.stdout and "reference forward" in out.stdout
    assert "rl: the rollout engine's key/value cache" in out.stdout and "rl.reference=model" in out.stdout
    assert "pp 2" not in out.stdout and "cp 2" not in out.stdout
