"""Token data on disk or in memory, cut into (input, target) windows.

Window i covers tokens [i*T, i*T + T + 1): the input is the first T, the target the last T.
Windows do not overlap and may span shard boundaries, so no token is wasted.

Shards are read with pread, not through a memory map: a shard cut short while a run reads it
(rewritten, truncated) then gives a short read, reported in one line naming the shard, where a
map would kill the process with SIGBUS on the first page past the new end.
"""

from __future__ import annotations

import hashlib
import json
import os
import weakref
from pathlib import Path

import numpy as np
import torch

from scaletrain.data.preference import PREFERENCE_FORMAT
from scaletrain.data.prepare import FORMAT, META_FILE
from scaletrain.data.sources import input_kind
from scaletrain.data.tokenizer import ByteTokenizer, load_tokenizer
from scaletrain.errors import DataError

VALID_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


def how_to_prepare(folder: Path) -> str:
    """The commands that make `folder`, which holds no prepared data, trainable — ones that work
    as printed: a folder or file of raw text is prepared into a new folder beside it (prepare
    never writes into a folder that holds files); a missing or empty folder can be prepare's
    output."""
    if not folder.exists():  # a mistyped path, or data not made yet: which, the user knows
        return (f"the folder was not found: check the path, or make it with `scaletrain prepare INPUT... "
                f"--out {folder}`")
    if folder.is_file():  # --data.path=corpus.jsonl: a raw file, which prepare reads, not writes
        if not input_kind(folder):
            return ("it is a file, not a folder of prepared data: give --data.path the folder `scaletrain prepare "
                    "INPUT... --out FOLDER` wrote")
    elif not any(f.is_file() and input_kind(f) for f in folder.rglob("*")):
        return f"prepare the data first with `scaletrain prepare INPUT... --out {folder}`"
    base = folder if folder.name else folder.resolve()  # "." has no name to extend
    if folder.is_file():
        base = base.with_name(base.name.split(".")[0] or "data")  # corpus.jsonl.gz -> corpus-tokens
    out = base.with_name(f"{base.name}-tokens")
    n = 2
    while out.exists():
        out, n = base.with_name(f"{base.name}-tokens-{n}"), n + 1
    what = "it is a raw text file" if folder.is_file() else "it holds raw text"
    return (f"{what}: prepare it into a new folder with `scaletrain prepare {folder} --out {out}`, "
            f"then train with --data.path={out}")


