"""Who stopped participating: each rank's progress, published where every rank can read it.

A collective that times out tells the rank that waited only that it waited. To name the rank
that never came, every rank runs a small thread that writes, once a second, into the process
group's key-value store: the step and phase its main thread is in, and how many collectives it
has issued on each of its process groups (their sequence numbers). A rank whose count on a group
is below its peers' has not reached the collective they are waiting in; a rank whose record
stopped being refreshed is dead or frozen. `lagging()` reads those records after a failure.

The same thread ends a rank whose peer has failed: the failing rank leaves an abort note in
the store, and every other rank leaves within seconds instead of waiting out its own collective
timeout or the launcher's grace period (a rank hung outside any collective would otherwise
ignore the launcher's SIGTERM, which only asks for a checkpoint at the end of the step).

The thread never touches tensors or collectives, only the store (whose client is thread-safe),
so it costs two small messages per rank per second.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

# keys in the process group's store, which is private to one attempt of the job (see
# scaletrain.runtime): a restarted group never reads its predecessor's records
PROGRESS, ABORT = "scaletrain/progress/{rank}", "scaletrain/abort"
ABORTED_EXIT_CODE = 1  # a rank ended because another failed; the launcher reports the other's error


def _groups() -> dict[str, tuple[list[int], object]]:
    """This rank's process groups of more than one rank: name -> (global ranks, group)."""
    found = {}
    for pg in list(dist.distributed_c10d._world.pg_map):
        ranks = dist.get_process_group_ranks(pg)
        if len(ranks) > 1:
            found[pg.group_name] = (ranks, pg)
    return found


class Progress:
    """The rank's own record; the main thread sets `step` and `phase`, the thread publishes."""

    def __init__(self, store, rank: int, interval: float = 1.0, grace: float = 2.0):
        self.store, self.rank, self.interval, self.grace = store, rank, interval, grace
        self.step, self.phase = 0, "start-up"
        self._stop = threading.Event()
        self._lock = threading.Lock()  # held while publishing, so stop() never races a publish
        self._thread: threading.Thread | None = None

    def record(self) -> dict:
        seq = {name: pg._get_sequence_number_for_group() for name, (_, pg) in _groups().items()}
        ranks = {name: ranks for name, (ranks, _) in _groups().items()}
        return {"step": self.step, "phase": self.phase, "time": time.time(), "seq": seq, "ranks": ranks}

    def publish(self) -> None:
        with self._lock:
            if not self._stop.is_set():
                self.store.set(PROGRESS.format(rank=self.rank), json.dumps(self.record()))

    def abort(self) -> None:
        """Tell every rank that this one failed (see the module docstring)."""
        try:
            self.store.set(ABORT, str(self.rank))
        except Exception:  # noqa: BLE001 - the store is gone: the launcher will stop the others
            pass

    def _peer_failed(self) -> bool:
        key = ABORT
        return self.store.check([key]) and int(self.store.get(key)) != self.rank

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.publish()
                failed = self._peer_failed()
            except Exception:  # noqa: BLE001 - the store went away with the job: nothing left to report
                return
            if failed and not self._stop.wait(self.grace):  # the main thread may still fail on its own
                sys.stderr.flush()
                os._exit(ABORTED_EXIT_CODE)

    def start(self) -> Progress:
        self.publish()
        self._thread = _ProgressThread(self)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop publishing (before the process group is destroyed)."""
        with self._lock:
            self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


class _ProgressThread(threading.Thread):
    """The publishing thread; it carries its Progress, so a process finds its running one among
    its threads (`running_progress`) instead of in a module-level variable."""

    def __init__(self, progress: Progress):
        super().__init__(target=progress._run, name="scaletrain-progress", daemon=True)
        self.progress = progress


def running_progress() -> Progress | None:
    """This process's publishing Progress, if one runs (one per process: a new join stops the old)."""
    for thread in threading.enumerate():
        if isinstance(thread, _ProgressThread) and thread.is_alive():
            return thread.progress
    return None


@dataclass
class Lagging:
    rank: int
    step: int
    phase: str
    why: str

    def __str__(self) -> str:
        return f"rank {self.rank} last reported step {self.step}, {self.phase} ({self.why})"


def _read(store, world_size: int) -> dict[int, dict | None]:
    records = {}
    for r in range(world_size):
        key = PROGRESS.format(rank=r)
        records[r] = json.loads(store.get(key)) if store.check([key]) else None
    return records


def lagging(store, world_size: int, *, interval: float = 1.0, timeout_s: float = 5.0) -> list[Lagging]:
    """The ranks that stopped participating, judged from every rank's published progress: those
    whose record is not refreshed any more (dead or frozen; read twice, a few intervals apart,
    so no clocks are compared), and those that issued fewer collectives on a group than the
    other members (hung outside the collective the others wait in)."""
    try:
        store.set_timeout(timedelta(seconds=timeout_s))
        first = _read(store, world_size)
        time.sleep(2.5 * interval)
        records = _read(store, world_size)
    except Exception:  # noqa: BLE001 - the store may have gone with the failed ranks
        return []
    found: dict[int, Lagging] = {}
    for r, rec in records.items():
        if rec is None:
            found[r] = Lagging(r, 0, "start-up", "it never reported")
        elif first[r] is not None and rec["time"] == first[r]["time"]:
            found[r] = Lagging(r, rec["step"], rec["phase"], "it stopped reporting: dead or frozen")
    groups: dict[str, list[int]] = {}
    for rec in records.values():
        if rec is not None:
            groups.update(rec["ranks"])
    for name, members in sorted(groups.items()):
        seqs = {r: records[r]["seq"].get(name) for r in members if records.get(r) is not None}
        seqs = {r: s for r, s in seqs.items() if s is not None}
        if not seqs:
            continue
        top = max(seqs.values())
        for r, s in seqs.items():
            if s < top and r not in found:
                rec = records[r]
                found[r] = Lagging(r, rec["step"], rec["phase"],
                                   f"it issued {s} collective(s) on the group of ranks {_span(members)}, "
                                   f"the others {top}")
    return [found[r] for r in sorted(found)]


def _span(ranks: list[int]) -> str:
    return ",".join(str(r) for r in ranks)
