"""`scaletrain VERB ...`: one thin sub-command per verb, each a call into the library.

A user error (bad config, data, checkpoint or launch request) prints one line per problem
and exits with code 2; there is no traceback for those.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import Sequence

from scaletrain.errors import UserError

EXIT_USER_ERROR = 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2, like our other user errors
        raise UserError(f"{self.prog}: {message} (see {self.prog} --help)")


LAUNCH_FLAGS = ("--nproc", "--nnodes", "--node-rank", "--rdzv-endpoint", "--max-restarts")


def _train(args: argparse.Namespace, extra: list[str]) -> int:
    from scaletrain.config import describe_options, load_config

    if args.help_config:
        print(describe_options())
        return 0
    cfg = load_config(args.config, extra)
    if args.print_config:
        print(cfg.to_json())
        return 0
    from scaletrain.parallel import launch

    if launch.is_worker():  # started by our launcher or by torchrun
        return _train_worker(cfg)
    if args.nproc is None:
        from scaletrain.train.trainer import Trainer

        return _exit_code(Trainer(cfg).fit())
    return _launch(args, cfg)


def _launch(args: argparse.Namespace, cfg) -> int:
    """Check the whole request here, once, then start the workers."""
    from scaletrain.config import check_layout, resolve_batch
    from scaletrain.parallel import launch
    from scaletrain.parallel.dims import ParallelDims
    from scaletrain.train.trainer import default_run_dir

    world = args.nproc * args.nnodes
    dims = ParallelDims.from_config(cfg.parallel, world)
    check_layout(cfg, dims)
    resolve_batch(cfg.train, dims.dp)
    launch.pick_device(cfg.train.device, 0, args.nproc)
    worker_args = _strip_launch_flags(args.argv[1:])
    if not cfg.log.run_dir:  # every rank (and node) must write to the same folder
        worker_args.append(f"--log.run_dir={default_run_dir()}")
    return launch.launch(worker_args, nproc=args.nproc, nnodes=args.nnodes, node_rank=args.node_rank,
                         rdzv_endpoint=args.rdzv_endpoint or "", max_restarts=args.max_restarts)


def _strip_launch_flags(argv: list[str]) -> list[str]:
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in LAUNCH_FLAGS:
            skip = "=" not in arg
            continue
        out.append(arg)
    return out


def _train_worker(cfg) -> int:
    from scaletrain.errors import UserError
    from scaletrain.parallel import launch
    from scaletrain.train.trainer import Trainer

    rank = int(os.environ.get("RANK", "0"))
    try:
        rt = launch.init_worker(cfg)
        code = _exit_code(Trainer(cfg, rt).fit())
    except BaseException as e:  # noqa: BLE001 - every failure is reported in a few lines
        launch.record_worker_error(e, rank)
        code = EXIT_USER_ERROR if isinstance(e, UserError) else 1
    launch.exit_worker(code)


def _exit_code(result: dict) -> int:
    return 0 if result["stopped_by"] is None else 128 + int(result["stopped_by"])


def _prepare(args: argparse.Namespace, extra: list[str]) -> int:
    _no_extra(extra)
    from scaletrain.data.prepare import prepare

    meta = prepare(args.inputs, args.out, tokenizer=args.tokenizer, vocab_size=args.vocab_size,
                   tokenizer_file=args.tokenizer_file, text_key=args.text_key, shard_tokens=args.shard_tokens)
    print(f"wrote {meta['num_tokens']:,} tokens ({meta['dtype']}, {len(meta['shards'])} shard(s), "
          f"{meta['num_documents']:,} documents, vocabulary {meta['tokenizer']['vocab_size']}) to {args.out}")
    return 0


def _export(args: argparse.Namespace, extra: list[str]) -> int:
    _no_extra(extra)
    from scaletrain.train.export import export_safetensors

    out = export_safetensors(args.checkpoint, args.out)
    print(f"wrote {out}")
    return 0


def _schedule(args: argparse.Namespace, extra: list[str]) -> int:
    _no_extra(extra)
    from scaletrain.parallel import timeline

    timeline.check(args.schedule, args.pp, args.microbatches, args.virtual)
    placed = timeline.simulate(args.schedule, args.pp, args.microbatches, args.virtual)
    print(timeline.render_text(args.schedule, args.pp, args.microbatches, args.virtual, placed))
    if args.png:
        timeline.render_png(args.schedule, args.pp, args.microbatches, args.virtual, placed, args.png)
        print(f"wrote {args.png}")
    return 0


def _no_extra(extra: list[str]) -> None:
    if extra:
        raise UserError(f"unexpected arguments: {' '.join(extra)}")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="scaletrain", description="Train models too big or too slow for one GPU.")
    sub = parser.add_subparsers(dest="verb", required=True, parser_class=_Parser)

    p = sub.add_parser("train", help="train a model (options: --section.key=value)",
                       description="Train. Any config option can be given as --section.key=value; "
                                   "see --help-config for the list.")
    p.add_argument("--config", help="TOML config file (default: the built-in tiny CPU run)")
    p.add_argument("--print-config", action="store_true", help="print the resolved config as JSON and exit")
    p.add_argument("--help-config", action="store_true", help="list every config option and exit")
    g = p.add_argument_group("launch (several processes through PyTorch's elastic launcher)")
    g.add_argument("--nproc", type=int, help="processes (ranks) on this node; one per GPU")
    g.add_argument("--nnodes", type=int, default=1, help="number of nodes (default 1)")
    g.add_argument("--node-rank", type=int, help="this node's rank, for a fixed rendezvous at --rdzv-endpoint")
    g.add_argument("--rdzv-endpoint", help="HOST:PORT of the rendezvous, reachable from every node")
    g.add_argument("--max-restarts", type=int, default=0, help="restart the group this often after a failure")
    p.set_defaults(func=_train, takes_overrides=True)

    p = sub.add_parser("prepare", help="tokenize text/jsonl/parquet files into token shards")
    p.add_argument("inputs", nargs="+", help="files or folders of .txt, .jsonl, .parquet")
    p.add_argument("--out", required=True, help="output folder (must not exist or be empty)")
    p.add_argument("--tokenizer", choices=("byte", "bpe", "file"), default="byte",
                   help="byte-level (256 tokens), a BPE trained here, or --tokenizer-file")
    p.add_argument("--vocab-size", type=int, default=8192, help="BPE vocabulary size (default 8192)")
    p.add_argument("--tokenizer-file", help="a Hugging Face tokenizer.json (with --tokenizer file)")
    p.add_argument("--text-key", default="text", help="jsonl field / parquet column with the text")
    p.add_argument("--shard-tokens", type=int, default=100_000_000, help="tokens per shard file")
    p.set_defaults(func=_prepare, takes_overrides=False)

    p = sub.add_parser("schedule", help="draw a pipeline schedule's timeline and its bubble")
    p.add_argument("--pp", type=int, required=True, help="pipeline stages (ranks)")
    p.add_argument("--microbatches", type=int, required=True, help="micro-batches per step")
    p.add_argument("--schedule", default="1f1b", help="gpipe, 1f1b, interleaved-1f1b or zero-bubble")
    p.add_argument("--virtual", type=int, default=1, help="chunks per rank (interleaved-1f1b, zero-bubble)")
    p.add_argument("--png", help="also draw it to this PNG file")
    p.set_defaults(func=_schedule, takes_overrides=False)

    p = sub.add_parser("export", help="write a checkpoint's model weights to safetensors")
    p.add_argument("checkpoint", help="a checkpoint folder (runs/.../checkpoints/step_*)")
    p.add_argument("--out", required=True, help="output .safetensors file")
    p.set_defaults(func=_export, takes_overrides=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        parser = build_parser()
        args, extra = parser.parse_known_args(argv)
        args.argv = argv
        return args.func(args, extra)
    except UserError as e:
        for line in e.lines:
            print(f"scaletrain: error: {line}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        return 128 + signal.SIGINT


if __name__ == "__main__":
    sys.exit(main())
