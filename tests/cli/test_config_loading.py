"""Loading a config: every bad input refused in one line (tests/conftest.py:
assert_one_clear_line), strings that look like code stay strings, the loader fuzzed with
hypothesis (a valid config or a ConfigError, nothing else), the round trip through TOML,
`--print-config`, and the demo config a run without one gets."""

from __future__ import annotations

import json
import tomllib
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scaletrain.config import ALIASES, SECTIONS, JobConfig, from_dict, load_config, option_fields
from scaletrain.errors import ConfigError

from conftest import (
    MICRO_ARGS,
    REPO,
    Case,
    assert_one_clear_line,
    folder_snapshot,
    run_here,
    run_main,
    train_args,
    with_toml,
    write,
)

LONG = "x" * 5000


# --------------------------------------------------------------------------------------------
# Bad input


BAD_INPUT = [
    # ---- unknown keys and sections: in a TOML file and on the command line
    Case("toml-unknown-key", ["train", "--config", "c.toml"], ("train.stesp: unknown key", "did you mean train.steps?"),
         with_toml("[train]\nstesp = 3\n")),
    Case("toml-unknown-section", ["train", "--config", "c.toml"],
         ("unknown section [optimiser]", "did you mean optim?"), with_toml("[optimiser]\nlr = 0.1\n")),
    Case("toml-section-not-a-table", ["train", "--config", "c.toml"], ("[train] must be a table",),
         with_toml("train = 3\n")),
    Case("toml-key-outside-section", ["train", "--config", "c.toml"], ("unknown section [steps]", "sections are model"),
         with_toml("steps = 3\n")),
    Case("toml-nested-table", ["train", "--config", "c.toml"], ("train.sub: unknown key", "keys of [train] are"),
         with_toml("[train.sub]\nx = 3\n")),
    Case("override-unknown-key", train_args("--optim.wieght_decay=0.1"),
         ("optim.wieght_decay: unknown key", "did you mean optim.weight_decay?")),
    Case("override-unknown-section", train_args("--modle.dim=64"),
         ("unknown option --modle.dim", "did you mean model.dim?")),
    Case("override-without-section", train_args("--steps=3"), ("'--steps=3'", "options look like --section.key=value")),
    Case("bare-word", train_args("steps=3"), ("unexpected argument 'steps=3'",)),
    Case("override-without-value", train_args("--train.steps"), ("--train.steps needs a value: --train.steps=VALUE",)),
    Case("two-unknown-keys", train_args("--train.stpes=5", "--optim.lrr=1"),
         ("train.stpes: unknown key", "optim.lrr: unknown key"), lines=2),
    # ---- wrong types
    Case("int-from-word", train_args("--train.steps=ten"), ("train.steps: expected an integer, got 'ten'",)),
    Case("int-from-decimal", train_args("--train.steps=2.5"), ("train.steps: expected an integer, got '2.5'",)),
    Case("int-empty", train_args("--model.dim="), ("model.dim: expected an integer, got ''",)),
    Case("toml-int-from-float", ["train", "--config", "c.toml"], ("train.steps: expected an integer, got 2.5",),
         with_toml("[train]\nsteps = 2.5\n")),
    Case("toml-int-from-string", ["train", "--config", "c.toml"], ("train.steps: expected an integer, got '10'",),
         with_toml('[train]\nsteps = "10"\n')),
    Case("toml-int-from-bool", ["train", "--config", "c.toml"], ("train.steps: expected an integer, got True",),
         with_toml("[train]\nsteps = true\n")),
    Case("toml-int-from-list", ["train", "--config", "c.toml"], ("train.steps: expected an integer, got [1, 2]",),
         with_toml("[train]\nsteps = [1, 2]\n")),
    Case("bool-from-word", train_args("--train.compile=maybe"),
         ("train.compile: expected true or false, got 'maybe'",)),
    Case("toml-bool-from-string", ["train", "--config", "c.toml"], ("log.tensorboard: expected true or false",),
         with_toml("[log]\ntensorboard = 'yes'\n")),
    Case("toml-bool-from-int", ["train", "--config", "c.toml"], ("train.compile: expected true or false, got 1",),
         with_toml("[train]\ncompile = 1\n")),
    Case("float-from-word", train_args("--optim.lr=fast"), ("optim.lr: expected a number, got 'fast'",)),
    Case("float-nan", train_args("--optim.lr=nan"), ("optim.lr: expected a finite number",)),
    Case("toml-float-inf", ["train", "--config", "c.toml"], ("optim.lr: expected a finite number",),
         with_toml("[optim]\nlr = inf\n")),
    Case("toml-float-from-huge-int", ["train", "--config", "c.toml"], ("optim.lr: expected a finite number",),
         with_toml("[optim]\nlr = 1" + "0" * 400 + "\n")),
    Case("toml-string-from-int", ["train", "--config", "c.toml"], ("data.path: expected a string, got 5",),
         with_toml("[data]\npath = 5\n")),
    Case("toml-string-from-table", ["train", "--config", "c.toml"], ("train.device: expected a string",),
         with_toml("[train]\ndevice = {kind = 'cpu'}\n")),
    Case("toml-string-with-nul", ["train", "--config", "c.toml"], ("log.run_dir:", "contains a NUL character"),
         with_toml('[log]\nrun_dir = "a\\u0000b"\n')),
    Case("toml-preset-not-a-string", ["train", "--config", "c.toml"], ("model.preset: expected a string",),
         with_toml("[model]\npreset = ['tiny']\n")),
    # ---- out-of-range values
    Case("negative-lr", train_args("--optim.lr=-0.1"), ("optim.lr: -0.1 is below the minimum 0.0",)),
    Case("zero-steps", train_args("--train.steps=0"), ("train.steps: 0 is below the minimum 1",)),
    Case("dropout-one", train_args("--model.dropout=1.0"), ("model.dropout: 1.0 must be below 1.0",)),
    Case("beta2-above-one", train_args("--optim.beta2=1.5"), ("optim.beta2: 1.5 must be below 1.0",)),
    Case("min-lr-ratio-above-one", train_args("--optim.min_lr_ratio=2"),
         ("optim.min_lr_ratio: 2.0 must be at most 1.0",)),
    Case("zero-stage-four", train_args("--parallel.zero=4"), ("parallel.zero: 4 must be at most 3",)),
    Case("keep-zero-checkpoints", train_args("--checkpoint.keep=0"), ("checkpoint.keep: 0 is below the minimum 1",)),
    Case("vocab-of-one", train_args("--model.vocab_size=1"), ("model.vocab_size: 1 is below the minimum 2",)),
    Case("negative-seed", train_args("--train.seed=-1"), ("train.seed: -1 is below the minimum 0",)),
    Case("log-every-zero", train_args("--log.every=0"), ("log.every: 0 is below the minimum 1",)),
    Case("timeout-zero", train_args("--parallel.timeout_s=0"), ("parallel.timeout_s: 0 is below the minimum 1",)),
    # ---- values outside a fixed set
    Case("precision-fp17", train_args("--precision.mode=fp17"), ("precision.mode: 'fp17' is not one of", "bf16-mixed")),
    Case("optimizer-adam", train_args("--optim.name=adam"),
         ("optim.name: 'adam' is not one of", "did you mean adamw?")),
    Case("checkpointing-partial", train_args("--memory.activation_checkpointing=partial"),
         ("memory.activation_checkpointing: 'partial' is not one of none, full, selective",)),
    Case("norm-batchnorm", train_args("--model.norm=batchnorm"),
         ("model.norm: 'batchnorm' is not one of layernorm, rmsnorm",)),
    Case("device-tpu", train_args("--train.device=tpu"), ("train.device: 'tpu' is not one of", "did you mean cpu?")),
    Case("schedule-2f2b", train_args("--parallel.pp_schedule=2f2b"), ("parallel.pp_schedule: '2f2b' is not one of",)),
    Case("preset-unknown", train_args("--model.preset=llama-9b"),
         ("unknown preset 'llama-9b'", "did you mean llama-8b?")),
    # ---- the config file itself
    Case("toml-malformed", ["train", "--config", "c.toml"], ("c.toml: not valid TOML", "line 1"),
         with_toml("[train\nsteps = 1\n")),
    Case("toml-duplicate-key", ["train", "--config", "c.toml"], ("c.toml: not valid TOML",),
         with_toml("[train]\nsteps = 1\nsteps = 2\n")),
    Case("toml-not-utf8", ["train", "--config", "c.toml"], ("c.toml: not valid TOML (not UTF-8 text)",),
         write("c.toml", b"\xff\xfe\x00[train]")),
    Case("config-missing", ["train", "--config", "nope.toml"],
         ("config file nope.toml not found", "configs/tiny.toml")),
    Case("config-is-a-folder", ["train", "--config", "data"], ("config data is a folder",)),
    Case("config-path-too-long", ["train", "--config", LONG], ("is too long for the file system", "shorter")),
    # ---- keys that contradict each other
    Case("heads-not-dividing-dim", train_args("--model.n_heads=5"),
         ("model.n_heads=5 must divide model.dim=64", "try")),
    Case("kv-heads-not-dividing-heads", train_args("--model.n_kv_heads=3"),
         ("model.n_kv_heads=3 must divide model.n_heads=4",)),
    Case("rope-odd-head-dim", train_args("--model.position=rope", "--model.dim=12"), ("needs an even head dimension",)),
    Case("seq-len-above-max", train_args("--data.seq_len=64"),
         ("data.seq_len=64 exceeds model.max_seq_len=32", "raise model.max_seq_len")),
    Case("offload-without-zero3", train_args("--memory.offload_optimizer=true"),
         ("set parallel.zero=3 or drop the offload",)),
    Case("min-scale-above-init", train_args("--precision.mode=16-mixed", "--precision.min_scale=1e6"),
         ("precision.min_scale=1000000.0 is above precision.init_scale",)),
    Case("implementation-for-8bit", train_args("--optim.name=adamw8bit", "--optim.implementation=fused"),
         ("leave it at auto for adamw8bit",)),
]


