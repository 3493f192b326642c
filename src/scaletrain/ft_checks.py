"""parallel.ft_*'s checks (torch-free: config validation runs them before anything is imported)."""

from __future__ import annotations


def fault_tolerance_problems(par) -> list[str]:
    """parallel.ft_*'s problems (`par`: the config's ParallelConfig), and the layouts inside a replica
    group that fault tolerance does not protect yet (their state or their collectives span more than
    what the groups heal and average)."""
    if not par.fault_tolerance:
        return []
    errors = []
    if par.ft_replica_id >= par.ft_groups:
        errors.append(f"parallel.ft_replica_id={par.ft_replica_id} is out of range for parallel.ft_groups="
                      f"{par.ft_groups}; give each group an id from 0 to {par.ft_groups - 1}")
    if par.ft_min_replicas > par.ft_groups:
        errors.append(f"parallel.ft_min_replicas={par.ft_min_replicas} is above parallel.ft_groups={par.ft_groups}: "
                      "no step could ever commit; lower ft_min_replicas or start more groups")
    if not par.ft_lighthouse:
        errors.append("parallel.fault_tolerance needs parallel.ft_lighthouse=http://HOST:PORT, the address "
                      "`scaletrain lighthouse` prints")
    unprotected = [f"parallel.{name}={value}" for name, value, ok in (
        ("tp", par.tp, 1), ("pp", par.pp, 1), ("cp", par.cp, 1), ("ep", par.ep, 1), ("zero", par.zero, None),
        ("dp_replicate", par.dp_replicate, 1), ("dp_sync", par.dp_sync, "step")) if
        (value == 3 if ok is None else value != ok) and (name != "dp_sync" or par.dp_replicate > 1)]
    if unprotected:
        errors.append(f"parallel.fault_tolerance does not protect {', '.join(unprotected)} yet: inside a replica "
                      "group it takes DDP or ZeRO-1/2 over dp_shard ranks, and the groups themselves are the "
                      "replicas (leave dp_replicate at 1, dp_sync=step)")
    return errors  # (local SGD / DiLoCo with dp_replicate = 1: the groups are the workers; Layout.errors)
