"""Fault tolerance with any layout inside a replica group: two groups of two ranks each (ZeRO-3,
tensor, pipeline, context or expert parallel, or data parallel over dp_replicate), or of four
(HSDP), train as one process trains their joint batch and end on the same local tensors bit for bit (a
mixture's routing biases too, moved by the load of both groups), the lowest group writes the checkpoints
with both its ranks, and a group that starts late heals from its peer's local shards, loss scale and
routing biases and holds them bit for bit.

No launcher: a Lighthouse per job in this process, and each group's ranks forked
(tests/forked_ranks.py) from a thread of its own; both groups run every job one after another in
one launch (tests/dist_worker.py), each job with its own Lighthouse."""

from __future__ import annotations

import json
import threading
import time
import zlib
from pathlib import Path

import pytest
import torch

from scaletrain.train.trainer import Trainer
from scaletrain.verify import TOLERANCES

from conftest import MICRO, Lazy, assert_same_run, micro_cfg, wanted_params

pytestmark = pytest.mark.multiproc

STEPS = 4
TOL = TOLERANCES["32-true"]  # (loss, grad norm) relative, every step: what the parity tests allow
GROUP = {"train.steps": STEPS, "train.global_batch": 4, "train.micro_batch": 2, "fault_tolerance.groups": 2,
         "fault_tolerance.quorum_timeout_s": 60, "fault_tolerance.step_timeout_s": 60}
LAYOUTS = {  # inside each group of two ranks
    "zero3": {"parallel.zero": 3, "checkpoint.save_final": True},  # only group 0 writes: with both ranks
    "tp2": {"parallel.tp": 2},
    # tied embedding: its copies on the first and last stage; a checkpoint holds both stages
    "pp2-1f1b": {"parallel.pp": 2, "parallel.pp_schedule": "1f1b", "checkpoint.save_final": True},
    "cp2-ring": {"parallel.cp": 2, "parallel.cp_method": "ring"},
    "dp-replicate2": {"parallel.dp_replicate": 2},  # two ranks only: no dp_shard left to shard (DDP)
    # experts split over both ranks, the rest ZeRO-3; the routing biases moved by the load counts summed
    # over the groups (a rate that changes the routing within the run), as by the joint batch's
    "ep2-zero3": {"parallel.ep": 2, "parallel.zero": 3, "model.moe_experts": 4, "model.moe_top_k": 2,
                  "model.moe_bias_rate": 0.05},
    # Muon (optim/whole.py gathers each matrix to an owner inside the group): the groups' gradient
    # sum reaches it before its step, its momentum shards as ZeRO-3 shards the weights
    "zero3-muon": {"parallel.zero": 3, "optim.name": "muon", "optim.muon.ns_dtype": "fp32"},
}
FOUR = {  # inside each group of four ranks (one launch more): HSDP, ZeRO-3 over 2 x 2 ranks
    "hsdp-zero3": {"parallel.zero": 3, "parallel.dp_replicate": 2, "train.micro_batch": 1},
}
# DiLoCo across the groups (dp_sync=diloco with dp_replicate 1: each group a worker), a sync every 2 steps,
# each group sharded over its two ranks as a local-SGD worker can be
DILOCO = {f"diloco-{name}": {**inside, "parallel.sync.mode": "diloco", "parallel.sync.every": 2} for name, inside in (
    ("zero3", {"parallel.zero": 3}), ("tp2", {"parallel.tp": 2}),
    ("pp2", {"parallel.pp": 2, "parallel.pp_schedule": "1f1b"}), ("cp2", {"parallel.cp": 2}),
    # experts over both ranks, balanced by the auxiliary loss (routing biases are refused across DiLoCo groups)
    ("ep2", {"parallel.ep": 2, "model.moe_experts": 4, "model.moe_top_k": 2, "model.moe_bias_rate": 0.0}))}
