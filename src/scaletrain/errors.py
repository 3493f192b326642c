"""User-facing errors.

Anything the user can fix (a config value, a data file, a checkpoint folder) raises a
subclass of `UserError`. The CLI prints each of its lines as one line and exits with code 2;
no traceback. `assert` stays for our own invariants. An `OSError` on a path the user chose
(read-only, full, missing) becomes one too, through `user_error_from_os`.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
import tempfile


class UserError(Exception):
    """An error in the user's input. `lines` holds one message per problem found."""

    exit_code = 2

    def __init__(self, *lines: str):
        if not lines:
            raise TypeError("UserError needs at least one message")
        # one problem, one line, even when it quotes user text holding line breaks
        self.lines = [line.replace("\r", "\\r").replace("\n", "\\n") for line in lines]
        super().__init__("\n".join(self.lines))


class ConfigError(UserError):
    """A bad config key, value or combination of values."""


class DataError(UserError):
    """A missing, truncated or inconsistent data file."""


class CheckpointError(UserError):
    """A checkpoint folder that cannot be used."""


class LaunchError(UserError):
    """A launch request that cannot be run as asked (ranks, devices, backend)."""


class TrainingStopped(UserError):
    """Training cannot go on: the numbers diverged, or a rank stopped answering. Reported like
    a user error (one line, no traceback) with its own exit code."""

    exit_code = 3
    # whether a restart may cure it (a quorum of replica groups that did not form: the others may be back);
    # a diverged run's would only repeat it
    restartable = False


class QuorumNotFormed(TrainingStopped):
    """A replica group gave up waiting for enough groups to form its quorum: restartable (--max-restarts),
    as the missing groups may be back by then."""

    restartable = True


# --------------------------------------------------------------------------------------------
# OS errors the user can fix: one line naming the path, the reason and the fix

_WRITE_FIX = "choose {another} on a writable disk"
_SPACE_FIX = "free some space or choose {another} on another disk"
_OS_REASONS = {  # errno -> (reason, fix); {another} becomes "another log.run_dir" or "another path"
    errno.EACCES: ("permission denied", "fix its permissions or choose {another} you may use"),
    errno.EPERM: ("operation not permitted", "fix its permissions or choose {another} you may use"),
    errno.EROFS: ("the file system is read-only", _WRITE_FIX),
    errno.ENOSPC: ("the disk is full (no space left on device)", _SPACE_FIX),
    errno.EDQUOT: ("the disk quota is exceeded", _SPACE_FIX),
    errno.ENOENT: ("no such file or folder", "check the path; the folder it goes in must exist"),
    errno.EEXIST: ("it already exists", "choose {another} or move it away (nothing was overwritten)"),
    errno.ENOTDIR: ("a part of the path is a file, not a folder", "fix the path"),
    errno.EISDIR: ("it is a folder where a file was expected", "give a file name"),
    errno.ENAMETOOLONG: ("the path is too long for the file system", "use a shorter one"),
}
# about the disk rather than one file: still the user's to fix when no file name came with it
_STORAGE = (errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.ENAMETOOLONG)


OUTPUT_OPTIONS = ("log.run_dir", "checkpoint.dir", "--out")  # what a write without a file name went to


@contextlib.contextmanager
def os_errors_named(paths: dict[str, object]):
    """Turn an OS error on a user's path into one line that names the option it came from
    (`paths`: option -> path; see `config_paths` for a config's)."""
    try:
        yield
    except OSError as e:
        error = user_error_from_os(e, paths, outputs=OUTPUT_OPTIONS)
        if error is None:
            raise
        raise error from None


def config_paths(cfg) -> dict[str, str]:
    """A JobConfig's paths by option, to name the option in an OS error on one of them."""
    resume = cfg.checkpoint.resume if cfg.checkpoint.resume not in ("none", "auto") else ""
    return {"log.run_dir": cfg.log.run_dir, "checkpoint.dir": cfg.checkpoint.dir, "data.path": cfg.data.path,
            "checkpoint.resume": resume}


def user_error_from_os(e: OSError, paths: dict[str, object] | None = None,
                       outputs: tuple[str, ...] | None = None) -> UserError | None:
    """The one-line `UserError` for an OS error on a path the user chose (a read-only or full
    disk, a missing folder, no permission, ...), or None for one that is ours to fix (a file of
    the installation, an error that names no path). `paths` maps the option each user path came
    from (`log.run_dir`, `--out`) to its value; the option whose path the error concerns is named.
    An error without a file name (a write to an open file) names the `outputs` among them."""
    if e.errno not in _OS_REASONS:
        return None
    name = os.fsdecode(e.filename) if e.filename not in (None, "", b"") else None
    if name is None and e.errno not in _STORAGE:
        return None
    if name is not None and e.errno in (errno.ENOENT, errno.EACCES, errno.EPERM) and _installed(name):
        return None  # a file of Python, torch or scaletrain itself: a bug or a broken installation
    paths = {k: os.fspath(v) for k, v in (paths or {}).items() if v not in (None, "")}
    if name is None and outputs is not None:
        paths = {k: v for k, v in paths.items() if k in outputs}
    option = _option_of(name, paths) if name is not None else (next(iter(paths)) if len(paths) == 1 else None)
    reason, fix = _OS_REASONS[e.errno]
    fix = fix.format(another=f"another {option}" if option else "another path")
    if name is not None and _inside(name, tempfile.gettempdir()) and not option:
        fix += " (temporary files go to TMPDIR: point it at another folder)"
    if name is None:  # e.g. a write to an open file: name the paths it could have been
        where = "; ".join(f"{k} {v}" for k, v in paths.items()) or "writing a file"
        return UserError(f"{where}: {reason}; {fix}")
    shown = name if len(name) <= 120 else f"{name[:60]}...{name[-20:]}"
    return UserError(f"{option + ': ' if option else ''}{shown}: {reason}; {fix}")


def _installed(name: str) -> bool:
    roots = {sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(os.path.abspath(__file__))}
    return any(_inside(name, root) for root in roots)


def _inside(name: str, root: str) -> bool:
    try:
        return os.path.commonpath([os.path.abspath(name), os.path.abspath(root)]) == os.path.abspath(root)
    except ValueError:
        return False


def _option_of(name: str, paths: dict[str, str]) -> str | None:
    """The option whose path `name` is, lies in, or lies on the way to (a missing parent)."""
    best, depth = None, -1
    for option, value in paths.items():
        if _inside(name, value) or _inside(value, name):
            d = len(os.path.abspath(value))
            if d > depth:
                best, depth = option, d
    return best
