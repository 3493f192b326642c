"""The colocated rollout engine on the demo model (configs/tiny.toml: 3.25M parameters, byte-level, 4
layers x 256, context 128) on CPU: generation tokens/s with the key/value cache against without it (every
token re-running the sequence so far), and with the cache plus the rescoring forward (LocalEngine's
default: the log-probs from one forward of each prompt + completion, as the trainer computes them), side
by side in one run; and the gap between the log-probs of the forwards that drew the tokens and the
trainer's forward on the same tokens (fp32).

The model is the demo's after `--train-steps` steps (briefly trained, so that its distributions are not
the near-uniform ones of a fresh initialisation). Prompts are lines of the demo's text, cut to
`--prompt-tokens` bytes; each gets `--n` completions of up to `--max-new` tokens at temperature 0.8 with
top-p 0.95 and top-k 50 (no stop: every completion runs to the limit, so the variants generate the same
tokens). The variants take turns over `--rounds` rounds; medians.

    OMP_NUM_THREADS=2 python benchmarks/rollout.py [--train-steps 60] [--prompts 8] [--n 4] [--max-new 96]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile

import torch

from scaletrain.config import load_config
from scaletrain.rollout import SamplingParams
from scaletrain.rollout.local import LocalEngine, logprobs_of
from scaletrain.train.trainer import Trainer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def trained_demo(steps: int, run_dir: str) -> Trainer:
    cfg = load_config(os.path.join(REPO, "configs", "tiny.toml"),
                      {"train.steps": steps, "train.sample_tokens": 0, "train.device": "cpu", "log.run_dir": run_dir,
                       "log.progress": "off", "log.tensorboard": False, "checkpoint.save_final": False,
                       "train.eval_every": 0})
    trainer = Trainer(cfg, stream=open(os.devnull, "w"))
    trainer.fit()
    return trainer


def prompts_of(trainer: Trainer, count: int, length: int) -> list[list[int]]:
    from pydoc_data.topics import topics

    lines = [line.strip() for text in topics.values() for line in text.splitlines() if len(line.strip()) > length]
    tok = trainer.data.corpus.tokenizer
    return [tok.encode(line)[:length] for line in lines[:count]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--train-steps", type=int, default=60)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=24)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-new", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        trainer = trained_demo(args.train_steps, os.path.join(tmp, "run"))
    module = trainer.pm.dp.module
    prompts = prompts_of(trainer, args.prompts, args.prompt_tokens)
    params = SamplingParams(n=args.n, max_new_tokens=args.max_new, temperature=0.8, top_p=0.95, top_k=50, seed=1)
    engines = {"cache": LocalEngine(module, rescore=False), "no cache": LocalEngine(module, use_cache=False,
                                                                                   rescore=False),
               "cache + rescore": LocalEngine(module)}
    rates: dict[str, list[float]] = {k: [] for k in engines}
    outs = {}
    for r in range(args.rounds):
        names = list(engines)
        for name in names[r % len(names):] + names[:r % len(names)]:
            outs[name] = engines[name].generate(prompts, params)
            rates[name].append(outs[name].tokens_per_second)
    assert outs["cache"].completion_ids == outs["no cache"].completion_ids == outs["cache + rescore"].completion_ids
    tokens = outs["cache"].tokens_generated
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; demo model after {args.train_steps} steps; "
          f"{len(prompts)} prompts x {args.n} completions x {args.max_new} tokens = {tokens} tokens a round; "
          f"median of {args.rounds} rounds; load average {os.getloadavg()[0]:.1f}")
    print(f"{'':16} {'tokens/s':>9} {'forwards':>9}")
    for name in engines:
        print(f"{name:16} {statistics.median(rates[name]):9.0f} {outs[name].forwards:9d}")
    print(f"speed-up of the cache: {statistics.median(rates['cache']) / statistics.median(rates['no cache']):.1f}x")
    drawn, rescored = outs["cache"], outs["cache + rescore"]
    gaps, same, exact = [], 0, 0
    for prompt, completion, lps, final in zip(drawn.prompt_ids, drawn.completion_ids, drawn.logprobs,
                                              rescored.logprobs, strict=True):
        ref = logprobs_of(module, prompt, completion, params.temperature)
        gaps.append((ref - lps).abs())
        same += int((ref == lps).sum())
        exact += int(torch.equal(ref, final))
    gap = torch.cat(gaps)
    print(f"log-probs of the drawing forwards (cache) vs the trainer's forward, fp32: max {gap.max().item():.2e}, "
          f"mean {gap.mean().item():.2e}, bitwise equal {same}/{gap.numel()} tokens "
          f"({100 * gap.eq(0).float().mean().item():.0f}%)")
    plain = max((logprobs_of(module, p, c, params.temperature) - lp).abs().max().item()
                for p, c, lp in zip(drawn.prompt_ids, drawn.completion_ids, outs["no cache"].logprobs, strict=True))
    print(f"the same without the cache: max {plain:.2e}; rescored: bitwise equal on {exact}/{len(rescored)} "
          f"completions (sampling_gap {rescored.sampling_gap:.2e})")

if __name__ == "__main__":
    main()
