"""Evaluation on held-out data during training (a saved checkpoint's: scaletrain.trained.evaluate).

During training (train.eval_every), `validation_sets` fixes the run's validation windows (one
set per source of a data.mix, each logged as val_loss/NAME, val_loss being their mean weighted as
the mix) and `validation_loss` is their mean token loss under the run's own layout: each validation batch is
split over data-parallel ranks and micro-batches like a training batch, pipeline stages run the
schedule's forward-only pass, and the sums are all-reduced like the training loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from scaletrain.config import JobConfig, parse_mix
from scaletrain.data.dataset import WindowDataset, open_validation
from scaletrain.data.documents import document_separator
from scaletrain.data.loader import rank_slices, validation_batches
from scaletrain.data.mix import source_name
from scaletrain.errors import ConfigError
from scaletrain.parallel import pipeline
from scaletrain.parallel.tensor_parallel import whole


@dataclass
class ValidationSet:
    """Fixed validation windows: (batches, global_batch) window indices of `dataset`. `name`:
    the source of a data.mix (None for a single folder), `weight` its share of the mix."""

    name: str | None
    weight: float
    dataset: WindowDataset
    batches: np.ndarray


def validation_sets(cfg: JobConfig, global_batch: int) -> list[ValidationSet]:
    """The validation windows that train.eval_every evaluates, fixed for the run: one set for
    data.path, one per source (that has a validation split) for data.mix; [] when evaluation is
    off."""
    train = cfg.train
    if not train.eval_every:
        return []
    if cfg.data.mix:
        sources = [(source_name(p), w, p) for p, w in parse_mix(cfg.data.mix)]
    else:
        sources = [(None, 1.0, cfg.data.path)]
    sets = []
    for name, weight, path in sources:
        data = open_validation(path, cfg.data.verify_checksums)
        if data is None:
            continue
        # a loss mask (chat data) counts the answers here as in training
        masked = cfg.data.loss_mask != "false" and data.mask is not None
        separator = document_separator(data, data.source) if cfg.data.document_mask else None
        dataset = WindowDataset(data, cfg.data.seq_len, loss_mask=masked, separator=separator)
        sets.append(ValidationSet(name, weight, dataset,
                                  validation_batches(len(dataset), global_batch, train.eval_batches, train.seed,
                                                     data.source)))
    if not sets:
        what = f"data.path {cfg.data.path} has none" if not cfg.data.mix else "none of data.mix's folders has one"
        raise ConfigError(f"train.eval_every={train.eval_every} needs a validation split, and {what}; prepare the "
                          "data again with --val-fraction (e.g. 0.05), or set train.eval_every=0")
    return sets


def combined(losses: dict[str | None, float], weights: dict[str | None, float]) -> dict[str, float]:
    """{"val_loss": ...} of one set; of a mix's sources, their mean weighted as the mix (over the
    sources evaluated) and "val_loss/NAME" for each."""
    if list(losses) == [None]:
        return {"val_loss": losses[None]}
    total = sum(weights[n] for n in losses)
    out = {"val_loss": sum(weights[n] * loss for n, loss in losses.items()) / total}
    out.update({f"val_loss/{n}": loss for n, loss in losses.items()})
    return out


@torch.no_grad()
def validation_loss(t) -> dict[str, float]:
    """The mean token loss of Trainer `t` over its fixed validation windows, in eval mode and
    without gradients, per validation set (`combined`). Each validation batch is split over ranks
    and micro-batches exactly like a training step's global batch; pipeline stages run the
    schedule's forward-only pass; the summed token losses are all-reduced like the training loss
    (tensor-parallel ranks hold copies). Gradients, optimizer state and random streams are left
    as they were."""
    t.health.enter("evaluation")
    b, modules = t.layout, t.pm.dp.modules
    share = t.pm.batch_share or (lambda batch: batch)  # this rank's tokens (context parallelism)
    totals = torch.zeros(len(t.data.val_sets), dtype=torch.float64, device=t.rt.device)
    was_training = [m.training for m in modules]
    for m in modules:
        m.eval()  # no dropout
    try:
        for i, v in enumerate(t.data.val_sets):
            for global_batch in v.batches:
                micro = rank_slices(global_batch, b.micro_batch, b.grad_accum, t.data.dp_rank, b.dp)
                if t.pm.micro_schedule is not None:
                    totals[i] += pipeline.eval_loss_sum(
                        t.pm, t.pm.micro_schedule, [share(v.dataset[indices]) for indices in micro], device=t.rt.device,
                        loss_factor=t.loss_factor(), autocast=t.precision.autocast, loss_context=t.pm.loss_context)
                    continue
                for indices in micro:
                    inputs, targets = (x.to(t.rt.device) for x in share(v.dataset[indices]))
                    with t.pm.loss_context():
                        with t.precision.autocast():
                            logits = t.pm.dp.module(inputs)  # the chunk itself: no DDP bookkeeping
                        loss = t.token_loss(logits, targets)
                        totals[i] += whole(loss).double()
    finally:
        restore_modes(modules, was_training, reshard=t.pm.dp.zero == 3)
    if t.rt.distributed:
        t.health.enter("the evaluation all-reduce")
        dist.all_reduce(totals)
        totals /= b.loss_copies
    # by the targets counted: every token's, or a loss mask's (the same on every rank: from the data)
    losses = {v.name: float(totals[i]) / max(1, sum(v.dataset.counted_tokens(g) for g in v.batches))
              for i, v in enumerate(t.data.val_sets)}
    return combined(losses, {v.name: v.weight for v in t.data.val_sets})


def restore_modes(modules, was_training: list[bool], *, reshard: bool) -> None:
    """Put each module back in the mode it was in; under ZeRO-3 free what FSDP gathered for
    the forwards."""
    for m, training in zip(modules, was_training):
        m.train(training)
    if reshard:
        for module in modules:
            for m in module.modules():
                if hasattr(m, "reshard"):
                    m.reshard()
