"""SIGINT and SIGTERM from a command's first line until the trainer handles them itself.

`EarlySignals.install()` is the first thing `python -m scaletrain`, the `scaletrain` command and a
rank's worker do (this module imports nothing slow). From then on a stop signal raises
KeyboardInterrupt (SIGINT) or `Terminated` (SIGTERM) where the program stands, which the command
turns into its exit code and one line, except inside an import: an exception there leaves modules
half-initialised (numpy's C core cannot be loaded a second time; a module missing its names is
found again by the next import), and some libraries turn it into an ImportError they swallow. A
signal that lands in an import is kept and raised as soon as the import is over; an import still
running IMPORT_GRACE_S later (a stalled file system) ends the program there, without unwinding,
through `on_stuck`. `received` keeps the first signal either way, so a stop that some library
swallowed is still seen by the next `check()`, or by the trainer, which then stops after its first
step, saved (a replica group, which waits for its first quorum before that step, stops there instead:
`StopWaiting`, with nothing of its own to save).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_RETRY_S = 0.02  # how often a signal kept during an import is tried again
IMPORT_GRACE_S = 3.0  # how long a signal waits for the import it landed in (torch's takes 1-5 s)


class Terminated(BaseException):
    """SIGTERM before the trainer handles it: the SIGTERM counterpart of KeyboardInterrupt."""


class StopWaiting(Exception):
    """A stop signal came while a training run waited for other processes before a step (replica groups'
    quorum: up to fault_tolerance.quorum_timeout_s): raised where it waited, the run stops before that
    step and saves the steps it took, as at a step's end (train.health.StopSignals.interruptible)."""


def stop_exception(signum: int) -> BaseException:
    return KeyboardInterrupt() if signum == signal.SIGINT else Terminated()


def _importing(frame) -> bool:
    """Whether the interrupted code runs inside an import (importlib's frames are below it)."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


class EarlySignals:
    """The stop signals' handler of a command before its trainer installs its own (see above)."""

    def __init__(self):
        self.received: int | None = None
        self.raised = False  # the stop is on its way: later signals are absorbed while it is reported
        self._since = 0.0
        # the exit code of a stop by this signal, its line said, where no exception can carry it
        # (an import that outlasts IMPORT_GRACE_S); None: wait for the import however long it takes
        self.on_stuck: Callable[[int], int] | None = None

    @classmethod
    def install(cls) -> EarlySignals | None:
        """Handle SIGINT and SIGTERM from now on; None off the main thread, where Python has no
        say over signals (the caller's handlers stay)."""
        if threading.current_thread() is not threading.main_thread():
            return None
        guard = cls()
        for sig in STOP_SIGNALS:
            if signal.getsignal(sig) is not signal.SIG_IGN:  # nohup's ignored SIGINT stays ignored
                signal.signal(sig, guard.handler)
        return guard

    @classmethod
    def current(cls) -> EarlySignals | None:
        """The guard installed in this process, if SIGINT's handler is one."""
        owner = getattr(signal.getsignal(signal.SIGINT), "__self__", None)
        return owner if isinstance(owner, cls) else None

    def handler(self, signum, frame) -> None:
        if self.received is None:
            self.received, self._since = signum, time.monotonic()
        if self.raised:
            return
        if _importing(frame):
            if self.on_stuck is not None and time.monotonic() - self._since >= IMPORT_GRACE_S:
                self._leave_now()
            self._retry_later(signum)
            return
        self.raised = True
        raise stop_exception(self.received)

    def _retry_later(self, signum: int) -> None:
        """Deliver `signum` to the main thread again shortly, while this guard still handles it:
        the import it interrupted is over by then, or it is kept again."""
        main = threading.main_thread().ident

        def again():
            with contextlib.suppress(Exception):  # the program ended meanwhile
                if signal.getsignal(signum) == self.handler:
                    signal.pthread_kill(main, signum)

        timer = threading.Timer(_RETRY_S, again)
        timer.daemon = True
        timer.start()

    def _leave_now(self) -> None:
        """End the program in the middle of its import: nothing has been saved or is being written
        yet that unwinding would finish (imports come before the work)."""
        code = self.on_stuck(self.received)
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)

    def absorb(self) -> None:
        """From now on a stop signal is only remembered: the program is already on its way out
        (a failure being recorded, which a SIGTERM from the launcher stopping the other ranks
        must not interrupt with a traceback of its own)."""
        self.raised = True

    def check(self) -> None:
        """Raise the stop of a signal received so far (one kept during an import, or one that
        some code swallowed)."""
        if self.received is not None:
            raise stop_exception(self.received)


def die_with_parent(parent_pid: int | None) -> None:
    """Have Linux send this process SIGTERM when its parent dies, even by SIGKILL (the parent-death
    signal, PR_SET_PDEATHSIG; kept across exec). `parent_pid`: the parent it should have; if it has
    died already (this process was re-parented before the call), SIGTERM now. SIGTERM, not SIGKILL: a
    training process finishes its step and saves a checkpoint first. Does nothing off Linux."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if parent_pid and os.getppid() != parent_pid:  # it died before the call above: no signal will come
        os.kill(os.getpid(), signal.SIGTERM)
