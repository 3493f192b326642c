from __future__ import annotations

import io
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from scaletrain.errors import CheckpointError, ConfigError, UserError
from scaletrain.interrupt import StopWaiting
from scaletrain.train import checkpoint as ckpt
from scaletrain.train import dcp_safe
from scaletrain.train.trainer import Trainer
from scaletrain.trained.export import export_safetensors, load_model_from_checkpoint

from conftest import (
    CKPT,
    CLI_MICRO,
    REPO,
    Case,
    assert_one_clear_line,
    edit_json,
    forge_checksums,
    micro_cfg,
    micro_overrides,
    mount_tmpfs,
    popen_train,
    read_metrics,
    run_group,
    run_until,
    train_args,
    train_micro,
    truncate,
    unmount,
    wait_for_rows,
    write,
)


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
    if resumed.precision.scaler:
        assert resumed.precision.scaler.scale == 4.0 * 2  # the loss scale came back with the rest
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
    # a save killed while it wrote HEAD.json left its partial file: the next save clears it with
    # the partial folders (25 random kills left two of them once, beside the folder)
    (folder / f".{ckpt.HEAD_FILE}.partial-99999").write_text("{")
    resumed.save()
    assert sorted(p.name for p in folder.iterdir() if p.name.startswith(".")) == []


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
    deadline = time.time() + 600  # an event, not a time: the bound only ends a broken run
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


# --------------------------------------------------------------------------------------------
# Loading never executes code


def _dotted_exploit(command: str) -> bytes:
    """A protocol-4 pickle whose global is `os.system` looked up *through* DCP's metadata module
    (which imports os): STACK_GLOBAL accepts dotted names."""
    def s(text: str) -> bytes:
        b = text.encode()
        return b"\x8c" + bytes([len(b)]) + b  # SHORT_BINUNICODE
    return b"\x80\x04" + s("torch.distributed.checkpoint.metadata") + s("os.system") + b"\x93" + s(command) \
        + b"\x85R."  # TUPLE1, REDUCE, STOP


def test_dotted_global_through_dcp_metadata_module_is_refused(tmp_path, monkeypatch):
    train_micro(tmp_path, **{"train.steps": 2, "checkpoint.save_final": True})
    path = ckpt.latest_checkpoint(tmp_path / "run" / "checkpoints")
    monkeypatch.chdir(tmp_path)
    exploit = _dotted_exploit("touch PWNED-premise")
    import pickle

    pickle.loads(exploit)  # the premise: a plain unpickler runs it
    assert (tmp_path / "PWNED-premise").exists()
    (path / ".metadata").write_bytes(_dotted_exploit("touch PWNED"))
    forge_checksums(path)
    with pytest.raises(CheckpointError,
                       match=r"refusing to load: .*torch\.distributed\.checkpoint\.metadata\.os\.system"):
        Trainer(micro_cfg(tmp_path, **{"checkpoint.resume": str(path), "log.run_dir": str(tmp_path / "r2")}))
    with pytest.raises(CheckpointError, match="refusing to load"):
        export_safetensors(path, tmp_path / "out.safetensors")
    assert not (tmp_path / "PWNED").exists() and not (tmp_path / "out.safetensors").exists()


def test_only_listed_metadata_classes_are_accepted():
    unpickler = dcp_safe._MetadataUnpickler(io.BytesIO(b""))
    assert unpickler.find_class("torch.distributed.checkpoint.metadata", "Metadata").__name__ == "Metadata"
    assert unpickler.find_class("torch", "float32") is torch.float32
    for module, name in (("torch.distributed.checkpoint.metadata", "os"), ("torch.distributed.checkpoint.metadata",
                         "torch.load"), ("torch", "load"), ("torch", "float32.__class__"), ("builtins", "eval")):
        with pytest.raises(CheckpointError, match="refusing to load"):
            unpickler.find_class(module, name)


# --------------------------------------------------------------------------------------------
# Saves survive signals


