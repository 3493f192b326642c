from __future__ import annotations

import pytest

from scaletrain.config import load_config
from scaletrain.errors import ConfigError
from scaletrain.parallel.dims import ParallelDims


def dims(world, **kw):
    return ParallelDims.from_config(load_config(None, {f"parallel.{k}": v for k, v in kw.items()}).parallel, world)


def test_dp_shard_minus_one_takes_the_remaining_ranks():
    d = dims(8, dp_replicate=2)
    assert (d.pp, d.dp_replicate, d.dp_shard, d.tp) == (1, 2, 4, 1)
    assert d.dp == 8 and d.shape == (1, 2, 4, 1) and d.names == ("pp", "dp_replicate", "dp_shard", "tp")


def test_layout_must_use_the_world():
    with pytest.raises(ConfigError, match="needs a multiple of dp_replicate × tp × pp = 3"):
        dims(4, dp_replicate=3)
    with pytest.raises(ConfigError, match="= 2 ranks, but the world has 4"):
        dims(4, dp_shard=2)
    assert dims(4, dp_shard=2, dp_replicate=2).dp == 4


def test_model_parallel_checks():
    from scaletrain.config import check_layout

    def check(world, **kw):
        cfg = load_config(None, {"model.tie_embeddings": False, **kw})
        check_layout(cfg, ParallelDims.from_config(cfg.parallel, world))

    with pytest.raises(ConfigError, match="parallel.tp=3 must divide model.n_heads=4"):
        check(3, **{"parallel.tp": 3, "model.n_heads": 4})
    with pytest.raises(ConfigError, match="must divide the key/value heads"):
        check(4, **{"parallel.tp": 4, "model.n_kv_heads": 2})
    with pytest.raises(ConfigError, match="at least 8 layers, but model.n_layers=4"):
        check(4, **{"parallel.pp": 4, "parallel.pp_schedule": "interleaved-1f1b", "parallel.pp_virtual_stages": 2,
                    "train.grad_accum": 4})
    with pytest.raises(ConfigError, match="needs parallel.pp_virtual_stages=2"):
        check(2, **{"parallel.pp": 2, "parallel.pp_schedule": "zero-bubble"})
    with pytest.raises(ConfigError, match="must list 2 positive layer counts summing to model.n_layers=4"):
        check(2, **{"parallel.pp": 2, "parallel.pp_split": "1,2", "train.grad_accum": 2})
    with pytest.raises(ConfigError, match="needs parallel.tp > 1"):
        check(2, **{"parallel.sp": True})
    with pytest.raises(ConfigError, match="model.tie_embeddings=true shares one weight"):
        check_layout(load_config(None, {"parallel.pp": 2}), ParallelDims(1, 1, 1, 2, 2))
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
