"""[parallel] split by job (issue 46): the local SGD / DiLoCo keys are the table [parallel.sync], the
replica groups' keys the section [fault_tolerance]. One name per option in TOML, on the command line
and in Python; the old flat names (parallel.sync_every, parallel.ft_groups, ...) still work wherever a
key is given, each read as its new name with one line saying so, and both names of one option is an
error in one line."""

from __future__ import annotations

import json

import pytest

from scaletrain.config import (
    ALIASES,
    FaultToleranceConfig,
    JobConfig,
    SyncConfig,
    describe_options,
    from_dict,
    load_config,
)
from scaletrain.errors import ConfigError
from scaletrain.layout import Layout

from conftest import copy_run, read_metrics, run_here

# a value for each option, none its default; with the sync mode and the Lighthouse below, they load
VALUES = {
    "parallel.sync.mode": "diloco", "parallel.sync.every": 10, "parallel.sync.fragments": 2,
    "parallel.sync.delay": 1, "parallel.sync.dtype": "bf16", "parallel.sync.outer_optimizer": "sgd",
    "parallel.sync.outer_lr": 0.5, "parallel.sync.outer_momentum": 0.5, "parallel.sync.inner_lr_scale": 0.25,
    "parallel.sync.outer_on_cpu": True, "fault_tolerance.enabled": True, "fault_tolerance.groups": 3,
    "fault_tolerance.replica_id": 1, "fault_tolerance.lighthouse": "http://127.0.0.1:2",
    "fault_tolerance.min_replicas": 2, "fault_tolerance.quorum_timeout_s": 5.0,
    "fault_tolerance.step_timeout_s": 7.0,
}
BASE = {"parallel.sync.mode": "local_sgd", "fault_tolerance.lighthouse": "http://127.0.0.1:1"}
OLD = sorted(ALIASES)


def _base_without(key: str) -> dict:
    return {k: v for k, v in BASE.items() if k != key}


def _nested(dotted: dict) -> dict:
    """{"a.b.c": v} as {"a": {"b": {"c": v}}} (a TOML file's or a saved config's shape)."""
    out: dict = {}
    for key, value in dotted.items():
        *path, leaf = key.split(".")
        table = out
        for part in path:
            table = table.setdefault(part, {})
        table[leaf] = value
    return out


def _flat_old(config: dict) -> dict:
    """A saved config (`to_dict()`) in the flat shape of the versions before the split."""
    sync, ft = config["parallel"].pop("sync"), config.pop("fault_tolerance")
    old = {new: old for old, new in ALIASES.items()}
    config["parallel"].update({old[f"parallel.sync.{k}"].partition(".")[2]: v for k, v in sync.items()})
    config["parallel"].update({old[f"fault_tolerance.{k}"].partition(".")[2]: v for k, v in ft.items()})
    return config


def _toml_value(value) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else json.dumps(value)


def _toml(dotted: dict) -> str:
    """The TOML of `dotted` keys, a table per section (and per sub-table)."""
    tables: dict[str, list[str]] = {}
    for key, value in dotted.items():
        table, _, leaf = key.rpartition(".")
        tables.setdefault(table, []).append(f"{leaf} = {_toml_value(value)}")
    return "".join(f"[{table}]\n" + "\n".join(lines) + "\n" for table, lines in tables.items())


def test_every_old_name_has_a_new_one_with_the_same_default_and_the_old_keys_are_gone():
    assert len(ALIASES) == len(set(ALIASES.values())) == 17 == len(VALUES)
    assert set(ALIASES.values()) == set(VALUES)
    for new in ALIASES.values():
        section, _, name = new.rpartition(".")
        cls = SyncConfig if section == "parallel.sync" else FaultToleranceConfig
        assert VALUES[new] != getattr(cls, name)  # each value below tells the option apart from its default
    cfg = load_config()
    assert not any(hasattr(cfg.parallel, old.partition(".")[2]) for old in ALIASES)  # one name in Python
    assert cfg.parallel.sync == SyncConfig() and cfg.fault_tolerance == FaultToleranceConfig()


