"""The first steps of a small mixture of experts: the worst layer's load imbalance at every step, for
the old routing defaults and the new ones side by side, over several seeds (issue 47, point 15).

Every row trains the demo config (configs/tiny.toml: 4 blocks x 256, byte-level, CPython's
documentation, lr 3e-3 with 25 warm-up steps) with 8 experts of 512, top 2, on batches of
`--batch` x 128 tokens, a metrics row every step. Imbalance: the worst MoE layer's max / mean tokens
per expert; 4.00 is the ceiling (8 experts / top 2: every token on the same 2 experts).

Rows:

* old: the defaults before issue 47 point 15, softmax scores and a bias rate of 1e-3;
* new: the defaults (sigmoid scores, bias rate 1e-2);
* softmax: the new rate with softmax scores (what the rate alone does);
* previous: no rate; before each step the bias is set to the one that would have balanced the
  *previous* step's scores exactly (solved on them): the best any rule fed by past steps can do;
* current: the same, solved on the *current* step's scores (an oracle: it makes a token's route
  depend on the batch it came in, and under data parallelism on the layout, so it is no option).

The last two are diagnostics: they replace the router's choice through `MoE.route` for the run.

    nice python benchmarks/moe_first_steps.py [--steps 40] [--seeds 1234,1,7] [--rows old,new] [--batch 8]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
import time

MOE = {"model.moe_experts": 8, "model.moe_top_k": 2, "model.moe_hidden": 512}
ROWS = {
    "old": ("softmax scores, bias rate 1e-3 (old defaults)",
            {"model.moe_score": "softmax", "model.moe_bias_rate": 1e-3}),
    "new": ("sigmoid scores, bias rate 1e-2 (defaults)", {}),
    "softmax": ("softmax scores, bias rate 1e-2", {"model.moe_score": "softmax", "model.moe_bias_rate": 1e-2}),
    "previous": ("bias solved on the previous step's scores", {"model.moe_bias_rate": 0.0}),
    "current": ("bias solved on the current step's scores", {"model.moe_bias_rate": 0.0}),
}


def balancing_bias(scores, top_k: int, start):
    """The bias under which `scores` (tokens, experts) send each expert an even share of the choices,
    as near as a decaying sign rule gets in 300 rounds (from `start`)."""
    import torch

    bias = start.clone()
    experts = scores.shape[1]
    even = scores.shape[0] * top_k / experts
    for i in range(300):
        load = torch.bincount(torch.topk(scores + bias, top_k, dim=-1).indices.flatten(), minlength=experts)
        bias += 0.05 * 0.97 ** i * torch.sign(even - load.float())
    return bias


@contextlib.contextmanager
def solved_bias(which: str | None):
    """While inside: each MoE layer's training forward first sets its bias to the one that balances
    the previous (which="previous") or the current (which="current") step's scores."""
    import torch

    from scaletrain.model.moe import MoE

    if which is None:
        yield
        return
    original = MoE.route

    def route(self, x):
        if self.training and torch.is_grad_enabled():
            with torch.no_grad():
                logits = torch.nn.functional.linear(x.float(), self.router.weight.float())
                scores = logits.softmax(-1) if self.score == "softmax" else logits.sigmoid()
                basis = scores if which == "current" else getattr(self, "_previous_scores", None)
                if basis is not None:
                    self.expert_bias.copy_(balancing_bias(basis, self.top_k, self.expert_bias))
                self._previous_scores = scores
        return original(self, x)

    MoE.route = route
    try:
        yield
    finally:
        MoE.route = original


def imbalance_per_step(args, extra: list[str], name: str, seed: int) -> list[float]:
    from scaletrain.config import load_config
    from scaletrain.launch.ranks import flags, quiet
    from scaletrain.train.trainer import Trainer

    run_dir = tempfile.mkdtemp(prefix="moe-first-steps-")
    base = {"train.steps": args.steps, "train.global_batch": args.batch, "train.eval_every": args.steps,
            "log.every": 1, "train.sample_tokens": 0, "train.seed": seed, **MOE}
    cfg = load_config(args.config, [*extra, *flags(quiet(run_dir)), *flags({**base, **ROWS[name][1]})])
    oracle = name if name in ("previous", "current") else None
    with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull), solved_bias(oracle):
        trainer = Trainer(cfg, stream=devnull)
        trainer.fit()
    return [row["moe_imbalance"] for row in trainer.metrics.history if "moe_imbalance" in row]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/tiny.toml")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch", type=int, default=8, help="train.global_batch (the demo's is 32)")
    ap.add_argument("--seeds", default="1234,1,7", help="train.seed of each run, comma-separated")
    ap.add_argument("--rows", default="old,new", help=f"of {', '.join(ROWS)}")
    args, extra = ap.parse_known_args(argv)
    names = [r.strip() for r in args.rows.split(",") if r.strip()]
    if unknown := [n for n in names if n not in ROWS]:
        raise SystemExit(f"unknown row(s) {', '.join(unknown)}; known: {', '.join(ROWS)}")
    seeds = [int(s) for s in args.seeds.split(",")]
    print(f"config {args.config}, {args.steps} steps of {args.batch} x seq_len, seeds {seeds}; "
          + "; ".join(f"{n}: {ROWS[n][0]}" for n in names))
    runs = {}
    for name in names:
        for seed in seeds:
            t0 = time.perf_counter()
            runs[name, seed] = imbalance_per_step(args, extra, name, seed)
            print(f"  {name} seed {seed}: {time.perf_counter() - t0:.0f}s", flush=True)
    print_steps(runs, names, seeds)
    print_windows(runs, names, seeds, args.steps)


def print_steps(runs: dict, names: list[str], seeds: list[int]) -> None:
    """The worst layer's imbalance at each step, a column per (row, seed)."""
    cols = [(n, s) for n in names for s in seeds]
    print("\n step" + "".join(f"{n[:8] + ' ' + str(s):>14}" for n, s in cols))
    for i in range(max(len(v) for v in runs.values())):
        print(f"{i + 1:>5}" + "".join(f"{runs[c][i]:>14.2f}" if i < len(runs[c]) else f"{'-':>14}" for c in cols))


def print_windows(runs: dict, names: list[str], seeds: list[int], steps: int) -> None:
    """Each row's mean imbalance over windows of 10 steps, over its seeds, and its last step's worst."""
    windows = [(a, min(a + 9, steps)) for a in range(1, steps + 1, 10)]
    print("\nmean of the worst layer's imbalance, over the seeds\n" + f"{'row':<10}"
          + "".join(f"{f'steps {a}-{b}':>14}" for a, b in windows))
    for n in names:
        means = [statistics.mean(v for s in seeds for v in runs[n, s][a - 1:b]) for a, b in windows]
        print(f"{n:<10}" + "".join(f"{m:>14.2f}" for m in means))


if __name__ == "__main__":
    main()
