"""Nothing saved is lost, nothing loaded runs code, nothing wrong passes silently: one test per
cause found by trying scaletrain as a new user would (issue 11). Faults are real where they can
be: signals to real processes, a real full disk, a second real run in the same folder."""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from scaletrain.errors import CheckpointError, ConfigError, TrainingStopped, UserError
from scaletrain.train import checkpoint as ckpt
from scaletrain.train.export import export_safetensors
from scaletrain.train.trainer import Trainer

from conftest import REPO, forge_checksums, micro_cfg, mount_tmpfs, read_metrics, unmount

CLI_MICRO = ["--model.dim=64", "--model.n_layers=2", "--model.max_seq_len=32", "--data.seq_len=32",
             "--train.global_batch=4", "--log.every=1", "--log.progress=off", "--log.tensorboard=false",
             "--train.sample_tokens=0"]


def _train(tmp_path, **overrides) -> dict:
    return Trainer(micro_cfg(tmp_path, **overrides)).fit()


def _snapshot(root: Path) -> dict:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else None
            for p in sorted(root.rglob("*"))}


def _popen(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "scaletrain", "train", *CLI_MICRO, *args], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


def _wait_for_rows(run_dir: Path, rows: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    f = run_dir / "metrics.jsonl"
    while time.time() < deadline and proc.poll() is None:
        if f.exists() and len(f.read_text().splitlines()) >= rows:
            return
        time.sleep(0.05)
    raise AssertionError(f"the run did not log {rows} rows: {proc.poll()=}")


# --------------------------------------------------------------------------------------------
# Security: loading never executes code


def _dotted_exploit(command: str) -> bytes:
    """A protocol-4 pickle whose global is `os.system` looked up *through* DCP's metadata module
    (which imports os): STACK_GLOBAL accepts dotted names."""
    def s(text: str) -> bytes:
        b = text.encode()
        return b"\x8c" + bytes([len(b)]) + b  # SHORT_BINUNICODE
    return b"\x80\x04" + s("torch.distributed.checkpoint.metadata") + s("os.system") + b"\x93" + s(command) \
        + b"\x85R."  # TUPLE1, REDUCE, STOP


def test_dotted_global_through_dcp_metadata_module_is_refused(tmp_path, monkeypatch):
    _train(tmp_path, **{"train.steps": 2, "checkpoint.save_final": True})
    path = ckpt.latest_checkpoint(tmp_path / "run" / "checkpoints")
    monkeypatch.chdir(tmp_path)
    exploit = _dotted_exploit("touch PWNED-premise")
    import pickle

    pickle.loads(exploit)  # the premise: a plain unpickler runs it
    assert (tmp_path / "PWNED-premise").exists()
    (path / ".metadata").write_bytes(_dotted_exploit("touch PWNED"))
    forge_checksums(path)
    with pytest.raises(CheckpointError, match=r"refusing to load: .*torch\.distributed\.checkpoint\.metadata\.os\.system"):
        Trainer(micro_cfg(tmp_path, **{"checkpoint.resume": str(path), "log.run_dir": str(tmp_path / "r2")}))
    with pytest.raises(CheckpointError, match="refusing to load"):
        export_safetensors(path, tmp_path / "out.safetensors")
    assert not (tmp_path / "PWNED").exists() and not (tmp_path / "out.safetensors").exists()


def test_only_listed_metadata_classes_are_accepted():
    unpickler = ckpt._MetadataUnpickler(io.BytesIO(b""))
    assert unpickler.find_class("torch.distributed.checkpoint.metadata", "Metadata").__name__ == "Metadata"
    assert unpickler.find_class("torch", "float32") is torch.float32
    for module, name in (("torch.distributed.checkpoint.metadata", "os"), ("torch.distributed.checkpoint.metadata",
                         "torch.load"), ("torch", "load"), ("torch", "float32.__class__"), ("builtins", "eval")):
        with pytest.raises(CheckpointError, match="refusing to load"):
            unpickler.find_class(module, name)


# --------------------------------------------------------------------------------------------
# Run folders are owned


@pytest.mark.slow
def test_second_run_in_the_same_folder_exits_2_and_the_first_finishes(tmp_path):
    run = tmp_path / "run"
    first = _popen("--train.steps=100000", f"--log.run_dir={run}", "--checkpoint.resume=auto")
    try:
        _wait_for_rows(run, 3, first)
        second = _popen("--train.steps=5", f"--log.run_dir={run}", "--checkpoint.resume=auto")
        _, err = second.communicate(timeout=120)
        assert second.returncode == 2, err
        assert err.strip().splitlines() == [
            f"scaletrain: error: log.run_dir {run} is in use by another scaletrain run (it holds the folder's lock); "
            "wait for that run to end, or choose another log.run_dir (nothing was changed)"]
    finally:
        first.send_signal(signal.SIGTERM)
        _, err = first.communicate(timeout=120)
    assert first.returncode == 128 + signal.SIGTERM, err
    steps = [r["step"] for r in read_metrics(run)]
    assert steps == list(range(1, len(steps) + 1))  # one run's rows, in order, none interleaved


def test_explicit_resume_into_a_folder_of_another_run_exits_2(tmp_path):
    _train(tmp_path, **{"train.steps": 2, "checkpoint.save_final": True, "log.run_dir": str(tmp_path / "a")})
    _train(tmp_path, **{"train.steps": 2, "checkpoint.save_final": True, "log.run_dir": str(tmp_path / "b")})
    before = _snapshot(tmp_path / "b")
    path_a = ckpt.latest_checkpoint(tmp_path / "a" / "checkpoints")
    with pytest.raises(ConfigError, match=rf"log.run_dir {tmp_path / 'b'} holds another run .* would mix two runs"):
        Trainer(micro_cfg(tmp_path, **{"log.run_dir": str(tmp_path / "b"), "checkpoint.resume": str(path_a),
                                       "train.steps": 4}))
    assert _snapshot(tmp_path / "b") == before
    # into a new folder it is allowed, and the run keeps its identity there
    result = Trainer(micro_cfg(tmp_path, **{"log.run_dir": str(tmp_path / "c"), "checkpoint.resume": str(path_a),
                                            "train.steps": 4})).fit()
    assert result["step"] == 4
    assert json.loads((tmp_path / "c" / "run.json").read_text())["run_id"] == \
        json.loads((tmp_path / "a" / "run.json").read_text())["run_id"]


def test_auto_resume_without_a_checkpoint_changes_nothing(tmp_path):
    _train(tmp_path, **{"train.steps": 3, "checkpoint.save_final": False})
    before = _snapshot(tmp_path / "run")
    assert "metrics.jsonl" in before and "config.json" in before
    with pytest.raises(ConfigError, match="holds a run .* but no complete checkpoint to resume"):
        Trainer(micro_cfg(tmp_path, **{"checkpoint.resume": "auto", "train.steps": 5, "optim.lr": 1e-4})).fit()
    assert _snapshot(tmp_path / "run") == before


def test_a_restarted_group_without_checkpoint_begins_again(tmp_path):
    _train(tmp_path, **{"train.steps": 3, "checkpoint.save_final": False})
    trainer = Trainer(micro_cfg(tmp_path, **{"checkpoint.resume": "auto", "train.steps": 3}), restart=True)
    trainer.fit()
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2, 3]


