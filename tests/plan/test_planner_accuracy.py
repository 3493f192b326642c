"""The planner against reality (issue 7(b), issue 13): real scaletrain steps on CPU in every
layout of benchmarks/planner.py — each ZeRO stage, tensor and sequence parallel, a pipeline,
each checkpointing mode, three precisions, two optimizers. Per rank, the planner's total (what
decides "fits") within 10% of the peak of live tensor storages during a whole training step;
model states within 10% and one micro-batch's activations within 20% of the bytes measured from
live tensors. Context parallelism's three methods likewise (their attention backward's score
tiles and K/V buffers, `attention_backward_bytes`). The peak measurement itself is checked on
sums done by hand."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from scaletrain.config import load_config
from scaletrain.measure import LiveMemory, measure_layouts, planned, predicted_components
from scaletrain.vocab import CP_METHODS

pytestmark = [pytest.mark.multiproc, pytest.mark.usefixtures("forked_launches")]

_spec = importlib.util.spec_from_file_location("planner_bench", Path(__file__).parents[2] / "benchmarks" / "planner.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)
_spec = importlib.util.spec_from_file_location("cp_bench",
                                               Path(__file__).parents[2] / "benchmarks" / "context_parallel.py")
cp_bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cp_bench)
TINY = str(Path(__file__).parents[2] / "configs" / "tiny.toml")


def test_live_memory_on_sums_done_by_hand():
    live = LiveMemory()
    with live:
        a = torch.empty(1000)  # 4000 bytes
        b = torch.empty(2000, dtype=torch.float64)  # 16000
        view = a[10:]  # no new storage
        del a
        assert (live.live, live.peak) == (20000, 20000)
        del b, view  # the view held a's storage until now
        assert (live.live, live.peak) == (0, 20000)
        s = torch.empty(100)  # FSDP-style: a storage resized in place
        s.untyped_storage().resize_(0)
        assert live.live == 0
        s.untyped_storage().resize_(40000)
        assert (live.live, live.peak) == (40000, 40000)
        del s
        # a step by hand: weight 256x256 fp32, input 8x256, y = x W^T, loss = sum(y^2)
        w = torch.nn.Parameter(torch.empty(256, 256))  # 262144 bytes
        x = torch.empty(8, 256)  # 8192
        live.reset_peak()
        assert live.live == 262144 + 8192
        loss = (x @ w.t()).pow(2).sum()  # keeps y (8192) for pow's backward, and the loss (4)
        assert live.live == 262144 + 8192 + 8192 + 4
        loss.backward()
        # backward's largest moment: dL/dy (8192) alive while the weight's gradient is made
        assert live.peak == 262144 + 8192 + 8192 + 4 + 4 + 8192 + 262144 - 8192
        assert w.grad is not None and live.live == 262144 + 8192 + 262144 + 4


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("accuracy")
    out = {}
    for ranks in (1, 2):  # one group of processes for all the two-rank layouts
        jobs = [(name, {**bench.BASE, **extra, "log.run_dir": str(tmp / name.replace(" ", "-"))})
                for name, r, extra in bench.LAYOUTS if r == ranks]
        for (name, overrides), rows in zip(jobs, measure_layouts([o for _, o in jobs], ranks, steps=0)):
            out[name] = (load_config(None, overrides), ranks, rows)
    return out


@pytest.mark.parametrize("name", [n for n, _, _ in bench.LAYOUTS])
def test_prediction_matches_measurement(measured, name):
    cfg, ranks, rows = measured[name]
    assert_memory_matches(planned(cfg, ranks, bench.CPU), rows)


def assert_memory_matches(ev, rows: list[dict]) -> dict:
    """The plan `ev` against the measured `rows` (one per rank): the total that decides "fits"
    (its reserve included) and each model state within 10% of the largest rank's, one
    micro-batch's saved activations within 20%. Returns the predicted components."""
    peak = max(r["peak"] for r in rows)
    assert ev.memory.total == pytest.approx(peak, rel=0.10), (ev.memory.as_dict(), peak)
    predicted = predicted_components(ev, None, None, ev.layout)
    for component in ("params", "grads", "optimizer"):
        got = max(r[component] for r in rows)
        assert predicted[component] == pytest.approx(got, rel=0.10), (component, predicted[component], got)
    acts = [r["activations"] for r in rows if r["activations"] is not None]
    if acts:
        assert predicted["activations"] == pytest.approx(max(acts), rel=0.20), (predicted["activations"], max(acts))
    return predicted


@pytest.fixture(scope="module")
def cp_measured():
    """cp 2 with each method on one group of two processes: the tiny model cut to two layers,
    one sequence of 2,048 tokens (two 512-row score tiles per K/V block for ring)."""
    jobs = [cp_bench.overrides_for(2048, 2, method, {"model.n_layers": 2}) for method in CP_METHODS]
    return {method: (load_config(TINY, job), rows)
            for method, job, rows in zip(CP_METHODS, jobs, measure_layouts(jobs, 2, steps=0, config=TINY))}


@pytest.mark.parametrize("method", CP_METHODS)
def test_context_parallel_prediction_matches_measurement(cp_measured, method):
    cfg, rows = cp_measured[method]
    ev = planned(cfg, 2, bench.CPU)
    assert (ev.layout.cp, ev.layout.cp_method) == (2, method)
    peak = max(r["peak"] for r in rows)
    assert ev.memory.total == pytest.approx(peak, rel=0.10), (ev.memory.as_dict(), peak)


# --- adapters: LoRA and QLoRA (NF4 base) in one process and under ZeRO-3 ------------------------

ADAPTER_LAYOUTS = [  # (name, ranks, overrides): the frozen base's bytes, the adapters' states
    ("lora", 1, {"adapter.kind": "lora"}),
    ("qlora nf4", 1, {"adapter.kind": "lora", "adapter.base_dtype": "nf4"}),
    ("lora zero 3", 2, {"adapter.kind": "lora", "parallel.zero": 3}),
    ("qlora nf4 zero 3", 2, {"adapter.kind": "lora", "adapter.base_dtype": "nf4", "parallel.zero": 3}),
]


@pytest.fixture(scope="module")
def adapters_measured(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("adapters")
    out = {}
    for ranks in (1, 2):
        jobs = [(name, {**bench.BASE, **extra, "log.run_dir": str(tmp / name.replace(" ", "-"))})
                for name, r, extra in ADAPTER_LAYOUTS if r == ranks]
        for (name, overrides), rows in zip(jobs, measure_layouts([o for _, o in jobs], ranks, steps=0)):
            out[name] = (load_config(None, overrides), ranks, rows)
    return out


@pytest.mark.parametrize("name", [n for n, _, _ in ADAPTER_LAYOUTS])
def test_adapter_prediction_matches_measurement(adapters_measured, name):
    cfg, ranks, rows = adapters_measured[name]
    predicted = assert_memory_matches(planned(cfg, ranks, bench.CPU), rows)
    # the frozen base holds no gradient and no optimizer state: the adapters' alone, rank 8 on each
    # block's 4 attention linears (128 x 128) and 2 MLP linears (128 x 512), fp32 with AdamW's two moments
    adapters = 4 * 8 * (4 * (128 + 128) + 2 * (128 + 512))
    assert predicted["grads"] == 4 * adapters / ranks and predicted["optimizer"] == 8 * adapters / ranks
