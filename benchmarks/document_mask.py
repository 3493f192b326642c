"""The cost of data.document_mask on CPU: the same model, data and batch trained with and without
it, step by step in one process, interleaved (scaletrain.bench.interleave: the rounds start at a
different variant each, medians over the rounds).

The data: the paragraphs of the documentation that ships with CPython (pydoc_data.topics, split
at blank lines) as documents, BPE-tokenized here (vocabulary 1024, each document ended by
<|endoftext|>): short documents, several to a window. Byte-level data has no end-of-document
token, so document masks need a tokenizer that has one.

What changes with the mask: each forward builds the (B, 1, T, T) boolean mask and the rotary or
learned positions from the separators, and attention runs scaled_dot_product_attention with that
explicit mask instead of is_causal (on CPU: the kernel that reads a mask); the loader counts the
targets of the whole global batch each step.

    nice python benchmarks/document_mask.py [--steps 10] [--warmup 2] [--seq 128,512]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
from pathlib import Path

import torch


def corpus(folder: Path) -> Path:
    """The topics' paragraphs, one jsonl document each, prepared with a BPE trained on them."""
    from pydoc_data.topics import topics

    from scaletrain.data import prepare

    docs = [p.strip() for key in sorted(topics) for p in topics[key].split("\n\n") if p.strip()]
    (folder / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    prepare([folder / "docs.jsonl"], folder / "tok", tokenizer="bpe", vocab_size=1024, workers=1)
    return folder / "tok"


def trainer(data: Path, run_dir: Path, seq: int, tokens: int, masked: bool):
    from scaletrain.config import load_config
    from scaletrain.train.trainer import Trainer

    cfg = load_config(None, {
        "model.preset": "tiny", "model.vocab_size": 0, "model.max_seq_len": seq, "data.path": str(data),
        "data.seq_len": seq, "data.document_mask": masked, "train.global_batch": tokens // seq,
        "train.device": "cpu", "train.steps": 1000, "train.sample_tokens": 0, "log.run_dir": str(run_dir),
        "log.tensorboard": False, "log.progress": "off", "log.summary": False, "checkpoint.save_final": False})
    devnull = open(os.devnull, "w")  # noqa: SIM115 - the Trainer logs to it for as long as it lives
    with contextlib.redirect_stdout(devnull):
        return Trainer(cfg, stream=devnull)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=10, help="timed rounds (one step of each variant a round)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--seq", default="128,512", help="window lengths, comma-separated (4,096 tokens a step each)")
    args = ap.parse_args()
    from scaletrain.bench.interleave import Entry, rows_table, run, trainer_runner

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="docmask-") as tmp:
        tmp = Path(tmp)
        data = corpus(tmp)
        print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), {os.cpu_count()} core(s); "
              f"model tiny (the demo's shape), vocabulary 1024 (BPE), fp32, AdamW; 4,096 tokens a step")
        for seq in (int(s) for s in args.seq.split(",")):
            probe = trainer(data, tmp / f"probe-{seq}", seq, 4096, True)
            windows = probe.sampler(0).global_batch_indices(0)
            inputs, _ = probe.data.dataset[windows]
            docs = (inputs == probe.data.dataset.separator).sum(1).float().mean().item() + 1
            counted = probe.counted_tokens(0) / inputs.numel()
            print(f"\nwindows of {seq} tokens, batch {len(windows)}: {docs:.1f} documents a window (step 1's "
                  f"mean), {100 * counted:.1f}% of the targets counted (those after a separator are not)")
            entries = [Entry(f"causal, seq {seq}", lambda s=seq: trainer_runner(
                           trainer(data, tmp / f"causal-{s}", s, 4096, False))),
                       Entry(f"document_mask, seq {seq}", lambda s=seq: trainer_runner(
                           trainer(data, tmp / f"masked-{s}", s, 4096, True)))]
            rows = run(entries, steps=args.steps, warmup=args.warmup, device=torch.device("cpu"),
                       progress=lambda text: print(f"  ({text})", file=sys.stderr))
            print(rows_table(rows))
            print(f"medians of {args.steps} interleaved steps each; step time with / without the mask: "
                  f"{rows[1].median_s / rows[0].median_s:.3f}")


if __name__ == "__main__":
    main()