def test_rewinding_keeps_the_checkpoint_and_never_resumes_the_abandoned_branch(tmp_path):
    folder = tmp_path / "run" / "checkpoints"
    _train(tmp_path, **{"train.steps": 8, "checkpoint.every": 2, "checkpoint.keep": 3})
    assert [p.name for p in ckpt.complete_checkpoints(folder)] == ["step_00000004", "step_00000006", "step_00000008"]
    old_losses = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "run")}
    # back to step 4 with another learning rate; this branch ends (crashes) at step 5 before any save
    log = io.StringIO()
    Trainer(micro_cfg(tmp_path, **{"checkpoint.resume": str(folder / "step_00000004"), "train.steps": 5,
                                   "optim.lr": 1e-3, "checkpoint.save_final": False}), stream=log).fit()
    assert "kept but never resumed or rotated (another branch): step_00000006, step_00000008" in log.getvalue()
    assert (tmp_path / "run" / "metrics.abandoned-after-step4.jsonl").exists()
    # auto resume continues the new branch from step 4, not the abandoned step 8
    resumed = Trainer(micro_cfg(tmp_path, **{"checkpoint.resume": "auto", "train.steps": 12, "optim.lr": 1e-3,
                                             "checkpoint.every": 2, "checkpoint.keep": 2}))
    assert resumed.step == 4
    resumed.fit()
    # rotation by lineage keeps the new branch's newest 2; the abandoned branch's step 6 and 8,
    # whose names the new branch reused, were set aside, not overwritten
    assert [p.name for p in ckpt.complete_checkpoints(folder)] == ["step_00000010", "step_00000012"]
    aside = sorted((folder / "abandoned").iterdir())
    assert [p.name.split(".")[0] for p in aside] == ["step_00000006", "step_00000008"]
    assert [ckpt.read_trainer_state(p)["step"] for p in aside] == [6, 8]
    assert all(len(ckpt.read_trainer_state(p)["lineage"]) == 1 and ckpt.verify_checkpoint(p) is None for p in aside)
    # the crashed branch saved nothing: the new one starts at step 4 of the first
    assert len(ckpt.read_trainer_state(folder / "step_00000012")["lineage"]) == 2
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == list(range(1, 13))
    assert rows[3]["loss"] == old_losses[4] and rows[5]["loss"] != old_losses[6]


