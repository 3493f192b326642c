from __future__ import annotations

import pytest

from scaletrain.config import load_config
from scaletrain.errors import ConfigError
from scaletrain.layout import MESH_AXES, Layout


def dims(world, **kw):
    return Layout.from_config(load_config(None, {f"parallel.{k}": v for k, v in kw.items()}), world)


def test_dp_shard_minus_one_takes_the_remaining_ranks():
    d = dims(8, dp_replicate=2)
    assert (d.pp, d.dp_replicate, d.dp_shard, d.tp) == (1, 2, 4, 1)
    assert d.dp == 8 and d.mesh_shape == (1, 2, 4, 1, 1) and MESH_AXES == ("pp", "dp_replicate", "dp_shard", "cp", "tp")


def test_layout_must_use_the_world():
    with pytest.raises(ConfigError, match="needs a multiple of dp_replicate × tp × pp = 3"):
        dims(4, dp_replicate=3)
    with pytest.raises(ConfigError, match="= 2 ranks, but the world has 4"):
        dims(4, dp_shard=2)
    assert dims(4, dp_shard=2, dp_replicate=2).dp == 4


def test_model_parallel_checks():
    def check(world, **kw):
        cfg = load_config(None, {"model.tie_embeddings": False, **kw})
        Layout.from_config(cfg, world).check(cfg.model)

    with pytest.raises(ConfigError, match="parallel.tp=3 must divide model.n_heads=4"):
        check(3, **{"parallel.tp": 3, "model.n_heads": 4})
    check(4, **{"parallel.tp": 4, "model.n_kv_heads": 2})  # fewer K/V heads than tp: each replicated on 2 ranks
    with pytest.raises(ConfigError, match=r"must divide the key/value heads \(3\), or be a multiple of them"):
        check(2, **{"parallel.tp": 2, "model.dim": 96, "model.n_heads": 12, "model.n_kv_heads": 3})
    with pytest.raises(ConfigError, match="at least 8 layers, but model.n_layers=4"):
        check(4, **{"parallel.pp": 4, "parallel.pp_schedule": "interleaved-1f1b", "parallel.pp_virtual_stages": 2,
                    "train.grad_accum": 4})
    with pytest.raises(ConfigError, match="needs parallel.pp_virtual_stages=2"):
        check(2, **{"parallel.pp": 2, "parallel.pp_schedule": "zero-bubble"})
    with pytest.raises(ConfigError, match="must list 2 positive layer counts summing to model.n_layers=4"):
        check(2, **{"parallel.pp": 2, "parallel.pp_split": "1,2", "train.grad_accum": 2})
    with pytest.raises(ConfigError, match="needs parallel.tp > 1"):
        check(2, **{"parallel.sp": True})
    tied = load_config(None, {"parallel.pp": 2}).model  # the first and the last stage each hold the weight...
    Layout(pp=2, grad_accum=2).check(tied)
    with pytest.raises(ConfigError, match="which the zero-bubble V puts on one rank"):  # ...not on one rank
        Layout(pp=2, grad_accum=2, pp_schedule="zero-bubble", pp_virtual_stages=2).check(tied)
    with pytest.raises(ConfigError, match="name the same count under pipelining"):
        check(2, **{"parallel.pp": 2, "parallel.pp_microbatches": 4, "train.grad_accum": 2})
    check(2, **{"parallel.pp": 2, "parallel.pp_split": "3,1", "train.grad_accum": 2})  # a hand split that adds up


def test_balanced_split_accounts_for_the_head():
    from scaletrain.parallel.pipeline import balanced_split_counts, layer_ranges, stage_indices

    assert balanced_split_counts(8, 4) == [2, 2, 2, 2]
    assert balanced_split_counts(8, 2, head_cost=2.0) == [5, 3]  # the head weighs 2 blocks
    assert [list(r) for r in layer_ranges(load_config(None, {"model.n_layers": 4}).model, 2, "3,1")] == [[0, 1, 2], [3]]
    assert stage_indices("interleaved-1f1b", 1, 2, 2) == [1, 3]
    assert stage_indices("zero-bubble", 0, 2, 2) == [0, 3]


