"""The planner against reality (issue 7(b)): real scaletrain steps on CPU in 15 layouts — each
ZeRO stage, tensor and sequence parallel, a pipeline, each checkpointing mode, three
precisions, two optimizers — and the planner's per-rank prediction of each memory component
beside the bytes measured from live tensors: model states within 10%, activations within 20%."""

from __future__ import annotations

import pytest

from scaletrain.config import load_config
from scaletrain.plan import plan
from scaletrain.plan.hardware import Hardware
from scaletrain.plan.measure import measure, predicted_components
from scaletrain.train.trainer import Trainer

from conftest import micro_overrides, run_group

pytestmark = pytest.mark.multiproc

BASE = {"model.n_layers": 4, "model.tie_embeddings": False, "model.dim": 128, "data.seq_len": 64, "model.max_seq_len": 64,
        "train.global_batch": 8, "train.micro_batch": 4, "train.steps": 3}
ONE = [  # (name, overrides) on one process
    ("fp32-adamw", {}),
    ("selective", {"memory.activation_checkpointing": "selective"}),
    ("full", {"memory.activation_checkpointing": "full"}),
    ("bf16-mixed", {"precision.mode": "bf16-mixed"}),
    ("bf16-true", {"precision.mode": "bf16-true"}),
    ("sgd", {"optim.name": "sgd"}),
]
TWO = [  # on two ranks
    ("zero0", {"parallel.zero": 0}),
    ("zero1", {"parallel.zero": 1}),
    ("zero2", {"parallel.zero": 2}),
    ("zero3", {"parallel.zero": 3}),
    ("zero3-bf16-selective", {"parallel.zero": 3, "precision.mode": "bf16-mixed",
                              "memory.activation_checkpointing": "selective"}),
    ("tp2", {"parallel.tp": 2}),
    ("tp2-sp-sgd", {"parallel.tp": 2, "parallel.sp": True, "optim.name": "sgd"}),
    ("pp2", {"parallel.pp": 2}),
    ("zero2-bf16-true", {"parallel.zero": 2, "precision.mode": "bf16-true"}),
]
CPU = Hardware("CPU", 24, {"fp32": 0.2, "tf32": 0.2, "bf16": 0.2, "fp16": 0.2}, 20, 5, 1)


def prediction(cfg, ranks: int) -> dict:
    from scaletrain.layout import Layout

    par = cfg.parallel
    batch = Layout.from_config(cfg, ranks)
    layout = {"zero": par.zero, "tp": par.tp, "pp": par.pp, "sp": par.sp, "micro_batch": batch.micro_batch,
              "ac": cfg.memory.activation_checkpointing}
    if par.pp > 1:
        layout.update(schedule=par.pp_schedule, virtual=par.pp_virtual_stages)
    r = plan(cfg.model, hardware=CPU, nodes=1, gpus_per_node=ranks, seq_len=cfg.data.seq_len,
             global_batch=batch.global_batch, precision=cfg.precision.mode, optimizer=cfg.optim.name,
             layout=layout, gpu=False)
    return predicted_components(r["layouts"][0], r["cfg"], r["workload"], r["layouts"][0].layout)


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("accuracy")
    out = {}
    for name, extra in ONE:
        cfg = load_config(None, micro_overrides(tmp / name, **{**BASE, **extra}))
        out[name] = (cfg, 1, [measure(Trainer(cfg), steps=1)])
    jobs = [{"overrides": micro_overrides(tmp / name, **{**BASE, **extra}), "measure": True} for name, extra in TWO]
    code, results, err = run_group(2, jobs, tmp)
    assert code == 0, err
    for (name, extra), result in zip(TWO, results):
        out[name] = (load_config(None, micro_overrides(tmp / name, **{**BASE, **extra})), 2, result["measured"])
    return out


@pytest.mark.parametrize("name", [n for n, _ in ONE + TWO])
def test_prediction_matches_measurement(measured, name):
    cfg, ranks, rows = measured[name]
    predicted = prediction(cfg, ranks)
    for component in ("params", "grads", "optimizer"):  # model states: within 10%
        got = max(r[component] for r in rows)
        assert predicted[component] == pytest.approx(got, rel=0.10), (component, predicted[component], got)
    acts = [r["activations"] for r in rows if r["activations"] is not None]
    if acts:  # one micro-batch's saved activations: within 20%
        assert predicted["activations"] == pytest.approx(max(acts), rel=0.20), (predicted["activations"], max(acts))
