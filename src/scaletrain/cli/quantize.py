"""`scaletrain quantize`: a checkpoint's linear layers quantized (torchao) to a folder eval reads."""

from __future__ import annotations

import argparse
import os

from scaletrain.cli.common import checkpoint_to_read
from scaletrain.errors import os_errors_named
from scaletrain.vocab import QUANT_SCHEMES


def add_parser(sub) -> None:
    p = sub.add_parser("quantize", help="quantize a checkpoint's linear layers to int8/int4 (torchao), to a folder "
                                        "eval reads",
                       description="Post-training quantization with torchao. The transformer blocks' linear layers "
                                   "convert; the embeddings, the output head and small layers stay high precision "
                                   "(printed). The folder holds safetensors and JSON only: it loads without "
                                   "unpickling. A checkpoint trained with train.qat takes its own scheme.")
    p.add_argument("source", help="a checkpoint folder (runs/.../checkpoints/step_*), a run folder (its newest "
                                  "complete checkpoint), or a .safetensors file written by scaletrain export")
    p.add_argument("--scheme", required=True, choices=QUANT_SCHEMES,
                   help="int8-weight: int8 weights per channel; int8-dynamic: int8 activations per token and int8 "
                        "weights per channel; int8-int4: int8 activations and int4 weights in groups of 32")
    p.add_argument("--out", required=True, help="the folder to write (created; an existing one only with --overwrite)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out (written whole first)")
    p.set_defaults(func=run, takes_overrides=False, parser=p)


def run(args: argparse.Namespace, extra: list[str]) -> int:
    from scaletrain.trained.quantize import quantize_source

    with os_errors_named({"--out": args.out, "source": args.source}):
        source = args.source if os.path.isfile(args.source) else checkpoint_to_read(args.source, peft=False)
        out = quantize_source(source, args.scheme, args.out, overwrite=args.overwrite, report=print)
    from scaletrain.quant.ptq import folder_bytes

    print(f"wrote {out} ({folder_bytes(out) / 2**20:.2f} MiB)")
    return 0