def test_a_signal_while_a_step_waits_to_begin_stops_before_it_saved(tmp_path):
    """A step that waits for other processes before it begins (replica groups' quorum: up to minutes) is
    cut short by a stop signal: the run stops at the steps it took, saved, and does not sit out the wait
    (a launcher's grace would run out first and SIGKILL the rank unsaved). A signal before the wait
    stops it before waiting at all; outside such a wait a signal still stops the run at a step's end."""
    from scaletrain.hooks import StepHook

    trainer = Trainer(micro_cfg(tmp_path, **{"train.steps": 50}))
    waited = []

    class Quorum(StepHook):
        def begin_step(self, loss_factor):
            if trainer.step == 3:  # before step 4: waits for peers that never come
                threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM)).start()
                started = time.monotonic()
                with trainer.hooks.outer.interruptible():  # as the run gave it (interrupt_waits_with)
                    threading.Event().wait(60)
                waited.append(time.monotonic() - started)  # not reached: the wait is cut short

    trainer.hooks.add(Quorum())
    started = time.monotonic()
    result = trainer.fit()
    assert time.monotonic() - started < 30 and not waited
    assert result["stopped_by"] == signal.SIGTERM and result["step"] == 3
    assert result["checkpoint"].endswith("step_00000003")
    assert ckpt.verify_checkpoint(Path(result["checkpoint"])) is None
    assert [r["step"] for r in read_metrics(tmp_path / "run")][-1] == 3
    signals = trainer.health.signals
    signals.received = signal.SIGINT  # already stopping: no wait is begun
    with pytest.raises(StopWaiting), signals.interruptible():
        raise AssertionError("the wait began")


def test_a_signal_during_the_stop_save_does_not_interrupt_it(tmp_path):
    trainer = Trainer(micro_cfg(tmp_path, **{"train.steps": 50, "checkpoint.save_final": True}))
    trainer.end_of_step = lambda t, g, real=trainer.end_of_step: (*real(t, g)[:2], trainer.step >= 3) \
        if trainer.health.signals.received is None else real(t, g)
    real_save = ckpt.save_checkpoint
    seen = []

    def save_with_signals(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C pressed twice while the checkpoint is written
        os.kill(os.getpid(), signal.SIGTERM)
        seen.append(trainer.health.signals.received)
        return real_save(*args, **kwargs)

    trainer.health.signals.received = signal.SIGINT
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
    proc = popen_train("--train.steps=100000", f"--log.run_dir={run}")
    wait_for_rows(run, 3, proc)
    for _ in range(20):  # the first stops it; the others land during the stop-save
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.01)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "Traceback" not in err and "already stopping" in err
    last = ckpt.latest_checkpoint(run / "checkpoints")
    assert last is not None and ckpt.verify_checkpoint(last) is None
    assert f"checkpoint saved to {last}" in err


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


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_before_training_starts_says_no_checkpoint_was_written(tmp_path, monkeypatch, capsys, sig):
    """A real signal, delivered while the trainer is still being built (opening the data):
    nothing was trained or saved, so the exit code is 3, not 128+N, and the line says so."""
    from scaletrain import cli
    from scaletrain.train import trainer as trainer_module

    real_open = trainer_module.open_training_data

    def open_then_signal(*args, **kwargs):
        os.kill(os.getpid(), sig)
        return real_open(*args, **kwargs)

    monkeypatch.setattr(trainer_module, "open_training_data", open_then_signal)
    run = tmp_path / "run"
    code = cli.main(["train", *CLI_MICRO, "--train.steps=3", f"--log.run_dir={run}"])
    err = capsys.readouterr().err
    assert code == 3, err
    assert err.strip().splitlines() == [f"scaletrain: error: stopped by {sig.name} before training started: no "
                                        "checkpoint was written"]
    assert not run.exists()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # main put its handler back


# --------------------------------------------------------------------------------------------
# Integrity


def _flip_a_byte(path: Path) -> None:
    f = sorted(path.glob("*.distcp"))[0]
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))


def test_damaged_checkpoint_is_named_and_auto_resume_falls_back(tmp_path):
    train_micro(tmp_path, **{"train.steps": 6, "checkpoint.every": 2})
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


