"""`scaletrain plan` speaks the config's language: `--section.key=value` and `--config FILE`
like `scaletrain train`, the short flags as aliases of config keys (one table), every value
checked by the config's validation; and the counts the planner shares with the model and the
pipeline, each defined once."""

from __future__ import annotations

import json

import pytest

from scaletrain.cli import build_parser, main
from scaletrain.config import option_fields
from scaletrain.plan import plan
from scaletrain.plan.options import ALIASES, LAYOUT_KEYS, LAYOUT_NAMES, SYNC_KEYS, WORKLOAD_KEYS

MODEL = ("llama-8b", "--gpus-per-node", "8", "--hardware", "H100-SXM")


def _run(capsys, *args: str) -> tuple[int, dict | None, str]:
    code = main(["plan", *args, "--json"])
    out, err = capsys.readouterr()
    return code, (json.loads(out) if out.strip() else None), err


def _result(capsys, *args: str) -> dict:
    code, data, err = _run(capsys, *args)
    assert code in (0, 1), err  # 1: the layout does not fit
    data.get("search", {}).pop("seconds", None)  # the search's own timing
    return data


def _error(capsys, *args: str) -> list[str]:
    code, data, err = _run(capsys, *args)
    assert code == 2 and data is None, (code, err)
    assert "Traceback" not in err
    return [line for line in err.splitlines() if line.strip()]


# --- the alias table --------------------------------------------------------------------------

def test_every_alias_names_a_config_key_and_says_so_in_its_help():
    fields = set(option_fields())
    assert set(ALIASES.values()) <= fields
    assert set(LAYOUT_KEYS) <= fields and set(WORKLOAD_KEYS.values()) <= fields and set(SYNC_KEYS) <= fields
    assert len(set(ALIASES.values())) == len(ALIASES)  # one alias per key
    sub = next(a for a in build_parser()._actions if a.dest == "verb").choices["plan"]
    helps = {s: a.help for a in sub._actions for s in a.option_strings}
    for flag, key in ALIASES.items():
        assert f"--{key}" in helps[flag], (flag, helps[flag])
    assert "parallel.cp" in helps["--cp"]
    # plan(layout={...}) takes the aliases' short names and Layout's field names for the same keys
    assert LAYOUT_NAMES["ac"] == LAYOUT_NAMES["activation_checkpointing"] == "memory.activation_checkpointing"
    assert LAYOUT_NAMES["schedule"] == "parallel.pp_schedule"
    assert LAYOUT_NAMES["virtual"] == "parallel.pp_virtual_stages"


# --- the config names give what the aliases give -------------------------------------------------

SAME = [
    (("--zero", "2"), ("--parallel.zero=2",)),
    (("--zero", "2", "--tp", "2", "--micro-batch", "2", "--ac", "full", "--seq-len", "4096", "--global-batch", "512",
      "--precision", "bf16-mixed", "--optimizer", "adamw"),
     ("--parallel.zero=2", "--parallel.tp=2", "--train.micro_batch=2", "--memory.activation_checkpointing=full",
      "--data.seq_len=4096", "--train.global_batch=512", "--precision.mode=bf16-mixed", "--optim.name=adamw")),
    (("--pp", "2", "--schedule", "interleaved-1f1b", "--virtual", "2", "--micro-batch", "1", "--global-batch", "32"),
     ("--parallel.pp=2", "--parallel.pp_schedule=interleaved-1f1b", "--parallel.pp_virtual_stages=2",
      "--train.micro_batch=1", "--train.global_batch=32")),
    (("--zero", "3", "--offload", "--tp", "2", "--sp", "false"),
     ("--parallel.zero=3", "--memory.offload_optimizer=true", "--parallel.tp=2", "--parallel.sp=false")),
    (("--zero", "3", "--dp-replicate", "2", "--dp-shard", "4", "--precision", "bf16-true", "--optimizer", "sgd"),
     ("--parallel.zero=3", "--parallel.dp_replicate=2", "--parallel.dp_shard=4", "--precision.mode=bf16-true",
      "--optim.name=sgd")),
    # mixed: some by alias, some by key
    (("--zero", "1", "--micro-batch", "4"), ("--zero", "1", "--train.micro_batch=4")),
    # parallel.cp is a layout key like the others (--cp its alias in the one table)
    (("--cp", "4", "--cp-method", "allgather", "--zero", "3", "--seq-len", "32768", "--global-batch", "8"),
     ("--parallel.cp=4", "--parallel.cp_method=allgather", "--parallel.zero=3", "--data.seq_len=32768",
      "--train.global_batch=8")),
]


