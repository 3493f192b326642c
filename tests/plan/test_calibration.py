"""The planner's calibration of the machine at hand (scaletrain.plan.calibrate, issue 24): the
fitted figures, the cache and its key, the calibrated time model, `plan --calibrate` and
`parallel.auto_measure_s`. The ranking against measured step times is a timing, so it lives in
benchmarks/planner_ranking.py (docs/benchmarks.md), not here."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from scaletrain.config import load_config
from scaletrain.hardware import Hardware
from scaletrain.plan import calibrate, plan
from scaletrain.plan.calibrate import Calibration, probes_for

from conftest import run_here

pytestmark = pytest.mark.usefixtures("forked_launches")

CPU = Hardware("CPU", 24, {"fp32": 0.1, "tf32": 0.1, "bf16": 0.1, "fp16": 0.1}, 20, 5, 1)
TINY = {"model.dim": 64, "model.n_layers": 2, "model.n_heads": 2, "data.seq_len": 32, "model.max_seq_len": 32,
        "train.global_batch": 4, "train.device": "cpu"}


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory):
    """One calibration cache for this file's runs: what one measured, the next reads."""
    return tmp_path_factory.mktemp("cache")


def test_fit_recovers_latency_and_bandwidth_of_exact_points():
    from scaletrain.bench.calibrate import _fit

    latency, bus = 2e-4, 3e9
    points = [(v, latency + v / bus) for v in (4e3, 6.4e4, 1e6, 8e6)]
    got = _fit(points)
    assert got[0] == pytest.approx(latency, rel=1e-6) and got[1] == pytest.approx(bus, rel=1e-6)
    # noise that would give a negative latency: latency 0, bandwidth through the origin
    lat, bw = _fit([(1e3, 1e-7), (1e6, 1e-3 + 1e-7), (2e6, 2.1e-3)])
    assert lat == 0.0 and 0.9e9 < bw < 1.1e9


def fake_calibration(block_s: dict, rest_s: float = 0.01, ranks: int = 2, overlap: float = 0.0,
                     allreduce=(1e-3, 1e9)) -> Calibration:
    """A calibration with `block_s[(tp, ac)]` seconds per block at micro-batch 1, linear in it."""
    cfg = load_config(None, TINY).model
    cal = Calibration("test|probe=1", ranks, {op: allreduce for op in calibrate.OPS}, overlap,
                      optimizer={"adamw|32-true": 1e-9})
    for (tp, ac), s in block_s.items():
        key = calibrate.compute_key(cfg, "32-true", 32, tp, tp > 1, ac)
        cal.compute[key] = {"1": {"block": s, "rest": rest_s}, "4": {"block": 4 * s, "rest": 4 * rest_s}}
    return cal


def test_block_seconds_are_interpolated_between_measured_micro_batches():
    cal = fake_calibration({(1, "none"): 0.01})
    key = next(iter(cal.compute))
    assert cal.block(key, 1) == pytest.approx((0.01, 0.01))
    assert cal.block(key, 2) == pytest.approx((0.02, 0.02))  # between 1 and 4
    assert cal.block(key, 8) == pytest.approx((0.08, 0.08))  # extended from the two nearest
    assert cal.has(key, 4) and not cal.has(key, 2)


def test_collective_seconds_are_latency_plus_bus_volume():
    cal = fake_calibration({}, ranks=4, allreduce=(1e-3, 1e9))
    # all-reduce of 1 GB on 4 ranks: bus volume 2·3/4 GB at 1 GB/s, one latency
    assert cal.collective_s("all_reduce", 1e9, 4) == pytest.approx(1e-3 + 1.5)
    # a group of 2 of the 4 measured ranks: a third of the ring's hops
    assert cal.collective_s("all_reduce", 1e9, 2, calls=3) == pytest.approx(3 * 1e-3 / 3 + 1.0)
    assert cal.collective_s("all_reduce", 1e9, 1) == 0.0


def plan_with(cal: Calibration, **kwargs):
    cfg = load_config(None, TINY)
    return plan(cfg.model, hardware=CPU, nodes=1, gpus_per_node=2, seq_len=32, global_batch=4, precision="32-true",
                gpu=False, calibrate=lambda *args: cal, **kwargs)


