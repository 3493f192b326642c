"""Expert parallelism on real processes (gloo on CPU): the experts split over ep ranks borrowed
from the data-parallel, context-parallel and tensor-parallel ones, with DDP, ZeRO-1/2 and ZeRO-3
(and HSDP) for the rest, and with cp, pp and tp (with and without sp). Every step's loss and
gradient norm before clipping, the final weights (the experts gathered whole) and the routing
bias after the run match one process, with the Switch and z losses on; checkpoints reshard
across ep sizes; DiLoCo workers with ep inside each pass verify."""

from __future__ import annotations

import pytest
import torch

from scaletrain.layout import Layout
from scaletrain.model.moe import MoE
from scaletrain.model.names import canonical_name
from scaletrain.train.trainer import Trainer
from scaletrain.verify import TOLERANCES

from conftest import (
    MICRO,
    Lazy,
    assert_same_run,
    assert_same_weights,
    margin_text,
    micro_cfg,
    micro_overrides,
    run_group,
    wanted_params,
)
from dist_worker import weight_fingerprint

pytestmark = pytest.mark.multiproc

STEPS = 5
TOL = TOLERANCES["32-true"]
WEIGHTS_TOL = 1e-3  # as tests/parallel/test_data_parallel.py
GRAD_TOL = 1e-4  # the first step's gradients, relative to their norm (seen: below 1e-6)
BIAS_TOL = 1e-6  # the bias moves by exact multiples of the rate: equal, or a whole step apart
# 8 experts, top 2 (4 experts per rank at ep 2, 2 at ep 4: the regrouping by local expert matters),
# SwiGLU experts, the balance losses on and a bias rate that changes the routing within the run
MOE = {"model.moe_experts": 8, "model.moe_top_k": 2, "model.moe_aux_loss": 0.01, "model.moe_z_loss": 0.001,
       "model.moe_bias_rate": 0.01, "model.activation": "swiglu", "model.norm": "rmsnorm", "train.steps": STEPS}
SGD = {"optim.name": "sgd", "optim.lr": 0.1, "train.grad_clip": 0.0}
UNTIED = {"model.tie_embeddings": False}

LAYOUTS_4 = [  # (name, overrides, reference) on 4 ranks
    ("ep2-ddp", {"parallel.ep": 2, "parallel.zero": 0}, "plain"),
    ("ep4-zero3", {"parallel.ep": 4, "parallel.zero": 3}, "plain"),
    ("ep2-zero3-ac", {"parallel.ep": 2, "parallel.zero": 3, "memory.activation_checkpointing": "full"}, "plain"),
    ("ep2-zero1-accum", {"parallel.ep": 2, "parallel.zero": 1, "train.micro_batch": 1}, "plain"),
    ("ep2-zero2-sgd-noclip", {"parallel.ep": 2, "parallel.zero": 2, **SGD}, "sgd"),
    ("ep2-hsdp-zero3", {"parallel.ep": 2, "parallel.zero": 3, "parallel.dp_replicate": 2}, "plain"),
    # ep borrows the cp ranks (ep 2: the two cp ranks of a dp rank; ep 4: the dp and the cp
    # ranks), the Switch loss's per-sequence counts summed over cp, the experts left out of cp's sum
    ("ep2xcp2-zero3", {"parallel.ep": 2, "parallel.cp": 2, "parallel.zero": 3}, "plain"),
    ("ep4xcp2", {"parallel.ep": 4, "parallel.cp": 2, "parallel.zero": 0}, "plain"),
    ("ep2xpp2", {"parallel.ep": 2, "parallel.pp": 2, "train.micro_batch": 2, **UNTIED}, "untied"),
    # ep borrows the tp ranks (each routes its own sequence shard: a slice of the replicated input,
    # or under sp the shard it holds); the experts left out of the tp engines (replicate, FSDP)
    # and of the tp sum of the router's and shared experts' gradients
    ("ep2xtp2", {"parallel.ep": 2, "parallel.tp": 2}, "plain"),
    ("ep2xtp2-sp", {"parallel.ep": 2, "parallel.tp": 2, "parallel.sp": True}, "plain"),
    ("ep2xtp2-zero3", {"parallel.ep": 2, "parallel.tp": 2, "parallel.zero": 3}, "plain"),
    ("ep4xtp2-zero1", {"parallel.ep": 4, "parallel.tp": 2, "parallel.zero": 1}, "plain"),
]
LAYOUTS_2 = [  # on 2 ranks: compiled blocks (inductor compiles on every rank: the cost of 2, not 4), their
    # all-to-all's split sizes dynamic after the first step, ZeRO-3 gathering and freeing around them
    ("ep2-zero3-compile", {"parallel.ep": 2, "parallel.zero": 3, "train.compile": True}, "plain"),
]
LAYOUTS = LAYOUTS_4 + LAYOUTS_2