def test_a_toml_file_with_the_new_tables_loads(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text(_toml(VALUES))
    assert "[parallel.sync]" in f.read_text() and "[fault_tolerance]" in f.read_text()
    notes: list[str] = []
    cfg = load_config(f, notes=notes.append)
    assert notes == []
    assert cfg.parallel.sync == SyncConfig(mode="diloco", every=10, fragments=2, delay=1, dtype="bf16",
                                           outer_optimizer="sgd", outer_lr=0.5, outer_momentum=0.5,
                                           inner_lr_scale=0.25, outer_on_cpu=True)
    assert cfg.fault_tolerance == FaultToleranceConfig(enabled=True, groups=3, replica_id=1,
                                                       lighthouse="http://127.0.0.1:2", min_replicas=2,
                                                       quorum_timeout_s=5.0, step_timeout_s=7.0)
    # the same options on the command line and through cfg.replace
    args = [f"--{k}={'true' if v is True else v}" for k, v in VALUES.items()]
    assert load_config(None, args) == cfg
    assert load_config().replace(**VALUES) == cfg
    # and back: TOML (the [parallel.sync] table after [parallel]'s own keys) and JSON read back the same
    (tmp_path / "again.toml").write_text(cfg.to_toml())
    assert load_config(tmp_path / "again.toml") == cfg
    assert from_dict(json.loads(cfg.to_json())) == cfg
    assert cfg.to_dict()["parallel"]["sync"]["every"] == 10 and cfg.to_dict()["fault_tolerance"]["groups"] == 3


@pytest.mark.parametrize("old", OLD)
def test_an_old_name_reads_as_its_new_one_with_one_note(old, tmp_path):
    new = ALIASES[old]
    base, value = _base_without(new), VALUES[new]
    want = load_config(None, {**base, new: value})
    note = f"{old} is now {new}; the old name still works"

    def loaded(load) -> JobConfig:
        notes: list[str] = []
        cfg = load(notes.append)
        assert notes == [note]
        return cfg

    # TOML
    f = tmp_path / "old.toml"
    f.write_text(_toml({**base, old: value}))
    assert loaded(lambda say: load_config(f, notes=say)) == want
    # the command line, and a mapping of overrides
    text = "true" if value is True else str(value)
    assert loaded(lambda say: load_config(None, [*(f"--{k}={v}" for k, v in base.items()), f"--{old}={text}"],
                                          notes=say)) == want
    assert loaded(lambda say: load_config(None, {**base, old: value}, notes=say)) == want
    # a config saved by an older version (a run's config.json, a checkpoint's trainer.json): flat
    saved = _flat_old(json.loads(load_config(None, base).to_json()))
    saved["parallel"][old.partition(".")[2]] = value
    notes: list[str] = []
    assert from_dict(saved, notes=notes.append) == want
    assert notes == [f"{o} is now {n}; the old name still works" for o, n in ALIASES.items()]  # all of them
    # cfg.replace (the Python API), and the old name on the command line over a file that gives the new one
    assert load_config(None, base).replace(**{old: value}) == want
    table, _, leaf = new.rpartition(".")
    default = getattr(SyncConfig if table == "parallel.sync" else FaultToleranceConfig, leaf)
    f.write_text(_toml({**base, new: default}))
    assert loaded(lambda say: load_config(f, [f"--{old}={text}"], notes=say)) == want


def test_several_old_names_are_a_line_each_once(tmp_path):
    f = tmp_path / "old.toml"
    f.write_text("[parallel]\ndp_sync = \"diloco\"\nsync_every = 10\nft_groups = 3\n")
    notes: list[str] = []
    cfg = load_config(f, ["--parallel.sync_every=20", "--parallel.outer_lr=0.5"], notes=notes.append)
    assert notes == ["parallel.dp_sync is now parallel.sync.mode; the old name still works",
                     "parallel.sync_every is now parallel.sync.every; the old name still works",
                     "parallel.ft_groups is now fault_tolerance.groups; the old name still works",
                     "parallel.outer_lr is now parallel.sync.outer_lr; the old name still works"]
    assert (cfg.parallel.sync.mode, cfg.parallel.sync.every, cfg.parallel.sync.outer_lr) == ("diloco", 20, 0.5)
    assert cfg.fault_tolerance.groups == 3


@pytest.mark.parametrize("old", ["parallel.sync_every", "parallel.dp_sync", "parallel.fault_tolerance",
                                 "parallel.ft_groups"])
def test_both_names_of_one_option_is_one_error_line(old, tmp_path):
    new = ALIASES[old]
    value = VALUES[new]
    text = "true" if value is True else str(value)
    want = f"{old} and {new} are one option"
    f = tmp_path / "both.toml"
    f.write_text(_toml({old: value, new: value}))
    for load in (lambda: load_config(f), lambda: load_config(None, [f"--{old}={text}", f"--{new}={text}"]),
                 lambda: load_config(None, {old: value, new: value}),
                 lambda: from_dict(_nested({old: value, new: value}))):
        with pytest.raises(ConfigError) as e:
            load()
        assert len(e.value.lines) == 1 and want in e.value.lines[0] and f"keep {new}" in e.value.lines[0]
    r = run_here("train", "--config", str(f), "--print-config")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [f"scaletrain: error: {want} in {f}; keep {new} ({old} is its old name)"]


def test_unknown_keys_of_the_new_tables_name_the_table():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["--parallel.sync.evry=3", "--fault_tolerance.group=2"])
    assert len(e.value.lines) == 2
    assert e.value.lines[0].startswith("parallel.sync.evry: unknown key (did you mean parallel.sync.every?)")
    assert e.value.lines[1].startswith("fault_tolerance.group: unknown key (did you mean fault_tolerance.groups?)")
    with pytest.raises(ConfigError) as e:
        load_config(None, ["--parallel.sync=3"])
    assert len(e.value.lines) == 1
    assert e.value.lines[0].startswith("parallel.sync is a table of options ([parallel.sync]), got '3'")
    with pytest.raises(ConfigError, match=r"parallel.sync.every: expected an integer, got 'ten'"):
        load_config(None, ["--parallel.sync.every=ten"])