def test_fewer_steps_than_the_checkpoint_is_a_clear_error(tmp_path):
    _train(tmp_path, **{"train.steps": 6, "checkpoint.save_final": True})
    with pytest.raises(CheckpointError, match=r"step_00000006 is at step 6, past train.steps=4; set train.steps "
                                              r"above 6 to train on, or resume an earlier checkpoint$"):
        Trainer(micro_cfg(tmp_path, **{"checkpoint.resume": "auto", "train.steps": 4}))


# --------------------------------------------------------------------------------------------
# Saves survive signals


def test_a_signal_during_the_stop_save_does_not_interrupt_it(tmp_path):
    trainer = Trainer(micro_cfg(tmp_path, **{"train.steps": 50, "checkpoint.save_final": True}))
    trainer.end_of_step = lambda t, g, real=trainer.end_of_step: (*real(t, g)[:2], trainer.step >= 3) \
        if trainer._stop_signal is None else real(t, g)
    real_save = ckpt.save_checkpoint
    seen = []

    def save_with_signals(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C pressed twice while the checkpoint is written
        os.kill(os.getpid(), signal.SIGTERM)
        seen.append(trainer._stop_signal)
        return real_save(*args, **kwargs)

    trainer._stop_signal = signal.SIGINT
    ckpt_save, ckpt.save_checkpoint = ckpt.save_checkpoint, save_with_signals
    try:
        result = trainer.fit()
    finally:
        ckpt.save_checkpoint = ckpt_save
    assert seen == [signal.SIGINT] and result["stopped_by"] == signal.SIGINT
    assert result["checkpoint"].endswith("step_00000001")
    assert ckpt.verify_checkpoint(Path(result["checkpoint"])) is None


@pytest.mark.slow
def test_repeated_sigterm_to_a_real_run_still_saves_then_exits_143(tmp_path):
    run = tmp_path / "run"
    proc = _popen("--train.steps=100000", f"--log.run_dir={run}")
    _wait_for_rows(run, 3, proc)
    for _ in range(20):  # the first stops it; the others land during the stop-save
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.01)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "Traceback" not in err and "already stopping" in err
    last = ckpt.latest_checkpoint(run / "checkpoints")
    assert last is not None and ckpt.verify_checkpoint(last) is None
    assert f"checkpoint saved to {last}" in err


# --------------------------------------------------------------------------------------------
# Integrity


def _flip_a_byte(path: Path) -> None:
    f = sorted(path.glob("*.distcp"))[0]
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))


def test_damaged_checkpoint_is_named_and_auto_resume_falls_back(tmp_path):
    _train(tmp_path, **{"train.steps": 6, "checkpoint.every": 2})
    folder = tmp_path / "run" / "checkpoints"
    newest = folder / "step_00000006"
    _flip_a_byte(newest)
    log = io.StringIO()
    trainer = Trainer(micro_cfg(tmp_path, **{"checkpoint.resume": "auto", "train.steps": 8}), stream=log)
    assert trainer.step == 4
    trainer.fit()
    lines = [line for line in log.getvalue().splitlines() if " is damaged " in line]
    assert lines == [f"checkpoint {newest} is damaged (__0_0.distcp does not match the checksum written with it); "
                     "falling back to an older one"]
    with pytest.raises(CheckpointError, match=rf"{newest} is damaged \(__0_0.distcp does not match the checksum"):
        export_safetensors(newest, tmp_path / "m.safetensors")
    assert not (tmp_path / "m.safetensors").exists()


def test_truncated_tensor_file_is_refused_on_explicit_resume(tmp_path):
    _train(tmp_path, **{"train.steps": 2, "checkpoint.save_final": True})
    path = ckpt.latest_checkpoint(tmp_path / "run" / "checkpoints")
    f = sorted(path.glob("*.distcp"))[0]
    f.write_bytes(f.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=r"is damaged \(__0_0.distcp has 100 bytes, \d+ were written\)"):
        Trainer(micro_cfg(tmp_path, **{"checkpoint.resume": str(path), "log.run_dir": str(tmp_path / "r2")}))