def test_the_rules_derived_from_a_layout():
    """Chunks per rank, the data-parallel engine and who keeps fp32 weights, read by the
    trainer, parallelize and the planner alike."""
    assert Layout(pp=2, pp_schedule="interleaved-1f1b", pp_virtual_stages=3).chunks_per_rank == 3
    assert Layout(pp=2, pp_schedule="1f1b").num_stages == 2
    engines = {(dp, zero, tp): Layout(dp_shard=dp, zero=zero, tp=tp).dp_engine
               for dp, zero, tp in ((1, 0, 1), (2, 0, 1), (2, 0, 2), (2, 1, 1), (2, 2, 1), (2, 3, 1))}
    assert engines == {(1, 0, 1): "none", (2, 0, 1): "ddp", (2, 0, 2): "replicate", (2, 1, 1): "zero1",
                       (2, 2, 1): "zero2", (2, 3, 1): "fsdp"}
    assert [Layout(dp_shard=2, zero=z).keeps_fp32_weights for z in range(4)] == [False, True, True, True]
    assert not Layout().keeps_fp32_weights
    lay = Layout.from_config(load_config(None, {"train.global_batch": 32, "train.micro_batch": 4}), 4)
    assert (lay.dp, lay.micro_batch, lay.grad_accum, lay.global_batch) == (4, 4, 2, 32)


def test_a_layout_round_trips_through_the_config_keys():
    cfg = load_config(None, {"model.tie_embeddings": False, "parallel.pp": 2, "parallel.tp": 2, "parallel.sp": True,
                             "parallel.zero": 1, "parallel.pp_schedule": "interleaved-1f1b",
                             "parallel.pp_virtual_stages": 2, "train.global_batch": 16, "train.grad_accum": 4,
                             "memory.activation_checkpointing": "selective"})
    lay = Layout.from_config(cfg, 8).check(cfg.model)
    again = Layout.from_config(cfg.replace(**lay.config_overrides()), 8)
    assert again == lay
    assert lay.describe() == "dp 2 zero1, tp 2+sp, pp 2 interleaved-1f1b v2, mb 2x4, ac selective"


def test_check_lists_every_problem_at_once():
    with pytest.raises(ConfigError) as e:
        Layout(sp=True, zero=1, offload_optimizer=True).check()
    text = "\n".join(e.value.lines)
    assert len(e.value.lines) == 3
    assert "needs parallel.tp > 1" in text and "offloads the sharded" in text
    assert "shards model states over the dp_shard ranks" in text


def test_the_layouts_defaults_are_the_configs():
    """Defined once: a Layout field's default is its config key's (sizes and the batch triad
    aside: the config's -1 and 0 ask for derivation); so are the planner's sync defaults."""
    from dataclasses import fields

    from scaletrain.config import MemoryConfig, ParallelConfig, TrainConfig
    from scaletrain.plan import DEFAULT_SYNC

    config = {**vars(ParallelConfig()), **vars(MemoryConfig()), "batch_rampup": TrainConfig().batch_rampup}
    derived = {"dp_shard", "micro_batch", "grad_accum"}
    assert {f.name: f.default for f in fields(Layout) if f.name not in derived} == \
        {f.name: config[f.name] for f in fields(Layout) if f.name not in derived}
    sync = ("dp_sync", "sync_every", "sync_fragments", "sync_delay", "sync_dtype")
    assert DEFAULT_SYNC == {k: config[k] for k in sync}


def test_world_of_a_config_and_the_rules_of_sizes_live_in_layout():
    from scaletrain.config import ParallelConfig
    from scaletrain.verify import layout_world

    par = ParallelConfig(dp_replicate=2, tp=2, pp=2, cp=2)
    assert Layout.fixed_ranks(par) == Layout.config_world(par) == layout_world(par, None) == 16  # dp_shard -1
    par = ParallelConfig(dp_replicate=2, tp=2, pp=2, cp=2, dp_shard=3)
    assert Layout.config_world(par) == layout_world(par, None) == 48
    lay = dims(48, dp_replicate=2, tp=2, pp=2, cp=2, dp_shard=3)
    assert lay.world == 48 and lay.global_batch == lay.micro_batch * lay.grad_accum * 6
    # the cp chunks of a sequence: every engine's rule, the same sentence
    for engine in ("scaletrain", "megatron"):
        assert any("2 × cp = 8 equal chunks" in e for e in Layout(cp=4).errors(engine=engine, seq_len=100))
        assert not Layout(cp=4).errors(engine=engine, seq_len=128)


def test_local_sgd_fragments_are_checked_by_one_rule():
    lay = Layout(dp_replicate=2, dp_sync="diloco", sync_every=10, sync_fragments=3)
    text = "parallel.sync_fragments=3 splits the model's blocks into fragments, but model.n_layers=2"
    assert lay.fragment_errors(2) == [f"{text}; use at most 2 fragments"]
    assert lay.fragment_errors(2, of_config=False)[0].endswith("but it has 2; use at most 2 fragments")
    assert lay.fragment_errors(3) == [] and Layout(sync_fragments=3).fragment_errors(1) == []  # without local sync
    model = load_config(None, {"model.n_layers": 2}).model
    assert any(e.startswith(text) for e in lay.errors(model))
