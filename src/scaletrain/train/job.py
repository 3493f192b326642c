"""A rank of `scaletrain train` on several processes: the `train` task of scaletrain.worker.

`scaletrain train --nproc N` settles the job where it starts, once: `parallel.layout = auto`
chosen, the layout derived and checked, the run folder named. It writes the config as it will
run and its layout to a JSON file (`spec`), whose path is the task's argument; every rank
reads that file (`train_rank`), so no rank parses the command line or reads the TOML again.
Under torchrun each rank runs the CLI, which hands `train` the config it loaded (rank 0
resolves `auto` for all of them in `runtime.prepare_worker`).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

from scaletrain.config import JobConfig, from_dict
from scaletrain.errors import config_paths, os_errors_named
from scaletrain.layout import Layout


def spec(cfg: JobConfig, layout: Layout) -> dict:
    """What every rank of a job is given: the config as it will run and its layout."""
    return {"config": cfg.to_dict(), "layout": layout.to_dict()}


def train_rank(spec_path: str) -> int:
    """One rank of `scaletrain train --nproc N` (the `train` task of scaletrain.worker, which
    reports its failures): SPEC_PATH is the JSON file of `spec`."""
    job = json.loads(Path(spec_path).read_text())
    return train(from_dict(job["config"]), Layout(**job["layout"]))


def train(cfg: JobConfig, layout: Layout | None = None) -> int:
    """Train `cfg` as one rank of a group (`layout`: cfg's, derived where the job started; None
    under torchrun, where the rank derives it, or rank 0 chooses it for `auto`). Returns the
    rank's exit code. A rank the launcher restarted after a failure resumes from the newest
    checkpoint."""
    from scaletrain import runtime
    from scaletrain.train.trainer import Trainer

    rank = int(os.environ.get("RANK", "0"))
    restarts = runtime.restart_count()
    if restarts > 0 and cfg.checkpoint.resume == "none":
        # the launcher restarted the group after a failure: continue from the newest checkpoint
        cfg = cfg.replace(**{"checkpoint.resume": "auto"})
    if restarts > 0 and rank == 0:
        print(f"scaletrain: restart {restarts} of at most {os.environ.get('TORCHELASTIC_MAX_RESTARTS', '?')}: "
              "a rank failed; the group resumes from its newest complete checkpoint", file=sys.stderr, flush=True)
    with os_errors_named(config_paths(cfg)):
        cfg, rt = runtime.prepare_worker(cfg, layout)
        return exit_code(Trainer(cfg, rt, restart=restarts > 0).fit())


def exit_code(result: dict) -> int:
    """The exit code of a finished `Trainer.fit()`: 0, or 128 + the signal that stopped it."""
    if result["stopped_by"] is None:
        return 0
    # stopped by a signal and saved: this process is on its way out; later signals (a second
    # Ctrl-C) must not turn exit 128+N into a death by signal. SIG_IGN, unlike a Python handler,
    # outlives the interpreter's own shutdown.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    return 128 + int(result["stopped_by"])
