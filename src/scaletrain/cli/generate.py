"""`scaletrain generate`: text sampled after a prompt from a checkpoint or a Hugging Face model folder."""

from __future__ import annotations

import argparse
import sys

from scaletrain.cli.common import checkpoint_to_read, note
from scaletrain.errors import os_errors_named


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="sample text from a checkpoint or a Hugging Face model folder",
                       description="Sample text after a prompt, one process, with a key/value cache (each new token "
                                   "costs one position). The tokenizer is the run's data folder's (or --data's); a "
                                   "Hugging Face folder's own.")
    p.add_argument("source", help="a checkpoint folder (runs/.../checkpoints/step_*), a Hugging Face model folder, "
                                  "or a PEFT adapter folder (on --base)")
    p.add_argument("--prompt", required=True, help="the text to continue")
    p.add_argument("--max-new-tokens", type=int, default=200, help="tokens to sample (default 200)")
    p.add_argument("--temperature", type=float, default=0.8, help="below 1: more predictable; above: more varied "
                                                                  "(default 0.8)")
    p.add_argument("--top-k", type=int, default=50, help="draw among the k likeliest tokens (default 50; 0: all)")
    p.add_argument("--seed", type=int, default=0, help="seed of the draws (default 0)")
    p.add_argument("--data", help="a prepared folder whose tokenizer to use (default: the run's data)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="where to run the model (default auto: cuda if available)")
    p.add_argument("--base", metavar="FOLDER",
                   help="adapters only: where their base is now (default: where the run read it, or a PEFT "
                        "folder's base_model_name_or_path); its sha256 must be the one they were trained on")
    p.set_defaults(func=run, takes_overrides=False, parser=p)


def run(args: argparse.Namespace, extra: list[str]) -> int:
    from scaletrain.trained.generate import generate_text

    def stream(piece: str) -> None:  # each piece as it is sampled (a long sample shows as it grows)
        sys.stdout.write(piece)
        sys.stdout.flush()

    started = False

    def first(piece: str) -> None:
        nonlocal started
        if not started:  # the prompt once the model is loaded and sampling has begun
            sys.stdout.write(args.prompt)
            started = True
        stream(piece)

    with os_errors_named({"source": args.source, "--data": args.data or "", "--base": args.base or ""}):
        # a run folder: its newest complete checkpoint, as eval and export take it
        generate_text(checkpoint_to_read(args.source), args.prompt, max_new_tokens=args.max_new_tokens,
                      temperature=args.temperature, top_k=args.top_k, seed=args.seed, data=args.data,
                      device=args.device, stream=first, report=note, base=args.base)
    if not started:  # no token asked for: the prompt alone
        sys.stdout.write(args.prompt)
    print()
    return 0