def test_help_config_lists_the_new_names_and_the_old_ones_as_aliases():
    text = describe_options()
    lines = text.splitlines()
    sync, ft = lines.index("[parallel.sync]"), lines.index("[fault_tolerance]")
    assert lines.index("[parallel]") < sync < ft
    assert lines[sync + 1].startswith("  mode = 'step' (step | local_sgd | diloco)")
    assert lines[sync + 2].startswith("  every = 50  #") and lines[ft + 1].startswith("  enabled = False  #")
    keys = {line.split("=")[0].strip() for line in lines if line.startswith("  ")}
    assert not {"dp_sync", "sync_every", "ft_groups", "fault_tolerance", "ft_lighthouse"} & keys
    assert lines[-1].startswith("# old names, still read") and "parallel.sync_every = parallel.sync.every" in lines[-1]
    r = run_here("train", "--help-config")
    assert r.returncode == 0 and "[parallel.sync]" in r.stdout and "[fault_tolerance]" in r.stdout


def test_print_config_shows_the_new_shape_whatever_name_was_given():
    r = run_here("train", "--print-config", "--parallel.sync_every=7", "--parallel.ft_groups=4")
    assert r.returncode == 0, r.stderr
    shown = json.loads(r.stdout)
    assert shown["parallel"]["sync"]["every"] == 7 and shown["fault_tolerance"]["groups"] == 4
    assert not {"sync_every", "dp_sync", "fault_tolerance", "ft_groups"} & set(shown["parallel"])
    assert r.stderr.splitlines() == [
        "scaletrain: parallel.sync_every is now parallel.sync.every; the old name still works",
        "scaletrain: parallel.ft_groups is now fault_tolerance.groups; the old name still works"]
    r = run_here("train", "--print-config=toml", "--parallel.sync.every=7")
    assert r.returncode == 0 and r.stderr == "" and "[parallel.sync]\nmode = \"step\"\nevery = 7\n" in r.stdout
    assert "\n[fault_tolerance]\nenabled = false\n" in r.stdout


def test_layout_options_name_the_new_keys():
    cfg = load_config(None, {"parallel.dp_replicate": 2, "parallel.sync.mode": "diloco", "parallel.sync.every": 5})
    layout = Layout.from_config(cfg, 2)
    assert (layout.dp_sync, layout.sync_every) == ("diloco", 5)
    given = layout.config_overrides()
    assert given["parallel.sync.mode"] == "diloco" and given["parallel.sync.every"] == 5
    assert not [k for k in given if k in ALIASES]
    assert Layout.from_config(load_config(None, given), 2) == layout


def _old_run(finished_run, to):
    """A copy of `finished_run` as a version before the split saved it: parallel.dp_sync, ... and
    parallel.fault_tolerance, ... in its config.json and in its checkpoint's trainer.json."""
    run = copy_run(finished_run, to)
    step = run / "checkpoints" / "step_00000004"

    for f, where in ((run / "config.json", None), (step / "trainer.json", "config")):
        data = json.loads(f.read_text())
        if where:
            data[where] = _flat_old(data[where])
        else:
            data = _flat_old(data)
        f.write_text(json.dumps(data))
    assert "dp_sync" in json.loads((run / "config.json").read_text())["parallel"]
    assert "ft_groups" in json.loads((step / "trainer.json").read_text())["config"]["parallel"]
    return run, step


def test_an_old_run_with_the_flat_names_resumes_with_a_note_each(finished_run, tmp_path):
    run, _ = _old_run(finished_run, tmp_path / "run")
    r = run_here("train", f"--log.run_dir={run}", "--checkpoint.resume=auto", "--train.steps=5")
    assert r.returncode == 0, r.stderr
    assert "resumed from" in r.stderr and read_metrics(run)[-1]["step"] == 5
    notes = [line for line in r.stderr.splitlines() if "the old name still works" in line]
    assert len(notes) == len(ALIASES) == len(set(notes))
    assert "scaletrain: parallel.dp_sync is now parallel.sync.mode; the old name still works" in notes
    # the run's config.json is written in the new shape
    assert json.loads((run / "config.json").read_text())["parallel"]["sync"]["mode"] == "step"
    # a checkpoint folder alone (its trainer.json's config) resumes too
    run, step = _old_run(finished_run, tmp_path / "other")
    r = run_here("train", f"--checkpoint.resume={step}", f"--log.run_dir={run}", "--train.steps=5")
    assert r.returncode == 0, r.stderr
    assert f"the run's own ({step / 'trainer.json'})" in r.stderr and read_metrics(run)[-1]["step"] == 5
    assert len([line for line in r.stderr.splitlines() if "the old name still works" in line]) == len(ALIASES)
