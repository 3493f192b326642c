"""Evaluation: the validation split of `prepare --val-fraction`, train.eval_every's val_loss
under every layout (equal to one process), and `scaletrain eval CKPT`."""

from __future__ import annotations

import io
import json
import math

import numpy as np
import pytest

from scaletrain.data import TokenData, prepare
from scaletrain.data.dataset import builtin_data, builtin_validation_text, open_validation
from scaletrain.data.prepare import is_validation
from scaletrain.errors import ConfigError, DataError
from scaletrain.train.metrics import MetricsLogger
from scaletrain.train.trainer import Trainer

from conftest import (
    assert_same_run,
    margin_text,
    micro_cfg,
    micro_overrides,
    read_metrics,
    run_group,
    run_here,
)

TOL = 1e-5
WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly box jackals".split()


def documents(n: int) -> list[str]:
    rng = np.random.default_rng(0)
    return [f"doc {i}: " + " ".join(rng.choice(WORDS, size=int(rng.integers(8, 30)))) for i in range(n)]


@pytest.fixture
def corpus(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    docs = documents(400)
    (src / "a.jsonl").write_text("\n".join(json.dumps({"text": d}) for d in docs[:250]))
    (src / "b.jsonl").write_text("\n".join(json.dumps({"text": d}) for d in docs[250:]))
    return src, docs


def texts(data: TokenData) -> list[str]:
    """The documents of a byte-level split (each followed by the blank-line separator)."""
    raw = bytes(data.read(0, data.num_tokens).astype(np.uint8).tolist()).decode()
    assert raw.endswith("\n\n")
    return raw[:-2].split("\n\n")


# ---------------------------------------------------------------------------------------------
# prepare --val-fraction


def test_split_is_by_document_deterministic_and_respects_the_fraction(corpus, tmp_path):
    src, docs = corpus
    meta = prepare([src], tmp_path / "out", val_fraction=0.25, shard_tokens=3000)
    train = TokenData.open(tmp_path / "out")
    val = TokenData.open(tmp_path / "out", split="val")
    train_docs, val_docs = texts(train), texts(val)
    assert not set(train_docs) & set(val_docs)  # no document on both sides
    assert sorted(train_docs + val_docs) == sorted(docs)  # every document whole, on one side
    assert val_docs == [d for d in docs if is_validation(d, 0.25)]  # decided by the text alone
    assert 0.20 < len(val_docs) / len(docs) < 0.30
    assert meta["num_val_documents"] == len(val_docs) and meta["num_documents"] == len(train_docs)
    assert meta["num_val_tokens"] == val.num_tokens and len(meta["val_shards"]) > 1  # several val shards
    assert all(s["file"].startswith("val_") and len(s["sha256"]) == 64 for s in meta["val_shards"])
    assert train.fingerprint != val.fingerprint

    # the same inputs in another order: the same documents on each side
    again = prepare([src / "b.jsonl", src / "a.jsonl"], tmp_path / "again", val_fraction=0.25)
    assert sorted(texts(TokenData.open(tmp_path / "again", split="val"))) == sorted(val_docs)
    assert again["num_val_tokens"] == meta["num_val_tokens"]

    # a corrupt validation shard is caught like a training shard
    shard = tmp_path / "out" / meta["val_shards"][0]["file"]
    shard.write_bytes(b"x" + shard.read_bytes()[1:])
    with pytest.raises(DataError, match="corrupt"):
        open_validation(str(tmp_path / "out"))


def test_without_the_flag_the_folder_is_written_as_before(corpus, tmp_path):
    src, _ = corpus
    meta = prepare([src], tmp_path / "plain")
    assert set(meta) == {"format", "version", "dtype", "tokenizer", "num_tokens", "num_documents", "shards",
                         "sources", "created"}
    assert meta["num_documents"] == 400 and [p.name for p in sorted((tmp_path / "plain").iterdir())] == \
        ["meta.json", "shard_00000.bin"]
    assert open_validation(str(tmp_path / "plain")) is None
    with pytest.raises(DataError, match="no validation split"):
        TokenData.open(tmp_path / "plain", split="val")
    # the training split of a split folder is named by its own tokens, not by the held-out ones
    prepare([src], tmp_path / "split", val_fraction=0.1)
    assert TokenData.open(tmp_path / "split").fingerprint != TokenData.open(tmp_path / "plain").fingerprint


@pytest.mark.parametrize("value", ["1.5", "1", "-0.1", "nan"])
def test_bad_val_fraction_is_one_line_and_writes_nothing(corpus, tmp_path, value):
    src, _ = corpus
    r = run_here("prepare", str(src), "--out", str(tmp_path / "out"), "--val-fraction", value)
    assert r.returncode == 2 and "--val-fraction" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_a_fraction_that_leaves_a_side_empty_is_refused(tmp_path):
    (tmp_path / "one.txt").write_text("a single document")
    with pytest.raises(DataError, match="validation split without text"):
        prepare([tmp_path / "one.txt"], tmp_path / "out", val_fraction=0.01)
    assert not (tmp_path / "out").exists()


def test_builtin_validation_text_is_not_in_the_training_text():
    train = bytes(builtin_data().read(0, builtin_data().num_tokens).astype(np.uint8).tolist()).decode()
    held_out = builtin_validation_text()
    assert len(held_out) > 30_000
    paragraphs = [p for p in held_out.split("\n\n") if len(p) > 80]
    assert paragraphs and not any(p in train for p in paragraphs)


# ---------------------------------------------------------------------------------------------
# train.eval_every


def test_eval_every_without_validation_data_is_one_line(corpus, tmp_path):
    src, _ = corpus
    prepare([src], tmp_path / "data")
    with pytest.raises(ConfigError, match="needs a validation split"):
        Trainer(micro_cfg(tmp_path, **{"data.path": str(tmp_path / "data"), "train.eval_every": 5}))
    r = run_here("train", f"--data.path={tmp_path / 'data'}", "--train.eval_every=5", "--train.device=cpu",
                 f"--log.run_dir={tmp_path / 'cli'}")
    assert r.returncode == 2 and "train.eval_every=5 needs a validation split" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "cli").exists()


