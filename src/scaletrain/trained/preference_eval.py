"""`scaletrain eval` of a preference-trained checkpoint (train.objective=preference): the held-out pairs' loss,
rewards, margins and accuracy, as the run evaluated them during training (the same batches of examples), in
one process. The reference is the run's starting model, rebuilt from what the config names: model.init_from's
weights, or the weights of train.seed; a reference-free loss (simpo, orpo) needs none."""

from __future__ import annotations

from dataclasses import replace

import torch

from scaletrain.data.loader import validation_batches
from scaletrain.model.preference import combined
from scaletrain.model.transformer import Transformer
from scaletrain.objectives.preference import examples_loss, open_preference_data, row_logps
from scaletrain.parallel.init import init_weights


def starting_model(cfg) -> Transformer:
    """The weights a run of `cfg` started from (its reference model), whole, fp32, on the CPU."""
    model = Transformer(cfg.model)
    model.init_buffers("cpu")
    source = cfg.preference.reference_from or cfg.model.init_from
    if source:
        from scaletrain.model.hf import load_hf_weights
        from scaletrain.parallel.init import load_weights

        load_weights(model, load_hf_weights(source, cfg.model), source)  # routing biases too (DeepSeek-V3)
    else:
        init_weights(model, seed=cfg.train.seed)
    return model.eval()


@torch.no_grad()
def evaluate_preference(model, cfg, data_path: str, global_batch: int, batches: int | None, dev) -> dict:
    """The preference metrics of `model` on the held-out split of `data_path` (or all of it, if it has none)."""
    data_cfg = replace(cfg.data, path=data_path)
    held_out = open_preference_data(data_cfg, cfg.model.vocab_size, "val")
    windows = held_out if held_out is not None else open_preference_data(data_cfg, cfg.model.vocab_size)
    wanted = cfg.train.eval_batches if batches is None else batches
    wanted = min(wanted, len(windows) // global_batch) if batches is None else wanted
    order = validation_batches(len(windows), global_batch, wanted, cfg.train.seed, windows.data.tokens.source)
    reference = starting_model(cfg).to(dev) if cfg.preference.needs_reference else None
    parts = []
    for examples in order:
        inputs, targets, ids = windows[examples]
        inputs, targets = inputs.to(dev), targets.to(dev)
        sums, counts = row_logps(model(inputs), targets)
        ref = None
        if reference is not None:
            ref_sums, _ = row_logps(reference(inputs), targets)
            ref = {"chosen": ref_sums[0::2], "rejected": ref_sums[1::2]}
        if cfg.preference.loss == "kto":  # each example's own row, then its KL row (the batch's KL estimate)
            ref.update(kl=(sums[1::2] - ref["rejected"]).mean().clamp(min=0), labels=windows.labels(ids).to(dev))
        parts.append(examples_loss(cfg.preference, sums, counts, ref))
    total = combined(parts)
    out = {f"val_{name}": float(m.value()) for name, m in total.metrics.items()}
    out["val_loss"] = float(total.value())
    return {"result": out, "split": "validation" if held_out is not None else "all (the folder has no validation "
                                                                              "split)",
            "batches": len(order), "examples": int(order.size), "source": windows.data.tokens.source}
