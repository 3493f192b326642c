"""The planner against real CPU steps of a mixture of experts (issue 31, point 5), as
tests/plan/test_planner_accuracy.py does for dense layouts: per rank, the planner's total (what
decides "fits") within 10% of the peak of live tensor storages during a training step, and the
model states and one micro-batch's activations beside the bytes measured from live tensors.
One process (bf16-mixed, a shared expert, SwiGLU), and data parallel 2 under ZeRO-3 and DDP;
expert parallel 2 under both, and over ranks it borrows from cp or tp (each rank routing its own
tokens: the cp ranks their chunks, the tp ranks their sequence shards, sliced from the
replicated input without sp). Under ep the reverse all-to-all returns an `AsyncCollectiveTensor`,
a wrapper whose own storage reports n·k·dim values but holds none: the trackers count the tensor
inside it (memory.holding_tensors), once."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from scaletrain.config import load_config
from scaletrain.launch.ranks import QUIET
from scaletrain.measure import measure_layouts
from scaletrain.plan import plan
from test_planner_accuracy import assert_memory_matches

pytestmark = [pytest.mark.multiproc, pytest.mark.usefixtures("forked_launches")]

_spec = importlib.util.spec_from_file_location("planner_bench", Path(__file__).parents[2] / "benchmarks" / "planner.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)  # its CPU: the catalog entry the dense accuracy test plans with


# two MoE blocks of 4 experts, 2 per token, each twice the model's width
BASE = {"model.n_layers": 2, "model.dim": 64, "model.n_heads": 4, "data.seq_len": 64, "model.max_seq_len": 64,
        "model.vocab_size": 256, "train.global_batch": 4, "train.micro_batch": 2, "train.steps": 3,
        "model.tie_embeddings": False, "train.device": "cpu", "model.moe_experts": 4, "model.moe_top_k": 2,
        "model.moe_hidden": 128, **QUIET}
# under ep the busiest rank's arrivals depend on where the router sends the tokens, which the
# plan takes as given (Workload.moe_imbalance, 1 unless told): every token to every expert makes
# each ep rank receive exactly the mean, the load planned
EVEN = {"model.moe_top_k": 4}
LAYOUTS = [  # (name, ranks, overrides)
    ("one process, bf16, shared expert", 1, {"precision.mode": "bf16-mixed", "model.moe_shared_experts": 1,
                                             "model.activation": "swiglu"}),
    ("dp 2 zero 3", 2, {"parallel.zero": 3}),
    ("dp 2 zero 0", 2, {"parallel.zero": 0}),
    ("ep 2 zero 3", 2, {"parallel.zero": 3, "parallel.ep": 2, **EVEN}),
    ("ep 2 zero 0", 2, {"parallel.zero": 0, "parallel.ep": 2, **EVEN}),
    ("ep 2 over cp 2", 2, {"parallel.zero": 0, "parallel.cp": 2, "parallel.ep": 2, **EVEN}),
    ("ep 2 over tp 2", 2, {"parallel.zero": 0, "parallel.tp": 2, "parallel.ep": 2, **EVEN}),
    # the experts' states ZeRO-2-sharded over the dp_shard × tp / ep = 2 ranks holding the same ones
    ("ep 2 over tp 2 sp, dp 2 zero 2", 4, {"parallel.zero": 2, "parallel.tp": 2, "parallel.sp": True,
                                           "parallel.ep": 2, **EVEN}),
]


def planned(cfg, ranks: int):
    """The planner's evaluation of the layout `cfg` trains on `ranks` CPU processes."""
    par = cfg.parallel
    layout = {"zero": par.zero, "ep": par.ep, "tp": par.tp, "sp": par.sp, "cp": par.cp, "cp_method": par.cp_method,
              "micro_batch": cfg.train.micro_batch, "ac": cfg.memory.activation_checkpointing}
    r = plan(cfg.model, hardware=bench.CPU, nodes=1, gpus_per_node=ranks, seq_len=cfg.data.seq_len,
             global_batch=cfg.train.global_batch, precision=cfg.precision.mode, optimizer=cfg.optim.name,
             layout=layout, gpu=False)
    return r["layouts"][0]


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("moe-accuracy")
    out = {}
    for ranks in (1, 2, 4):  # one group of processes for all the layouts of each size
        jobs = [(name, {**BASE, **extra, "log.run_dir": str(tmp / name.replace(" ", "-").replace(",", ""))})
                for name, r, extra in LAYOUTS if r == ranks]
        for (name, overrides), rows in zip(jobs, measure_layouts([o for _, o in jobs], ranks, steps=0)):
            out[name] = (load_config(None, overrides), ranks, rows)
    return out


@pytest.mark.parametrize("name", [n for n, *_ in LAYOUTS])
def test_moe_prediction_matches_measurement(measured, name):
    cfg, ranks, rows = measured[name]
    ev = planned(cfg, ranks)
    assert (ev.layout.ep, ev.layout.tp, ev.layout.sp, ev.layout.cp) == \
        (cfg.parallel.ep, cfg.parallel.tp, cfg.parallel.sp, cfg.parallel.cp)
    predicted = assert_memory_matches(ev, rows)
    acts = [r["activations"] for r in rows if r["activations"] is not None]
    assert acts
    if cfg.parallel.ep > 1 and cfg.parallel.cp == 1:  # what the dispatch keeps, to the index (a wrapper counted
        # twice would be 9%; under cp the attention keeps 2.5% more than planned here, with or without experts)
        # (small tensors apart, 0.05% here; one index of 8 bytes per arrival missing would be 0.28%)
        assert predicted["activations"] == pytest.approx(max(acts), rel=0.002)
