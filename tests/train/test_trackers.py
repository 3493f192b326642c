"""Weights & Biases and MLflow beside metrics.jsonl, with the real client libraries in their
offline / local modes: the written run is read back and holds the metrics and the config; a
resumed run continues the same tracker run; a tracker that fails never stops training."""

from __future__ import annotations

import json
import struct

import pytest

from scaletrain.train import trackers
from scaletrain.train.trainer import Trainer

from conftest import micro_cfg, read_metrics, run_here, run_until

BASE = {"train.steps": 6, "checkpoint.every": 3, "log.run_name": "tiny-ddp", "log.tags": "ddp,owner=me"}


def numbers(row: dict) -> dict:
    return {k: v for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


# W&B's offline run file: LevelDB's log format (32 KiB blocks of records, each a 7-byte header:
# crc32, length, type) after a 7-byte file header, holding wandb's protobuf Records


def wandb_records(path) -> list:
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, records, pending = 7, [], b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        body = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            continue
        pending += body
        if kind in (1, 4):  # FULL, LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def finished_records(folder, timeout: float = 120.0) -> list:
    """The records of one offline run folder once its run's exit record is written. run.finish()
    returns before W&B's service has flushed the file (seen under load: a resumed run's file still
    its 7-byte header), so wait for the last record rather than for a time."""
    import time

    from google.protobuf.message import DecodeError

    deadline = time.monotonic() + timeout
    while True:
        files = list(folder.glob("run-*.wandb"))
        try:  # none yet, its header not yet written, or a record half written: not finished
            records = wandb_records(files[0]) if files and files[0].stat().st_size >= 7 else []
        except DecodeError:
            records = []
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            return records
        assert time.monotonic() < deadline, f"{folder}: no exit record {timeout:.0f} s after the run finished"
        time.sleep(0.1)


def wandb_run(folder):
    """(run id, tags, config, history rows) of one offline run folder."""
    run_id, tags, config, history = None, [], {}, []
    for r in finished_records(folder):
        kind = r.WhichOneof("record_type")
        if kind == "run":
            run_id, tags = r.run.run_id, list(r.run.tags)
            config.update({i.key: json.loads(i.value_json) for i in r.run.config.update})
        elif kind == "config":
            config.update({i.key: json.loads(i.value_json) for i in r.config.update})
        elif kind == "history":
            items = {(i.key or ".".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item}
            history.append({k: v for k, v in items.items() if not k.startswith("_")})
    return run_id or folder.name.rsplit("-", 1)[-1], tags, config, history


def test_wandb_offline_run_holds_the_metrics_config_and_continues_on_resume(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="the wandb extra (pip install 'scaletrain[wandb]') is missing")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = micro_cfg(tmp_path, **{**BASE, "log.wandb": "scaletrain-test", "checkpoint.resume": "auto"})
    run_until(cfg, 3)
    Trainer(cfg).fit()  # resumed at step 3
    run_dir = tmp_path / "run"
    rows = read_metrics(run_dir)
    folders = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len(folders) == 2  # the first run and its resume
    first, resumed = wandb_run(folders[0]), wandb_run(folders[1])
    run_id = json.loads((run_dir / "run.json").read_text())["run_id"]
    assert first[0] == resumed[0] == run_id  # one W&B run, continued
    assert first[1] == ["ddp", "owner=me"]
    config = {k: v.get("value", v) if isinstance(v, dict) else v for k, v in first[2].items()}
    assert config["train"]["steps"] == 6 and config["log"]["wandb"] == "scaletrain-test"
    logged = first[3] + resumed[3]
    assert [h["step"] for h in logged] == [1, 2, 3, 4, 5, 6]
    for h, row in zip(logged, rows):
        assert h == pytest.approx(numbers(row))  # the same metrics as metrics.jsonl


def test_mlflow_local_run_holds_the_metrics_config_and_continues_on_resume(tmp_path):
    pytest.importorskip("mlflow", reason="the mlflow extra (pip install 'scaletrain[mlflow]') is missing")
    pytest.importorskip("sqlalchemy", reason="the mlflow extra's local database (sqlalchemy) is missing")
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = micro_cfg(tmp_path, **{**BASE, "log.mlflow": "scaletrain-test", "log.mlflow_uri": uri,
                                 "checkpoint.resume": "auto", "train.eval_every": 3, "train.eval_batches": 1})
    run_until(cfg, 3)
    Trainer(cfg.replace(**{"train.steps": 6})).fit()  # resumed at step 3
    rows = read_metrics(tmp_path / "run")
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("scaletrain-test")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1  # one MLflow run, continued
    run = runs[0]
    assert run.info.run_name == "tiny-ddp" and run.info.status == "FINISHED"
    assert run.data.tags["ddp"] == "true" and run.data.tags["owner"] == "me"
    assert run.data.params["train.steps"] == "6" and run.data.params["log.mlflow"] == "scaletrain-test"
    for key in ("loss", "lr", "tokens_per_s", "val_loss"):
        history = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))
        want = [(r["step"], r[key]) for r in rows if key in r]
        assert [s for s, _ in history] == [s for s, _ in want], key
        assert [v for _, v in history] == pytest.approx([v for _, v in want]), key
    assert set(run.data.metrics) == set(numbers(rows[-1])) - {"step"}