class TokenData:
    """All tokens of a prepared folder as one logical array (shards concatenated).

    `fingerprint` names the data: equal fingerprints mean the same tokens (a checkpoint keeps
    it, so a run does not resume on other data)."""

    def __init__(self, arrays_or_paths: list, dtype: np.dtype, lengths: list[int], tokenizer, source: str,
                 description: dict | None = None):
        self._sources = arrays_or_paths  # np.ndarray (in memory) or Path (opened lazily, read with pread)
        self._opened: list[np.ndarray | int] | None = None  # the arrays, and a file descriptor per Path
        self.dtype = np.dtype(dtype)
        self.lengths = lengths
        self.offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        self.num_tokens = int(self.offsets[-1])
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.vocab_size
        self.source = source
        self._description = description  # what meta.json says of the shards; None in memory
        self._fingerprint: str | None = None
        self.mask: TokenData | None = None  # the loss mask (prepare --chat-format): 1 a counted target, else 0

    @classmethod
    def from_array(cls, tokens: np.ndarray, tokenizer, source: str) -> TokenData:
        top = int(tokens.max()) if tokens.size else 0
        if top >= tokenizer.vocab_size:
            raise DataError(f"{source}: holds token id {top}, outside the tokenizer's {tokenizer.vocab_size}-token "
                            "vocabulary")
        return cls([tokens], tokens.dtype, [int(tokens.size)], tokenizer, source)

    @property
    def fingerprint(self) -> str:
        """16 hex digits naming the tokens, stable across opens, copies and moves of the folder.

        For a prepared folder: a sha256 of its dtype, tokenizer and, per shard, file name, token
        count and recorded sha256, plus the first and last 4 KiB of each shard; it reads no
        more than that (a shard edited in its middle is caught by data.verify_checksums).
        In memory: a sha256 of all the tokens."""
        if self._fingerprint is None:
            h = hashlib.sha256()
            if self._description is not None:
                h.update(json.dumps(self._description, sort_keys=True).encode())
                for path in self._sources:
                    with path.open("rb") as f:
                        h.update(f.read(_SAMPLE_BYTES))
                        f.seek(max(0, path.stat().st_size - _SAMPLE_BYTES))
                        h.update(f.read(_SAMPLE_BYTES))
            else:
                h.update(json.dumps({"dtype": self.dtype.name, "tokenizer": self.tokenizer.describe()},
                                    sort_keys=True).encode())
                for arr in self._sources:
                    h.update(np.ascontiguousarray(arr).data)
            self._fingerprint = h.hexdigest()[:16]
        return self._fingerprint

    @classmethod
    def open(cls, folder: str | Path, verify_checksums: bool = True, split: str = "train",
             expected_format: str = FORMAT) -> TokenData:
        """Open a folder written by `scaletrain prepare`, checking it against its metadata.
        `split`: train (its `shards`) or val (its `val_shards`, written by --val-fraction).
        `expected_format`: the folder's kind, token data (FORMAT) or preference data's tokens."""
        if split not in ("train", "val"):
            raise ValueError(f"unknown split {split!r}; expected train or val")
        folder = Path(folder)
        meta_path = folder / META_FILE
        if not meta_path.is_file():
            raise DataError(f"{folder}: no {META_FILE}; {how_to_prepare(folder)}")
        try:
            meta = json.loads(meta_path.read_text())
        except json.JSONDecodeError as e:
            raise DataError(f"{meta_path}: not valid JSON ({e.msg}); re-run scaletrain prepare") from None
        fmt = meta.get("format") if isinstance(meta, dict) else None
        if fmt == PREFERENCE_FORMAT != expected_format:
            raise DataError(f"{folder}: holds preference data (prepare --preference), which language-model "
                            "training does not read; train on it with train.objective=preference, or give a folder "
                            "of text or chat data")
        if fmt != expected_format:
            raise DataError(f"{meta_path}: not a scaletrain token folder (format {fmt!r}); re-run scaletrain prepare")
        dtype_name = meta.get("dtype")
        if dtype_name not in VALID_DTYPES:
            raise DataError(f"{meta_path}: token dtype {dtype_name!r} is not supported; "
                            f"expected one of {', '.join(VALID_DTYPES)}")
        dtype = np.dtype(VALID_DTYPES[dtype_name])
        tokenizer = load_tokenizer(meta.get("tokenizer", {}), folder)
        if tokenizer.vocab_size > np.iinfo(dtype).max + 1:
            raise DataError(f"{meta_path}: dtype {dtype_name} cannot hold the ids of a "
                            f"{tokenizer.vocab_size}-token vocabulary; re-run scaletrain prepare")
        paths, lengths, described = [], [], []
        key = "shards" if split == "train" else "val_shards"
        if key not in meta and split == "val":
            raise DataError(f"{meta_path}: no validation split; prepare the data with --val-fraction F")
        shards = meta.get(key)
        for shard in shards if isinstance(shards, list) else []:
            try:
                path, n = folder / shard["file"], int(shard["num_tokens"])
            except (TypeError, KeyError, ValueError):
                raise DataError(f"{meta_path}: shard entry {shard!r} needs a file name and a token count; "
                                "re-run scaletrain prepare") from None
            if Path(shard["file"]).name != shard["file"]:  # shards live in this folder, nowhere else
                raise DataError(f"{meta_path}: shard file {shard['file']!r} is not a plain file name in this "
                                "folder; re-run scaletrain prepare")
            if n < 1:
                raise DataError(f"{meta_path}: shard {shard['file']!r} has {n} tokens; prepare never writes an "
                                "empty shard, so re-run scaletrain prepare")
            if not path.is_file():
                raise DataError(f"{path}: shard listed in {META_FILE} is missing")
            size, expected = path.stat().st_size, n * dtype.itemsize
            if size < expected:
                raise DataError(f"{path}: shard is truncated or has the wrong dtype: it is shorter than {META_FILE} "
                                f"records, {size} bytes against {n} tokens of {dtype_name} ({expected} bytes); "
                                "re-run scaletrain prepare")
            if size > expected:
                raise DataError(f"{path}: shard is longer than {META_FILE} records, {size} bytes against {n} tokens "
                                f"of {dtype_name} ({expected} bytes): something was appended to it, or the dtype "
                                "is wrong; re-run scaletrain prepare")
            # the vocabulary check always runs; the checksum only when asked (it costs the same read)
            _check_shard(path, shard.get("sha256") if verify_checksums else None, dtype, tokenizer.vocab_size)
            paths.append(path)
            lengths.append(n)
            described.append([shard["file"], n, shard.get("sha256")])
        if not paths:
            raise DataError(f"{meta_path}: lists no {'' if split == 'train' else 'validation '}shards; "
                            "re-run scaletrain prepare")
        description = {"dtype": dtype_name, "tokenizer": tokenizer.describe(), "shards": described}
        if split == "val":  # the training split's description (and fingerprint) stays as it always was
            description["split"] = "val"
        mask_key = "mask_shards" if split == "train" else "val_mask_shards"
        mask = None
        if mask_key in meta:  # data with a mask is other data than the same tokens without one
            mask = _open_mask(folder, meta[mask_key], lengths, tokenizer, verify_checksums)
            description[mask_key] = mask._description["shards"]
        source = str(folder) if split == "train" else f"{folder} (validation split)"
        data = cls(paths, dtype, lengths, tokenizer, source, description)
        data.mask = mask
        return data

    def _open(self) -> list[np.ndarray | int]:
        if self._opened is None:
            opened = [os.open(src, os.O_RDONLY) if isinstance(src, Path) else src for src in self._sources]
            fds = [fd for fd in opened if isinstance(fd, int)]
            weakref.finalize(self, _close_all, fds)
            self._opened = opened
        return self._opened

    def __getstate__(self):
        # worker processes open the shards again instead of receiving this process's descriptors
        state = self.__dict__.copy()
        state["_opened"] = None
        return state

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start + length) as int64, across shard boundaries."""
        opened = self._open()
        out = np.empty(length, dtype=np.int64)
        shard = int(np.searchsorted(self.offsets, start, side="right") - 1)
        pos, filled = start, 0
        while filled < length:
            local = pos - int(self.offsets[shard])
            take = min(length - filled, self.lengths[shard] - local)
            src = opened[shard]
            if isinstance(src, int):
                want = take * self.dtype.itemsize
                raw = os.pread(src, want, local * self.dtype.itemsize)
                if len(raw) < want:
                    raise self._cut_short(shard, src)
                out[filled:filled + take] = np.frombuffer(raw, dtype=self.dtype)
            else:
                out[filled:filled + take] = src[local:local + take]
            filled += take
            pos += take
            shard += 1
        return out

    def _cut_short(self, shard: int, fd: int) -> DataError:
        path, expected = self._sources[shard], self.lengths[shard] * self.dtype.itemsize
        return DataError(f"{path}: the shard is now {os.fstat(fd).st_size} bytes, {expected} when it was opened: it "
                         "was cut short (truncated or rewritten) while this process read it; restore it as it was "
                         "(data prepared again is other data, for a new run)")


def _open_mask(folder: Path, shards, lengths: list[int], tokenizer, verify_checksums: bool) -> TokenData:
    """The loss mask's shards beside the token shards: one uint8 (0 or 1) per token, cut alike."""
    meta_path = folder / META_FILE
    paths, described = [], []
    if not isinstance(shards, list) or len(shards) != len(lengths):
        raise DataError(f"{meta_path}: the loss mask's shards do not match the token shards one to one; re-run "
                        "scaletrain prepare")
    for shard, n in zip(shards, lengths):
        try:
            name, count = shard["file"], int(shard["num_tokens"])
        except (TypeError, KeyError, ValueError):
            raise DataError(f"{meta_path}: mask shard entry {shard!r} needs a file name and a token count; "
                            "re-run scaletrain prepare") from None
        path = folder / name
        if Path(name).name != name or count != n or not path.is_file() or path.stat().st_size != n:
            raise DataError(f"{path}: the loss mask shard is missing, misnamed or not {n} bytes (one per token of "
                            "its token shard); re-run scaletrain prepare")
        _check_shard(path, shard.get("sha256") if verify_checksums else None, np.dtype(np.uint8), 2)
        paths.append(path)
        described.append([name, n, shard.get("sha256")])
    return TokenData(paths, np.uint8, list(lengths), tokenizer, f"{folder} (loss mask)",
                     {"dtype": "uint8", "shards": described})


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


