"""Verifiable tasks for RL (issue 50 #7; benchmarks/rl.py, the tests and the guide train on them): a prompt whose
answer a reward checks exactly, in a format a model learns from a brief supervised warm-up.

    sum       "a+b=" -> the sum's digits (single digits by default); reward: answer_match, extractor last_number
    reverse   "abc<" -> "cba", random lowercase words; reward: answer_match, extractor first_line

A completion ends at a newline (rl.stop = "\\n"). `sft_text` writes the task as plain text, one example a line,
for `scaletrain prepare` (a model that has seen the format but not yet learned the task well); `write_prompts`
the jsonl files rl.prompts and rl.eval_prompts read ({"prompt", "answer"}); `examples` draws them, the held-out
ones from another seed (the words: whatever overlap chance gives).
"""

from __future__ import annotations

import json
import random
import string
from pathlib import Path

TASKS = ("sum", "reverse")
EXTRACTOR = {"sum": "last_number", "reverse": "first_line"}


def example(task: str, rng: random.Random, largest: int = 9, letters: tuple[int, int] = (3, 5)) -> tuple[str, str]:
    """(prompt, answer) of one example of `task`."""
    if task == "sum":
        a, b = rng.randint(0, largest), rng.randint(0, largest)
        return f"{a}+{b}=", str(a + b)
    if task == "reverse":
        word = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(*letters)))
        return f"{word}<", word[::-1]
    raise ValueError(f"unknown task {task!r}; one of {TASKS}")


def examples(task: str, n: int, seed: int = 0, **kw) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    return [example(task, rng, **kw) for _ in range(n)]


def write_prompts(path: str | Path, rows: list[tuple[str, str]]) -> Path:
    """rl.prompts's rows: {"prompt", "answer"}."""
    path = Path(path)
    path.write_text("".join(json.dumps({"prompt": p, "answer": a}) + "\n" for p, a in rows))
    return path


def sft_text(path: str | Path, rows: list[tuple[str, str]]) -> Path:
    """The examples as text, "PROMPTANSWER" a line, for `scaletrain prepare`."""
    path = Path(path)
    path.write_text("".join(f"{p}{a}\n" for p, a in rows))
    return path


def ascii_share(prompts, completions, completion_ids, **_) -> list[float]:
    """A graded reward for smoke runs and tests of an untrained byte-level model: the share of a completion's
    tokens that are ASCII bytes (below 128). Random completions score about a half, with spread: groups differ."""
    return [sum(t < 128 for t in ids) / max(1, len(ids)) for ids in completion_ids]