def test_auto_resume_with_every_checkpoint_damaged_names_each_and_changes_nothing(tmp_path):
    """Issue 47: every checkpoint damaged, resume=auto names each with what is wrong with it (as export
    does) and suggests nothing that would lose one; the folder is left byte for byte."""
    train_micro(tmp_path, **{"train.steps": 4, "checkpoint.every": 2})
    folder = tmp_path / "run" / "checkpoints"
    for step in (2, 4):
        _flip_a_byte(folder / f"step_{step:08d}")
    before = {p: p.read_bytes() for p in (tmp_path / "run").rglob("*") if p.is_file()}
    with pytest.raises(ConfigError) as e:
        Trainer(micro_cfg(tmp_path, **{"checkpoint.resume": "auto", "train.steps": 6}))
    assert e.value.lines[:2] == [
        f"checkpoint {folder / name} is damaged (__0_0.distcp does not match the checksum written with it); "
        "no older one is complete" for name in ("step_00000004", "step_00000002")]
    assert "are all damaged (above)" in e.value.lines[2] and "move" not in e.value.lines[2]
    assert len(e.value.lines) == 3
    assert {p: p.read_bytes() for p in (tmp_path / "run").rglob("*") if p.is_file()} == before


def test_truncated_tensor_file_is_refused_on_explicit_resume(tmp_path):
    train_micro(tmp_path, **{"train.steps": 2, "checkpoint.save_final": True})
    path = ckpt.latest_checkpoint(tmp_path / "run" / "checkpoints")
    f = sorted(path.glob("*.distcp"))[0]
    f.write_bytes(f.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=r"is damaged \(__0_0.distcp has 100 bytes, \d+ were written\)"):
        Trainer(micro_cfg(tmp_path, **{"checkpoint.resume": str(path), "log.run_dir": str(tmp_path / "r2")}))


# --------------------------------------------------------------------------------------------
# Resuming with other settings is refused


def test_fewer_steps_than_the_checkpoint_is_a_clear_error(tmp_path):
    train_micro(tmp_path, **{"train.steps": 6, "checkpoint.save_final": True})
    with pytest.raises(CheckpointError, match=r"step_00000006 is at step 6, past train.steps=4; set train.steps "
                                              r"above 6 to train on, or resume an earlier checkpoint$"):
        Trainer(micro_cfg(tmp_path, **{"checkpoint.resume": "auto", "train.steps": 4}))


def test_resume_with_another_seq_len_is_refused(tmp_path):
    train_micro(tmp_path, **{"train.steps": 2, "checkpoint.save_final": True})
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
    train_micro(tmp_path, **{"train.steps": 2, "checkpoint.save_final": True, "data.path": str(a)})
    with pytest.raises(CheckpointError, match=r"was trained on other data .* set checkpoint.allow_data_change=true"):
        Trainer(micro_cfg(tmp_path, **{"checkpoint.resume": "auto", "train.steps": 4, "data.path": str(b)}))
    log = io.StringIO()
    trainer = Trainer(micro_cfg(tmp_path, **{"checkpoint.resume": "auto", "train.steps": 4, "data.path": str(b),
                                             "checkpoint.allow_data_change": True}), stream=log)
    trainer.fit()
    assert trainer.step == 4 and "the data changed since" in log.getvalue()


# --------------------------------------------------------------------------------------------
# Bad input


