"""What each memory saver saves, measured from live tensors on the config's model.

* saved-activation bytes per micro-batch for activation checkpointing none / selective / full
  (storages that autograd keeps alive between forward and backward, see
  `scaletrain.memory.saved_activation_bytes`), with the step time of each;
* optimizer-state bytes per parameter for adamw, sgd, adamw8bit, adafactor after one step.

    python benchmarks/memory.py [--config configs/tiny.toml] [--section.key=value ...]
"""

from __future__ import annotations

import argparse
import tempfile
import time

from scaletrain.config import load_config
from scaletrain.launch.ranks import flags, quiet
from scaletrain.memory import saved_activation_bytes
from scaletrain.optim import optimizer_state_bytes
from scaletrain.train.trainer import Trainer, cross_entropy_sum


def trainer_for(config: str, overrides: list[str], **dotted) -> Trainer:
    run_dir = tempfile.mkdtemp(prefix="memory-")
    extra = [f"--{k}={v}" for k, v in dotted.items()]
    cfg = load_config(config, [*overrides, *extra, *flags(quiet(run_dir))])
    return Trainer(cfg)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/tiny.toml")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per checkpointing mode")
    args, overrides = ap.parse_known_args(argv)

    print("activation checkpointing (one micro-batch)")
    print(f"{'mode':<12}{'saved activations':>20}{'vs none':>10}{'step time':>12}")
    base = None
    for mode in ("none", "selective", "full"):
        trainer = trainer_for(args.config, overrides, **{"memory.activation_checkpointing": mode})
        batches = trainer.batches()
        x, y = next(batches)
        held = saved_activation_bytes(trainer.model, lambda: cross_entropy_sum(trainer.model(x), y))  # noqa: B023 - called here
        trainer.optimizer.zero_grad(set_to_none=True)
        trainer.train_step(batches)  # warm-up
        t0 = time.perf_counter()
        for _ in range(args.steps):
            trainer.train_step(batches)
        step = (time.perf_counter() - t0) / args.steps
        base = base or held
        print(f"{mode:<12}{held / 2**20:>17.1f}MiB{held / base:>10.2f}{step * 1e3:>10.0f}ms")

    print()
    print("optimizer state (after one step)")
    print(f"{'optimizer':<12}{'state bytes':>14}{'bytes/param':>14}")
    for name in ("adamw", "sgd", "adamw8bit", "adafactor"):
        try:
            trainer = trainer_for(args.config, overrides, **{"optim.name": name})
        except Exception as e:  # torchao missing: say so and go on with the others
            print(f"{name:<12}{'unavailable':>14}  ({e})")
            continue
        trainer.train_step(trainer.batches())
        state = optimizer_state_bytes(trainer.optimizer)
        print(f"{name:<12}{state / 2**20:>11.2f}MiB{state / trainer.pm.num_params:>14.3f}")


if __name__ == "__main__":
    main()