def probe(trainer):
    """A probe (tests/dist_worker.py): every parameter's gradient of the first step before clipping
    (fingerprinted whole: dist_worker.weight_fingerprint), the routing biases after the run, and
    the bytes this rank's expert weights hold after it (replicas, their shards, and whole)."""
    layers = {canonical_name(n): m for chunk in trainer.pm.dp.models for n, m in chunk.named_modules()
              if isinstance(m, MoE)}  # a pipeline stage holds its own blocks' layers
    first = {}
    real = trainer.hooks.reduce_gradients

    def reduce(named):  # the gradients the norm and the optimizer see (context parallel: summed)
        real(named)
        if not first:
            first.update(weight_fingerprint([(n, p.grad) for n, p in named]))

    trainer.hooks.reduce_gradients = reduce
    return lambda: {"grads": first, "biases": {n: m.expert_bias.tolist() for n, m in layers.items()},
                    "expert_bytes": expert_bytes(trainer, layers.values())}


def expert_bytes(trainer, layers) -> dict:
    """Bytes of the expert weights on this rank: in the layers' parameters (the replicas), in
    what the optimizer steps for them, and what the rank's experts take whole."""
    replicas = [w for m in layers for w in (m.w1, m.w2, m.w3) if w is not None]
    ids = {id(w) for w in replicas}
    engine = getattr(trainer.pm.dp, "experts", None)  # expert parallelism's engine (ZeRO: the shards)
    shards = [p for _, p in engine.named_optim_params if id(p) not in ids] if engine is not None else []

    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    return {"replicas": sum(local(w).untyped_storage().nbytes() for w in replicas),
            "shards": sum(local(p).numel() * local(p).element_size() for p in shards),
            "whole": sum(local(w).numel() * local(w).element_size() for w in replicas)}


def fit_one(cfg) -> dict:
    trainer = Trainer(cfg)
    before = {n: p.detach().double().clone() for n, p in trainer.pm.dp.named_params}
    report = probe(trainer)
    history = trainer.fit()["history"]
    weights = weight_fingerprint(trainer.pm.dp.named_params)
    for n, p in trainer.pm.dp.named_params:
        weights[n].append((p.detach().double() - before[n]).norm().item())
    return {"history": history, "weights": weights, **report()}


def assert_same_gradients(got: dict, ref: dict, what: str) -> None:
    """The first step's gradients of every parameter (fingerprints) within GRAD_TOL of their norm."""
    assert sorted(got) == sorted(ref), f"{what}: gradients of {sorted(set(got) ^ set(ref))} in one run only"
    rel, name = max((max(abs(got[n][0] - ref[n][0]), abs(got[n][1] - ref[n][1])) / ref[n][0], n) for n in ref)
    assert rel <= GRAD_TOL, f"{what}: the gradient of {name} differs by {rel:.2e} of its norm = " \
                            f"{margin_text(rel, GRAD_TOL)}"


def assert_same_biases(ranks: list[dict], ref: dict, what: str) -> None:
    seen = set()
    for r in ranks:  # every rank's biases (of its stage's layers), moved every step by the whole step's load
        for name, bias in r["probe"]["biases"].items():
            worst = (torch.tensor(bias) - torch.tensor(ref[name])).abs().max().item()
            assert worst <= BIAS_TOL, f"{what}: rank {r['rank']}'s {name}.expert_bias differs by {worst:.2e} " \
                                      "from one process's"
            seen.add(name)
    assert seen == set(ref), f"{what}: the biases of {sorted(set(ref) - seen)} on no rank"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return Lazy({name: lambda name=name, extra=extra: fit_one(micro_cfg(tmp_path_factory.mktemp(name),
                                                                        **{**MOE, **extra}))
                 for name, extra in {"plain": {}, "sgd": SGD, "untied": UNTIED}.items()})


def resharding_jobs(tmp) -> list[tuple[str, dict]]:
    """Saved at ep 2 (ZeRO-3: the experts' shards) at step 2, resumed at ep 4 (ZeRO-3) and saved
    at step 4, resumed at ep 1 (DDP) for step 5: one job after the other in the same group."""
    a, b = tmp / "save-ep2", tmp / "ep2-to-ep4"
    return [("save-ep2", {"parallel.ep": 2, "parallel.zero": 3, "checkpoint.every": 2}),
            ("ep2-to-ep4", {"parallel.ep": 4, "parallel.zero": 3, "checkpoint.every": 4,
                            "checkpoint.resume": str(a / "checkpoints" / "step_00000002")}),
            ("ep4-to-ep1", {"parallel.ep": 1, "parallel.zero": 0,
                            "checkpoint.resume": str(b / "checkpoints" / "step_00000004")})]


@pytest.fixture(scope="module")
def ep_runs(request, tmp_path_factory):
    """The layouts and the resharding chain, in one group of 4 ranks, then the compiled layout in
    one of 2 (those the session's tests ask for: see conftest.wanted_params)."""
    tmp = tmp_path_factory.mktemp("ep4")
    wanted = wanted_params(request, "name")
    out = {}
    for nproc, layouts in ((4, [(n, e) for n, e, _ in LAYOUTS_4] + resharding_jobs(tmp)),
                           (2, [(n, e) for n, e, _ in LAYOUTS_2])):
        cases = [(name, extra) for name, extra in layouts if wanted is None or name in wanted]
        if not cases:
            continue
        jobs = [{"overrides": micro_overrides(tmp / name, **{**MOE, **extra}), "probe": "test_expert_parallel:probe"}
                for name, extra in cases]
        code, results, err = run_group(nproc, jobs, tmp)
        assert code == 0, err
        out.update({name: result for (name, _), result in zip(cases, results, strict=True)})
    return out


