"""parallel.ft_*'s checks (torch-free: config validation runs them before anything is imported)."""

from __future__ import annotations


def fault_tolerance_problems(par) -> list[str]:
    """parallel.ft_*'s own problems (`par`: the config's ParallelConfig): what
    fault tolerance does not protect inside a replica group is scaletrain.legality's."""
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
    return errors  # (what fault tolerance does not protect in a layout: scaletrain.legality)
