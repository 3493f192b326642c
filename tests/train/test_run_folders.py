"""A run folder read from anywhere: its data found from another working folder, and after the
run folder moved together with its data; the default run on the user's own data, with or
without a validation split; a run folder's broken or missing config.json. Every command is the
CLI, run from a folder other than the one the run was trained in (subprocesses where the working
folder is the point)."""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest

from scaletrain.errors import DataError

from conftest import MICRO_ARGS, copy_run, read_metrics, run_cli, run_main

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly box jackals".split()
RUN_ARGS = [*MICRO_ARGS, "--train.steps=2", "--checkpoint.save_final=true"]  # the demo's eval_every=50: at the end


def write_corpus(folder, docs: int = 60, words: int = 120):
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for i in range(docs):
        (folder / f"{i}.txt").write_text(f"doc {i}: " + " ".join(rng.choice(WORDS, size=words)))


def val_loss_of(stdout: str) -> float:
    return float(re.match(r"val_loss (\S+)", stdout).group(1))


# --------------------------------------------------------------------------------------------
# Point 3: a run folder works from anywhere, and moved with its data


def test_a_run_folder_works_from_another_folder_and_moved_with_its_data(tmp_path, monkeypatch, capsys):
    work = tmp_path / "work"
    write_corpus(work / "corpus")
    (work / "sub").mkdir()
    monkeypatch.chdir(work / "sub")  # trained from work/sub, with paths relative to it
    code, _, err = run_main(["prepare", "../corpus", "--out", "../data/mine", "--val-fraction", "0.25", "--quiet"],
                            capsys)
    assert code == 0, err
    code, _, err = run_main(["train", *RUN_ARGS, "--data.path=../data/mine", "--log.run_dir=../runs/mine"], capsys)
    assert code == 0, err
    logged = read_metrics(work / "runs" / "mine")[-1]["val_loss"]

    # from another folder, nothing moved: the run names its data absolutely
    monkeypatch.chdir(tmp_path)
    code, out, err = run_main(["eval", "work/runs/mine", "--device", "cpu"], capsys)
    assert code == 0, err
    assert val_loss_of(out) == pytest.approx(logged, abs=1e-4) and str(work / "data" / "mine") in out

    # the run folder and its data moved together: found beside the run, said in a line
    moved = tmp_path / "elsewhere" / "moved"
    moved.parent.mkdir()
    shutil.move(work, moved)
    r = run_cli("eval", str(moved / "runs" / "mine"), "--device", "cpu", cwd=tmp_path / "elsewhere")
    assert r.returncode == 0, r.stderr
    assert val_loss_of(r.stdout) == pytest.approx(logged, abs=1e-4)
    assert f"using {moved / 'data' / 'mine'}" in r.stderr and f"data.path {work / 'data' / 'mine'}" in r.stderr
    # resumed from yet another folder: trains on, on the moved data, and its config now names it
    code, _, err = run_main(["train", f"--log.run_dir={moved / 'runs' / 'mine'}", "--checkpoint.resume=auto",
                             "--train.steps=3"], capsys)
    assert code == 0, err
    assert f"using {moved / 'data' / 'mine'}" in err and "resumed from" in err
    assert read_metrics(moved / "runs" / "mine")[-1]["step"] == 3
    saved = json.loads((moved / "runs" / "mine" / "config.json").read_text())
    assert saved["data"]["path"] == str(moved / "data" / "mine")
    # generate: the run's tokenizer found
    step = moved / "runs" / "mine" / "checkpoints" / "step_00000002"
    code, out, err = run_main(["generate", str(step), "--prompt", "the ", "--max-new-tokens", "4",
                               "--device", "cpu"], capsys)
    assert code == 0 and out.startswith("the "), err

    # the data gone from both places: "not found", naming both, never "prepare"
    shutil.rmtree(moved / "data")
    code, out, err = run_main(["eval", str(step), "--device", "cpu"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"data.path {work / 'data' / 'mine'}" in err and "was not found" in err, err
    assert f"nor at {moved / 'data' / 'mine'}" in err and "--data FOLDER" in err, err
    assert "scaletrain prepare" not in err, err


def test_a_mix_is_found_by_each_folder_relative_to_the_checkpoint(tmp_path):
    """data.mix's folders, their weights kept, found again where they moved with the checkpoint."""
    from scaletrain.config import locate_data, relative_data

    for name in ("a", "b", "ckpt/step_1"):
        (tmp_path / "old" / name).mkdir(parents=True)
    config = {"data": {"path": "", "mix": f"{tmp_path / 'old' / 'a'}=70, {tmp_path / 'old' / 'b'}=30"}}
    recorded = relative_data(config["data"], tmp_path / "old" / "ckpt" / "step_1")
    assert recorded == {"mix": "../../a=70,../../b=30"}
    assert locate_data(config, recorded, tmp_path / "old" / "ckpt" / "step_1", what="x", fix="y") is config
    shutil.move(tmp_path / "old", tmp_path / "new")
    notes = []
    found = locate_data(config, recorded, tmp_path / "new" / "ckpt" / "step_1", what="x", fix="y",
                        report=notes.append)
    assert found["data"]["mix"] == f"{tmp_path / 'new' / 'a'}=70,{tmp_path / 'new' / 'b'}=30" and len(notes) == 1
    shutil.rmtree(tmp_path / "new" / "b")
    with pytest.raises(DataError, match="data.mix .* of x was not found, nor at .*; y"):
        locate_data(config, recorded, tmp_path / "new" / "ckpt" / "step_1", what="x", fix="y")


def test_a_data_folder_that_does_not_exist_says_not_found(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code, _, err = run_main(["train", *RUN_ARGS, "--data.path=nodata", "--log.run_dir=run"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"{tmp_path / 'nodata'}: no meta.json; the folder was not found" in err, err


# --------------------------------------------------------------------------------------------
# Point 4: the default run on the user's own data


def test_the_first_journey_trains_on_data_prepared_without_a_split(tmp_path, monkeypatch, capsys):
    """`prepare x --out d && train --data.path=d`, as the README's first steps: the demo's
    evaluation steps aside with one line; no validation loss is logged."""
    write_corpus(tmp_path / "x", docs=20)
    monkeypatch.chdir(tmp_path)
    code, _, err = run_main(["prepare", "x", "--out", "d", "--quiet"], capsys)
    assert code == 0, err
    r = run_cli("train", *RUN_ARGS, "--data.path=d", "--log.run_dir=run", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    notes = [line for line in r.stderr.splitlines() if "validation split" in line]
    assert notes == ["scaletrain: data.path d has no validation split, so the demo config's evaluation "
                     "(train.eval_every=50) steps aside; prepare the data with --val-fraction F for a validation loss"]
    rows = read_metrics(tmp_path / "run")
    assert rows[-1]["step"] == 2 and not any("val_loss" in row for row in rows)
    assert json.loads((tmp_path / "run" / "config.json").read_text())["train"]["eval_every"] == 0


def test_a_small_split_is_evaluated_on_the_batches_it_holds(tmp_path, monkeypatch, capsys):
    """The demo's train.eval_batches=4, a split of 2 batches: the run and `eval` use those 2, each
    with one line; an explicit --batches 4 is still refused."""
    monkeypatch.chdir(tmp_path)
    write_corpus(tmp_path / "x", docs=20)
    code, _, err = run_main(["prepare", "x", "--out", "d", "--val-fraction", "0.2", "--quiet"], capsys)
    assert code == 0, err
    val_tokens = json.loads((tmp_path / "d" / "meta.json").read_text())["num_val_tokens"]
    batch = (val_tokens - 1) // 32 // 2  # windows of 32 for 2 whole batches
    assert batch >= 1
    code, _, err = run_main(["train", *RUN_ARGS, "--data.path=d", "--log.run_dir=run",
                             f"--train.global_batch={batch}"], capsys)
    assert code == 0, err
    assert (f"holds 2 whole batch(es) of {batch} windows, fewer than the demo config's train.eval_batches=4: each "
            "evaluation uses those 2") in err, err
    logged = read_metrics(tmp_path / "run")[-1]["val_loss"]
    assert json.loads((tmp_path / "run" / "config.json").read_text())["train"]["eval_batches"] == 2
    # eval of that run on that data takes the run's 2; on the run's data with 4 asked of it: refused
    code, out, err = run_main(["eval", "run", "--device", "cpu"], capsys)
    assert code == 0 and val_loss_of(out) == pytest.approx(logged, abs=1e-4), err
    code, out, err = run_main(["eval", "run", "--device", "cpu", "--batches", "4"], capsys)
    assert code == 2 and "fewer than train.eval_batches=4" in err, err


def test_eval_takes_the_batches_a_small_split_holds(finished_run, tmp_path, monkeypatch, capsys):
    """A run with train.eval_batches=4 (the demo's) evaluated on other data whose split holds
    fewer: those, with one line, not an error."""
    monkeypatch.chdir(tmp_path)
    write_corpus(tmp_path / "x", docs=20, words=15)
    code, _, err = run_main(["prepare", "x", "--out", "d", "--val-fraction", "0.2", "--quiet"], capsys)
    assert code == 0, err
    held = (json.loads((tmp_path / "d" / "meta.json").read_text())["num_val_tokens"] - 1) // 32 // 8
    assert 1 <= held < 4
    code, out, err = run_main(["eval", str(finished_run), "--data", "d", "--device", "cpu", "--json"], capsys)
    assert code == 0, err
    assert json.loads(out)["batches"] == held
    assert f"fewer than the run's train.eval_batches=4: evaluating on those {held}" in err, err


# --------------------------------------------------------------------------------------------
# Point 16: a run folder's config.json missing or not an object


@pytest.mark.parametrize("broken", ["[1, 2, 3]", None], ids=["not-an-object", "missing"])
def test_a_broken_config_json_gives_way_to_the_checkpoints_config(finished_run, tmp_path, capsys, broken):
    run = copy_run(finished_run, tmp_path / "run")
    if broken is None:
        (run / "config.json").unlink()
        problem = "is missing"
    else:
        (run / "config.json").write_text(broken)
        problem = "is a JSON list, not an object of sections"
    code, _, err = run_main(["train", f"--log.run_dir={run}", "--checkpoint.resume=auto", "--train.steps=5"], capsys)
    assert code == 0, err
    newest = run / "checkpoints" / "step_00000004"
    assert f"{run / 'config.json'} {problem}: the run's config is the one its newest checkpoint holds, {newest}" \
        in err, err
    assert f"config: the run's own ({newest / 'trainer.json'})" in err and "resumed from" in err
    assert read_metrics(run)[-1]["step"] == 5
    assert json.loads((run / "config.json").read_text())["model"]["dim"] == 64  # written again, whole


def test_a_broken_config_json_without_a_checkpoint_names_the_file(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text("[1, 2, 3]")
    code, _, err = run_main(["train", f"--log.run_dir={run}", "--checkpoint.resume=auto"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"{run / 'config.json'}: a JSON list, not an object of sections, so not the run's config" in err, err
    assert "model" not in err


@pytest.mark.multiproc
def test_resuming_on_fewer_ranks_suggests_the_ranks_it_was_saved_by(tmp_path):
    """A 2-rank ZeRO-3 run resumed without --nproc: the layout does not fit one rank, and the line
    says to resume with --nproc 2 (it suggested parallel.zero=0, which changes the run's layout);
    nothing in the run folder changes. resume=auto without a run folder is refused (it started a
    new run every time)."""
    from conftest import folder_snapshot, run_here

    run = tmp_path / "run"
    r = run_here("train", *MICRO_ARGS, "--nproc", "2", "--parallel.zero=3", "--train.steps=2",
                 "--checkpoint.every=2", f"--log.run_dir={run}")
    assert r.returncode == 0, r.stderr
    before = folder_snapshot(run)
    again = run_here("train", f"--log.run_dir={run}", "--checkpoint.resume=auto", "--train.steps=4")
    lines = again.stderr.strip().splitlines()
    assert again.returncode == 2 and "Traceback" not in again.stderr, again.stderr
    assert len([line for line in lines if "error:" in line]) == 1, again.stderr
    assert "was saved by 2 ranks: resume it with --nproc 2 to keep its layout" in lines[-1], again.stderr
    assert folder_snapshot(run) == before
    auto = run_here("train", *MICRO_ARGS, "--checkpoint.resume=auto", "--train.steps=1")
    assert auto.returncode == 2 and "checkpoint.resume=auto resumes the run in log.run_dir, but none is given" \
        in auto.stderr, auto.stderr


def test_the_command_suggested_for_a_raw_file_works_as_printed(tmp_path):
    """`--data.path=corpus.jsonl` (a raw file, not prepared data): the line suggests a prepare
    command and a --data.path; both run as printed (the suggestion used to name the file itself
    as prepare's output, which prepare refuses: it is a file)."""
    import shlex

    from conftest import run_here

    raw = tmp_path / "corpus.jsonl"
    raw.write_text("".join(json.dumps({"text": f"document {i} " + "words " * 40}) + "\n" for i in range(30)))
    r = run_here("train", *MICRO_ARGS, f"--data.path={raw}", "--train.steps=1", f"--log.run_dir={tmp_path / 'r'}")
    assert r.returncode == 2 and "it is a raw text file" in r.stderr, r.stderr
    command = re.search(r"`scaletrain (prepare [^`]+)`", r.stderr).group(1)
    data = re.search(r"--data.path=(\S+)", r.stderr).group(1)
    prepared = run_here(*shlex.split(command), "--quiet")
    assert prepared.returncode == 0, prepared.stderr
    trained = run_here("train", *MICRO_ARGS, f"--data.path={data}", "--train.steps=1", "--train.eval_every=0",
                       f"--log.run_dir={tmp_path / 'r2'}")
    assert trained.returncode == 0, trained.stderr
    other = tmp_path / "weights.bin"
    other.write_bytes(b"\0" * 64)
    r = run_here("train", *MICRO_ARGS, f"--data.path={other}", "--train.steps=1", f"--log.run_dir={tmp_path / 'r3'}")
    assert r.returncode == 2 and "it is a file, not a folder of prepared data" in r.stderr, r.stderr