def test_too_few_validation_windows_names_the_most_batches(tmp_path):
    with pytest.raises(DataError, match=r"lower it to at most \d+"):
        Trainer(micro_cfg(tmp_path, **{"train.eval_every": 5, "train.eval_batches": 10_000}))


def test_evaluation_leaves_training_bitwise_unchanged_and_logs_val_metrics(tmp_path):
    plain = Trainer(micro_cfg(tmp_path / "plain", **{"log.every": 2})).fit()["history"]
    cfg = micro_cfg(tmp_path / "eval", **{"log.every": 2, "train.eval_every": 3, "train.eval_batches": 2})
    evaluated = Trainer(cfg).fit()["history"]
    by_step = {r["step"]: r for r in evaluated}
    for r in plain:  # every bit of the training numbers
        assert (by_step[r["step"]]["loss"], by_step[r["step"]]["grad_norm"]) == (r["loss"], r["grad_norm"])
    val_steps = [r["step"] for r in evaluated if "val_loss" in r]
    assert val_steps == [3, 6, 9, 10]  # every 3 steps and at the end, logged even off log.every
    for r in evaluated:
        if "val_loss" in r:
            assert r["val_ppl"] == pytest.approx(math.exp(r["val_loss"]))
            assert 0 < r["val_loss"] < math.log(256) + 0.5
    assert read_metrics(tmp_path / "eval" / "run")[-1]["val_loss"] == evaluated[-1]["val_loss"]
    # the same windows each time: a second run evaluates to the same numbers
    again = Trainer(micro_cfg(tmp_path / "again", **{"log.every": 2, "train.eval_every": 3,
                                                     "train.eval_batches": 2})).fit()["history"]
    assert [r.get("val_loss") for r in again] == [r.get("val_loss") for r in evaluated]


def test_val_metrics_go_to_tensorboard_under_val_and_to_the_progress_line(tmp_path):
    class Writer:
        tags: list = []

        def add_scalar(self, tag, value, step):
            self.tags.append(tag)

    stream = io.StringIO()
    logger = MetricsLogger(tmp_path, 10, enabled=True, stream=stream, progress="off")
    logger._jsonl, logger._tb = io.StringIO(), Writer()
    logger.log({"step": 10, "loss": 2.0, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 1.0, "mfu": 0.1,
                "peak_mem_bytes": 1, "data_wait_frac": 0.0, "val_loss": 2.5, "val_ppl": math.exp(2.5)})
    assert {"val/loss", "val/ppl", "train/loss"} <= set(Writer.tags) and "train/val_loss" not in Writer.tags
    assert "val_loss 2.5000  val_ppl 12.18" in stream.getvalue()
    logger.summary()
    assert "validation loss" in stream.getvalue() and "2.5000 (ppl 12.18, step 10)" in stream.getvalue()


# ---------------------------------------------------------------------------------------------
# every layout gives one process's val_loss (and trains like it: every step logged and compared)

STEPS = 6
BASE = {"train.steps": STEPS, "model.n_layers": 4, "model.tie_embeddings": False, "train.micro_batch": 2,
        "train.eval_every": 3, "train.eval_batches": 2, "log.every": 1}
