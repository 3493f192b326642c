from __future__ import annotations

import pytest
import torch

from scaletrain.train.trainer import Trainer

from conftest import assert_same_run, micro_cfg

STEPS = 50
# Against 32-true, over 50 steps of the micro model at lr 1e-3, every step's (loss, gradient
# norm before clipping) relative difference. The losses' bound is the README's precision table
# (seen on CPU: bf16-mixed 0.14%, 16-mixed 0.23%, bf16-true 0.13%). The gradient norm is what
# shows a loss scale left in the gradients (16-mixed: x 65536), which clipping and AdamW hide
# from the losses; it tracks 32-true closely over the first 10 steps (seen: 2e-4 for 16-mixed,
# 3e-3 for bf16: held to `scaletrain verify`'s tolerances for the mode), then the runs drift
# apart and a step where the norm spikes differs by up to 40% (step 43, every mode): after
# step 10 it is held within a factor of 2. tf32 changes nothing on a CPU (its matmuls stay
# fp32), so comparing it with fp32 there could not fail: it has its own tests below, and a GPU one.
LOSS_TOL = 0.01
LATE_NORM_TOL = 1.0
MODES = ("bf16-mixed", "16-mixed", "bf16-true")
LR = {"optim.lr": 1e-3}


@pytest.fixture(scope="module")
def fp32_history(tmp_path_factory):
    cfg = micro_cfg(tmp_path_factory.mktemp("fp32"), **{"train.steps": STEPS, **LR})
    return Trainer(cfg).fit()["history"]


@pytest.fixture
def matmul_precision_restored():
    """Precision modes set process-wide matmul flags (configure_backends): put them back, so
    that no later test runs under another test's mode."""
    saved = (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32)
    yield
    torch.set_float32_matmul_precision(saved[0])
    torch.backends.cudnn.allow_tf32 = saved[1]


@pytest.mark.parametrize("mode", MODES)
def test_each_mode_tracks_fp32(tmp_path, fp32_history, mode):
    from scaletrain.verify import CALIBRATED_STEPS, TOLERANCES

    rows = Trainer(micro_cfg(tmp_path, **{"train.steps": STEPS, "precision.mode": mode, **LR})).fit()["history"]
    first = CALIBRATED_STEPS
    assert_same_run(rows[:first], fp32_history[:first], steps=first, tol=TOLERANCES[mode],
                    what=f"{mode} against 32-true, steps 1-{first}")
    assert_same_run(rows, fp32_history, steps=STEPS, tol=(LOSS_TOL, LATE_NORM_TOL), what=f"{mode} against 32-true")
    assert rows[-1]["loss"] < rows[0]["loss"] - 1.5  # and it learns


def test_tf32_sets_the_matmul_precision_and_says_what_it_does_on_cpu(tmp_path, matmul_precision_restored):
    from scaletrain.precision import Precision

    cfg = micro_cfg(tmp_path, **{"precision.mode": "tf32"})
    tf32 = Precision(cfg.precision, torch.device("cpu"))
    tf32.configure_backends()
    assert torch.get_float32_matmul_precision() == "high"  # TF32 allowed where the device has it
    Precision(micro_cfg(tmp_path).precision, torch.device("cpu")).configure_backends()
    assert torch.get_float32_matmul_precision() == "highest"
    assert "on CPU matmuls stay fp32" in tf32.note()


def test_tf32_on_cpu_trains_exactly_like_fp32(tmp_path, fp32_history, matmul_precision_restored):
    """What the note promises: on a CPU, tf32 is 32-true, bit for bit, losses and gradients."""
    rows = Trainer(micro_cfg(tmp_path, **{"train.steps": STEPS, "precision.mode": "tf32", **LR})).fit()["history"]
    assert [(r["step"], r["loss"], r["grad_norm"]) for r in rows] == \
        [(r["step"], r["loss"], r["grad_norm"]) for r in fp32_history]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="TF32 is a CUDA matmul mode: needs a GPU")