def test_the_calibrated_ranking_follows_what_was_measured_not_the_catalog():
    cheap_tp = fake_calibration({(1, "none"): 0.02, (2, "none"): 0.005, (1, "full"): 0.03, (2, "full"): 0.008,
                                 (1, "selective"): 0.025, (2, "selective"): 0.006})
    best = plan_with(cheap_tp, top_k=50)["layouts"][0]
    assert best.layout.tp == 2 and best.time.calibrated
    slow_tp = fake_calibration({(1, "none"): 0.005, (2, "none"): 0.02, (1, "full"): 0.008, (2, "full"): 0.03,
                                (1, "selective"): 0.006, (2, "selective"): 0.025})
    result = plan_with(slow_tp, top_k=50)
    assert result["layouts"][0].layout.tp == 1
    # the figure is the measured one: a block of 5 ms per micro-batch, 2 blocks, 2 micro-batches of 1 ...
    lay = {"zero": 0, "micro_batch": 1}
    ev = plan_with(slow_tp, layout=lay)["layouts"][0]
    assert ev.time.compute_s == pytest.approx(2 * (2 * 0.005 + 0.01))
    # ... whatever the catalog says of the device
    faster_catalog = replace(CPU, peak_tflops={k: 100.0 for k in CPU.peak_tflops}, memory_GBps=1e4, bus_GBps=1e3)
    cfg = load_config(None, TINY)
    again = plan(cfg.model, hardware=faster_catalog, nodes=1, gpus_per_node=2, seq_len=32, global_batch=4,
                 precision="32-true", gpu=False, calibrate=lambda *args: slow_tp, layout=lay)["layouts"][0]
    assert again.time.step_time_s == ev.time.step_time_s
    # and the explanation says which figures were calibrated
    assert "calibrated on this machine for 2 rank(s)" in " ".join(result["explanation"])


def test_data_parallel_communication_is_exposed_as_far_as_the_measured_overlap_does_not_hide_it():
    blocks = {(1, "none"): 0.01}
    lay = {"zero": 0, "micro_batch": 2}
    none = plan_with(fake_calibration(blocks, overlap=0.0, allreduce=(1e-3, 1e8)), layout=lay)["layouts"][0]
    full = plan_with(fake_calibration(blocks, overlap=1.0, allreduce=(1e-3, 1e8)), layout=lay)["layouts"][0]
    assert none.time.dp_comm_s == full.time.dp_comm_s > 0
    assert none.time.dp_exposed_s == pytest.approx(none.time.dp_comm_s)
    assert full.time.dp_exposed_s < none.time.dp_exposed_s


def test_the_calibrated_optimizer_step_is_not_spread_over_the_cp_ranks():
    """scaletrain's ZeRO shards over dp_shard alone (`Layout.shard_ranks`): cp 4 beside dp_shard 2
    steps the same half of the parameters as dp_shard 2 alone, and sums the cp ranks' gradient
    shards once per step."""
    from scaletrain.plan import calibrated_time
    from scaletrain.plan.calibrate import layout_key
    from scaletrain.plan.params import rank_params
    from scaletrain.plan.spec import Cluster, Layout, Workload

    cfg = load_config(None, TINY).model
    wl = Workload(seq_len=32, global_batch=4, precision="32-true")
    cal = fake_calibration({}, ranks=8)
    flat = Layout(dp_shard=2, zero=1, micro_batch=1, grad_accum=2)
    split = replace(flat, cp=4)
    for lay in (flat, split):
        cal.compute[layout_key(cfg, wl, lay)] = {"1": {"block": 0.01, "rest": 0.01}, "4": {"block": 0.04, "rest": 0.04}}
    cluster = Cluster(CPU, 1, 8, calibration=cal)
    params = rank_params(cfg, flat, 0).total
    for lay in (flat, split):
        t = calibrated_time.estimate(cfg, wl, lay, cluster)
        clip = cal.collective_s("all_reduce", 4, lay.world)
        assert t.optimizer_s == pytest.approx(1e-9 * params / 2 + clip)
    cp_sum = cal.collective_s("all_reduce", params * 4 / 2, 4)
    assert calibrated_time.estimate(cfg, wl, split, cluster).dp_exposed_s >= cp_sum > 0


