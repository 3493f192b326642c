"""`scaletrain plan`'s short flags (each an alias of a config key) and the value types that check its numbers."""

from __future__ import annotations

import argparse


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


def add_aliases(p: argparse.ArgumentParser) -> None:
    """The group of short flags: each sets the config key scaletrain.plan.options.ALIASES names."""
    from scaletrain.plan.options import ALIASES
    from scaletrain.vocab import AC_MODES, CP_METHODS, OPTIMIZERS, PP_SCHEDULES, PRECISIONS, ZERO_STAGES

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
