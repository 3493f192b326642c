from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import time

import pytest
import torch

from scaletrain.errors import CheckpointError, ConfigError, UserError
from scaletrain.train import checkpoint as ckpt
from scaletrain.train.export import export_safetensors, load_model_from_checkpoint
from scaletrain.train.trainer import Trainer

from conftest import REPO, forge_checksums, micro_cfg, read_metrics, run_until


def test_stop_and_resume_gives_bitwise_identical_losses(tmp_path):
    straight = micro_cfg(tmp_path / "a", **{"train.steps": 40})
    Trainer(straight).fit()
    cfg = micro_cfg(tmp_path / "b", **{"train.steps": 40, "checkpoint.resume": "auto"})
    first = run_until(cfg, stop_after=20)
    assert first["step"] == 20 and first["stopped_by"] == signal.SIGTERM
    assert first["checkpoint"].endswith("step_00000020")
    Trainer(cfg).fit()
    a = [(r["step"], r["loss"], r["grad_norm"]) for r in read_metrics(tmp_path / "a" / "run")]
    b = [(r["step"], r["loss"], r["grad_norm"]) for r in read_metrics(tmp_path / "b" / "run")]
    assert len(a) == 40 and a == b  # every step, every bit


@pytest.mark.parametrize("extra", [
    {"optim.name": "sgd", "optim.lr": 0.1},
    {"optim.name": "adafactor", "optim.lr": 0.1},
    {"optim.name": "adamw8bit"},
    {"precision.mode": "bf16-true"},
    {"precision.mode": "16-mixed", "precision.growth_interval": 2, "precision.init_scale": 4.0},
    {"memory.activation_checkpointing": "selective", "train.grad_accum": 2},
    # quantization-aware training: the fake quantizers' state comes back too
    {"train.qat": "int8-int4"},
    {"train.qat": "int8-int4", "train.grad_accum": 2, "memory.activation_checkpointing": "full",
     "precision.mode": "bf16-mixed"},
    # fp8 (emulated): the Float8Linears keep nn.Linear's names and hold no state of their own
    {"precision.mode": "fp8", "precision.fp8_emulate": True, "precision.fp8_min_dim": 64},
    {"precision.mode": "fp8", "precision.fp8_emulate": True, "precision.fp8_min_dim": 64,
     "precision.fp8_recipe": "rowwise", "train.grad_accum": 2, "memory.activation_checkpointing": "full"},
], ids=lambda e: "-".join(str(v) for v in e.values()))
def test_resume_is_exact_for_optimizers_and_precisions(tmp_path, extra):
    if extra.get("optim.name") == "adamw8bit" or "train.qat" in extra or extra.get("precision.mode") == "fp8":
        pytest.importorskip("torchao")
    base = {"train.steps": 6, "checkpoint.every": 3, **extra}
    straight = Trainer(micro_cfg(tmp_path / "a", **base)).fit()["history"]
    straight = [(r["step"], r["loss"], r["grad_norm"]) for r in straight]
    cfg = micro_cfg(tmp_path / "b", **{**base, "checkpoint.resume": "auto"})
    run_until(cfg, stop_after=3)
    resumed = Trainer(cfg)
    assert resumed.step == 3
    if resumed.scaler:
        assert resumed.scaler.scale == 4.0 * 2  # the loss scale came back with the rest
    resumed.fit()
    assert [(r["step"], r["loss"], r["grad_norm"]) for r in read_metrics(tmp_path / "b" / "run")] == straight
    assert len(straight) == 6


def test_keep_last_k_and_partial_folders_are_never_picked(tmp_path):
    cfg = micro_cfg(tmp_path, **{"train.steps": 10, "checkpoint.every": 2, "checkpoint.keep": 2,
                                 "checkpoint.save_final": True})
    Trainer(cfg).fit()
    folder = tmp_path / "run" / "checkpoints"
    assert [p.name for p in ckpt.complete_checkpoints(folder)] == ["step_00000008", "step_00000010"]
    (folder / ".step_00000012.partial").mkdir()  # a save that died half way
    (folder / "step_00000014").mkdir()  # not complete: no trainer.json
    assert ckpt.latest_checkpoint(folder).name == "step_00000010"
    resumed = Trainer(micro_cfg(tmp_path, **{"train.steps": 12, "checkpoint.resume": "auto"}))
    assert resumed.step == 10


def test_existing_run_is_not_overwritten(tmp_path):
    Trainer(micro_cfg(tmp_path, **{"train.steps": 2, "checkpoint.save_final": True})).fit()
    before = (tmp_path / "run" / "metrics.jsonl").read_text()
    with pytest.raises(ConfigError, match="already holds a run"):
        Trainer(micro_cfg(tmp_path, **{"train.steps": 2}))
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == before


def test_resume_with_another_model_shape_is_refused(tmp_path):
    Trainer(micro_cfg(tmp_path, **{"train.steps": 2, "checkpoint.save_final": True})).fit()
    with pytest.raises(CheckpointError, match=r"another model shape: dim=64 \(now 128\)"):
        Trainer(micro_cfg(tmp_path, **{"model.dim": 128, "checkpoint.resume": "auto"}))


def _saved_checkpoint(tmp_path):
    Trainer(micro_cfg(tmp_path, **{"train.steps": 2, "checkpoint.save_final": True})).fit()
    return ckpt.latest_checkpoint(tmp_path / "run" / "checkpoints")


class _Boom:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


def test_malicious_metadata_pickle_is_refused(tmp_path, monkeypatch):
    path = _saved_checkpoint(tmp_path)
    (path / ".metadata").write_bytes(pickle.dumps(_Boom()))
    forge_checksums(path)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError, match="refusing to load.*os.*system"):
        Trainer(micro_cfg(tmp_path, **{"checkpoint.resume": str(path)}))
    assert not (tmp_path / "PWNED").exists()


def test_malicious_tensor_file_is_refused(tmp_path, monkeypatch):
    path = _saved_checkpoint(tmp_path)
    for f in path.glob("*.distcp"):
        f.write_bytes(pickle.dumps(_Boom()))
    forge_checksums(path)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError, match="refusing to load"):
        load_model_from_checkpoint(path)
    assert not (tmp_path / "PWNED").exists()


def test_export_safetensors(tmp_path):
    from safetensors.torch import load_file

    path = _saved_checkpoint(tmp_path)
    out = export_safetensors(path, tmp_path / "model.safetensors")
    weights = load_file(out)
    model = load_model_from_checkpoint(path)
    assert set(weights) == {n for n, _ in model.named_parameters()}
    for n, p in model.named_parameters():
        assert torch.equal(weights[n], p)
    with pytest.raises(UserError, match="already exists"):
        export_safetensors(path, out)


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_then_stops(tmp_path):
    run_dir = tmp_path / "run"
    args = [sys.executable, "-m", "scaletrain", "train", "--train.steps=100000", "--log.every=1",
            f"--log.run_dir={run_dir}", "--log.tensorboard=false", "--train.sample_tokens=0",
            "--model.dim=64", "--model.n_layers=2", "--data.seq_len=32", "--train.global_batch=4"]
    proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.time() + 120
    while time.time() < deadline and not (run_dir / "metrics.jsonl").exists():
        time.sleep(0.2)
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "stopped by SIGTERM" in err
    last = ckpt.latest_checkpoint(run_dir / "checkpoints")
    steps = [r["step"] for r in read_metrics(run_dir)]
    assert last is not None and last.name == f"step_{steps[-1]:08d}"
