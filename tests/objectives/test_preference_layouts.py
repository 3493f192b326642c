"""Preference training on 2 ranks against one process (issue 49 #4): every step's loss and gradient norm before
clipping, and the final weights under SGD without clipping (each update the gradient itself), for DPO and SimPO
under ZeRO-3, tensor parallelism with sequence parallelism, pipeline parallelism, context parallelism, expert
parallelism on a mixture of experts, adapters (the reference their base) and a precomputed reference — each
with accumulation (micro-batches of 1 or 2 pairs). A pair's two rows are one example of the sampler: never
split over micro-batches, ranks or pipeline micro-batches."""

from __future__ import annotations

import json

import pytest

from scaletrain.bench.preference_task import write_rule_pairs
from scaletrain.data.prepare import prepare
from scaletrain.verify import TOLERANCES

from conftest import (
    assert_same_run,
    assert_same_weights,
    language_models,
    layouts_on_two_ranks,
    one_process_key,
    one_process_references,
)

pytestmark = [pytest.mark.multiproc, pytest.mark.slow, pytest.mark.usefixtures("forked_launches")]

STEPS = 3
TOL = TOLERANCES["32-true"]
WEIGHTS_TOL = 1e-3  # final weights relative to their change over the run (as tests/parallel/test_model_parallel.py)
SGD = {"optim.name": "sgd", "optim.lr": 0.3, "train.grad_clip": 0.0}
# 4 untied blocks (pipelining splits them); 6 pairs a step: 3 micro-batches of 2 on one rank
BASE = {"train.objective": "preference", "train.steps": STEPS, "model.n_layers": 4, "model.tie_embeddings": False,
        "train.global_batch": 6, "train.micro_batch": 1, **SGD}
MOE = {"model.moe_experts": 4, "model.moe_aux_loss": 0.01}
SIMPO = {"preference.loss": "simpo", "preference.beta": 2.0}
KTO = {"preference.loss": "kto", "preference.undesirable_weight": 1.5}  # (+ the models of `data`: a KL above 0)

LAYOUTS = [
    ("zero3", {"parallel.dp_shard": 2, "parallel.zero": 3}),
    ("tp2-sp", {"parallel.tp": 2, "parallel.sp": True}),
    ("pp2-1f1b", {"parallel.pp": 2, "parallel.pp_schedule": "1f1b"}),
    ("cp2-ring", {"parallel.cp": 2}),
    ("ep2-zero3-moe", {"parallel.dp_shard": 2, "parallel.zero": 3, "parallel.ep": 2, **MOE}),
    ("zero3-lora", {"parallel.dp_shard": 2, "parallel.zero": 3, "adapter.kind": "lora"}),
    ("ddp-precomputed", {"parallel.dp_shard": 2, "preference.reference": "precomputed"}),
    ("simpo-zero3", {"parallel.dp_shard": 2, "parallel.zero": 3, **SIMPO}),
    ("simpo-tp2-sp", {"parallel.tp": 2, "parallel.sp": True, **SIMPO}),
    ("simpo-pp2-gpipe", {"parallel.pp": 2, "parallel.pp_schedule": "gpipe", **SIMPO}),
    ("simpo-cp2-ulysses", {"parallel.cp": 2, "parallel.cp_method": "ulysses", **SIMPO}),
    ("simpo-ep2-moe", {"parallel.dp_shard": 2, "parallel.zero": 3, "parallel.ep": 2, **MOE, **SIMPO}),
    # KTO: unpaired examples, the KL estimate over the global batch (every rank's KL rows)
    ("kto-zero3", {"parallel.dp_shard": 2, "parallel.zero": 3, **KTO}),
    ("kto-pp2", {"parallel.pp": 2, **KTO}),
    ("kto-cp2", {"parallel.cp": 2, **KTO}),
    ("kto-tp2-sp-precomputed", {"parallel.tp": 2, "parallel.sp": True, "preference.reference": "precomputed", **KTO}),
]


def data_of(extra: dict, data: dict) -> dict:
    """The data (and for KTO the starting and reference models) of a layout's settings."""
    if extra.get("preference.loss") != "kto":
        return {"data.path": data["pairs"]}
    return {"data.path": data["unpaired"], "model.init_from": data["policy"],
            **({} if extra.get("preference.reference") == "precomputed" else
               {"preference.reference_from": data["reference"]})}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("pairs")
    rows = write_rule_pairs(root / "rows.jsonl", 60, seed=5)
    with rows.open("a") as f:  # completions of uneven lengths: rows of a micro-batch differ
        for i in range(6):
            f.write(json.dumps({"prompt": "vowels: ", "chosen": "ae" * (1 + i), "rejected": "k" * (3 + i)}) + "\n")
    prepare([rows], root / "data", preference="pairs")
    kto = root / "kto.jsonl"  # the same completions, unpaired: the chosen desirable, the rejected not
    kto.write_text("".join(json.dumps({"prompt": r["prompt"], "completion": r["chosen" if i % 2 else "rejected"],
                                       "label": bool(i % 2)}) + "\n"
                           for i, r in enumerate(json.loads(line) for line in rows.read_text().splitlines())))
    prepare([kto], root / "unpaired", preference="unpaired")
    models = language_models(root, [json.loads(line)["prompt"] + json.loads(line)["chosen"]
                                    for line in rows.read_text().splitlines()])
    return {"pairs": str(root / "data"), "unpaired": str(root / "unpaired"), **models}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data):
    return layouts_on_two_ranks(tmp_path_factory.mktemp("pref-mp"), LAYOUTS,
                                lambda extra: {**BASE, **data_of(extra, data), **extra})


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data):
    return one_process_references(tmp_path_factory.mktemp("pref-one"), LAYOUTS,
                                  lambda model: {**BASE, **data_of(model, data), "train.micro_batch": 6, **model})


@pytest.mark.parametrize("name,extra", LAYOUTS, ids=[n for n, _ in LAYOUTS])
def test_a_layout_trains_like_one_process(runs, reference, name, extra):
    ref = reference[one_process_key(extra)]
    if name.startswith("kto") and extra.get("preference.reference") != "precomputed":
        assert min(r["kl"] for r in ref["history"]) > 0.1, [r["kl"] for r in ref["history"]]  # the KL counts
    assert_same_run(runs[name]["history"], ref["history"], steps=STEPS, tol=TOL, what=name)
    assert_same_weights(runs[name]["weights"], ref["weights"], tol=WEIGHTS_TOL, what=name)