def test_a_tracker_without_its_package_is_one_line_exit_2(tmp_path, monkeypatch):
    monkeypatch.setitem(trackers.PACKAGES, "wandb", ("no_such_module_here", "wandb"))
    r = run_here("train", "--log.wandb=proj", "--train.steps=1", f"--log.run_dir={tmp_path / 'run'}")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [
        "scaletrain: error: log.wandb='proj' needs the no_such_module_here package, which is not installed: pip "
        "install 'scaletrain[wandb]' (or set log.wandb to \"\" to train without it)"]
    assert not (tmp_path / "run").exists()  # nothing written


def test_a_failing_tracker_is_one_line_and_never_stops_training(tmp_path, monkeypatch):
    pytest.importorskip("mlflow", reason="the mlflow extra is missing")
    import io

    stream = io.StringIO()
    cfg = micro_cfg(tmp_path, **{"log.mlflow": "x", "log.mlflow_uri": "nosuchscheme://server", "train.steps": 3})
    result = Trainer(cfg, stream=stream).fit()
    assert result["step"] == 3 and len(read_metrics(tmp_path / "run")) == 3
    notes = [line for line in stream.getvalue().splitlines() if line.startswith("log.mlflow")]
    assert len(notes) == 1 and "the tracker could not start" in notes[0] and "without it" in notes[0]

    # and one that fails mid-run is dropped with one line
    class Broken:
        where = "nowhere"

        def __init__(self, *args):
            self.calls = 0

        def log(self, row):
            if row["step"] == 2:
                raise ConnectionError("the network went away")

        def close(self):
            pass

    monkeypatch.setattr(trackers, "_MLflow", Broken)
    stream = io.StringIO()
    cfg = micro_cfg(tmp_path / "b", **{"log.mlflow": "x", "train.steps": 4})
    assert Trainer(cfg, stream=stream).fit()["step"] == 4
    notes = [line for line in stream.getvalue().splitlines() if line.startswith("log.mlflow")]
    assert notes == ["log.mlflow: logging to nowhere",
                     "log.mlflow: the tracker failed at step 2 (ConnectionError: the network went away); the run "
                     "goes on without it"]


def test_mlflow_without_a_uri_writes_in_the_run_folder_and_reasons_are_whole(tmp_path, monkeypatch):
    """log.mlflow_uri empty (and no MLFLOW_TRACKING_URI): the store is the run folder's
    mlflow.db, not a file in the working folder; a tracker's failure reason is its first line
    whole, or cut at a sentence's end (it was cut mid-sentence at 200 characters)."""
    pytest.importorskip("mlflow", reason="the mlflow extra is missing")
    pytest.importorskip("sqlalchemy", reason="the mlflow extra's local database (sqlalchemy) is missing")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg = micro_cfg(tmp_path, **{**BASE, "log.mlflow": "here", "train.steps": 2})
    Trainer(cfg).fit()
    assert (tmp_path / "run" / "mlflow.db").is_file()
    assert list(work.iterdir()) == []  # nothing in the working folder
    long = ("The server refused the request because the experiment name is taken. " * 6).strip()
    reason = trackers._reason(ConnectionError(long))
    assert reason.startswith("ConnectionError: The server refused") and reason.endswith("is taken."), reason
    assert len(reason) < 320
    words = trackers._reason(ValueError("x" * 50 + " " + "word " * 100))
    assert words.endswith(" …") and not words.endswith("wor …")