# the joint run's model and optimizer
MODEL_KEYS = ("model.moe_experts", "model.moe_top_k", "model.moe_bias_rate", "optim.name", "optim.muon.ns_dtype")
HEAL_STEPS, HEAL_AT = 6, 3  # group 1 of the heal job starts once group 0 has logged HEAL_AT steps alone
PROBE = "test_ft_layouts"


def _local_bytes(t) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t
    return zlib.crc32(t.detach().cpu().contiguous().view(-1).view(dtype=torch.uint8).numpy())


def local_state(trainer):
    """A probe (tests/dist_worker.py): after the run, a checksum of each of this rank's local
    tensors (weights the optimizer steps, optimizer state) and the replica groups' counters."""
    from scaletrain.parallel.fault_tolerance import ReplicaGroups

    def report() -> dict:
        sums = {n: _local_bytes(p) for n, p in trainer.pm.optim_params}
        for n, p in trainer.pm.optim_params:
            for k, v in trainer.optimizer.state[p].items():
                if hasattr(v, "shape"):
                    sums[f"{n}/{k}"] = _local_bytes(v)
        scaler = trainer.precision.scaler.state_dict() if trainer.precision.scaler else None
        return {"crc": sums, "healed": trainer.hooks.find(ReplicaGroups).healed, "scaler": scaler,
                "biases": _biases(trainer)}

    return report


def _biases(trainer) -> dict[str, list[float]]:
    """Each MoE layer's routing bias on this rank (its pipeline stages'), by name."""
    from scaletrain.parallel.moe_balance import moe_layers

    return {n: m.expert_bias.tolist() for n, m in moe_layers(trainer.pm.dp.models).items()}


def _marker(trainer) -> Path:
    return Path(trainer.cfg.log.run_dir).parent / "group1-joins"


def held_group(trainer):
    """Group 0 of the heal job: before step HEAL_AT + 1 it waits until group 1 is about to ask for
    its first quorum (then a moment more, so that the Lighthouse holds group 1's request first)."""
    real = trainer.train_step

    def step(batches):
        if trainer.step == HEAL_AT:
            deadline = time.monotonic() + 120
            while not _marker(trainer).exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.5)
        return real(batches)

    trainer.train_step = step
    return local_state(trainer)


def late_group(trainer):
    """Group 1 of the heal job: says when it asks for its first quorum (the heal happens there)."""
    from scaletrain.parallel.fault_tolerance import ReplicaGroups

    hook = trainer.hooks.find(ReplicaGroups)
    real = hook.start

    def start():
        if trainer.rt.rank == 0:
            _marker(trainer).touch()
        real()

    hook.start = start
    return local_state(trainer)


def _lighthouse(monkeypatch, min_replicas: int, join_timeout_ms: int):
    from scaletrain.cli.lighthouse import start_lighthouse

    monkeypatch.setenv("RUST_LOG", "warn")  # start_lighthouse's default, undone after the module
    server = start_lighthouse("127.0.0.1:0", min_replicas, join_timeout_ms, 5000)
    return server, f"http://127.0.0.1:{server.address().rsplit(':', 1)[1]}"  # loopback: the groups' stores too


def _jobs(tmp: Path, names: list[str], lighthouses: dict, group: int) -> list[dict]:
    jobs = []
    for name in names:
        ft = {**GROUP, "fault_tolerance.enabled": True, "fault_tolerance.replica_id": group,
              "fault_tolerance.lighthouse": lighthouses[name], "log.run_dir": str(tmp / name / f"group{group}")}
        if name == "heal":  # experts over 2 ranks, the rest ZeRO-3; group 0 alone for HEAL_AT steps (min_replicas
            # 1), then both. fp16, the late group's first loss scale another (as a group resumed from an older
            # checkpoint): it takes the peer's scale, grown once (growth_interval 2) in the steps it trained alone,
            # and the routing biases those steps moved
            job = {"overrides": {**MICRO, **ft, **LAYOUTS["ep2-zero3"], "train.steps": HEAL_STEPS,
                                 "fault_tolerance.min_replicas": 1, "precision.mode": "16-mixed",
                                 "precision.growth_interval": 2, "precision.init_scale": 1024.0 * (1 + 6 * group)},
                   "probe": f"{PROBE}:{'held_group' if group == 0 else 'late_group'}"}
            if group == 1:
                job["wait_for"] = [str(tmp / name / "group0" / "metrics.jsonl"), HEAL_AT]
        else:
            job = {"overrides": {**MICRO, **ft, **{**LAYOUTS, **DILOCO, **FOUR}[name],
                                 "fault_tolerance.min_replicas": 2},
                   "probe": f"{PROBE}:local_state"}
        jobs.append(job)
    return jobs


