"""`scaletrain export`: a checkpoint's weights written as safetensors, a Hugging Face folder or PEFT adapters."""

from __future__ import annotations

import argparse

from scaletrain.cli.common import checkpoint_to_read
from scaletrain.errors import os_errors_named


def add_parser(sub) -> None:
    p = sub.add_parser("export", help="write a checkpoint's model weights to safetensors")
    p.add_argument("checkpoint", help="a checkpoint folder (runs/.../checkpoints/step_*), or a run folder: its "
                                      "newest complete checkpoint")
    p.add_argument("--out", required=True, help="output .safetensors file, or folder with --format hf (missing "
                                                "folders are created)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing --out (the new one is written whole first, then put in its place)")
    p.add_argument("--format", choices=("safetensors", "hf", "peft"), default="safetensors",
                   help="safetensors: one file, scaletrain names; hf: a Hugging Face model folder (config.json, "
                        "safetensors, generation_config, the data's tokenizer) that transformers loads with no code "
                        "(adapters merged into their base); peft: an adapter run's adapters alone, as a folder "
                        "that peft.PeftModel.from_pretrained loads onto the base")
    p.add_argument("--base", metavar="FOLDER",
                   help="adapters only: where their base is now (default: where the run read it, or a PEFT "
                        "folder's base_model_name_or_path); its sha256 must be the one they were trained on")

    p.set_defaults(func=run, takes_overrides=False, parser=p)


def run(args: argparse.Namespace, extra: list[str]) -> int:
    from scaletrain.trained.adapters import export_peft
    from scaletrain.trained.export import export_safetensors
    from scaletrain.trained.export_hf import export_hf

    write = {"hf": export_hf, "peft": export_peft, "safetensors": export_safetensors}[args.format]
    with os_errors_named({"--out": args.out, "checkpoint": args.checkpoint, "--base": args.base or ""}):
        out = write(checkpoint_to_read(args.checkpoint, peft=False), args.out, overwrite=args.overwrite, base=args.base)
    print(f"wrote {out}")
    return 0
