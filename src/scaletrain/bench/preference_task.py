"""A synthetic preference task whose answer we know: the completion that follows the prompt's stated rule
is preferred over one that breaks it (issue 49 #7; the tests and benchmarks/preference.py train on it).

Each prompt states a kind of characters ("digits: ", "vowels: ", "capitals: "); the chosen completion is
eight characters of that kind, the rejected one eight of another kind, both drawn at random. A model that
learns the rule prefers every held-out pair's chosen; one that has not is at chance (50%). With `subtle`, the
rejected completion breaks the rule at one position only (one character of another kind among seven of the
right one): the pair differs in one token, which a model must single out.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

KINDS = {"digits": "0123456789", "vowels": "aeiou", "capitals": "BCDFGHJKLMNPQRSTVWXZ"}


def rule_pairs(n: int, seed: int = 0, length: int = 8, subtle: bool = False) -> list[dict]:
    """`n` rows {"prompt", "chosen", "rejected"}: the chosen follows the prompt's rule, the rejected breaks it
    (everywhere, or with `subtle` at one position: the chosen with one character replaced)."""
    rng = random.Random(seed)
    names = sorted(KINDS)
    rows = []
    for _ in range(n):
        kind = rng.choice(names)
        other = rng.choice([k for k in names if k != kind])
        chosen = "".join(rng.choice(KINDS[kind]) for _ in range(length))
        if subtle:
            at = rng.randrange(length)
            rejected = chosen[:at] + rng.choice(KINDS[other]) + chosen[at + 1:]
        else:
            rejected = "".join(rng.choice(KINDS[other]) for _ in range(length))
        rows.append({"prompt": f"{kind}: ", "chosen": chosen, "rejected": rejected})
    return rows


def write_rule_pairs(path: str | Path, n: int, seed: int = 0, subtle: bool = False) -> Path:
    """The rows of `rule_pairs` as a jsonl file (`scaletrain prepare FILE --preference --out FOLDER` reads it)."""
    path = Path(path)
    path.write_text("".join(json.dumps(row) + "\n" for row in rule_pairs(n, seed, subtle=subtle)))
    return path
