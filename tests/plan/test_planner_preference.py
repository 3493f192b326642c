"""The planner knows a preference run (issue 49 #8): a pair is two sequences of one micro-batch, the reference's
memory under each of its three ways (a frozen copy: the policy's parameter bytes again, sharded alike; adapters
off and precomputed: nothing), its forward in the step time, and the frozen copy's bytes as the trainer holds
them (measured)."""

from __future__ import annotations

import dataclasses

import pytest

from scaletrain.hardware import lookup
from scaletrain.model.presets import preset_config
from scaletrain.plan import Layout, plan
from scaletrain.plan.params import rank_params
from scaletrain.plan.search import enumerate_layouts, evaluate, layout_errors
from scaletrain.plan.spec import Cluster, Workload

from conftest import run_here

H100 = lookup("H100-SXM")


def workload(reference: str, objective: str = "preference") -> Workload:
    return Workload(seq_len=2048, global_batch=64, precision="bf16-mixed", objective=objective, reference=reference)


@pytest.mark.parametrize("layout", [Layout(dp_shard=8, zero=3, micro_batch=2, grad_accum=4),
                                    Layout(tp=4, dp_shard=2, zero=1, micro_batch=2, grad_accum=16),
                                    Layout(pp=2, tp=2, dp_shard=2, micro_batch=2, grad_accum=16)],
                         ids=["zero3", "tp4-zero1", "pp2-tp2"])
def test_the_reference_copy_costs_the_policys_parameter_bytes_and_a_forward(layout):
    cfg = preset_config("llama-8b")
    cluster = Cluster(H100, 1, 8)
    lm = evaluate(cfg, workload("none", "lm"), cluster, layout)
    by_mode = {mode: evaluate(cfg, workload(mode), cluster, layout) for mode in ("model", "adapters", "precomputed")}
    # a frozen copy: the policy's parameters again, bf16-mixed keeps fp32 parameters (4 bytes), split by tp and pp,
    # and by the shards under ZeRO-3; the worst stage's count (the first holds the embedding)
    held = max(rank_params(cfg, layout, r).total for r in range(layout.pp))
    shards = layout.dp if layout.zero == 3 else 1
    extra = by_mode["model"].memory.params - lm.memory.params
    assert extra == pytest.approx(4 * held / shards, rel=1e-9)
    assert by_mode["precomputed"].memory.params == by_mode["adapters"].memory.params == lm.memory.params
    # a forward a step where the reference is computed on the fly: a third of a forward and backward
    t = lm.time
    busy = (t.compute_s + t.tp_comm_s + t.cp_comm_s + t.pp_comm_s + t.ep_comm_s) * (1 + t.bubble_fraction)
    gathers = t.dp_comm_s / 3 if layout.zero == 3 else 0.0
    for mode in ("model", "adapters"):
        assert by_mode[mode].time.reference_s == pytest.approx(busy / 3 + gathers, rel=1e-9)
        assert by_mode[mode].time.step_time_s == pytest.approx(t.step_time_s + busy / 3 + gathers, rel=1e-9)
    assert by_mode["precomputed"].time.step_time_s == t.step_time_s and by_mode["precomputed"].time.reference_s == 0


def test_a_pair_is_never_split_by_the_search():
    cfg = dataclasses.replace(preset_config("llama-1b"), n_layers=4)
    wl = workload("model")
    layouts = list(enumerate_layouts(cfg, wl, Cluster(H100, 1, 8)))
    assert layouts and all(lay.micro_batch % 2 == 0 for lay in layouts)
    odd = Layout(dp_shard=8, zero=3, micro_batch=1, grad_accum=8)
    assert any("would split a preference pair" in e for e in layout_errors(cfg, wl, Cluster(H100, 1, 8), odd))
    assert not any("split" in e for e in layout_errors(cfg, workload("none", "lm"), Cluster(H100, 1, 8), odd))


def test_plan_of_a_70b_dpo_on_h100s_states_the_reference(capsys):
    r = run_here("plan", "llama-70b", "--hardware", "H100-SXM", "--nodes", "8", "--gpus-per-node", "8", "--seq-len",
                 "4096", "--global-batch", "64", "--train.objective=preference", "--top", "1")
    assert r.returncode == 0, r.stderr
    assert "global batch 128 sequences (64 preference pairs; reference: a frozen copy, a forward a step)" in r.stdout
    assert "reference forward" in r.stdout
    free = plan("llama-70b", hardware="H100-SXM", nodes=8, gpus_per_node=8, seq_len=4096, global_batch=128,
                objective="preference", reference="precomputed", top_k=1)
    copy = plan("llama-70b", hardware="H100-SXM", nodes=8, gpus_per_node=8, seq_len=4096, global_batch=128,
                objective="preference", reference="model", top_k=1)
    assert copy["layouts"][0].time.step_time_s > free["layouts"][0].time.step_time_s


def test_the_planned_copy_is_the_copy_the_trainer_holds(tmp_path):
    """One process, fp32: the planner's reference bytes equal the frozen copy's parameters as built."""
    from scaletrain.bench.preference_task import write_rule_pairs
    from scaletrain.data.prepare import prepare
    from scaletrain.train.trainer import Trainer

    from conftest import micro_cfg

    prepare([write_rule_pairs(tmp_path / "rows.jsonl", 40)], tmp_path / "data", preference="pairs")
    cfg = micro_cfg(tmp_path, **{"train.objective": "preference", "data.path": str(tmp_path / "data"),
                                 "train.global_batch": 4, "precision.mode": "32-true"})
    t = Trainer(cfg)
    measured = sum(p.numel() * p.element_size() for m in t.objective.ref_pm.dp.modules for p in m.parameters())
    lay = Layout(micro_batch=4, grad_accum=1)
    wl = Workload(seq_len=cfg.data.seq_len, global_batch=8, precision="32-true", objective="preference",
                  reference="model")
    lm = Workload(seq_len=cfg.data.seq_len, global_batch=8, precision="32-true")
    cluster = Cluster(H100, 1, 1)
    planned = evaluate(cfg.model, wl, cluster, lay, gpu=False).memory.params - \
        evaluate(cfg.model, lm, cluster, lay, gpu=False).memory.params
    assert planned == measured
    t.folder.release()
