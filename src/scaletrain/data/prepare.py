"""`scaletrain prepare`: text, jsonl and parquet files -> token shards + metadata.

Output folder:
    meta.json          format version, dtype, tokenizer, token counts, per-shard sha256
    shard_00000.bin    raw little-endian token ids (uint16 when the vocabulary fits, else uint32)
    val_00000.bin      with --val-fraction F: the validation split, the same format; a document
                       goes to it when the first 8 bytes of its text's sha256, read as a fraction
                       of 2**64, fall below F, so the split depends on the document alone (never
                       on the run, the order of the inputs or the other documents), a document
                       never straddles the two, and duplicates land on the same side
    tokenizer.json     for BPE, file and Hugging Face tokenizers
    tokenizer_config.json, special_tokens_map.json
                       copied from a Hugging Face model folder, where it has them

The folder is written under a temporary name and renamed when complete, and an existing
prepared folder is never overwritten.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from scaletrain.atomic import replacing
from scaletrain.data.tokenizer import ByteTokenizer, HFTokenizer
from scaletrain.errors import DataError

META_FILE = "meta.json"
FORMAT = "scaletrain.tokens"
FORMAT_VERSION = 1
SUFFIXES = (".txt", ".jsonl", ".parquet")


def find_inputs(inputs: Sequence[str | Path]) -> list[Path]:
    files: list[Path] = []
    for item in inputs:
        p = Path(item)
        if p.is_dir():
            found = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in SUFFIXES)
            if not found:
                raise DataError(f"{p}: no .txt, .jsonl or .parquet files in this folder")
            files.extend(found)
        elif p.is_file():
            if p.suffix not in SUFFIXES:
                raise DataError(f"{p}: unsupported file type {p.suffix!r}; give .txt, .jsonl or .parquet files")
            files.append(p)
        else:
            raise DataError(f"{p}: no such file or folder")
    return files


def iter_documents(files: Sequence[Path], text_key: str = "text") -> Iterator[str]:
    """Each .txt file is one document; each jsonl line and parquet row is one. Text must be
    valid UTF-8: a bad byte is reported with its place, never replaced."""
    for f in files:
        if f.suffix == ".txt":
            yield _read_txt(f)
        elif f.suffix == ".jsonl":
            yield from _jsonl_texts(f, text_key)
        elif f.suffix == ".parquet":
            yield from _parquet_texts(f, text_key)


REENCODE = "re-encode the file as UTF-8 (e.g. iconv -f LATIN1 -t UTF-8) or remove it from the inputs"


def _read_txt(f: Path) -> str:
    raw = f.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise DataError(f"{f}: invalid UTF-8 at byte {e.start} (line {line}): "
                        f"{raw[e.start:e.end]!r} ({e.reason}); {REENCODE}") from None
    # universal newlines, as text-mode reading gives: \r\n and \r become \n
    return text.replace("\r\n", "\n").replace("\r", "\n")


def _jsonl_texts(f: Path, text_key: str) -> Iterator[str]:
    offset = 0  # of the current line in the file
    with f.open("rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{f}:{lineno}: invalid UTF-8 at byte {offset + e.start} of the file "
                                f"(column {e.start + 1}): {raw[e.start:e.end]!r} ({e.reason}); {REENCODE}") from None
            offset += len(raw)
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{f}:{lineno}: not valid JSON ({e.msg} at column {e.colno}); "
                                "each line must hold one JSON object") from None
            if not isinstance(row, dict) or not isinstance(row.get(text_key), str):
                raise DataError(f"{f}:{lineno}: expected an object with a string field "
                                f"{text_key!r}; set --text-key to the field that holds the text")
            yield row[text_key]


def _parquet_texts(f: Path, text_key: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{f}: reading parquet needs pyarrow: pip install pyarrow "
                        "(or pip install 'scaletrain[parquet]')") from None
    try:
        pf = pq.ParquetFile(f)
    except Exception as e:  # pyarrow raises its own exception types for bad files
        raise DataError(f"{f}: not a readable parquet file ({e})") from None
    if text_key not in pf.schema_arrow.names:
        raise DataError(f"{f}: no column {text_key!r} (columns: {', '.join(pf.schema_arrow.names)}); "
                        "set --text-key to the column that holds the text")
    row = 0
    for batch in pf.iter_batches(columns=[text_key]):
        for value in batch.column(0).to_pylist():
            if value is not None and not isinstance(value, str):
                raise DataError(f"{f}: row {row} of column {text_key!r} holds {type(value).__name__}, not text; "
                                "set --text-key to a string column")
            if value is not None:
                yield value
            row += 1


def recorded_vocab_size(path: str | Path) -> int:
    """The model vocabulary a prepared folder records, read from its meta.json alone: a Hugging
    Face model's own vocab_size where it is larger than its tokenizer's, else the tokenizer's.
    An empty path is the built-in byte-level data: 256."""
    if not str(path):
        return ByteTokenizer.vocab_size
    meta_path = Path(path) / META_FILE
    try:
        described = json.loads(meta_path.read_text())["tokenizer"]
        vocab = described.get("model_vocab_size") or described["vocab_size"]
    except FileNotFoundError:
        raise DataError(f"{meta_path} does not exist") from None
    except OSError as e:
        raise DataError(f"{meta_path} cannot be read ({e.strerror})") from None
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError):
        raise DataError(f"{meta_path} records no tokenizer vocabulary") from None
    if isinstance(vocab, bool) or not isinstance(vocab, int):
        raise DataError(f"{meta_path} records no tokenizer vocabulary")
    return vocab


def is_validation(doc: str, fraction: float) -> bool:
    """Whether `doc` belongs to the validation split of a `fraction`: decided by its text alone."""
    if fraction <= 0:
        return False
    digest = hashlib.sha256(doc.encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(digest[:8], "big") < fraction * 2**64


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def prepare(inputs: Sequence[str | Path], out: str | Path, *, tokenizer: str | Path = "byte",
            vocab_size: int = 8192, tokenizer_file: str | Path | None = None,
            text_key: str = "text", shard_tokens: int = 100_000_000, val_fraction: float = 0.0) -> dict:
    """Tokenize `inputs` into `out`; returns the metadata written to meta.json. `tokenizer` is
    byte, bpe, file (with `tokenizer_file`) or the path of a Hugging Face model folder.
    `val_fraction` of the documents (by their text's hash) go to a validation split instead."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise DataError(f"{out} is a file; --out must be a new or empty folder (nothing was changed)")
    if out.exists() and any(out.iterdir()):
        raise DataError(f"{out} already exists and is not empty; choose another --out (nothing was changed)")
    if shard_tokens < 1:
        raise DataError(f"--shard-tokens must be at least 1, got {shard_tokens}")
    if not 0 <= val_fraction < 1:  # also refuses NaN
        raise DataError(f"--val-fraction {val_fraction} is outside [0, 1): give the share of documents to hold out "
                        "for validation, e.g. 0.05 (nothing was written)")
    files = find_inputs(inputs)

    if tokenizer == "byte":
        tok = ByteTokenizer()
    elif tokenizer == "bpe":
        if vocab_size < 257:
            raise DataError(f"--vocab-size {vocab_size} is too small for BPE; it needs more than the 256 bytes")
        # learnt from the training documents only: the validation text stays unseen
        tok = HFTokenizer.train_bpe((d for d in iter_documents(files, text_key) if not is_validation(d, val_fraction)),
                                    vocab_size)
    elif tokenizer == "file":
        if tokenizer_file is None:
            raise DataError("--tokenizer file needs --tokenizer-file PATH (a tokenizer.json)")
        tok = HFTokenizer.from_file(tokenizer_file)
    elif Path(tokenizer).is_file():
        raise DataError(f"--tokenizer {tokenizer} is a file; give its Hugging Face model folder, or "
                        f"--tokenizer file --tokenizer-file {tokenizer} for a lone tokenizer.json")
    elif Path(tokenizer).is_dir():
        tok = HFTokenizer.from_hf_folder(tokenizer)
    else:
        raise DataError(f"--tokenizer {tokenizer}: neither byte, bpe nor file, and no such folder; "
                        "give one of those or a Hugging Face model folder holding tokenizer.json")

    dtype = token_dtype(tok.vocab_size)
    with replacing(out) as tmp:
        tmp.mkdir(parents=True)
        train = _ShardWriter(tmp, "shard", tok, dtype, shard_tokens)
        val = _ShardWriter(tmp, "val", tok, dtype, shard_tokens)
        for doc in iter_documents(files, text_key):
            (val if is_validation(doc, val_fraction) else train).add(doc)
        train.close()
        val.close()
        n_docs = train.n_docs + val.n_docs
        if train.n_text_docs + val.n_text_docs == 0:  # separators alone are no training data
            found = f"{n_docs} document(s), all empty or whitespace" if n_docs else "no documents"
            field = f" in field {text_key!r}" if any(f.suffix != ".txt" for f in files) else ""
            raise DataError(f"no text to tokenize in {', '.join(map(str, inputs))}: {found}{field}; "
                            "give files that hold text (nothing was written)")
        if val_fraction and not (train.n_text_docs and val.n_text_docs):
            side = "validation" if train.n_text_docs else "training"
            raise DataError(f"--val-fraction {val_fraction} left the {side} split without text: of {n_docs} "
                            f"document(s), {val.n_docs} went to validation; "
                            f"{'raise' if side == 'validation' else 'lower'} --val-fraction or give more documents "
                            "(nothing was written)")
        shards = train.shards
        tok.save(tmp)
        meta = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "dtype": dtype.name,
            "tokenizer": tok.describe(),
            "num_tokens": sum(s["num_tokens"] for s in shards),
            "num_documents": train.n_docs,
            "shards": shards,
            "sources": [str(f) for f in files],
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        if val_fraction:  # absent otherwise: a folder without a split is written as it always was
            meta.update({"val_fraction": val_fraction, "num_val_tokens": sum(s["num_tokens"] for s in val.shards),
                         "num_val_documents": val.n_docs, "val_shards": val.shards})
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2))
        if out.exists():
            out.rmdir()  # empty, checked above: the rename needs its place
    return meta