@pytest.mark.parametrize("name,ref", [(name, ref) for name, _, ref in LAYOUTS], ids=[n for n, _, _ in LAYOUTS])
def test_parity_with_one_process(ep_runs, reference, name, ref):
    result, want = ep_runs[name], reference[ref]
    grads = {}  # every stage's (pipeline stages hold different parameters; the others, copies)
    for r in result["ranks"]:
        grads.update(r["probe"]["grads"])
    assert_same_gradients(grads, want["grads"], name)
    assert_same_biases(result["ranks"], want["biases"], name)
    assert max(abs(b) for bias in want["biases"].values() for b in bias) > 0, "the bias never moved: the test is blind"
    assert_same_run(result["history"], want["history"], steps=STEPS, tol=TOL, what=name)
    assert_same_weights(result["weights"], want["weights"], tol=WEIGHTS_TOL, what=name)


@pytest.mark.parametrize("name", ["ep2-zero3-ac", "ep2xcp2-zero3", "ep2xtp2-zero3"])
def test_zero3_keeps_a_shard_of_the_experts_between_steps(ep_runs, name):
    """Under ZeRO-3 the experts are sharded like every other weight: after the run each rank's
    expert replicas hold no storage and the shards it steps are 1/N of its experts (N = the
    ranks holding the same experts, 2 here)."""
    for r in ep_runs[name]["ranks"]:
        got = r["probe"]["expert_bytes"]
        assert got["whole"] > 0 and got["replicas"] == 0, f"{name} rank {r['rank']}: {got}"
        assert got["shards"] == got["whole"] // 2, f"{name} rank {r['rank']}: {got}"


@pytest.mark.parametrize("name", [("save-ep2", "ep2-to-ep4", "ep4-to-ep1")], ids=["ep2-ep4-ep1"])
def test_checkpoints_reshard_across_ep_sizes(ep_runs, reference, name):
    """Saved at ep 2, resumed at ep 4, saved again and resumed at ep 1: the same losses and
    gradient norms as one process's uninterrupted run, the same final weights and bias."""
    ref = reference["plain"]
    assert_same_run(ep_runs["save-ep2"]["history"], ref["history"], steps=STEPS, tol=TOL, what="ep 2")
    assert_same_run(ep_runs["ep2-to-ep4"]["history"], ref["history"], steps=STEPS, first=3, tol=TOL,
                    what="ep 2 -> ep 4")
    last = ep_runs["ep4-to-ep1"]
    assert_same_run(last["history"], ref["history"], steps=STEPS, first=5, tol=TOL, what="ep 2 -> ep 4 -> ep 1")
    assert_same_weights(last["weights"], ref["weights"], tol=WEIGHTS_TOL, what="ep 2 -> ep 4 -> ep 1")
    assert_same_biases(last["ranks"], ref["biases"], "ep 2 -> ep 4 -> ep 1")


@pytest.mark.parametrize("overrides,world,fragment", [
    ({**MOE, "parallel.ep": 3}, 4,
     "parallel.ep=3 borrows its ranks from the dp_shard × cp × tp ranks, so it must divide "
     "dp_shard × cp × tp = 4 × 1 × 1 = 4"),
    ({**MOE, "parallel.ep": 4, "model.moe_experts": 6}, 4, "parallel.ep=4 must divide model.moe_experts=6"),
    ({"parallel.ep": 2}, 2, "the model is dense (model.moe_experts=0)"),
], ids=["ep-not-dividing-dp-shard", "ep-not-dividing-experts", "ep-on-a-dense-model"])
def test_layout_errors(tmp_path, overrides, world, fragment):
    cfg = micro_cfg(tmp_path, **overrides)
    problems = Layout.from_config(cfg, world).errors(cfg.model, seq_len=cfg.data.seq_len)
    assert sum(fragment in p for p in problems) == 1, problems


@pytest.mark.usefixtures("forked_launches")  # verify's ranks forked (conftest.forked_launches)
def test_diloco_workers_with_expert_parallelism_pass_verify(tmp_path):
    """2 DiLoCo workers of 2 ranks each, experts split over each worker's 2 ranks: every step's
    loss and gradient norm as verify's simulation of the workers (the experts' gradients are
    averaged within a worker, never across workers between syncs)."""
    from conftest import run_here

    args = [f"--{k}={v}" for k, v in {**MICRO, **MOE, "parallel.dp_replicate": 2, "parallel.dp_shard": 2,
                                      "parallel.ep": 2, "parallel.sync.mode": "diloco",
                                      "parallel.sync.every": 2}.items()
            if not k.startswith(("log.", "checkpoint.", "train.steps"))]
    r = run_here("verify", f"--steps={STEPS}", *args, "--nproc=4")
    verdict = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""
    assert r.returncode == 0 and verdict.endswith(" (precision 32-true): PASS"), f"{r.stdout}{r.stderr}"
