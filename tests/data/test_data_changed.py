"""Data changed under a running job (issue 37, point 13): a shard cut short while a run reads it
stops the run with one line naming the shard (exit 2, never SIGBUS), after an emergency
checkpoint of the steps it finished. The runs are real processes; the test truncates the file
on disk while they train."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from scaletrain.data.dataset import TokenData
from scaletrain.data.prepare import prepare
from scaletrain.errors import DataError

from conftest import MICRO, REPO

TEXTS = {"web": "The quick brown fox jumps over the lazy dog. ", "code": "def f(x):\n    return x * 2 + 1\n"}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("changed")
    for name, text in TEXTS.items():
        src = root / f"{name}.jsonl"
        src.write_text("".join(json.dumps({"text": f"{k} {text * (3 + k % 5)}"}) + "\n" for k in range(200)))
        prepare([src], root / name, workers=1)
    return root


def test_a_read_past_a_cut_short_shard_is_a_data_error_naming_it(folders, tmp_path):
    import shutil

    folder = tmp_path / "web"
    shutil.copytree(folders / "web", folder)
    data = TokenData.open(folder)
    first = data.read(0, 100)
    shard = folder / "shard_00000.bin"
    with shard.open("r+b") as f:
        f.truncate(150)  # 75 tokens of uint16 left
    assert np.array_equal(data.read(0, 75), first[:75])  # what is still there reads as before
    with pytest.raises(DataError, match=rf"{re.escape(str(shard))}: the shard is now 150 bytes, "
                                        rf"{data.num_tokens * 2} when it was opened"):
        data.read(50, 100)


def wait_for(predicate, what: str, proc, timeout: float = 60.0) -> None:
    deadline = time.time() + timeout
    while not predicate():
        assert proc.poll() is None, f"the run ended before {what}: {proc.communicate()}"
        assert time.time() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.05)


def last_step(metrics: Path) -> int:
    try:
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.endswith("}")]
    except (OSError, ValueError):
        return 0
    return max((r.get("step", 0) for r in rows), default=0)


@pytest.mark.parametrize("case", ["mix", "folder-with-loader-worker"])
def test_a_shard_cut_short_mid_run_stops_in_one_line_after_saving(folders, tmp_path, case):
    run = tmp_path / "run"
    values = {**MICRO, "train.steps": 100000, "train.eval_every": 0, "checkpoint.every": 4, "log.run_dir": str(run)}
    if case == "mix":
        values["data.mix"] = f"{folders / 'web'}=50,{folders / 'code'}=50"
    else:
        values.update({"data.path": str(folders / "code"), "data.num_workers": 1})
    args = [f"--{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in values.items()]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO / "src")}
    proc = subprocess.Popen([sys.executable, "-m", "scaletrain", "train", *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: last_step(run / "metrics.jsonl") >= 6, "step 6", proc)
        shard = folders / "code" / "shard_00000.bin"
        kept = shard.read_bytes()
        try:
            os.truncate(shard, 0)  # what a copy over the file, or a prepare into it, does first
            out, err = proc.communicate(timeout=60)
        finally:
            shard.write_bytes(kept)  # the other case reads it whole
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 2, (proc.returncode, err[-2000:])  # never -7 (SIGBUS)
    assert "Traceback" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("scaletrain: error:")]
    assert len(errors) == 1 and errors[0] == err.strip().splitlines()[-1], err
    line = errors[0]
    found = re.fullmatch(rf"scaletrain: error: step (\d+): {re.escape(str(shard))}: the shard is now 0 bytes, "
                         rf"{len(kept)} when it was opened: .* cut short .*; checkpoint (\S+) was saved first, "
                         r"resume from it once the data is restored", line)
    assert found, line
    step, saved = int(found.group(1)), Path(found.group(2))
    assert step > 6 and saved == run / "checkpoints" / f"step_{step - 1:08d}"  # the steps it finished
    assert (saved / "trainer_state.json").is_file() or any(saved.iterdir())
