"""The planner and mixtures of experts (issue 31, point 5): total and active parameters, the
experts' model states under expert parallelism and ZeRO, a MoE block's activations against the
real layer's saved tensors, the all-to-all's volume and time, the expert load (given, or from the
calibration), the search's expert-parallel sizes, and a published MoE run's stated assumptions.
The planner against real CPU steps of MoE layouts: tests/plan/test_planner_moe_accuracy.py."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from scaletrain.hardware import lookup
from scaletrain.model.config import ModelConfig
from scaletrain.model.flops import matmul_params
from scaletrain.model.transformer import Transformer, count_params
from scaletrain.plan import plan
from scaletrain.plan.activations import formula_activation_bytes
from scaletrain.plan.memory_model import model_state_memory
from scaletrain.plan.params import expert_params, expert_shard_ranks, rank_params
from scaletrain.plan.search import enumerate_layouts
from scaletrain.plan.spec import Cluster, Layout, Workload
from scaletrain.plan.time_model import ep_traffic, estimate_time

from conftest import run_here

MOE = dict(dim=64, n_layers=3, n_heads=4, vocab_size=256, max_seq_len=64, moe_experts=8, moe_top_k=2, moe_hidden=96)


def test_total_and_active_parameters_each_counted_once():
    """Total: every expert (the built model's count); active: model/flops.py's, which MFU uses.
    The table and the JSON state both."""
    cfg = ModelConfig(**MOE, moe_shared_experts=1, moe_first_dense=1)
    r = plan(cfg, hardware="H100-SXM", gpus_per_node=2, seq_len=64, global_batch=8, top_k=1)
    assert r["num_params"] == count_params(cfg) == rank_params(cfg, Layout(), 0).total
    assert r["active_params"] == matmul_params(cfg) < r["num_params"]
    # 2 MoE blocks each hold 8 experts, of which a token visits 2
    assert r["num_params"] - r["active_params"] >= 2 * 6 * expert_params(cfg)
    from scaletrain.plan import report

    assert r["num_params"] < 1e9  # a model under a billion is counted in millions, not as 0.00B
    assert f"{r['num_params'] / 1e6:.2f}M parameters ({r['active_params'] / 1e6:.2f}M active)" in report.table(r)
    model = json.loads(report.to_json(r))["model"]
    assert (model["num_params"], model["active_params"], model["moe_imbalance"]) == \
        (r["num_params"], r["active_params"], 1.0)


CASES = [  # (model options, precision): each routing and loss option that keeps tensors for backward
    ({}, "32-true"),
    ({"moe_shared_experts": 1, "activation": "swiglu"}, "bf16-mixed"),
    ({"moe_renorm": True, "moe_z_loss": 1e-3, "moe_aux_loss": 1e-2, "moe_score": "sigmoid"}, "32-true"),
    ({"norm": "layernorm", "bias": True, "moe_shared_experts": 2}, "32-true"),
]


@pytest.mark.parametrize("extra,precision", CASES, ids=[f"{i}" for i in range(len(CASES))])
def test_moe_block_activations_match_the_real_layers_saved_tensors(extra, precision):
    """What a MoE block keeps for backward (`moe_half_bytes` in its layer): a model of 2 blocks
    less one of 1 block, measured on the real layer, within 1%."""
    from scaletrain.config import PrecisionConfig
    from scaletrain.memory import saved_activation_bytes
    from scaletrain.precision import Precision

    prec = Precision(PrecisionConfig(mode=precision), torch.device("cpu"))
    tokens = torch.randint(256, (2, 64), generator=torch.Generator().manual_seed(0))
    held = {}
    for n in (1, 2):
        torch.manual_seed(0)
        cfg = ModelConfig(**{**MOE, "n_layers": n, **extra})
        model = Transformer(cfg)

        def forward(model=model):
            with prec.autocast():
                return model(tokens).float().sum()

        held[n] = saved_activation_bytes(model, forward)
    predicted = formula_activation_bytes(cfg, Workload(seq_len=64, global_batch=2, precision=precision), 2, 1, False,
                                         "none", moe=True)[0]
    assert predicted == pytest.approx(held[2] - held[1], rel=0.01)


def test_expert_states_split_by_ep_then_sharded_over_the_rest():
    """Each rank holds E/ep experts; the dp_shard × cp × tp / ep ranks holding the same ones
    shard them by the experts' own engine (parallel/expert_parallel.py) at the layout's stage:
    gradients and optimizer state at ZeRO-1/2, the weights too at ZeRO-3. The other parameters
    as without experts (ZeRO over dp_shard)."""
    cfg = ModelConfig(**MOE)
    wl = Workload(seq_len=64, global_batch=8, precision="32-true")
    experts = 3 * 8 * expert_params(cfg)  # 3 MoE blocks of 8
    dense = count_params(cfg) - experts

    def states(layout):
        m = model_state_memory(rank_params(cfg, layout, 0), wl, layout)
        return m.params / 4, m.grads / 4, m.optimizer / 8  # fp32 weights and gradients, Adam's two moments

    assert states(Layout(dp_shard=4, zero=3)) == pytest.approx(((dense + experts) / 4,) * 3)
    # zero 3, ep 2: 4 experts a rank, their weights, gradients and moments over the 2 ranks holding them
    assert states(Layout(dp_shard=4, zero=3, ep=2)) == pytest.approx(((dense + experts) / 4,) * 3)
    assert states(Layout(dp_shard=4, zero=3, ep=4)) == pytest.approx(((dense + experts) / 4,) * 3)  # none left
    assert states(Layout(dp_shard=4, zero=0, ep=2)) == pytest.approx((dense + experts / 2,) * 3)
    assert states(Layout(dp_shard=4, zero=2, ep=2)) == pytest.approx(
        (dense + experts / 2, dense / 4 + experts / 4, dense / 4 + experts / 4))
    # ZeRO-1: E/ep experts' moments over dp/ep ranks are the dp-th of them, as without ep; the
    # weights are what ep saves
    with_ep, without = Layout(dp_shard=8, zero=1, ep=4), Layout(dp_shard=8, zero=1)
    assert states(without)[0] - states(with_ep)[0] == pytest.approx(experts * 3 / 4)
    assert states(without)[2] == pytest.approx(states(with_ep)[2])
    # ep borrows the cp ranks too: the experts' shards over dp_shard × cp / ep, the rest's over dp_shard
    assert expert_shard_ranks(Layout(dp_shard=2, cp=2, zero=2, ep=2)) == 2
    assert states(Layout(dp_shard=2, cp=2, zero=2, ep=2)) == pytest.approx(
        (dense + experts / 2, dense / 2 + experts / 4, dense / 2 + experts / 4))
    assert states(Layout(dp_shard=2, cp=2, zero=2, ep=4)) == pytest.approx(
        (dense + experts / 4, dense / 2 + experts / 4, dense / 2 + experts / 4))  # none left to shard over
    # and the tp ranks (which split the dense weights, not the experts)
    assert expert_shard_ranks(Layout(dp_shard=4, tp=2, zero=1, ep=2)) == 4
    assert expert_shard_ranks(Layout(dp_shard=2, dp_replicate=2, tp=2, cp=2, zero=3, ep=8)) == 1


def test_all_to_all_volume_and_time_and_the_expert_load():
    """4 all-to-alls per MoE block and micro-batch (6 under full checkpointing), each of the
    rank's tokens × top_k × dim × dtype bytes, (ep-1)/ep of it leaving; the load scales the
    exchange and the busiest rank's expert compute; one rank's experts do not care."""
    cfg = ModelConfig(**{**MOE, "dim": 512, "moe_hidden": 1024, "n_heads": 8, "max_seq_len": 2048})
    cluster = Cluster(lookup("H100-SXM"), 1, 8)
    wl = Workload(seq_len=2048, global_batch=32)
    lay = Layout(dp_shard=8, zero=1, ep=8, micro_batch=2, grad_accum=2)
    buffer, calls = ep_traffic(cfg, wl, lay)
    assert (buffer, calls) == (2 * 2048 * 2 * 512 * 2, 4)
    assert ep_traffic(cfg, wl, dataclasses.replace(lay, activation_checkpointing="full"))[1] == 6
    t1 = estimate_time(cfg, wl, lay, cluster)
    bw = lookup("H100-SXM").intra_node_GBps * 0.75e9  # LINK_EFFICIENCY of NVLink
    volume = 2 * 3 * calls * buffer * 7 / 8  # micro-batches × MoE blocks × calls × bytes leaving
    latency = 2 * 3 * calls * 7 * 3e-6  # each call: 7 hops of 3 µs inside a node
    assert t1.ep_comm_s == pytest.approx(volume / bw + latency, rel=1e-6)
    t2 = estimate_time(cfg, dataclasses.replace(wl, moe_imbalance=2.0), lay, cluster)
    assert t2.ep_comm_s == pytest.approx(2 * volume / bw + latency, rel=1e-6)
    assert t2.compute_s > t1.compute_s
    # ep over cp and tp ranks: each rank sends its own tokens, 1/(cp·tp) of the sequences, sp or not
    for sp in (True, False):
        over = Layout(dp_shard=2, cp=2, tp=2, sp=sp, zero=1, ep=8, micro_batch=2, grad_accum=2)
        assert ep_traffic(cfg, wl, over) == (buffer / 4, 4)
        assert estimate_time(cfg, wl, over, cluster).ep_comm_s == pytest.approx(volume / 4 / bw + latency, rel=1e-6)
    flat = Layout(dp_shard=8, zero=1, micro_batch=2, grad_accum=2)
    assert estimate_time(cfg, wl, flat, cluster).ep_comm_s == 0.0
    assert estimate_time(cfg, dataclasses.replace(wl, moe_imbalance=2.0), flat, cluster) == \
        estimate_time(cfg, wl, flat, cluster)


def test_tp_collectives_of_a_moe_block():
    """scaletrain's MoE half runs no tp collective under sp (each rank routes the shard it
    holds); without sp it slices the replicated input and all-gathers the output forward, and
    all-gathers the input's gradient backward: one all-reduce's volume, where a dense MLP has
    two. Once per step the router's and shared experts' gradients are summed over tp."""
    from scaletrain.plan.params import moe_block_split
    from scaletrain.plan.time_model import tp_collectives

    sp, no_sp = Layout(dp_shard=4, tp=2, sp=True), Layout(dp_shard=4, tp=2)
    wl = Workload(seq_len=2048, global_batch=8)
    assert [tp_collectives(wl, lay, 1, 2) for lay in (sp, no_sp)] == [4 + 2 * 2, 4 + 2 * 3]
    megatron = dataclasses.replace(wl, engine="megatron")
    assert tp_collectives(megatron, sp, 1, 2) == tp_collectives(megatron, no_sp, 1, 2) == 12
    cfg = ModelConfig(**{**MOE, "dim": 512, "moe_hidden": 1024, "n_heads": 8, "max_seq_len": 2048,
                         "moe_shared_experts": 1})
    cluster = Cluster(lookup("H100-SXM"), 1, 8)
    for lay, calls in ((sp, 3 * 2), (no_sp, 3 * 3)):  # 3 MoE blocks
        lay = dataclasses.replace(lay, ep=2, micro_batch=2, grad_accum=1)
        bw = lookup("H100-SXM").intra_node_GBps * 0.75e9
        # an all-reduce over 2 ranks: 2(n-1)/n = 1 of the micro-batch's bf16 activations, or of the
        # fp32 gradients (the routed experts are ep's, not summed over tp)
        per_collective = 2 * 2048 * 512 * 2 / bw
        summed = 3 * moe_block_split(cfg)[1] * 4 / bw
        assert estimate_time(cfg, wl, lay, cluster).tp_comm_s == pytest.approx(
            (calls + 2) * per_collective + summed, rel=1e-6)


def test_the_search_tries_ep_sizes_that_divide_the_experts_and_the_ranks():
    """ep divides the experts and the dp_shard × cp × tp ranks it borrows from."""
    cluster = Cluster(lookup("H100-SXM"), 1, 8)
    wl = Workload(seq_len=2048, global_batch=8)

    def sizes(cfg):
        return {lay.ep for lay in enumerate_layouts(cfg, wl, cluster, max_micro_batch=1)}

    layouts = list(enumerate_layouts(ModelConfig(**MOE), wl, cluster, max_micro_batch=1))
    assert all(lay.dp_shard * lay.cp * lay.tp % lay.ep == 0 for lay in layouts)
    assert {(lay.dp_shard, lay.tp, lay.ep) for lay in layouts} >= {(1, 4, 4), (2, 4, 8), (2, 2, 4), (4, 2, 8)}
    assert sizes(ModelConfig(**MOE)) == {1, 2, 4, 8}
    assert sizes(ModelConfig(**{**MOE, "moe_experts": 6})) == {1, 2}
    assert sizes(ModelConfig(**{k: v for k, v in MOE.items() if not k.startswith("moe")})) == {1}
    r = plan(ModelConfig(**MOE), hardware="H100-SXM", gpus_per_node=8, seq_len=2048, global_batch=8, top_k=3)
    assert r["stats"]["layouts"] > 0 and all(e.layout.ep in (1, 2, 4, 8) for e in r["layouts"])


def test_the_expert_load_comes_from_the_calibration_unless_given():
    """A calibrated plan takes the load its compute probes measured; --moe-imbalance wins."""
    from scaletrain.plan.calibrate import OPS, Calibration, probe_key

    def measure(model_cfg, probes, optimizers, ranks, device):
        compute = {}
        for p in probes:
            entry = {"block": 0.01, "rest": 0.02} | ({} if p.get("engine") else {"imbalance": 1.7})
            compute.setdefault(probe_key(model_cfg, p), {})[str(p["micro_batch"])] = entry
        return Calibration("test", ranks, {op: (1e-5, 1e9) for op in OPS}, 0.5, compute,
                           {"|".join(o): 1e-9 for o in optimizers})

    args = dict(hardware=lookup("H100-SXM"), gpus_per_node=2, seq_len=64, global_batch=4,
                layout={"dp_shard": 2, "zero": 1, "ep": 2}, calibrate=measure)
    measured = plan(ModelConfig(**MOE), **args)
    assert measured["workload"].moe_imbalance == 1.7
    assert any("measured by this machine's calibration" in line for line in measured["explanation"])
    given = plan(ModelConfig(**MOE), moe_imbalance=1.2, **args)
    assert given["workload"].moe_imbalance == 1.2
    assert given["layouts"][0].time.ep_comm_s < measured["layouts"][0].time.ep_comm_s


def test_a_published_moe_run_states_its_assumptions():
    """Megatron-Bridge's Qwen3-30B-A3B row on 16 H100: the plan says the parameters in all and
    active, that the router is taken as force-balanced as published figures do, and what ep
    costs; its prediction is held against the figure in tests/plan/test_planner_published.py."""
    from scaletrain.plan.published import RUNS

    run = next(r for r in RUNS if "Qwen3-30B-A3B" in r.name)
    out = run_here("plan", *run.args).stdout
    assert "30.53B parameters (3.04B active)" in out
    assert "published figures force-balance the router" in out
    assert "Expert parallel 8: each rank holds 16 of 128 experts" in out
    assert "expert all-to-all" in out


def test_the_plan_says_where_ep_borrows_its_ranks():
    """Where ep spans tp or cp ranks, the plan's words say so (each routes its own tokens);
    within dp_shard they stay as they were."""

    def ep_line(**layout):
        r = plan(ModelConfig(**MOE), hardware="H100-SXM", gpus_per_node=4, seq_len=64, global_batch=8, top_k=1,
                 layout={"zero": 1, **layout})
        return next(line for line in r["explanation"] if line.startswith("Expert parallel"))

    assert ep_line(tp=2, ep=4).startswith("Expert parallel 4 (ranks borrowed from dp_shard 2 × tp 2: each tp rank "
                                          "routes its own sequence shard): each rank holds 2 of 8 experts (unsharded)")
    assert "ZeRO-1 over the 2 ranks holding the same ones" in ep_line(tp=2, ep=2)
    assert ep_line(ep=2).startswith("Expert parallel 2: each rank holds 4 of 8 experts (ZeRO-1 over the 2 ranks")
