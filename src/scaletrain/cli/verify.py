"""`scaletrain verify`: a layout checked step by step against one process."""

from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    p = sub.add_parser("verify", help="check a layout against one process, step by step",
                       description="Run the config's first --steps steps under its layout and under a reference "
                                   "(one process, or the fewest ZeRO-3 ranks that fit), compare every step's loss "
                                   "and gradient norm, and print PASS (exit 0) or FAIL (exit 1) against a tolerance "
                                   "for the precision. Config options as --section.key=value.")
    p.add_argument("--config", help="TOML config file (default: the built-in tiny CPU run)")
    p.add_argument("--steps", type=int, default=10, help="steps to run and compare (default 10)")
    p.add_argument("--nproc", type=int, help="ranks of the layout (default: pp × dp_replicate × dp_shard × tp)")
    p.add_argument("--device-memory", dest="device_memory", type=float, metavar="GIB",
                   help="memory of one device for the reference's fit check (default: the device's own)")
    p.set_defaults(func=run, takes_overrides=True, parser=p)


def run(args: argparse.Namespace, extra: list[str]) -> int:
    from scaletrain.verify import verify

    return verify(args.config, extra, steps=args.steps, nproc=args.nproc, device_memory_gib=args.device_memory)
