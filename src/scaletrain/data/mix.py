"""Data mixtures (`data.mix`): several prepared folders, each window drawn from one of them in
chosen proportions, e.g. 70% web, 20% code, 10% books.

Which source fills each slot of the run depends only on (seed, position), position = step *
global_batch + slot: slot p takes the source whose share of [0, 1) holds x_p = frac(c + p * phi)
(phi the golden ratio, c from the seed; in 64-bit integers). That sequence spreads evenly: over
any first N slots each source's count is within a few windows of N * weight, so the proportions
drawn match the weights from the first steps on, not just on average. The count of each source
before any position has a closed form (a floor sum, O(log N)), so step s is found without
replaying the steps before it: resuming is exact and costs nothing.

Within a source, windows come in the order of a permutation seeded by (seed, source, epoch) of
that source's windows, the k-th window drawn from it being the k-th of that order (epochs of
each source run on independently). The global batch is then split over data-parallel ranks and
micro-batches exactly as a single folder's (scaletrain.data.loader.rank_slices): every rank
reads distinct windows.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import torch

from scaletrain.data.dataset import TokenData, WindowDataset, open_data
from scaletrain.data.documents import document_separator
from scaletrain.data.loader import StepSampler
from scaletrain.data.tokenizer import TOKENIZER_FILE
from scaletrain.errors import ConfigError, DataError

M = 2**64
PHI = 0x9E3779B97F4A7C15  # 2**64 / golden ratio, odd


def source_name(path: str) -> str:
    return Path(path).name or str(path)


class MixData:
    """The sources of a mix, opened and checked to share one tokenizer; behaves like TokenData
    where the trainer needs it (tokenizer, vocabulary, source, fingerprint, num_tokens)."""

    def __init__(self, pairs: list[tuple[str, float]], verify_checksums: bool = True):
        self.paths = [p for p, _ in pairs]
        self.weights = np.array([w for _, w in pairs], dtype=np.float64)
        self.names = [source_name(p) for p in self.paths]
        if len(set(self.names)) < len(self.names):
            dup = next(n for n in self.names if self.names.count(n) > 1)
            raise DataError(f"data.mix: two sources are named {dup!r} (a source is named after its folder); "
                            "rename one of the folders")
        self.parts = [TokenData.open(p, verify_checksums) for p in self.paths]
        first = tokenizer_identity(self.parts[0], self.paths[0])
        for path, part in zip(self.paths[1:], self.parts[1:]):
            if (other := tokenizer_identity(part, path)) != first:
                raise DataError(f"data.mix: {path} was prepared with another tokenizer than {self.paths[0]} "
                                f"({_describe(other)} against {_describe(first)}); every source of a mix must "
                                "share one: prepare them with the same --tokenizer")
        self.tokenizer = self.parts[0].tokenizer
        self.vocab_size = self.parts[0].vocab_size
        self.num_tokens = sum(p.num_tokens for p in self.parts)
        self.source = "mix of " + ", ".join(f"{n} {100 * w:g}%" for n, w in zip(self.names, self.weights))
        h = hashlib.sha256(json.dumps([[n, float(w), p.fingerprint] for n, w, p in
                                       zip(self.names, self.weights, self.parts)]).encode())
        self.fingerprint = h.hexdigest()[:16]


def tokenizer_identity(data: TokenData, folder: str) -> dict:
    """What makes two tokenizers the same: the vocabulary and the sha256 of their files (a BPE
    trained by prepare and the same tokenizer.json given with --tokenizer file are one)."""
    described = data.tokenizer.describe()
    names = described.get("files") or ([described["file"]] if "file" in described else [])
    identity = {"kind": "byte" if described["kind"] == "byte" else "tokenizer.json",
                "vocab_size": described["vocab_size"]}
    for name in names:
        identity[f"sha256:{name}"] = hashlib.sha256((Path(folder) / name).read_bytes()).hexdigest()[:16]
    return identity


def _describe(identity: dict) -> str:
    digest = identity.get(f"sha256:{TOKENIZER_FILE}")
    return f"{identity['kind']}, vocabulary {identity['vocab_size']}" + (f", sha256 {digest}" if digest else "")


class MixDataset(torch.utils.data.Dataset):
    """Windows of all sources under one index: id = offsets[source] + window."""

    separator = None  # config loading refuses data.document_mask with data.mix

    def __init__(self, data: MixData, seq_len: int):
        self.data = data
        self.parts = [WindowDataset(p, seq_len) for p in data.parts]
        self.sizes = [len(p) for p in self.parts]
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def counted_in_step(self, step: int, sampler) -> None:
        return None  # every target counts: a mixture refuses loss masks (_use_mask)

    def counts_nothing(self, step: int, sampler) -> bool:
        return False

    def __getitem__(self, ids) -> tuple[torch.Tensor, torch.Tensor]:
        ids = np.asarray(ids, dtype=np.int64)
        which = np.searchsorted(self.offsets, ids, side="right") - 1
        rows = [self.parts[s].data.read(int(i - self.offsets[s]) * self.parts[s].seq_len, self.parts[s].seq_len + 1)
                for s, i in zip(which, ids)]
        tokens = torch.from_numpy(np.stack(rows))
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def floor_sum(n: int, m: int, a: int, b: int) -> int:
    """sum(floor((a * i + b) / m) for i in range(n)), for n, m >= 1 and a, b >= 0, in O(log)."""
    total = 0
    while True:
        if a >= m:
            total += (n - 1) * n // 2 * (a // m)
            a %= m
        if b >= m:
            total += n * (b // m)
            b %= m
        top = a * n + b
        if top < m:
            return total
        n, b = top // m, top % m
        m, a = a, m


class MixSampler(StepSampler):
    """StepSampler over a MixDataset: step s's global batch of window ids from (seed, s) alone
    (see the module's docstring); `drawn(step)` counts each source's windows before it.
    `weights`: one positive number per source, taken as proportions."""

    def __init__(self, dataset: MixDataset, weights, global_batch: int, micro_batch: int, grad_accum: int,
                 dp_rank: int, dp_size: int, seed: int, start_step: int = 0):
        super().__init__(max(len(dataset), global_batch), global_batch, micro_batch, grad_accum, dp_rank, dp_size,
                         seed, start_step)
        self.sizes, self.offsets = dataset.sizes, dataset.offsets
        # source d holds x in [bounds[d], bounds[d+1]): the weights as proportions, whatever they sum
        # to; a bound inside stays below 2**64 (uint64) even where a share is too small to show
        cumulative = np.cumsum(np.asarray(weights, dtype=np.float64))
        self.bounds = [0, *(min(M - 1, int(round(c / cumulative[-1] * M))) for c in cumulative[:-1]), M]
        self.c = int.from_bytes(hashlib.sha256(f"scaletrain.mix:{seed}".encode()).digest()[:8], "big")
        self._perms: dict[int, tuple[int, np.ndarray]] = {}  # source -> (epoch, its permutation)

    def sources(self, first: int, count: int) -> np.ndarray:
        """The source of each slot first, ..., first + count - 1."""
        p = np.arange(first, first + count, dtype=np.uint64)
        x = np.uint64(self.c) + p * np.uint64(PHI)  # modulo 2**64, as uint64 wraps
        return np.searchsorted(np.array(self.bounds[1:-1], dtype=np.uint64), x, side="right")

    def _below(self, n: int, bound: int) -> int:
        """How many of the first n slots have x < bound."""
        if n == 0 or bound == 0:
            return 0
        return floor_sum(n, M, PHI, self.c) - floor_sum(n, M, PHI, self.c + M - bound) + n

    def drawn(self, step: int) -> list[int]:
        """Windows drawn from each source in steps 0 .. step - 1 (closed form)."""
        n = step * self.global_batch
        below = [self._below(n, b) for b in self.bounds]
        return [below[d + 1] - below[d] for d in range(len(self.sizes))]

    def shares(self, step: int, names: list[str]) -> dict[str, float]:
        """{"mix/NAME": the share of the windows drawn before `step` from each source}."""
        drawn = self.drawn(step)
        return {f"mix/{name}": n / sum(drawn) for name, n in zip(names, drawn)}

    def global_batch_indices(self, step: int) -> np.ndarray:
        first = step * self.global_batch
        src = self.sources(first, self.global_batch)
        out = np.empty(self.global_batch, dtype=np.int64)
        for d, before in enumerate(self.drawn(step)):
            slots = np.flatnonzero(src == d)
            if slots.size:
                out[slots] = self.offsets[d] + self._windows(d, before + np.arange(slots.size))
        return out

    def _windows(self, d: int, k: np.ndarray) -> np.ndarray:
        """The k-th windows drawn from source d (k may cross its epochs)."""
        size = self.sizes[d]
        out = np.empty(k.size, dtype=np.int64)
        epochs = k // size
        for epoch in np.unique(epochs):
            cached = self._perms.get(d)
            if cached is None or cached[0] != epoch:
                cached = (int(epoch), np.random.default_rng([self.seed, d, int(epoch)]).permutation(size))
                self._perms[d] = cached
            sel = epochs == epoch
            out[sel] = cached[1][k[sel] % size]
        return out


def open_training_data(data_cfg, mix: list[tuple[str, float]] | None, vocab_size: int | None):
    """(data, dataset) of a run: data.path's folder, or data.mix's sources (`mix`, parsed) in
    proportion; refuses a tokenizer larger than the model's vocabulary (`vocab_size`; None: a
    custom module's, unknown). With data.document_mask the dataset knows the token that ends each
    document (its `separator`); with a loss mask (chat data) its `mask` (what a layout may refuse of
    it: scaletrain.legality.data_errors)."""
    data = MixData(mix, data_cfg.verify_checksums) if mix else open_data(data_cfg.path, data_cfg.verify_checksums)
    if mix:
        _use_mask(data_cfg.loss_mask, [data])  # refuses what a mixture cannot honour
    if vocab_size is not None and data.vocab_size > vocab_size:
        raise DataError(f"{data.source}: the tokenizer has {data.vocab_size} tokens but model.vocab_size={vocab_size}; "
                        f"set model.vocab_size to at least {data.vocab_size}")
    masked = not mix and _use_mask(data_cfg.loss_mask, [data])
    separator = None
    if data_cfg.document_mask and not mix:
        if vocab_size is None:
            raise ConfigError("data.document_mask=true masks the attention of scaletrain's transformer; a custom "
                              "module is not given the documents: set data.document_mask=false")
        separator = document_separator(data, data.source)
    return data, (MixDataset(data, data_cfg.seq_len) if mix else
                  WindowDataset(data, data_cfg.seq_len, loss_mask=masked, separator=separator))


def _use_mask(asked: str, parts: list) -> bool:
    """Whether training counts only the loss mask's tokens (data.loss_mask), refusing a mask asked
    of data without one and masks under data.mix (its sampler does not count them)."""
    where = "data.mix" if len(parts) > 1 or isinstance(parts[0], MixData) else parts[0].source
    masked = [getattr(p, "mask", None) is not None for p in getattr(parts[0], "parts", parts)]
    if asked == "true" and not all(masked):
        raise ConfigError(f"data.loss_mask=true, but {where} was prepared without a loss mask; prepare chat data "
                          "with `scaletrain prepare FILE.jsonl --chat-format plain|template --out FOLDER`, or set "
                          "data.loss_mask=auto")
    if asked != "false" and any(masked) and where == "data.mix":
        raise ConfigError("data.mix with loss-masked (chat) folders is not supported; train on one folder "
                          "(data.path), or set data.loss_mask=false to count every token")
    return asked != "false" and all(masked)


def step_sampler(dataset, layout, *, dp_rank: int, seed: int, start_step: int, schedule,
                 outer: tuple[int, int] = (0, 1)) -> StepSampler:
    """Which windows data-parallel rank `dp_rank` reads at each step from `start_step` on, by
    `layout`'s batch triad: a mixture's sampler (each source in its proportion) or one folder's
    (`schedule`: the batch-size warm-up, a BatchSchedule). `outer` = (index, count): this run is
    group `index` of `count` that read one step's windows apart (fault tolerance's replica groups:
    each reads what `layout.dp` ranks of a count-times larger data-parallel run read)."""
    b, (index, count) = layout, outer
    batch, dp, rank = b.global_batch * count, b.dp * count, index * b.dp + dp_rank
    if isinstance(dataset, MixDataset):
        return MixSampler(dataset, dataset.data.weights, batch, b.micro_batch, b.grad_accum,
                          dp_rank=rank, dp_size=dp, seed=seed, start_step=start_step)
    return StepSampler(len(dataset), batch, b.micro_batch, b.grad_accum, dp_rank=rank, dp_size=dp,
                       seed=seed, start_step=start_step, schedule=schedule)