LAYOUTS = [
    ("dp2-ddp", {"parallel.zero": 0}),
    ("dp2-zero3", {"parallel.zero": 3}),
    ("tp2", {"parallel.tp": 2}),
    ("pp2-1f1b", {"parallel.pp": 2, "parallel.pp_schedule": "1f1b"}),
    ("pp2-interleaved", {"parallel.pp": 2, "parallel.pp_schedule": "interleaved-1f1b",
                         "parallel.pp_virtual_stages": 2}),
    ("cp2-ring", {"parallel.cp": 2}),  # each rank's val tokens are its chunks of every sequence
    ("cp2-ulysses", {"parallel.cp": 2, "parallel.cp_method": "ulysses"}),
]


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("eval-layouts")
    jobs = LAYOUTS + [("dp2-zero3-no-eval", {"parallel.zero": 3, "train.eval_every": 0})]
    code, results, err = run_group(2, [{"overrides": micro_overrides(tmp / n, **{**BASE, **e})} for n, e in jobs],
                                   tmp)
    assert code == 0, err
    out = {n: r["history"] for (n, _), r in zip(jobs, results, strict=True)}
    out["one"] = Trainer(micro_cfg(tmp / "one", **BASE)).fit()["history"]
    return out


@pytest.mark.multiproc
@pytest.mark.parametrize("name", [n for n, _ in LAYOUTS])
def test_val_loss_equals_one_process(layouts, name):
    ref = {r["step"]: r["val_loss"] for r in layouts["one"] if "val_loss" in r}
    got = {r["step"]: r["val_loss"] for r in layouts[name] if "val_loss" in r}
    assert sorted(got) == sorted(ref) == [3, 6]
    for step, loss in got.items():
        rel = abs(loss - ref[step]) / ref[step]
        assert rel < TOL, f"{name}: val_loss at step {step}: {loss} vs {ref[step]}, {margin_text(rel, TOL)}"
    # the training it evaluates: every step's loss and gradient norm (verify's fp32 tolerances)
    assert_same_run(layouts[name], layouts["one"], steps=STEPS, tol=(TOL, 1e-4), what=name)


@pytest.mark.multiproc
def test_evaluation_leaves_sharded_training_bitwise_unchanged(layouts):
    with_eval, without = layouts["dp2-zero3"], layouts["dp2-zero3-no-eval"]
    assert [(r["step"], r["loss"], r["grad_norm"]) for r in with_eval] == \
        [(r["step"], r["loss"], r["grad_norm"]) for r in without]
    assert not any("val_loss" in r for r in without)


# ---------------------------------------------------------------------------------------------
# scaletrain eval CKPT


