"""Data parallelism on real processes (gloo on CPU): parity with one process, memory as the
ZeRO paper says, distinct data per rank, checkpoints that reshard."""

from __future__ import annotations

import pytest

from scaletrain.config import load_config
from scaletrain.train.trainer import Trainer

from conftest import micro_cfg, micro_overrides, run_group

pytestmark = pytest.mark.multiproc

STEPS = 10
TOL = 1e-5  # relative, every step's loss (fp32)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Single-process losses: plain, and with gradient accumulation."""
    out = {}
    for name, extra in {"plain": {}, "accum": {"train.micro_batch": 1}}.items():
        cfg = micro_cfg(tmp_path_factory.mktemp(name), **{"train.steps": STEPS, **extra})
        out[name] = Trainer(cfg).fit()["losses"]
    return out


def assert_parity(losses, ref):
    assert [step for step, _ in losses] == list(range(1, STEPS + 1))
    worst = max(abs(loss - r) / r for (_, loss), r in zip(losses, ref))
    assert worst < TOL, worst
    return worst


def paper_bytes(zero: int, n: int, psi: int) -> int:
    """Model-state bytes per rank for fp32 AdamW (Rajbhandari et al. 2020, section 5)."""
    return {0: 16 * psi, 1: 8 * psi + 8 * psi / n, 2: 4 * psi + 12 * psi / n, 3: 16 * psi / n}[zero]


LAYOUTS_2 = [  # (name, overrides, reference)
    ("zero0", {"parallel.zero": 0}, "plain"),
    ("zero1", {"parallel.zero": 1}, "plain"),
    ("zero2", {"parallel.zero": 2}, "plain"),
    ("zero3", {"parallel.zero": 3}, "plain"),
    ("zero0-accum", {"parallel.zero": 0, "train.micro_batch": 1}, "accum"),
    ("zero2-accum", {"parallel.zero": 2, "train.micro_batch": 1}, "accum"),
    ("zero3-accum", {"parallel.zero": 3, "train.micro_batch": 2}, "accum"),
]
LAYOUTS_4 = [
    ("zero0", {"parallel.zero": 0}, "plain"),
    ("zero1", {"parallel.zero": 1}, "plain"),
    ("zero2", {"parallel.zero": 2}, "plain"),
    ("zero3", {"parallel.zero": 3}, "plain"),
    ("hsdp-zero3", {"parallel.zero": 3, "parallel.dp_replicate": 2}, "plain"),
    ("hsdp-zero2", {"parallel.zero": 2, "parallel.dp_replicate": 2}, "plain"),
    ("zero1-accum", {"parallel.zero": 1, "train.micro_batch": 1}, "accum"),
]


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"{n}ranks")
def group_results(request, tmp_path_factory):
    n = request.param
    layouts = LAYOUTS_2 if n == 2 else LAYOUTS_4
    tmp = tmp_path_factory.mktemp(f"dp{n}")
    # dim 128 and vocabulary 256 divide into 2 and 4 equal shards: no padding in the memory figures
    jobs = [{"overrides": micro_overrides(tmp / name, **{"train.steps": STEPS, **extra})}
            for name, extra, _ in layouts]
    code, results, err = run_group(n, jobs, tmp)
    assert code == 0, err
    return n, layouts, results


def test_parity_with_one_process(group_results, reference):
    n, layouts, results = group_results
    for (name, _, ref), result in zip(layouts, results):
        assert_parity(result["losses"], reference[ref])


def test_each_rank_reads_distinct_samples_whose_union_is_the_global_batch(group_results, tmp_path):
    from scaletrain.data.loader import StepSampler

    n, layouts, results = group_results
    for (name, extra, _), result in zip(layouts, results):
        per_dp_rank = {}
        for r in result["ranks"]:
            per_dp_rank[r["dp_rank"]] = sum(r["indices"], [])
        flat = sum(per_dp_rank.values(), [])
        assert len(per_dp_rank) == n and len(flat) == len(set(flat)) == 8, name
        single = StepSampler(14571, 8, 8, 1, 0, 1, seed=1234).rank_micro_batches(0)[0]
        assert sorted(flat) == sorted(single), name


