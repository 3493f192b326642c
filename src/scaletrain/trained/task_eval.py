"""`scaletrain eval CKPT --tasks ...` (`evaluate_checkpoint_tasks`): a checkpoint's downstream task
scores through lm-evaluation-harness, in one process, with the model whole.

What is scored is what `generate` reads (scaletrain.trained.generate.load_for_generation): a checkpoint
(adapters merged), a `scaletrain quantize` folder, a Hugging Face model folder or a PEFT folder, with
its run's tokenizer. The model's window is its model.max_seq_len, as lm-eval's Hugging Face backend
takes it from the exported config.json, so the scores equal those of `lm-eval --model hf` on
`scaletrain export --format hf` of the same checkpoint (tests/trained/test_task_eval.py).
"""

from __future__ import annotations

from pathlib import Path

import torch

from scaletrain.errors import ConfigError, DataError
from scaletrain.train.downstream import evaluate_tasks, require_lm_eval, scores, task_names, task_specs


def evaluate_checkpoint_tasks(path: str | Path, tasks: str, *, limit: int = 0, include: str = "",
                              download: bool = False, batch_size: int = 8, device: str = "auto",
                              data: str | None = None, report=None, base: str | Path | None = None) -> dict:
    """{"checkpoint", "tasks": {name: examples scored}, "scores": {tasks/TASK/METRIC: value}, "samples"
    (lm-eval's per-example records), "device"} of checkpoint `path` on the comma-separated `tasks`."""
    from scaletrain.train.lm_eval_model import HarnessLM
    from scaletrain.trained.generate import load_for_generation

    require_lm_eval("--tasks")
    names = task_names(tasks, "--tasks")
    if limit < 0:
        raise ConfigError(f"--limit {limit} must be 0 (every example) or more")
    if batch_size < 1:
        raise ConfigError(f"--batch-size {batch_size} must be at least 1")
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is available here; use --device cpu")
    task_specs(names, include, "--tasks")  # an unknown name before the model is read
    model, tokenizer, _ = load_for_generation(path, data, report, base)
    if tokenizer.vocab_size > model.cfg.vocab_size:
        raise DataError(f"the tokenizer has {tokenizer.vocab_size} tokens, more than the model's vocabulary of "
                        f"{model.cfg.vocab_size}: give --data, the folder the model was trained on")
    dev = torch.device("cuda" if device == "cuda" or (device == "auto" and torch.cuda.is_available()) else "cpu")
    lm = HarnessLM(model.to(dev).eval(), tokenizer, max_length=model.cfg.max_seq_len, device=dev,
                   batch_size=batch_size)
    results = evaluate_tasks(lm, names, limit=limit, include=include, download=download, what="--tasks")
    return {"checkpoint": str(path), "tasks": {t: n["effective"] for t, n in results["n-samples"].items()},
            "scores": scores(results), "samples": results.get("samples", {}), "device": str(dev)}