_SAMPLE_BYTES = 4096  # read from each end of a shard for its fingerprint
_CHUNK_BYTES = 1 << 24  # shards are scanned 16 MiB at a time: memory stays bounded


def _check_shard(path: Path, sha256: str | None, dtype: np.dtype, vocab_size: int) -> None:
    """Every token id of the shard must be below `vocab_size`; with `sha256`, the shard's digest
    must match it too. One sequential read, vectorised per chunk."""
    digest = hashlib.sha256() if sha256 is not None else None
    bad: tuple[int, int] | None = None  # (position, id) of the first id outside the vocabulary
    pos = 0
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            if digest is not None:
                digest.update(chunk)
            ids = np.frombuffer(chunk, dtype=dtype)
            if bad is None and int(ids.max()) >= vocab_size:
                i = int(np.argmax(ids >= vocab_size))
                bad = (pos + i, int(ids[i]))
                if digest is None:
                    break  # nothing more to learn from the rest
            pos += ids.size
    if digest is not None and digest.hexdigest() != sha256:
        raise DataError(f"{path}: shard is corrupt (its sha256 differs from {META_FILE}); re-run scaletrain prepare")
    if bad is not None:
        raise DataError(f"{path}: holds token id {bad[1]} (token {bad[0]}), outside the tokenizer's {vocab_size}-token "
                        "vocabulary; the shard is corrupt or from another tokenizer: re-run scaletrain prepare")


