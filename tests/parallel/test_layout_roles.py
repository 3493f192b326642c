"""Meshes named by role (issue 46): the Layout answers every derived fact of the ranks once, and the
Runtime hands out the mesh of each role; the parts ask them instead of deriving them again."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from scaletrain.layout import MESH_AXES, Layout

SHAPES = [dict(pp=2, dp_replicate=3, dp_shard=2, cp=2, tp=2), dict(dp_shard=5, tp=3), dict(pp=3, cp=2),
          dict(dp_replicate=2, dp_shard=3, tp=2, ep=3), dict()]


@pytest.mark.parametrize("sizes", SHAPES, ids=lambda s: "x".join(f"{k}{v}" for k, v in s.items()) or "one")
def test_each_axis_stride_is_the_rank_distance_of_its_neighbours_in_the_mesh(sizes):
    """Reference: the global ranks laid out as the mesh lays them (row-major over MESH_AXES, as
    init_device_mesh does), and the rank distance between two neighbours along each axis."""
    lay = Layout(**sizes)
    ranks = np.arange(lay.world).reshape(lay.mesh_shape)
    for i, axis in enumerate(MESH_AXES):
        if lay.mesh_shape[i] == 1:
            continue
        step = [0] * len(MESH_AXES)
        step[i] = 1
        assert lay.stride(axis) == ranks[tuple(step)] - ranks[(0,) * len(MESH_AXES)], axis


@pytest.mark.parametrize("dp_sync,dp_replicate,zero,axis,replicas,shard_axes", [
    ("step", 2, 3, "dp", 2, ("dp_replicate", "dp_shard")),  # HSDP: every dp rank, sharded within a replica
    ("step", 1, 3, "dp", 1, ("dp_shard",)),
    ("diloco", 2, 3, "dp_shard", 1, ("dp_shard",)),  # the workers shard on their own, sync every H steps
    ("local_sgd", 3, 0, "dp_shard", 1, ("dp_shard",)),
])
def test_the_ranks_that_reduce_every_step(dp_sync, dp_replicate, zero, axis, replicas, shard_axes):
    lay = Layout(dp_replicate=dp_replicate, dp_shard=2, zero=zero, dp_sync=dp_sync)
    assert (lay.step_axis, lay.step_replicas, lay.shard_axes) == (axis, replicas, shard_axes)
    assert lay.step_dp == (2 * dp_replicate if dp_sync == "step" else 2)


def test_the_expert_shard_ranks_are_those_ep_borrows_from_divided_by_ep():
    """Hand-counted: dp_shard 4 × cp 2 × tp 2 = 16 ranks route different tokens, ep 4 splits the
    experts over groups of 4, so 16 / 4 = 4 ranks hold the same experts; with two workers syncing
    every H steps each reduces within its own."""
    lay = Layout(dp_replicate=2, dp_shard=4, cp=2, tp=2, ep=4)
    assert lay.expert_shard_ranks == 4 and lay.expert_dp == 2 * 4 and lay.expert_step_axis == "expert_dp"
    local = Layout(dp_replicate=2, dp_shard=4, cp=2, tp=2, ep=4, dp_sync="diloco")
    assert local.expert_dp == 4 and local.expert_step_axis == "dp_shard"


def test_the_layout_as_options_carries_its_global_batch():
    for micro, accum, dp in itertools.product((1, 3), (1, 2), (1, 5)):
        lay = Layout(dp_shard=dp, micro_batch=micro, grad_accum=accum)
        assert lay.config_overrides()["train.global_batch"] == micro * accum * dp
