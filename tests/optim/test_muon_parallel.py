"""optim.name=muon on real processes (gloo on CPU): under ZeRO-1/2/3, HSDP, tp (+sp), ZeRO-3 and ZeRO-1 x tp
(an owner per matrix among the 4 ranks), ep x ZeRO-3 on a mixture of experts, pp and cp, with accumulation,
every step's loss and gradient norm and the final weights (each parameter's update over the run) match one
process; the momentum shards like the parameters; a ZeRO-3 checkpoint resumes on one process.

Newton-Schulz runs in fp32 here (optim.muon.ns_dtype=fp32) for the same reason `scaletrain verify` runs it
so: in bf16 a layout's other summation order moves a value across a bf16 rounding now and then (the
exchange itself is the same in both dtypes: test_muon.py checks it in bf16, bit for bit)."""

from __future__ import annotations

import pytest

from scaletrain.layout import Layout
from scaletrain.plan.params import optimizer_bytes, rank_params
from scaletrain.train.trainer import Trainer
from scaletrain.verify import TOLERANCES

from conftest import (
    Lazy,
    assert_same_run,
    assert_same_weights,
    fit_reference,
    micro_cfg,
    micro_overrides,
    run_group,
    wanted_params,
)

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

STEPS = 3  # a ZeRO-3 checkpoint at step 2, resumed on one process for step 3
TOL = TOLERANCES["32-true"]
WEIGHTS_TOL = 1e-3  # final weights relative to their change over the run, as tests/parallel/test_data_parallel.py
MUON = {"optim.name": "muon", "optim.muon.ns_dtype": "fp32", "train.steps": STEPS}
MOE = {"model.moe_experts": 4, "model.moe_top_k": 2, "model.activation": "swiglu", "model.norm": "rmsnorm"}
PP = {"model.n_layers": 4, "model.tie_embeddings": False, "train.micro_batch": 2}

LAYOUTS = {  # ranks: [(name, overrides, reference)]
    2: [("zero1", {"parallel.zero": 1}, "plain"),
        ("zero2-accum", {"parallel.zero": 2, "train.micro_batch": 1}, "accum"),
        ("zero3", {"parallel.zero": 3, "checkpoint.every": 2}, "plain"),  # its checkpoint resumes on one process
        ("tp2-sp", {"parallel.tp": 2, "parallel.sp": True}, "plain"),
        ("ep2-zero3", {"parallel.ep": 2, "parallel.zero": 3, **MOE}, "moe"),
        ("pp2", {"parallel.pp": 2, **PP}, "pp"),
        ("cp2", {"parallel.cp": 2}, "plain")],
    4: [("hsdp-zero3", {"parallel.zero": 3, "parallel.dp_replicate": 2}, "plain"),
        ("zero3-tp2", {"parallel.zero": 3, "parallel.dp_shard": 2, "parallel.tp": 2}, "plain"),
        ("zero1-tp2", {"parallel.zero": 1, "parallel.dp_shard": 2, "parallel.tp": 2}, "plain")],
}
REFERENCES = {"plain": {}, "accum": {"train.micro_batch": 1}, "moe": MOE, "pp": PP}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return Lazy({name: lambda name=name, extra=extra: fit_reference(
        micro_cfg(tmp_path_factory.mktemp(name), **{**MUON, **extra})) for name, extra in REFERENCES.items()})


@pytest.fixture(scope="module")
def groups(request, tmp_path_factory):
    """group(n): the results of the n-rank layouts the session's tests ask for, in one group of processes;
    group.folders[n]: the folder of their run folders (one per layout, by name)."""
    done, folders = {}, {}
    wanted = wanted_params(request, "name")

    def group(n: int) -> dict[str, dict]:
        if n not in done:
            tmp = folders[n] = tmp_path_factory.mktemp(f"muon{n}")
            layouts = [(name, extra) for name, extra, _ in LAYOUTS[n] if wanted is None or name in wanted]
            jobs = [{"overrides": micro_overrides(tmp / name, **{**MUON, **extra})} for name, extra in layouts]
            code, results, err = run_group(n, jobs, tmp)
            assert code == 0, err
            done[n] = {name: result for (name, _), result in zip(layouts, results, strict=True)}
        return done[n]

    group.folders = folders
    return group


@pytest.mark.parametrize("n,name,ref", [(n, name, ref) for n, layouts in LAYOUTS.items() for name, _, ref in layouts],
                         ids=[f"{n}ranks-{name}" for n, layouts in LAYOUTS.items() for name, _, _ in layouts])
def test_parity_with_one_process(groups, reference, n, name, ref):
    result = groups(n)[name]
    assert_same_run(result["history"], reference[ref]["history"], steps=STEPS, tol=TOL, what=f"muon {n} ranks {name}")
    assert_same_weights(result["weights"], reference[ref]["weights"], tol=WEIGHTS_TOL, what=f"muon {n} ranks {name}")


@pytest.mark.parametrize("name", ["zero3"])  # the layout it reads (conftest.wanted_params)
def test_momentum_is_sharded_like_the_parameters(groups, tmp_path, name):
    """Under ZeRO-3 on 2 ranks each rank holds half of Muon's momentum and of AdamW's moments (the
    planner's figure over 2, within 5%: AdamW's step counters and uneven rows aside)."""
    result = groups(2)[name]
    cfg = micro_cfg(tmp_path, **MUON)
    half = optimizer_bytes("muon", rank_params(cfg.model, Layout(), 0)) / 2
    for r in result["ranks"]:
        measured = r["state_bytes"]["optimizer"]
        assert abs(measured - half) / half < 0.05, (r["rank"], measured, half)


@pytest.mark.parametrize("name", ["zero3"])  # the 2-rank layout whose checkpoint it resumes
def test_a_zero3_checkpoint_resumes_on_one_process(groups, tmp_path, reference, name):
    groups(2)
    step2 = groups.folders[2] / name / "checkpoints" / "step_00000002"
    one = Trainer(micro_cfg(tmp_path / "one", **{**MUON, "checkpoint.resume": str(step2)})).fit()
    assert_same_run(one["history"], reference["plain"]["history"], steps=STEPS, first=3, tol=TOL,
                    what="muon zero 3, 2 ranks -> 1 process")
