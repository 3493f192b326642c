"""`scaletrain plot`: runs' loss, validation loss, tokens/s and learning rate, overlaid in a PNG."""

from __future__ import annotations

import argparse

from scaletrain.cli.common import check_png
from scaletrain.errors import os_errors_named


def add_parser(sub) -> None:
    p = sub.add_parser("plot", help="loss, validation loss, tokens/s and learning rate of runs, overlaid, to a PNG")
    p.add_argument("runs", nargs="+", metavar="RUN", help="run folders (log.run_dir), each with its metrics.jsonl")
    p.add_argument("--out", required=True, help="the PNG to write")
    p.set_defaults(func=run, takes_overrides=False, parser=p)


def run(args: argparse.Namespace, extra: list[str]) -> int:
    from scaletrain.trained.plot import plot_runs

    check_png("--out", args.out)
    with os_errors_named({"--out": args.out}):
        summary = plot_runs(args.runs, args.out)
    print(f"wrote {args.out} ({', '.join(summary['runs'])})")
    return 0