BAD_INPUT = [
    Case("resume-other-dim", train_args(f"--checkpoint.resume={CKPT}", "--model.dim=96"),
         ("saved for another model shape: dim=64 (now 96)", "the model config it was saved with")),
    Case("resume-other-depth", train_args(f"--checkpoint.resume={CKPT}", "--model.n_layers=3"),
         ("another model shape: n_layers=2 (now 3)",)),
    Case("resume-other-batch", train_args(f"--checkpoint.resume={CKPT}", "--train.global_batch=16"),
         ("trained with global batch 8", "keep train.global_batch")),
    Case("resume-auto-other-shape", train_args("--checkpoint.resume=auto", "--model.dim=96", run_dir="run"),
         ("another model shape: dim=64 (now 96)",)),
    Case("resume-not-a-checkpoint", train_args("--checkpoint.resume=data"),
         ("data is not a complete scaletrain checkpoint", "pick a step_* folder")),
    Case("resume-missing", train_args("--checkpoint.resume=nope"), ("checkpoint.resume: folder nope does not exist",)),
    Case("resume-trainer-json-corrupt", train_args(f"--checkpoint.resume={CKPT}"), ("trainer.json: not valid JSON",),
         write(f"{CKPT}/trainer.json", "{")),
    Case("resume-trainer-json-not-an-object", train_args(f"--checkpoint.resume={CKPT}"),
         ("trainer.json: expected a JSON object",),
         write(f"{CKPT}/trainer.json", "[]")),
    Case("resume-trainer-json-without-config", train_args(f"--checkpoint.resume={CKPT}"),
         ("missing or malformed config", "the checkpoint is damaged"),
         edit_json(f"{CKPT}/trainer.json", lambda s: s.pop("config"))),
    Case("resume-trainer-json-without-model", train_args(f"--checkpoint.resume={CKPT}"),
         ("missing or malformed config.model",), edit_json(f"{CKPT}/trainer.json", lambda s: s["config"].pop("model"))),
    Case("resume-trainer-json-without-batch", train_args(f"--checkpoint.resume={CKPT}"), ("missing or malformed data",),
         edit_json(f"{CKPT}/trainer.json", lambda s: s["data"].pop("global_batch"))),
    Case("resume-format-version", train_args(f"--checkpoint.resume={CKPT}"),
         ("checkpoint format 99 is not one this version reads (1, 2)",),
         edit_json(f"{CKPT}/trainer.json", lambda s: s.update(format_version=99))),
    Case("resume-tensor-file-missing", train_args(f"--checkpoint.resume={CKPT}"),
         ("is damaged (__0_0.distcp is missing or unreadable)", "use another checkpoint"),
         lambda d: (d / CKPT / "__0_0.distcp").unlink()),
    Case("resume-tensor-file-truncated", train_args(f"--checkpoint.resume={CKPT}"),
         ("is damaged (__0_0.distcp has 100 bytes", "use another checkpoint"), truncate(f"{CKPT}/__0_0.distcp", 100)),
    Case("resume-metadata-garbage", train_args(f"--checkpoint.resume={CKPT}"),
         ("is damaged (.metadata has 7 bytes", "use another checkpoint"), write(f"{CKPT}/.metadata", b"garbage")),
]


@pytest.mark.parametrize("case", BAD_INPUT, ids=[c.id for c in BAD_INPUT])
def test_bad_input_gives_one_clear_line(case: Case, workdir: Path, capsys):
    assert_one_clear_line(case, workdir, capsys)


# --------------------------------------------------------------------------------------------
# Checkpoints written in the background (checkpoint.async_save)

ASYNC = {"checkpoint.async_save": True}


def assert_same_checkpoint(got: Path, ref: Path) -> None:
    """Two checkpoints of the same state, by two saves: the same files, the tensor and generator
    files byte for byte, .metadata alike but for what names the save itself (DCP's storage_meta:
    the folder it was written to and a random save id), and trainer.json's checksums the same
    for every file but .metadata."""
    from scaletrain.train.dcp_safe import SafeReader

    names = sorted(p.name for p in got.iterdir())
    assert names == sorted(p.name for p in ref.iterdir())
    for name in names:
        if name.endswith((".distcp", ".json")) and name != ckpt.TRAINER_FILE:
            assert (got / name).read_bytes() == (ref / name).read_bytes(), f"{got.name}/{name}"
    a, b = (SafeReader(str(p)).read_metadata() for p in (got, ref))
    assert (a.state_dict_metadata, a.storage_data, a.planner_data) == \
        (b.state_dict_metadata, b.storage_data, b.planner_data)
    a, b = (ckpt.read_trainer_state(p)["files"] for p in (got, ref))
    assert {k: v for k, v in a.items() if k != ".metadata"} == {k: v for k, v in b.items() if k != ".metadata"}