@pytest.fixture(scope="module")
def groups(request, tmp_path_factory):
    """{job: (group 0's results, group 1's results)}: every job this session's tests ask for, run
    by the two groups in one launch per group size (two ranks each, then four)."""
    wanted = wanted_params(request, "name")
    tmp = tmp_path_factory.mktemp("ftl")
    runs = Runs()
    runs.folder = tmp  # each job's groups' run folders: folder / job / groupR
    for nproc, names in ((2, [*LAYOUTS, *DILOCO, "heal"]), (4, list(FOUR))):
        names = [n for n in names if wanted is None or n in wanted]
        if names:
            runs.update(_launch(tmp, nproc, names))
    return runs


def _launch(tmp: Path, nproc: int, names: list[str]) -> dict:
    """Both groups of `nproc` ranks each running `names` one after another, each job with a
    Lighthouse of its own (a fresh quorum), each group's ranks forked from a thread of its own."""
    from forked_ranks import run_forked

    with pytest.MonkeyPatch.context() as mp:
        servers = {n: _lighthouse(mp, 1 if n == "heal" else 2, 30000 if n == "heal" else 1000) for n in names}
        outcome: dict[int, tuple[int, str]] = {}

        def run(g: int) -> None:
            spec = tmp / f"group{g}-{nproc}.json"
            spec.write_text(json.dumps({"jobs": _jobs(tmp, names, {n: a for n, (_, a) in servers.items()}, g),
                                        "out": str(spec.with_suffix(".out.json"))}))
            outcome[g] = run_forked("dist_worker:main", [str(spec)], nproc, timeout=400)

        t0 = time.monotonic()
        threads = [threading.Thread(target=run, args=(g,)) for g in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        seconds = time.monotonic() - t0
        for server, _ in servers.values():
            server.shutdown()
    for g in (0, 1):
        assert outcome[g][0] == 0, f"group {g} failed:\n{outcome[g][1][-6000:]}"
    results = [json.loads((tmp / f"group{g}-{nproc}.out.json").read_text()) for g in (0, 1)]
    print(f"{len(names)} jobs of 2 groups x {nproc} ranks in {seconds:.1f} s")
    return {n: (a, b) for n, a, b in zip(names, *results, strict=True)}


class Runs(dict):
    folder: Path


def _model(layout: dict) -> dict:
    return {k: v for k, v in layout.items() if k in MODEL_KEYS}


@pytest.fixture(scope="module")
def joint(tmp_path_factory):
    """joint[name]: one process training the groups' joint batch (2 x train.global_batch) of that
    layout's model, in micro-batches of 2 (one run per model)."""
    def fit(model: dict) -> dict:
        cfg = micro_cfg(tmp_path_factory.mktemp("joint"), **{"train.steps": STEPS, "train.global_batch": 8,
                                                              "train.micro_batch": 2, **model})
        trainer = Trainer(cfg)
        return {"history": trainer.fit()["history"], "biases": _biases(trainer)}

    runs: dict = {}  # one run per model (and optimizer)

    def run(name: str) -> dict:
        model = _model({**LAYOUTS, **FOUR}[name])
        key = tuple(sorted(model.items()))
        if key not in runs:
            runs[key] = fit(model)
        return runs[key]

    return run


def _crc(result: dict) -> list[dict]:
    return [r["probe"]["crc"] for r in sorted(result["ranks"], key=lambda r: r["rank"])]


@pytest.mark.parametrize("name", [*LAYOUTS, *FOUR])
def test_two_groups_of_a_layout_train_as_one_process_on_their_joint_batch(groups, joint, name):
    """Both groups in every step (min_replicas 2): the mean of their losses and their common
    gradient norm are one process's on the joint batch, and the two groups end with the same
    local tensors on each rank (shards, stages, optimizer state) bit for bit."""
    g0, g1 = groups[name]
    h0, h1 = g0["history"], g1["history"]
    assert [r["step"] for r in h0] == [r["step"] for r in h1] == list(range(1, STEPS + 1))
    assert [r["ft_groups"] for r in h0 + h1] == [2.0] * (2 * STEPS)
    both = [{"step": a["step"], "loss": (a["loss"] + b["loss"]) / 2, "grad_norm": a["grad_norm"]}
            for a, b in zip(h0, h1, strict=True)]  # the joint mean: both groups count the same tokens
    assert_same_run(both, joint(name)["history"], steps=STEPS, tol=TOL, what=name)
    assert [a["grad_norm"] for a in h0] == [b["grad_norm"] for b in h1]  # one averaged gradient, bit for bit
    assert _crc(g0) == _crc(g1), f"{name}: the groups' local tensors differ"


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory):
    """two_workers(name): verify's one-process simulation of two DiLoCo workers of that job's model,
    synced as DILOCO's, each reading the windows of a group with that job's data-parallel ranks inside
    (the group's share of the joint batch of 8 is cut among them as among dp_replicate x dp ranks)."""
    from scaletrain.layout import Layout
    from scaletrain.verify import isolated, simulate_workers

    def simulate(dp: int, model: dict) -> list[dict]:
        tmp = tmp_path_factory.mktemp("workers")
        cfg = micro_cfg(tmp, **{"train.steps": STEPS, "train.global_batch": 8, "train.micro_batch": 2,
                                "parallel.dp_replicate": 2, "parallel.sync.mode": "diloco", "parallel.sync.every": 2,
                                **model})
        return simulate_workers(isolated(cfg, tmp / "ref", STEPS), Layout.from_config(cfg, 2 * dp), STEPS, tmp / "ref")

    def key(name: str) -> tuple:  # one simulation per (dp, model)
        group = micro_cfg(tmp_path_factory.getbasetemp(), **{**GROUP, **DILOCO[name], "fault_tolerance.enabled": True,
                                                             "fault_tolerance.lighthouse": "http://127.0.0.1:1"})
        return Layout.from_config(group, 2).dp_shard, tuple(_model(DILOCO[name]).items())

    runs = Lazy({k: lambda k=k: simulate(k[0], dict(k[1])) for k in map(key, DILOCO)})
    return lambda name: runs[key(name)]


