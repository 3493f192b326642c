"""The lines this process writes, each prefixed with the part of a job it belongs to.

`scaletrain ft-local` runs its replica groups side by side on one terminal: it gives each group's
launcher `SCALETRAIN_LINE_PREFIX="[group R] "`, which the group's ranks inherit, and each of those
processes prefixes every line it writes to stdout and stderr (`prefix_lines`, at its start). Each
process writes its own lines, whole: nothing between a group and the terminal (a pipe, a reader) can
stop a group that is saving when ft-local dies.
"""

from __future__ import annotations

import io
import os
import sys

PREFIX_ENV = "SCALETRAIN_LINE_PREFIX"


class PrefixedLines(io.TextIOBase):
    """A text stream that writes `prefix` at the start of every line (after a newline or a carriage
    return: a progress bar's redrawn line keeps it) into `stream`."""

    def __init__(self, stream, prefix: str):
        self.stream, self.prefix, self.at_start = stream, prefix, True

    def write(self, text: str) -> int:
        out = []
        for ch in text:
            if self.at_start and ch not in "\n\r":
                out.append(self.prefix)
                self.at_start = False
            out.append(ch)
            if ch in "\n\r":
                self.at_start = True
        self.stream.write("".join(out))
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def fileno(self) -> int:
        return self.stream.fileno()

    def isatty(self) -> bool:
        return self.stream.isatty()

    @property
    def encoding(self) -> str:
        return getattr(self.stream, "encoding", "utf-8")

    def writable(self) -> bool:
        return True


def prefix_lines(environ=os.environ) -> None:
    """This process's stdout and stderr prefixed as its job asks (SCALETRAIN_LINE_PREFIX), once."""
    prefix = environ.get(PREFIX_ENV)
    if not prefix:
        return
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if not isinstance(stream, PrefixedLines):
            setattr(sys, name, PrefixedLines(stream, prefix))
