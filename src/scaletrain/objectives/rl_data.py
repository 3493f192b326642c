"""What an RL run reads and keeps (train.objective=rl): its prompts, the rows a batch of rollouts becomes,
and the file that records rollouts for replay.

* `PromptSet`: the rows of rl.prompts (jsonl or parquet: a `prompt` text and the fields the rewards read),
  tokenized once at start with the run's tokenizer (data.path's, else the built-in byte-level one). Which
  prompts a step samples depends on (seed, round, attempt) alone: `draw` walks a fresh permutation of the
  prompts per epoch, and each dynamic-sampling attempt of a round has its own stretch of it, so a resumed
  run draws what the uninterrupted one did.
* `Completion`: one sampled completion with what training needs of it (tokens, the rollout's log-probs,
  rewards, whether the length limit cut it); `to_rows` turns a rank's completions into fixed-width
  (inputs, targets) rows, prompt tokens and padding ignored in the targets.
* `RolloutRecord`: rl.record writes each round's completions of the whole batch, one JSON line a round;
  rl.rollouts replays them, each rank taking its share of the rows (verify compares layouts this way).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from scaletrain.config import completion_room_problem
from scaletrain.data.dataset import IGNORE_INDEX
from scaletrain.data.sources import iter_rows
from scaletrain.data.tokenizer import ByteTokenizer, load_tokenizer
from scaletrain.errors import ConfigError, DataError


def run_tokenizer(data_path: str):
    """The tokenizer of a run: data.path's (a folder written by `scaletrain prepare`), else byte-level."""
    if not data_path:
        return ByteTokenizer()
    from scaletrain.data.prepare import META_FILE

    folder = Path(data_path)
    try:
        meta = json.loads((folder / META_FILE).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise DataError(f"data.path={data_path}: train.objective=rl reads its tokenizer from a folder written by "
                        f"`scaletrain prepare`, and {folder / META_FILE} does not read ({e}); give such a folder, or "
                        "leave data.path empty for the byte-level tokenizer") from None
    return load_tokenizer(meta.get("tokenizer", {}), folder)


def open_prompts(cfg) -> PromptSet:
    """An RL run's training prompts (rl.prompts), with room in each row for rl.max_new_tokens."""
    if problem := completion_room_problem(cfg.data.seq_len, cfg.rl.max_new_tokens):
        raise ConfigError(problem)
    if not cfg.rl.prompts:
        raise ConfigError("train.objective=rl samples completions of prompts (and scores replayed ones from their "
                          "rows): set rl.prompts to a jsonl or parquet file of rows with a `prompt` and the fields "
                          "your rewards read")
    return PromptSet(cfg.rl.prompts, run_tokenizer(cfg.data.path), cfg.data.seq_len - cfg.rl.max_new_tokens)


class PromptSet:
    """The prompts of an RL run, tokenized, with their other fields. It stands where a language-model run's
    dataset stands (RunData.corpus and .dataset): `source`, `fingerprint` and `tokenizer` name the data;
    nothing is packed or masked."""

    separator = None
    rows_per_example = 1
    mask = None

    def __init__(self, path: str, tokenizer, room: int, key: str = "rl.prompts"):
        """`room`: the most prompt tokens a row holds (data.seq_len - rl.max_new_tokens)."""
        self.source, self.tokenizer = str(path), tokenizer
        self.texts: list[str] = []
        self.ids: list[list[int]] = []
        self.fields: dict[str, list] = {}
        rows = list(iter_rows([Path(path)], what=key))
        if not rows:
            raise DataError(f"{key}: {path} holds no rows; give a file with a `prompt` per row")
        names = set(rows[0][1]) - {"prompt"}
        for where, row in rows:
            prompt = row.get("prompt")
            if not isinstance(prompt, str) or not prompt:
                raise DataError(f"{where}: a prompt row needs a `prompt` that is non-empty text, got {prompt!r}")
            if set(row) - {"prompt"} != names:
                raise DataError(f"{where}: its fields {sorted(set(row) - {'prompt'})} are not the first row's "
                                f"{sorted(names)}; every row of {key} has the same fields")
            ids = tokenizer.encode(prompt)
            if len(ids) > room:
                raise DataError(f"{where}: the prompt is {len(ids)} tokens and a row holds {room} besides the "
                                f"completion (data.seq_len - rl.max_new_tokens); raise data.seq_len or shorten it")
            self.texts.append(prompt)
            self.ids.append(ids)
            for name in names:
                self.fields.setdefault(name, []).append(row[name])
        h = hashlib.sha256(json.dumps([self.texts, self.fields], sort_keys=True, default=str).encode())
        self.fingerprint = h.hexdigest()[:16]

    def __len__(self) -> int:
        return len(self.ids)

    def draw(self, seed: int, start: int, count: int) -> list[int]:
        """Prompt indices start .. start + count - 1 of the run's stream: each epoch a permutation of the
        prompts seeded by (seed, epoch)."""
        n, out = len(self.ids), []
        for k in range(start, start + count):
            epoch, pos = divmod(k, n)
            out.append(int(np.random.default_rng([seed, epoch]).permutation(n)[pos]))
        return out

    def counted_in_step(self, step: int, sampler) -> int:
        return 0  # the completions' tokens are known once sampled (the objective counts them)

    def counts_nothing(self, step: int, sampler) -> bool:
        return False


@dataclass
class Completion:
    """One completion of a prompt: its tokens, the rollout's per-token log-probs, the rewards (their weighted
    sum `reward`, and each function's), and `finished` (False: cut by rl.max_new_tokens)."""

    prompt: int  # the prompt's index in the PromptSet
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    finished: bool
    reward: float = 0.0
    rewards: dict[str, float] = field(default_factory=dict)
    advantage: float = 0.0


def to_rows(completions: list[Completion], seq_len: int, *, mask_truncated: bool = False,
            pad_id: int = 0) -> dict[str, torch.Tensor]:
    """Fixed-width rows of completions: `inputs` and `targets` (B, seq_len), a target IGNORE_INDEX except
    at completion tokens (and, with mask_truncated, a completion cut by the length limit has none);
    `rollout_logps` (B, seq_len) aligned with the targets; `lengths` (B,) the completion tokens trained."""
    B = len(completions)
    inputs = torch.full((B, seq_len), pad_id, dtype=torch.long)
    targets = torch.full((B, seq_len), IGNORE_INDEX, dtype=torch.long)
    rollout = torch.zeros(B, seq_len)
    lengths = torch.zeros(B)
    for i, c in enumerate(completions):
        row = c.prompt_ids + c.completion_ids
        if len(row) > seq_len + 1:
            raise DataError(f"a prompt of {len(c.prompt_ids)} tokens and a completion of {len(c.completion_ids)} "
                            f"exceed data.seq_len + 1 = {seq_len + 1}")
        n = min(len(row) - 1, seq_len)
        inputs[i, :n] = torch.tensor(row[:n])
        if mask_truncated and not c.finished:
            continue
        first = len(c.prompt_ids) - 1  # the position whose target is the completion's first token
        targets[i, first:n] = torch.tensor(row[first + 1:n + 1])
        rollout[i, first:n] = torch.tensor(c.logprobs[:n - first], dtype=torch.float32)
        lengths[i] = n - first
    return {"inputs": inputs, "targets": targets, "rollout_logps": rollout, "lengths": lengths}


class RolloutRecord:
    """rl.record / rl.rollouts: a jsonl file, one line per round of rollouts, {"round": r, "completions":
    [...]}, the whole global batch's completions in rank order."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._rounds: dict[int, list[Completion]] | None = None

    def write(self, round_: int, completions: list[Completion]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({"round": round_, "completions": [asdict(c) for c in completions]}) + "\n")

    def clear_from(self, round_: int) -> None:
        """Keep the rounds before `round_` (a resumed run records the rest again)."""
        if not self.path.exists():
            return
        kept = [line for line in self.path.read_text().splitlines() if json.loads(line)["round"] < round_]
        self.path.write_text("".join(line + "\n" for line in kept))

    def read(self, round_: int) -> list[Completion]:
        if self._rounds is None:
            self._rounds = {}
            for n, line in enumerate(self.path.read_text().splitlines(), 1):
                try:
                    entry = json.loads(line)
                    self._rounds[int(entry["round"])] = [Completion(**c) for c in entry["completions"]]
                except (ValueError, KeyError, TypeError) as e:
                    raise DataError(f"{self.path}:{n}: not a round of recorded rollouts ({e}); record it again "
                                    "with rl.record") from None
        if round_ not in self._rounds:
            raise DataError(f"rl.rollouts: {self.path} records rounds {sorted(self._rounds)[:3]}..."
                            f"{max(self._rounds, default=-1)} and the run needs round {round_}; record as many "
                            "steps as the run trains")
        return self._rounds[round_]