def test_probes_cover_each_shape_at_its_smallest_and_largest_micro_batch():
    cfg = load_config(None, TINY)
    result = plan(cfg.model, hardware=CPU, nodes=1, gpus_per_node=2, seq_len=32, global_batch=4,
                  precision="32-true", gpu=False, top_k=100)
    layouts = [e.layout for e in result["layouts"]]
    everything = probes_for(result["cfg"], result["workload"], layouts)
    probes = [p for p in everything if not p.get("engine")]
    engines = [p for p in everything if p.get("engine")]
    shapes = {(p["tp"], p["sp"], p["ac"]) for p in probes}
    references = {(p["tp"], p["sp"], "none", p["micro_batch"]) for p in engines}
    assert shapes == {(lay.tp, lay.sp, lay.activation_checkpointing) for lay in layouts} | {r[:3] for r in references}
    for tp, sp, ac in shapes:
        sizes = [lay.micro_batch for lay in layouts if (lay.tp, lay.sp, lay.activation_checkpointing) == (tp, sp, ac)]
        got = sorted(p["micro_batch"] for p in probes if (p["tp"], p["sp"], p["ac"]) == (tp, sp, ac))
        # each engine's reference (its shape without checkpointing at its micro-batch) is among them
        wanted = ({min(sizes), max(sizes)} if sizes else set()) | {r[3] for r in references if r[:3] == (tp, sp, ac)}
        assert got == sorted(wanted)
    # and each data/tensor-parallel engine once, at its smallest micro-batch, without checkpointing
    wanted = {(lay.zero, lay.tp, lay.sp) for lay in layouts if lay.pp == 1}
    assert sorted((p["engine"]["zero"], p["tp"], p["sp"]) for p in engines) == sorted(wanted)
    for p in engines:
        assert p["ac"] == "none" and p["micro_batch"] == min(
            lay.micro_batch for lay in layouts if (lay.pp, lay.zero, lay.tp, lay.sp) == (1, p["engine"]["zero"],
                                                                                          p["tp"], p["sp"]))


def test_a_measured_engine_replaces_the_modelled_communication_and_optimizer_step():
    """The engine's cost per step, worked out by hand: 2 blocks, 2 micro-batches of 1. What the probe
    found once per step is paid once, what it found per micro-batch twice, whatever the stage:
    ZeRO-2 steps and gathers once though it reduce-scatters every micro-batch (counting its whole
    cost per micro-batch had predicted 1.45x a two-micro-batch step), and a trainer's per-micro-batch
    work is paid per micro-batch under DDP or tp too (counted once, tp was predicted 16-18% fast)."""
    from scaletrain.plan.calibrate import engine_key

    cal = fake_calibration({(1, "none"): 0.01})
    for zero in (0, 2, 3):
        lay = {"zero": zero, "micro_batch": 1}
        r = plan_with(cal, layout=lay)
        ev = r["layouts"][0]
        cal.engine[engine_key(r["cfg"], r["workload"], ev.layout)] = {"block": 0.002, "rest": 0.03,
                                                                      "block_micro": 0.005, "rest_micro": 0.007}
        measured = plan_with(cal, layout=lay)["layouts"][0]
        assert ev.layout.grad_accum == 2
        compute = 2 * (2 * 0.01 + 0.01)
        engine = (2 * 0.002 + 0.03) + 2 * (2 * 0.005 + 0.007)  # = 0.068
        assert engine == pytest.approx(0.068)
        assert measured.time.compute_s == pytest.approx(compute)
        assert measured.time.step_time_s == pytest.approx(compute + engine)
        assert measured.time.optimizer_s == 0.0 and measured.time.dp_exposed_s == pytest.approx(engine)