class _ShardWriter:
    """Documents -> `PREFIX_00000.bin`, ... of `shard_tokens` tokens each, every document
    followed by the tokenizer's separator; `shards` describes the files for meta.json."""

    def __init__(self, folder: Path, prefix: str, tok, dtype: np.dtype, shard_tokens: int):
        self.folder, self.prefix, self.tok, self.dtype, self.shard_tokens = folder, prefix, tok, dtype, shard_tokens
        self.shards: list[dict] = []
        self.buf: list[int] = []
        self.n_docs = self.n_text_docs = 0  # all documents, and those with more than whitespace

    def add(self, doc: str) -> None:
        self.n_docs += 1
        ids = self.tok.encode(doc)
        if ids and not doc.isspace():
            self.n_text_docs += 1
        self.buf.extend(ids)
        self.buf.extend(self.tok.separator)
        while len(self.buf) >= self.shard_tokens:
            self._flush(self.buf[:self.shard_tokens])
            self.buf = self.buf[self.shard_tokens:]

    def close(self) -> None:
        if self.buf:
            self._flush(self.buf)
            self.buf = []

    def _flush(self, ids: list[int]) -> None:
        arr = np.asarray(ids, dtype=self.dtype)
        name = f"{self.prefix}_{len(self.shards):05d}.bin"
        data = arr.tobytes()
        (self.folder / name).write_bytes(data)
        self.shards.append({"file": name, "num_tokens": int(arr.size), "sha256": hashlib.sha256(data).hexdigest()})
