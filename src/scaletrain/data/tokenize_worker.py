"""A tokenizer worker of `scaletrain prepare`: a process that runs `serve()`.

A fresh interpreter (never a fork: tokenizer threads and CUDA do not survive one, and spawn
would re-run the caller's script), fed over its stdin: first the Encoder, then chunks, then None;
for each chunk it writes one pickled ("ok", Encoded), ("error", lines) or ("crash", traceback)
to its stdout. It ends at None or when its stdin closes (the main process is gone).
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
import traceback


def serve() -> None:
    from scaletrain.errors import DataError

    out = os.fdopen(os.dup(1), "wb")  # results go to the real stdout; stray prints to stderr
    os.dup2(2, 1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's to handle
    inbox = sys.stdin.buffer
    try:
        encoder = pickle.load(inbox)
        while (chunk := pickle.load(inbox)) is not None:
            try:
                result = ("ok", encoder(chunk))
            except DataError as e:
                result = ("error", e.lines)
            except Exception:  # a bug: its traceback goes to the main process
                result = ("crash", traceback.format_exc())
            pickle.dump(result, out, protocol=pickle.HIGHEST_PROTOCOL)
            out.flush()
    except (EOFError, BrokenPipeError):
        pass  # the main process is gone or stopped us