def test_eval_cli_prints_the_val_loss_the_run_logged(corpus, tmp_path):
    src, _ = corpus
    prepare([src], tmp_path / "data", val_fraction=0.3)
    cfg = micro_cfg(tmp_path, **{"data.path": str(tmp_path / "data"), "train.eval_every": 5,
                                 "train.eval_batches": 2, "checkpoint.save_final": True})
    result = Trainer(cfg).fit()
    logged = result["history"][-1]["val_loss"]
    r = run_here("eval", result["checkpoint"], "--data", str(tmp_path / "data"), "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    # the windows of eval_batches global batches of the run (the metric is over exactly those)
    windows = cfg.train.eval_batches * cfg.train.global_batch
    assert out["split"] == "validation" and out["step"] == cfg.train.steps and out["windows"] == windows
    assert abs(out["val_loss"] - logged) / logged < TOL
    # without --data: the data it was trained on; the text form
    r = run_here("eval", result["checkpoint"])
    assert r.returncode == 0 and r.stdout.startswith(f"val_loss {logged:.4f}  val_ppl "), r.stdout + r.stderr
    # a folder with no validation split: all of it, and said so
    prepare([src], tmp_path / "whole")
    r = run_here("eval", result["checkpoint"], "--data", str(tmp_path / "whole"), "--batches", "1")
    assert r.returncode == 0 and "all (the folder has no validation split)" in r.stdout, r.stdout + r.stderr
    # bad input: one line, exit 2
    for args in (["--batches", "-1"], ["--data", str(tmp_path / "missing")]):
        r = run_here("eval", result["checkpoint"], *args)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr, \
            r.stderr
    r = run_here("eval", str(tmp_path / "no-checkpoint"))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr


@pytest.mark.parametrize("loss_mask", ["auto", "false"])
def test_eval_of_a_mid_run_chat_checkpoint_gives_the_val_loss_logged_at_its_step(tmp_path, loss_mask):
    """`scaletrain eval` of the checkpoint of step 5 (not the last) of a run on chat data gives the
    val_loss the run logged at step 5, counting the tokens the run counted: the answers alone, or every
    token where the run said data.loss_mask=false (eval counted the answers alone there, 2% off)."""
    from scaletrain.trained.evaluate import evaluate_checkpoint
    from test_chat import conversations, write_jsonl

    prepare([write_jsonl(tmp_path / "chat.jsonl", conversations(80))], tmp_path / "tok", chat_format="plain",
            val_fraction=0.3)
    cfg = micro_cfg(tmp_path, **{"data.path": str(tmp_path / "tok"), "data.loss_mask": loss_mask,
                                 "train.eval_every": 5, "train.eval_batches": 2, "checkpoint.every": 5})
    result = Trainer(cfg).fit()
    logged = {row["step"]: row["val_loss"] for row in result["history"] if "val_loss" in row}
    assert logged[5] != logged[10]  # the steps' losses differ, so evaluating the other checkpoint shows
    out = evaluate_checkpoint(tmp_path / "run" / "checkpoints" / "step_00000005")
    assert out["step"] == 5 and out["split"] == "validation"
    assert abs(out["val_loss"] - logged[5]) / logged[5] < TOL, (out["val_loss"], logged[5])


# --------------------------------------------------------------------------------------------
# `scaletrain eval RUN_FOLDER`


def test_eval_and_export_take_a_run_folder_and_config_names(finished_run, tmp_path):
    newest = finished_run / "checkpoints" / "step_00000004"
    r = run_here("eval", str(finished_run))
    assert r.returncode == 0, r.stderr
    assert f"its newest complete checkpoint is {newest}" in r.stderr
    logged = read_metrics(finished_run)[-1]["val_loss"]
    assert r.stdout.startswith(f"val_loss {logged:.4f}")
    by_name = run_here("eval", str(finished_run), "--data.path=", "--train.eval_batches=1", "--train.device=cpu")
    by_alias = run_here("eval", str(finished_run), "--data", "", "--batches", "1", "--device", "cpu")
    assert by_name.returncode == 0 and by_name.stdout == by_alias.stdout
    typo = run_here("eval", str(finished_run), "--data.paths=x")
    assert typo.returncode == 2 and "(did you mean --data.path?)" in typo.stderr
    assert len(typo.stderr.strip().splitlines()) == 1


def test_eval_takes_a_hugging_face_folder_as_generate_does(finished_run, tmp_path):
    """Issue 47: eval refused a Hugging Face folder that generate accepts. The run's export evaluates to
    the checkpoint's loss on the same windows (its eval batch of 8 windows of 32 is the run's); without
    --data it is one line saying what to give."""
    newest = finished_run / "checkpoints" / "step_00000004"
    assert run_here("export", str(newest), "--format", "hf", "--out", str(tmp_path / "hf")).returncode == 0
    ckpt = run_here("eval", str(newest), "--data", "", "--batches", "2", "--json")
    hf = run_here("eval", str(tmp_path / "hf"), "--data", "", "--batches", "2", "--json")
    assert ckpt.returncode == 0 and hf.returncode == 0, ckpt.stderr + hf.stderr
    a, b = json.loads(ckpt.stdout), json.loads(hf.stdout)
    assert a["windows"] == b["windows"] == 16 and abs(a["val_loss"] - b["val_loss"]) < 1e-5, (a, b)
    assert run_here("generate", str(tmp_path / "hf"), "--prompt", "a", "--max-new-tokens", "4").returncode == 0
    r = run_here("eval", str(tmp_path / "hf"))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert "is a Hugging Face model folder, which names no data: give --data FOLDER" in r.stderr


def test_eval_refuses_a_model_folder_of_another_tokenizer_in_eval_s_words(finished_run, corpus, tmp_path):
    """A Hugging Face folder evaluated on data of another tokenizer: one line that names the folder and
    what to give `eval`, not model.init_from's advice."""
    src, _ = corpus
    assert run_here("export", str(finished_run / "checkpoints" / "step_00000004"), "--format", "hf", "--out",
                    str(tmp_path / "hf")).returncode == 0
    prepare([src], tmp_path / "bpe", tokenizer="bpe", vocab_size=300)
    r = run_here("eval", str(tmp_path / "hf"), "--data", str(tmp_path / "bpe"))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert f"the model folder {tmp_path / 'hf'} was trained with another tokenizer" in r.stderr
    assert r.stderr.rstrip().endswith("or give --data a folder prepared with this model's tokenizer")
    assert "model.init_from" not in r.stderr
