"""A small instruction-tuning run on CPU: the answers' validation loss falls, and the prompts'
tokens are provably not trained on.

The instruction set is built from text that ships with CPython: for each documentation topic
(pydoc_data.topics) the prompt "What is TOPIC?" and the answer the start of its text, and for
each documented built-in the prompt "What does NAME do?" and the start of its docstring; it is
prepared with `scaletrain prepare --chat-format plain` (byte-level; "User: ...\\nAssistant: ...\\n",
the loss mask on the answers) with 20% of the records held out. The demo's model (the tiny
preset) trains on it from scratch, answers only (data.loss_mask=auto).

Measured:
* the validation loss (the mean over the held-out answers' tokens, as training counts them)
  before training and every `--eval-every` steps;
* the proof: every micro-batch's loss is taken through a wrapper that keeps the logits'
  gradient, and over every step of the run the largest |d loss / d logit| at a prompt position
  (a target the mask leaves out) is reported: exactly 0.0 means the prompts' targets add nothing
  to any gradient (the prompts are still read, as the context of the answers);
* the share of the targets counted (tokens_trained against every target seen).

    nice python benchmarks/instruction_tuning.py [--steps 200] [--batch 8] [--eval-every 50] [--eval-batches 10]
"""

from __future__ import annotations

import argparse
import builtins
import contextlib
import json
import os
import tempfile
import time
from pathlib import Path

import torch


def records() -> list[dict]:
    """Prompt/response pairs from CPython's own documentation."""
    from pydoc_data.topics import topics

    out = [{"prompt": f"What is {key}?", "response": " ".join(topics[key].split())[:600]} for key in sorted(topics)]
    for name in sorted(dir(builtins)):
        doc = getattr(getattr(builtins, name), "__doc__", None)
        if not name.startswith("_") and doc:
            out.append({"prompt": f"What does {name} do?", "response": " ".join(doc.split())[:600]})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=8, help="global batch, windows of 128 bytes")
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--eval-batches", type=int, default=10, help="held-out batches per evaluation (0: all)")
    args = ap.parse_args()
    from scaletrain.config import load_config
    from scaletrain.data import prepare
    from scaletrain.data.dataset import IGNORE_INDEX
    from scaletrain.model.loss import cross_entropy_sum
    from scaletrain.train.trainer import Trainer

    worst = {"prompt": 0.0, "answer_min": float("inf"), "targets": 0}

    def recording_loss(logits, targets):
        """The training loss; after backward, the logits' gradient at the prompts' positions is read."""
        if logits.requires_grad:  # (evaluation runs without gradients)
            logits.register_hook(lambda g: _record(g, targets))
        return cross_entropy_sum(logits, targets)

    def _record(grad, targets):
        left_out = targets == IGNORE_INDEX
        worst["prompt"] = max(worst["prompt"], grad[left_out].abs().max().item() if left_out.any() else 0.0)
        counted = grad[~left_out].abs().amax(-1)
        worst["answer_min"] = min(worst["answer_min"], counted.min().item())  # every answer token moves
        worst["targets"] += targets.numel()
        return grad

    with tempfile.TemporaryDirectory(prefix="instruct-") as tmp:
        tmp = Path(tmp)
        recs = records()
        (tmp / "qa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
        meta = prepare([tmp / "qa.jsonl"], tmp / "qa", chat_format="plain", val_fraction=0.2, workers=1)
        cfg = load_config(None, {
            "model.preset": "tiny", "data.path": str(tmp / "qa"), "data.seq_len": 128,
            "train.global_batch": args.batch, "train.steps": args.steps, "train.eval_every": args.eval_every,
            "train.eval_batches": args.eval_batches, "train.device": "cpu", "train.sample_tokens": 0,
            "optim.warmup_steps": 25,
            "log.run_dir": str(tmp / "run"), "log.tensorboard": False, "log.progress": "off", "log.every": 50,
            "checkpoint.save_final": False})
        devnull = open(os.devnull, "w")  # noqa: SIM115 - the Trainer logs to it for as long as it lives
        with contextlib.redirect_stdout(devnull):
            trainer = Trainer(cfg, stream=devnull, loss_fn=recording_loss)
            before = trainer.evaluate()["val_loss"]
            t0 = time.perf_counter()
            result = trainer.fit()
            seconds = time.perf_counter() - t0
        rows = [r for r in result["history"] if "val_loss" in r]
        print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s); {len(recs)} records "
              f"({meta['num_documents']} train, {meta['num_val_documents']} held out), "
              f"{meta['num_tokens']:,} training tokens of which {meta['num_counted_tokens']:,} answers'; "
              f"model tiny ({trainer.pm.num_params / 1e6:.2f}M), {args.steps} steps of {args.batch} x 128, "
              f"{seconds:.0f} s")
        print(f"validation loss over the held-out answers' tokens ({args.eval_batches or 'all'} batch(es) of "
              f"{args.batch} windows):")
        print(f"  step {0:>4}  {before:.4f}")
        for r in rows:
            print(f"  step {r['step']:>4}  {r['val_loss']:.4f}")
        last = result["history"][-1]
        print(f"targets counted: {last['tokens_trained']:,} of {worst['targets']:,} seen "
              f"({100 * last['tokens_trained'] / worst['targets']:.1f}%)")
        print(f"largest |d loss / d logit| at a prompt position over all {args.steps} steps: {worst['prompt']!r}; "
              f"smallest largest-|gradient| of an answer position: {worst['answer_min']:.3g}")
        prompt = "User: What is assert?\nAssistant: "
        with contextlib.redirect_stdout(devnull):
            text = trainer.sample(prompt, 120)
        print(f"sample: {text!r}")


if __name__ == "__main__":
    main()
