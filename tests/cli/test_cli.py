from __future__ import annotations

import importlib
import json
import re
from pathlib import Path

import pytest

from conftest import REPO, Case, assert_one_clear_line, read_metrics, run_cli, run_here, train_args


@pytest.mark.slow
def test_default_run_trains_and_samples(tmp_path):
    # the built-in default (what `make demo` runs), cut to a few steps
    r = run_cli("train", "--config", "configs/tiny.toml", "--train.steps=3", f"--log.run_dir={tmp_path / 'run'}",
                "--train.sample_tokens=16", "--log.tensorboard=false", "--train.eval_batches=1")
    assert r.returncode == 0, r.stderr
    assert "sample: The " in r.stderr
    assert "validation loss" in r.stderr  # the demo's config evaluates on held-out text at the end
    rows = read_metrics(tmp_path / "run")
    assert [row["step"] for row in rows] == [1, 3]
    assert abs(rows[0]["loss"] - 5.55) < 0.2  # ln 256 at the start
    assert json.loads((tmp_path / "run" / "config.json").read_text())["model"]["preset"] == "tiny"
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000003"
    assert ckpt.is_dir()
    r = run_cli("export", str(ckpt), "--out", str(tmp_path / "m.safetensors"))
    assert r.returncode == 0 and (tmp_path / "m.safetensors").stat().st_size > 3_000_000 * 4


@pytest.mark.slow
def test_help_and_print_config():
    r = run_cli("train", "--help-config")
    assert r.returncode == 0
    for section in ("model", "data", "train", "optim", "precision", "memory", "parallel", "checkpoint", "log"):
        assert f"[{section}]" in r.stdout
    r = run_cli("train", "--print-config", "--optim.name=sgd")
    assert r.returncode == 0 and json.loads(r.stdout)["optim"]["name"] == "sgd"


def test_user_errors_exit_2_without_traceback(tmp_path):
    cases = [
        ("train", "--config", str(tmp_path / "missing.toml")),
        ("train", f"--data.path={tmp_path}"),
        ("train", "--checkpoint.resume=/no/such/checkpoint"),
        ("export", str(tmp_path), "--out", str(tmp_path / "x.safetensors")),
        ("prepare", str(tmp_path / "nothing"), "--out", str(tmp_path / "o")),
        ("train", "--model.n_heads=3"),
    ]
    for args in cases:
        r = run_here(*args)
        assert r.returncode == 2, (args, r.stderr)
        assert "Traceback" not in r.stderr, r.stderr
        assert r.stderr.startswith("scaletrain: error: "), r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_quick_start_is_two_make_commands():
    readme = (REPO / "README.md").read_text()
    quick = readme.split("## Quick start", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    commands = [line.split("#")[0].strip() for line in quick.strip().splitlines()]
    assert commands == ["make demo", "make test"]
    assert "make test" in (REPO / ".ci" / "run").read_text()
    makefile = (REPO / "Makefile").read_text()
    assert "torch==2.13.0" in makefile and "pytest" in makefile


def test_a_job_is_settled_once_its_run_folder_named_and_oversubscription_said(tmp_path, monkeypatch):
    """scaletrain.launch.job.settle: the one place every way of starting a job (one process, --nproc,
    torchrun) completes the request; it names the run folder, so every rank gets the same one."""
    import torch

    from scaletrain import hardware
    from scaletrain.launch.job import settle

    from conftest import micro_cfg

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(hardware, "cpu_cores", lambda: 1)
    cpu, notes = torch.device("cpu"), []
    cfg, layout = settle(micro_cfg(tmp_path, **{"log.run_dir": ""}), 2, cpu, note=notes.append)
    assert cfg.log.run_dir.startswith("runs") and layout.world == 2
    assert notes == ["2 ranks on 1 CPU core(s): oversubscribed, the ranks take turns on the cores and each step "
                     "is slower than with --nproc 1"]
    given = micro_cfg(tmp_path)
    assert settle(given, 1, cpu, note=notes.append)[0].log.run_dir == given.log.run_dir and len(notes) == 1
    assert not (tmp_path / "runs").exists()  # named, not made: nothing is written before the ranks start


def test_auto_is_settled_by_the_job_not_by_the_runtime(tmp_path, monkeypatch):
    from scaletrain.errors import ConfigError
    from scaletrain.launch.job import start
    from scaletrain.runtime import prepare_worker

    from conftest import micro_cfg

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    cfg = micro_cfg(tmp_path, **{"parallel.layout": "auto"})
    with pytest.raises(ConfigError, match=r"scaletrain\.launch\.job\.start"):
        prepare_worker(cfg)
    settled, rt = start(cfg)
    assert settled.parallel.layout == "manual" and rt.world_size == 1 and rt.layout.world == 1


# --------------------------------------------------------------------------------------------------
# From test_cli_errors.py (merged here):
#
# The command line itself: verbs and flags that do not exist get a "did you mean", `--version`
# says what runs, and the bad-input corpus of every subject together stays large and distinct.

def test_did_you_mean_for_verbs_and_launcher_flags_and_a_version():
    r = run_here("trian")
    assert r.returncode == 2 and r.stderr.count("scaletrain") <= 3  # no "scaletrain: error: scaletrain:"
    assert "scaletrain: error: scaletrain:" not in r.stderr and "(did you mean train?)" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    r = run_here("train", "--nprocs", "2")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "'--nprocs' (did you mean --nproc?)" in r.stderr
    r = run_here("--version")
    assert r.returncode == 0 and re.fullmatch(r"scaletrain \S+ \(torch \S+, python \S+\)\n", r.stdout), r.stdout


BAD_INPUT = [
    Case("no-subcommand", [], ("the following arguments are required: verb",)),
    Case("unknown-subcommand", ["fit"], ("invalid choice: 'fit'",)),
    Case("train-unknown-flag", train_args("--verbose"), ("unexpected argument '--verbose'",)),
]


@pytest.mark.parametrize("case", BAD_INPUT, ids=[c.id for c in BAD_INPUT])
def test_bad_input_gives_one_clear_line(case: Case, workdir: Path, capsys):
    assert_one_clear_line(case, workdir, capsys)


def every_bad_input() -> list[Case]:
    """The BAD_INPUT cases of every test file (each subject lists its own)."""
    cases = []
    for path in sorted(Path(__file__).parents[1].rglob("test_*.py")):
        if "\nBAD_INPUT = [" in path.read_text():
            # (a case marked slow comes as pytest.param(case, marks=...): the case is its value)
            cases += [c.values[0] if hasattr(c, "values") else c for c in importlib.import_module(path.stem).BAD_INPUT]
    return cases


def test_corpus_is_large_and_distinct():
    CASES = every_bad_input()
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids))
    plain = [tuple(c.argv) for c in CASES if c.prep is None]  # (a prepared case differs by its files)
    assert len(plain) == len(set(plain))
    assert len(CASES) >= 55
