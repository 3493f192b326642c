"""Writing files so that a crash, a full disk or a signal never leaves half of one behind: the
new content goes to a temporary name beside the target and is renamed over it in one step
(rename is atomic within a folder); on failure the temporary file or folder is removed and the
old target, if any, is left as it was."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def replacing(target: str | Path, *, durable: bool = False, sweep: bool = False) -> Iterator[Path]:
    """A temporary path beside `target` to write (a file or a folder); when the block ends
    without an error it is renamed to `target`, otherwise removed. `durable`: also flush the
    folder's entry to disk (checkpoints), so the rename survives a power cut. A folder already at
    `target` (an overwrite the caller allowed) is swapped out whole and removed after the rename.
    `sweep`: first remove what a killed writer of `target` left beside it (`leftovers`)."""
    target = Path(target)
    if sweep:
        for dead in leftovers(target):
            _remove(dead)
    tmp = target.with_name(f".{target.name}.partial-{os.getpid()}")
    try:
        yield tmp
        if target.is_dir() and not target.is_symlink() and tmp.is_dir():
            old = target.with_name(f".{target.name}.replaced-{os.getpid()}")
            os.replace(target, old)
            try:
                os.replace(tmp, target)
            except BaseException:
                os.replace(old, target)
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, target)
    except BaseException:
        _remove(tmp)
        raise
    if durable:
        fsync_dir(target.parent)


def leftovers(target: str | Path) -> list[Path]:
    """The temporary names `replacing` gave `target` in processes that no longer run (a writer
    killed before it could remove them: SIGKILL, a power cut). A process's name carries its pid,
    so this holds for writers on this machine: the command-line writers (export, quantize), not
    the ranks of several nodes."""
    target = Path(target)
    found = []
    with contextlib.suppress(OSError):
        for p in target.parent.iterdir():
            head, _, pid = p.name.rpartition("-")
            if head in (f".{target.name}.partial", f".{target.name}.replaced") and pid.isdigit() \
                    and not _running(int(pid)):
                found.append(p)
    return sorted(found)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _remove(path: Path) -> None:
    with contextlib.suppress(OSError):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


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


def umask() -> int:
    """This process's umask (read without changing it where Linux tells it)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def usual_mode(path: str | Path) -> None:
    """Give `path` (a file, or every file under a folder) the mode open() would have given it,
    0666 less the umask: for files a library writes with a mode of its own (safetensors: 0600)."""
    path = Path(path)
    mode = 0o666 & ~umask()
    for f in ([path] if path.is_file() else [p for p in path.rglob("*") if p.is_file() and not p.is_symlink()]):
        os.chmod(f, mode)


def fsync_dir(path: str | Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
