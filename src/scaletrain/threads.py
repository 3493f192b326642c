"""Intra-op threads on a shared machine: how many each local rank runs, how its idle threads
wait, and one line when the machine has more to run than its cores.

torch's default is one intra-op thread per core, and its OpenMP (libgomp) makes a thread that
waits at the end of a parallel region spin before it sleeps (GOMP_SPINCOUNT 300,000 by default).
On an idle machine that is the fastest. On a busy one every parallel region waits for its
slowest thread, which shares a core with other work: the spinning thread burns the time slice
its partner needs, and the step pays a scheduler delay per region. A mixture of experts runs
thousands of small regions a step: on a 2-core machine shared with other sessions it ran 8x
slower than on one thread, the dense demo 1.7x (docs/benchmarks.md, benchmarks/threads.py); on
an idle one, one thread costs 40-45%.

So the threads are chosen from the cores this process may use (its affinity), shared among the
local ranks, less the cores other work keeps busy: the lower of the last minute's load average
(read as the job starts, before its own work counts in it) and the threads running now (the
average lags: a job that ended seconds ago is still in it). Idle threads sleep at once
(OMP_WAIT_POLICY=PASSIVE): on an idle machine that costs nothing measurable, and a load that
arrives after the start costs less. A variable the user set is kept: OMP_NUM_THREADS (the threads),
and OMP_WAIT_POLICY, GOMP_SPINCOUNT or KMP_BLOCKTIME (the wait). The wait policy is read by
OpenMP when torch is imported: `wait_env` is set at the command line's entry, before that.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass

THREADS_VAR = "OMP_NUM_THREADS"
WAIT_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")  # libgomp's and Intel OpenMP's
WAIT = {"OMP_WAIT_POLICY": "PASSIVE"}  # idle threads sleep at once instead of spinning on a core others need


@dataclass(frozen=True)
class Threads:
    """The intra-op threads of each of a node's local ranks, and why."""

    threads: int  # per local rank
    cores: int  # the cores this process may use
    local_ranks: int
    load: float | None  # the 1-minute load average before this job ran; None where the OS does not say
    given: bool  # OMP_NUM_THREADS was the user's
    running: float | None = None  # the other threads runnable as the job starts; None: not known

    @property
    def share(self) -> int:
        """Threads per rank on an idle machine: the cores shared among the local ranks."""
        return max(1, self.cores // self.local_ranks)

    @property
    def busy(self) -> int:
        """The cores other work keeps busy, in whole cores: the lower of the load average and the
        threads running now (a load of 0.3, or of 2 left by a job that just ended, is none)."""
        known = [x for x in (self.load, self.running) if x is not None]
        return math.floor(min(known) + 0.5) if known else 0

    @property
    def fitting(self) -> int:
        """Threads per rank on the cores other work leaves, shared among the ranks: at least one."""
        return max(1, min(self.share, (self.cores - self.busy) // self.local_ranks))

    @property
    def oversubscribed(self) -> bool:
        """The other work and this node's threads together need more than the cores."""
        return self.busy + self.threads * self.local_ranks > self.cores

    def note(self) -> str | None:
        """One line for the run's log when other work keeps cores busy and this job's threads were
        cut for it or, with them, the machine has more to run than cores: the load, the threads
        and the override. None on an idle machine (more ranks than cores is said by the launch), and
        for a user's OMP_NUM_THREADS no higher than the cores left (OMP_NUM_THREADS=1: nothing to change)."""
        if not self.busy or not (self.oversubscribed or self.threads < self.share):
            return None
        if self.given and self.threads <= self.fitting:
            return None
        ranks = " per rank" if self.local_ranks > 1 else ""
        if self.given:
            chosen = f"OMP_NUM_THREADS={self.threads} intra-op thread(s){ranks}, as set"
        else:
            chosen = f"{self.threads} intra-op thread(s){ranks}" + (f", not {self.share}" if self.threads < self.share
                                                                     else "")
        now = f", {self.running:.0f} other thread(s) running now" if self.running is not None else ""
        line = (f"threads: {chosen}: the machine is busy (load average {self.load:.1f} over the last minute{now}, "
                f"on {self.cores} core(s))")
        if self.oversubscribed:
            line += (f"; with this job's {self.threads * self.local_ranks} thread(s) it has more to run than cores, "
                     "so each step is slower than on an idle machine")
        return line + ("" if self.given else "; OMP_NUM_THREADS=N sets the threads")


def choose(cores: int, local_ranks: int, load: float | None, env: Mapping[str, str],
           running: float | None = None) -> Threads:
    """The threads of each of `local_ranks` ranks on `cores` cores, `load` the 1-minute load
    average before the job and `running` the other threads runnable as it starts (None:
    unknown; both unknown: idle), `env` the environment the user gave: OMP_NUM_THREADS, when
    set, is kept as it is."""
    local_ranks = max(1, local_ranks)
    free = Threads(1, cores, local_ranks, load, given=False, running=running)
    if text := env.get(THREADS_VAR, "").strip():  # "4,2" (nested levels): torch runs the first
        return dataclasses.replace(free, threads=_positive_int(text.split(",")[0]) or free.share, given=True)
    return dataclasses.replace(free, threads=free.fitting)


def wait_env(env: Mapping[str, str]) -> dict[str, str]:
    """The wait policy to set: PASSIVE, unless the user chose one (any of WAIT_VARS set)."""
    return {} if any(env.get(var) for var in WAIT_VARS) else dict(WAIT)


def rank_env(choice: Threads, env: Mapping[str, str]) -> dict[str, str]:
    """The variables a launcher sets for its ranks (those the user left unset): the threads and the wait."""
    return {**({} if choice.given else {THREADS_VAR: str(choice.threads)}), **wait_env(env)}


def on_this_node(local_ranks: int) -> Threads:
    """`choose` for this machine: this process's cores, the load before the job, os.environ."""
    from scaletrain.hardware import cpu_cores

    return choose(cpu_cores(), local_ranks, load_average(), os.environ, running=running_now())


def load_average() -> float | None:
    """The 1-minute load average (read as the job starts, its own work is not yet in it); None
    where the OS does not say."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def running_now(samples: int = 5, gap_s: float = 0.01) -> float | None:
    """The threads runnable on the machine now besides the one reading (/proc/stat's
    procs_running, the mean of `samples` reads `gap_s` apart); None where the OS does not say."""
    counts = []
    for i in range(samples):
        try:
            with open("/proc/stat") as f:
                counts += [int(line.split()[1]) - 1 for line in f if line.startswith("procs_running ")]
        except (OSError, ValueError, IndexError):
            return None
        if i + 1 < samples:
            time.sleep(gap_s)
    return sum(counts) / len(counts) if counts else None


def use(choice: Threads) -> None:
    """Run this process's intra-op work on `choice.threads` threads (the user's OMP_NUM_THREADS,
    which torch already follows, is left to it)."""
    import torch

    if not choice.given and torch.get_num_threads() != choice.threads:
        torch.set_num_threads(choice.threads)


def _positive_int(text: str) -> int | None:
    try:
        value = int(text)
    except ValueError:
        return None
    return value if value > 0 else None