@pytest.mark.parametrize("aliases,keys", SAME, ids=[" ".join(a) for a, _ in SAME])
def test_config_names_give_what_the_aliases_give(capsys, aliases, keys):
    by_alias, by_key = _result(capsys, *MODEL, *aliases), _result(capsys, *MODEL, *keys)
    assert by_key == by_alias
    assert len(by_key["layouts"]) == 1  # a layout key fixes the layout


def test_cp_is_an_ordinary_layout_key():
    assert ALIASES["--cp"] == "parallel.cp" and "parallel.cp" in LAYOUT_KEYS and LAYOUT_NAMES["cp"] == "parallel.cp"
    kw = dict(hardware="H100-SXM", nodes=1, gpus_per_node=8, seq_len=32768, global_batch=8)
    by_name = plan("llama-8b", layout={"cp": 4, "zero": 3}, **kw)["layouts"][0].layout
    assert by_name == plan("llama-8b", layout={"parallel.cp": 4, "parallel.zero": 3}, **kw)["layouts"][0].layout
    assert (by_name.cp, by_name.dp_shard) == (4, 2)


def test_workload_keys_alone_search(capsys):
    by_alias = _result(capsys, *MODEL, "--seq-len", "1024", "--global-batch", "16", "--top", "3")
    by_key = _result(capsys, *MODEL, "--data.seq_len=1024", "--train.global_batch=16", "--top", "3")
    assert by_key == by_alias and len(by_key["layouts"]) == 3  # nothing fixes the layout: searched


def test_config_values_of_derive_mean_derive(capsys):
    """The config's own meanings: dp_shard = -1 the remaining ranks, micro_batch = 0 derived,
    global_batch = 0 the micro-batch × accumulation × data-parallel ranks."""
    base = _result(capsys, *MODEL, "--zero", "3")
    assert _result(capsys, *MODEL, "--zero", "3", "--parallel.dp_shard=-1", "--train.micro_batch=0") == base
    derived = _result(capsys, *MODEL, "--train.micro_batch=2", "--train.grad_accum=4")["layouts"][0]["layout"]
    assert (derived["micro_batch"], derived["grad_accum"], derived["dp_shard"]) == (2, 4, 8)  # global batch 64


# --- a TOML fixes what it gives -----------------------------------------------------------------

def _toml(tmp_path, body: str) -> str:
    f = tmp_path / "run.toml"
    f.write_text('[model]\npreset = "llama-1b"\n[data]\nseq_len = 2048\n[train]\nglobal_batch = 64\n'
                 '[precision]\nmode = "bf16-mixed"\n' + body)
    return str(f)


def test_toml_layout_keys_fix_the_layout(capsys, tmp_path):
    searched = _result(capsys, "--config", _toml(tmp_path, ""), "--gpus-per-node", "8", "--top", "3")
    assert len(searched["layouts"]) == 3
    fixed = _result(capsys, "--config", _toml(tmp_path, "[parallel]\nzero = 2\n"), "--gpus-per-node", "8")
    assert [e["layout"]["zero"] for e in fixed["layouts"]] == [2]
    # the same as the key or its alias on the command line, on the config without it
    assert _result(capsys, "--config", _toml(tmp_path, ""), "--gpus-per-node", "8", "--parallel.zero=2") == fixed
    assert _result(capsys, "--config", _toml(tmp_path, ""), "--gpus-per-node", "8", "--zero", "2") == fixed
    # the command line wins over the TOML
    tp = _result(capsys, "--config", _toml(tmp_path, "[parallel]\nzero = 2\n"), "--gpus-per-node", "8",
                 "--parallel.zero=1")
    assert tp["layouts"][0]["layout"]["zero"] == 1


