"""parallel.ft_*'s checks (torch-free: config validation runs them before anything is imported)."""

from __future__ import annotations


def fault_tolerance_problems(par, model=None) -> list[str]:
    """parallel.ft_*'s problems (`par`: the config's ParallelConfig, `model`: its ModelConfig), and
    what fault tolerance does not protect yet inside a replica group.

    Every group has the same layout and rank i of each group pairs with rank i of the others (its
    all-reduce, and what it sends a healing peer), so each rank's local tensors (its ZeRO-3 or
    tensor-parallel shard, its pipeline stages, its experts) line up with the same ones in the other
    groups: with dp_sync=step any layout inside a group is protected (tests/test_ft_layouts.py)."""
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
    if par.dp_sync == "step":  # a mixture's load counts summed over the groups each step, its biases healed
        return errors
    if model is not None and model.moe_experts and model.moe_bias_rate:
        errors.append(f"parallel.fault_tolerance with parallel.dp_sync={par.dp_sync} and model.moe_bias_rate="
                      f"{model.moe_bias_rate:g}: each group, a worker, would move its experts' routing biases by its "
                      "own tokens' load between syncs, and the workers' models would drift apart; set "
                      "model.moe_bias_rate=0 (balance with model.moe_aux_loss instead), or use dp_sync=step")
    # local SGD / DiLoCo: the groups are the workers, one level of them; inside each, any layout a local-SGD
    # worker can have (ZeRO 1-3, tp, pp, cp, ep: tests/test_ft_layouts.py), but not workers of its own
    if par.dp_replicate != 1:
        errors.append(f"parallel.fault_tolerance with parallel.dp_sync={par.dp_sync} does not protect "
                      f"parallel.dp_replicate={par.dp_replicate}: the replica groups are the workers, and workers "
                      "inside them would be a second level; leave dp_replicate at 1 (ZeRO, tp, pp, cp and ep work "
                      "inside a group), or use dp_sync=step")
    return errors  # (streamed, delayed or compressed syncs across the groups: Layout.errors)
