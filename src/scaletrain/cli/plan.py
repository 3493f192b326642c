"""`scaletrain plan`: will a model fit on a cluster, and which layout is fastest; measured here on demand."""

from __future__ import annotations

import argparse
import functools
import sys

from scaletrain.cli.common import check_png
from scaletrain.cli.plan_aliases import add_aliases, alias_dest, load_factor
from scaletrain.errors import UserError


def add_parser(sub) -> None:
    """`scaletrain plan`'s options: the cluster, the config and its keys, and their short aliases."""
    from scaletrain.plan.spec import ATTENTION
    from scaletrain.vocab import PLAN_ENGINES

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
                        "tries local SGD / DiLoCo (--parallel.sync.mode, every, fragments, delay, dtype; "
                        "default diloco every 50 steps) and says where it overtakes synchronous training")
    p.add_argument("--workers-link", type=float, metavar="GBPS",
                   help="bandwidth of the link between the sites, GB/s each way, shared by every rank that sends "
                        "over it")
    add_aliases(p)
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
    from scaletrain.measure import calibration

    return functools.partial(calibration, note=lambda line: print(line, file=sys.stderr))
