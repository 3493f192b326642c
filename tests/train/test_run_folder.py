"""A run folder belongs to one run (train/run_folder.py): its lock, its identity and lineage, a
resume from the folder alone (its config.json the base), and nothing changed by a run that is
refused. Faults are real: a second real run in the same folder."""

from __future__ import annotations

import hashlib
import io
import json
import re
import signal
from pathlib import Path

import pytest

from scaletrain.errors import ConfigError
from scaletrain.train import checkpoint as ckpt
from scaletrain.train.trainer import Trainer

from conftest import (
    Case,
    assert_one_clear_line,
    copy_run,
    micro_cfg,
    popen_train,
    read_metrics,
    run_here,
    train_args,
    train_micro,
    wait_for_rows,
)

# --------------------------------------------------------------------------------------------
# Resuming from a run folder or a checkpoint folder alone


def test_resume_from_the_run_folder_alone(finished_run, tmp_path):
    """No config typed again: the run's config.json is the base, the options given go on top and
    are checked against the checkpoint; the schedule's change is said in one line."""
    run = copy_run(finished_run, tmp_path / "run")
    r = run_here("train", f"--log.run_dir={run}", "--checkpoint.resume=auto", "--train.steps=6")
    assert r.returncode == 0, r.stderr
    assert f"config: the run's own ({run / 'config.json'}), with train.steps=6, checkpoint.resume=auto" in r.stderr
    assert "resumed from" in r.stderr and "at step 4" in r.stderr
    rows = read_metrics(run)
    assert rows[-1]["step"] == 6 and json.loads((run / "config.json").read_text())["model"]["dim"] == 64
    # the learning-rate schedule changed with train.steps: said, with the lr step 5 trains at
    line = next(x for x in r.stderr.splitlines() if "the learning-rate schedule changed" in x)
    assert "(train.steps 4 -> 6)" in line
    said = float(re.search(r"so step 5 trains at lr ([0-9.e+-]+)", line).group(1))
    step5 = next(row for row in read_metrics(run) if row["step"] == 5) if any(
        row["step"] == 5 for row in rows) else None
    assert step5 is not None and step5["lr"] == pytest.approx(said, rel=1e-2)
    # an explicit option that changes the model is checked against the checkpoint
    bad = run_here("train", f"--log.run_dir={run}", "--checkpoint.resume=auto", "--train.steps=8", "--model.dim=96")
    assert bad.returncode == 2 and "saved for another model shape: dim=64 (now 96)" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1
    # the same run continued unchanged says nothing about the schedule
    same = run_here("train", f"--log.run_dir={run}", "--checkpoint.resume=auto", "--train.steps=6")
    assert same.returncode == 0 and "schedule changed" not in same.stderr


def test_a_checkpoint_folder_alone_resumes_too_and_config_json_is_a_config(finished_run, tmp_path):
    run = copy_run(finished_run, tmp_path / "run")
    step = run / "checkpoints" / "step_00000004"
    r = run_here("train", f"--checkpoint.resume={step}", f"--log.run_dir={run}", "--train.steps=5")
    assert r.returncode == 0, r.stderr
    assert f"the run's own ({step / 'trainer.json'})" in r.stderr
    r = run_here("train", "--config", str(run / "config.json"), "--checkpoint.resume=auto", "--train.steps=6")
    assert r.returncode == 0, r.stderr
    assert read_metrics(run)[-1]["step"] == 6


# --------------------------------------------------------------------------------------------
# A run folder is owned by one run


def _snapshot(root: Path) -> dict:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else None
            for p in sorted(root.rglob("*"))}


@pytest.mark.slow
def test_second_run_in_the_same_folder_exits_2_and_the_first_finishes(tmp_path):
    run = tmp_path / "run"
    first = popen_train("--train.steps=100000", f"--log.run_dir={run}", "--checkpoint.resume=auto")
    try:
        wait_for_rows(run, 3, first)
        second = popen_train("--train.steps=5", f"--log.run_dir={run}", "--checkpoint.resume=auto")
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
    train_micro(tmp_path, **{"train.steps": 2, "checkpoint.save_final": True, "log.run_dir": str(tmp_path / "a")})
    train_micro(tmp_path, **{"train.steps": 2, "checkpoint.save_final": True, "log.run_dir": str(tmp_path / "b")})
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
    train_micro(tmp_path, **{"train.steps": 3, "checkpoint.save_final": False})
    before = _snapshot(tmp_path / "run")
    assert "metrics.jsonl" in before and "config.json" in before
    with pytest.raises(ConfigError, match="holds a run .* but no complete checkpoint to resume"):
        Trainer(micro_cfg(tmp_path, **{"checkpoint.resume": "auto", "train.steps": 5, "optim.lr": 1e-4})).fit()
    assert _snapshot(tmp_path / "run") == before


def test_a_restarted_group_without_checkpoint_begins_again(tmp_path):
    train_micro(tmp_path, **{"train.steps": 3, "checkpoint.save_final": False})
    trainer = Trainer(micro_cfg(tmp_path, **{"checkpoint.resume": "auto", "train.steps": 3}), restart=True)
    trainer.fit()
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2, 3]


def test_rewinding_keeps_the_checkpoint_and_never_resumes_the_abandoned_branch(tmp_path):
    folder = tmp_path / "run" / "checkpoints"
    train_micro(tmp_path, **{"train.steps": 8, "checkpoint.every": 2, "checkpoint.keep": 3})
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


# --------------------------------------------------------------------------------------------
# Bad input


BAD_INPUT = [
    Case("run-dir-already-used", train_args(run_dir="run"),
         ("log.run_dir run already holds a run", "checkpoint.resume=auto", "nothing was changed")),
    Case("checkpoint-dir-already-used", train_args("--checkpoint.dir=run/checkpoints"),
         ("checkpoint.dir run/checkpoints already holds checkpoints", "checkpoint.resume=auto")),
    Case("run-dir-is-a-file", train_args(run_dir="data/meta.json"),
         ("log.run_dir data/meta.json is a file, not a folder",)),
]


@pytest.mark.parametrize("case", BAD_INPUT, ids=[c.id for c in BAD_INPUT])
def test_bad_input_gives_one_clear_line(case: Case, workdir: Path, capsys):
    assert_one_clear_line(case, workdir, capsys)


def test_a_restarted_process_keeps_its_runs_id(tmp_path):
    """Issue 47: a replica group restarted by its launcher, with no checkpoint of its own, got a new
    run id in run.json; a restarted process keeps the id its folder records, a new run gets its own."""
    from scaletrain.train.run_folder import RunFolder, write_identity

    cfg = micro_cfg(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    write_identity(run, "abc123def456")

    def folder(restart: bool) -> RunFolder:
        return RunFolder(run, run / "checkpoints", cfg, 0, shared=lambda v: v, restart=restart)

    assert folder(restart=True).identity()[0] == "abc123def456"
    assert folder(restart=False).identity()[0] != "abc123def456"
