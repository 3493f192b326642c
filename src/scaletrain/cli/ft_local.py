"""`scaletrain ft-local`: a fault-tolerant job on this machine (scaletrain.launch.replica_groups runs it)."""

from __future__ import annotations

import argparse

from scaletrain.cli.lighthouse import add_options

FT_LOCAL_RESTARTS = 10  # each group's own restarts, by default: a group that keeps failing ends the job


def add_parser(sub) -> None:
    p = sub.add_parser("ft-local", help="a fault-tolerant job on this machine: a Lighthouse and R replica groups, "
                                        "each restarted alone when it fails",
                       description="Start a Lighthouse and --groups replica groups, each `scaletrain train "
                                   "--nproc N` with fault_tolerance.enabled under its own elastic agent (a group "
                                   "that fails restarts alone, heals from a live peer and rejoins). Config "
                                   "options as --section.key=value go to every group; group r's run folder is "
                                   "<log.run_dir>/group<r>.")
    p.add_argument("--config", help="TOML config file (default: the demo run)")
    p.add_argument("--groups", type=int, required=True, help="replica groups (R)")
    p.add_argument("--nproc", type=int, default=1, help="ranks of each group (default 1)")
    p.add_argument("--max-restarts", type=int, default=FT_LOCAL_RESTARTS,
                   help=f"restarts of each group after a failure (default {FT_LOCAL_RESTARTS})")
    add_options(p)
    # for tests, not users (hidden from --help): passed on to every group's `scaletrain train --rank-hook`
    # (scaletrain.launch.job.call_rank_hook): the fault-tolerance tests' SIGKILLs at chosen steps and phases
    p.add_argument("--rank-hook", metavar="MODULE:FUNCTION", help=argparse.SUPPRESS)
    p.set_defaults(func=run, takes_overrides=True, parser=p)


def run(args: argparse.Namespace, extra: list[str]) -> int:
    """Run the groups to their end; the exit code: 0 when every group finished, else the first failure's."""
    from scaletrain.launch.replica_groups import run_replica_groups

    return run_replica_groups(args.config, extra, groups=args.groups, nproc=args.nproc, max_restarts=args.max_restarts,
                              min_replicas=args.min_replicas, join_timeout_ms=args.join_timeout_ms,
                              heartbeat_timeout_ms=args.heartbeat_timeout_ms, rank_hook=args.rank_hook)
