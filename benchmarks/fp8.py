"""bf16-mixed against fp8 training on one GPU: tokens/s, MFU and peak memory, side by side.

The baseline is the config at precision.mode=bf16-mixed; beside it run fp8 with tensorwise and
rowwise scales, each eager and compiled (`--no-compile` leaves the compiled ones out). All run in
this one process, interleaved step by step (`scaletrain bench step` does the measuring), so the
GPU's clocks and neighbours hit every variant alike. MFU is against the bf16 peak for every row
(the model's FLOPs per token are the same): an fp8 row above bf16's is real extra work done.

Which layers run in fp8 is the trainer's rule (precision.fp8_min_dim, printed at start-up): the
default keeps layers under 1024 wide in bf16, so GPT-2 124M (768 wide) converts nothing at the
default; `--precision.fp8_min_dim=768` makes it convert and shows what small layers cost.

    python benchmarks/fp8.py                                   # Llama 3.2 1B shape, seq 2048, micro 4
    python benchmarks/fp8.py --config configs/gpt2-124m.toml --precision.fp8_min_dim=768
    python benchmarks/fp8.py --config configs/llama-8b.toml --model.n_layers=4   # 8B-wide layers

It needs a CUDA GPU with fp8 matmuls (sm89+: L4, L40S, H100, B200); elsewhere it says so in one
line and exits 0. Ready; not yet run (this project's machine has no GPU): docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import sys

# built-in text (no prepared folder needed), and a batch one step of which fits one 80 GB GPU
DEFAULTS = ["--data.path=", "--data.num_workers=0", "--train.device=cuda", "--precision.mode=bf16-mixed",
            "--train.compile=false", "--parallel.layout=manual", "--train.micro_batch=4", "--train.global_batch=4"]


def variants(compile: bool) -> list[str]:
    out = []
    for recipe in ("tensorwise", "rowwise"):
        fp8 = f"precision.mode=fp8,precision.fp8_recipe={recipe}"
        out += [fp8] + ([f"{fp8},train.compile=true"] if compile else [])
    return out + (["train.compile=true"] if compile else [])  # bf16 compiled: fp8-compiled's fair baseline


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/llama-1b.toml")
    ap.add_argument("--steps", type=int, default=10, help="timed steps of each variant")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (compile happens here)")
    ap.add_argument("--no-compile", dest="compile", action="store_false", help="eager variants only")
    args, overrides = ap.parse_known_args(argv)

    import torch

    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        what = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA GPU"
        print(f"benchmarks/fp8.py needs a CUDA GPU with fp8 matmuls (sm89+); here: {what}. Nothing measured.")
        return 0

    from scaletrain.bench.step import bench_step, progress_line, report

    result = bench_step(args.config, [*DEFAULTS, *overrides],
                        variants(args.compile), steps=args.steps, warmup=args.warmup, progress=progress_line)
    print(report(result))
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
