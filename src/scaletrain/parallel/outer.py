"""The run's outer loop: what syncs copies of the model less often than every step, as one strategy.

Two techniques keep several copies of the model apart between syncs, and at most one runs:

    replica groups (fault_tolerance.enabled)   groups of ranks that may die and rejoin, averaged every
                                                step (sync.mode=step) or as the workers of local SGD /
                                                DiLoCo (parallel/fault_tolerance.py, on torchft)
    local SGD / DiLoCo (parallel.sync.mode)     the dp_replicate groups of one job as workers, synced
                                                every sync.every steps (parallel/local_sgd.py)

`outer_loop` picks the run's (None: every rank syncs every step, the data-parallel engine's work). It is
the last step hook: it sees the weights the optimizer stepped.
"""

from __future__ import annotations

from scaletrain.hooks import OuterLoop
from scaletrain.parallel.fault_tolerance import ReplicaGroups
from scaletrain.parallel.local_sgd import LocalSGD


def outer_loop(named, cfg, rt, *, n_blocks: int, optimizer, state, refresh, scaler, hooks) -> OuterLoop | None:
    """The outer-loop hook of a run over `named` (what the optimizer steps), or None. `state` (the
    run's TrainState), `refresh` (what the model computes with, from the stepped weights), `scaler` and
    `hooks` (the other techniques', whose state a healing group takes from a peer) for replica groups."""
    if cfg.fault_tolerance.enabled:
        return ReplicaGroups.for_run(cfg, rt, named, optimizer, state, refresh, scaler, hooks)
    return LocalSGD.for_run(named, rt.layout, cfg.parallel, n_blocks=n_blocks, mesh=rt.mesh)
