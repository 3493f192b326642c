"""User-facing errors.

Anything the user can fix (a config value, a data file, a checkpoint folder) raises a
subclass of `UserError`. The CLI prints each of its lines as one line and exits with code 2;
no traceback. `assert` stays for our own invariants.
"""

from __future__ import annotations


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
