"""The one program every rank runs.

    python -m scaletrain.launch.worker TASK [ARG ...]

scaletrain's launcher (`scaletrain.launch.launcher.launch`) starts it on each rank, and
`torchrun -m scaletrain train ...` reaches it through the CLI (`run`, with the config each rank
loaded). TASK says what the rank does:

    train SPEC               a rank of `scaletrain train --nproc N` (SPEC: a JSON file of the
                             settled config and its layout, see scaletrain.launch.job)
    verify SPEC [OUT]        a rank of `scaletrain verify`'s layout or reference run
    measure SPEC OUT         a rank of the planner's measured run (`plan --measure`)
    calibrate SPEC OUT       a rank of the planner's calibration of this machine
    bench-techniques SPEC OUT  a rank of `scaletrain bench techniques`
    bench-comms SPEC OUT     a rank of `scaletrain bench comms`
    MODULE:FUNCTION ARGS...  any importable function (the test suite's groups of jobs, the benchmarks)

The tasks with SPEC and OUT are started by scaletrain.launch.ranks.run_on_ranks: SPEC a JSON file of
what to do, OUT where rank 0 writes its result.

The task returns the rank's exit code. Whatever it is, the rank:
  * dies with its launcher (Linux's parent-death signal): no rank outlives the job;
  * reports a failure in one line, where the launcher looks for it (TORCHELASTIC_ERROR_FILE),
    with exit code 2 for a user's error (bad input, a read-only or full folder), which
    `--max-restarts` never retries, and 1 for anything else;
  * leaves without the interpreter's teardown, where the communication libraries' threads can
    abort a process whose work succeeded.
"""

from __future__ import annotations

import importlib
import os
import signal
import sys
from collections.abc import Callable
from typing import NoReturn

TASKS = {
    "train": "scaletrain.launch.job:train_rank",
    "verify": "scaletrain.verify:run_rank",
    "measure": "scaletrain.measure:measure_rank",
    "bench-techniques": "scaletrain.bench.techniques:bench_rank",
    "bench-comms": "scaletrain.bench.comms:bench_rank",
    "calibrate": "scaletrain.bench.calibrate:calibrate_rank",
}


def program(task: str, *args: str) -> tuple[str, ...]:
    """The launcher's `program` for TASK: `python -m scaletrain.launch.worker TASK ARGS...`."""
    return ("-m", "scaletrain.launch.worker", task, *args)


def main(argv: list[str] | None = None) -> NoReturn:
    """`python -m scaletrain.launch.worker TASK ARGS...`: the rank runs TASK's function with ARGS."""
    argv = list(sys.argv[1:] if argv is None else argv)
    run(_task, *argv)


def _task(*argv: str) -> int:
    from scaletrain.errors import UserError

    if not argv:
        raise UserError(f"python -m scaletrain.launch.worker TASK: no task; "
                        f"known: {', '.join(TASKS)} or MODULE:FUNCTION")
    task, *args = argv
    target = TASKS.get(task, task)
    module, _, name = target.partition(":")
    if not name:
        raise UserError(f"unknown worker task {task!r}; known: {', '.join(TASKS)} or MODULE:FUNCTION")
    return getattr(importlib.import_module(module), name)(*args)


def run(task: Callable[..., int | None], *args) -> NoReturn:
    """Run `task(*args)` as this rank's work, and leave as every rank leaves (see above)."""
    from scaletrain.console import prefix_lines
    from scaletrain.interrupt import EarlySignals, Terminated

    guard = EarlySignals.current() or EarlySignals.install()  # before torch is imported
    prefix_lines()  # ft-local's groups: every line names its group
    if guard is not None and guard.on_stuck is None:  # the launcher says in one line what the ranks saved
        guard.on_stuck = lambda signum: 128 + signum
    rank = int(os.environ.get("RANK", "0"))
    try:
        from scaletrain import runtime

        runtime.die_with_launcher()  # first: a launcher killed from here on takes this rank with it
        if guard is not None:
            guard.check()
        code = task(*args)
    except (KeyboardInterrupt, Terminated) as e:  # a stop before the task handled signals: nothing to report,
        code = 128 + (signal.SIGTERM if isinstance(e, Terminated) else signal.SIGINT)  # the launcher says it
    except BaseException as e:  # noqa: BLE001 - every failure is reported in a few lines
        if (current := EarlySignals.current()) is not None:
            current.absorb()  # the launcher stops the other ranks now: its SIGTERM must not cut this report
        from scaletrain.launch import launcher

        code = launcher.record_worker_error(e, rank)
    from scaletrain import runtime

    runtime.exit_worker(int(code or 0))


if __name__ == "__main__":
    main()
