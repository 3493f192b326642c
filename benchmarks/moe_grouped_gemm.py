"""The experts' grouped matmul (`torch._grouped_mm`) against a loop of one matmul per expert.

`scaletrain.model.moe.expert_mlp` runs every expert's MLP over its group of tokens (tokens
sorted by expert) in one grouped matmul per weight; `loop=True` runs the same computation as a
Python loop over the experts (`x[group] @ w[e].T`), the way a first MoE is usually written.
Both run forward + backward here on the same inputs, interleaved (a few repetitions of one,
then of the other, alternating which goes first), and are checked to give the same outputs and
gradients. Times are the process's CPU time (steady on a shared machine; the same as wall time
on an idle one with one thread), the wall-clock ratio beside it. Shapes: the quality
benchmark's layer (benchmarks/moe_quality.py), wider experts, many small experts
(fine-grained, DeepSeek-style), and a skewed load (half the tokens on one expert, as an
unbalanced router gives).

    python benchmarks/moe_grouped_gemm.py [--rounds 10] [--reps 3] [--dtype fp32|bf16]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from scaletrain.model.moe import expert_mlp

# (name, token slots = tokens x top_k, dim, expert hidden, experts, SwiGLU, skewed load)
SHAPES = [
    ("quality layer", 2048 * 2, 256, 512, 8, False, False),
    ("quality layer, skewed", 2048 * 2, 256, 512, 8, False, True),
    ("wider, SwiGLU", 4096, 512, 1024, 8, True, False),
    ("fine-grained 64 x 128", 4096 * 4, 256, 128, 64, True, False),
]


def counts_for(slots: int, experts: int, skewed: bool, gen: torch.Generator) -> torch.Tensor:
    """Tokens per expert: a random near-even split, or half of them on expert 0 and the rest even."""
    if skewed:
        rest = torch.full((experts - 1,), (slots - slots // 2) // (experts - 1))
        rest[: (slots - slots // 2) - int(rest.sum())] += 1
        return torch.cat([torch.tensor([slots // 2]), rest])
    choice = torch.randint(experts, (slots,), generator=gen)
    return torch.bincount(choice, minlength=experts)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--reps", type=int, default=3, help="forward+backward passes of one kind per round")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    args = ap.parse_args(argv)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    gen = torch.Generator().manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), {args.dtype}, forward + backward, "
          f"median of {args.rounds} x {args.reps} interleaved; CPU time (wall-clock ratio beside it)")
    print(f"{'shape':<24}{'slots':>7}{'dim':>5}{'hidden':>7}{'E':>4}  {'grouped':>9}{'loop':>9}{'loop/grouped':>13}"
          f"{'(wall)':>11}{'GFLOP/s':>9}{'max diff':>10}")
    for shape in SHAPES:
        print(measure(shape, dtype, args.rounds, args.reps, gen), flush=True)


def measure(shape: tuple, dtype: torch.dtype, rounds: int, reps: int, gen: torch.Generator) -> str:
    """One row of the table: both ways timed on the same inputs, after checking they agree."""
    name, slots, dim, hidden, experts, swiglu, skewed = shape
    counts = counts_for(slots, experts, skewed, gen)
    x = torch.randn(slots, dim, generator=gen, dtype=dtype, requires_grad=True)
    w1 = (torch.randn(experts, hidden, dim, generator=gen) / dim**0.5).to(dtype).requires_grad_()
    w2 = (torch.randn(experts, dim, hidden, generator=gen) / hidden**0.5).to(dtype).requires_grad_()
    w3 = (torch.randn(experts, hidden, dim, generator=gen) / dim**0.5).to(dtype).requires_grad_() if swiglu else None
    leaves = [t for t in (x, w1, w2, w3) if t is not None]
    grad_out = torch.randn(slots, dim, generator=gen, dtype=dtype)

    def run(loop: bool) -> list[torch.Tensor]:
        for t in leaves:
            t.grad = None
        y = expert_mlp(x, counts, w1, w2, w3, loop=loop)
        y.backward(grad_out)
        return [y.detach(), *(t.grad for t in leaves)]

    def timed(loop: bool) -> list[tuple[float, float]]:
        out = []
        for _ in range(reps):
            t0, c0 = time.process_time(), time.perf_counter()
            run(loop)
            out.append((time.process_time() - t0, time.perf_counter() - c0))
        return out

    diff = max(float((a - b).abs().max()) for a, b in zip(run(False), run(True)))  # warm-up, and they agree
    times: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    for r in range(rounds):
        for loop in (False, True) if r % 2 == 0 else (True, False):
            times[loop].extend(timed(loop))
    (g, g_wall), (lo, lo_wall) = ([statistics.median(x[i] for x in times[loop]) for i in (0, 1)]
                                  for loop in (False, True))
    flops = 3 * 2 * slots * dim * hidden * (3 if swiglu else 2)  # 2 forward + 4 backward per multiply-add
    return (f"{name:<24}{slots:>7}{dim:>5}{hidden:>7}{experts:>4}  {g * 1e3:>7.1f}ms{lo * 1e3:>7.1f}ms"
            f"{lo / g:>13.2f}{lo_wall / g_wall:>11.2f}{flops / g / 1e9:>9.1f}{diff:>10.1e}")

if __name__ == "__main__":
    main()