@pytest.mark.parametrize("case", BAD_INPUT, ids=[c.id for c in BAD_INPUT])
def test_bad_input_gives_one_clear_line(case: Case, workdir: Path, capsys):
    assert_one_clear_line(case, workdir, capsys)


# --------------------------------------------------------------------------------------------
# Config strings that look like code stay strings

PAYLOADS = ["__import__('os').system('touch PWNED')", "{{7*7}}", "$(touch PWNED)", "; touch PWNED"]


def toml_string(text: str) -> str:
    """A TOML basic string holding exactly `text`."""
    out = json.dumps(text, ensure_ascii=False)  # escapes quotes, backslashes and control characters
    return out.replace("\x7f", "\\u007F")  # TOML also forbids a raw DEL


def assert_nothing_ran(root: Path) -> None:
    assert not [p for p in root.rglob("*") if p.name == "PWNED"]
    assert not (REPO / "PWNED").exists()


@pytest.mark.parametrize("payload", PAYLOADS)
def test_code_in_config_strings_is_used_as_text(payload, workdir: Path, capsys):
    """The prompt and the run folder take the payload verbatim; training runs; nothing executes."""
    (workdir / "c.toml").write_text(f"[train]\nsample_prompt = {toml_string(payload)}\n")
    code, out, err = run_main(["train", "--config", "c.toml", *MICRO_ARGS, "--train.steps=1",
                               "--train.sample_tokens=4", "--data.path=data", f"--log.run_dir={payload}"], capsys)
    assert code == 0, err
    assert "Traceback" not in out + err
    assert f"sample: {payload}" in err  # the prompt went through the tokenizer as it was written
    assert (workdir / payload / "metrics.jsonl").is_file()  # the folder has the literal name
    assert_nothing_ran(workdir)


