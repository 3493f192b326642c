"""Sliding-window attention's kernel (scaletrain.model.window.local_attention) against two others
on the same queries, keys and values, forward and backward, in one process:

  causal   the whole sequence, is_causal (what scaletrain computed before windows were real:
           the wrong answer past the window, but the cost a window is measured against)
  dense    the whole (T, T) window mask through scaled_dot_product_attention (right, and as
           costly as causal, or more: the masked kernel)
  tiled    scaletrain's: W query rows at a time against the keys they may see (at most 2W - 1)

Each row: the median wall time of a forward + backward over `--reps` rounds (the variants
interleaved, each round starting at the next), and the bytes autograd keeps for backward
(counted by saved_tensors_hooks: exact, not a sampled peak); the largest difference of tiled's
output from dense's.

    OMP_NUM_THREADS=1 nice python benchmarks/window_attention.py [--seq 2048,8192] [--window 256] [--reps 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from scaletrain.model.window import Window, causal_allows, local_attention


def sdpa(q, k, v, mask, causal):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)


def variants(window: Window):
    def causal(q, k, v):
        return sdpa(q, k, v, None, True)

    def dense(q, k, v):
        pos = torch.arange(q.shape[2])
        return sdpa(q, k, v, causal_allows(window, pos, pos), False)

    def tiled(q, k, v):
        return local_attention(q, k, v, window, None, sdpa)

    return {"causal": causal, "dense": dense, "tiled": tiled}


def saved_bytes(fn, q, k, v) -> int:
    seen: dict[int, int] = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(q, k, v).sum().backward()
    return sum(seen.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", default="2048,8192")
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    window = Window(args.window)
    print(f"B=1, {args.heads} heads of {args.head_dim}, fp32, window {args.window}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} thread(s)")
    print("| T | variant | forward + backward (median) | kept for backward | vs causal |\n|---|---|---|---|---|")
    for T in (int(s) for s in args.seq.split(",")):
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, args.heads, T, args.head_dim, generator=g).requires_grad_() for _ in range(3))
        fns = variants(window)
        times: dict[str, list[float]] = {name: [] for name in fns}
        names = list(fns)
        for r in range(args.reps + 1):
            for name in names[r % 3:] + names[:r % 3]:
                t0 = time.perf_counter()
                fns[name](q, k, v).sum().backward()
                if r:  # (round 0 warms up)
                    times[name].append(time.perf_counter() - t0)
        with torch.no_grad():
            diff = (fns["tiled"](q, k, v) - fns["dense"](q, k, v)).abs().max().item()
        base = statistics.median(times["causal"])
        for name in names:
            t, kept = statistics.median(times[name]), saved_bytes(fns[name], q, k, v)
            print(f"| {T:,} | {name} | {t * 1e3:.1f} ms | {kept / 2**20:.1f} MiB | {t / base:.2f}x |")
        print(f"| {T:,} | tiled - dense | largest difference {diff:.1e} | | |")


if __name__ == "__main__":
    main()
