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


def test_model_parallel_axes_exist_but_stay_one_for_now():
    with pytest.raises(ConfigError, match="parallel.tp: 2 must be at most 1"):
        load_config(None, {"parallel.tp": 2})
