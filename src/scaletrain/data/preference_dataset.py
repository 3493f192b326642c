"""Preference data on disk -> examples and padded batches: the reader of `prepare --preference` (issue 49).

`PreferenceData[i]` is example i: prompt + chosen and prompt + rejected (pairs), or prompt + completion
with its label (unpaired), each with a completion mask, 1 on the completion's tokens alone. It is
indexed by example, so whatever sampler picks the indices, a pair is never split across micro-batches
or ranks; `collate_preference` pads a list of examples into one `PreferenceBatch`, a pair's two
sequences on adjacent rows. Nothing here knows the trainer (the wiring comes later).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from scaletrain.data.dataset import IGNORE_INDEX, TokenData
from scaletrain.data.preference import INDEX_COLUMNS, PREFERENCE_FORMAT, PREFERENCE_KINDS
from scaletrain.data.prepare import META_FILE
from scaletrain.errors import DataError


@dataclass
class PreferenceExample:
    """One example's sequences: [chosen, rejected] (pairs) or [completion] (unpaired), each prompt + completion."""

    sequences: list[torch.Tensor]  # (L,) int64 token ids each
    masks: list[torch.Tensor]  # (L,) bool each: True on the completion's tokens
    prompt_len: int
    label: bool | None  # unpaired: desirable (True) or not; pairs: None


@dataclass
class PreferenceBatch:
    """Examples padded to one length T (the longest sequence less one: inputs and targets are shifted by one).
    R rows, one per sequence in the order of the examples: a pair's chosen on row 2k, its rejected on 2k + 1."""

    input_ids: torch.Tensor  # (R, T) int64, padded with the pad id
    targets: torch.Tensor  # (R, T) int64: the next token; IGNORE_INDEX on the prompt's tokens and the padding
    completion_mask: torch.Tensor  # (R, T) bool: the targets that are completion tokens (what the losses sum)
    pair_index: torch.Tensor  # (R,) int64: the example of the batch each row belongs to
    chosen: torch.Tensor | None  # (R,) bool: a pair's chosen row (pairs); None for unpaired data
    label: torch.Tensor | None  # (R,) bool: a desirable completion (unpaired); None for pairs


class PreferenceData(torch.utils.data.Dataset):
    """The examples of a folder written by `scaletrain prepare --preference` (one split)."""

    def __init__(self, tokens: TokenData, index: np.ndarray, kind: str):
        self.tokens, self.index, self.kind = tokens, index, kind
        self.tokenizer = tokens.tokenizer
        widths = index[:, :3] if kind == "pairs" else index[:, :2]  # an unpaired row's third column is its label
        self.lengths = widths.sum(axis=1)
        self.offsets = np.concatenate([[0], np.cumsum(self.lengths)]).astype(np.int64)
        if int(self.offsets[-1]) != tokens.num_tokens:
            raise DataError(f"{tokens.source}: the index covers {int(self.offsets[-1])} tokens, the shards hold "
                            f"{tokens.num_tokens}; re-run scaletrain prepare")

    @classmethod
    def open(cls, folder: str | Path, split: str = "train", verify_checksums: bool = True) -> PreferenceData:
        folder = Path(folder)
        tokens = TokenData.open(folder, verify_checksums, split, expected_format=PREFERENCE_FORMAT)
        meta_path = folder / META_FILE
        meta = json.loads(meta_path.read_text())  # read and checked by TokenData.open
        kind = (meta.get("preference") or {}).get("kind")
        if kind not in PREFERENCE_KINDS:
            raise DataError(f"{meta_path}: preference kind {kind!r} is not one of {', '.join(PREFERENCE_KINDS)}; "
                            "re-run scaletrain prepare")
        shards = meta.get("index_shards" if split == "train" else "val_index_shards")
        if not isinstance(shards, list) or len(shards) != 1 or not isinstance(shards[0], dict):
            raise DataError(f"{meta_path}: lists no index for the {split} split; re-run scaletrain prepare")
        entry = shards[0]
        name, path = str(entry.get("file")), folder / str(entry.get("file"))
        raw = path.read_bytes() if Path(name).name == name and path.is_file() else None
        width, count = len(INDEX_COLUMNS[kind]), entry.get("num_tokens")
        if raw is None or not isinstance(count, int) or len(raw) != 8 * count or len(raw) % (8 * width):
            raise DataError(f"{path}: the index is missing, misnamed or not the size {META_FILE} records; re-run "
                            "scaletrain prepare")
        if verify_checksums and hashlib.sha256(raw).hexdigest() != entry.get("sha256"):
            raise DataError(f"{path}: the index is corrupt (its sha256 differs from {META_FILE}); re-run scaletrain "
                            "prepare")
        index = np.frombuffer(raw, dtype=np.int64).reshape(-1, width)
        if (index < 0).any():
            raise DataError(f"{path}: the index holds a negative length; re-run scaletrain prepare")
        return cls(tokens, index, kind)

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> PreferenceExample:
        row = [int(x) for x in self.index[i]]
        prompt_len = row[0]
        completions = row[1:3] if self.kind == "pairs" else row[1:2]
        ids = torch.from_numpy(self.tokens.read(int(self.offsets[i]), int(self.lengths[i])))
        prompt, sequences, masks, pos = ids[:prompt_len], [], [], prompt_len
        for n in completions:
            sequences.append(torch.cat([prompt, ids[pos:pos + n]]))
            masks.append(torch.arange(prompt_len + n) >= prompt_len)
            pos += n
        return PreferenceExample(sequences, masks, prompt_len, bool(row[2]) if self.kind == "unpaired" else None)