def test_tf32_on_gpu_differs_from_fp32_within_its_tolerance(tmp_path, matmul_precision_restored):
    from scaletrain.verify import CALIBRATED_STEPS, TOLERANCES, rel_diff

    base = {"train.steps": STEPS, "train.device": "cuda", **LR}
    fp32 = Trainer(micro_cfg(tmp_path / "a", **base)).fit()["history"]
    tf32 = Trainer(micro_cfg(tmp_path / "b", **base, **{"precision.mode": "tf32"})).fit()["history"]
    assert torch.get_float32_matmul_precision() == "high"  # the tf32 run did set it (the fixture undoes it)
    worst = max(rel_diff(a["loss"], b["loss"]) for a, b in zip(tf32, fp32, strict=True))
    assert 0 < worst, "the tf32 run computed exactly what fp32 did: it did not run TF32 matmuls"
    # and it stays close, gradients included: verify's tolerances over the first 10 steps, then
    # the losses within 1e-3 and the norms as the other modes' (see LATE_NORM_TOL)
    first = CALIBRATED_STEPS
    assert_same_run(tf32[:first], fp32[:first], steps=first, tol=TOLERANCES["tf32"], what="tf32, steps 1-10")
    assert_same_run(tf32, fp32, steps=STEPS, tol=(1e-3, LATE_NORM_TOL), what="tf32 against fp32")


def test_fp16_overflow_skips_step_and_lowers_scale(tmp_path):
    trainer = Trainer(micro_cfg(tmp_path, **{"precision.mode": "16-mixed", "precision.init_scale": 1024.0}))
    batches = trainer.batches()
    before = {n: p.detach().clone() for n, p in trainer.pm.dp.named_params}
    for bad in (float("inf"), float("nan")):
        trainer.forward_backward(batches)
        trainer.pm.dp.named_params[3][1].grad.view(-1)[0] = bad  # one poisoned gradient element
        scale = trainer.precision.scaler.scale
        _, skipped = trainer.update()
        assert skipped
        assert trainer.precision.scaler.scale == scale * 0.5
        for n, p in trainer.pm.dp.named_params:
            assert torch.equal(p, before[n]), n  # weights untouched
        assert all(p.grad is None for _, p in trainer.pm.dp.named_params)
    assert trainer.precision.scaler.skipped_steps == 2
    trainer.forward_backward(batches)
    _, skipped = trainer.update()  # a clean step moves the weights again
    assert not skipped
    assert any(not torch.equal(p, before[n]) for n, p in trainer.pm.dp.named_params)


def test_fp16_scale_grows_after_clean_interval(tmp_path):
    cfg = micro_cfg(tmp_path, **{"precision.mode": "16-mixed", "precision.init_scale": 8.0,
                                 "precision.growth_interval": 3, "train.steps": 7})
    trainer = Trainer(cfg)
    trainer.fit()
    assert trainer.precision.scaler.scale == 8.0 * 2 * 2  # grew after steps 3 and 6


def test_fp16_scale_never_below_minimum(tmp_path):
    trainer = Trainer(micro_cfg(tmp_path, **{"precision.mode": "16-mixed", "precision.init_scale": 4.0,
                                             "precision.min_scale": 2.0}))
    for _ in range(3):
        trainer.precision.scaler.update(found_inf=True)
    assert trainer.precision.scaler.scale == 2.0


def test_bf16_true_keeps_fp32_master_weights(tmp_path):
    trainer = Trainer(micro_cfg(tmp_path, **{"precision.mode": "bf16-true", "optim.lr": 1e-4}))
    assert all(p.dtype == torch.bfloat16 for _, p in trainer.pm.dp.named_params)
    masters = [m for _, m in trainer.pm.master.named_master]
    assert all(m.dtype == torch.float32 for m in masters)
    assert {id(p) for g in trainer.optimizer.param_groups for p in g["params"]} == {id(m) for m in masters}
    batches = trainer.batches()
    start = [m.detach().clone() for m in masters]
    for _ in range(3):
        trainer.forward_backward(batches)
        trainer.update()
    # the masters took updates smaller than bf16 can represent; the model holds their rounding
    moved = [(m - s).abs().max().item() for m, s in zip(masters, start)]
    assert min(moved) > 0
    for (_, p), m in zip(trainer.pm.dp.named_params, masters):
        assert torch.equal(p, m.to(torch.bfloat16))
    assert any(not torch.equal(m, m.to(torch.bfloat16).float()) for m in masters)
