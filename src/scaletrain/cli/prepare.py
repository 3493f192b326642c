"""`scaletrain prepare`: text, jsonl, parquet or Arrow files tokenized into token shards."""

from __future__ import annotations

import argparse
import sys

from scaletrain.cli.common import note
from scaletrain.errors import os_errors_named


def add_parser(sub) -> None:
    p = sub.add_parser("prepare", help="tokenize text/jsonl/parquet/Arrow files or a saved dataset into token shards")
    p.add_argument("inputs", nargs="+", help="files or folders of .txt, .jsonl, .jsonl.gz, .jsonl.zst, .parquet, "
                                             ".arrow, or a folder written by a Hugging Face dataset's save_to_disk")
    p.add_argument("--out", required=True, help="output folder (must not exist or be empty)")
    p.add_argument("--tokenizer", default="byte", metavar="byte|bpe|file|HF_FOLDER",
                   help="byte-level (256 tokens), a BPE trained here, --tokenizer-file, or a Hugging Face model "
                        "folder whose tokenizer.json (and tokenizer_config.json) to use and copy")
    p.add_argument("--vocab-size", type=int, default=8192, help="BPE vocabulary size (default 8192)")
    p.add_argument("--tokenizer-file", help="a Hugging Face tokenizer.json (with --tokenizer file)")
    p.add_argument("--text-key", default="text", help="jsonl field / parquet, Arrow or dataset column with the text")
    p.add_argument("--shard-tokens", type=int, default=100_000_000, help="tokens per shard file")
    p.add_argument("--val-fraction", type=float, default=0.0, metavar="F",
                   help="hold out this share of the documents (chosen by a hash of each document's text) as a "
                        "validation split for train.eval_every and scaletrain eval (default 0: none)")
    p.add_argument("--workers", type=int, metavar="N",
                   help="tokenizer processes (default: every core; inputs under 16 MiB are tokenized in one); the "
                        "shards are byte-identical whatever N")
    p.add_argument("--chat-format", choices=("template", "plain"),
                   help="the inputs are chat/instruction jsonl: a `messages` list of {role, content} turns, or a "
                        "prompt|instruction|question field with a response|completion|output|answer field (and an "
                        "optional system); rendered with the tokenizer's chat_template (template: a Hugging Face "
                        "folder) or as \"User: ...\\nAssistant: ...\\n\" (plain), with a loss mask beside the tokens "
                        "that counts the assistant's tokens only")
    p.add_argument("--loss-on-prompt", action="store_true",
                   help="with --chat-format: count every token (the prompt's too), not the assistant's alone")
    p.add_argument("--preference", nargs="?", const="auto", choices=("pairs", "unpaired", "auto"),
                   help="the inputs are preference rows (jsonl or parquet, TRL's formats): prompt/chosen/rejected "
                        "pairs (pairs), or prompt/completion/label for KTO (unpaired); alone: read from the first "
                        "row. Text, or conversations rendered by --chat-format (template by default)")
    p.add_argument("--max-prompt-tokens", type=int, metavar="N",
                   help="with --preference: a longer prompt keeps its last N tokens (cut from the left)")
    p.add_argument("--max-length", type=int, metavar="N",
                   help="with --preference: completions are cut from the right so that prompt + completion holds "
                        "at most N tokens; a row left with no completion token is dropped and counted")
    p.add_argument("--quiet", action="store_true", help="no progress line (MB/s, tokens, ETA) on stderr")
    p.set_defaults(func=run, takes_overrides=False, parser=p)


def run(args: argparse.Namespace, extra: list[str]) -> int:
    from scaletrain.data.prepare import prepare

    with os_errors_named({"--out": args.out}):
        meta = prepare(args.inputs, args.out, tokenizer=args.tokenizer, vocab_size=args.vocab_size,
                       tokenizer_file=args.tokenizer_file, text_key=args.text_key, shard_tokens=args.shard_tokens,
                       val_fraction=args.val_fraction, workers=args.workers, chat_format=args.chat_format,
                       loss_on_prompt=args.loss_on_prompt, progress=None if args.quiet else sys.stderr,
                       report=lambda line: note(f"prepare: {line}"), preference=args.preference,
                       max_prompt_tokens=args.max_prompt_tokens, max_length=args.max_length)
    if "preference" in meta:
        from scaletrain.data.preference import summary

        print("\n".join(summary(meta, args.out)))
        return 0
    if "mask_shards" in meta:
        print(f"loss mask: {meta['num_counted_tokens']:,} of the training tokens counted "
              f"(--chat-format {meta['chat_format']}{', the prompt included' if meta['loss_on_prompt'] else ''})")
    model_vocab = meta["tokenizer"].get("model_vocab_size")
    padded = f", {model_vocab} in the model" if model_vocab else ""
    print(f"wrote {meta['num_tokens']:,} tokens ({meta['dtype']}, {len(meta['shards'])} shard(s), "
          f"{meta['num_documents']:,} documents, vocabulary {meta['tokenizer']['vocab_size']}{padded}) to {args.out}")
    if "val_shards" in meta:
        print(f"validation split: {meta['num_val_tokens']:,} tokens, {meta['num_val_documents']:,} documents "
              f"({len(meta['val_shards'])} shard(s), --val-fraction {meta['val_fraction']:g} by document)")
    return 0