def test_async_saves_resume_bitwise_and_hold_what_sync_saves_hold(tmp_path):
    """A run saving in the background, stopped by SIGTERM after step 7 (step 6's checkpoint may
    still be being written then) and resumed, logs every step as the run saving synchronously
    does, bit for bit; their checkpoints of the same steps hold the same bytes."""
    common = {"train.steps": 12, "checkpoint.every": 3, "checkpoint.keep": 10}
    Trainer(micro_cfg(tmp_path / "sync", **common)).fit()
    cfg = micro_cfg(tmp_path / "async", **common, **ASYNC, **{"checkpoint.resume": "auto"})
    first = run_until(cfg, stop_after=7)
    assert first["stopped_by"] == signal.SIGTERM and first["checkpoint"].endswith("step_00000007")
    folder = tmp_path / "async" / "run" / "checkpoints"
    saved = ckpt.complete_checkpoints(folder)
    assert [p.name for p in saved] == ["step_00000003", "step_00000006", "step_00000007"]
    assert [ckpt.verify_checkpoint(p) for p in saved] == [None] * 3 and not list(folder.glob(".step_*"))
    Trainer(cfg).fit()
    a, b = ([(r["step"], r["loss"], r["grad_norm"]) for r in read_metrics(tmp_path / run / "run")]
            for run in ("sync", "async"))
    assert len(a) == 12 and a == b  # every step, every bit
    for name in ("step_00000003", "step_00000006"):
        assert_same_checkpoint(folder / name, tmp_path / "sync" / "run" / "checkpoints" / name)


def test_training_goes_on_while_a_checkpoint_is_written_one_save_at_a_time(tmp_path, monkeypatch):
    """Step 2's checkpoint is held mid-write until step 4 starts: steps 3 and 4 train meanwhile (a
    synchronous save would wait here for good), what it writes is still step 2's state (byte for
    byte a synchronous save's of step 2), and no save starts while another is in flight."""
    common = {"train.steps": 6, "checkpoint.every": 2, "checkpoint.keep": 5}
    Trainer(micro_cfg(tmp_path / "sync", **common)).fit()
    trainer = Trainer(micro_cfg(tmp_path / "async", **common, **ASYNC))
    released, held_until, in_flight, overlaps = threading.Event(), [], [], []
    real_write, real_save, real_step = ckpt._write_json, ckpt.save_checkpoint, trainer.train_step

    def held_write(path, data):
        if path.name == "rng_rank0.json" and path.parent.name == ".step_00000002.partial":
            assert released.wait(30), "training did not go on while step 2's checkpoint was written"
            held_until.append(trainer.step)
        real_write(path, data)

    def counted_save(folder, step, *args, **kwargs):
        overlaps.append(list(in_flight))
        in_flight.append(step)
        try:
            return real_save(folder, step, *args, **kwargs)
        finally:
            in_flight.remove(step)

    def step_then_release(batches):
        if trainer.step == 3:  # step 4 starts: step 3 was trained while step 2's checkpoint was held
            released.set()
        return real_step(batches)

    monkeypatch.setattr(ckpt, "_write_json", held_write)
    monkeypatch.setattr(ckpt, "save_checkpoint", counted_save)
    trainer.train_step = step_then_release
    result = trainer.fit()
    assert held_until and held_until[0] >= 3, held_until
    assert overlaps == [[], [], []]  # the saves of steps 2, 4 and 6, each alone
    assert result["checkpoint"].endswith("step_00000006")
    for name in ("step_00000002", "step_00000004", "step_00000006"):
        assert_same_checkpoint(tmp_path / "async" / "run" / "checkpoints" / name,
                               tmp_path / "sync" / "run" / "checkpoints" / name)


def rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.slow
def test_memory_stays_flat_over_50_background_saves(tmp_path):
    """50 background saves of 15 MiB of state changing in place between saves (as training
    changes weights and optimizer state): the process's resident memory grows by less than twice
    the state from save 10 to save 50 (one staging copy, reused; a copy kept per save would add
    600 MiB, a twentieth of one per save 30 MiB; measured: 1.3 MiB alone, 8.1 MiB in a suite
    worker that ran other tests first: the allocator's arenas, not the saves), and the last
    checkpoint holds the state of its step. The measure sees a leak: 10 more saves that each keep a
    copy of the state grow it by more than the bound."""
    from datetime import timedelta

    from scaletrain.train.async_save import CheckpointWriter
    from scaletrain.train.checkpoint import load_tensors

    state = {"model": {f"w{i}": torch.randn(1000, 1000 + i) for i in range(2)},
             "optim": {f"w{i}": {"exp_avg": torch.zeros(1000, 1000 + i), "step": torch.tensor(0.0)} for i in range(2)}}
    tensors = [*state["model"].values(), *(t for v in state["optim"].values() for t in v.values())]
    state_bytes = sum(t.numel() * t.element_size() for t in tensors)
    writer = CheckpointWriter(True, torch.device("cpu"), timedelta(seconds=60))

    def save(step: int) -> None:
        for t in tensors:
            t.add_(1.0)  # the state changes in place between saves, as training changes it
        trainer_state = {"step": step, "world_size": 1, "config": {"model": {}}, "optimizer": {},
                         "data": {"global_batch": 1, "seed": 0}, "lineage": [["run", 0]]}
        writer.save(tmp_path, step, {"model": dict(state["model"]), "optim": state["optim"]}, trainer_state, keep=1,
                    wait=False)  # a fresh dict each save, as Trainer.checkpoint_tensors makes

    rss = {}
    for step in range(1, 51):
        save(step)
        rss[step] = rss_bytes()
    writer.wait()
    growth = rss[50] - rss[10]
    print(f"state {state_bytes / 2**20:.1f} MiB; resident memory after save 1: {rss[1] / 2**20:.1f} MiB, "
          f"10: {rss[10] / 2**20:.1f} MiB, 50: {rss[50] / 2**20:.1f} MiB")
    assert growth < 2 * state_bytes, f"resident memory grew {growth / 2**20:.1f} MiB over 40 saves"
    assert [p.name for p in ckpt.complete_checkpoints(tmp_path)] == ["step_00000050"]
    loaded = {"model": {k: torch.empty_like(v) for k, v in state["model"].items()},
              "optim": {k: {n: torch.empty_like(t) for n, t in v.items()} for k, v in state["optim"].items()}}
    load_tensors(tmp_path / "step_00000050", loaded)
    assert all(torch.equal(loaded["model"][k], v) for k, v in state["model"].items())
    assert loaded["optim"]["w1"]["step"].item() == 50.0
    kept = []
    for step in range(51, 61):
        save(step)
        kept.append([t.clone() for t in tensors])  # a leak the size of the state per save
    writer.close()
    print(f"with a copy kept per save, 10 saves later: {rss_bytes() / 2**20:.1f} MiB")
    assert rss_bytes() - rss[50] > 2 * state_bytes  # the planted leak passes the bound


def test_a_background_save_that_fails_stops_the_run_at_the_next_save(tmp_path):
    """A checkpoint written in the background onto a disk that fills up: the failure is not lost.
    The next save (or the run's end) raises it, naming the step and the last complete checkpoint,
    which is intact; nothing half-written is left."""
    disk = tmp_path / "small-disk"
    if not mount_tmpfs(disk, "size=2m"):
        pytest.skip("cannot mount a small tmpfs here (needs root and mount rights)")
    try:
        trainer = Trainer(micro_cfg(tmp_path, **{"checkpoint.dir": str(disk), "train.steps": 8,
                                                 "checkpoint.every": 2, **ASYNC}))
        with pytest.raises(CheckpointError) as e:
            trainer.fit()
        assert str(e.value) == (f"saving checkpoint step 4 to {disk} failed: the disk is full; the last complete "
                                f"checkpoint {disk / 'step_00000002'} is intact")
        assert trainer.step == 6  # found at step 6's save
        assert [p.name for p in ckpt.complete_checkpoints(disk)] == ["step_00000002"]
        assert ckpt.verify_checkpoint(disk / "step_00000002") is None and not list(disk.glob(".step_*"))
    finally:
        unmount(disk)