def test_toml_without_global_batch_derives_it_on_the_cluster(capsys, tmp_path):
    f = tmp_path / "run.toml"
    f.write_text('[model]\npreset = "llama-1b"\n[data]\nseq_len = 2048\n[train]\nmicro_batch = 2\ngrad_accum = 2\n')
    r = _result(capsys, "--config", str(f), "--gpus-per-node", "8")
    lay = r["layouts"][0]["layout"]
    assert (lay["micro_batch"], lay["grad_accum"], lay["dp_shard"]) == (2, 2, 8)  # 2 × 2 × 8 = 32 sequences


# --- bad values: the config's validation, one line --------------------------------------------

def test_a_bad_value_is_one_line_naming_the_key(capsys, tmp_path):
    lines = _error(capsys, *MODEL, "--parallel.zero=5")
    assert len(lines) == 1 and "parallel.zero" in lines[0], lines
    lines = _error(capsys, *MODEL, "--parallel.sp=maybe")
    assert len(lines) == 1 and "parallel.sp: expected true or false" in lines[0], lines
    lines = _error(capsys, "--config", _toml(tmp_path, "[parallel]\nzero = 5\n"), "--gpus-per-node", "8")
    assert len(lines) == 1 and "parallel.zero" in lines[0], lines
    lines = _error(capsys, *MODEL, "--parallel.zeroo=1")
    assert len(lines) == 1 and "parallel.zeroo: unknown key" in lines[0] and "parallel.zero" in lines[0], lines
    lines = _error(capsys, *MODEL, "--memory.activation_checkpointing=some")
    assert len(lines) == 1 and "memory.activation_checkpointing" in lines[0], lines


def test_an_alias_and_its_key_with_different_values_is_an_error(capsys):
    lines = _error(capsys, *MODEL, "--zero", "2", "--parallel.zero=3")
    assert len(lines) == 1 and "--zero" in lines[0] and "parallel.zero" in lines[0], lines
    lines = _error(capsys, *MODEL, "--sp", "true", "--parallel.sp=false", "--tp", "2")
    assert len(lines) == 1 and "parallel.sp" in lines[0], lines
    # the same value twice is no conflict
    assert _result(capsys, *MODEL, "--zero", "2", "--parallel.zero=2") == _result(capsys, *MODEL, "--zero", "2")


def test_model_options_need_the_configs_model(capsys):
    lines = _error(capsys, *MODEL, "--model.n_layers=4")
    assert len(lines) == 1 and "model.n_layers" in lines[0], lines
    # without MODEL, the config's model is planned: --model.* describe it
    r = _result(capsys, "--model.preset=llama-1b", "--model.n_layers=4", "--gpus-per-node", "8", "--zero", "3")
    assert r["model"]["config"]["n_layers"] == 4 and r["layouts"][0]["layout"]["zero"] == 3


# --- from Python, the same keys --------------------------------------------------------------------

def test_python_takes_config_keys_field_names_and_short_names():
    kw = dict(hardware="H100-SXM", gpus_per_node=8, seq_len=2048, global_batch=16)
    short = plan("llama-1b", layout={"zero": 3, "ac": "selective", "micro_batch": 1}, **kw)["layouts"][0]
    keys = plan("llama-1b", layout={"parallel.zero": 3, "memory.activation_checkpointing": "selective",
                                    "train.micro_batch": 1}, **kw)["layouts"][0]
    fields = plan("llama-1b", layout={"zero": 3, "activation_checkpointing": "selective", "micro_batch": 1},
                  **kw)["layouts"][0]
    assert short.layout == keys.layout == fields.layout
    assert short.memory.as_dict() == keys.memory.as_dict() and short.time.as_dict() == keys.time.as_dict()