@pytest.mark.parametrize("via", ["toml", "override"])
@pytest.mark.parametrize("payload", PAYLOADS)
def test_code_in_config_values_is_refused_as_data(payload, via, workdir: Path, capsys):
    """Every kind of field refuses the payload as a value, or treats it as a name that does not exist."""
    values = {"data.path": payload, "model.preset": payload, "precision.mode": payload, "train.steps": payload,
              "optim.lr": payload, "log.tensorboard": payload, "checkpoint.resume": payload}
    if via == "toml":
        sections: dict[str, list[str]] = {}
        for dotted, value in values.items():
            section, key = dotted.split(".")
            sections.setdefault(section, []).append(f"{key} = {toml_string(value)}")
        (workdir / "c.toml").write_text("".join(f"[{s}]\n" + "\n".join(body) + "\n" for s, body in sections.items()))
        argv = ["train", "--config", "c.toml"]
    else:
        argv = ["train", *(f"--{dotted}={value}" for dotted, value in values.items())]
    before = folder_snapshot(workdir)
    code, out, err = run_main(argv, capsys)
    assert code == 2 and "Traceback" not in out + err, err
    lines = err.strip().splitlines()
    assert all(line.startswith("scaletrain: error: ") for line in lines)
    # each typed field names itself; data.path and checkpoint.resume are checked later, if at all
    for name in ("model.preset", "precision.mode", "train.steps", "optim.lr", "log.tensorboard"):
        assert any(line.startswith(f"scaletrain: error: {name}") for line in lines), (name, err)
    assert folder_snapshot(workdir) == before
    assert_nothing_ran(workdir)