def test_a_layout_at_the_engine_probes_micro_batch_is_the_trainers_step_as_measured():
    """With the bare steps timed beside the trainer's (`plain_block`, `plain_rest`), the step is the
    trainer's own, extrapolated to the layout's blocks and micro-batches, not the engine added to
    compute measured in another session; another micro-batch or checkpointing adds the compute
    probes' difference from the probe's shape. By hand, 2 blocks, the engine probed at micro-batch 1;
    the compute probes: 10 ms a block and 10 ms the rest at micro-batch 1 (15 ms a block with full
    recomputation), 4x at 4; the bare steps beside the engine's: 12 and 11 ms."""
    from scaletrain.plan.calibrate import engine_key

    cal = fake_calibration({(1, "none"): 0.01, (1, "full"): 0.015})
    r = plan_with(cal, layout={"zero": 0, "micro_batch": 1})
    cal.engine[engine_key(r["cfg"], r["workload"], r["layouts"][0].layout)] = {
        "block": 0.002, "rest": 0.03, "block_micro": 0.005, "rest_micro": 0.007,
        "plain_block": 0.012, "plain_rest": 0.011, "micro_batch": 1}
    # 2 micro-batches of 1: the trainer's step, 0.068 (as above) + 2 x (2 x 0.012 + 0.011) = 0.138
    same = plan_with(cal, layout={"zero": 0, "micro_batch": 1})["layouts"][0]
    assert same.layout.grad_accum == 2 and same.time.step_time_s == pytest.approx(0.138)
    assert same.time.compute_s == pytest.approx(0.06) and same.time.dp_exposed_s == pytest.approx(0.078)
    # full recomputation: + 2 x 2 x (0.015 - 0.010) = 0.158
    full = plan_with(cal, layout={"zero": 0, "micro_batch": 1, "ac": "full"})["layouts"][0]
    assert full.time.step_time_s == pytest.approx(0.158)
    # one micro-batch of 2 (block and rest 20 ms each, interpolated): the trainer's one-micro-batch step
    # (2 x 0.002 + 0.03) + (2 x 0.005 + 0.007) + (2 x 0.012 + 0.011) = 0.086, + (2 x 0.02 + 0.02) - (2 x 0.01 + 0.01)
    two = plan_with(cal, layout={"zero": 0, "micro_batch": 2})["layouts"][0]
    assert two.layout.grad_accum == 1 and two.time.step_time_s == pytest.approx(0.116)


def test_an_engine_measured_before_the_per_micro_batch_probe_is_paid_once_per_step():
    from scaletrain.plan.calibrated_time import engine_seconds

    assert engine_seconds({"block": 0.002, "rest": 0.03}, blocks=4, micro_batches=3) == pytest.approx(0.038)


def test_the_engine_parts_are_recovered_from_the_six_timings():
    """engine_parts against timings made from known parts: bare forward and backward of 10 ms per
    block and 4 ms for the rest; the trainer adds 3 ms per block and 20 ms once per step, and
    1 ms per block and 6 ms per micro-batch."""
    from scaletrain.bench.calibrate import engine_parts

    def bare(n):
        return n * 0.010 + 0.004

    def trained(n, m):
        return m * bare(n) + m * (n * 0.001 + 0.006) + n * 0.003 + 0.020

    got = engine_parts(bare(1), bare(3), trained(1, 1), trained(3, 1), trained(1, 2), trained(3, 2))
    assert got == pytest.approx({"block": 0.003, "rest": 0.020, "block_micro": 0.001, "rest_micro": 0.006,
                                 "plain_block": 0.010, "plain_rest": 0.004})
    # by hand: one block, one micro-batch adds 0.001 + 0.006 + 0.003 + 0.020 = 0.030 s to a bare 0.014 s
    assert trained(1, 1) == pytest.approx(0.044)
    # a busy machine's reversed timings (3 blocks' extra below 1 block's): a part comes out below 0, and the
    # parts still give back the four training steps measured (a part clamped at 0 had added its noise to
    # every prediction, one way: ZeRO-1's engine came out 2-3x its cost)
    from scaletrain.plan.calibrated_time import engine_seconds

    timings = {(1, 1): 0.050, (3, 1): 0.060, (1, 2): 0.070, (3, 2): 0.080}
    noisy = engine_parts(0.014, 0.034, *timings.values())
    assert noisy["block_micro"] == pytest.approx(-0.010) and noisy["plain_block"] == pytest.approx(0.010)
    for (n, m), t in timings.items():
        assert engine_seconds(noisy, n, m) + m * (n * noisy["plain_block"] + noisy["plain_rest"]) == pytest.approx(t)