def test_model_state_memory_follows_the_zero_paper(group_results):
    n, layouts, results = group_results
    for (name, extra, _), result in zip(layouts, results):
        if "accum" in name or "hsdp" in name:
            continue
        zero = extra["parallel.zero"]
        psi = result["num_params"]
        for r in result["ranks"]:
            b = r["state_bytes"]
            measured = b["params"] + b["grads"] + b["optimizer"]
            expected = paper_bytes(zero, n, psi)
            assert abs(measured - expected) / expected < 0.05, (name, r["rank"], measured, expected)


def test_metrics_report_global_and_per_device_throughput(group_results):
    n, layouts, results = group_results
    row = results[0]["history"][-1]
    assert row["tokens_per_s"] == pytest.approx(row["tokens_per_s_per_device"] * n)
    assert row["peak_mem_bytes"] > 0 and 0 < row["mfu"]


def _tail_parity(history, ref, first_step):
    losses = [(r["step"], r["loss"]) for r in history]
    assert [s for s, _ in losses] == list(range(first_step, STEPS + 1))
    worst = max(abs(loss - ref[s - 1]) / ref[s - 1] for s, loss in losses)
    assert worst < TOL, worst


def test_checkpoints_reshard_across_layouts(tmp_path, reference):
    ref = reference["plain"]
    save4 = tmp_path / "zero3-4ranks"
    save0 = tmp_path / "zero0-2ranks"
    code, _, err = run_group(4, [{"overrides": micro_overrides(
        save4, **{"train.steps": STEPS, "parallel.zero": 3, "checkpoint.every": 5})}], tmp_path)
    assert code == 0, err
    step5 = save4 / "checkpoints" / "step_00000005"
    assert step5.is_dir()
    code, results, err = run_group(2, [
        # saved at zero 3 on 4 ranks, resumed at zero 3 on 2 ranks
        {"overrides": micro_overrides(tmp_path / "r2", **{"train.steps": STEPS, "parallel.zero": 3,
                                                          "checkpoint.resume": str(step5)})},
        # and at zero 1 (sharded optimizer state, replicated weights) on 2 ranks
        {"overrides": micro_overrides(tmp_path / "r2z1", **{"train.steps": STEPS, "parallel.zero": 1,
                                                            "checkpoint.resume": str(step5)})},
        # a zero 0 run that saves, for the next resume
        {"overrides": micro_overrides(save0, **{"train.steps": STEPS, "parallel.zero": 0,
                                                "checkpoint.every": 5})},
    ], tmp_path)
    assert code == 0, err
    _tail_parity(results[0]["history"], ref, 6)
    _tail_parity(results[1]["history"], ref, 6)
    # saved at zero 3 on 4 ranks, resumed on 1 process
    one = Trainer(micro_cfg(tmp_path / "r1", **{"train.steps": STEPS, "checkpoint.resume": str(step5)})).fit()
    _tail_parity(one["history"], ref, 6)
    # saved at zero 0 (DDP), resumed at zero 3
    z0step5 = save0 / "checkpoints" / "step_00000005"
    code, results, err = run_group(2, [{"overrides": micro_overrides(
        tmp_path / "r3", **{"train.steps": STEPS, "parallel.zero": 3, "checkpoint.resume": str(z0step5)})}],
        tmp_path)
    assert code == 0, err
    _tail_parity(results[0]["history"], ref, 6)