# --------------------------------------------------------------------------------------------
# Fuzzing the config loader: it returns a valid config or raises ConfigError, nothing else

FIELD_NAMES = {name: [f.name for f in fields(cls)] for name, cls in SECTIONS.items()}
# the keys of every section, a sub-table's as "sync.every", and the old names that still work
ALL_KEYS = sorted({k for keys in FIELD_NAMES.values() for k in keys} | {k.split(".", 1)[1] for k in option_fields()}
                  | {k.split(".", 1)[1] for k in ALIASES})

scalars = st.one_of(st.text(max_size=20), st.integers(), st.integers(min_value=-(10**30), max_value=10**30),
                    st.floats(allow_nan=True, allow_infinity=True), st.booleans(), st.none())
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                                             max_size=3), max_leaves=6)
section_names = st.sampled_from(list(SECTIONS)) | st.text(max_size=10)
key_names = st.sampled_from(ALL_KEYS) | st.text(max_size=10)
raw_configs = st.dictionaries(section_names, st.dictionaries(key_names, values, max_size=6) | values, max_size=5)

FUZZ = settings(max_examples=200, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def loads_or_refuses(load: Callable[[], JobConfig]) -> None:
    try:
        cfg = load()
    except ConfigError as e:
        assert e.lines and all(isinstance(line, str) and line and "\n" not in line for line in e.lines)
    else:
        assert isinstance(cfg, JobConfig)


@FUZZ
@given(raw=raw_configs)
def test_fuzz_nested_dicts(raw):
    loads_or_refuses(lambda: from_dict(raw))


override_args = st.builds(lambda s, k, v: f"--{s}.{k}={v}", section_names, key_names, st.text(max_size=20))


@FUZZ
@given(args=st.lists(override_args | st.text(max_size=20), max_size=6))
def test_fuzz_command_line_overrides(args):
    loads_or_refuses(lambda: load_config(None, args))


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


@FUZZ
@given(content=st.binary(max_size=200) | st.text(max_size=200).map(str.encode)
       | st.builds(lambda d: "".join(f"[{s}]\n" + "".join(f"{k} = {toml_string(str(v))}\n" for k, v in b.items())
                                     for s, b in d.items()).encode(),
                   st.dictionaries(st.sampled_from(list(SECTIONS)),
                                   st.dictionaries(st.sampled_from(ALL_KEYS), st.text(max_size=8), max_size=4),
                                   max_size=3)))
def test_fuzz_config_files(content, fuzz_dir):
    path = fuzz_dir / "fuzz.toml"
    path.write_bytes(content)
    loads_or_refuses(lambda: load_config(path))


# ---- round trip: a valid config, written as TOML, loads back equal


def _field_values(section: str, f) -> st.SearchStrategy:
    meta, kind = f.metadata, f.type
    if meta.get("choices"):
        return st.sampled_from(meta["choices"])
    if kind in (bool, "bool"):
        return st.booleans()
    lo, hi = meta.get("min"), meta.get("max")
    if kind in (int, "int"):
        return st.integers(min_value=int(lo) if lo is not None else -(10**6),
                           max_value=int(hi) if hi is not None else 10**6)
    if kind in (float, "float"):
        return st.floats(min_value=lo if lo is not None else -1e6, max_value=hi if hi is not None else 1e6,
                         exclude_max=bool(meta.get("open_max")), allow_nan=False, allow_infinity=False)
    if f.name == "resume":
        return st.sampled_from(["none", "auto"])
    if f.name == "preset":
        return st.sampled_from(["", "tiny", "gpt2-124m"])
    return st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=12)