def test_a_torn_last_metrics_row_is_tolerated_on_resume(tmp_path):
    _train(tmp_path, **{"train.steps": 4, "checkpoint.every": 2, "checkpoint.save_final": False})
    metrics = tmp_path / "run" / "metrics.jsonl"
    with metrics.open("a") as f:
        f.write('{"step": 5, "loss": 3.1')  # the crash cut this write short
    log = io.StringIO()
    Trainer(micro_cfg(tmp_path, **{"checkpoint.resume": "auto", "train.steps": 6}), stream=log).fit()
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2, 3, 4, 5, 6]
    assert "dropped 1 unreadable row(s)" in log.getvalue()


# --------------------------------------------------------------------------------------------
# Silent wrong results become errors


def test_resume_with_another_seq_len_is_refused(tmp_path):
    _train(tmp_path, **{"train.steps": 2, "checkpoint.save_final": True})
    with pytest.raises(CheckpointError, match=r"trained with data.seq_len=32; resuming with data.seq_len=16"):
        Trainer(micro_cfg(tmp_path, **{"checkpoint.resume": "auto", "train.steps": 4, "data.seq_len": 16}))


def _prepare(tmp_path: Path, name: str, text: str) -> Path:
    src = tmp_path / f"{name}.txt"
    src.write_text(text)
    out = tmp_path / name
    from scaletrain.data.prepare import prepare

    prepare([str(src)], str(out))
    return out


def test_resume_on_other_data_needs_an_explicit_flag(tmp_path):
    a = _prepare(tmp_path, "data-a", "the quick brown fox jumps over the lazy dog. " * 400)
    b = _prepare(tmp_path, "data-b", "pack my box with five dozen liquor jugs now. " * 400)
    _train(tmp_path, **{"train.steps": 2, "checkpoint.save_final": True, "data.path": str(a)})
    with pytest.raises(CheckpointError, match=r"was trained on other data .* set checkpoint.allow_data_change=true"):
        Trainer(micro_cfg(tmp_path, **{"checkpoint.resume": "auto", "train.steps": 4, "data.path": str(b)}))
    log = io.StringIO()
    trainer = Trainer(micro_cfg(tmp_path, **{"checkpoint.resume": "auto", "train.steps": 4, "data.path": str(b),
                                             "checkpoint.allow_data_change": True}), stream=log)
    trainer.fit()
    assert trainer.step == 4 and "the data changed since" in log.getvalue()


def _override_loss(trainer: Trainer, loss_at) -> None:
    """The global loss each step reports becomes loss_at(step, real loss)."""
    real = trainer.end_of_step
    trainer.end_of_step = lambda t, g: (lambda out: (loss_at(trainer.step, out[0]), *out[1:]))(real(t, g))


def test_a_loss_far_above_its_early_value_stops_with_exit_3(tmp_path):
    trainer = Trainer(micro_cfg(tmp_path, **{"train.steps": 20, "train.divergence_factor": 3.0,
                                             "train.divergence_margin": 100.0}))
    _override_loss(trainer, lambda step, loss: 5.0 if step <= 5 else 15.5 if step == 12 else loss)
    with pytest.raises(TrainingStopped, match=r"^step 12: the loss 15.5000 is 3.1x its early value 5.0000 "
                                              r"\(train.divergence_factor=3\): the run diverged"):
        trainer.fit()
    assert TrainingStopped.exit_code == 3


def test_a_loss_worse_than_uniform_after_warm_up_stops(tmp_path):
    trainer = Trainer(micro_cfg(tmp_path, **{"train.steps": 20, "optim.warmup_steps": 5}))
    uniform = math.log(256)
    _override_loss(trainer, lambda step, loss: uniform + 1.5 if step >= 4 else loss)  # from step 4, in warm-up
    with pytest.raises(TrainingStopped, match=r"^step 6: after warm-up the loss 7.0452 is above ln\(vocab_size\) \+ "
                                              r"train.divergence_margin = 5.5452 \+ 1, worse than guessing"):
        trainer.fit()


def test_divergence_checks_can_be_turned_off(tmp_path):
    trainer = Trainer(micro_cfg(tmp_path, **{"train.steps": 12, "train.divergence_factor": 0}))
    _override_loss(trainer, lambda step, loss: 100.0 if step > 8 else loss)
    assert trainer.fit()["step"] == 12


