"""The paths only a CUDA device exercises, together (`make test-gpu` runs every `gpu`-marked test
of the suite: these, and those beside their features — tf32 in test_precision, real fp8 in
test_fp8, FSDP2 offload in test_data_parallel, the GPT-2 step beside a hand-written loop in
test_bench). On a machine without CUDA each skips with its reason.

Their bounds are the CPU tests' where the same comparison exists there (the precision modes
against fp32: test_precision's); the others are stated where they are set. None of them has run
yet: no session so far had a GPU (docs/benchmarks.md says which figures are still to take).
"""

from __future__ import annotations

import pytest
import torch

from scaletrain.train.trainer import Trainer

from conftest import assert_same_run, micro_cfg, read_metrics, run_cli

CUDA = torch.cuda.is_available()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs a CUDA device")]

STEPS = 20
ON_GPU = {"train.device": "cuda", "train.steps": STEPS, "optim.lr": 1e-3}


@pytest.fixture(scope="module")
def fp32_on_gpu(tmp_path_factory):
    torch.set_float32_matmul_precision("highest")
    return Trainer(micro_cfg(tmp_path_factory.mktemp("fp32"), **ON_GPU)).fit()["history"]


@pytest.mark.parametrize("mode", ["bf16-mixed", "16-mixed", "bf16-true"])
def test_each_precision_mode_on_cuda_tracks_fp32(tmp_path, fp32_on_gpu, mode):
    """CUDA autocast, the fp16 loss scaler and bf16 parameters with fp32 masters, as on CPU
    (test_precision's bounds: verify's tolerances for the first steps, 1% on the losses after)."""
    from scaletrain.verify import CALIBRATED_STEPS, TOLERANCES

    rows = Trainer(micro_cfg(tmp_path, **ON_GPU, **{"precision.mode": mode})).fit()["history"]
    first = CALIBRATED_STEPS
    assert_same_run(rows[:first], fp32_on_gpu[:first], steps=first, tol=TOLERANCES[mode], what=f"{mode} on cuda")
    assert_same_run(rows, fp32_on_gpu, steps=STEPS, tol=(0.01, 1.0), what=f"{mode} on cuda, all steps")


def test_fused_adamw_steps_like_the_foreach_kernel(tmp_path):
    """`optim.implementation = fused` (one CUDA kernel for every parameter) against foreach:
    the same arithmetic in another order, so within 1e-4 of each other's losses (a stated bound)."""
    foreach = Trainer(micro_cfg(tmp_path / "a", **ON_GPU, **{"optim.implementation": "foreach"})).fit()["losses"]
    fused_trainer = Trainer(micro_cfg(tmp_path / "b", **ON_GPU, **{"optim.implementation": "fused"}))
    assert all(g.get("fused") for g in fused_trainer.optimizer.param_groups)  # it did take the fused kernel
    fused = fused_trainer.fit()["losses"]
    assert max(abs(a - b) / b for a, b in zip(fused, foreach, strict=True)) <= 1e-4


def test_compile_on_cuda_trains_like_eager(tmp_path):
    """torch.compile's CUDA kernels (Triton) against eager: fused element-wise work rounds
    differently, within 1e-3 of the losses (the bound test_fp8 holds compile to on CPU)."""
    eager = Trainer(micro_cfg(tmp_path / "a", **ON_GPU)).fit()["losses"]
    compiled = Trainer(micro_cfg(tmp_path / "b", **ON_GPU, **{"train.compile": True})).fit()["losses"]
    assert max(abs(a - b) / b for a, b in zip(compiled, eager, strict=True)) <= 1e-3


def test_one_rank_over_nccl_trains_as_one_process(tmp_path):
    """`train --nproc 1` on a GPU: a process group of one rank on the NCCL backend, the same
    losses as the plain process (nothing to reduce: the same arithmetic)."""
    import json

    cfg = micro_cfg(tmp_path / "a", **ON_GPU)
    plain = [row["loss"] for row in Trainer(cfg).fit()["history"]]
    path = tmp_path / "config.json"  # the same config, as a run's config.json
    path.write_text(json.dumps(cfg.replace(**{"log.run_dir": str(tmp_path / "b")}).to_dict()))
    r = run_cli("train", "--nproc", "1", "--config", str(path), timeout=600)
    assert r.returncode == 0, r.stderr
    losses = [row["loss"] for row in read_metrics(tmp_path / "b") if "loss" in row]
    assert losses == pytest.approx(plain, rel=1e-6)


def test_batches_arrive_in_page_locked_memory(tmp_path):
    """`data.pin_memory` (on by default): the loader page-locks batches on CUDA runs, so the copy
    to the device can overlap; off, they are ordinary host memory."""
    on = Trainer(micro_cfg(tmp_path / "a", **ON_GPU))
    inputs, _ = next(on.batches())
    assert inputs.is_pinned()
    off = Trainer(micro_cfg(tmp_path / "b", **ON_GPU, **{"data.pin_memory": False}))
    inputs, _ = next(off.batches())
    assert not inputs.is_pinned()
