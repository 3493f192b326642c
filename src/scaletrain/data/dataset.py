"""Token data on disk (memory-mapped) or in memory, cut into (input, target) windows.

Window i covers tokens [i*T, i*T + T + 1): the input is the first T, the target the last T.
Windows do not overlap and may span shard boundaries, so no token is wasted.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import torch

from scaletrain.data.prepare import FORMAT, META_FILE
from scaletrain.data.tokenizer import ByteTokenizer, load_tokenizer
from scaletrain.errors import DataError

VALID_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


class TokenData:
    """All tokens of a prepared folder as one logical array (shards concatenated)."""

    def __init__(self, arrays_or_paths: list, dtype: np.dtype, lengths: list[int], tokenizer, source: str):
        self._sources = arrays_or_paths  # np.ndarray (in memory) or Path (memory-mapped lazily)
        self._arrays: list[np.ndarray] | None = None
        self.dtype = np.dtype(dtype)
        self.lengths = lengths
        self.offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        self.num_tokens = int(self.offsets[-1])
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.vocab_size
        self.source = source

    @classmethod
    def from_array(cls, tokens: np.ndarray, tokenizer, source: str) -> "TokenData":
        return cls([tokens], tokens.dtype, [int(tokens.size)], tokenizer, source)

    @classmethod
    def open(cls, folder: str | Path, verify_checksums: bool = True) -> "TokenData":
        """Open a folder written by `scaletrain prepare`, checking it against its metadata."""
        folder = Path(folder)
        meta_path = folder / META_FILE
        if not meta_path.is_file():
            raise DataError(f"{folder}: no {META_FILE}; prepare the data first with "
                            f"`scaletrain prepare INPUT... --out {folder}`")
        try:
            meta = json.loads(meta_path.read_text())
        except json.JSONDecodeError as e:
            raise DataError(f"{meta_path}: not valid JSON ({e.msg}); re-run scaletrain prepare") from None
        fmt = meta.get("format") if isinstance(meta, dict) else None
        if fmt != FORMAT:
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
        paths, lengths = [], []
        shards = meta.get("shards")
        for shard in shards if isinstance(shards, list) else []:
            try:
                path, n = folder / shard["file"], int(shard["num_tokens"])
            except (TypeError, KeyError, ValueError):
                raise DataError(f"{meta_path}: shard entry {shard!r} needs a file name and a token count; "
                                "re-run scaletrain prepare") from None
            if Path(shard["file"]).name != shard["file"]:  # shards live in this folder, nowhere else
                raise DataError(f"{meta_path}: shard file {shard['file']!r} is not a plain file name in this "
                                "folder; re-run scaletrain prepare")
            if not path.is_file():
                raise DataError(f"{path}: shard listed in {META_FILE} is missing")
            size = path.stat().st_size
            if size != n * dtype.itemsize:
                raise DataError(f"{path}: shard is truncated or has the wrong dtype: {size} bytes, "
                                f"but {META_FILE} says {n} tokens of {dtype_name} ({n * dtype.itemsize} bytes); "
                                "re-run scaletrain prepare")
            if verify_checksums:
                _verify_shard(path, shard.get("sha256"), dtype, tokenizer.vocab_size)
            paths.append(path)
            lengths.append(n)
        if not paths:
            raise DataError(f"{meta_path}: lists no shards; re-run scaletrain prepare")
        return cls(paths, dtype, lengths, tokenizer, str(folder))

    def _open_arrays(self) -> list[np.ndarray]:
        if self._arrays is None:
            self._arrays = [np.memmap(s, dtype=self.dtype, mode="r") if isinstance(s, Path) else s
                            for s in self._sources]
        return self._arrays

    def __getstate__(self):
        # worker processes re-open the memory maps instead of receiving copies of them
        state = self.__dict__.copy()
        state["_arrays"] = None
        return state

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start + length) as int64, across shard boundaries."""
        arrays = self._open_arrays()
        out = np.empty(length, dtype=np.int64)
        shard = int(np.searchsorted(self.offsets, start, side="right") - 1)
        pos, filled = start, 0
        while filled < length:
            local = pos - int(self.offsets[shard])
            take = min(length - filled, self.lengths[shard] - local)
            out[filled:filled + take] = arrays[shard][local:local + take]
            filled += take
            pos += take
            shard += 1
        return out


def _verify_shard(path: Path, expected: str | None, dtype: np.dtype, vocab_size: int) -> None:
    digest = hashlib.sha256()
    top = 0
    with path.open("rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
            if chunk:
                top = max(top, int(np.frombuffer(chunk, dtype=dtype).max()))
    if expected is not None and digest.hexdigest() != expected:
        raise DataError(f"{path}: shard is corrupt (its sha256 differs from {META_FILE}); re-run scaletrain prepare")
    if top >= vocab_size:
        raise DataError(f"{path}: holds token id {top}, outside the tokenizer's {vocab_size}-token "
                        "vocabulary; the shard is corrupt or from another tokenizer")


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


class WindowDataset(torch.utils.data.Dataset):
    """Map-style dataset indexed by a list of window indices -> (inputs, targets), each (b, T)."""

    def __init__(self, data: TokenData, seq_len: int):
        self.data = data
        self.seq_len = seq_len
        self.num_windows = (data.num_tokens - 1) // seq_len
        if self.num_windows < 1:
            raise DataError(f"{data.source}: {data.num_tokens} tokens are too few for one window of "
                            f"data.seq_len={seq_len} (+1 target); lower data.seq_len or add data")

    def __len__(self) -> int:
        return self.num_windows

    def __getitem__(self, indices) -> tuple[torch.Tensor, torch.Tensor]:
        T = self.seq_len
        rows = np.stack([self.data.read(int(i) * T, T + 1) for i in indices])  # (b, T + 1)
        tokens = torch.from_numpy(rows)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