def test_every_step_skipped_under_fp16_stops(tmp_path):
    # the scale starts so high that every step of this short run overflows and backs off
    trainer = Trainer(micro_cfg(tmp_path, **{"precision.mode": "16-mixed", "precision.init_scale": 2.0**100,
                                             "train.steps": 6, "train.max_skipped_steps": 5}))
    with pytest.raises(TrainingStopped, match=r"^every one of the 6 steps of this run was skipped \(non-finite "
                                              r"gradients or fp16 overflow\): the weights never changed; lower "
                                              r"precision.init_scale or train with precision.mode=bf16-mixed$"):
        trainer.fit()
    assert trainer.applied_steps == 0 and trainer.skipped_steps == 6


# --------------------------------------------------------------------------------------------
# OS faults during training


def test_full_disk_for_metrics_saves_an_emergency_checkpoint_first(tmp_path):
    disk = tmp_path / "small-disk"
    if not mount_tmpfs(disk, "size=64k"):
        pytest.skip("cannot mount a small tmpfs here (needs root and mount rights)")
    try:
        run = disk / "run"
        ckdir = tmp_path / "checkpoints"  # on the big disk: the emergency save has room
        trainer = Trainer(micro_cfg(tmp_path, **{"log.run_dir": str(run), "checkpoint.dir": str(ckdir),
                                                 "train.steps": 100000}))
        (disk / "filler").write_bytes(b"\0" * (64 * 1024 - 4096 * 3))  # leave a few pages
        with pytest.raises(UserError) as e:
            trainer.fit()
        saved = ckpt.latest_checkpoint(ckdir)
        assert saved is not None and ckpt.verify_checkpoint(saved) is None
        step = int(saved.name.split("_")[1])
        assert e.value.exit_code == 2
        assert str(e.value) == (f"step {step - 1}: writing metrics to {run / 'metrics.jsonl'} failed: the disk is "
                                f"full; checkpoint {saved} was saved first, resume from it once there is room")
    finally:
        unmount(disk)


def test_out_of_memory_in_activations_is_one_line_with_the_fix(tmp_path):
    overcommit = Path("/proc/sys/vm/overcommit_memory")
    if not overcommit.exists() or overcommit.read_text().strip() == "1":
        pytest.skip("the kernel grants any allocation here (overcommit_memory=1): no real out-of-memory error")
    # the logits of one micro-batch: 256 x 1024 x 262144 x 4 bytes = 256 GiB, far beyond this machine
    text = tmp_path / "t.txt"
    text.write_text("".join(chr(32 + i % 95) for i in range(300_000)))
    from scaletrain.data.prepare import prepare

    prepare([str(text)], str(tmp_path / "data"))
    trainer = Trainer(micro_cfg(tmp_path, **{
        "data.path": str(tmp_path / "data"), "model.vocab_size": 262144, "model.dim": 16, "model.n_heads": 2,
        "model.n_layers": 1, "model.max_seq_len": 1024, "data.seq_len": 1024, "train.global_batch": 256,
        "train.micro_batch": 256, "train.steps": 1}))
    with pytest.raises(ConfigError) as e:
        trainer.fit()
    assert str(e.value) == (
        "step 1: out of cpu memory on rank 0 during forward/backward (activations of micro-batch 256 x data.seq_len "
        "1024); lower train.micro_batch (now 256; gradient accumulation keeps the global batch), or set "
        "memory.activation_checkpointing=selective or full")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_before_training_starts_says_no_checkpoint_was_written(tmp_path, monkeypatch, capsys, sig):
    """A real signal, delivered while the trainer is still being built (opening the data):
    nothing was trained or saved, so the exit code is 3, not 128+N, and the line says so."""
    from scaletrain import cli
    from scaletrain.train import trainer as trainer_module

    real_open = trainer_module.open_data

    def open_then_signal(*args, **kwargs):
        os.kill(os.getpid(), sig)
        return real_open(*args, **kwargs)

    monkeypatch.setattr(trainer_module, "open_data", open_then_signal)
    run = tmp_path / "run"
    code = cli.main(["train", *CLI_MICRO, "--train.steps=3", f"--log.run_dir={run}"])
    err = capsys.readouterr().err
    assert code == 3, err
    assert err.strip().splitlines() == [f"scaletrain: error: stopped by {sig.name} before training started: no "
                                        "checkpoint was written"]
    assert not run.exists()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # main put its handler back
