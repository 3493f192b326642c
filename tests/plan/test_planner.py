"""The planner: published figures reproduced, the closed form against the traced count, the
search, the inputs it takes, its output, and its calibration."""

from __future__ import annotations

import json

import pytest
import torch

from scaletrain.config import from_dict
from scaletrain.errors import ConfigError
from scaletrain.hardware import lookup
from scaletrain.plan import Layout, plan
from scaletrain.plan.activations import (
    attention_backward_bytes,
    first_layer_extra_bytes,
    formula_activation_bytes,
    in_flight,
    in_flight_from_orders,
)
from scaletrain.plan.search import enumerate_layouts, evaluate, layout_errors
from scaletrain.plan.spec import Cluster, Workload, hf_config_to_model, load_model
from scaletrain.vocab import CP_METHODS

from conftest import run_here

# --- 7(a): published figures ------------------------------------------------------------------

# Published figures (the ZeRO paper, Korthikanti et al., Megatron, Llama 3, torchtitan,
# llm-foundry) are checked through the CLI in tests/plan/test_planner_published.py.


# --- the closed form against the actual model -------------------------------------------------

@pytest.mark.parametrize("variant,precision,tp,sp,ac", [
    ({}, "32-true", 1, False, "none"),
    ({}, "bf16-mixed", 1, False, "selective"),
    ({}, "bf16-mixed", 2, True, "full"),
    ({"norm": "rmsnorm", "activation": "swiglu", "position": "rope", "n_kv_heads": 2}, "bf16-true", 2, True, "none"),
    ({"norm": "rmsnorm", "activation": "swiglu", "position": "rope", "n_kv_heads": 2}, "16-mixed", 2, False, "none"),
    ({"bias": True}, "32-true", 2, False, "selective"),
])
def test_closed_form_matches_the_traced_count(variant, precision, tp, sp, ac):
    from scaletrain.plan.trace import release_fake_world, traced_activation_bytes

    cfg = from_dict({"model": {"dim": 256, "n_layers": 4, "n_heads": 4, "tie_embeddings": False, **variant},
                     "data": {"seq_len": 64}}).model
    wl = Workload(seq_len=64, global_batch=8, precision=precision)
    try:
        traced_layer, traced_rest = traced_activation_bytes(cfg, wl, 2, tp, sp, ac)
    finally:
        release_fake_world()
    layer, head = formula_activation_bytes(cfg, wl, 2, tp, sp, ac)
    head += first_layer_extra_bytes(cfg, wl, 2, tp, sp, ac)
    assert layer == pytest.approx(traced_layer, rel=0.02)
    assert head == pytest.approx(traced_rest, rel=0.03)


@pytest.mark.parametrize("schedule,p,m,v,counted", [
    # per rank, the most chunk-forwards whose activations are still held, over the chunks per rank,
    # counted by hand from each rank's order (tests/plan/test_timeline.py checks those orders are the
    # ones torch.distributed.pipelining runs):
    ("gpipe", 2, 2, 1, (2, 2)),  # F0 F1 B0 B1 on both ranks
    ("1f1b", 2, 4, 1, (2, 1)),  # rank 0: F0 | F1 B0 F2 B1 ...: 2 held; rank 1: F B F B ...: 1
    ("1f1b", 4, 4, 1, (4, 3, 2, 1)),  # p - r: the warm-up forwards and the one in flight
    ("interleaved-1f1b", 2, 2, 2, (4 / 2, 3 / 2)),  # rank 0: 4 forwards then 4 backwards; rank 1: F F | F B F B | B B
    ("interleaved-1f1b", 2, 4, 2, (5 / 2, 3 / 2)),  # rank 0: 4 warm-up forwards + 1 in flight
    # ZB-V, chunk 0 down, chunk 1 back up; a chunk's activations go at its W (weight gradient).
    # p=2, m=2, rank 0: F0 F1 | f0 i0 w0 f1 i1 w1 | I0 W0 I1 W1: 3 held after f0, f1
    #           rank 1: F0 f0 F1 f1 | i0 w0 | I0 W0 i1 w1 I1 W1: 4 held after f1
    ("zero-bubble", 2, 2, 2, (3 / 2, 4 / 2)),
    ("zero-bubble", 2, 1, 2, (2 / 2, 2 / 2)),  # F0 f0 ... on both ranks, nothing else in flight
    ("zero-bubble", 2, 4, 2, (4 / 2, 4 / 2)),  # steady state: 2p chunk-forwards, p micro-batches
    ("zero-bubble", 3, 2, 2, (3 / 2, 4 / 2, 4 / 2)),
])
def test_micro_batches_in_flight_counted_by_hand(schedule, p, m, v, counted):
    assert in_flight(schedule, p, m, v) == tuple(float(c) for c in counted)
    assert in_flight_from_orders(schedule, p, m, v) == tuple(float(c) for c in counted)


