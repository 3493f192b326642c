"""`scaletrain train --rank-hook threads_probe:report` (tests/launch/test_threads.py): what the
training process runs with, on stderr. Imports nothing of the tests (their conftest sets threads)."""

import os
import sys


def report(trainer):
    import torch

    print(f"probe: threads {torch.get_num_threads()} wait {os.environ.get('OMP_WAIT_POLICY')}", file=sys.stderr)