def hold_rank_1s_write(trainer):
    """A probe (tests/dist_worker.py): rank 1's write of step 3's checkpoint is held until it starts
    step 6, so that rank 0's thread waits for it in the save's collectives while both ranks train
    (a checkpoint collective on the training's group would be paired with a training collective
    there, and the run would hang). Reports the step rank 1 had done when its write went on."""
    held, released = [], threading.Event()
    real_write, real_step = ckpt._write_json, trainer.train_step

    def held_write(path, data):
        if trainer.rt.rank == 1 and path.name.startswith("rng") and path.parent.name == ".step_00000003.partial":
            released.wait(60)
            held.append(trainer.step)
        real_write(path, data)

    def step_then_release(batches):
        if trainer.step == 5:
            released.set()
        return real_step(batches)

    ckpt._write_json, trainer.train_step = held_write, step_then_release

    def report():
        ckpt._write_json = real_write
        return held
    return report


@pytest.mark.slow
@pytest.mark.multiproc
def test_two_ranks_save_in_the_background_and_resume_bitwise(tmp_path):
    """Two gloo ranks, ZeRO-3 (each rank writes its own shards): background saves hold the bytes
    synchronous ones hold, every rank's, and a run resumed from one (in the background too) goes on
    bit for bit as the synchronous run; a save held on one rank while both train (their collectives
    under way beside the save's) neither hangs nor changes a step. In one group, one run after
    another: each run makes its own process group for its saves and lets it go at its end."""
    common = {"train.steps": 6, "checkpoint.every": 3, "checkpoint.keep": 5, "parallel.zero": 3,
              "parallel.timeout_s": 60}  # (a hang fails the test in a minute)
    a = tmp_path / "async" / "checkpoints" / "step_00000003"
    code, results, err = run_group(2, [
        {"overrides": micro_overrides(tmp_path / "sync", **common)},
        {"overrides": micro_overrides(tmp_path / "async", **common, **ASYNC)},
        {"overrides": micro_overrides(tmp_path / "resumed", **common, **ASYNC, **{"checkpoint.resume": str(a)})},
        {"overrides": micro_overrides(tmp_path / "held", **common, **ASYNC),
         "probe": "test_checkpoint:hold_rank_1s_write"},
    ], tmp_path)
    assert code == 0, err
    sync, background, resumed, held = ([(r["step"], r["loss"], r["grad_norm"]) for r in job["history"]]
                                       for job in results)
    assert len(sync) == 6 and background == sync and resumed == sync[3:] and held == sync
    # rank 0's thread waited in the save's barrier for rank 1's while both ranks trained steps 4 and 5,
    # their all-gathers and reduce-scatters on the training group
    assert results[3]["ranks"][1]["probe"] == [5], results[3]["ranks"]
    for name in ("step_00000003", "step_00000006"):
        got = tmp_path / "async" / "checkpoints" / name
        assert {p.name for p in got.glob("__*.distcp")} == {"__0_0.distcp", "__1_0.distcp"}
        assert_same_checkpoint(got, tmp_path / "sync" / "checkpoints" / name)
    assert_same_checkpoint(tmp_path / "resumed" / "checkpoints" / "step_00000006",
                           tmp_path / "sync" / "checkpoints" / "step_00000006")


@pytest.mark.slow
def test_kills_during_background_writes_never_leave_an_incomplete_checkpoint_to_resume(tmp_path, monkeypatch):
    """benchmarks/checkpoint_async.py's kill soak, short (docs/benchmarks.md has the 20-kill run): a
    run saving in the background is SIGKILLed twice while a checkpoint is being written and resumed
    each time (resume=auto). After each kill every complete checkpoint verifies and holds the clean
    synchronous run's bytes of its step, and resume takes the newest; a SIGTERM during a write exits
    143 with the checkpoint of the step it stopped at complete; the run ends bit for bit as the
    clean one."""
    import importlib.util

    # the soak's own function, called from this process (its runs are fresh processes, as in the benchmark)
    spec = importlib.util.spec_from_file_location("checkpoint_async", REPO / "benchmarks" / "checkpoint_async.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    report = bench.soak(2, 0, tmp_path)
    assert report["problems"] == [] and report["kills"] == 2, report
    assert report["mid_write"] == 2, report  # both kills cut a write short (its .partial folder left)
    assert report["checked"] >= 2 and all(life["resume_takes"] for life in report["lives"]), report
    assert report["sigterm"]["exit"] == 128 + signal.SIGTERM and report["sigterm_ok"], report
    assert report["final_bitwise"], report
