"""`scaletrain schedule`: a pipeline schedule's timeline and its bubble, drawn as text or a PNG."""

from __future__ import annotations

import argparse

from scaletrain.cli.common import check_png


def add_parser(sub) -> None:
    """`scaletrain schedule`'s options: the config's pipeline keys, with short aliases (and its defaults)."""
    from scaletrain.config import ParallelConfig

    p = sub.add_parser("schedule", help="draw a pipeline schedule's timeline and its bubble",
                       description="Draw a pipeline schedule. Options are the config's names (parallel.pp, "
                                   "parallel.pp_microbatches, parallel.pp_schedule, parallel.pp_virtual_stages), "
                                   "with short aliases.")
    p.add_argument("--pp", "--parallel.pp", dest="pp", type=int, required=True, metavar="N",
                   help="pipeline stages (ranks)")
    p.add_argument("--microbatches", "--parallel.pp_microbatches", dest="microbatches", type=int, required=True,
                   metavar="M", help="micro-batches per step (train.grad_accum under pipelining)")
    p.add_argument("--schedule", "--parallel.pp_schedule", dest="schedule", default=ParallelConfig.pp_schedule,
                   metavar="NAME",
                   help="gpipe, 1f1b, interleaved-1f1b or zero-bubble")
    p.add_argument("--virtual", "--parallel.pp_virtual_stages", dest="virtual", type=int,
                   default=ParallelConfig.pp_virtual_stages, metavar="V",
                   help="chunks per rank (interleaved-1f1b, zero-bubble)")
    p.add_argument("--png", help="also draw it to this PNG file")
    p.set_defaults(func=run, takes_overrides=False, parser=p)


def run(args: argparse.Namespace, extra: list[str]) -> int:
    """`scaletrain schedule`: a pipeline schedule's timeline, as text and optionally a PNG."""
    from scaletrain.plan import timeline

    timeline.check(args.schedule, args.pp, args.microbatches, args.virtual)
    check_png("--png", args.png)
    placed = timeline.simulate(args.schedule, args.pp, args.microbatches, args.virtual)
    print(timeline.render_text(args.schedule, args.pp, args.microbatches, args.virtual, placed))
    if args.png:
        timeline.render_png(args.schedule, args.pp, args.microbatches, args.virtual, placed, args.png)
        print(f"wrote {args.png}")
    return 0
