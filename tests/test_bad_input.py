"""Bad inputs to the `scaletrain` CLI: each must give one `scaletrain: error:` line that names
the problem (and the fix, where there is one), exit with code 2, print no traceback, and leave
every file where it was.

Most cases run `scaletrain.cli.main` in this process (the CLI validates everything before it
launches ranks), inside a private copy of a prepared data folder and a small real checkpoint.
The config loader is also fuzzed with hypothesis, and config strings that look like code are
checked never to run.
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scaletrain.cli import main
from scaletrain.config import SECTIONS, JobConfig, from_dict, load_config
from scaletrain.data.prepare import prepare
from scaletrain.errors import ConfigError
from scaletrain.train.trainer import Trainer

from conftest import MICRO, REPO

CKPT = "run/checkpoints/step_00000002"  # the fixture's checkpoint, relative to a case's folder
CORPUS = "the quick brown fox jumps over the lazy dog while the model trains one step at a time\n" * 200


# --------------------------------------------------------------------------------------------
# Shared inputs: one prepared data folder, one too small, and one real checkpoint (made once)


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("assets")
    (root / "corpus.txt").write_text(CORPUS)
    prepare([root / "corpus.txt"], root / "data")
    (root / "hello.txt").write_text("hello")
    prepare([root / "hello.txt"], root / "tiny")  # 7 tokens: too few for one window of 32
    cfg = load_config(None, {**MICRO, "train.steps": 2, "checkpoint.save_final": True,
                             "data.path": str(root / "data"), "log.run_dir": str(root / "run")})
    Trainer(cfg).fit()
    assert (root / CKPT / "trainer.json").is_file()
    for name in ("corpus.txt", "hello.txt"):
        (root / name).unlink()
    return root


@pytest.fixture
def workdir(assets, tmp_path, monkeypatch) -> Path:
    """A private copy of the shared inputs, as the current folder."""
    for name in ("data", "tiny", "run"):
        shutil.copytree(assets / name, tmp_path / name)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def snapshot(root: Path) -> dict[str, tuple]:
    """Every file and folder under root with its size, mtime and content hash."""
    out = {}
    for p in sorted(root.rglob("*")):
        info = p.lstat()
        digest = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else None
        out[str(p.relative_to(root))] = (p.is_dir(), info.st_size if p.is_file() else 0, info.st_mtime_ns, digest)
    return out


def run_main(argv: list[str], capsys) -> tuple[int, str, str]:
    """`scaletrain ARGV` in this process: (exit code, stdout, stderr)."""
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own exits (--help), should a parser bypass our error()
        code = e.code if isinstance(e.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


# --------------------------------------------------------------------------------------------
# Helpers that build a case's arguments and damage its copy of the inputs

MICRO_ARGS = [f"--{key}={value}" for key, value in MICRO.items()]


def train(*extra: str, data: str = "data", run_dir: str = "newrun") -> list[str]:
    """`train` on the micro model with the prepared data, into a fresh run folder."""
    return ["train", *MICRO_ARGS, f"--data.path={data}", f"--log.run_dir={run_dir}", *extra]


def with_toml(text: str, name: str = "c.toml") -> Callable[[Path], None]:
    return lambda d: (d / name).write_text(text)


def write(rel: str, content: str | bytes) -> Callable[[Path], None]:
    def prep(d: Path) -> None:
        p = d / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(content) if isinstance(content, bytes) else p.write_text(content)
    return prep


def edit_json(rel: str, change: Callable[[dict], None]) -> Callable[[Path], None]:
    def prep(d: Path) -> None:
        data = json.loads((d / rel).read_text())
        change(data)
        (d / rel).write_text(json.dumps(data))
    return prep


def truncate(rel: str, keep: int) -> Callable[[Path], None]:
    def prep(d: Path) -> None:
        p = d / rel
        p.write_bytes(p.read_bytes()[:keep])
    return prep


def flip_byte(d: Path) -> None:
    p = d / "data" / "shard_00000.bin"
    raw = bytearray(p.read_bytes())
    raw[100] ^= 1
    p.write_bytes(bytes(raw))


def token_outside_vocab(d: Path) -> None:
    """A shard with token id 300 (byte vocabulary: 256) and a matching checksum."""
    p = d / "data" / "shard_00000.bin"
    tokens = np.fromfile(p, dtype=np.uint16)
    tokens[5] = 300
    p.write_bytes(tokens.tobytes())
    edit_json("data/meta.json", lambda m: m["shards"][0].update(sha256=hashlib.sha256(tokens.tobytes()).hexdigest()))(d)


def both(*preps: Callable[[Path], None]) -> Callable[[Path], None]:
    def prep(d: Path) -> None:
        for p in preps:
            p(d)
    return prep


@dataclass
class Case:
    id: str
    argv: list[str]
    expect: tuple[str, ...]  # fragments of the error line(s), naming the problem and the fix
    prep: Callable[[Path], None] | None = None
    lines: int = 1  # problems reported; each gets its own line


LONG = "x" * 5000

CASES = [
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
    Case("override-unknown-key", train("--optim.wieght_decay=0.1"),
         ("optim.wieght_decay: unknown key", "did you mean optim.weight_decay?")),
    Case("override-unknown-section", train("--modle.dim=64"),
         ("unknown option --modle.dim", "did you mean model.dim?")),
    Case("override-without-section", train("--steps=3"), ("'--steps=3'", "options look like --section.key=value")),
    Case("bare-word", train("steps=3"), ("unexpected argument 'steps=3'",)),
    Case("override-without-value", train("--train.steps"), ("--train.steps needs a value: --train.steps=VALUE",)),
    Case("two-unknown-keys", train("--train.stpes=5", "--optim.lrr=1"),
         ("train.stpes: unknown key", "optim.lrr: unknown key"), lines=2),
    # ---- wrong types
    Case("int-from-word", train("--train.steps=ten"), ("train.steps: expected an integer, got 'ten'",)),
    Case("int-from-decimal", train("--train.steps=2.5"), ("train.steps: expected an integer, got '2.5'",)),
    Case("int-empty", train("--model.dim="), ("model.dim: expected an integer, got ''",)),
    Case("toml-int-from-float", ["train", "--config", "c.toml"], ("train.steps: expected an integer, got 2.5",),
         with_toml("[train]\nsteps = 2.5\n")),
    Case("toml-int-from-string", ["train", "--config", "c.toml"], ("train.steps: expected an integer, got '10'",),
         with_toml('[train]\nsteps = "10"\n')),
    Case("toml-int-from-bool", ["train", "--config", "c.toml"], ("train.steps: expected an integer, got True",),
         with_toml("[train]\nsteps = true\n")),
    Case("toml-int-from-list", ["train", "--config", "c.toml"], ("train.steps: expected an integer, got [1, 2]",),
         with_toml("[train]\nsteps = [1, 2]\n")),
    Case("bool-from-word", train("--train.compile=maybe"), ("train.compile: expected true or false, got 'maybe'",)),
    Case("toml-bool-from-string", ["train", "--config", "c.toml"], ("log.tensorboard: expected true or false",),
         with_toml("[log]\ntensorboard = 'yes'\n")),
    Case("toml-bool-from-int", ["train", "--config", "c.toml"], ("train.compile: expected true or false, got 1",),
         with_toml("[train]\ncompile = 1\n")),
    Case("float-from-word", train("--optim.lr=fast"), ("optim.lr: expected a number, got 'fast'",)),
    Case("float-nan", train("--optim.lr=nan"), ("optim.lr: expected a finite number",)),
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
    Case("negative-lr", train("--optim.lr=-0.1"), ("optim.lr: -0.1 is below the minimum 0.0",)),
    Case("zero-steps", train("--train.steps=0"), ("train.steps: 0 is below the minimum 1",)),
    Case("dropout-one", train("--model.dropout=1.0"), ("model.dropout: 1.0 must be below 1.0",)),
    Case("beta2-above-one", train("--optim.beta2=1.5"), ("optim.beta2: 1.5 must be below 1.0",)),
    Case("min-lr-ratio-above-one", train("--optim.min_lr_ratio=2"), ("optim.min_lr_ratio: 2.0 must be at most 1.0",)),
    Case("zero-stage-four", train("--parallel.zero=4"), ("parallel.zero: 4 must be at most 3",)),
    Case("keep-zero-checkpoints", train("--checkpoint.keep=0"), ("checkpoint.keep: 0 is below the minimum 1",)),
    Case("vocab-of-one", train("--model.vocab_size=1"), ("model.vocab_size: 1 is below the minimum 2",)),
    Case("negative-seed", train("--train.seed=-1"), ("train.seed: -1 is below the minimum 0",)),
    Case("log-every-zero", train("--log.every=0"), ("log.every: 0 is below the minimum 1",)),
    Case("timeout-zero", train("--parallel.timeout_s=0"), ("parallel.timeout_s: 0 is below the minimum 1",)),
    # ---- workers that sync every few steps (parallel.dp_sync)
    Case("sync-every-zero", train("--parallel.dp_sync=diloco", "--parallel.sync_every=0"),
         ("parallel.sync_every: 0 is below the minimum 1",)),
    Case("sync-fragments-above-blocks", train("--nproc", "2", "--parallel.dp_replicate=2", "--parallel.dp_sync=diloco",
                                              "--parallel.sync_every=10", "--parallel.sync_fragments=3"),
         ("parallel.sync_fragments=3 splits the model's blocks into fragments, but model.n_layers=2",
          "at most 2 fragments")),
    Case("sync-delay-too-long", train("--parallel.dp_sync=local_sgd", "--parallel.sync_every=10",
                                      "--parallel.sync_fragments=2", "--parallel.sync_delay=5"),
         ("parallel.sync_delay=5 must be below sync_every / sync_fragments = 10 / 2",)),
    Case("sync-fragments-above-sync-every", train("--parallel.dp_sync=diloco", "--parallel.sync_every=2",
                                                  "--parallel.sync_fragments=3"),
         ("parallel.sync_fragments=3 must be at most sync_every=2",)),
    Case("diloco-one-worker", train("--nproc", "2", "--parallel.dp_sync=diloco"),
         ("parallel.dp_sync=diloco syncs the workers, which are the dp_replicate groups",
          "set parallel.dp_replicate to the number of workers")),
    Case("auto-layout-with-diloco", train("--parallel.layout=auto", "--parallel.dp_sync=diloco"),
         ("parallel.layout=auto chooses the layout itself; leave parallel.dp_sync at their defaults",)),
    Case("outer-optimizer-adam", train("--parallel.outer_optimizer=adam"),
         ("parallel.outer_optimizer: 'adam' is not one of nesterov, sgd",)),
    Case("batch-rampup-two-numbers", train("--train.batch_rampup=2,2"),
         ("train.batch_rampup='2,2' is not START,INCREMENT,TOKENS",)),
    Case("batch-rampup-from-the-full-batch", train("--train.batch_rampup=8,8,1000"),
         ("train.batch_rampup starts at 8 sequences, not below train.global_batch=8",)),
    Case("resume-other-batch-rampup", train(f"--checkpoint.resume={CKPT}", "--train.batch_rampup=4,4,1000",
                                            "--train.micro_batch=4"),
         ("was trained with train.batch_rampup=''", "keep train.batch_rampup")),
    Case("resume-other-dp-sync", train(f"--checkpoint.resume={CKPT}", "--nproc", "2", "--parallel.dp_replicate=2",
                                       "--parallel.dp_sync=diloco"),
         ("was trained with parallel.dp_sync=step; resuming it with dp_sync=diloco", "parallel.dp_sync=step")),
    # ---- values outside a fixed set
    Case("precision-fp17", train("--precision.mode=fp17"), ("precision.mode: 'fp17' is not one of", "bf16-mixed")),
    Case("optimizer-adam", train("--optim.name=adam"), ("optim.name: 'adam' is not one of", "did you mean adamw?")),
    Case("checkpointing-partial", train("--memory.activation_checkpointing=partial"),
         ("memory.activation_checkpointing: 'partial' is not one of none, full, selective",)),
    Case("norm-batchnorm", train("--model.norm=batchnorm"),
         ("model.norm: 'batchnorm' is not one of layernorm, rmsnorm",)),
    Case("device-tpu", train("--train.device=tpu"), ("train.device: 'tpu' is not one of", "did you mean cpu?")),
    Case("schedule-2f2b", train("--parallel.pp_schedule=2f2b"), ("parallel.pp_schedule: '2f2b' is not one of",)),
    Case("preset-unknown", train("--model.preset=llama-9b"), ("unknown preset 'llama-9b'", "did you mean llama-8b?")),
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
    Case("heads-not-dividing-dim", train("--model.n_heads=5"), ("model.n_heads=5 must divide model.dim=64", "try")),
    Case("kv-heads-not-dividing-heads", train("--model.n_kv_heads=3"),
         ("model.n_kv_heads=3 must divide model.n_heads=4",)),
    Case("rope-odd-head-dim", train("--model.position=rope", "--model.dim=12"), ("needs an even head dimension",)),
    Case("seq-len-above-max", train("--data.seq_len=64"),
         ("data.seq_len=64 exceeds model.max_seq_len=32", "raise model.max_seq_len")),
    Case("offload-without-zero3", train("--memory.offload_optimizer=true"),
         ("set parallel.zero=3 or drop the offload",)),
    Case("min-scale-above-init", train("--precision.mode=16-mixed", "--precision.min_scale=1e6"),
         ("precision.min_scale=1000000.0 is above precision.init_scale",)),
    Case("implementation-for-8bit", train("--optim.name=adamw8bit", "--optim.implementation=fused"),
         ("leave it at auto for adamw8bit",)),
    # ---- layouts: checked against the world size before any rank starts
    Case("tp-not-dividing-heads", train("--nproc", "2", "--parallel.tp=2", "--model.dim=96", "--model.n_heads=3"),
         ("parallel.tp=2 must divide model.n_heads=3", "use tp in [1, 3]")),
    Case("tp-not-dividing-vocab", train("--nproc", "2", "--parallel.tp=2", "--model.vocab_size=257"),
         ("parallel.tp=2 must divide model.vocab_size=257", "pad the vocabulary")),
    Case("pp-above-layers", train("--nproc", "2", "--parallel.pp=2", "--model.n_layers=1",
                                  "--model.tie_embeddings=false", "--train.micro_batch=4"),
         ("need at least 2 layers, but model.n_layers=1",)),
    Case("cp-seq-len-not-a-multiple", train("--nproc", "2", "--parallel.cp=2", "--data.seq_len=30"),
         ("parallel.cp=2 splits each sequence into 2 × cp = 4 equal chunks", "data.seq_len=30 is not a multiple of 4")),
    Case("cp-above-seq-len", train("--nproc", "32", "--parallel.cp=32"),
         ("parallel.cp=32 splits each sequence into 2 × cp = 64 chunks, but data.seq_len=32 has fewer tokens",
          "lower parallel.cp to at most 16")),
    Case("cp-ulysses-heads", train("--nproc", "4", "--parallel.cp=4", "--parallel.cp_method=ulysses",
                                   "--model.n_heads=2"),
         ("cp_method=ulysses swaps sequence shards for head shards", "must divide by parallel.cp=4",
          "use cp_method=ring or allgather")),
    Case("cp-with-dropout", train("--nproc", "2", "--parallel.cp=2", "--model.dropout=0.1"),
         ("model.dropout=0.1: attention dropout is not supported under context parallelism",)),
    Case("cp-unknown-method", train("--nproc", "2", "--parallel.cp=2", "--parallel.cp_method=rings"),
         ("parallel.cp_method", "did you mean ring?")),
    Case("pp-zero-bubble-with-tied-embeddings", train("--nproc", "2", "--parallel.pp=2", "--train.micro_batch=2",
                                                      "--model.n_layers=4", "--parallel.pp_schedule=zero-bubble",
                                                      "--parallel.pp_virtual_stages=2"),
         ("which the zero-bubble V puts on one rank", "set model.tie_embeddings=false")),
    Case("pp-split-not-numbers", train("--nproc", "2", "--parallel.pp=2", "--model.tie_embeddings=false",
                                       "--train.micro_batch=4", "--parallel.pp_split=1,x"),
         ("parallel.pp_split='1,x' must list 2 positive layer counts", "e.g. 1,1")),
    Case("interleaved-without-virtual", train("--nproc", "2", "--parallel.pp=2", "--model.tie_embeddings=false",
                                              "--train.micro_batch=4", "--parallel.pp_schedule=interleaved-1f1b"),
         ("needs parallel.pp_virtual_stages >= 2",)),
    Case("virtual-stages-without-pp", train("--parallel.pp_virtual_stages=2"), ("they need parallel.pp > 1",)),
    Case("zero3-on-one-rank", train("--parallel.zero=3"),
         ("parallel.zero=3 shards model states over the dp_shard ranks, but there is only 1", "use parallel.zero=0")),
    Case("zero1-on-one-rank", train("--parallel.zero=1"), ("parallel.zero=1", "use parallel.zero=0")),
    Case("zero2-on-replicas-only", train("--nproc", "2", "--parallel.zero=2", "--parallel.dp_replicate=2"),
         ("parallel.zero=2", "there is only 1")),
    Case("sp-without-tp", train("--nproc", "2", "--parallel.sp=true"), ("it needs parallel.tp > 1",)),
    Case("global-batch-vs-micro", train("--train.global_batch=10", "--train.micro_batch=4"),
         ("train.global_batch=10 is not divisible by micro_batch × data-parallel size", "a multiple of 4")),
    Case("global-batch-vs-triad", train("--train.global_batch=10", "--train.micro_batch=4", "--train.grad_accum=2"),
         ("train.global_batch=10 but micro_batch × grad_accum × data-parallel size", "= 8")),
    Case("global-batch-vs-ranks", train("--nproc", "2", "--train.global_batch=7"),
         ("train.global_batch=7 is not divisible", "a multiple of 2")),
    Case("accum-vs-pp-microbatches", train("--nproc", "2", "--parallel.pp=2", "--model.tie_embeddings=false",
                                           "--train.grad_accum=2", "--parallel.pp_microbatches=4"),
         ("name the same count under pipelining", "give one of them")),
    Case("world-smaller-than-layout", train("--nproc", "2", "--parallel.dp_shard=4"),
         ("= 4 ranks, but the world has 2", "launch 4 processes")),
    Case("tp-without-ranks", train("--parallel.tp=2"), ("= 2 ranks, but the world has 1", "--nproc")),
    Case("replicas-not-dividing-world", train("--nproc", "2", "--parallel.dp_replicate=3"),
         ("= 3 ranks, but the world has 2",)),
    Case("dp-shard-zero", train("--parallel.dp_shard=0"), ("parallel.dp_shard=0 is not a size", "use -1")),
    Case("nproc-zero", train("--nproc", "0"), ("--nproc must be at least 1, got 0",)),
    Case("nproc-negative", train("--nproc", "-1"), ("--nproc must be at least 1, got -1",)),
    Case("nproc-not-a-number", train("--nproc", "two"), ("argument --nproc: invalid int value: 'two'",)),
    Case("nnodes-zero", train("--nproc", "1", "--nnodes", "0"), ("--nnodes must be at least 1, got 0",)),
    Case("nnodes-without-endpoint", train("--nproc", "1", "--nnodes", "2"), ("--nnodes > 1 needs --rdzv-endpoint",)),
    Case("auto-layout-with-fixed-zero", train("--parallel.layout=auto", "--parallel.zero=3"),
         ("parallel.layout=auto chooses the layout itself", "parallel.layout=manual")),
    # ---- data folders
    Case("data-missing", train(data="nodata"), ("nodata: no meta.json", "scaletrain prepare")),
    Case("data-empty-folder", train(data="empty"), ("empty: no meta.json",), lambda d: (d / "empty").mkdir()),
    Case("data-shard-truncated", train(), ("shard is truncated or has the wrong dtype", "re-run scaletrain prepare"),
         truncate("data/shard_00000.bin", 30)),
    Case("data-shard-missing", train(), ("shard_00000.bin: shard listed in meta.json is missing",),
         lambda d: (d / "data" / "shard_00000.bin").unlink()),
    Case("data-meta-corrupt", train(), ("meta.json: not valid JSON", "re-run scaletrain prepare"),
         write("data/meta.json", "{not json")),
    Case("data-meta-not-an-object", train(), ("not a scaletrain token folder",), write("data/meta.json", "[1, 2]")),
    Case("data-checksum-mismatch", train(), ("shard is corrupt (its sha256 differs",), flip_byte),
    Case("data-dtype-float32", train(), ("token dtype 'float32' is not supported", "uint16, uint32"),
         edit_json("data/meta.json", lambda m: m.update(dtype="float32"))),
    Case("data-dtype-uint32", train(), ("wrong dtype", "tokens of uint32"),
         edit_json("data/meta.json", lambda m: m.update(dtype="uint32"))),
    Case("data-foreign-format", train(), ("not a scaletrain token folder (format 'other')",),
         edit_json("data/meta.json", lambda m: m.update(format="other"))),
    Case("data-no-shards", train(), ("lists no shards",), edit_json("data/meta.json", lambda m: m.update(shards=[]))),
    Case("data-shard-entry-broken", train(), ("needs a file name and a token count",),
         edit_json("data/meta.json", lambda m: m["shards"][0].pop("file"))),
    Case("data-shard-outside-folder", train(), ("shard file '../data/shard_00000.bin' is not a plain file name",),
         edit_json("data/meta.json", lambda m: m["shards"][0].update(file="../data/shard_00000.bin"))),
    Case("data-tokenizer-outside-folder", train(), ("tokenizer file '/etc/passwd' in the metadata is not a plain",),
         edit_json("data/meta.json", lambda m: m.update(tokenizer={"kind": "file", "file": "/etc/passwd"}))),
    Case("data-token-outside-vocab", train(), ("holds token id 300", "256-token vocabulary"), token_outside_vocab),
    Case("data-tokenizer-unknown", train(), ("unknown tokenizer kind 'sentencepiece'",),
         edit_json("data/meta.json", lambda m: m.update(tokenizer={"kind": "sentencepiece"}))),
    Case("vocab-larger-than-model", train("--model.vocab_size=100"),
         ("the tokenizer has 256 tokens but model.vocab_size=100", "at least 256")),
    Case("seq-len-longer-than-data", train(data="tiny"),
         ("too few for one window of data.seq_len=32", "lower data.seq_len")),
    # ---- checkpoints and run folders
    Case("resume-other-dim", train(f"--checkpoint.resume={CKPT}", "--model.dim=96"),
         ("saved for another model shape: dim=64 (now 96)", "the model config it was saved with")),
    Case("resume-other-depth", train(f"--checkpoint.resume={CKPT}", "--model.n_layers=3"),
         ("another model shape: n_layers=2 (now 3)",)),
    Case("resume-other-batch", train(f"--checkpoint.resume={CKPT}", "--train.global_batch=16"),
         ("trained with global batch 8", "keep train.global_batch")),
    Case("resume-auto-other-shape", train("--checkpoint.resume=auto", "--model.dim=96", run_dir="run"),
         ("another model shape: dim=64 (now 96)",)),
    Case("resume-not-a-checkpoint", train("--checkpoint.resume=data"),
         ("data is not a complete scaletrain checkpoint", "pick a step_* folder")),
    Case("resume-missing", train("--checkpoint.resume=nope"), ("checkpoint.resume: folder nope does not exist",)),
    Case("resume-trainer-json-corrupt", train(f"--checkpoint.resume={CKPT}"), ("trainer.json: not valid JSON",),
         write(f"{CKPT}/trainer.json", "{")),
    Case("resume-trainer-json-not-an-object", train(f"--checkpoint.resume={CKPT}"),
         ("trainer.json: expected a JSON object",),
         write(f"{CKPT}/trainer.json", "[]")),
    Case("resume-trainer-json-without-config", train(f"--checkpoint.resume={CKPT}"),
         ("missing or malformed config", "the checkpoint is damaged"),
         edit_json(f"{CKPT}/trainer.json", lambda s: s.pop("config"))),
    Case("resume-trainer-json-without-model", train(f"--checkpoint.resume={CKPT}"),
         ("missing or malformed config.model",), edit_json(f"{CKPT}/trainer.json", lambda s: s["config"].pop("model"))),
    Case("resume-trainer-json-without-batch", train(f"--checkpoint.resume={CKPT}"), ("missing or malformed data",),
         edit_json(f"{CKPT}/trainer.json", lambda s: s["data"].pop("global_batch"))),
    Case("resume-format-version", train(f"--checkpoint.resume={CKPT}"), ("checkpoint format 99 is not one this version reads (1, 2)",),
         edit_json(f"{CKPT}/trainer.json", lambda s: s.update(format_version=99))),
    Case("resume-tensor-file-missing", train(f"--checkpoint.resume={CKPT}"),
         ("is damaged (__0_0.distcp is missing or unreadable)", "use another checkpoint"), lambda d: (d / CKPT / "__0_0.distcp").unlink()),
    Case("resume-tensor-file-truncated", train(f"--checkpoint.resume={CKPT}"),
         ("is damaged (__0_0.distcp has 100 bytes", "use another checkpoint"), truncate(f"{CKPT}/__0_0.distcp", 100)),
    Case("resume-metadata-garbage", train(f"--checkpoint.resume={CKPT}"),
         ("is damaged (.metadata has 7 bytes", "use another checkpoint"), write(f"{CKPT}/.metadata", b"garbage")),
    Case("run-dir-already-used", train(run_dir="run"),
         ("log.run_dir run already holds a run", "checkpoint.resume=auto", "nothing was changed")),
    Case("checkpoint-dir-already-used", train("--checkpoint.dir=run/checkpoints"),
         ("checkpoint.dir run/checkpoints already holds checkpoints", "checkpoint.resume=auto")),
    Case("run-dir-is-a-file", train(run_dir="data/meta.json"), ("log.run_dir data/meta.json is a file, not a folder",)),
    # ---- export
    Case("export-missing", ["export", "nope", "--out", "m.safetensors"],
         ("nope is not a complete scaletrain checkpoint",)),
    Case("export-not-a-checkpoint", ["export", "data", "--out", "m.safetensors"], ("data is not a complete",)),
    Case("export-over-existing-file", ["export", CKPT, "--out", "data/meta.json"],
         ("data/meta.json already exists", "nothing was overwritten")),
    Case("export-without-out", ["export", CKPT], ("the following arguments are required: --out",)),
    Case("export-metadata-garbage", ["export", CKPT, "--out", "m.safetensors"], ("is damaged (.metadata has 9 bytes",),
         write(f"{CKPT}/.metadata", b"\x80\x04garbage")),
    Case("export-with-overrides", ["export", CKPT, "--out", "m.safetensors", "--model.dim=3"],
         ("unexpected arguments: --model.dim=3",)),
    # ---- plan
    Case("plan-unknown-gpu", ["plan", "tiny", "--hardware", "H900"], ("unknown hardware 'H900'", "H100-SXM")),
    Case("plan-zero-gpus", ["plan", "tiny", "--gpus-per-node", "0"], ("--gpus-per-node must be at least 1",)),
    Case("plan-zero-nodes", ["plan", "tiny", "--nodes", "0"], ("--nodes and --gpus-per-node must be at least 1",)),
    Case("plan-unknown-model", ["plan", "gpt9"], ("unknown model 'gpt9'", "not a preset")),
    Case("plan-workers-without-link", ["plan", "tiny", "--workers", "2"],
         ("--workers 2 splits the cluster into sites; give the link between them: --workers-link GBPS",)),
    Case("plan-workers-not-dividing", ["plan", "tiny", "--workers", "3", "--workers-link", "1"],
         ("--workers 3 does not divide the cluster's 8 GPUs",)),
    Case("plan-no-model", ["plan"], ("plan needs a model",)),
    Case("plan-hf-config-not-an-object", ["plan", "config.json"],
         ("expected a JSON object",), write("config.json", "[1]")),
    Case("plan-hf-config-incomplete", ["plan", "config.json"],
         ("no 'vocab_size'",), write("config.json", '{"n_embd": 64}')),
    Case("plan-tp-zero", ["plan", "tiny", "--tp", "0"], ("layout sizes must be at least 1, got tp=0",)),
    Case("plan-micro-batch-zero", ["plan", "tiny", "--micro-batch", "0"], ("got micro_batch=0",)),
    Case("plan-tp-not-dividing-gpus", ["plan", "tiny", "--tp", "3"],
         ("tp 3 × pp 1 does not divide the cluster's 8 GPUs",)),
    Case("plan-top-zero", ["plan", "tiny", "--top", "0"], ("--top must be at least 1",)),
    Case("plan-global-batch-zero", ["plan", "tiny", "--global-batch", "0"], ("global batch must be at least 1",)),
    Case("plan-zero-stage-five", ["plan", "tiny", "--zero", "5"], ("argument --zero: invalid choice: 5",)),
    Case("plan-chart-folder-missing", ["plan", "tiny", "--chart", "nodir/c.png"], ("the folder nodir does not exist",)),
    Case("plan-bad-training-config", ["plan", "--config", "c.toml"], ("train.steps: 0 is below the minimum 1",),
         with_toml("[train]\nsteps = 0\n")),
    Case("plan-unknown-engine", ["plan", "tiny", "--engine", "colossal"],
         ("argument --engine: invalid choice: 'colossal'", "megatron")),
    Case("plan-cp-zero", ["plan", "tiny", "--engine", "megatron", "--cp", "0"], ("got cp=0",)),
    Case("plan-fp8-without-fp8-peak", ["plan", "tiny", "--hardware", "A100-80GB", "--fp8"],
         ("--fp8: hardware A100-80GB has no fp8 peak",)),
    Case("plan-precision-fp8-without-fp8-peak", ["plan", "tiny", "--hardware", "A100-80GB", "--precision", "fp8"],
         ("--fp8 (or --precision fp8): hardware A100-80GB has no fp8 peak",)),
    Case("plan-measure-other-engine", ["plan", "tiny", "--engine", "megatron", "--measure"],
         ("--measure runs scaletrain's trainer", "--engine megatron")),
    # ---- schedule
    Case("schedule-one-stage", ["schedule", "--pp", "1", "--microbatches", "4"], ("--pp must be at least 2",)),
    Case("schedule-zero-microbatches", ["schedule", "--pp", "2", "--microbatches", "0"],
         ("--microbatches at least 1",)),
    Case("schedule-unknown", ["schedule", "--pp", "2", "--microbatches", "4", "--schedule", "2f2b"],
         ("--schedule '2f2b' is not one of",)),
    Case("schedule-interleaved-one-chunk", ["schedule", "--pp", "2", "--microbatches", "4", "--schedule",
                                            "interleaved-1f1b"], ("interleaved-1f1b needs --virtual 2 or more",)),
    Case("schedule-zero-bubble-three-chunks", ["schedule", "--pp", "2", "--microbatches", "4", "--schedule",
                                               "zero-bubble", "--virtual", "3"], ("--virtual 2",)),
    Case("schedule-too-large-to-draw", ["schedule", "--pp", "2", "--microbatches", "100000000"],
         ("too many to draw (at most 65,536)",)),
    Case("schedule-png-not-png", ["schedule", "--pp", "2", "--microbatches", "4", "--png", "data/meta.json"],
         ("give a file name ending in .png",)),
    Case("schedule-png-folder-missing", ["schedule", "--pp", "2", "--microbatches", "4", "--png", "nodir/s.png"],
         ("the folder nodir does not exist",)),
    Case("schedule-without-microbatches", ["schedule", "--pp", "2"], ("required: --microbatches",)),
    # ---- prepare
    Case("prepare-missing-input", ["prepare", "nope.txt", "--out", "o"], ("nope.txt: no such file or folder",)),
    Case("prepare-unsupported-extension", ["prepare", "x.csv", "--out", "o"], ("unsupported file type '.csv'",),
         write("x.csv", "a,b")),
    Case("prepare-folder-without-text", ["prepare", "empty", "--out", "o"], ("no .txt, .jsonl or .parquet files",),
         lambda d: (d / "empty").mkdir()),
    Case("prepare-over-existing-data", ["prepare", "t.txt", "--out", "data"],
         ("data already exists and is not empty", "nothing was changed"), write("t.txt", "hello")),
    Case("prepare-out-is-a-file", ["prepare", "t.txt", "--out", "t.txt"],
         ("t.txt is a file",), write("t.txt", "hello")),
    Case("prepare-jsonl-corrupt", ["prepare", "t.jsonl", "--out", "o"], ("t.jsonl:1: not valid JSON",),
         write("t.jsonl", "{bad\n")),
    Case("prepare-jsonl-without-text", ["prepare", "t.jsonl", "--out", "o"], ("set --text-key",),
         write("t.jsonl", '{"body": "x"}\n')),
    Case("prepare-bpe-vocab-too-small", ["prepare", "t.txt", "--out", "o", "--tokenizer", "bpe", "--vocab-size", "100"],
         ("--vocab-size 100 is too small for BPE",), write("t.txt", "hello")),
    Case("prepare-tokenizer-file-missing", ["prepare", "t.txt", "--out", "o", "--tokenizer", "file"],
         ("--tokenizer file needs --tokenizer-file",), write("t.txt", "hello")),
    Case("prepare-shard-tokens-zero", ["prepare", "t.txt", "--out", "o", "--shard-tokens", "0"],
         ("--shard-tokens must be at least 1",), write("t.txt", "hello")),
    Case("prepare-parquet-garbage", ["prepare", "t.parquet", "--out", "o"],
         ("t.parquet:",), write("t.parquet", "hello")),
    # ---- the command line itself
    Case("no-subcommand", [], ("the following arguments are required: verb",)),
    Case("unknown-subcommand", ["fit"], ("invalid choice: 'fit'",)),
    Case("train-unknown-flag", train("--verbose"), ("unexpected argument '--verbose'",)),
    # ---- fp8 (more in tests/test_fp8.py)
    Case("fp8-on-cpu-without-emulation", train("--precision.mode=fp8", "--precision.fp8_min_dim=64"),
         ("precision.mode=fp8 on cpu", "set precision.fp8_emulate=true")),
    Case("fp8-model-too-narrow", train("--precision.mode=fp8", "--precision.fp8_emulate=true"),
         ("no block linear layer qualifies", "precision.fp8_min_dim=1024")),
    Case("schedule-unknown-flag", ["schedule", "--pp", "2", "--microbatches", "4", "--verbose"],
         ("unexpected arguments: --verbose",)),
]


def test_corpus_is_large_and_distinct():
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids))
    plain = [tuple(c.argv) for c in CASES if c.prep is None]  # (a prepared case differs by its files)
    assert len(plain) == len(set(plain))
    assert len(CASES) >= 55


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_gives_one_clear_line(case: Case, workdir: Path, capsys):
    if case.prep:
        case.prep(workdir)
    before = snapshot(workdir)
    code, out, err = run_main(case.argv, capsys)
    assert "Traceback" not in out + err, err
    assert code == 2, (code, err)
    assert out.strip() == "", out  # nothing half-done printed before the error
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == case.lines, err
    assert all(line.startswith("scaletrain: error: ") for line in lines), err
    for fragment in case.expect:
        assert fragment in err, (fragment, err)
    assert snapshot(workdir) == before  # nothing written, nothing overwritten


def test_layout_error_from_the_real_command_starts_no_rank(tmp_path):
    """`python -m scaletrain` exits 2 on a world-size mismatch, before the launcher runs."""
    r = subprocess.run([sys.executable, "-m", "scaletrain", "train", *MICRO_ARGS, "--nproc", "2",
                        "--parallel.dp_shard=4", f"--log.run_dir={tmp_path / 'run'}"],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [
        "scaletrain: error: the layout pp × dp_replicate × dp_shard × tp = 1 × 1 × 4 × 1 = 4 ranks, but the world "
        "has 2; set parallel.dp_shard=-1 to use the remaining ranks, or launch 4 processes"]
    assert list(tmp_path.iterdir()) == []


def _limit_address_space():
    limit = 16 * 2**30  # far below the 4 TiB the model asks for; a refusal, never the OOM killer
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def test_model_too_large_for_memory_is_one_line(assets, tmp_path):
    """A single weight larger than memory: a clear line, not an allocator traceback."""
    r = subprocess.run([sys.executable, "-m", "scaletrain", "train", *MICRO_ARGS, "--model.dim=1048576",
                        f"--data.path={assets / 'data'}", f"--log.run_dir={tmp_path / 'run'}"],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path, preexec_fn=_limit_address_space,
                       env={**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""})  # no driver mappings
    assert r.returncode == 2, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("scaletrain: error: the model's weights"), r.stderr[-2000:]
    assert "do not fit in cpu memory" in lines[0] and "scaletrain plan" in lines[0]
    assert list(tmp_path.iterdir()) == []


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
    before = snapshot(workdir)
    code, out, err = run_main(argv, capsys)
    assert code == 2 and "Traceback" not in out + err, err
    lines = err.strip().splitlines()
    assert all(line.startswith("scaletrain: error: ") for line in lines)
    # each typed field names itself; data.path and checkpoint.resume are checked later, if at all
    for name in ("model.preset", "precision.mode", "train.steps", "optim.lr", "log.tensorboard"):
        assert any(line.startswith(f"scaletrain: error: {name}") for line in lines), (name, err)
    assert snapshot(workdir) == before
    assert_nothing_ran(workdir)


# --------------------------------------------------------------------------------------------
# Fuzzing the config loader: it returns a valid config or raises ConfigError, nothing else

FIELD_NAMES = {name: [f.name for f in fields(cls)] for name, cls in SECTIONS.items()}
ALL_KEYS = sorted({k for keys in FIELD_NAMES.values() for k in keys})

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


FIELD_STRATEGIES = {f"{s}.{f.name}": _field_values(s, f) for s, cls in SECTIONS.items() for f in fields(cls)}


def to_toml(cfg: JobConfig) -> str:
    lines = []
    for section, body in cfg.to_dict().items():
        lines.append(f"[{section}]")
        for key, value in body.items():
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
