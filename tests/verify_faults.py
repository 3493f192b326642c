"""Known bugs planted in `scaletrain verify`'s layout run (through its layout_hook), so that a
test can watch verify FAIL. Each is called with a layout rank's Trainer before it trains."""

from __future__ import annotations

import os


def perturb_grad_rank1(trainer, scale: float = 1.01) -> None:
    """Rank 1's gradients are multiplied by `scale` before any reduction: the gradient flowing
    into the outputs of its model chunks is scaled, the values not."""
    if int(os.environ.get("RANK", "0")) != 1:
        return

    def scale_gradient(module, inputs, output):
        return output.detach() + (output - output.detach()) * scale

    for chunk in trainer.dp.modules:
        chunk.register_forward_hook(scale_gradient)


def local_loss_norm(trainer) -> None:
    """Every rank divides its loss by its own token count instead of the global batch's, while
    the data-parallel average still divides by dp: gradients dp times too large."""
    real = trainer._loss_factor
    trainer._loss_factor = lambda: real() * trainer.layout.dp


def skip_delay_on_worker1(trainer) -> None:
    """Worker 1 applies each fragment's average as soon as it arrives, not sync_delay steps later
    as the others (and the simulation) do: its weights leave the others' at the first sync."""
    if trainer.outer is not None and trainer.worker == 1:
        trainer.outer.delay = 0
