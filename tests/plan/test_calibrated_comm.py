"""Each engine's communication per step, derived here by hand from a fixed calibration
(`scaletrain.plan.calibrated_time`), as tests/plan/test_calibration.py derives one collective.

A collective of `nbytes` (the whole buffer, as `scaletrain bench comms` counts it) over `n` of
the calibration's ranks takes, per call, its measured latency times the ring's share of the hops
((n - 1) / (ranks - 1)), and in all the bus volume (nbytes × the ring's bus factor: 2(n-1)/n for
an all-reduce, (n-1)/n for an all-gather, reduce-scatter and all-to-all, 1 for a send) at its
measured bandwidth. Every collective has its own latency and bandwidth here, and the precision
(bf16-mixed) stores 4-byte weights and computes in 2 bytes, so that a collective priced as
another, or a buffer counted in another dtype, moves the figures by far more than the tolerance.

The catalog's time model (`scaletrain.plan.time_model`) with a measured bus bandwidth
(`plan --comms`) is checked the same way, for the engines whose collectives it prices there
(the calibrated model measures tensor parallelism inside its compute probes).
"""

from __future__ import annotations

import math

import pytest

from scaletrain.config import load_config
from scaletrain.hardware import Hardware
from scaletrain.model.transformer import Transformer
from scaletrain.plan import calibrate, calibrated_time, time_model
from scaletrain.plan.calibrate import Calibration
from scaletrain.plan.spec import Cluster, Layout, Workload

RANKS = 8
# (latency s, bus bandwidth B/s) per collective: no two alike
MEASURED = {"all_reduce": (1e-4, 2e8), "all_gather": (2e-4, 3e8), "reduce_scatter": (3e-4, 5e8),
            "all_to_all": (5e-4, 7e8), "send_recv": (7e-4, 1.1e9)}
OVERLAP = 0.25
OPTIMIZER_S = 3e-9  # per parameter stepped
BLOCK_S = {1: 2e-3, 2: 1.3e-3}  # a block's forward and backward at micro-batch 1, by tp
REST_S = {1: 1.5e-3, 2: 1.1e-3}  # embedding, head and loss
BUCKET_MB = 0.1  # the DDP/ZeRO bucket: a few buckets for this model
SEQ, PRECISION = 32, "bf16-mixed"
PARAM_B, COMPUTE_B, GRAD_B = 4, 2, 4  # bf16-mixed: fp32 weights, bf16 matmuls, fp32 gradient reductions
TOLERANCE = 1e-9  # relative: the same arithmetic, in another order

CPU = Hardware("CPU", 24, {"fp32": 0.1, "tf32": 0.1, "bf16": 0.1, "fp16": 0.1}, 20, 5, 1)


@pytest.fixture(scope="module")
def model():
    """(its config, its parameter count): 4 blocks of 4 query and 2 key/value heads of 16."""
    cfg = load_config(None, {"model.dim": 64, "model.n_layers": 4, "model.n_heads": 4, "model.n_kv_heads": 2,
                             "data.seq_len": SEQ, "model.max_seq_len": SEQ}).model
    return cfg, sum(p.numel() for p in Transformer(cfg).parameters())


def calibration(cfg) -> Calibration:
    cal = Calibration("test|probe=1", RANKS, dict(MEASURED), OVERLAP, optimizer={f"adamw|{PRECISION}": OPTIMIZER_S})
    for tp, sp in ((1, False), (2, True)):
        for cp in (1, 2, 4):
            key = calibrate.compute_key(cfg, PRECISION, SEQ, tp, sp, "none", cp)
            cal.compute[key] = {"1": {"block": BLOCK_S[tp] / cp, "rest": REST_S[tp] / cp},
                                "4": {"block": 4 * BLOCK_S[tp] / cp, "rest": 4 * REST_S[tp] / cp}}
    return cal


def seconds(op: str, nbytes: float, n: int, calls: int = 1) -> float:
    """One collective by hand (the module's docstring)."""
    bus_factor = {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n,
                  "all_to_all": (n - 1) / n, "send_recv": 1.0}[op]
    latency, bandwidth = MEASURED[op]
    return calls * latency * (n - 1) / (RANKS - 1) + nbytes * bus_factor / bandwidth


