"""`scaletrain bench comms | step | techniques`, run for real on CPU at small sizes, and the
planner reading measured collective figures. Structure and consistency only: timings on a
shared machine are noise, so no test checks a speed."""

from __future__ import annotations

import json
import statistics

import pytest
import torch

from scaletrain import cli
from scaletrain.bench import comms, step, techniques
from scaletrain.bench.interleave import Row, rows_table

from conftest import MICRO, run_cli

FACTORS_N2 = {"all_reduce": 1.0, "all_gather": 0.5, "reduce_scatter": 0.5, "all_to_all": 0.5,
              "broadcast": 1.0, "reduce": 1.0}  # 2(n-1)/n, (n-1)/n, 1 at n = 2
MICRO_ARGS = [f"--{k}={v}" for k, v in MICRO.items() if not k.startswith(("log.", "checkpoint.", "train.steps"))]


@pytest.fixture(scope="module")
def comms_file(tmp_path_factory):
    r = run_cli("bench", "comms", "--nproc", "2", "--sizes", "4K", "64K", "--iters", "3", "--warmup", "1", "--json")
    assert r.returncode == 0, r.stderr
    path = tmp_path_factory.mktemp("comms") / "comms.json"
    path.write_text(r.stdout)
    return path


@pytest.mark.multiproc
def test_comms_every_collective_with_nccl_tests_factors(comms_file):
    result = json.loads(comms_file.read_text())
    assert (result["backend"], result["device"], result["world_size"]) == ("gloo", "cpu", 2)
    assert result["sizes"] == [4096, 65536]
    assert {(r["op"], r["bytes"]) for r in result["rows"]} == {(op, s) for op in FACTORS_N2 for s in (4096, 65536)}
    for r in result["rows"]:
        assert r["time_s"] > 0 and r["algbw_GBps"] > 0
        assert r["algbw_GBps"] == pytest.approx(r["bytes"] / r["time_s"] / 1e9, rel=1e-12)
        assert r["bus_factor"] == FACTORS_N2[r["op"]]
        assert r["busbw_GBps"] == r["algbw_GBps"] * FACTORS_N2[r["op"]]
    assert set(result["busbw_at_largest_GBps"]) == set(FACTORS_N2)
    text = comms.table(result)  # the table prints every row
    for op in FACTORS_N2:
        assert op in text
    assert text.count("64 KiB") == len(FACTORS_N2)


def test_comms_sizes_and_factors():
    assert comms.parse_sizes(["1K", "64KiB,1M"]) == [1024, 65536, 2**20]
    assert comms.parse_sizes(["1K:16K"]) == [1024, 4096, 16384]
    assert comms.parse_sizes(["1K:8K:2"]) == [1024, 2048, 4096, 8192]
    assert comms.message_sizes([1000, 4096], 3) == [996, 4092]  # whole float32 elements per rank
    assert [comms.bus_factor(op, 8) for op in comms.OPS] == [1.75, 0.875, 0.875, 1.0, 1.0, 0.875]


