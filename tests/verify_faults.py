"""Known bugs planted in `scaletrain verify`'s layout run (through its layout_hook), so that a
test can watch verify FAIL; and, last, checks of the layout run's setup that fail its ranks when
the setup is not what the test meant to compare. Each is called with a layout rank's Trainer
before it trains."""

from __future__ import annotations

import os


def perturb_grad_rank1(trainer, scale: float = 1.01) -> None:
    """Rank 1's gradients are multiplied by `scale` before any reduction: the gradient flowing
    into the outputs of its model chunks is scaled, the values not."""
    if int(os.environ.get("RANK", "0")) != 1:
        return

    def scale_gradient(module, inputs, output):
        return output.detach() + (output - output.detach()) * scale

    for chunk in trainer.pm.dp.modules:
        chunk.register_forward_hook(scale_gradient)


def local_loss_norm(trainer) -> None:
    """Every rank divides its loss by its own token count instead of the global batch's, while
    the data-parallel average still divides by dp: gradients dp times too large."""
    real = trainer.loss_factor
    trainer.loss_factor = lambda: real() * trainer.layout.dp


def skip_delay_on_worker1(trainer) -> None:
    """Worker 1 applies each fragment's average as soon as it arrives, not sync_delay steps later
    as the others (and the simulation) do: its weights leave the others' at the first sync."""
    from scaletrain.parallel.local_sgd import LocalSGD

    sync = trainer.hooks.find(LocalSGD)
    if sync is not None and sync.worker == 1:
        sync.outer.delay = 0


def every_block_linear_fake_quantized(trainer) -> None:
    """A check, not a bug: train.qat survived this rank's wrapping (DDP, ZeRO), every linear of
    the blocks trains through torchao's fake quantization. Without it a layout that dropped QAT
    would still track a QAT reference within a loose tolerance on a model this small."""
    from torch import nn
    from torchao.quantization.qat import FakeQuantizedLinear

    linears = {n: m for chunk in trainer.pm.dp.modules for n, m in chunk.named_modules()
               if isinstance(m, nn.Linear) and "layers." in n}
    plain = sorted(n for n, m in linears.items() if not isinstance(m, FakeQuantizedLinear))
    if not linears or plain:
        raise AssertionError(f"train.qat={trainer.cfg.train.qat}: {len(linears)} block linear(s), not fake-quantized: "
                             f"{plain or 'none found'}")
