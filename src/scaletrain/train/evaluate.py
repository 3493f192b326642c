"""`scaletrain eval CKPT`: a checkpoint's loss and perplexity on held-out data, in one process.

The windows are those the training run evaluated (train.eval_every): the same data split, the
checkpoint's data.seq_len, global batch and seed, and train.eval_batches batches of them (or
--batches), so the number matches the val_loss the run logged at the checkpoint's step. The
model runs whole, in fp32; a folder without a validation split is evaluated on all its windows.
"""

from __future__ import annotations

from pathlib import Path

import torch

from scaletrain.config import from_dict
from scaletrain.data.dataset import WindowDataset, open_data, open_validation
from scaletrain.data.loader import validation_batches
from scaletrain.errors import ConfigError, DataError
from scaletrain.train import checkpoint as ckpt
from scaletrain.train.export import load_model_from_checkpoint
from scaletrain.train.metrics import perplexity


@torch.no_grad()
def evaluate_checkpoint(path: str | Path, data: str | None = None, batches: int | None = None,
                        device: str = "auto", chunk: int = 8) -> dict:
    """Evaluate checkpoint `path` on `data` (a prepared folder; None: the data it was trained on,
    "" the built-in data): its validation split, or all of it if it has none. `batches`: global
    batches of windows (None: the run's train.eval_batches; 0: every whole batch). `chunk`:
    sequences per forward, which changes memory, not the result."""
    if batches is not None and batches < 0:
        raise ConfigError(f"--batches {batches} must be 0 (every whole batch) or more")
    if device not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"--device {device!r}: expected auto, cpu or cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is available here; use --device cpu")
    state = ckpt.read_trainer_state(Path(path))
    cfg = from_dict(state["config"])
    data_path = cfg.data.path if data is None else str(data)
    held_out = open_validation(data_path)
    tokens = held_out if held_out is not None else open_data(data_path)
    if tokens.vocab_size > cfg.model.vocab_size:
        raise DataError(f"{tokens.source}: the tokenizer has {tokens.vocab_size} tokens, more than the model's "
                        f"vocabulary of {cfg.model.vocab_size}: this data was prepared for another model")
    seq_len, global_batch, seed = cfg.data.seq_len, int(state["data"]["global_batch"]), cfg.train.seed
    dataset = WindowDataset(tokens, seq_len)
    order = validation_batches(len(dataset), global_batch, cfg.train.eval_batches if batches is None else batches,
                               seed, tokens.source)

    dev = torch.device("cuda" if device == "cuda" or (device == "auto" and torch.cuda.is_available()) else "cpu")
    model = load_model_from_checkpoint(path).to(dev).eval()
    from scaletrain.model.loss import cross_entropy_sum  # the training loss, summed over tokens

    total = torch.zeros((), dtype=torch.float64, device=dev)
    for window_batch in order:
        for i in range(0, global_batch, chunk):
            inputs, targets = dataset[window_batch[i:i + chunk]]
            total += cross_entropy_sum(model(inputs.to(dev)), targets.to(dev)).double()
    loss = float(total) / (order.size * seq_len)
    return {"checkpoint": str(path), "step": int(state["step"]), "data": tokens.source,
            "split": "validation" if held_out is not None else "all (the folder has no validation split)",
            "batches": len(order), "windows": int(order.size), "tokens": int(order.size * seq_len),
            "val_loss": loss, "val_ppl": perplexity(loss), "device": str(dev)}