def test_rank_killed_mid_save_leaves_previous_checkpoint(tmp_path, reference):
    from scaletrain.train import checkpoint as ckpt

    run = tmp_path / "killed"
    job = {"overrides": micro_overrides(run, **{"train.steps": STEPS, "parallel.zero": 2, "checkpoint.every": 2}),
           "fault": {"kind": "kill_during_save", "rank": 1, "save": 2}}
    code, _, err = run_group(2, [job], tmp_path)
    assert code != 0
    folder = run / "checkpoints"
    assert [p.name for p in ckpt.complete_checkpoints(folder)] == ["step_00000002"]
    assert (folder / ".step_00000004.partial").is_dir()  # the half-written save is left aside
    resumed = Trainer(load_config(None, micro_overrides(run, **{"train.steps": STEPS, "checkpoint.resume": "auto"})))
    assert resumed.step == 2
    _tail_parity(resumed.fit()["history"], reference["plain"], 3)


PRECISION_LAYOUTS = [(0, "bf16-true"), (1, "bf16-true"), (2, "16-mixed"), (3, "bf16-mixed"), (3, "bf16-true"),
                     (3, "16-mixed")]


def test_precision_composes_with_every_zero_stage(tmp_path):
    """bf16 modes reduce gradients in fp32; 16-mixed shares its overflow verdict over ranks."""
    jobs = [{"overrides": micro_overrides(tmp_path / f"z{z}-{mode}", **{
        "train.steps": STEPS, "parallel.zero": z, "precision.mode": mode, "optim.lr": 1e-3})}
        for z, mode in PRECISION_LAYOUTS]
    # an inf in one rank's gradient shard at step 3: every rank must skip that step
    jobs.append({"overrides": micro_overrides(tmp_path / "overflow", **{
        "train.steps": 6, "parallel.zero": 3, "precision.mode": "16-mixed", "precision.init_scale": 256.0}),
        "fault": {"kind": "inf_grad", "rank": 1, "step": 3}})
    code, results, err = run_group(2, jobs, tmp_path)
    assert code == 0, err
    for (z, mode), result in zip(PRECISION_LAYOUTS, results):
        ref = Trainer(micro_cfg(tmp_path / f"ref-{z}-{mode}", **{
            "train.steps": STEPS, "precision.mode": mode, "optim.lr": 1e-3})).fit()["losses"]
        worst = max(abs(loss - r) / r for (_, loss), r in zip(result["losses"], ref))
        assert worst < 1e-3, (z, mode, worst)  # reduced precision: summation order shows
    rows = results[-1]["history"]
    assert [r["loss_scale"] for r in rows] == [256.0, 256.0, 128.0, 128.0, 128.0, 128.0]
    assert rows[-1]["skipped_steps"] == 1


def test_offload_is_refused_on_cpu(tmp_path):
    import pytest as _pytest

    from scaletrain.errors import ConfigError

    from scaletrain.layout import Layout

    cfg = micro_cfg(tmp_path, **{"memory.offload_optimizer": True, "parallel.zero": 1})
    with _pytest.raises(ConfigError, match="offloads the sharded model states of parallel.zero=3"):
        Layout.from_config(cfg, 2).check(cfg.model)
    job = {"overrides": micro_overrides(tmp_path / "off", **{"parallel.zero": 3, "memory.offload_optimizer": True})}
    code, _, err = run_group(2, [job], tmp_path)
    assert code != 0 and "this run is on the CPU already" in err


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available() or __import__("torch").cuda.device_count() < 2,
                    reason="needs 2 CUDA devices (FSDP2 CPU offload pins host memory)")
def test_offload_matches_one_gpu(tmp_path):
    cuda = {"train.device": "cuda", "train.steps": STEPS}
    ref = Trainer(micro_cfg(tmp_path / "ref", **cuda)).fit()["losses"]
    job = {"overrides": micro_overrides(tmp_path / "off", **{**cuda, "parallel.zero": 3,
                                                            "memory.offload_optimizer": True})}
    code, results, err = run_group(2, [job], tmp_path)
    assert code == 0, err
    assert max(abs(loss - r) / r for (_, loss), r in zip(results[0]["losses"], ref)) < 1e-4
