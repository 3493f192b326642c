"""`scaletrain bench comms|step|techniques`: this machine measured, each a call into scaletrain.bench."""

from __future__ import annotations

import argparse
import json
import sys


def add_parser(sub) -> None:
    """`scaletrain bench` and its three verbs' options."""
    p = sub.add_parser("bench", help="measure this machine: collectives, a step, each technique",
                       description="Benchmarks run here, for real: collectives over N ranks; a config's step with "
                                   "variants beside it; what each technique buys in speed and memory.")
    bench = p.add_subparsers(dest="bench", required=True, parser_class=type(p))
    b = bench.add_parser("comms", help="all-reduce, all-gather, reduce-scatter, broadcast, reduce, all-to-all",
                         description="Median time, algorithm and bus bandwidth (nccl-tests factors) of each "
                                     "collective over a range of message sizes; NCCL on GPUs, gloo on CPU.")
    b.add_argument("--nproc", type=int, help="ranks (default: the GPUs here, or 2 on CPU)")
    b.add_argument("--sizes", nargs="+", metavar="SIZE",
                   help="message sizes in bytes (64K, 16M, 1G) or a range MIN:MAX[:FACTOR] (default: 1K 32K 1M 16M "
                        "on CPU, 1M 16M 256M 1G on GPU)")
    b.add_argument("--iters", type=int, default=20, help="timed calls per collective and size (default 20)")
    b.add_argument("--warmup", type=int, default=5, help="untimed calls before them (default 5)")
    b.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: cuda if available")
    b.add_argument("--json", action="store_true", help="print JSON (for `scaletrain plan --comms FILE`)")
    b.set_defaults(func=comms, takes_overrides=False, parser=b)
    b = bench.add_parser("step", help="a config's step: time, tokens/s, MFU, peak memory; --vs variants as ratios",
                         description="Warm up, then time the config's training step interleaved with each --vs "
                                     "variant (and --vs-plain-loop): median step time, tokens/s, MFU, peak memory, "
                                     "and each variant's speed and memory as ratios to the baseline. Config "
                                     "options as --section.key=value.")
    b.add_argument("--config", help="TOML config file (default: the built-in tiny CPU run)")
    b.add_argument("--vs", action="append", default=[], metavar="KEY=VALUE",
                   help="a variant: section.key=value, several joined by commas; repeat for more variants")
    b.add_argument("--vs-plain-loop", action="store_true",
                   help="also time a minimal hand-written PyTorch loop of the same model (AdamW, autocast)")
    b.add_argument("--steps", type=int, default=10, help="timed steps of each, one per round (default 10)")
    b.add_argument("--warmup", type=int, default=3, help="untimed steps of each first (default 3)")
    b.add_argument("--json", action="store_true", help="print JSON")
    b.set_defaults(func=step, takes_overrides=True, parser=b)
    b = bench.add_parser("techniques", help="which technique buys speed, which buys memory, measured here",
                         description="Gradient accumulation, activation checkpointing, each precision mode, a "
                                     "larger batch, each optimizer, loader workers, each ZeRO stage and compile, "
                                     "each interleaved with the baseline config: speed and peak-memory ratios, "
                                     "as a table and a PNG chart. Config options as --section.key=value.")
    b.add_argument("--config", help="TOML config file (default: the built-in tiny CPU run)")
    b.add_argument("--nproc", type=int, help="ranks (default 1); the ZeRO stages need 2 or more")
    b.add_argument("--steps", type=int, default=5, help="timed steps of each, one per round (default 5)")
    b.add_argument("--warmup", type=int, default=2, help="untimed steps of each first (default 2)")
    b.add_argument("--skip", nargs="+", default=[], metavar="NAME",
                   help="leave techniques out by name (accum, ac-full, ac-selective, precision-MODE, batch, "
                        "optim-NAME, workers, zero1, zero2, zero3, compile)")
    b.add_argument("--max-slowdown", type=float, default=10.0, metavar="X",
                   help="stop timing a technique whose step takes over X times the baseline's (default 10; 0: never)")
    b.add_argument("--png", help="chart file (default runs/bench-techniques-DATE-TIME.png; '' for none)")
    b.add_argument("--json", action="store_true", help="print JSON")
    b.set_defaults(func=techniques, takes_overrides=True, parser=b)


def comms(args: argparse.Namespace, extra: list[str]) -> int:
    """`scaletrain bench comms`: each collective's time and bus bandwidth over N ranks."""
    from scaletrain.bench import comms as bench

    result = bench.run(nproc=args.nproc, sizes=args.sizes, iters=args.iters, warmup=args.warmup, device=args.device)
    print(json.dumps(result, indent=1) if args.json else bench.table(result))
    return 0


def step(args: argparse.Namespace, extra: list[str]) -> int:
    """`scaletrain bench step`: the config's step, and each --vs variant's as ratios to it."""
    from scaletrain.bench import step as bench

    result = bench.bench_step(args.config, extra, args.vs, steps=args.steps, warmup=args.warmup,
                              plain_loop=args.vs_plain_loop, progress=_progress())
    print(json.dumps(result, indent=1) if args.json else bench.report(result))
    return 0


def techniques(args: argparse.Namespace, extra: list[str]) -> int:
    """`scaletrain bench techniques`: what each technique buys in speed and memory, and its chart."""
    from scaletrain.bench import techniques as bench

    result = bench.bench_techniques(args.config, extra, nproc=args.nproc, steps=args.steps, warmup=args.warmup,
                                    skip=args.skip, max_slowdown=args.max_slowdown or None, progress=_progress())
    print(json.dumps(result, indent=1) if args.json else bench.report(result))
    if args.png != "":
        line = bench.chart(result, args.png or bench.default_png())
        print(line, file=sys.stderr if args.json else sys.stdout)
    return 0


def _progress():
    """A live progress line on a terminal; nothing when stderr is a file."""
    from scaletrain.bench.step import progress_line

    return progress_line if sys.stderr.isatty() else None
