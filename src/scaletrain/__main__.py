"""`python -m scaletrain` and `torchrun -m scaletrain train ...`."""

import sys

from scaletrain.interrupt import EarlySignals

guard = EarlySignals.install()  # first: a stop signal from here on is one line and its exit code

from scaletrain.cli import main  # noqa: E402 - after the signals' handler, as everything slow

sys.exit(main(guard=guard))