def test_the_cache_is_keyed_by_machine_and_versions(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cal = fake_calibration({(1, "none"): 0.01})
    got = calibrate.merge(None, {"collectives": cal.collectives, "overlap": 0.5, "compute": cal.compute,
                                 "optimizer": cal.optimizer}, "cpu", 2)
    assert got.machine == calibrate.machine_key("cpu", 2)
    loaded = calibrate.load("cpu", 2)
    assert loaded.compute == cal.compute and loaded.overlap == 0.5
    assert calibrate.load("cpu", 4) is None  # another rank count is another calibration
    monkeypatch.setattr(torch, "__version__", "0.0.0-other")
    assert calibrate.load("cpu", 2) is None  # so is another PyTorch (or CPU, core count, probe version)


def ranked(stdout: str) -> list[str]:
    """A plan's table's layouts, in its order."""
    import re

    return re.findall(r"^\s+\d+\s+(.+?)\s+[0-9.]+\s+(?:yes|NO)\s", stdout.split("memory per GPU")[0], re.M)


@pytest.mark.multiproc
def test_plan_calibrate_measures_this_machine_once_then_reads_the_cache(shared_cache, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(shared_cache))
    args = ["plan", "--config", "configs/tiny.toml", "--calibrate", "--nproc", "2", "--top", "3",
            *(f"--{k}={v}" for k, v in TINY.items())]
    first = run_here(*args)
    assert first.returncode == 0, first.stderr
    assert "calibrated this machine for 2 rank(s)" in first.stderr
    assert "collectives and overlap" in first.stderr
    cal = calibrate.load("cpu", 2)
    assert set(cal.collectives) == set(calibrate.OPS)
    assert all(lat >= 0 and bus > 0 for lat, bus in cal.collectives.values())
    assert 0.0 <= cal.overlap <= 1.0 and cal.optimizer["adamw|32-true"] > 0
    # a block's seconds are (3 blocks - 1 block) / 2, clamped at 0: on a busy machine the two
    # timings of a micro model can come out equal or reversed, so only the whole model's must be > 0
    compute = [v for by_size in cal.compute.values() for v in by_size.values()]
    assert compute and all(v["block"] >= 0 and v["rest"] >= 0 and v["block"] + v["rest"] > 0 for v in compute)
    # an engine's parts are signed differences (`engine_parts`); the training steps they add up to are not
    from scaletrain.plan.calibrated_time import engine_seconds

    assert cal.engine and all(engine_seconds(v, n, m) + m * (n * v["plain_block"] + v["plain_rest"]) > 0
                              and v["micro_batch"] >= 1 for v in cal.engine.values() for n in (1, 3) for m in (1, 2))
    second = run_here(*args)
    assert second.returncode == 0 and "calibrated this machine" not in second.stderr  # read from the cache
    # the same ranking; the figures may differ by the machine's pace since (all alike, `Calibration.slowdown`)
    assert ranked(second.stdout) == ranked(first.stdout) and len(ranked(first.stdout)) == 3
    assert "Step times calibrated on this machine for 2 rank(s)" in second.stdout


@pytest.mark.multiproc
def test_auto_layout_times_the_best_predicted_layouts_within_its_budget(tmp_path, shared_cache, monkeypatch):
    # the CLI's main in this process; its timed layouts and the training run on forked ranks
    # (forked_launches): the choice is the subject here, the launcher's fresh ranks are tested elsewhere
    monkeypatch.setenv("XDG_CACHE_HOME", str(shared_cache))
    r = run_here("train", "--config", "configs/tiny.toml", "--nproc", "2", "--parallel.layout=auto",
                 "--parallel.auto_measure_s=20", "--train.steps=2", f"--log.run_dir={tmp_path / 'run'}",
                 *(f"--{k}={v}" for k, v in TINY.items() if k != "train.device"), "--train.device=cpu")
    assert r.returncode == 0, r.stderr
    said = r.stdout + r.stderr
    timed = next(line for line in said.splitlines() if "parallel.auto_measure_s=20: timed the" in line)
    k = int(timed.split("timed the ")[1].split()[0])
    assert 2 <= k <= 5
    assert timed.count(" ms (predicted ") == k
    assert "parallel.layout=auto chose" in said


def test_a_calibration_taken_on_a_busy_machine_says_so(monkeypatch):
    from scaletrain import measure

    monkeypatch.setattr(measure.os, "getloadavg", lambda: (12.0, 0.0, 0.0))
    monkeypatch.setattr("scaletrain.hardware.cpu_cores", lambda: 2)
    assert measure._busy(2) == "the machine was busy (load average 12.0 on 2 cores, 2 of it the calibration's)"
    monkeypatch.setattr(measure.os, "getloadavg", lambda: (2.5, 0.0, 0.0))  # the calibration's own ranks
    assert measure._busy(2) is None


def test_every_calibrated_figure_is_scaled_by_the_machines_slowdown_since_it_was_calibrated():
    """The step of the engine test above, by hand: compute 0.06 s and engine 0.068 s at the
    calibration's pace; the machine now twice as slow (`Calibration.slowdown` 2): 0.256 s, and
    the explanation says by how much."""
    from scaletrain.plan.calibrate import engine_key

    cal = fake_calibration({(1, "none"): 0.01})
    lay = {"zero": 0, "micro_batch": 1}
    r = plan_with(cal, layout=lay)
    cal.engine[engine_key(r["cfg"], r["workload"], r["layouts"][0].layout)] = {
        "block": 0.002, "rest": 0.03, "block_micro": 0.005, "rest_micro": 0.007}
    assert plan_with(cal, layout=lay)["layouts"][0].time.step_time_s == pytest.approx(0.128)
    cal.slowdown = 2.0
    slow = plan_with(cal, layout=lay)
    t = slow["layouts"][0].time
    assert t.step_time_s == pytest.approx(0.256)
    assert t.compute_s == pytest.approx(0.12) and t.dp_exposed_s == pytest.approx(0.136)
    assert "all × 2.00 for the machine's pace now" in " ".join(slow["explanation"])


def test_probes_measured_at_another_pace_are_brought_to_the_cached_ones(tmp_path, monkeypatch):
    """A calibration made at a pace of 0.1 s; a probe added later while the machine ran twice as
    slow (pace 0.2 s) is stored at half its measured seconds, the expert load (a ratio) as it is;
    the pace survives the cache."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = {"collectives": {op: (1e-3, 1e9) for op in calibrate.OPS}, "overlap": 0.0,
             "compute": {"a": {"1": {"block": 0.01, "rest": 0.02}}}, "optimizer": {"adamw|32-true": 2e-9}}
    cal = calibrate.merge(None, first, "cpu", 2, pace=0.1)
    later = {"compute": {"b": {"1": {"block": 0.04, "rest": 0.06, "imbalance": 3.0}}}, "optimizer": {},
             "engine": {"e": {"block": 0.008, "rest": 0.002, "block_micro": 0.0, "rest_micro": 0.01}}}
    cal = calibrate.merge(cal, later, "cpu", 2, pace=0.2)
    loaded = calibrate.load("cpu", 2)
    assert loaded.pace == 0.1
    assert loaded.compute["a"]["1"] == {"block": 0.01, "rest": 0.02}
    assert loaded.compute["b"]["1"] == pytest.approx({"block": 0.02, "rest": 0.03, "imbalance": 3.0})
    assert loaded.engine["e"] == pytest.approx({"block": 0.004, "rest": 0.001, "block_micro": 0.0, "rest_micro": 0.005})
    assert loaded.optimizer == {"adamw|32-true": 2e-9}


def test_a_plan_reads_the_machines_pace_now_against_the_calibrations():
    from scaletrain.measure import paced

    said = []
    cal = paced(fake_calibration({}), 0.1, said.append)
    assert cal.slowdown == 1.0 and not said  # a calibration without a pace: as measured
    cal.pace = 0.05
    assert paced(cal, 0.1, said.append).slowdown == pytest.approx(2.0)
    assert said == ["this machine runs 2.00x as long now as when it was calibrated (a fixed piece of work took "
                    "100 ms, then 50 ms: slower); the calibrated step times are scaled by it"]
    assert paced(cal, 0.052, said.append).slowdown == pytest.approx(1.04) and len(said) == 1  # within 10%: quiet
