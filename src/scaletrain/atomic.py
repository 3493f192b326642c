"""Writing files so that a crash, a full disk or a signal never leaves half of one behind: the
new content goes to a temporary name beside the target and is renamed over it in one step
(rename is atomic within a folder); on failure the temporary file or folder is removed and the
old target, if any, is left as it was."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Iterator


@contextlib.contextmanager
def replacing(target: str | Path, *, durable: bool = False) -> Iterator[Path]:
    """A temporary path beside `target` to write (a file or a folder); when the block ends
    without an error it is renamed to `target`, otherwise removed. `durable`: also flush the
    folder's entry to disk (checkpoints), so the rename survives a power cut."""
    target = Path(target)
    tmp = target.with_name(f".{target.name}.partial-{os.getpid()}")
    try:
        yield tmp
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            if tmp.is_dir() and not tmp.is_symlink():
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(target.parent)


def write_text(target: str | Path, text: str, *, durable: bool = False) -> None:
    """Replace `target`'s content with `text`, all at once."""
    with replacing(target, durable=durable) as tmp:
        with tmp.open("w") as f:
            f.write(text)
            if durable:
                f.flush()
                os.fsync(f.fileno())


def write_json(target: str | Path, data: Any, *, indent: int | None = 1, sort_keys: bool = False,
               durable: bool = False) -> None:
    write_text(target, json.dumps(data, indent=indent, sort_keys=sort_keys) + "\n", durable=durable)


def fsync_dir(path: str | Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
