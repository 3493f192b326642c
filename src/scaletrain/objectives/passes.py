"""Forward-only passes of an objective's micro-batches (reference log-probs, the policy's log-probs before
an update), shared by the preference and RL objectives.

The pass runs each micro-batch through a parallelized model as training would — through the pipeline
schedule's forward-only pass under pipeline parallelism, under the loss context (tensor parallelism's
vocabulary-sharded loss) — in eval mode and without gradients; the objective's own loss function sees the
logits and keeps what it needs (its `capture` list), since under pipeline parallelism the logits exist on
the last stage only, inside the schedule."""

from __future__ import annotations

import torch

from scaletrain.parallel import pipeline
from scaletrain.train.evaluate import restore_modes


@torch.no_grad()
def forward_only(t, pm, parts, loss_fn) -> None:
    """Micro-batches `parts` ((inputs, targets, ...) each) of Trainer `t` through `pm`'s model in eval mode,
    without gradients; `loss_fn(logits, targets)` is called on each (pipeline: the schedule's loss, which must
    be the same function, on the last stage)."""
    modules = pm.dp.modules
    was_training = [m.training for m in modules]
    for m in modules:
        m.eval()
    try:
        if pm.micro_schedule is not None:
            inputs = [(x, y) for x, y, *_ in parts]
            pipeline.eval_loss_sum(pm, pm.micro_schedule, inputs, device=t.rt.device, loss_factor=1.0,
                                   autocast=t.precision.autocast, loss_context=pm.loss_context)
        else:
            for inputs, targets, *_ in parts:
                inputs, targets = inputs.to(t.rt.device), targets.to(t.rt.device)
                with pm.loss_context():
                    with t.precision.autocast():
                        logits = pm.dp.module(inputs)
                    loss_fn(logits, targets)
    finally:
        restore_modes(modules, was_training, reshard=pm.dp.zero == 3)


def captured(objective, t, pm, parts) -> list:
    """What `objective.micro_loss` keeps of each micro-batch of `parts` (appended to its `capture` list) in a
    forward-only pass under `pm`'s model; None for each on a pipeline stage without the head."""
    objective.capture = []
    try:
        forward_only(t, pm, parts, objective.micro_loss)
        got = objective.capture
    finally:
        objective.capture = None
    return got if got else [None] * len(parts)
