"""`scaletrain eval`: a checkpoint's validation loss and perplexity, or (--tasks) its downstream task scores."""

from __future__ import annotations

import argparse

from scaletrain.cli.common import checkpoint_to_read, note
from scaletrain.errors import os_errors_named


def add_parser(sub) -> None:
    p = sub.add_parser("eval", help="a checkpoint's validation loss and perplexity, or its lm-eval task scores "
                                    "(--tasks; one process)",
                       description="Evaluate a checkpoint. Options are the config's names (data.path, "
                                   "train.eval_batches, train.device), with short aliases.")
    p.add_argument("checkpoint", help="a checkpoint folder (runs/.../checkpoints/step_*), or a run folder: its "
                                      "newest complete checkpoint; or a PEFT adapter folder (on --base)")
    p.add_argument("--data", "--data.path", dest="data", metavar="FOLDER",
                   help="a prepared folder: its validation split, or all of it if it has none (default: the data "
                        "the checkpoint was trained on); with --tasks, the folder whose tokenizer to use")
    p.add_argument("--batches", "--train.eval_batches", dest="batches", type=int, metavar="N",
                   help="validation batches of the run's global batch (default: its train.eval_batches; 0 = every "
                        "whole batch)")
    p.add_argument("--device", "--train.device", dest="device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="where to run the model (default auto: cuda if available)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--base", metavar="FOLDER",
                   help="adapters only: where their base is now (default: where the run read it, or a PEFT "
                        "folder's base_model_name_or_path); its sha256 must be the one they were trained on")
    t = p.add_argument_group("downstream tasks (lm-evaluation-harness: pip install 'scaletrain[eval]')")
    t.add_argument("--tasks", "--eval.tasks", dest="tasks", metavar="NAMES",
                   help="score these lm-eval tasks (comma-separated) instead of the validation loss: lm-eval's, "
                        "--include's, or scaletrain's own scaletrain_choice and scaletrain_complete")
    t.add_argument("--limit", "--eval.limit", dest="limit", type=int, default=0, metavar="N",
                   help="the first N examples of each task (default 0: all)")
    t.add_argument("--include", "--eval.include", dest="include", default="", metavar="FOLDER",
                   help="a folder of lm-eval task YAML files")
    t.add_argument("--download", "--eval.download", dest="download", action="store_true",
                   help="let lm-eval download a task's data set (default: local or cached data only)")
    t.add_argument("--batch-size", "--eval.batch_size", dest="batch_size", type=int, default=8, metavar="N",
                   help="requests per forward (default 8)")
    p.set_defaults(func=run, takes_overrides=False, parser=p)


def run(args: argparse.Namespace, extra: list[str]) -> int:
    import json

    if args.tasks is not None:
        return _tasks(args)
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


def _tasks(args: argparse.Namespace) -> int:
    import json

    from scaletrain.trained.task_eval import evaluate_checkpoint_tasks

    with os_errors_named({"checkpoint": args.checkpoint, "data.path": args.data or "", "--base": args.base or ""}):
        r = evaluate_checkpoint_tasks(checkpoint_to_read(args.checkpoint), args.tasks, limit=args.limit,
                                      include=args.include, download=args.download, batch_size=args.batch_size,
                                      device=args.device, data=args.data, report=note, base=args.base)
    if args.json:
        print(json.dumps({k: v for k, v in r.items() if k != "samples"}, indent=1))
        return 0
    for name, value in r["scores"].items():
        task = name.split("/")[1]
        print(f"{name:<44} {value:.4f}  ({r['tasks'][task]} examples)")
    return 0
