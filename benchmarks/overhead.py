"""How much does scaletrain's training step cost over a minimal hand-written PyTorch loop?

Both run in this one process on the same model shape, batch and precision, interleaved
(a few steps of one, then of the other, repeated), so machine noise hits both alike. The
hand-written loop is what a user would write: index a token tensor, forward, cross-entropy,
backward, clip, AdamW step, zero grads. Prints the median step time of each, their ratio, and
each loop's MFU (model FLOPs per token x tokens/s over the device's peak at the precision).

    python benchmarks/overhead.py [--config configs/tiny.toml] [--rounds 15] [--steps 3] [--section.key=value ...]

On a GPU, GPT-2 124M in bf16 with compile, one micro-batch of 12 x 1024 per step, on the
built-in text (ready; not run on this project's machine, which has no GPU):

    python benchmarks/overhead.py --config configs/gpt2-124m.toml --data.path= --train.global_batch=12 \
        --data.num_workers=0 --train.device=cuda
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

import torch

from scaletrain.bench.plain import PlainLoop
from scaletrain.config import load_config
from scaletrain.launch.ranks import flags, quiet
from scaletrain.train.trainer import Trainer


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/tiny.toml")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--steps", type=int, default=3, help="steps of each loop per round")
    args, overrides = ap.parse_known_args(argv)
    run_dir = tempfile.mkdtemp(prefix="overhead-")
    cfg = load_config(args.config, [*overrides, *flags(quiet(run_dir))])
    if cfg.train.grad_accum not in (0, 1):
        sys.exit("this benchmark compares single micro-batch steps; leave train.grad_accum unset")

    # scaletrain: the real Trainer and its step (loader, precision, clipping, schedule, optimizer)
    trainer = Trainer(cfg)
    batches = trainer.batches()

    # hand-written: the same model shape and optimizer, nanoGPT-style batches (scaletrain.bench.plain;
    # `scaletrain bench step --vs-plain-loop` runs the same comparison)
    device = trainer.rt.device
    data = torch.from_numpy(trainer.data.corpus.read(0, trainer.data.corpus.num_tokens))
    B, T = trainer.layout.micro_batch, cfg.data.seq_len
    hand_step = PlainLoop(cfg, data, device, B).step

    def ours_step() -> None:
        trainer.train_step(batches)

    def timed(fn) -> list[float]:
        out = []
        for _ in range(args.steps):
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            out.append(time.perf_counter() - t0)
        return out

    for fn in (ours_step, hand_step):  # warm-up (allocator, kernels, compile if on)
        timed(fn)
    ours, hand = [], []
    for r in range(args.rounds):
        first, second = (ours_step, hand_step) if r % 2 == 0 else (hand_step, ours_step)
        a, b = timed(first), timed(second)
        (ours if first is ours_step else hand).extend(a)
        (hand if first is ours_step else ours).extend(b)
    m_ours, m_hand = statistics.median(ours), statistics.median(hand)
    print(f"config {args.config}, device {device}, precision {cfg.precision.mode}, "
          f"batch {B}x{T}, {trainer.pm.num_params / 1e6:.2f}M params, {len(ours)} steps each, interleaved")
    print(f"{'loop':<14}{'median step':>14}{'min':>10}{'max':>10}")
    for name, xs in (("scaletrain", ours), ("hand-written", hand)):
        print(f"{name:<14}{statistics.median(xs) * 1e3:>12.1f}ms{min(xs) * 1e3:>8.1f}ms{max(xs) * 1e3:>8.1f}ms")
    print(f"ratio scaletrain / hand-written (median): {m_ours / m_hand:.3f}")
    # MFU of each loop: the same model FLOPs per token over the device's peak at this precision
    tokens = B * T
    for name, m in (("scaletrain", m_ours), ("hand-written", m_hand)):
        print(f"MFU {name}: {trainer.meter.flops_per_token * tokens / m / trainer.meter.peak_flops:.1%} "
              f"({tokens / m:,.0f} tokens/s; peak {trainer.meter.peak_flops / 1e12:.3g} TFLOP/s)")


if __name__ == "__main__":
    main()
