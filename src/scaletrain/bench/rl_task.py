"""A verifiable task for RL (issue 50 #7; benchmarks/rl.py and the tests train on it): sums of small numbers,
whose answers a reward checks exactly.

A prompt is "a+b=" and its answer the sum's digits; a completion is right when its last number is the sum
(rewards.answer_match with extractor last_number) and ends at a newline (rl.stop = "\\n"). `sft_text` writes
the same format as plain text for a brief supervised warm-up (a model that has seen the format, but not yet
learned to add); `write_prompts` the jsonl files rl.prompts and rl.eval_prompts read, the held-out prompts
none of the training ones.
"""

from __future__ import annotations

import json
import random
from pathlib import Path


def problems(largest: int = 9) -> list[tuple[int, int]]:
    return [(a, b) for a in range(largest + 1) for b in range(largest + 1)]


def split(largest: int = 9, held_out: float = 0.2, seed: int = 0) -> tuple[list, list]:
    """The problems split into training and held-out ones, at random (seeded)."""
    every = problems(largest)
    random.Random(seed).shuffle(every)
    n = max(1, int(len(every) * held_out))
    return every[n:], every[:n]


def write_prompts(path: str | Path, pairs: list[tuple[int, int]]) -> Path:
    """rl.prompts's rows: {"prompt": "a+b=", "answer": "a+b"}."""
    path = Path(path)
    path.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n" for a, b in pairs))
    return path


def sft_text(path: str | Path, pairs: list[tuple[int, int]], lines: int, seed: int = 0) -> Path:
    """`lines` lines "a+b=c", drawn from `pairs` (the training problems), for `scaletrain prepare`."""
    rng = random.Random(seed)
    path = Path(path)
    path.write_text("".join(f"{a}+{b}={a + b}\n" for a, b in (rng.choice(pairs) for _ in range(lines))))
    return path
