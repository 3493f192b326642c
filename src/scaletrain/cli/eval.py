"""`scaletrain eval`: a checkpoint's validation loss and perplexity."""

from __future__ import annotations

import argparse

from scaletrain.cli.common import checkpoint_to_read, note
from scaletrain.errors import os_errors_named


def add_parser(sub) -> None:
    p = sub.add_parser("eval", help="a checkpoint's validation loss and perplexity (one process)",
                       description="Evaluate a checkpoint. Options are the config's names (data.path, "
                                   "train.eval_batches, train.device), with short aliases.")
    p.add_argument("checkpoint", help="a checkpoint folder (runs/.../checkpoints/step_*), or a run folder: its "
                                      "newest complete checkpoint; or a PEFT adapter folder (on --base)")
    p.add_argument("--data", "--data.path", dest="data", metavar="FOLDER",
                   help="a prepared folder: its validation split, or all of it if it has none (default: the data "
                        "the checkpoint was trained on)")
    p.add_argument("--batches", "--train.eval_batches", dest="batches", type=int, metavar="N",
                   help="validation batches of the run's global batch (default: its train.eval_batches; 0 = every "
                        "whole batch)")
    p.add_argument("--device", "--train.device", dest="device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="where to run the model (default auto: cuda if available)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--base", metavar="FOLDER",
                   help="adapters only: where their base is now (default: where the run read it, or a PEFT "
                        "folder's base_model_name_or_path); its sha256 must be the one they were trained on")
    p.set_defaults(func=run, takes_overrides=False, parser=p)


def run(args: argparse.Namespace, extra: list[str]) -> int:
    import json

    from scaletrain.trained.evaluate import evaluate_checkpoint

    with os_errors_named({"checkpoint": args.checkpoint, "data.path": args.data or "", "--base": args.base or ""}):
        r = evaluate_checkpoint(checkpoint_to_read(args.checkpoint), args.data, args.batches, args.device, report=note,
                                base=args.base)
    if args.json:
        print(json.dumps(r, indent=1))
    elif "val_rewards/chosen" in r:  # a preference-trained checkpoint (pairs: accuracy and margin; KTO: rewards)
        shown = (f"accuracy {100 * r['val_rewards/accuracies']:.1f}%  margin {r['val_rewards/margins']:.4f}"
                 if "val_rewards/accuracies" in r else f"reward desirable {r['val_rewards/chosen']:.4f}  undesirable "
                 f"{r['val_rewards/rejected']:.4f}  kl {r['val_kl']:.4f}")
        print(f"val_loss {r['val_loss']:.4f}  {shown}  ({r['data']}, {r['split']}: {r['batches']} batch(es) = "
              f"{r['examples']:,} examples; step {r['step']})")
    else:
        scheme = f"  [quantized: {r['quantized']}]" if r.get("quantized") else \
            f"  [fake-quantized: train.qat={r['fake_quantized']}]" if r.get("fake_quantized") else ""
        print(f"val_loss {r['val_loss']:.4f}  val_ppl {r['val_ppl']:.2f}{scheme}  ({r['data']}, {r['split']}: "
              f"{r['batches']} batch(es) = {r['windows']:,} windows, {r['tokens']:,} tokens; step {r['step']})")
        for name, loss in r.get("sources", {}).items():
            print(f"  {name}: val_loss {loss:.4f}")
    return 0