@pytest.mark.parametrize("name", [*DILOCO])
def test_diloco_groups_sharded_inside_train_as_the_simulated_workers(groups, two_workers, name):
    """Each group a DiLoCo worker with ZeRO-3, tp, pp, cp or ep over its two ranks: every step's mean loss of
    the two groups and the root mean square of their gradient norms are verify's one-process
    simulation of two workers (syncs after steps 2 and 4 included), and after the last sync both
    groups hold the same weights on each rank, bit for bit."""
    import math

    g0, g1 = groups[name]
    h0, h1 = g0["history"], g1["history"]
    assert [r["step"] for r in h0] == [r["step"] for r in h1] == list(range(1, STEPS + 1))
    both = [{"step": a["step"], "loss": (a["loss"] + b["loss"]) / 2,
             "grad_norm": math.hypot(a["grad_norm"], b["grad_norm"]) / math.sqrt(2)}
            for a, b in zip(h0, h1, strict=True)]
    assert_same_run(both, two_workers(name), steps=STEPS, tol=TOL, what=name)
    assert h0[0]["grad_norm"] != h1[0]["grad_norm"]  # each group its own gradients between syncs

    def weights(result):  # (the inner optimizers' states are each group's own)
        return [{k: v for k, v in crc.items() if "/" not in k} for crc in _crc(result)]

    assert weights(g0) == weights(g1), f"{name}: the groups' weights differ after the last sync"