def collate_preference(examples: list[PreferenceExample], pad_id: int = 0) -> PreferenceBatch:
    """Pad `examples` into one batch, each example's sequences on adjacent rows (a pair is never split)."""
    seqs = [(s, m) for ex in examples for s, m in zip(ex.sequences, ex.masks)]
    R, T = len(seqs), max(s.numel() for s, _ in seqs) - 1
    input_ids = torch.full((R, T), pad_id, dtype=torch.long)
    targets = torch.full((R, T), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((R, T), dtype=torch.bool)
    for r, (s, m) in enumerate(seqs):
        n = s.numel() - 1  # position t predicts token t + 1: a completion token is counted as the target
        input_ids[r, :n] = s[:-1]
        mask[r, :n] = m[1:]
        targets[r, :n] = torch.where(m[1:], s[1:], IGNORE_INDEX)
    per_example = torch.tensor([len(ex.sequences) for ex in examples])
    pair_index = torch.repeat_interleave(torch.arange(len(examples)), per_example)
    pairs = examples[0].label is None
    chosen = torch.arange(R) % 2 == 0 if pairs else None
    label = None if pairs else torch.tensor([ex.label for ex in examples], dtype=torch.bool)
    return PreferenceBatch(input_ids, targets, mask, pair_index, chosen, label)


class PreferenceWindows(torch.utils.data.Dataset):
    """PreferenceData as the trainer reads it (train.objective=preference): `dataset[indices]` is one
    micro-batch of examples as fixed-width rows, (inputs, targets, ids): inputs and targets (R, seq_len),
    every example's sequences on adjacent rows (a pair's chosen, then its rejected; an unpaired example's
    completion, then its KL row: its prompt with the completion of `kl_partner` — KTO's mismatched pair, fixed
    by the data rather than by the batch, so that every layout estimates the KL alike), padded on the right;
    targets the next token on the completion's tokens and IGNORE_INDEX elsewhere; ids the examples'
    indices (what the precomputed reference log-probs are looked up by). One width for every batch keeps
    the shapes that pipeline stages, context-parallel chunks and compiled blocks need.

    The step's counts come from the index alone, the same on every rank: its examples (what the loss is
    a mean over) and its completion tokens (counted, and ORPO's NLL divisor: the chosen's)."""

    mask = None  # the trainer's loss mask and document separator: a language-modelling dataset's
    separator = None

    def __init__(self, data: PreferenceData, seq_len: int, pad_id: int = 0):
        self.data, self.seq_len, self.pad_id = data, seq_len, pad_id
        self.kind, self.tokenizer = data.kind, data.tokenizer
        self.rows_per_example = 2  # a pair's two sequences; an unpaired example's own and its KL row
        columns = data.index[:, 1:3] if data.kind == "pairs" else data.index[:, 1:2]
        self.completion_lengths = columns.astype(np.int64)  # (N, rows per example)
        # a sequence of L tokens fills L - 1 positions (inputs and targets shifted by one)
        self.longest = int((data.index[:, :1] + columns).max()) - 1 if len(data) else 0
        self._counts = (-1, 0, 0)

    def __len__(self) -> int:
        return len(self.data)

    def kl_partner(self, i: int) -> int:
        """The example whose completion example i's KL row takes (the next one, round the data's end)."""
        return (i + 1) % len(self.data)

    def _with_kl_row(self, i: int) -> PreferenceExample:
        """Example i with its KL row: its prompt and its partner's completion, cut on the right to fit a row."""
        ex, other = self.data[i], self.data[self.kl_partner(i)]
        prompt, completion = ex.sequences[0][:ex.prompt_len], other.sequences[0][other.prompt_len:]
        kl = torch.cat([prompt, completion])[:self.seq_len + 1]
        mask = torch.arange(kl.numel()) >= ex.prompt_len
        return PreferenceExample([ex.sequences[0], kl], [ex.masks[0], mask], ex.prompt_len, ex.label)

    def __getitem__(self, indices) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        examples = [self.data[int(i)] if self.kind == "pairs" else self._with_kl_row(int(i)) for i in indices]
        batch = collate_preference(examples, self.pad_id)
        R, T = batch.input_ids.shape
        if T > self.seq_len:
            raise DataError(f"{self.data.tokens.source}: an example is {T + 1} tokens long, more than data.seq_len + 1 "
                            f"= {self.seq_len + 1}; raise data.seq_len or prepare again with --max-length")
        inputs = torch.full((R, self.seq_len), self.pad_id, dtype=torch.long)
        targets = torch.full((R, self.seq_len), IGNORE_INDEX, dtype=torch.long)
        inputs[:, :T], targets[:, :T] = batch.input_ids, batch.targets
        return inputs, targets, torch.as_tensor(np.asarray(indices, dtype=np.int64))

    def labels(self, ids: torch.Tensor) -> torch.Tensor:
        """Unpaired examples: desirable (True) or not, by example index."""
        return torch.as_tensor(self.data.index[ids.numpy(), 2] != 0)

    def step_counts(self, step: int, sampler) -> tuple[int, int]:
        """(examples, chosen completion tokens) of step `step`'s global batch (kept for the last step asked)."""
        if self._counts[0] != step:
            ids = sampler(step).global_batch_indices(step)
            self._counts = (step, len(ids), int(self.completion_lengths[ids, 0].sum()))
        return self._counts[1], self._counts[2]

    def counted_in_step(self, step: int, sampler) -> int:
        """The completion tokens of step `step`'s global batch: the targets the losses read."""
        return max(1, int(self.completion_lengths[sampler(step).global_batch_indices(step)].sum()))

    def counts_nothing(self, step: int, sampler) -> bool:
        return False  # prepare drops every example without a completion token

    def counted_tokens(self, indices) -> int:
        return int(self.completion_lengths[np.asarray(indices)].sum())
