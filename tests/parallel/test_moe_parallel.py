"""A mixture of experts (expert bias, Switch loss and z-loss on) under data parallelism, ZeRO-3,
tensor parallelism (with and without sequence parallelism), pipeline and context parallelism,
on real processes (gloo on CPU), all in one launch of 2 ranks: the first step's gradients, every
step's loss and gradient norm before clipping, the final weights and the expert biases after the
run match one process."""

from __future__ import annotations

import pytest

from scaletrain.layout import Layout
from scaletrain.verify import TOLERANCES
from test_expert_parallel import assert_same_gradients, fit_one

from conftest import assert_same_run, assert_same_weights, micro_cfg, micro_overrides, run_group

pytestmark = pytest.mark.multiproc

STEPS = 4
TOL = TOLERANCES["32-true"]
WEIGHTS_TOL = 1e-3  # as tests/parallel/test_model_parallel.py
# 4 blocks, the first dense (a tp plan mixing both kinds), untied embeddings (for pipelining);
# the Switch loss's coefficient large enough that a wrong share of it shows in the gradient norm
MOE = {"train.steps": STEPS, "model.n_layers": 4, "model.tie_embeddings": False, "train.micro_batch": 2,
       "model.moe_experts": 4, "model.moe_top_k": 2, "model.moe_first_dense": 1, "model.moe_aux_loss": 0.5,
       "model.moe_z_loss": 0.01, "model.moe_bias_rate": 0.05, "model.activation": "swiglu",
       "model.moe_shared_experts": 1, "model.position": "rope"}
LAYOUTS = [
    ("dp2-ddp", {"parallel.dp_shard": 2, "parallel.zero": 0}),
    ("dp2-zero3", {"parallel.dp_shard": 2, "parallel.zero": 3}),
    ("tp2", {"parallel.tp": 2}),
    ("tp2-sp", {"parallel.tp": 2, "parallel.sp": True}),
    ("pp2-1f1b", {"parallel.pp": 2, "parallel.pp_schedule": "1f1b"}),
    ("pp2-zero-bubble", {"parallel.pp": 2, "parallel.pp_schedule": "zero-bubble", "parallel.pp_virtual_stages": 2}),
    ("cp2-ring", {"parallel.cp": 2, "parallel.cp_method": "ring"}),
]
# two workers that sync every 2 steps: each moves its own biases from its own tokens, as the
# simulation of `scaletrain verify` (the workers one after the other in one process) does
WORKERS = ("local-sgd", {"parallel.dp_replicate": 2, "parallel.sync.mode": "local_sgd", "parallel.sync.every": 2})


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process: its history, first step's gradients, final weights (fingerprinted with the norm
    of their change over the run, what assert_same_weights measures a difference against), biases."""
    return fit_one(micro_cfg(tmp_path_factory.mktemp("one"), **MOE))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("moe-mp")
    jobs = [{"overrides": micro_overrides(tmp / name, **{**MOE, **extra}), "probe": "test_expert_parallel:probe"}
            for name, extra in [*LAYOUTS, WORKERS]]
    code, results, err = run_group(2, jobs, tmp)
    assert code == 0, err
    return {name: r for (name, _), r in zip([*LAYOUTS, WORKERS], results, strict=True)}


@pytest.mark.parametrize("name", [n for n, _ in LAYOUTS])
def test_moe_parity_with_one_process(runs, reference, name):
    got = runs[name]
    grads, biases = {}, {}
    for rank in got["ranks"]:  # pipeline ranks each hold their stages' parameters and layers
        grads.update(rank["probe"]["grads"])
        biases.update(rank["probe"]["biases"])
    assert_same_gradients(grads, reference["grads"], name)
    assert_same_run(got["history"], reference["history"], steps=STEPS, tol=TOL, what=name)
    assert_same_weights(got["weights"], reference["weights"], tol=WEIGHTS_TOL, what=name)
    assert sorted(biases) == sorted(reference["biases"]) == ["layers.1.moe", "layers.2.moe", "layers.3.moe"]
    assert any(any(b) for b in reference["biases"].values()), "the biases never moved in the reference"
    for layer, want in reference["biases"].items():
        assert biases[layer] == want, f"{name}: the bias of {layer} after {STEPS} steps differs from one process's"
    # every rank holding a layer holds the same bias (tp and dp ranks: copies)
    for rank in got["ranks"]:
        for layer, b in rank["probe"]["biases"].items():
            assert b == reference["biases"][layer], f"{name}: rank {rank['rank']}'s bias of {layer}"
    # the metrics see every layer (pipeline: summed over the stages) and the whole step's load
    assert got["history"][-1]["moe_imbalance"] == reference["history"][-1]["moe_imbalance"]


def test_moe_workers_match_their_simulation(runs, tmp_path):
    from scaletrain.verify import compare, isolated, simulate_workers, verdict

    cfg = micro_cfg(tmp_path, **{**MOE, **WORKERS[1]})
    layout = Layout.from_config(cfg, 2)
    ref = simulate_workers(isolated(cfg, tmp_path / "ref", STEPS), layout, STEPS, tmp_path / "ref")
    ok, line = verdict(compare(runs[WORKERS[0]]["history"], ref), STEPS, "32-true", layout.sync_dtype)
    assert ok, line