@pytest.mark.parametrize("schedule,v", [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zero-bubble", 2)])
def test_closed_forms_of_micro_batches_in_flight_agree_with_the_orders(schedule, v):
    """The closed forms the planner uses at scale against counts from the orders (ZB-V with few
    micro-batches is counted, not closed-form: m < 2p - 1 is excluded here, it would compare
    the function with itself)."""
    for p in (2, 4, 8):
        for m in (p, 2 * p, 4 * p):
            if schedule == "zero-bubble" and m < 2 * p - 1:
                continue
            assert in_flight(schedule, p, m, v) == in_flight_from_orders(schedule, p, m, v)
    assert in_flight("1f1b", 4, 8, 1)[0] == 4 and in_flight("gpipe", 4, 8, 1)[0] == 8
    assert in_flight("interleaved-1f1b", 4, 8, 2)[0] == 4 * (1 + 3 / 8)  # Narayanan et al.: 1 + (p-1)/(pv)


# --- search ---------------------------------------------------------------------------------

def test_search_ranks_fitting_layouts_by_throughput():
    r = plan("llama-8b", hardware="H100-SXM", nodes=1, gpus_per_node=8, seq_len=8192, global_batch=64, top_k=20)
    layouts = r["layouts"]
    assert r["stats"]["layouts"] > 1000 and r["stats"]["fit"] > 10
    assert all(e.fits for e in layouts)
    speeds = [e.time.tokens_per_s for e in layouts]
    assert speeds == sorted(speeds, reverse=True)
    best = layouts[0].layout
    assert best.world == 8 and best.tp <= 8
    assert any("ZeRO" in line for line in r["explanation"])
    assert r["explanation"][0].startswith("Best: ")
    assert any(line.startswith("Runner-up: ") for line in r["explanation"])


def test_ten_thousand_layouts():
    """Every 50th of the search's layouts is legal, and its evaluation sane: memory positive, at
    least the states it always holds, and no larger where more is recomputed, sharded or offloaded;
    times positive, tokens/s the global batch over the step time, a bubble under pipelining only."""
    import dataclasses

    cfg = load_model("llama-70b").cfg
    wl = Workload(seq_len=8192, global_batch=512)
    cluster = Cluster(lookup("H100-SXM"), 8, 8)
    layouts = list(enumerate_layouts(cfg, wl, cluster))
    assert len(layouts) > 9000

    def variant(layout, **change):
        """`layout` with `change`, evaluated, where that is a legal layout too (else None)."""
        other = dataclasses.replace(layout, **change)
        return evaluate(cfg, wl, cluster, other) if not layout_errors(cfg, wl, cluster, other) else None

    compared = {"checkpointing": 0, "zero": 0, "offload": 0}
    for layout in layouts[::50]:
        assert layout_errors(cfg, wl, cluster, layout) == [] and layout.errors(cfg, seq_len=wl.seq_len) == []
        assert layout.world == cluster.world and layout.micro_batch * layout.grad_accum * layout.dp == 512
        e = evaluate(cfg, wl, cluster, layout)
        m, t = e.memory, e.time
        assert all(getattr(m, c) >= 0 for c in m.COMPONENTS) and m.host >= 0, m
        assert m.activations > 0 and m.params + m.host > 0 and m.optimizer + m.host > 0, m  # host: offloaded
        assert m.total >= m.params + m.master + m.optimizer + m.reserve, m  # the states are held throughout
        assert (m.host > 0) == layout.offload_optimizer, m
        times = ("compute_s", "tp_comm_s", "pp_comm_s", "dp_comm_s", "dp_exposed_s", "bubble_s", "optimizer_s",
                 "cp_comm_s")
        assert t.compute_s > 0 and all(getattr(t, name) >= 0 for name in times), t
        assert t.dp_exposed_s <= t.dp_comm_s * (1 + 1e-12) and t.step_time_s >= t.compute_s, t
        assert t.tokens_per_s == pytest.approx(wl.global_batch * wl.seq_len / t.step_time_s, rel=1e-9), t
        assert 0 < t.mfu < 1, t
        assert (t.bubble_fraction > 0) == (t.bubble_s > 0) == (layout.pp > 1), t  # idle over busy time
        # more recomputation: no more activation memory, no less compute
        order = ["none", "selective", "full"]
        for less in order[order.index(layout.activation_checkpointing) + 1:]:
            if (other := variant(layout, activation_checkpointing=less)) is not None:
                compared["checkpointing"] += 1
                assert other.memory.activations <= m.activations and other.time.compute_s >= t.compute_s, less
        # a higher ZeRO stage: less model state on the device (ZeRO-2 over ZeRO-1 no more, as under
        # pipelining, where the gradients stay whole)
        for zero in range(layout.zero + 1, 4):
            if (other := variant(layout, zero=zero)) is not None:
                compared["zero"] += 1
                if (layout.zero, zero) == (1, 2):
                    assert other.memory.model_states <= m.model_states, (layout, zero)
                else:
                    assert other.memory.model_states < m.model_states, (layout, zero)
        # the optimizer offloaded: less on the device, the rest in host memory
        if not layout.offload_optimizer and (other := variant(layout, offload_optimizer=True)) is not None:
            compared["offload"] += 1
            assert other.memory.optimizer < m.optimizer and other.memory.host > 0
            assert other.memory.total < m.total, layout
    assert all(n >= 20 for n in compared.values()), compared  # each property held on many layouts


def test_tp_stays_inside_a_node_and_divides_the_heads():
    cfg = load_model("llama-8b").cfg
    for layout in enumerate_layouts(cfg, Workload(seq_len=2048, global_batch=64), Cluster(lookup("A100-40GB"), 2, 8)):
        assert layout.tp <= 8 and cfg.n_heads % layout.tp == 0 and cfg.kv_heads % layout.tp == 0
        assert layout.pp == 1 or not cfg.tie_embeddings


def test_the_search_proposes_what_the_trainer_runs():
    """The search's candidates are those `Layout.errors` accepts, so it proposes what the
    trainer runs: a tied embedding under pipelining (any schedule but zero-bubble's V) and
    tensor parallelism above the key/value heads (each K/V head replicated)."""
    wl, cluster = Workload(seq_len=2048, global_batch=64), Cluster(lookup("H100-SXM"), 1, 8)
    tied = from_dict({"model": {"dim": 256, "n_layers": 8, "n_heads": 8, "tie_embeddings": True, "max_seq_len": 2048},
                      "data": {"seq_len": 2048}}).model
    layouts = list(enumerate_layouts(tied, wl, cluster))
    assert {lay.pp for lay in layouts} == {1, 2, 4, 8}
    assert {lay.pp_schedule for lay in layouts if lay.pp > 1} == {"gpipe", "1f1b", "interleaved-1f1b"}
    assert not [lay for lay in layouts if lay.errors(tied, seq_len=wl.seq_len)]
    gqa = from_dict({"model": {"dim": 256, "n_layers": 4, "n_heads": 8, "n_kv_heads": 2, "tie_embeddings": False,
                                "max_seq_len": 2048},
                     "data": {"seq_len": 2048}}).model
    layouts = list(enumerate_layouts(gqa, wl, cluster))
    assert {lay.tp for lay in layouts} == {1, 2, 4, 8}  # 4 and 8 above the 2 K/V heads
    assert not [lay for lay in layouts if lay.errors(gqa, seq_len=wl.seq_len)]
    # the memory model holds the K/V projections as the engine does: one head per rank, replicated
    from scaletrain.plan.params import rank_params

    one_head = ((gqa.head_size, gqa.dim),) * 2
    kv_matrices = {tp: rank_params(gqa, Layout(tp=tp), 0).matrices[1:3] for tp in (2, 4, 8)}
    assert kv_matrices[8] == kv_matrices[4] == one_head
    assert kv_matrices[2] == one_head  # 2 heads / tp 2: one each, not replicated
    # and a plan fixes them as the trainer takes them
    kw = dict(nodes=1, gpus_per_node=8, seq_len=2048, global_batch=64)
    assert plan(gqa, layout={"tp": 8}, **kw)["layouts"][0].layout.tp == 8
    assert plan(tied, layout={"pp": 2, "micro_batch": 4}, **kw)["layouts"][0].layout.pp == 2


def test_the_models_shard_what_the_engine_shards():
    """`Layout.shard_ranks`: scaletrain's ZeRO shards over the dp_shard ranks alone (its cp ranks
    hold copies and sum their gradients), the other engines also over the cp ranks. The memory
    and time models follow it: the optimizer step is not spread over scaletrain's cp ranks."""
    from dataclasses import replace

    from scaletrain.plan.memory_model import estimate_memory, sharding
    from scaletrain.plan.time_model import estimate_time, optimizer_seconds

    cfg, hw = load_model("llama-8b").cfg, lookup("H100-SXM")
    cluster = Cluster(hw, 1, 8)
    ours = Workload(seq_len=32768, global_batch=8)
    theirs = replace(ours, engine="megatron")
    flat = Layout(dp_shard=2, zero=1, micro_batch=1, grad_accum=4)
    split = replace(flat, cp=4)
    assert (split.shard_ranks(), split.shard_ranks("megatron"), flat.shard_ranks("megatron")) == (2, 8, 2)
    assert sharding(ours, split).n == 2 and sharding(theirs, split).n == 8
    params = 8e9
    assert optimizer_seconds(ours, split, hw, params) == optimizer_seconds(ours, flat, hw, params)
    spread = optimizer_seconds(theirs, flat, hw, params) / 4
    assert optimizer_seconds(theirs, split, hw, params) == pytest.approx(spread)
    assert estimate_time(cfg, ours, split, cluster).optimizer_s == estimate_time(cfg, ours, flat, cluster).optimizer_s
    assert estimate_memory(cfg, ours, split).optimizer == estimate_memory(cfg, ours, flat).optimizer
    # the cp ranks' gradient sum after backward is paid, on the critical path, without any dp rank
    alone = estimate_time(cfg, ours, Layout(cp=8, micro_batch=1, grad_accum=8), cluster)
    assert alone.dp_comm_s == alone.dp_exposed_s > 0


def test_fixed_layout_that_does_not_fit_says_why():
    r = plan("llama-8b", hardware="A100-40GB", nodes=1, gpus_per_node=8, seq_len=8192, global_batch=8,
             layout={"zero": 0, "micro_batch": 1})
    e = r["layouts"][0]
    assert not e.fits
    device = lookup("A100-40GB").memory_bytes / 2**30  # 40 GB of the datasheet, in GiB
    assert e.why_not[0].startswith("needs ") and f"but the device has {device:.1f} GiB" in e.why_not[0]
    assert "optimizer" in e.why_not[0]
    with pytest.raises(ConfigError, match="parallel.tp=3 must divide model.n_heads=32"):
        plan("llama-8b", nodes=1, gpus_per_node=6, seq_len=2048, global_batch=60, layout={"tp": 3})


def test_memory_falls_with_each_technique():
    kw = dict(hardware="H100-SXM", nodes=1, gpus_per_node=8, seq_len=4096, global_batch=8)
    total = lambda **lay: plan("llama-8b", layout=lay, **kw)["layouts"][0].memory  # noqa: E731
    z = [total(zero=k, micro_batch=1) for k in range(4)]
    assert z[0].model_states > z[1].model_states > z[2].model_states > z[3].model_states
    # under accumulation the ZeRO-2 engine still reduce-scatters every micro-step: its gradients stay
    # sharded (issue 23; they were counted whole, as ZeRO-1's)
    accum = lambda zero: plan("llama-8b", layout={"zero": zero, "micro_batch": 1}, **{**kw, "global_batch": 16})  # noqa: E731
    assert accum(2)["layouts"][0].memory.grads == z[2].grads < accum(1)["layouts"][0].memory.grads
    acts = [total(zero=3, micro_batch=1, ac=ac).activations for ac in ("none", "selective", "full")]
    assert acts[0] > acts[1] > acts[2]
    tp = total(tp=2, zero=3, micro_batch=1)
    assert tp.activations < z[3].activations
    assert total(zero=3, micro_batch=1, offload=True).optimizer == 0



def test_context_parallel_on_scaletrain_engine_splits_activations_not_states():
    kw = dict(hardware="H100-SXM", nodes=1, gpus_per_node=8, seq_len=32768, global_batch=8)
    one = plan("llama-8b", layout={"zero": 3, "micro_batch": 1}, **kw)["layouts"][0]
    cp = plan("llama-8b", layout={"zero": 3, "micro_batch": 1, "cp": 4}, **kw)["layouts"][0]
    assert cp.layout.cp == 4 and cp.layout.dp_shard == 2
    # scaletrain shards the states over dp_shard alone (2 ranks instead of 8): 4x the states...
    assert cp.memory.params == pytest.approx(4 * one.memory.params, rel=0.01)
    # ...and a quarter of the tokens' activations (plus ring's fp32 copy of the attention output)
    assert 0.25 * one.memory.activations < cp.memory.activations < 0.4 * one.memory.activations
    # the search tries cp for long sequences
    wl = Workload(seq_len=32768, global_batch=8)
    cfg = load_model("llama-8b").cfg
    cluster = Cluster(lookup("H100-SXM"), 1, 8)
    cps = {(lay.cp, lay.cp_method) for lay in enumerate_layouts(cfg, wl, cluster)}
    assert {cp for cp, _ in cps} == {1, 2, 4, 8}
    # with each method (one process: the default) where Layout.errors lets it run
    assert cps == {(1, "ring")} | {(cp, m) for cp in (2, 4, 8) for m in CP_METHODS}
    runnable = {lay.cp_method for lay in enumerate_layouts(cfg, wl, cluster) if lay.cp == 2 and lay.tp == 4
                and not layout_errors(cfg, wl, cluster, lay)}
    assert runnable == set(CP_METHODS)  # 32 heads / tp 4 = 8: cp 2 divides them, ulysses runs


def test_context_parallel_methods_pay_their_own_exchange():
    """`cp_traffic`: ring's K/V sends (mostly hidden), allgather's gathers and reduce-scatter,
    ulysses' all-to-alls of q, k, v and the output — each by its own volume."""
    from scaletrain.plan.time_model import cp_traffic

    cfg, wl = load_model("llama-8b").cfg, Workload(seq_len=32768, global_batch=8)
    kv = 8192 * 2 * 8 * 128 * 2  # one rank's K and V: 8192 rows, 8 K/V heads of 128, bf16
    q = 8192 * 32 * 128 * 2
    traffic = {m: cp_traffic(cfg, wl, Layout(dp_shard=2, cp=4, cp_method=m, micro_batch=1, zero=3)) for m in CP_METHODS}
    assert traffic["ring"] == [("send_recv", kv, 9, 0.2)]
    assert traffic["allgather"] == [("all_gather", 4 * kv, 2, 1.0), ("reduce_scatter", 4 * kv, 1, 1.0)]
    assert traffic["ulysses"] == [("all_to_all", 2 * q + kv, 2, 1.0)]
    kw = dict(hardware="H100-SXM", nodes=1, gpus_per_node=8, seq_len=32768, global_batch=8)
    t = {m: plan("llama-8b", layout={"zero": 3, "micro_batch": 1, "cp": 4, "cp_method": m}, **kw)["layouts"][0].time
         for m in CP_METHODS}
    assert len({round(x.cp_comm_s, 9) for x in t.values()}) == 3  # three different exchanges
    assert t["ulysses"].cp_comm_s > t["ring"].cp_comm_s  # exposed, and q is 4x the K/V here


def test_context_parallel_methods_hold_different_transients():
    """The attention backward of each method (`attention_backward_bytes`): allgather's score
    tiles span the whole sequence's keys, ring's one rank's block, ulysses has none."""
    kw = dict(hardware="H100-SXM", nodes=1, gpus_per_node=8, seq_len=32768, global_batch=8)
    mem = {m: plan("llama-8b", layout={"zero": 3, "micro_batch": 1, "cp": 4, "cp_method": m}, **kw)["layouts"][0]
           for m in CP_METHODS}
    assert {m: e.layout.cp_method for m, e in mem.items()} == {m: m for m in CP_METHODS}
    # allgather's tiles (8 GiB) outgrow the last layer's freed MLP half; ring's (2 GiB) do not
    assert mem["allgather"].memory.total > mem["ring"].memory.total == mem["ulysses"].memory.total
    # the saved activations are the same bytes: only the moment in backward differs
    assert len({e.memory.activations for e in mem.values()}) == 1
    cfg, wl = load_model("llama-8b").cfg, Workload(seq_len=32768, global_batch=8)
    ring, allgather = (attention_backward_bytes(cfg, wl, 1, 1, 4, m) for m in ("ring", "allgather"))
    # four fp32 tiles of 512 query rows per head: against 8192 keys (ring) or 32768 (allgather)
    assert allgather - ring > 4 * 32 * 512 * (32768 - 8192) * 4
    assert attention_backward_bytes(cfg, wl, 1, 1, 4, "ulysses") < ring / 10
    # the CLI's flag is the config key
    r = run_here("plan", "llama-8b", "--seq-len", "32768", "--global-batch", "8", "--zero", "3", "--micro-batch", "1",
                 "--cp", "4", "--cp-method", "allgather", "--json")
    assert json.loads(r.stdout)["layouts"][0]["layout"]["cp_method"] == "allgather"
    # so are the config's keys, and --cp is parallel.cp
    r = run_here("plan", "llama-8b", "--seq-len", "32768", "--global-batch", "8", "--zero", "3", "--micro-batch", "1",
                 "--parallel.cp=4", "--parallel.cp_method=ulysses", "--json")
    lay = json.loads(r.stdout)["layouts"][0]["layout"]
    assert (lay["cp"], lay["cp_method"]) == (4, "ulysses")
    r = run_here("plan", "llama-8b", "--seq-len", "32768", "--global-batch", "8", "--cp", "2", "--parallel.cp=4")
    assert r.returncode != 0 and "--cp 2 and parallel.cp=4" in r.stderr


@pytest.mark.parametrize("seq, kv_heads, precision", [(1024, 4, "32-true"), (512, 4, "32-true"), (1024, 2, "32-true"),
                                                      (1024, 2, "bf16-true")])
def test_ring_and_allgather_backward_buffers_counted_exactly(seq, kv_heads, precision):
    """Every storage ring's and allgather's backward holds at its worst moment, as LiveMemory
    counts them on one rank (one K/V block: keys = the rank's tokens), is in
    `attention_backward_bytes`'s sum — with one and with two 512-row tiles, grouped-query
    attention, 16-bit — byte for byte (the output's gradient, made before, included)."""
    import torch.distributed as dist

    from scaletrain.measure import LiveMemory
    from scaletrain.model.config import ModelConfig
    from scaletrain.parallel.context_parallel import METHODS
    from scaletrain.plan.activations import _tiled_backward_bytes
    from scaletrain.plan.trace import release_fake_world

    cfg = ModelConfig(dim=64, n_heads=4, n_kv_heads=kv_heads, n_layers=1, vocab_size=256, max_seq_len=seq)
    wl = Workload(seq_len=seq, global_batch=1, precision=precision)
    dtype = torch.float32 if precision == "32-true" else torch.bfloat16
    release_fake_world()  # the traced count's fake group, if a test before this one left it
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for method in ("ring", "allgather"):
            live = LiveMemory()
            with live:
                q = torch.randn(1, 4, seq, 16, dtype=dtype, requires_grad=True)
                k, v = (torch.randn(1, kv_heads, seq, 16, dtype=dtype, requires_grad=True) for _ in range(2))
                y = METHODS[method](q, k, v, group=dist.group.WORLD, rank=0, n=1, ranks=[0])
                dy = torch.randn_like(y)
                live.reset_peak()
                before = live.live
                y.backward(dy)
            assert live.peak - before + dy.nbytes == _tiled_backward_bytes(cfg, wl, 1, 1, 1, method), method
    finally:
        dist.destroy_process_group()


# --- inputs ---------------------------------------------------------------------------------

def test_hugging_face_configs(tmp_path):
    llama = {"model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "num_hidden_layers": 32,
             "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
             "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
             "hidden_act": "silu", "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(llama))
    r = plan(str(tmp_path / "config.json"), seq_len=2048, global_batch=64)
    assert r["num_params"] == 8_030_261_248
    gpt2 = {"model_type": "gpt2", "vocab_size": 50257, "n_embd": 768, "n_layer": 12, "n_head": 12, "n_positions": 1024}
    assert hf_config_to_model(gpt2).dim == 768
    with pytest.raises(ConfigError, match="config.json: no 'vocab_size'; expected a decoder config"):
        hf_config_to_model({"model_type": "llama"})


def test_toml_model_section(tmp_path):
    (tmp_path / "m.toml").write_text('[model]\npreset = "gpt2-124m"\nn_layers = 6\n')
    r = plan(str(tmp_path / "m.toml"), gpus_per_node=1, seq_len=1024, global_batch=8)
    assert r["cfg"].n_layers == 6 and r["layouts"][0].fits


def test_live_module_counted_and_traced():
    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(1000, 128)
            self.mlp = torch.nn.Sequential(torch.nn.Linear(128, 512), torch.nn.GELU(), torch.nn.Linear(512, 1000))

        def forward(self, tokens):
            return self.mlp(self.emb(tokens))

    r = plan(Tiny(), hardware="RTX-4090", nodes=1, gpus_per_node=2, seq_len=256, global_batch=8)
    assert r["num_params"] == 1000 * 128 + 128 * 512 + 512 + 512 * 1000 + 1000
    best = r["layouts"][0]
    # the traced activations: at least the MLP's hidden states and the logits of one micro-batch
    tokens = best.layout.micro_batch * 256
    assert best.memory.activations >= tokens * (512 + 1000) * 4
    # our own Transformer, passed as a module, is described by its config
    from scaletrain.model.transformer import Transformer

    cfg = from_dict({"model": {"dim": 64, "n_layers": 2, "n_heads": 4}, "data": {"seq_len": 32}}).model
    with torch.device("meta"):
        model = Transformer(cfg)
    assert plan(model, gpus_per_node=1, seq_len=32, global_batch=4)["cfg"] == cfg


def test_user_hardware_file(tmp_path):
    f = tmp_path / "hw.toml"
    f.write_text('[[hardware]]\nname = "MyGPU"\nmemory_GB = 48\npeak_tflops = { bf16 = 200.0, fp32 = 50.0 }\n'
                 'memory_GBps = 1000\nintra_node_GBps = 100\ninter_node_GBps = 25\n')
    r = plan("gpt2-124m", hardware="MyGPU", hardware_file=str(f), gpus_per_node=2, seq_len=1024, global_batch=16)
    assert r["cluster"].hardware.memory_GB == 48
    with pytest.raises(ConfigError, match="unknown hardware 'Nope'"):
        lookup("Nope")


# --- output ---------------------------------------------------------------------------------

def test_cli_table_json_and_chart(tmp_path):
    r = run_here("plan", "llama-8b", "--hardware", "H100-SXM", "--nodes", "1", "--gpus-per-node", "8",
                "--seq-len", "8192", "--global-batch", "64", "--top", "3", "--chart", str(tmp_path / "c.png"))
    assert r.returncode == 0, r.stderr
    assert "searched" in r.stdout and "tokens/s" in r.stdout and "memory per GPU" in r.stdout
    assert "Best: " in r.stdout
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"
    r = run_here("plan", "llama-8b", "--seq-len", "4096", "--global-batch", "32", "--json", "--top", "2")
    data = json.loads(r.stdout)
    assert data["schema"] == "scaletrain.plan/1" and data["model"]["num_params"] == 8_030_261_248
    lay = data["layouts"][0]
    for key in ("layout", "memory", "fits", "step_time_s", "tokens_per_s", "mfu"):
        assert key in lay
    assert set(lay["memory"]) >= {"params", "grads", "optimizer", "activations", "total"}
    r = run_here("plan", "llama-8b", "--hardware", "A100-40GB", "--seq-len", "8192", "--global-batch", "8",
                "--zero", "0", "--micro-batch", "1")
    assert r.returncode == 1 and "DOES NOT FIT" in r.stdout
    r = run_here("plan", "llama-8b", "--hardware", "TPUv9")
    assert r.returncode == 2 and "unknown hardware" in r.stderr and "Traceback" not in r.stderr


def test_layout_overrides_round_trip():
    lay = Layout(dp_shard=2, tp=2, pp=2, zero=1, sp=True, pp_schedule="interleaved-1f1b", pp_virtual_stages=2,
                 micro_batch=2, grad_accum=4, activation_checkpointing="selective")
    over = lay.config_overrides()
    assert over["parallel.tp"] == 2 and over["parallel.pp_schedule"] == "interleaved-1f1b"
    assert over["memory.activation_checkpointing"] == "selective"


# --- workers that sync every few steps (local SGD, DiLoCo) over a slow link -------------------

def test_diloco_sends_ddps_bytes_every_h_steps_and_hides_them_behind_tau_steps():
    from dataclasses import replace

    from scaletrain.plan.time_model import outer_sync_seconds

    cluster = Cluster(lookup("H100-SXM"), 2, 8, workers=2, workers_link_GBps=1.0)
    lay = Layout(dp_replicate=2, dp_shard=8, zero=3, dp_sync="diloco", sync_every=50)
    comm, exposed = outer_sync_seconds(lay, cluster, 1e9, step_s=1.0)
    assert exposed == pytest.approx(comm)  # nothing overlaps it without a delay
    # a ring of 2 over the link, shared by the 16 ranks' rings: 1 GB/s x 0.75 x 2 / 16 per rank
    whole = 1e9 / 8 * 4 / (0.75 * 2 / 16 * 1e9)
    assert comm == pytest.approx(whole / 50, rel=1e-3)
    int8 = outer_sync_seconds(replace(lay, sync_dtype="int8"), cluster, 1e9, step_s=1.0)[0]
    assert int8 == pytest.approx(comm / 4, rel=0.01)
    # 4 fragments of 1.33 s each, overlapped with 1 step of 1 s (with 2: hidden whole)
    streamed = replace(lay, sync_fragments=4, sync_delay=1)
    assert whole == pytest.approx(5.333, rel=1e-3)
    assert outer_sync_seconds(streamed, cluster, 1e9, step_s=1.0)[1] == pytest.approx(4 * (whole / 4 - 1) / 50,
                                                                                      rel=1e-3)
    assert outer_sync_seconds(replace(streamed, sync_delay=2), cluster, 1e9, step_s=1.0)[1] == 0


def test_plan_takes_diloco_over_a_slow_link_and_says_where_it_overtakes():
    common = dict(hardware="H100-SXM", nodes=4, gpus_per_node=8, seq_len=4096, global_batch=256, top_k=3)
    slow = plan("llama-1b", workers=2, workers_link=1.0, **common)
    best = slow["layouts"][0].layout
    assert best.dp_sync == "diloco" and best.dp_replicate == 2 and best.sync_every == 50
    text = "\n".join(slow["explanation"])
    assert "Workers: 2 sites of 16 GPUs joined by 1 GB/s" in text and "overtakes synchronous training" in text
    fast = plan("llama-1b", workers=2, workers_link=10000.0, **common)
    assert not any(e.layout.local_sync for e in fast["layouts"])  # not in the search: the link is not slow
    one_site = plan("llama-1b", **common)
    assert not any(e.layout.local_sync for e in one_site["layouts"])
    # the settings given are the ones tried
    streamed = plan("llama-1b", workers=2, workers_link=1.0, sync={"sync_every": 100, "sync_dtype": "int8"}, **common)
    assert streamed["layouts"][0].layout.describe_sync(short=True) == "diloco H100 int8"


def test_plan_cli_workers(tmp_path):
    r = run_here("plan", "llama-1b", "--nodes", "4", "--workers", "2", "--workers-link", "1", "--seq-len", "4096",
                 "--global-batch", "256", "--parallel.sync.mode=local_sgd", "--parallel.sync.every=20", "--top", "2")
    assert r.returncode == 0, r.stderr
    assert "local_sgd H20" in r.stdout and "local_sgd every 20 steps, fp32 overtakes synchronous training" in r.stdout


# --- measured against the prediction --------------------------------------------------------

def test_kendall_tau_by_hand():
    from scaletrain.measure import kendall_tau

    assert kendall_tau([1, 2, 3, 4], [10, 20, 30, 40]) == 1.0
    assert kendall_tau([1, 2, 3, 4], [4, 3, 2, 1]) == -1.0
    # one discordant pair of six: (5 - 1) / 6
    assert kendall_tau([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(4 / 6)


def test_plan_measure_top_runs_the_k_best_and_reranks_them_by_measurement(tmp_path):
    r = run_here("plan", "--config", "configs/tiny.toml", "--measure", "--top", "3", "--model.dim=64",
                 "--model.n_layers=2", "--data.seq_len=32", "--train.global_batch=4", "--train.device=cpu")
    assert r.returncode == 0, r.stderr
    table = r.stdout.split("fastest measured first:")[1].strip().splitlines()
    rows = [line.split() for line in table[1:4]]
    assert [int(row[0]) for row in rows] == [1, 2, 3]
    assert sorted(int(row[1]) for row in rows) == [1, 2, 3]  # each predicted rank once
    measured = [float(line.split(" ms")[1].split()[-1]) for line in table[1:4]]
    assert measured == sorted(measured)  # fastest measured first
    assert "Kendall's tau between the predicted and the measured order" in table[4]
