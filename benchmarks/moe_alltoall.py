"""Bytes the expert-parallel all-to-alls send per step, against the theory.

Under expert parallelism (`parallel.ep = N`) each MoE block sends every routed token slot to
the rank holding its expert and brings the output back: two all-to-alls forward (dispatch,
combine) and two backward (their gradients), each moving, per rank and micro-batch,

    tokens x top_k x dim x bytes            token slots, the rank's own share included
    ... x (ep - 1) / ep                     what leaves the rank, when the routing is even

This script *counts* what is sent: every call of `torch.distributed.all_to_all_single` and
`all_to_all` (and the functional collectives' all_to_all_single) is wrapped on each rank, before
scaletrain builds the model, and adds up the bytes of its input tensor, those destined for the
rank itself apart. Payload (floating-point tensors, rows of `dim`) is counted apart from the
small integer exchanges (how many tokens go where). Per step and rank it prints the counted
payload against the theory with the own share included (summed over the ranks, dropless routing:
equal whatever the routing; one rank's combine returns what its experts received) and the bytes
that left the rank against the (ep - 1) / ep theory (equal in expectation over an even routing;
the measured share of slots sent away is printed beside it).

    python benchmarks/moe_alltoall.py [--nproc 2] [--ep 2] [--steps 3] [--section.key=value ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
from pathlib import Path

MOE = {"model.moe_experts": 8, "model.moe_top_k": 2, "model.moe_hidden": 512, "train.global_batch": 8,
       "train.micro_batch": 4}


class Counter:
    """The bytes of every all-to-all this rank starts, by kind: payload (floating point) sent to
    other ranks, payload kept (the rank's own chunk), and integer metadata."""

    def __init__(self):
        self.sent = self.kept = self.meta = 0
        self.calls = 0
        self.value_bytes: set[int] = set()  # bytes per value of the payloads seen (fp32: 4, bf16: 2)

    def add(self, tensors: list, own: int | None) -> None:
        """`tensors`: the chunks in rank order; `own`: this rank's index among them (None: unknown)."""
        self.calls += 1
        sizes = [t.numel() * t.element_size() for t in tensors]
        if not any(t.is_floating_point() for t in tensors):
            self.meta += sum(sizes)
            return
        self.value_bytes.update(t.element_size() for t in tensors if t.is_floating_point())
        kept = sizes[own] if own is not None else 0
        self.kept += kept
        self.sent += sum(sizes) - kept


def _size_of(group) -> int:
    import torch.distributed as dist

    return dist.get_world_size(group)


def _rank_in(group) -> int | None:
    import torch.distributed as dist

    try:
        return dist.get_rank(group) if group is None or isinstance(group, dist.ProcessGroup) else None
    except (RuntimeError, ValueError):
        return None


def install(counter: Counter) -> None:
    """Wrap the all-to-alls where scaletrain can reach them (before its modules import them)."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    single, many = c10d.all_to_all_single, c10d.all_to_all

    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                          async_op=False):
        n = _size_of(group)
        parts = list(input.split(list(input_split_sizes))) if input_split_sizes else list(input.chunk(n))
        counter.add(parts, _rank_in(group))
        return single(output, input, output_split_sizes, input_split_sizes, group, async_op)

    def all_to_all(output_tensor_list, input_tensor_list, group=None, async_op=False):
        counter.add(list(input_tensor_list), _rank_in(group))
        return many(output_tensor_list, input_tensor_list, group, async_op)

    for module in (dist, c10d):
        module.all_to_all_single, module.all_to_all = all_to_all_single, all_to_all
    try:
        import torch.distributed._functional_collectives as fc
    except ImportError:
        return
    for name in ("all_to_all_single", "all_to_all_single_autograd"):
        original = getattr(fc, name, None)
        if original is None:
            continue

        def functional(input, output_split_sizes, input_split_sizes, group, tag="", _original=original):
            parts = list(input.split(list(input_split_sizes))) if input_split_sizes else [input]
            counter.add(parts, _rank_in(group) if input_split_sizes else None)
            return _original(input, output_split_sizes, input_split_sizes, group, tag)
        setattr(fc, name, functional)


def has_ep() -> bool:
    from scaletrain.config import ParallelConfig

    return any(f.name == "ep" for f in dataclasses.fields(ParallelConfig))


def rank_main(spec_path: str, out_path: str) -> int:
    """One rank: count the all-to-alls of each step; rank 0 writes every rank's counts."""
    import torch.distributed as dist

    counter = Counter()
    install(counter)  # first: before scaletrain's modules import (and perhaps bind) the all-to-alls

    from scaletrain.config import load_config
    from scaletrain.launch.ranks import flags, quiet, read_spec, write_result
    from scaletrain.runtime import init_worker
    from scaletrain.train.trainer import Trainer

    args, extra = _parser().parse_known_args(read_spec(spec_path)["argv"])
    cfg = load_config(args.config, [*flags(MOE), f"--parallel.ep={args.ep}", *extra,
                                    *flags(quiet(tempfile.mkdtemp(prefix="moe-a2a-")))])
    rt = init_worker(cfg)
    trainer = Trainer(cfg, rt, stream=open(os.devnull, "w"))
    batches = trainer.batches()
    trainer.train_step(batches)  # warm-up: any set-up exchange stays out of the count
    per_step = []
    for _ in range(args.steps):
        dist.barrier()
        before = (counter.sent, counter.kept, counter.meta, counter.calls)
        trainer.train_step(batches)
        per_step.append([a - b for a, b in zip((counter.sent, counter.kept, counter.meta, counter.calls), before)])
    every = [None] * rt.world_size
    dist.all_gather_object(every, per_step)
    if rt.rank == 0:
        b = trainer.layout
        write_result(out_path, {"per_step": every, "micro_batch": b.micro_batch, "grad_accum": b.grad_accum,
                                "seq_len": cfg.data.seq_len, "dim": cfg.model.dim, "top_k": cfg.model.moe_top_k,
                                "blocks": cfg.model.moe_blocks, "precision": cfg.precision.mode,
                                "value_bytes": sorted(counter.value_bytes), "explain": b.explain()})
    return 0


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/tiny.toml")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--ep", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    return ap


def main(argv=None) -> None:
    args, extra = _parser().parse_known_args(argv)
    if not has_ep():
        sys.exit("moe_alltoall: this scaletrain has no parallel.ep yet (expert parallelism, issue 31, is being "
                 "built); run this benchmark once it is merged")
    from scaletrain.launch.ranks import run_on_ranks

    forwarded = [f"--config={args.config}", f"--nproc={args.nproc}", f"--ep={args.ep}", f"--steps={args.steps}",
                 *extra]
    r = run_on_ranks("moe_alltoall:rank_main", {"argv": forwarded}, args.nproc,
                     pythonpath=(str(Path(__file__).resolve().parent),))
    if not r["value_bytes"]:
        sys.exit("moe_alltoall: no floating-point all-to-all was counted: the expert-parallel exchange does not go "
                 "through torch.distributed's all_to_all_single / all_to_all (update install() in this script)")
    ep, size = args.ep, max(r["value_bytes"])
    tokens = r["micro_batch"] * r["seq_len"]  # per rank and micro-batch
    # 2 all-to-alls forward + 2 backward per MoE block and micro-batch, each every slot's row
    whole = 4 * r["blocks"] * r["grad_accum"] * tokens * r["top_k"] * r["dim"] * size
    away = whole * (ep - 1) / ep
    print(f"{args.config} + {MOE['model.moe_experts']} experts top {r['top_k']}; layout {r['explain']}; "
          f"{r['precision']}; per rank and step: {r['grad_accum']} micro-batch(es) of {tokens} tokens, "
          f"{r['blocks']} MoE blocks, dim {r['dim']}, {size} bytes per value (as sent; seen: {r['value_bytes']})")
    print(f"theory: 4 x blocks x micro-batches x tokens x top_k x dim x bytes = {whole / 2**20:.3f} MiB of slots, "
          f"of which (ep-1)/ep = {away / 2**20:.3f} MiB leave the rank under an even routing")
    print(f"{'rank':>4}{'calls':>7}{'slots MiB':>11}{'vs theory':>10}{'sent away MiB':>15}{'vs (ep-1)/ep':>13}"
          f"{'share away':>11}{'metadata B':>11}")
    sums = [0.0, 0.0]
    for rank, steps in enumerate(r["per_step"]):
        sent = statistics.mean(s[0] for s in steps)
        kept = statistics.mean(s[1] for s in steps)
        meta = statistics.mean(s[2] for s in steps)
        calls = statistics.mean(s[3] for s in steps)
        total = sent + kept
        print(f"{rank:>4}{calls:>7.0f}{total / 2**20:>11.3f}{total / whole:>10.4f}{sent / 2**20:>15.3f}"
              f"{sent / away:>13.4f}{sent / total if total else 0:>11.3f}{meta:>11.0f}")
        sums = [sums[0] + total, sums[1] + sent]
    # a rank's dispatch sends its own slots (exact), its combine returns what its experts received
    # (the routing decides): over all ranks the two are equal, so the sum is exact for any routing
    n = len(r["per_step"])
    print(f"{'all':>4}{'':>7}{sums[0] / 2**20:>11.3f}{sums[0] / (n * whole):>10.4f}{sums[1] / 2**20:>15.3f}"
          f"{sums[1] / (n * away):>13.4f}{sums[1] / sums[0] if sums[0] else 0:>11.3f}")


if __name__ == "__main__":
    main()
