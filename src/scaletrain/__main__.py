"""`python -m scaletrain` (and the `scaletrain` command) and `torchrun -m scaletrain train ...`."""

import signal
import sys

from scaletrain.interrupt import EarlySignals


def run() -> int:
    """The CLI, with SIGINT and SIGTERM handled before anything slow is imported."""
    guard = EarlySignals.install()  # first: a stop signal from here on is one line and its exit code
    from scaletrain.cli import main

    code = main(guard=guard)
    for sig in (signal.SIGINT, signal.SIGTERM):  # the command's result stands: later signals are absorbed
        signal.signal(sig, signal.SIG_IGN)
    return code


if __name__ == "__main__":
    sys.exit(run())
