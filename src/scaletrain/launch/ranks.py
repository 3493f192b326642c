"""The plumbing of the runs scaletrain starts for itself: measuring a layout, verifying one,
benchmarking, calibrating the planner.

* `QUIET` / `quiet(run_dir)`: the settings of a run nobody reads. It writes nothing a user would
  look for (no TensorBoard, no checkpoint, no sample, no progress bar), never resumes from one,
  keeps its files in a folder of its own, and logs every step (for a caller that reads its
  metrics). A caller that needs another value overrides that one key.
* `run_on_ranks(task, spec, nproc)`: run a worker task (scaletrain.launch.worker) on `nproc` local
  ranks and read its result. The user's process writes SPEC, a JSON file of the task's
  settings, starts `python -m scaletrain.launch.worker TASK SPEC OUT` on every rank, and reads OUT,
  the JSON file the task's rank 0 wrote. `read_spec` and `write_result` are the ranks' half.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# a run nobody reads: no files a user would look for, no resuming, every step in its metrics
QUIET = {"log.every": 1, "log.tensorboard": False, "log.progress": "off", "log.summary": False,
         "train.sample_tokens": 0, "train.eval_every": 0, "checkpoint.dir": "", "checkpoint.every": 0,
         "checkpoint.save_final": False, "checkpoint.resume": "none"}


def quiet(run_dir: str | Path) -> dict:
    """`QUIET`, in the folder `run_dir` (its checkpoints, if any, under it)."""
    return {**QUIET, "log.run_dir": str(run_dir)}


def flags(overrides: dict) -> list[str]:
    """`{"section.key": value}` as command-line overrides (`--section.key=value`)."""
    return [f"--{k}={v}" for k, v in overrides.items()]


class RanksFailed(SystemExit):
    """A task's ranks ended with a non-zero exit code (`.code`); the launcher has already said
    why in one line. Uncaught, it ends the program with that code."""


def run_on_ranks(task: str, spec: dict, nproc: int, *, folder: str | Path | None = None,
                 pythonpath: Sequence[str] = ()) -> Any:
    """Run `task` of scaletrain.launch.worker on `nproc` local ranks with `spec` and return what its
    rank 0 wrote with `write_result` (None if it wrote nothing). Raises RanksFailed with the
    ranks' exit code if they fail.

    SPEC and OUT go to `folder` (then left there), or to a temporary folder removed afterwards;
    `pythonpath`: folders the ranks import from too (a task MODULE:FUNCTION outside scaletrain)."""
    from scaletrain.launch.launcher import launch

    own = folder is None
    where = Path(tempfile.mkdtemp(prefix=f"scaletrain-{task.replace(':', '-')}-")) if own else Path(folder)
    try:
        name = task.rpartition(":")[2]  # MODULE:FUNCTION's function
        spec_path, out_path = where / f"{name}-spec.json", where / f"{name}-result.json"
        out_path.unlink(missing_ok=True)  # a result is this run's or none
        spec_path.write_text(json.dumps(spec))
        code = launch(task, [str(spec_path), str(out_path)], nproc=nproc, pythonpath=tuple(pythonpath))
        if code:
            raise RanksFailed(code)
        return json.loads(out_path.read_text()) if out_path.exists() else None
    finally:
        if own:
            shutil.rmtree(where, ignore_errors=True)


def read_spec(path: str) -> dict:
    """On a rank: the settings `run_on_ranks` wrote for its task."""
    return json.loads(Path(path).read_text())


def write_result(path: str, result: Any) -> None:
    """On the rank that answers (rank 0): the task's result, for `run_on_ranks` to return; whole
    or not at all."""
    from scaletrain.atomic import write_json

    write_json(path, result, indent=None)
