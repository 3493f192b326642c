"""The planner's verbs: `scaletrain plan` (the request read from the options: a config, its
keys, the short flags as aliases; the planner run for the cluster asked or for the devices at
hand, `--measure` and `--calibrate`; its report printed) and `scaletrain schedule` (a pipeline
schedule drawn). Each verb's parser is one function here, which scaletrain.cli calls.
"""

from __future__ import annotations

import argparse
import os
import sys

from scaletrain.errors import UserError


def at_least_1(name: str):
    """argparse type of a count given by one of plan's short flags: an integer of at least 1
    (the config's own names keep its meanings: train.micro_batch=0 derives, parallel.dp_shard=-1
    takes the remaining ranks)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"layout sizes must be at least 1, got {name}={value}" if " " not in name
                                             else f"{name} must be at least 1, got {value}")
        return value
    return parse


def load_factor(text: str) -> float:
    """argparse type of --moe-imbalance: max / mean tokens per expert, a number of at least 1."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number (max / mean tokens per expert), got {text!r}") from None
    if not value >= 1.0:  # NaN too
        raise argparse.ArgumentTypeError(f"max / mean tokens per expert is at least 1 (1 = balanced), got {text}")
    return value


def alias_dest(flag: str) -> str:
    """The argparse destination of a short flag: --seq-len -> seq_len."""
    return flag[2:].replace("-", "_")


def check_png(flag: str, path: str | None) -> None:
    """Refuse an image path that cannot be written before any work is done (plan --chart,
    schedule --png, plot --out)."""
    if not path:
        return
    folder = os.path.dirname(path) or "."
    if not path.lower().endswith(".png"):
        raise UserError(f"{flag} {path}: give a file name ending in .png")
    if not os.path.isdir(folder):
        raise UserError(f"{flag} {path}: the folder {folder} does not exist; create it or choose another path")


