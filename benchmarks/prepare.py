"""How fast is `scaletrain prepare` against the tokenizer's own `encode_batch`?

Both tokenize the same documents on the same cores with the same tokenizer (a byte-level BPE
trained here on the text shipped with CPython, saved as tokenizer.json):

* `encode_batch`: the documents already in memory as a list of strings, one call of the
  `tokenizers` library's own batch encoder, which runs on every core (Rust threads). Nothing is
  read, parsed or written: the upper bound of tokenizing alone.
* `prepare`: the whole `scaletrain prepare CORPUS --tokenizer file --workers N`, in this process:
  reading the jsonl file, parsing each line, tokenizing in N worker processes, writing shards and
  their sha256, and meta.json.

The corpus is jsonl built from CPython's documentation text (paragraphs shuffled into documents
of 1-8 KB) up to --mb megabytes. Rounds alternate the two; the median of each is reported, in MB
of input text per second, with their ratio.

    python benchmarks/prepare.py [--mb 64] [--rounds 3] [--workers N]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from scaletrain.data.dataset import builtin_text
from scaletrain.data.prepare import default_workers, prepare
from scaletrain.data.tokenizer import HFTokenizer


def corpus(folder: Path, megabytes: float, seed: int = 0) -> tuple[Path, list[str]]:
    paragraphs = [p for p in builtin_text().split("\n\n") if p.strip()]
    rng = random.Random(seed)
    docs, size, target = [], 0, int(megabytes * 1e6)
    while size < target:
        doc, want = [], rng.randint(1000, 8000)
        while sum(map(len, doc)) < want:
            doc.append(rng.choice(paragraphs))
        text = "\n\n".join(doc)
        docs.append(text)
        size += len(text.encode())
    path = folder / "corpus.jsonl"
    with path.open("w") as f:
        for d in docs:
            f.write(json.dumps({"text": d}) + "\n")
    return path, docs


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=64, help="corpus size in MB of text (default 64)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workers", type=int, default=default_workers(), help="default: every core")
    args = ap.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="bench-prepare-"))
    try:
        path, docs = corpus(root, args.mb)
        mb = sum(len(d.encode()) for d in docs) / 1e6
        tok = HFTokenizer.train_bpe(iter(builtin_text().split("\n\n")), 8192)
        tok.save(root)
        tokenizer_file = root / "tokenizer.json"
        print(f"corpus: {len(docs):,} documents, {mb:.1f} MB of text ({path.stat().st_size / 1e6:.1f} MB of jsonl); "
              f"BPE vocabulary {tok.vocab_size}; {args.workers} worker(s) / cores: {default_workers()}")
        times: dict[str, list[float]] = {"encode_batch": [], "prepare": []}
        tokens = {}
        for r in range(args.rounds):
            t0 = time.perf_counter()
            encoded = tok.tok.encode_batch(docs)
            times["encode_batch"].append(time.perf_counter() - t0)
            tokens["encode_batch"] = sum(len(e.ids) for e in encoded)
            del encoded
            out = root / f"out{r}"
            t0 = time.perf_counter()
            meta = prepare([path], out, tokenizer="file", tokenizer_file=tokenizer_file, workers=args.workers)
            times["prepare"].append(time.perf_counter() - t0)
            tokens["prepare"] = meta["num_tokens"] - len(docs) * len(tok.separator)
            shutil.rmtree(out)
            print(f"round {r + 1}: encode_batch {times['encode_batch'][-1]:.2f} s, "
                  f"prepare {times['prepare'][-1]:.2f} s")
        assert tokens["prepare"] == tokens["encode_batch"], tokens  # the same tokens, separators aside
        med = {k: statistics.median(v) for k, v in times.items()}
        for what in ("encode_batch", "prepare"):
            print(f"{what:<14}{mb / med[what]:7.2f} MB/s  ({tokens[what] / med[what] / 1e6:.2f}M tokens/s)")
        print(f"prepare / encode_batch: {med['encode_batch'] / med['prepare']:.2f}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")  # encode_batch on every core, as by default
    main()