@pytest.mark.parametrize("name", ["ep2-zero3"])
def test_routing_biases_move_by_the_load_of_every_group_as_for_the_joint_batch(groups, joint, name):
    """The step's expert load counts are summed over the groups before the commit vote: every rank of
    both groups ends with the routing biases of one process on the joint batch, bit for bit (each
    bias moves by whole steps of model.moe_bias_rate, so one count off shows as a whole step)."""
    want = joint(name)["biases"]
    assert any(b != 0 for bias in want.values() for b in bias), "the biases never moved: the test is blind"
    for g, result in enumerate(groups[name]):
        for r in result["ranks"]:
            assert r["probe"]["biases"] == want, f"group {g} rank {r['rank']}: {r['probe']['biases']} vs {want}"


@pytest.mark.parametrize("name", ["heal"])
def test_a_late_zero3_group_heals_from_its_peers_shards_and_then_holds_them_bit_for_bit(groups, name):
    """Group 0 trains HEAL_AT steps alone; group 1 starts then, finds itself behind the quorum,
    takes group 0's local ZeRO-3 and expert shards, optimizer state, step, fp16 loss scale and routing
    biases over HTTP (rank i from rank i),
    and both train the remaining steps together on the same weights."""
    g0, g1 = groups[name]
    h0, h1 = g0["history"], g1["history"]
    assert [r["step"] for r in h0] == list(range(1, HEAL_STEPS + 1))
    assert [r["step"] for r in h1] == list(range(HEAL_AT + 1, HEAL_STEPS + 1))  # it went on from the peer's step
    assert [r["ft_groups"] for r in h0[:HEAL_AT]] == [1.0] * HEAL_AT
    assert [r["ft_groups"] for r in h0[HEAL_AT:] + h1] == [2.0] * (2 * (HEAL_STEPS - HEAL_AT))
    assert [r["probe"]["healed"] for r in g0["ranks"]] == [0, 0]
    assert [r["probe"]["healed"] for r in g1["ranks"]] == [1, 1]  # each rank from its counterpart
    assert [a["grad_norm"] for a in h0[HEAL_AT:]] == [b["grad_norm"] for b in h1]
    assert _crc(g0) == _crc(g1), "the healed group's local shards differ from its peer's"
    assert [a["loss_scale"] for a in h0[HEAL_AT:]] == [b["loss_scale"] for b in h1]  # fp16: the peer's scale
    assert [r["probe"]["scaler"] for r in g1["ranks"]] == [r["probe"]["scaler"] for r in g0["ranks"]]
    assert h0[0]["loss_scale"] == 1024.0 and h0[-1]["loss_scale"] > 1024.0  # it grew: the test is not blind
    biases = [r["probe"]["biases"] for r in g0["ranks"]]
    assert [r["probe"]["biases"] for r in g1["ranks"]] == biases  # the peer's, moved alike since
    assert any(b != 0 for bias in biases[0].values() for b in bias)


@pytest.mark.parametrize("name", ["zero3", "pp2-1f1b"])
def test_the_lowest_group_writes_the_checkpoint_with_all_its_ranks_and_the_other_none(groups, name):
    """writes_checkpoint is the same on every rank of a group: group 0's two ranks save together
    (both ZeRO-3 shards, both pipeline stages), group 1 writes nothing."""
    from scaletrain.train import checkpoint as ckpt

    folder = groups.folder / name
    saved = ckpt.complete_checkpoints(folder / "group0" / "checkpoints")
    assert [p.name for p in saved] == [f"step_{STEPS:08d}"]
    assert ckpt.verify_checkpoint(saved[0]) is None
    assert sorted(p.name for p in saved[0].glob("rng_rank*")) == ["rng_rank0.json", "rng_rank1.json"]
    assert not (folder / "group1" / "checkpoints").exists()
