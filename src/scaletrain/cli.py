"""`scaletrain VERB ...`: one thin sub-command per verb, each a call into the library.

A user error (bad config, data, checkpoint or launch request) prints one line per problem
and exits with code 2; there is no traceback for those.
"""

from __future__ import annotations

import argparse
import signal
import sys
from typing import Sequence

from scaletrain.errors import UserError

EXIT_USER_ERROR = 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2, like our other user errors
        raise UserError(f"{self.prog}: {message} (see {self.prog} --help)")


def _train(args: argparse.Namespace, extra: list[str]) -> int:
    from scaletrain.config import describe_options, load_config

    if args.help_config:
        print(describe_options())
        return 0
    cfg = load_config(args.config, extra)
    if args.print_config:
        print(cfg.to_json())
        return 0
    from scaletrain.train.trainer import Trainer

    result = Trainer(cfg).fit()
    if result["stopped_by"] is not None:
        return 128 + int(result["stopped_by"])
    return 0


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
        return args.func(args, extra)
    except UserError as e:
        for line in e.lines:
            print(f"scaletrain: error: {line}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        return 128 + signal.SIGINT


if __name__ == "__main__":
    sys.exit(main())
