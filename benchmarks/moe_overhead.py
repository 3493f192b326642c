"""How much does scaletrain's step cost on a mixture of experts over a minimal hand-written loop?

The same model object trains in both, in this one process, interleaved (a few steps of one,
then of the other, repeated, alternating which goes first), so machine noise hits both alike:

* scaletrain: the Trainer's own step (`Trainer.train_step`: loader, step hooks -- the MoE
  balance hook's load all-reduce-free count, bias update and metrics --, loss, backward,
  clipping, AdamW);
* hand-written: what a user writes for the same model: random windows of the token tensor,
  forward, cross-entropy, backward, clip, AdamW (its own state, same settings), zero the
  gradients, then the expert bias moved from the step's token counts (DeepSeek-V3's sign rule)
  and the counts cleared -- the same work the MoE needs, done by hand.

The model is the demo's (configs/tiny.toml) with every block a mixture of 8 experts of 512,
2 per token (the active parameters of the demo's dense MLP). Prints the median step time of
each loop and their ratio (target: at most 1.05), in wall time and in CPU time (the steadier of
the two on a machine shared with other work).

    python benchmarks/moe_overhead.py [--rounds 10] [--steps 3] [--section.key=value ...]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

from scaletrain.config import load_config
from scaletrain.launch.ranks import flags, quiet
from scaletrain.model.moe import MoE
from scaletrain.train.trainer import Trainer

MOE = {"model.moe_experts": 8, "model.moe_top_k": 2, "model.moe_hidden": 512, "train.global_batch": 16}


class HandLoop:
    """The hand-written MoE training step over `model` (already built and initialized)."""

    def __init__(self, model: torch.nn.Module, cfg, tokens: torch.Tensor, micro_batch: int):
        self.model, self.tokens, self.B, self.T = model, tokens, micro_batch, cfg.data.seq_len
        self.params = [p for p in model.parameters() if p.requires_grad]
        o = cfg.optim
        self.opt = torch.optim.AdamW(self.params, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                                     weight_decay=o.weight_decay, fused=True)
        self.clip = cfg.train.grad_clip or float("inf")
        self.rate = cfg.model.moe_bias_rate
        self.moes = [m for m in model.modules() if isinstance(m, MoE)]

    def step(self) -> None:
        ix = torch.randint(len(self.tokens) - self.T - 1, (self.B,))
        x = torch.stack([self.tokens[i:i + self.T] for i in ix]).long()
        y = torch.stack([self.tokens[i + 1:i + 1 + self.T] for i in ix]).long()
        logits = self.model(x)  # (B, T, vocab)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, self.clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        with torch.no_grad():  # the expert bias: underloaded experts up, overloaded ones down
            for m in self.moes:
                load = m.stats[:m.num_experts]
                m.expert_bias += self.rate * torch.sign(load.mean() - load)
                m.stats.zero_()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/tiny.toml")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--steps", type=int, default=3, help="steps of each loop per round")
    args, overrides = ap.parse_known_args(argv)
    cfg = load_config(args.config, [*flags(MOE), *overrides, *flags(quiet(tempfile.mkdtemp(prefix="moe-overhead-")))])
    if cfg.train.grad_accum not in (0, 1) or cfg.precision.mode != "32-true" or cfg.train.device == "cuda":
        sys.exit("this benchmark compares single micro-batch fp32 CPU steps; leave train.grad_accum, "
                 "precision.mode and train.device as they are")
    if cfg.model.moe_aux_loss or cfg.model.moe_z_loss or cfg.model.moe_capacity_factor:
        sys.exit("the hand-written loop has the expert bias only: leave moe_aux_loss, moe_z_loss and "
                 "moe_capacity_factor at 0")

    trainer = Trainer(cfg)
    batches = trainer.batches()
    model = trainer.pm.dp.module  # one process: the plain Transformer both loops train
    tokens = torch.from_numpy(trainer.data.corpus.read(0, trainer.data.corpus.num_tokens))
    B, T = trainer.layout.micro_batch, cfg.data.seq_len
    hand = HandLoop(model, cfg, tokens, B)

    def ours() -> None:
        trainer.train_step(batches)
        trainer.hooks.metrics()  # what a logged step adds: the balance figures

    def timed(fn) -> list[tuple[float, float]]:
        """(wall, CPU) seconds of each of `args.steps` steps."""
        out = []
        for _ in range(args.steps):
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            out.append((time.perf_counter() - t0, time.process_time() - c0))
        return out

    for fn in (ours, hand.step):  # warm-up
        timed(fn)
    times: dict[str, list[tuple[float, float]]] = {"scaletrain": [], "hand-written": []}
    for r in range(args.rounds):
        order = (("scaletrain", ours), ("hand-written", hand.step))
        for name, fn in order if r % 2 == 0 else order[::-1]:
            times[name].extend(timed(fn))
    m = cfg.model
    print(f"config {args.config} + {m.moe_experts} experts of {m.expert_hidden}, top {m.moe_top_k}, bias rate "
          f"{m.moe_bias_rate:g}; device {trainer.rt.device}, batch {B}x{T}, {trainer.pm.num_params / 1e6:.2f}M params; "
          f"{len(times['scaletrain'])} steps each, interleaved; {torch.get_num_threads()} thread(s)")
    # CPU time (all the process's threads) is the steadier figure on a machine shared with other work
    print(f"{'loop':<14}{'median step':>14}{'min':>10}{'max':>10}{'median CPU time':>17}")
    for name, xs in times.items():
        wall = [w for w, _ in xs]
        print(f"{name:<14}{statistics.median(wall) * 1e3:>12.1f}ms{min(wall) * 1e3:>8.1f}ms{max(wall) * 1e3:>8.1f}ms"
              f"{statistics.median(c for _, c in xs) * 1e3:>15.1f}ms")
    for i, what in ((0, "wall"), (1, "CPU time")):
        ours_m, hand_m = (statistics.median(x[i] for x in times[name]) for name in ("scaletrain", "hand-written"))
        ratio = ours_m / hand_m
        print(f"ratio scaletrain / hand-written ({what}, median): {ratio:.3f} (target <= 1.05)")


if __name__ == "__main__":
    main()
