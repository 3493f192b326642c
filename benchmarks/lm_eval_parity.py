"""Downstream task scores: `scaletrain eval --tasks` against lm-eval's own Hugging Face backend.

A small model is trained on a text (CPython's `json` package source, shipped with Python, and the sentence
the shipped tasks ask about; or --text),
prepared with a trained BPE tokenizer; its checkpoint is scored on the shipped tasks (scaletrain_choice,
scaletrain_complete) by scaletrain (HarnessLM on the model as scaletrain loads it) and by lm-eval's `hf`
model type on `scaletrain export --format hf` of the same checkpoint. Printed: each score from both, the
largest difference of one request's log-likelihood, the generations that differ, and each side's time.

    nice python benchmarks/lm_eval_parity.py [--steps 200] [--dim 128] [--layers 4] [--batch-size 8]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch

from scaletrain.config import load_config
from scaletrain.data.prepare import prepare
from scaletrain.train.downstream import hub, random_state_kept, scores, task_names, task_specs
from scaletrain.train.trainer import Trainer
from scaletrain.trained.export_hf import export_hf
from scaletrain.trained.task_eval import evaluate_checkpoint_tasks

TASKS = "scaletrain_choice,scaletrain_complete"
FOX = "the quick brown fox jumps over the lazy dog while the model trains one step at a time\n"


def hf_backend(hf_dir: Path, batch_size: int) -> dict:
    from lm_eval import simple_evaluate

    specs, manager = task_specs(task_names(TASKS, "tasks"), "", "tasks")
    with hub(False), random_state_kept(torch.device("cpu")):
        return simple_evaluate(model="hf", model_args={"pretrained": str(hf_dir), "dtype": "float32", "device": "cpu"},
                               tasks=specs, task_manager=manager, batch_size=batch_size, bootstrap_iters=0,
                               log_samples=True, random_seed=0, numpy_random_seed=0, torch_random_seed=0,
                               fewshot_random_seed=0)


def answers(samples: dict) -> dict:
    return {(task, s["doc_id"], k): r[0] for task, rows in samples.items() for s in rows
            for k, r in enumerate(s["resps"])}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--text", default=None, help="a text file to train on (default: CPython's json package)")
    args = ap.parse_args()
    import json as json_pkg

    tmp = Path(tempfile.mkdtemp(prefix="lm-eval-parity-"))
    if args.text:
        text = Path(args.text).read_text()
    else:  # code, and the sentences the shipped tasks ask about
        text = "".join(p.read_text() for p in sorted(Path(json_pkg.__file__).parent.glob("*.py"))) + FOX * 300
    (tmp / "corpus.txt").write_text(text)
    prepare([tmp / "corpus.txt"], tmp / "data", tokenizer="bpe", vocab_size=1024)
    cfg = load_config(None, {"model.dim": args.dim, "model.n_layers": args.layers, "model.n_heads": 4,
                             "model.max_seq_len": 128, "model.vocab_size": 0, "data.seq_len": 128,
                             "data.path": str(tmp / "data"), "train.global_batch": 16, "train.steps": args.steps,
                             "train.device": "cpu", "train.sample_tokens": 0, "log.progress": "off",
                             "log.tensorboard": False, "log.run_dir": str(tmp / "run"), "log.summary": False})
    ckpt = Path(Trainer(cfg).fit()["checkpoint"])
    export_hf(ckpt, tmp / "hf")
    t0 = time.perf_counter()
    ours = evaluate_checkpoint_tasks(ckpt, TASKS, batch_size=args.batch_size, device="cpu")
    t1 = time.perf_counter()
    ref = hf_backend(tmp / "hf", args.batch_size)
    t2 = time.perf_counter()
    theirs = scores(ref)
    print(f"{'score':<46} {'scaletrain':>10} {'lm-eval hf':>10}")
    for name in sorted(set(ours["scores"]) | set(theirs)):
        print(f"{name:<46} {ours['scores'].get(name, float('nan')):>10.4f} {theirs.get(name, float('nan')):>10.4f}")
    a, b = answers(ours["samples"]), answers(ref["samples"])
    lls = [abs(a[k][0] - b[k][0]) for k in b if not isinstance(b[k], str)]
    texts = [k for k in b if isinstance(b[k], str) and a[k] != b[k]]
    print(json.dumps({"requests": len(b), "max_loglik_diff": max(lls), "greedy_flags_differ":
                      sum(a[k][1] != b[k][1] for k in b if not isinstance(b[k], str)),
                      "generations_differ": len(texts), "scaletrain_s": round(t1 - t0, 2),
                      "hf_backend_s": round(t2 - t1, 2), "checkpoint_step": args.steps}))


if __name__ == "__main__":
    main()