FIELD_STRATEGIES = {key: _field_values(key.rsplit(".", 1)[0], f) for key, f in option_fields().items()}


def to_toml(cfg: JobConfig) -> str:
    lines = []
    tables = list(cfg.to_dict().items())
    while tables:
        section, body = tables.pop(0)
        lines.append(f"[{section}]")
        for key, value in body.items():
            if isinstance(value, dict):  # a sub-table: [parallel.sync], after its section's own keys
                tables.insert(0, (f"{section}.{key}", value))
                continue
            if isinstance(value, bool):
                text = "true" if value else "false"
            elif isinstance(value, str):
                text = toml_string(value)
            else:
                text = repr(value)  # ints, and floats as the shortest text that reads back exactly
            lines.append(f"{key} = {text}")
    return "\n".join(lines) + "\n"


@FUZZ
@given(data=st.data())
def test_round_trip_through_toml(data, fuzz_dir):
    names = data.draw(st.lists(st.sampled_from(sorted(FIELD_STRATEGIES)), max_size=8, unique=True))
    chosen = {name: data.draw(FIELD_STRATEGIES[name], label=name) for name in names}
    try:
        cfg = from_dict({}, overrides=chosen)
    except ConfigError:
        return  # a combination the checks refuse (e.g. heads not dividing dim): nothing to round-trip
    path = fuzz_dir / "round.toml"
    path.write_text(to_toml(cfg))
    again = load_config(path)
    assert again == cfg
    assert json.loads(again.to_json()) == json.loads(cfg.to_json())
    assert tomllib.loads(path.read_text()) == cfg.to_dict()


def test_round_trip_sees_a_change():
    """The round-trip comparison notices a value that did not survive."""
    cfg = from_dict({}, overrides={"optim.lr": 0.1 + 0.2, "train.sample_prompt": 'a "quoted"\tprompt\x7f'})
    text = to_toml(cfg)
    assert from_dict(tomllib.loads(text)) == cfg
    assert from_dict(tomllib.loads(text.replace(repr(0.1 + 0.2), "0.3"))) != cfg  # one ulp away


# --------------------------------------------------------------------------------------------
# --print-config and the demo config


def test_print_config_writes_toml_that_reads_back(finished_run, tmp_path):
    from scaletrain.config import load_config

    r = run_here("train", "--config", str(finished_run / "config.json"), "--print-config=toml",
                 '--train.sample_prompt=a "quoted"\\ prompt', "--optim.lr=1e-05")
    assert r.returncode == 0, r.stderr
    (tmp_path / "c.toml").write_text(r.stdout)
    again = load_config(tmp_path / "c.toml")
    assert again == load_config(finished_run / "config.json", {"train.sample_prompt": 'a "quoted"\\ prompt',
                                                               "optim.lr": 1e-5})
    json_out = run_here("train", "--config", str(tmp_path / "c.toml"), "--print-config")
    assert json.loads(json_out.stdout) == again.to_dict()


def test_no_config_is_the_demo_run():
    from scaletrain.config import load_config

    r = run_here("train", "--print-config")
    assert r.returncode == 0
    assert json.loads(r.stdout) == load_config(REPO / "configs" / "tiny.toml").to_dict()
    # its global batch is the demo's, whatever the number of ranks: 64 ranks do not divide 32 (no launch)
    r = run_here("train", "--nproc", "64", "--train.device=cpu")
    assert r.returncode == 2 and "train.global_batch=32" in r.stderr, r.stderr


def test_the_demo_config_ships_inside_the_package():
    from scaletrain.config import DEMO_CONFIG, read_config_file

    assert read_config_file(DEMO_CONFIG) == read_config_file(REPO / "configs" / "tiny.toml")
    assert "demo.toml" in (REPO / "pyproject.toml").read_text()  # package data: installed with scaletrain
