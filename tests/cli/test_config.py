from __future__ import annotations

from pathlib import Path

import pytest

from scaletrain.config import SECTIONS, JobConfig, from_dict, load_config, parse_override_args
from scaletrain.errors import ConfigError
from scaletrain.layout import Layout
from scaletrain.model.presets import PRESETS

from conftest import REPO, run_cli


def test_defaults_are_the_tiny_demo():
    cfg = load_config()
    assert isinstance(cfg, JobConfig)
    assert set(cfg.to_dict()) == set(SECTIONS) == {
        "model", "data", "train", "optim", "precision", "memory", "parallel", "fault_tolerance", "checkpoint", "log",
        "adapter", "preference", "rl", "eval"}
    assert cfg.model.vocab_size == 256 and cfg.precision.mode == "32-true"


def test_toml_then_cli_precedence(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('[train]\nsteps = 7\nseed = 3\n[optim]\nlr = 0.5\n')
    cfg = load_config(f, ["--train.steps=9", "--optim.name", "sgd"])
    assert cfg.train.steps == 9  # CLI beats TOML
    assert cfg.train.seed == 3  # TOML beats default
    assert cfg.optim.lr == 0.5 and cfg.optim.name == "sgd"


def test_same_names_in_python_api():
    cfg = load_config(None, {"train.steps": 11, "precision.mode": "bf16-mixed"})
    assert cfg.train.steps == 11 and cfg.precision.mode == "bf16-mixed"
    assert cfg.replace(**{"train.steps": 12}).train.steps == 12


def test_every_error_reported_at_once_with_suggestions():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["--train.stpes=5", "--optim.lr=abc", "--precision.mode=bf16", "--modle.dim=3",
                           "--memory.activation_checkpointing=partial", "--train.steps=-1"])
    lines = e.value.lines
    assert len(lines) == 6, lines
    text = "\n".join(lines)
    assert "train.stpes: unknown key (did you mean train.steps?)" in text
    assert "optim.lr: expected a number, got 'abc'" in text
    assert "precision.mode: 'bf16' is not one of 32-true, tf32, 16-mixed, bf16-mixed, bf16-true" in text
    assert "did you mean model.dim?" in text
    assert "none, full, selective" in text
    assert "train.steps: -1 is below the minimum 1" in text


def test_toml_type_errors_and_unknown_section(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('[train]\nsteps = "ten"\ncompile = 1\n[optimizer]\nlr = 1\n')
    with pytest.raises(ConfigError) as e:
        load_config(f)
    text = "\n".join(e.value.lines)
    assert "train.steps: expected an integer, got 'ten'" in text
    assert "train.compile: expected true or false, got 1" in text
    assert "unknown section [optimizer] (did you mean optim?)" in text


def test_bad_toml_and_missing_file(tmp_path):
    f = tmp_path / "bad.toml"
    f.write_text("[train\nsteps=1")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(f)
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.toml")


def test_cross_key_checks():
    with pytest.raises(ConfigError) as e:
        load_config(None, {"model.dim": 100, "model.n_heads": 3, "data.seq_len": 512})
    text = "\n".join(e.value.lines)
    assert "model.n_heads=3 must divide model.dim=100" in text
    assert "data.seq_len=512 exceeds model.max_seq_len=128" in text


@pytest.mark.parametrize("given,dp,expected", [
    ({}, 1, (32, 32, 1)),
    ({"global_batch": 64}, 2, (64, 32, 1)),
    ({"global_batch": 64, "micro_batch": 8}, 2, (64, 8, 4)),
    ({"global_batch": 64, "grad_accum": 4}, 2, (64, 8, 4)),
    ({"micro_batch": 4, "grad_accum": 3}, 2, (24, 4, 3)),
    ({"micro_batch": 4}, 4, (16, 4, 1)),
    ({"global_batch": 24, "micro_batch": 4, "grad_accum": 3}, 2, (24, 4, 3)),
])
def test_batch_triad_derived(given, dp, expected):
    cfg = load_config(None, {f"train.{k}": v for k, v in given.items()})
    plan = Layout.from_config(cfg, dp)
    assert (plan.global_batch, plan.micro_batch, plan.grad_accum) == expected
    assert plan.global_batch == plan.micro_batch * plan.grad_accum * dp


@pytest.mark.parametrize("given,dp,msg", [
    ({"global_batch": 30, "micro_batch": 4, "grad_accum": 3}, 2, "micro_batch × grad_accum × data-parallel size"),
    ({"global_batch": 30, "micro_batch": 4}, 2, "not divisible by micro_batch"),
    ({"global_batch": 30}, 4, "not divisible by grad_accum"),
])
def test_batch_triad_checked(given, dp, msg):
    cfg = load_config(None, {f"train.{k}": v for k, v in given.items()})
    with pytest.raises(ConfigError, match=msg):
        Layout.from_config(cfg, dp)


def test_presets_fill_model_section_and_keys_override():
    cfg = from_dict({"model": {"preset": "llama-8b", "n_layers": 2}})
    assert cfg.model.dim == 4096 and cfg.model.n_kv_heads == 8 and cfg.model.n_layers == 2
    with pytest.raises(ConfigError, match="did you mean llama-8b"):
        from_dict({"model": {"preset": "llama-8B"}})


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.toml")), ids=lambda p: p.name)
def test_shipped_configs_load(path: Path):
    load_config(path)


def test_shipped_presets():
    assert {"tiny", "gpt2-124m", "llama-1b", "llama-8b"} <= set(PRESETS)
    names = {p.stem for p in (REPO / "configs").glob("*.toml")}
    assert {"tiny", "gpt2-124m", "llama-1b", "llama-8b"} <= names


def test_override_parsing_errors():
    _, errors = parse_override_args(["steps=3", "--train.steps"])
    assert len(errors) == 2


@pytest.mark.slow
def test_cli_reports_errors_one_line_each_exit_2():
    r = run_cli("train", "--train.stpes=5", "--optim.lr=abc")
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 2, r.stderr
    assert all(line.startswith("scaletrain: error: ") for line in lines)
    assert "Traceback" not in r.stderr
    r = run_cli("nonsense")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1


def test_did_you_mean_finds_what_the_user_meant():
    """The suggestion is what the name most likely means: Lightning's short precision names (its
    "bf16" is bf16-mixed, which spelling alone took for bf16-true), another case, the names it
    begins (both H100s), else the closest spelling."""
    from scaletrain.hardware import CATALOG
    from scaletrain.vocab import PRECISIONS, did_you_mean

    assert did_you_mean("bf16", PRECISIONS) == " (did you mean bf16-mixed?)"
    assert did_you_mean("16", PRECISIONS) == " (did you mean 16-mixed?)"
    assert did_you_mean("fp32", PRECISIONS) == " (did you mean 32-true?)"
    assert did_you_mean("H100", CATALOG) == " (did you mean H100-SXM or H100-PCIe?)"
    assert did_you_mean("h200", CATALOG) == " (did you mean H200?)"
    assert did_you_mean("llama-8B", ["llama-1b", "llama-8b", "llama-70b"]) == " (did you mean llama-8b?)"
    assert did_you_mean("adam", ["adamw", "sgd", "adafactor", "adamw8bit"]) == " (did you mean adamw?)"
    assert did_you_mean("zzz", PRECISIONS) == ""
    with pytest.raises(ConfigError, match=r"unknown hardware 'H100' \(did you mean H100-SXM or H100-PCIe\?\)"):
        from scaletrain.hardware import lookup

        lookup("H100")