def _error_line(capsys, *argv) -> str:
    assert cli.main(list(argv)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("scaletrain: error: "), err
    return err[0]


def test_bad_input_is_one_line_exit_2(capsys):
    assert "not a size" in _error_line(capsys, "bench", "comms", "--sizes", "12X")
    assert "not a size" in _error_line(capsys, "bench", "comms", "--sizes", "0")
    assert "less than one float32 per rank" in _error_line(capsys, "bench", "comms", "--sizes", "4")
    assert "at least 2 ranks" in _error_line(capsys, "bench", "comms", "--nproc", "1")
    assert "--vs train.nope=1: train.nope: unknown key" in _error_line(capsys, "bench", "step", *MICRO_ARGS, "--vs",
                                                                       "train.nope=1")
    assert "section.key=value" in _error_line(capsys, "bench", "step", *MICRO_ARGS, "--vs", "compile")
    assert "optim.name" in _error_line(capsys, "bench", "step", *MICRO_ARGS, "--vs", "optim.name=lion")
    assert "unknown technique" in _error_line(capsys, "bench", "techniques", *MICRO_ARGS, "--skip", "nope")
    assert step.parse_variant("train.compile=true,parallel.pp_split=1,2") == {"train.compile": "true",
                                                                            "parallel.pp_split": "1,2"}


def _check_rows(rows: list[dict]) -> None:
    """Every figure of a measured row follows from its step times, every ratio from the baseline's."""
    base = rows[0]
    assert base["name"].startswith("baseline") and base["status"] == "measured"
    for r in rows:
        if r["status"] != "measured":
            assert r["reason"] and r["speed"] is None and r["memory"] is None
            continue
        assert all(t > 0 for t in r["times_s"]) and r["peak_bytes"] >= r["kept_bytes"] > 0
        assert r["median_s"] == statistics.median(r["times_s"])
        assert r["tokens_per_s"] == pytest.approx(r["tokens_per_step"] / r["median_s"], rel=1e-12)
        assert r["speed"] == pytest.approx(r["tokens_per_s"] / base["tokens_per_s"], rel=1e-12)
        assert r["memory"] == pytest.approx(r["peak_bytes"] / base["peak_bytes"], rel=1e-12)
        assert 0 < r["mfu"]


@pytest.mark.slow
def test_step_with_a_variant_and_the_hand_written_loop():
    r = run_cli("bench", "step", *MICRO_ARGS, "--steps", "3", "--warmup", "1", "--vs", "optim.name=sgd",
                "--vs-plain-loop", "--json")
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    rows = result["rows"]
    assert [x["name"] for x in rows] == ["baseline", "optim.name=sgd", "hand-written loop"]
    assert all(x["status"] == "measured" and len(x["times_s"]) == 3 for x in rows)
    _check_rows(rows)
    assert rows[0]["speed"] == rows[0]["memory"] == 1.0
    assert rows[0]["tokens_per_step"] == rows[2]["tokens_per_step"] == 8 * 32  # same batch for the plain loop
    # SGD keeps one momentum buffer where AdamW keeps two: less resident memory
    assert rows[1]["memory"] < 1.0
    text = step.report(result)
    for name in ("baseline", "optim.name=sgd", "hand-written loop", "speed x", "memory x"):
        assert name in text
    assert f"{rows[1]['speed']:.3f}" in text and f"{rows[1]['memory']:.3f}" in text


@pytest.mark.slow
def test_techniques_table_and_chart(tmp_path):
    png = tmp_path / "chart.png"
    # --max-slowdown 0: one noisy step must not drop a row here (tested on a fake clock below)
    r = run_cli("bench", "techniques", *MICRO_ARGS, "--steps", "2", "--warmup", "1", "--skip", "compile",
                "--max-slowdown", "0", "--png", str(png), "--json")
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    rows = {x["name"]: x for x in result["rows"]}
    expected = ["baseline", "grad accumulation x4 (micro-batch 2)", "activation checkpointing full",
                "activation checkpointing selective", "precision tf32", "precision 16-mixed", "precision bf16-mixed",
                "precision bf16-true", "precision fp8", "larger batch x2 (micro-batch 16)", "optimizer sgd",
                "optimizer adafactor", "optimizer adamw8bit", "optimizer muon",
                "loader workers 2", "ZeRO stage 1", "ZeRO stage 2",
                "ZeRO stage 3", "compile"]
    assert list(rows) == expected
    _check_rows(result["rows"])
    for z in (1, 2, 3):
        assert rows[f"ZeRO stage {z}"]["status"] == "skipped" and "--nproc >= 2" in rows[f"ZeRO stage {z}"]["reason"]
    assert rows["compile"]["status"] == "skipped" and "--skip" in rows["compile"]["reason"]
    assert rows["precision fp8"]["status"] == "skipped" and "sm89+" in rows["precision fp8"]["reason"]
    for name in ("grad accumulation x4 (micro-batch 2)", "activation checkpointing full", "larger batch x2 "
                 "(micro-batch 16)", "optimizer sgd", "precision bf16-mixed", "loader workers 2"):
        assert rows[name]["status"] == "measured", rows[name]
    # what each buys in memory is no timing: fewer saved activations, more of them, less optimizer state
    assert rows["grad accumulation x4 (micro-batch 2)"]["memory"] < 1
    assert rows["activation checkpointing full"]["memory"] < 1
    assert rows["larger batch x2 (micro-batch 16)"]["memory"] > 1
    assert rows["larger batch x2 (micro-batch 16)"]["tokens_per_step"] == 2 * rows["baseline"]["tokens_per_step"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"wrote {png}" in r.stderr
    text = techniques.report(result)
    assert all(name in text for name in expected)
    assert "skipped: needs --nproc >= 2" in text


@pytest.mark.multiproc
def test_techniques_zero_stages_on_two_ranks():
    skip = [k for k in ("accum", "ac-full", "ac-selective", "precision-tf32", "precision-16-mixed",
                        "precision-bf16-mixed", "precision-bf16-true", "batch", "optim-sgd", "optim-adafactor",
                        "optim-adamw8bit", "workers", "compile")]
    r = run_cli("bench", "techniques", *MICRO_ARGS, "--nproc", "2", "--steps", "2", "--warmup", "1",
                "--skip", *skip, "--max-slowdown", "0", "--png", "", "--json")
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    assert result["world_size"] == 2
    rows = {x["name"]: x for x in result["rows"]}
    assert rows["baseline (DDP)"]["status"] == "measured"
    for z in (1, 2, 3):
        assert rows[f"ZeRO stage {z}"]["status"] == "measured", rows[f"ZeRO stage {z}"]
    _check_rows(result["rows"])
    # what each rank keeps between steps: ZeRO-3 shards parameters and optimizer state and keeps no
    # gradient buckets (a step's peak on a model this small is mostly buffers, so no claim on it)
    assert rows["ZeRO stage 3"]["kept_bytes"] < rows["baseline (DDP)"]["kept_bytes"]
    assert "wrote" not in r.stderr  # --png '' draws no chart


def test_rows_table_marks_skipped_rows():
    rows = [Row("baseline", "measured", times_s=[0.1], tokens_per_step=100, median_s=0.1, tokens_per_s=1000,
                mfu=0.5, peak_bytes=2**20, speed=1.0, memory=1.0),
            Row("ZeRO stage 1", "skipped", reason="needs --nproc >= 2")]
    lines = rows_table(rows).splitlines()
    assert lines[1].split()[-2:] == ["1.000", "1.000"]
    assert lines[2].startswith("ZeRO stage 1") and lines[2].endswith("skipped: needs --nproc >= 2")


def test_interleaving_failures_and_slow_runners(monkeypatch):
    # fake runners on a fake clock: each step advances it by the runner's cost
    from scaletrain.bench import interleave

    clock, calls = [0.0], []
    monkeypatch.setattr(interleave.time, "perf_counter", lambda: clock[0])

    def entry(name, cost, fail=False):
        def make():
            if fail:
                raise RuntimeError("no kernel for this\nsecond line")

            def step():
                calls.append(name)
                clock[0] += cost
                torch.ones(int(cost * 1000))  # memory in proportion to the cost

            return interleave.Runner(step, tokens_per_step=100, flops_per_token=1.0, peak_flops=1e6)
        return interleave.Entry(name, make)

    entries = [entry("base", 1.0), entry("fast", 0.5), entry("broken", 1.0, fail=True), entry("slow", 30.0),
               interleave.Entry("absent", None, "needs --nproc >= 2"), entry("fair", 2.0)]
    rows = interleave.run(entries, steps=3, warmup=2, device=torch.device("cpu"), tolerate_failures=True,
                          max_slowdown=20)
    by = {r.name: r for r in rows}
    assert [r.status for r in rows] == ["measured", "measured", "failed", "skipped", "skipped", "measured"]
    assert by["broken"].reason == "RuntimeError: no kernel for this"
    assert by["slow"].reason.startswith("too slow here: a step took 30.00 s, 30x the baseline's 1.00 s")
    assert by["fast"].times_s == [0.5] * 3 and by["fast"].speed == 2.0 and by["fair"].speed == 0.5
    assert by["fair"].peak_bytes == 2 * by["base"].peak_bytes == 8000 and by["fair"].memory == 2.0
    timed = calls[2 * 4 + 1:2 * 4 + 10]  # after the warm-ups (2 each, the slow one's too, and one more of
    # the baseline's for the slowdown reference): rounds, rotated
    assert timed == ["base", "fast", "fair", "fast", "fair", "base", "fair", "base", "fast"]
    with pytest.raises(RuntimeError):  # a baseline that fails is an error, not a row
        interleave.run([entry("base", 1.0, fail=True)], steps=1, warmup=1, device=torch.device("cpu"),
                       tolerate_failures=True)


def test_planner_uses_measured_bus_bandwidth(comms_file, tmp_path, capsys):
    from dataclasses import replace

    from scaletrain.hardware import lookup
    from scaletrain.plan import plan

    def dp_comm(bus: float) -> float:
        hw = replace(lookup("H100-SXM"), bus_GBps=bus)
        r = plan("gpt2-124m", hardware=hw, gpus_per_node=2, seq_len=1024, global_batch=8, layout={"zero": 0})
        return r["layouts"][0].time.dp_comm_s

    assert dp_comm(1.0) == pytest.approx(100 * dp_comm(100.0))  # the collective time scales with 1 / bandwidth

    def planned(*extra) -> float:
        argv = ["plan", "gpt2-124m", "--gpus-per-node", "2", "--seq-len", "1024", "--global-batch", "8",
                "--zero", "0", "--json", *extra]
        assert cli.main(argv) in (0, 1)
        return json.loads(capsys.readouterr().out)["layouts"][0]["time"]["dp_comm_s"]

    catalog, measured = planned(), planned("--comms", str(comms_file))
    bus = json.loads(comms_file.read_text())["busbw_at_largest_GBps"]["all_reduce"]
    assert bus < lookup("H100-SXM").intra_node_GBps  # gloo on a shared CPU is no NVLink
    assert measured > catalog
    assert measured == pytest.approx(dp_comm(bus), rel=1e-9)
    assert cli.main(["plan", "gpt2-124m", "--gpus-per-node", "2", "--zero", "0", "--comms", str(comms_file)]) in (0, 1)
    assert "measured all-reduce bus bandwidth" in capsys.readouterr().out
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert "not the output of `scaletrain bench comms --json`" in _error_line(capsys, "plan", "gpt2-124m", "--comms",
                                                                               str(bad))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpt2_step_beside_a_hand_written_loop_on_gpu():
    # GPT-2 124M, bf16-mixed, compiled, against the minimal loop of the same model in the same run
    r = run_cli("bench", "step", "--model.preset=gpt2-124m", "--data.seq_len=1024", "--train.global_batch=12",
                "--train.micro_batch=12", "--precision.mode=bf16-mixed", "--train.compile=true", "--train.device=cuda",
                "--steps", "10", "--warmup", "5", "--vs-plain-loop", "--json", timeout=1200)
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)["rows"]
    assert [x["name"] for x in rows] == ["baseline", "hand-written loop"]
    assert all(x["status"] == "measured" for x in rows)
    _check_rows(rows)


def answering_rank(spec_path: str, out_path: str) -> int:
    """A worker task for run_on_ranks' test: rank 0 echoes the spec and says the world size, or
    every rank fails as a user's error would."""
    import os

    from scaletrain.errors import UserError
    from scaletrain.launch.ranks import read_spec, write_result

    spec = read_spec(spec_path)
    if spec["fail"]:
        raise UserError("planted failure")
    if os.environ["RANK"] == "0":
        write_result(out_path, {"echo": spec["echo"], "world": int(os.environ["WORLD_SIZE"])})
    return 0


@pytest.mark.multiproc
def test_run_on_ranks_returns_rank_0s_result_or_raises_the_ranks_exit_code(capfd):
    from pathlib import Path

    from scaletrain.launch.ranks import RanksFailed, run_on_ranks

    here = (str(Path(__file__).parent), str(Path(__file__).parents[1]))  # this file, and conftest it imports
    got = run_on_ranks("test_bench:answering_rank", {"echo": [1, "a"], "fail": False}, 2, pythonpath=here)
    assert got == {"echo": [1, "a"], "world": 2}
    with pytest.raises(RanksFailed) as failed:
        run_on_ranks("test_bench:answering_rank", {"echo": None, "fail": True}, 2, pythonpath=here)
    assert failed.value.code == 2 and isinstance(failed.value, SystemExit)  # a user's error, as the CLI exits
    assert "planted failure" in capfd.readouterr().err


def test_the_compute_probe_runs_the_weights_a_run_starts_from():
    """The calibration's compute probe times the model a run trains: the run's initial weights (by name),
    not nn's defaults. With those defaults the probe's backward went through subnormal floats, which this
    CPU computes 10-100x slower: a 3-block forward and backward took 5.2 s against 0.3 s, and the
    calibrated planner predicted 14-40x the measured step times (benchmarks/planner_ranking.py)."""
    from scaletrain.bench.calibrate import _model_step
    from scaletrain.config import load_config
    from scaletrain.model.transformer import Transformer
    from scaletrain.parallel.init import init_weights

    cfg = load_config(None, {**MICRO, "model.n_layers": 2}).model
    probe = _model_step(cfg, torch.device("cpu"), 2, "32-true", 32, 2, 1, False, "none").model
    with torch.no_grad():
        run = Transformer(cfg)
        init_weights(run, seed=0)
    mine, theirs = dict(probe.named_parameters()), dict(run.named_parameters())
    assert mine.keys() == theirs.keys()
    for name, p in mine.items():
        assert torch.equal(p, theirs[name]), name


def test_the_calibration_keeps_the_median_call_as_the_measurement_keeps_the_median_step(monkeypatch):
    """On a busy machine most calls are slow and a few find the cores free. The calibration's
    figure for a probe is the median of its timed calls, as `scaletrain.measure` times training
    steps (the figure a prediction is compared with); the fastest call, kept before, had made
    every calibrated prediction fast by the machine's load (DDP's ratio 0.79-0.94 run to run). Each
    rank's median, then the slowest rank's, as the measurement takes the slowest rank's median step."""
    import time as time_module

    import torch.distributed as dist

    from scaletrain.bench import calibrate as probes
    from scaletrain.measure import _timed_steps

    durations = [0.050, 0.010, 0.031, 0.030, 0.012, 0.032]  # the first: the untimed warm-up call
    now = [0.0]
    monkeypatch.setattr(time_module, "perf_counter", lambda: now[0])  # a clock that moves as the calls run

    def calls():
        left = iter(durations)

        def call(*args):
            now[0] += next(left)
        return call

    monkeypatch.setattr(dist, "barrier", lambda *a, **k: None)
    other_rank = []  # what the all-reduce got: one figure per probe, this rank's median

    def all_reduce(t, op=None):  # a second rank whose median was `other`: the slowest rank's is kept
        other_rank.append(t.tolist())
        t.copy_(torch.maximum(t, torch.full_like(t, other)))

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    other = 0.020
    got = probes._timed(calls(), torch.device("cpu"))
    assert other_rank == [[pytest.approx(0.030)]]
    other = 0.045  # a slower rank sets the figure, its median against this one's
    assert probes._timed(calls(), torch.device("cpu")) == pytest.approx(0.045)

    class Trainer:
        train_step = staticmethod(calls())

    Trainer.train_step(None)  # as measure does: warm-up steps first, untimed
    measured = _timed_steps(Trainer(), None, 5)
    assert got == pytest.approx(0.030) == pytest.approx(measured)  # the median of 10, 31, 30, 12, 32 ms


def test_measured_layouts_keep_their_median_round():
    """With several rounds, each layout keeps the rows of its median round by its slowest rank's step
    (the faster middle one of an even count), as the probes keep their median call: the fastest
    round, kept before, was the one that found the cores free, and the predictions came out slow
    against it."""
    from scaletrain.measure import _median_round

    def rows(*seconds):  # one layout's ranks in one round
        return [{"step_time_s": s, "round": seconds} for s in seconds]

    rounds = [[rows(0.30, 0.31), rows(0.50, 0.40)],  # round 1: layouts a, b
              [rows(0.20, 0.26), rows(0.45, 0.46)],
              [rows(0.33, 0.29), rows(0.70, 0.10)]]
    assert _median_round(rounds) == [rows(0.30, 0.31), rows(0.50, 0.40)]  # a: 0.26 < 0.31 < 0.33; b: 0.46 < 0.5 < 0.7
    assert _median_round(rounds[:2]) == [rows(0.20, 0.26), rows(0.45, 0.46)]
    assert _median_round(rounds[:1]) == rounds[0]