def plan_parser(sub) -> None:
    """`scaletrain plan`'s options: the cluster, the config and its keys, and their short aliases."""
    from scaletrain.plan.options import ALIASES
    from scaletrain.plan.spec import ATTENTION
    from scaletrain.vocab import AC_MODES, CP_METHODS, OPTIMIZERS, PLAN_ENGINES, PP_SCHEDULES, PRECISIONS, ZERO_STAGES

    p = sub.add_parser("plan", help="will it fit, and which layout is fastest",
                       description="Search the layouts of a model on a cluster, or evaluate the one the options fix, "
                                   "with every byte and second broken down. Takes the options of `scaletrain train`: "
                                   "--config FILE and --section.key=value (write the '='); the short flags below are "
                                   "aliases of config keys. The layout keys given fix the layout (anything left out "
                                   "is derived); with none given, it searches.")
    p.add_argument("model", nargs="?", help="preset name, TOML with a [model] section, or a Hugging Face config.json "
                                            "(default: the config's model)")
    p.add_argument("--config", help="a training config: its model, sequence length, batch, precision, optimizer, "
                                    "and the layout keys it gives")
    p.add_argument("--hardware", default="H100-SXM", help="catalog entry (V100-32GB, A100-40GB, A100-80GB, H100-SXM, "
                   "H100-PCIe, H200, B200, RTX-3090, RTX-4090) or one from --hardware-file")
    p.add_argument("--hardware-file", help="TOML with [[hardware]] tables of your own")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--attention", default="flash", choices=ATTENTION,
                   help="memory-efficient attention kernels, or materialized scores")
    p.add_argument("--activations", default="formula", choices=("formula", "traced"),
                   help="closed form, or counted on the actual model under fake tensors (slower)")
    p.add_argument("--engine", choices=PLAN_ENGINES,
                   help="the engine that trains it: what it keeps in memory and how it communicates "
                        "(default: the model TOML's [plan] engine, else scaletrain)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction,
                   help="torch.compile fuses the element-wise work (default: the [plan] table's, else off)")
    p.add_argument("--fp8", action=argparse.BooleanOptionalAction,
                   help="the block linears that precision.mode=fp8 converts (its layer rule) at the fp8 peak "
                        "(default: the [plan] table's, else off)")
    p.add_argument("--moe-imbalance", type=load_factor, metavar="X",
                   help="a mixture of experts' load: max / mean tokens per expert (the moe_imbalance a run logs); "
                        "the busiest expert-parallel rank computes and receives X times the mean. Default: measured "
                        "with --calibrate, else 1 (balanced, as published figures force the router)")
    p.add_argument("--workers", type=int, default=1, metavar="N",
                   help="the cluster is N sites (e.g. datacenters) of equal size joined by --workers-link; the "
                        "data-parallel workers (dp_replicate groups) are the sites. When that link is slow the search "
                        "tries local SGD / DiLoCo (--parallel.dp_sync, sync_every, sync_fragments, sync_delay, "
                        "sync_dtype; default diloco every 50 steps) and says where it overtakes synchronous training")
    p.add_argument("--workers-link", type=float, metavar="GBPS",
                   help="bandwidth of the link between the sites, GB/s each way, shared by every rank that sends "
                        "over it")
    g = p.add_argument_group("aliases of config keys (each the same as its --section.key=value)")

    def alias(flag: str, help: str = "", **kw):
        g.add_argument(flag, dest=alias_dest(flag), help=f"alias of --{ALIASES[flag]}" + (f"; {help}" if help else ""),
                       **kw)

    alias("--seq-len", type=int, metavar="N", help="default 2048 (without --config)")
    alias("--global-batch", type=at_least_1("global batch"), metavar="N",
          help="sequences per optimizer step, default 256 (without --config); --train.global_batch=0 derives it "
               "from the micro-batch and accumulation")
    alias("--precision", choices=PRECISIONS, help="default bf16-mixed (without --config)")
    alias("--optimizer", choices=OPTIMIZERS)
    alias("--zero", type=int, choices=ZERO_STAGES)
    alias("--tp", type=at_least_1("tp"), metavar="N")
    alias("--pp", type=at_least_1("pp"), metavar="N")
    alias("--dp-replicate", type=at_least_1("dp_replicate"), metavar="N")
    alias("--dp-shard", type=at_least_1("dp_shard"), metavar="N")
    alias("--micro-batch", type=at_least_1("micro_batch"), metavar="N")
    alias("--ac", choices=AC_MODES)
    alias("--sp", metavar="true|false", help="default: on under tensor parallelism")
    alias("--schedule", choices=PP_SCHEDULES)
    alias("--virtual", type=at_least_1("pp_virtual_stages"), metavar="N")
    alias("--offload", action="store_const", const=True, help="sets it to true")
    alias("--cp", type=at_least_1("cp"), metavar="N",
          help="context parallel: ranks that split every sequence; each keeps its own tokens' activations, and "
               "--cp-method's attention backward buffers")
    alias("--cp-method", choices=CP_METHODS, help="how attention reaches the other cp ranks' keys (with --cp)")
    alias("--ep", type=at_least_1("ep"), metavar="N",
          help="expert parallel: a mixture's experts split over N ranks borrowed from dp_shard × cp × tp (N divides "
               "the experts and those ranks); the tokens travel by all-to-all")
    p.add_argument("--top", type=int, help="layouts to show (default 10); with --measure, the K best predicted "
                                           "are run and re-ranked by their measured step time")
    p.add_argument("--json", action="store_true", help="print JSON (schema in docs/planner.md)")
    p.add_argument("--chart", help="stacked memory bars of the top layouts, to this PNG")
    p.add_argument("--measure", action="store_true",
                   help="run one real step of the best (or fixed) layout here and print predicted vs measured")
    p.add_argument("--calibrate", action="store_true",
                   help="plan for this machine with --nproc local ranks, its step times from a calibration measured "
                        "here (compute, collectives, overlap; cached); --measure implies it")
    p.add_argument("--nproc", type=int, help="ranks for --measure or --calibrate (default 1)")
    p.add_argument("--comms", metavar="FILE", help="`scaletrain bench comms --json` output: use its measured "
                   "all-reduce bus bandwidth for the collectives inside a node")
    p.set_defaults(func=run, takes_overrides=True, parser=p)