def close(got: float, want: float, what: str) -> None:
    err = abs(got - want) / abs(want)
    assert err <= TOLERANCE, f"{what}: {got:.6g} s, by hand {want:.6g} s ({err / TOLERANCE:.3g}x tolerance)"


def hand(cfg, params: int, lay: Layout) -> dict[str, float]:
    """The step's parts for layout `lay` (no pipeline or one of 2 stages), derived from the
    calibrated model's docstring: compute, data-parallel communication and what of it is
    exposed, context- and pipeline-parallel communication, the optimizer step and the clip."""
    m, mb, cp, tp, blocks = lay.grad_accum, lay.micro_batch, lay.cp, lay.tp, cfg.n_layers
    block, rest = mb * BLOCK_S[tp] / cp, mb * REST_S[tp] / cp
    if lay.pp == 1:
        compute = m * (blocks * block + rest)
    else:  # two stages of two blocks, the last with the rest
        compute = m * (blocks // 2 * block + rest)
    out = {"compute": compute, "pp": 0.0, "cp": 0.0, "dp": 0.0, "dp_exposed": 0.0}
    grads = params * GRAD_B
    buckets = math.ceil(grads / (BUCKET_MB * 2 ** 20))
    backward = compute / m * 2 / 3  # the last micro-batch's, where DDP and ZeRO-1/2 reduce
    n, r = lay.dp_shard, lay.dp_replicate
    if lay.dp > 1 and lay.zero == 0:  # DDP: the gradients all-reduced bucket by bucket
        comm = seconds("all_reduce", grads, n * r, buckets)
        out["dp"], out["dp_exposed"] = comm, comm - min(comm, OVERLAP * backward)
    elif lay.zero in (1, 2):  # reduce-scattered (ZeRO-2: every micro-batch), the weights all-gathered after
        times = m if lay.zero == 2 else 1
        reduce = times * seconds("reduce_scatter", grads, n, buckets)
        if r > 1:  # then all-reduced over the replicas, shard by shard
            reduce += times * seconds("all_reduce", grads / n, r, buckets)
        gather = seconds("all_gather", params * PARAM_B, n, buckets)
        out["dp"] = reduce + gather
        out["dp_exposed"] = reduce - min(reduce, OVERLAP * backward * times) + gather
    elif lay.zero == 3:  # FSDP: each block (and the rest) gathered twice in bf16, reduce-scattered, per micro-batch
        units = blocks + 1
        per_micro = 2 * seconds("all_gather", params * COMPUTE_B, n, units) + \
            seconds("reduce_scatter", grads, n, units)
        if r > 1:
            per_micro += seconds("all_reduce", grads / n, r, units)
        out["dp"] = m * per_micro
        out["dp_exposed"] = out["dp"] - min(out["dp"], OVERLAP * compute)
    if cp > 1:  # the cp ranks sum their gradients (their ZeRO shards) after backward, exposed
        summed = seconds("all_reduce", grads / (n if lay.zero >= 1 else 1), cp)
        out["dp"] += summed
        out["dp_exposed"] += summed
        rows = mb * SEQ / cp  # this rank's tokens of a sequence
        kv = rows * 2 * cfg.kv_heads * cfg.head_size / tp * COMPUTE_B
        q = rows * cfg.n_heads * cfg.head_size / tp * COMPUTE_B
        per_block = {  # each block's exchange per micro-batch, forward and backward
            # K/V passed round the ring forward, and with dK/dV in backward: mostly hidden (20% exposed)
            "ring": seconds("send_recv", kv, 2, 3 * (cp - 1)) * 0.2,
            # K/V gathered for forward and again for backward, dK/dV reduce-scattered
            "allgather": seconds("all_gather", cp * kv, cp, 2) + seconds("reduce_scatter", cp * kv, cp),
            # q, k, v to head shards and the output back, forward and backward
            "ulysses": seconds("all_to_all", q + kv + q, cp, 2),
        }[lay.cp_method]
        out["cp"] = m * blocks * per_block
    if lay.pp > 1:  # each micro-batch's activation forward and its gradient back, per chunk boundary
        sent = mb * SEQ / cp * cfg.dim * COMPUTE_B / (tp if lay.sp else 1)
        out["pp"] = 2 * m * lay.chunks_per_rank * seconds("send_recv", sent, 2)
    stepped = params / n if lay.zero >= 1 else params
    out["optimizer"] = OPTIMIZER_S * stepped + seconds("all_reduce", 4, lay.world)  # and the clip's norm
    return out


CASES = {
    "ddp": Layout(dp_shard=2, micro_batch=2, grad_accum=2),
    "ddp-replicate": Layout(dp_replicate=2, dp_shard=2, micro_batch=1, grad_accum=2),
    "zero1": Layout(dp_shard=4, zero=1, micro_batch=1, grad_accum=1),
    "zero2-accum": Layout(dp_shard=2, zero=2, micro_batch=1, grad_accum=4),
    "zero1-replicate": Layout(dp_replicate=2, dp_shard=2, zero=1, micro_batch=1, grad_accum=2),
    "zero2-replicate": Layout(dp_replicate=2, dp_shard=2, zero=2, micro_batch=1, grad_accum=2),
    "fsdp-accum": Layout(dp_shard=2, zero=3, micro_batch=1, grad_accum=2),
    "hsdp": Layout(dp_replicate=2, dp_shard=2, zero=3, micro_batch=1, grad_accum=1),
    "cp2-ring": Layout(cp=2, cp_method="ring", micro_batch=1, grad_accum=2),
    "cp4-allgather": Layout(cp=4, cp_method="allgather", micro_batch=1, grad_accum=2),
    "cp2-ulysses": Layout(cp=2, cp_method="ulysses", micro_batch=2, grad_accum=2),
    "zero1xcp2-ring": Layout(dp_shard=2, zero=1, cp=2, cp_method="ring", micro_batch=1, grad_accum=2),
    "pp2-gpipe": Layout(pp=2, pp_schedule="gpipe", micro_batch=1, grad_accum=4),
    "pp2-interleaved": Layout(pp=2, pp_schedule="interleaved-1f1b", pp_virtual_stages=2, micro_batch=1, grad_accum=4),
    "tp2-sp-pp2": Layout(tp=2, sp=True, pp=2, pp_schedule="1f1b", micro_batch=2, grad_accum=2),
}


@pytest.mark.parametrize("name", CASES)
def test_each_engines_communication_is_the_calibrated_collectives_by_hand(model, name):
    cfg, params = model
    lay = CASES[name]
    assert not lay.errors(cfg, seq_len=SEQ), lay.errors(cfg, seq_len=SEQ)
    wl = Workload(seq_len=SEQ, global_batch=lay.global_batch, precision=PRECISION)
    t = calibrated_time.estimate(cfg, wl, lay, Cluster(CPU, 1, RANKS, calibration=calibration(cfg)),
                                 bucket_mb=BUCKET_MB)
    want = hand(cfg, params, lay)
    close(t.compute_s, want["compute"], f"{name}: compute")
    assert t.tp_comm_s == 0.0  # measured inside the compute probes, not added again
    for part, got in (("dp", t.dp_comm_s), ("dp_exposed", t.dp_exposed_s), ("cp", t.cp_comm_s),
                      ("pp", t.pp_comm_s)):
        if want[part] == 0.0:
            assert got == 0.0, f"{name}: {part} communication {got:.3g} s where there is none"
        else:
            close(got, want[part], f"{name}: {part} communication")
    if lay.pp == 1:  # the pipeline's rank holds other parameters than the whole model's
        close(t.optimizer_s, want["optimizer"], f"{name}: optimizer step and clip")
        close(t.step_time_s, want["compute"] + want["cp"] + want["dp_exposed"] + want["optimizer"], f"{name}: step")
    else:
        close(t.bubble_s, (want["compute"] + want["pp"]) * t.bubble_fraction, f"{name}: bubble")


def test_the_calibration_tells_each_engines_collectives_apart(model):
    """The figures above are not at easy points: the exposed part of each data-parallel engine
    is neither all nor none of its communication (the overlap's min() does not saturate)."""
    cfg, params = model
    for name, lay in CASES.items():
        want = hand(cfg, params, lay)
        if want["dp"] and lay.dp > 1:
            assert 0 < want["dp_exposed"] < want["dp"], name


# ------------------------------------------------------------------------------------------
# The catalog's time model with a measured bus bandwidth

BUS_GBPS = 37.0
GPU = Hardware("GPU", 80, {"bf16": 100.0, "fp32": 50.0}, 2000.0, 300.0, 50.0, bus_GBps=BUS_GBPS)


def catalog_comm(cfg, params: int, lay: Layout) -> dict[str, float]:
    """The catalog's communication per step inside one node, by hand: ring volumes at the
    measured bus bandwidth (`Hardware.bus_GBps`), FSDP's ring latency per gathered block."""
    m, mb, cp, tp, blocks = lay.grad_accum, lay.micro_batch, lay.cp, lay.tp, cfg.n_layers
    bw = BUS_GBPS * 1e9
    act = mb * SEQ / cp * cfg.dim * COMPUTE_B
    out = {"tp": 0.0, "cp": 0.0, "pp": 0.0, "dp": 0.0}
    if tp > 1:  # an all-reduce after attention and after the MLP of each block of the rank, forward and
        # backward; and the embedding's and the head's
        out["tp"] = (4 * blocks // lay.pp + 2) * m * 2 * (tp - 1) / tp * act / bw
    if cp > 1:
        rows = mb * SEQ / cp
        kv = rows * 2 * cfg.kv_heads * cfg.head_size / tp * COMPUTE_B
        q = rows * cfg.n_heads * cfg.head_size / tp * COMPUTE_B
        per_block = {"ring": 3 * (cp - 1) * kv / bw * 0.2,
                     "allgather": (2 + 1) * cp * kv * (cp - 1) / cp / bw,
                     "ulysses": 2 * (q + kv + q) * (cp - 1) / cp / bw}[lay.cp_method]
        out["cp"] = m * blocks * per_block
        out["dp"] += 2 * (cp - 1) / cp * params * GRAD_B / bw  # the cp ranks' gradient sum
    if lay.pp > 1:
        out["pp"] = 2 * m * lay.chunks_per_rank * act / (tp if lay.sp else 1) / bw * 0.2
    n = lay.dp
    if n > 1 and lay.zero == 0:
        out["dp"] += 2 * (n - 1) / n * params * GRAD_B / bw
    elif n > 1 and lay.zero in (1, 2):
        out["dp"] += (n - 1) / n * params * (GRAD_B + PARAM_B) / bw
    elif n > 1:
        hop = time_model.HOP_LATENCY_S["intra"]
        out["dp"] += m * ((n - 1) / n * params * (2 * COMPUTE_B + GRAD_B) / bw + 3 * blocks * (n - 1) * hop)
    return out


CATALOG = {
    "ddp": Layout(dp_shard=4, micro_batch=1, grad_accum=2),
    "zero2": Layout(dp_shard=2, zero=2, micro_batch=1, grad_accum=2),
    "fsdp": Layout(dp_shard=4, zero=3, micro_batch=2, grad_accum=2),
    "tp2": Layout(tp=2, micro_batch=1, grad_accum=2),
    "tp4-sp": Layout(tp=4, sp=True, micro_batch=2, grad_accum=1),
    "cp2-ring": Layout(cp=2, cp_method="ring", micro_batch=1, grad_accum=2),
    "cp4-allgather": Layout(cp=4, cp_method="allgather", micro_batch=1, grad_accum=2),
    "cp2-ulysses": Layout(cp=2, cp_method="ulysses", micro_batch=1, grad_accum=2),
    "tp2-sp-pp2": Layout(tp=2, sp=True, pp=2, pp_schedule="1f1b", micro_batch=1, grad_accum=4),
}


@pytest.mark.parametrize("name", CATALOG)
def test_the_catalog_prices_each_engines_collectives_at_the_measured_bus_bandwidth(model, name):
    cfg, params = model
    lay = CATALOG[name]
    assert not lay.errors(cfg, seq_len=SEQ), lay.errors(cfg, seq_len=SEQ)
    wl = Workload(seq_len=SEQ, global_batch=lay.global_batch, precision=PRECISION)
    t = time_model.estimate_time(cfg, wl, lay, Cluster(GPU, 1, 8))
    want = catalog_comm(cfg, params, lay)
    for part, got in (("tp", t.tp_comm_s), ("cp", t.cp_comm_s), ("pp", t.pp_comm_s), ("dp", t.dp_comm_s)):
        if want[part] == 0.0:
            assert got == 0.0, f"{name}: {part} communication {got:.3g} s where there is none"
        else:
            close(got, want[part], f"{name}: {part} communication")