def builtin_text() -> str:
    """The documentation text shipped inside CPython (pydoc_data.topics), about 465 KB."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


def builtin_data() -> TokenData:
    tok = ByteTokenizer()
    arr = np.frombuffer(builtin_text().encode("utf-8"), dtype=np.uint8).astype(np.uint16)
    return TokenData.from_array(arr, tok, "builtin:pydoc_data.topics")


def open_data(path: str, verify_checksums: bool = True) -> TokenData:
    return builtin_data() if not path else TokenData.open(path, verify_checksums)


def builtin_validation_text() -> str:
    """Held-out text for the built-in data: the docstrings of Python's built-in functions and
    types and of their public methods (about 65 KB), none of which is in pydoc_data.topics. The
    training text stays exactly what it was; this is a separate, similar source."""
    import builtins
    import types

    docs = []
    for name in sorted(dir(builtins)):
        obj = getattr(builtins, name)
        if name.startswith("_") or not isinstance(obj, (type, types.BuiltinFunctionType)):
            continue  # site's help, exit, copyright... differ between installations
        parts = [obj.__doc__ or ""]
        if isinstance(obj, type):  # dunder methods' docstrings ("Return self+value.") are boilerplate
            parts += [getattr(v, "__doc__", None) or "" for k, v in sorted(vars(obj).items()) if not k.startswith("_")]
        docs.append("\n\n".join(p for p in parts if isinstance(p, str) and p))
    return "\n\n".join(docs)


def builtin_validation_data() -> TokenData:
    arr = np.frombuffer(builtin_validation_text().encode("utf-8"), dtype=np.uint8).astype(np.uint16)
    return TokenData.from_array(arr, ByteTokenizer(), "builtin:docstrings of Python's built-ins (validation)")


def has_validation_split(path: str) -> bool:
    """Whether `path` (a prepared folder; empty = the built-in data) has a validation split."""
    if not path:
        return True
    try:
        meta = json.loads((Path(path) / META_FILE).read_text())
    except (OSError, ValueError):
        return False  # opening the folder reports what is wrong with it
    return isinstance(meta, dict) and "val_shards" in meta


def open_validation(path: str, verify_checksums: bool = True) -> TokenData | None:
    """The validation split of `path` (empty: the built-in data's), or None if it has none."""
    if not has_validation_split(path):
        return None
    return builtin_validation_data() if not path else TokenData.open(path, verify_checksums, split="val")


IGNORE_INDEX = -100  # a target the loss does not count (cross_entropy's default ignore_index)


class WindowDataset(torch.utils.data.Dataset):
    """Map-style dataset indexed by a list of window indices -> (inputs, targets), each (b, T).
    With `loss_mask` (the data has one), a target whose mask is 0 is IGNORE_INDEX; with `separator`
    (data.document_mask: the token that ends each document), so is the target of each separator,
    the next document's first token, which nothing in its own document predicts."""

    def __init__(self, data: TokenData, seq_len: int, loss_mask: bool = False, separator: int | None = None):
        self.data = data
        self.seq_len = seq_len
        self.mask = data.mask if loss_mask else None
        self.separator = separator
        self._counted = (-1, 0)  # (step, its counted targets): counted_in_step's last answer
        self.num_windows = (data.num_tokens - 1) // seq_len
        if self.num_windows < 1:
            fix = (f"lower data.seq_len to at most {data.num_tokens - 1} or add data" if data.num_tokens > 1
                   else "add data")
            raise DataError(f"{data.source}: {data.num_tokens} tokens are too few for one window of data.seq_len="
                            f"{seq_len}, which needs {seq_len + 1} (the inputs and the target shifted by one); {fix}")

    def __len__(self) -> int:
        return self.num_windows

    def __getitem__(self, indices) -> tuple[torch.Tensor, torch.Tensor]:
        T = self.seq_len
        rows = np.stack([self.data.read(int(i) * T, T + 1) for i in indices])  # (b, T + 1)
        if self.mask is not None or self.separator is not None:
            targets = rows[:, 1:].copy()
            targets[~self.target_mask(indices, rows[:, :-1])] = IGNORE_INDEX
            return torch.from_numpy(rows[:, :-1].copy()), torch.from_numpy(targets)
        tokens = torch.from_numpy(rows)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def target_mask(self, indices, inputs: np.ndarray | None = None) -> np.ndarray:
        """(b, T) bool of the windows' targets: True where the loss counts the token (`inputs`: the
        windows' input tokens where the caller has read them already)."""
        T = self.seq_len
        counted = np.ones((len(indices), T), dtype=bool)
        if self.mask is not None:
            counted &= np.stack([self.mask.read(int(i) * T + 1, T) for i in indices]) != 0
        if self.separator is not None:
            if inputs is None:
                inputs = np.stack([self.data.read(int(i) * T, T) for i in indices])
            counted &= inputs != self.separator
        return counted

    def counted_in_step(self, step: int, sampler) -> int | None:
        """The targets counted (a loss mask's, less the separators' under document masks) in step
        `step`'s global batch, whose windows `sampler(step)` (a StepSampler) gives: every rank
        counts the whole batch alike, so no reduction is needed. At least 1 (an all-prompt batch
        trains on nothing, without dividing by 0); None when every target counts. The last step's
        count is kept: the trainer asks per micro-batch."""
        if self.mask is None and self.separator is None:
            return None
        if self._counted[0] != step:
            self._counted = (step, self.counted_tokens(sampler(step).global_batch_indices(step)))
        return max(1, self._counted[1])

    def counts_nothing(self, step: int, sampler) -> bool:
        """Whether step `step`'s global batch holds no target the loss counts (every window prompt
        tokens only): such a step trains nothing and has no loss."""
        return self.counted_in_step(step, sampler) is not None and self._counted[1] == 0

    def counted_tokens(self, indices) -> int:
        """Targets the loss counts in these windows: all of them without a mask or document boundaries."""
        if self.mask is None and self.separator is None:
            return len(indices) * self.seq_len
        return int(self.target_mask(indices).sum())
