"""A run folder belongs to one run at a time, and to one run ever.

* A lock: rank 0 holds an exclusive `flock` on the run folder (and on a separate checkpoint
  folder) while it trains, so a second run pointed at the same folder stops with one line
  instead of interleaving metrics and rotating away the first run's checkpoints. The kernel
  drops the lock when the process ends, however it ends, so a crash never leaves a stale lock.
* An identity: `run.json` holds the run's id, which every checkpoint also records; a
  checkpoint of another run is never resumed into this folder.

Locking costs one open file descriptor; nothing is written to take it.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import time
from pathlib import Path

RUN_FILE = "run.json"


class FolderLock:
    """An exclusive, non-blocking lock on a folder, held until `release()` or process exit."""

    def __init__(self, folder: Path):
        self.folder = folder
        self._fd: int | None = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            self.release()
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise FolderBusy(folder) from None
            raise

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the flock
            self._fd = None

    def __del__(self):
        self.release()


class FolderBusy(Exception):
    def __init__(self, folder: Path):
        super().__init__(str(folder))
        self.folder = folder


def holds_run(run_dir: Path, ckpt_dir: Path) -> list[str]:
    """What in these folders shows that a run already lives there (empty: nothing)."""
    found = [name for name in (RUN_FILE, "metrics.jsonl", "config.json") if (run_dir / name).exists()]
    if ckpt_dir.is_dir() and any(p.name.startswith("step_") for p in ckpt_dir.iterdir()):
        found.append(f"checkpoints in {ckpt_dir}")
    return found


def run_id_of(run_dir: Path) -> str | None:
    try:
        value = json.loads((run_dir / RUN_FILE).read_text()).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


def write_identity(run_dir: Path, run_id: str) -> None:
    """Record the run's id (once: a folder never changes hands)."""
    if run_id_of(run_dir) == run_id:
        return
    tmp = run_dir / f".{RUN_FILE}.tmp"
    try:
        tmp.write_text(json.dumps({"run_id": run_id, "created": time.strftime("%Y-%m-%dT%H:%M:%S")}) + "\n")
        os.replace(tmp, run_dir / RUN_FILE)
    except OSError:
        tmp.unlink(missing_ok=True)  # a full disk leaves nothing half-written behind
        raise
