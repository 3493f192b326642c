"""[fault_tolerance]'s checks (torch-free: config validation runs them before anything is imported)."""

from __future__ import annotations


def fault_tolerance_problems(ft) -> list[str]:
    """fault_tolerance.*'s own problems (`ft`: the config's FaultToleranceConfig): what
    fault tolerance does not protect inside a replica group is scaletrain.legality's."""
    if not ft.enabled:
        return []
    errors = []
    if ft.replica_id >= ft.groups:
        errors.append(f"fault_tolerance.replica_id={ft.replica_id} is out of range for fault_tolerance.groups="
                      f"{ft.groups}; give each group an id from 0 to {ft.groups - 1}")
    if ft.min_replicas > ft.groups:
        errors.append(f"fault_tolerance.min_replicas={ft.min_replicas} is above fault_tolerance.groups={ft.groups}: "
                      "no step could ever commit; lower fault_tolerance.min_replicas or start more groups")
    if not ft.lighthouse:
        errors.append("fault_tolerance.enabled needs fault_tolerance.lighthouse=http://HOST:PORT, the address "
                      "`scaletrain lighthouse` prints")
    return errors  # (what fault tolerance does not protect in a layout: scaletrain.legality)