def schedule_parser(sub) -> None:
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
    p.set_defaults(func=schedule, takes_overrides=False, parser=p)


def run(args: argparse.Namespace, extra: list[str]) -> int:
    """`scaletrain plan` with its parsed options `args` and config options `extra`; the exit
    code: 0 when the best layout fits, else 1 (with --measure, the measured run's code)."""
    from scaletrain.plan import plan, report
    from scaletrain.plan.options import ALIASES, read_request

    check_png("--chart", args.chart)
    hardware, nodes, per_node = args.hardware, args.nodes, args.gpus_per_node
    here = args.measure or args.calibrate
    if here:  # plan for the devices at hand, where the step will run
        nodes, per_node = 1, args.nproc or 1
    aliases = {flag: getattr(args, alias_dest(flag)) for flag in ALIASES}
    req = read_request(args.model, args.config, aliases, extra, world=nodes * per_node)
    if here:
        from scaletrain.hardware import local_hardware
        from scaletrain.runtime import pick_device

        hardware = local_hardware(pick_device(req.cfg.train.device))
    if args.measure and (args.engine or "scaletrain") != "scaletrain":
        raise UserError(f"--measure runs scaletrain's trainer; it cannot measure a plan for --engine {args.engine}")
    comms_note = None
    if args.comms:  # the bus bandwidth measured by `scaletrain bench comms --json`, inside a node
        from dataclasses import replace

        from scaletrain.bench.comms import read_bus_bandwidth
        from scaletrain.hardware import Hardware, lookup

        bus, comms_note = read_bus_bandwidth(args.comms)
        hw = hardware if isinstance(hardware, Hardware) else lookup(hardware, args.hardware_file)
        hardware = replace(hw, bus_GBps=bus)
    result = plan(req.model, hardware=hardware, hardware_file=args.hardware_file, nodes=nodes,
                  gpus_per_node=per_node, attention=args.attention, layout=req.layout,
                  top_k=10 if args.top is None else args.top, activations=args.activations, engine=args.engine,
                  compile=args.compile, fp8=args.fp8, workers=args.workers, workers_link=args.workers_link,
                  sync=req.sync, calibrate=_calibration_here() if here else None, moe_imbalance=args.moe_imbalance,
                  name=None if args.model else f"{args.config} [model]" if args.config else "(the --model.* options)",
                  **req.workload)
    if args.json:
        print(report.to_json(result))
    else:
        print(report.table(result))
        print()
        print(report.breakdown(result["layouts"][0]))
        print()
        print("\n".join(result["explanation"]))
        if comms_note:
            print(f"Collectives inside a node: {comms_note}.")
    if args.chart:
        report.chart(result, args.chart)
        if not args.json:
            print(f"wrote {args.chart}")
    if args.measure:
        return _measure(args, result, req.overrides)
    return 0 if result["layouts"][0].fits else 1


def _measure(args: argparse.Namespace, result: dict, overrides) -> int:
    """--measure: a real step of the best (or fixed) layout, or with --top K of the K best, here."""
    from scaletrain.measure import measure_and_print, measure_top

    if not args.config:
        raise UserError("--measure runs a real step and needs a training config: --config FILE")
    if args.top is not None and args.top > 1:  # the K best, re-ranked by what they measure
        candidates = [ev for ev in result["layouts"] if ev.fits][:args.top]
        if not candidates:
            raise UserError("plan --measure --top: no layout fits, so none is measured")
        measure_top(args.config, candidates, nproc=args.nproc or 1, overrides=overrides)
        return 0
    code = measure_and_print(args.config, result, nproc=args.nproc or 1, overrides=overrides)
    return code or (0 if result["layouts"][0].fits else 1)


def _calibration_here():
    """The planner's `calibrate`: this machine's calibration, measured where missing (said on stderr)."""
    import functools

    from scaletrain.measure import calibration

    return functools.partial(calibration, note=lambda line: print(line, file=sys.stderr))


def schedule(args: argparse.Namespace, extra: list[str]) -> int:
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
