"""`scaletrain prepare`: text, jsonl (plain, .gz, .zst), parquet, Arrow files and Hugging Face
dataset folders -> token shards + metadata.

Output folder:
    meta.json          format version, dtype, tokenizer, token counts, per-shard sha256
    shard_00000.bin    raw little-endian token ids (uint16 when the vocabulary fits, else uint32)
    val_00000.bin      with --val-fraction F: the validation split, the same format; a document
                       goes to it when the first 8 bytes of its text's sha256, read as a fraction
                       of 2**64, fall below F, so the split depends on the document alone (never
                       on the run, the order of the inputs or the other documents), a document
                       never straddles the two, and duplicates land on the same side
    index_00000.bin    with --preference: one row of three int64 per example (scaletrain.data.preference),
                       whose tokens (prompt, then each completion) follow one another in the shards;
                       meta.json's format is then scaletrain.preference (`index_shards`, `val_index_shards`)
    mask_00000.bin     with --chat-format: the loss mask, one uint8 a token (1: a training target, the
                       assistant's tokens; 0: the prompt's), cut into shards of the same token counts
                       as the token shards (meta.json's `mask_shards`, and `val_mask_shards`)
    tokenizer.json     for BPE, file and Hugging Face tokenizers
    tokenizer_config.json, special_tokens_map.json
                       copied from a Hugging Face model folder, where it has them

Every core: the main process reads the inputs in chunks (scaletrain.data.sources) and hands them
to `workers` processes, which parse and tokenize them; the main process writes their tokens in
the order of the inputs, so the shards are byte-identical whatever the number of workers. At
most two chunks per worker are in flight and shards are written as the tokens come, so memory
stays bounded whatever the size of the corpus (a .txt file is one document, read whole).

The folder is written under a temporary name (`.OUT.partial-PID`, locked while prepare runs) and
renamed when complete, so an interrupted prepare leaves no folder that looks complete; running
it again removes what an interrupted one left (an unlocked partial folder) and starts over. An
existing prepared folder is never overwritten.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import itertools
import json
import os
import pickle
import queue
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import numpy as np

from scaletrain import fmt
from scaletrain.atomic import replacing
from scaletrain.data.chat import ChatRenderer, iter_records
from scaletrain.data.preference import PREFERENCE_FORMAT, PreferenceEncoder, row_key
from scaletrain.data.sources import Chunk, chunks, find_inputs, input_bytes, iter_documents, iter_rows, texts_of
from scaletrain.data.tokenizer import ByteTokenizer, HFTokenizer
from scaletrain.errors import DataError

__all__ = ["find_inputs", "iter_documents", "prepare", "is_validation", "recorded_vocab_size", "token_dtype"]

META_FILE = "meta.json"
FORMAT = "scaletrain.tokens"
FORMAT_VERSION = 1
SMALL_INPUT = 16 << 20  # with the default worker count, inputs smaller than this are tokenized in this process
IN_FLIGHT = 2  # chunks handed out per worker at a time


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


def recorded_validation_tokens(path: str | Path) -> int:
    """The tokens of a prepared folder's validation split, as its meta.json records them (0: it
    has none, or the folder cannot say; opening it reports why)."""
    try:
        shards = json.loads((Path(path) / META_FILE).read_text())["val_shards"]
        return sum(int(shard["num_tokens"]) for shard in shards)
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def is_validation(doc: str, fraction: float) -> bool:
    """Whether `doc` belongs to the validation split of a `fraction`: decided by its text alone."""
    if fraction <= 0:
        return False
    digest = hashlib.sha256(doc.encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(digest[:8], "big") < fraction * 2**64


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def default_workers() -> int:
    """Every core this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def prepare(inputs: Sequence[str | Path], out: str | Path, *, tokenizer: str | Path = "byte",
            vocab_size: int = 8192, tokenizer_file: str | Path | None = None,
            text_key: str = "text", shard_tokens: int = 100_000_000, val_fraction: float = 0.0,
            workers: int | None = None, progress: IO[str] | None = None,
            progress_every: float | None = None, report: Callable[[str], None] | None = None,
            chat_format: str | None = None, loss_on_prompt: bool = False, preference: str | None = None,
            max_prompt_tokens: int | None = None, max_length: int | None = None) -> dict:
    """Tokenize `inputs` into `out`; returns the metadata written to meta.json. `tokenizer` is
    byte, bpe, file (with `tokenizer_file`) or the path of a Hugging Face model folder.
    `val_fraction` of the documents (by their text's hash) go to a validation split instead.
    `workers`: tokenizer processes (None: every core, or this process alone for inputs under
    16 MiB; 1: this process), at most one per core and per chunk of the input (a process starts
    when there is a chunk for it). `progress`: a stream for the progress line (MB/s, tokens,
    ETA), redrawn every `progress_every` seconds (None: 0.5 on a terminal, else a line every 30).
    `report`: told the workers' cap in a line (None: the progress stream, if any, is).
    `chat_format` (template or plain; scaletrain.data.chat): the inputs are chat or instruction
    jsonl, rendered in this process, with a loss mask on the assistant's tokens (every token's
    with `loss_on_prompt`). `preference` (pairs, unpaired or auto; scaletrain.data.preference): the inputs
    are preference rows, written as prompt and completion ids with an index, truncated to
    `max_prompt_tokens` (from the left) and `max_length` (completions from the right); `chat_format`
    then renders their conversations."""
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
    if workers is not None and workers < 1:
        raise DataError(f"--workers must be at least 1, got {workers}")
    if preference is None and (max_prompt_tokens is not None or max_length is not None):
        flag = "--max-prompt-tokens" if max_prompt_tokens is not None else "--max-length"
        raise DataError(f"{flag} truncates preference data: give it with --preference (nothing was written)")
    if preference is not None and loss_on_prompt:
        raise DataError("--loss-on-prompt does not apply to --preference data: a preference loss counts the "
                        "completions' tokens alone (nothing was written)")
    files = find_inputs(inputs)
    total_bytes = input_bytes(files)
    cores = default_workers()
    asked, workers = workers, (cores if total_bytes >= SMALL_INPUT else 1) if workers is None else min(workers, cores)

    if tokenizer == "byte":
        tok = ByteTokenizer()
    elif tokenizer == "bpe":
        if chat_format or preference:
            flag = "--preference" if preference else "--chat-format"
            raise DataError(f"{flag} needs a tokenizer made beforehand: byte, file or a Hugging Face folder, "
                            "not bpe (train one on the text first)")
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
    line = ProgressLine(total_bytes, progress, progress_every) if progress is not None else None
    say = report or (line.note if line is not None else None)
    if say is not None and asked is not None and asked > workers:
        say(f"--workers {asked}: {workers} tokenizer process(es) at most, one per core this process may use (more "
            "would only wait for each other)")
    for stale in _unfinished(out):  # left by an interrupted prepare: nothing in it is complete
        shutil.rmtree(stale, ignore_errors=True)
        if line is not None:
            line.note(f"removed {stale}, left by an interrupted prepare")
    encoder = Encoder(tok, text_key, val_fraction, dtype)
    pref = PreferenceEncoder(tok, preference, chat_format, max_prompt_tokens, max_length) if preference else None
    renderer = ChatRenderer(tok, chat_format, loss_on_prompt) if chat_format and not pref else None
    with replacing(out) as tmp, _locked_folder(tmp), _ShardWriter(tmp, "shard", dtype, shard_tokens) as train, \
            _ShardWriter(tmp, "val", dtype, shard_tokens) as val, \
            _ShardWriter(tmp, "mask", np.uint8, shard_tokens) as train_mask, \
            _ShardWriter(tmp, "val_mask", np.uint8, shard_tokens) as val_mask, \
            _ShardWriter(tmp, "index", np.int64, 1 << 62) as train_index, \
            _ShardWriter(tmp, "val_index", np.int64, 1 << 62) as val_index:
        started: list[int] = []
        if pref is not None:
            _write_preference(files, pref, val_fraction, dtype, (train, train_index), (val, val_index), line, say)
        elif renderer is not None:
            _write_chat(files, renderer, val_fraction, dtype, (train, train_mask), (val, val_mask), line)
        rendered = renderer is not None or pref is not None  # else text, tokenized in chunks (by workers)
        for part in encode_chunks(chunks(files, text_key), encoder, workers, started) if not rendered else ():
            train.add(part.train, part.docs, part.text_docs)
            val.add(part.val, part.val_docs, part.val_text_docs)
            if line is not None:
                line.advance(part.nbytes, part.train.size + part.val.size)
        for writer in (train, val, train_mask, val_mask, train_index, val_index):
            writer.close()
        if line is not None:
            line.finish()
        if say is not None and asked is not None and workers > 1 and started and started[0] < workers:
            say(f"--workers {asked}: {started[0]} tokenizer process(es) started, one per chunk of the input "
                f"(it came in {started[0]})")
        n_docs = train.n_docs + val.n_docs
        if train.n_text_docs + val.n_text_docs == 0:  # separators alone are no training data
            found = f"{n_docs} document(s), all empty or whitespace" if n_docs else "no documents"
            field = f" in field {text_key!r}" if any(not f.name.endswith(".txt") for f in files) else ""
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
        if renderer is not None:  # absent for text: its folders are written as they always were
            meta.update({"chat_format": chat_format, "loss_on_prompt": loss_on_prompt,
                         "num_counted_tokens": train_mask.ones, "mask_shards": train_mask.shards})
            if val_fraction:
                meta["val_mask_shards"] = val_mask.shards
        if pref is not None:  # its own format: a folder that text training refuses (dataset.TokenData.open)
            meta.update({"format": PREFERENCE_FORMAT, "preference": pref.describe(),
                         "index_shards": train_index.shards})
            if val_fraction:
                meta["val_index_shards"] = val_index.shards
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2))
        if out.exists():
            out.rmdir()  # empty, checked above: the rename needs its place
    return meta


def _write_chat(files, renderer: ChatRenderer, val_fraction: float, dtype: np.dtype, train: tuple, val: tuple,
                line: ProgressLine | None) -> None:
    """Every chat record rendered to tokens and mask, each to its split (by its rendered tokens' hash)."""
    for where, messages in iter_records(files):
        ids, mask = renderer(messages, where)
        key = json.dumps(messages, sort_keys=True)
        tokens, masks = val if is_validation(key, val_fraction) else train
        tokens.add(ids.astype(dtype), 1, int(mask.any()))
        masks.add(mask, 0, 0)
        if line is not None:
            line.advance(len(key), ids.size)


def _write_preference(files, encoder: PreferenceEncoder, val_fraction: float, dtype: np.dtype, train: tuple,
                      val: tuple, line: ProgressLine | None, say: Callable[[str], None] | None) -> None:
    """Every preference row's ids (prompt, then each completion) and its index row, each to its split (by the
    row's text's hash); refused in one line when no row is left to train on."""
    for where, row in iter_rows(files):
        example = encoder(row, where)
        if example is None:
            continue
        tokens, index = val if is_validation(row_key(row), val_fraction) else train
        ids = np.concatenate([example.prompt, *example.completions])
        tokens.add(ids.astype(dtype), 1, 1)
        index.add(np.asarray(example.index_row(), dtype=np.int64), 0, 0)
        if line is not None:
            line.advance(0, ids.size)
    kept = train[0].n_docs + val[0].n_docs
    if not kept:
        t = encoder.tally
        why = "; ".join(encoder.report(0)) or "the inputs hold no rows"
        raise DataError(f"no preference example to write: of {t.rows} row(s), none is left ({why}); nothing was "
                        "written")
    for report in encoder.report(kept) if say is not None else ():
        say(report)


# --------------------------------------------------------------------------------------------
# Tokenizing chunks, in this process or in workers


@dataclass
class Encoded:
    """A chunk's tokens: the training and validation documents' ids, each document followed by
    the separator, and their counts (`text_docs`: documents with more than whitespace)."""

    train: np.ndarray
    val: np.ndarray
    docs: int
    text_docs: int
    val_docs: int
    val_text_docs: int
    nbytes: int


class Encoder:
    """Chunk -> Encoded: parse, split off the validation documents, tokenize. Runs in the
    workers (it is pickled to them) and, with one worker, in the main process."""

    def __init__(self, tok, text_key: str, val_fraction: float, dtype: np.dtype):
        self.tok, self.text_key, self.val_fraction, self.dtype = tok, text_key, val_fraction, np.dtype(dtype)
        self.separator = np.asarray(tok.separator, dtype=self.dtype)

    def __call__(self, chunk: Chunk) -> Encoded:
        docs = texts_of(chunk, self.text_key)
        parts: tuple[list, list] = ([], [])
        counts = [0, 0, 0, 0]  # docs, text docs, val docs, val text docs
        for doc, ids in zip(docs, self._encode(docs)):
            side = 1 if is_validation(doc, self.val_fraction) else 0
            parts[side].extend((ids, self.separator))
            counts[2 * side] += 1
            counts[2 * side + 1] += bool(ids.size) and not doc.isspace()
        train, val = (np.concatenate(p).astype(self.dtype, copy=False) if p else np.empty(0, self.dtype)
                      for p in parts)
        return Encoded(train, val, *counts, nbytes=chunk.nbytes)

    def _encode(self, docs: list[str]) -> list[np.ndarray]:
        if isinstance(self.tok, ByteTokenizer):
            return [np.frombuffer(d.encode("utf-8"), dtype=np.uint8) for d in docs]
        return [np.asarray(ids, dtype=self.dtype) for ids in self.tok.encode_batch(docs)]


def encode_chunks(parts: Iterator[Chunk], encoder: Encoder, workers: int,
                  started: list[int] | None = None) -> Iterator[Encoded]:
    """`encoder` applied to every chunk, in order: here with one worker, else in `workers`
    processes, chunk i going to worker i % workers, at most IN_FLIGHT chunks each at a time.
    Worker i starts with chunk i: an input of fewer chunks starts fewer processes (their number
    is put in `started`, where one is given)."""
    if workers == 1:
        for chunk in parts:
            yield encoder(chunk)
        return
    procs: list[_Worker] = []
    ok = False
    try:
        sent = received = 0
        for chunk in itertools.islice(parts, IN_FLIGHT * workers):
            if sent < workers:
                procs.append(_Worker(encoder, sent))
            procs[sent % workers].send(chunk)
            sent += 1
        if started is not None:
            started[:] = [len(procs)]
        while received < sent:
            kind, value = procs[received % workers].receive()
            received += 1
            if kind == "error":
                raise DataError(*value)
            if kind == "crash":
                raise RuntimeError(f"a tokenizer worker failed:\n{value}")
            chunk = next(parts, None)
            if chunk is not None:  # to the worker just heard from: sent - received stays IN_FLIGHT * workers
                procs[sent % workers].send(chunk)
                sent += 1
            yield value
        ok = True
    finally:
        for w in procs:
            w.close(abort=not ok)


class _Worker:
    """One tokenizer process (scaletrain.data.tokenize_worker) and the thread that feeds its
    stdin (a write that waits for the worker must never hold up reading the results)."""

    def __init__(self, encoder: Encoder, index: int):
        root = str(Path(__file__).resolve().parents[2])  # so that the worker imports this scaletrain
        path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
        self.index = index
        entry = "from scaletrain.data.tokenize_worker import serve; serve()"
        self.proc = subprocess.Popen([sys.executable, "-c", entry],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env={**os.environ, "PYTHONPATH": path,
                                          # one thread each: the processes are the parallelism
                                          "TOKENIZERS_PARALLELISM": "false", "RAYON_NUM_THREADS": "1"})
        self.inbox: queue.Queue = queue.Queue()
        self.feeder = threading.Thread(target=self._feed, daemon=True, name=f"prepare-feed-{index}")
        self.feeder.start()
        self.inbox.put(encoder)

    def _feed(self) -> None:
        try:
            while (item := self.inbox.get()) is not _STOP:
                pickle.dump(item, self.proc.stdin, protocol=pickle.HIGHEST_PROTOCOL)
                self.proc.stdin.flush()
        except OSError:
            pass  # the worker is gone: receive() says so

    def send(self, chunk: Chunk) -> None:
        self.inbox.put(chunk)

    def receive(self) -> tuple[str, object]:
        try:
            return pickle.load(self.proc.stdout)
        except (EOFError, pickle.UnpicklingError, OSError):
            code = self.proc.wait()
            raise DataError(f"tokenizer worker {self.index} ended unexpectedly (exit code {code}: out of memory, or "
                            "killed?); nothing was written; run prepare again, with fewer --workers if memory is "
                            "short") from None

    def close(self, abort: bool) -> None:
        if not abort:
            self.inbox.put(None)  # the worker's signal to end
        self.inbox.put(_STOP)
        try:
            self.proc.wait(timeout=0.1 if abort else 10)
        except subprocess.TimeoutExpired:
            pass
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError):
                f.close()


_STOP = object()  # tells a feeder thread to end


# --------------------------------------------------------------------------------------------
# Writing


class _ShardWriter:
    """Tokens -> `PREFIX_00000.bin`, ... of `shard_tokens` tokens each, written as they come
    (memory holds none of a shard); `shards` describes the files for meta.json."""

    def __init__(self, folder: Path, prefix: str, dtype: np.dtype, shard_tokens: int):
        self.folder, self.prefix, self.dtype, self.shard_tokens = folder, prefix, np.dtype(dtype), shard_tokens
        self.shards: list[dict] = []
        self.n_docs = self.n_text_docs = 0  # all documents, and those with more than whitespace
        self._file: IO[bytes] | None = None
        self._digest = hashlib.sha256()
        self._count = 0  # tokens in the open shard
        self.ones = 0  # of a mask: the counted tokens written

    def __enter__(self) -> _ShardWriter:
        return self

    def __exit__(self, *exc) -> None:
        if self._file is not None:  # an error: the folder is removed; the file is closed first
            self._file.close()
            self._file = None

    def add(self, ids: np.ndarray, docs: int, text_docs: int) -> None:
        self.n_docs += docs
        self.n_text_docs += text_docs
        if self.dtype == np.uint8:
            self.ones += int(np.count_nonzero(ids))
        pos = 0
        while pos < ids.size:
            if self._file is None:
                self._file = (self.folder / self._name()).open("wb")
                self._digest, self._count = hashlib.sha256(), 0
            take = min(ids.size - pos, self.shard_tokens - self._count)
            data = ids[pos:pos + take].tobytes()
            self._file.write(data)
            self._digest.update(data)
            self._count += take
            pos += take
            if self._count == self.shard_tokens:
                self._close_shard()

    def close(self) -> None:
        if self._file is not None:
            self._close_shard()

    def _name(self) -> str:
        return f"{self.prefix}_{len(self.shards):05d}.bin"

    def _close_shard(self) -> None:
        name = self._name()
        self._file.close()
        self._file = None
        self.shards.append({"file": name, "num_tokens": self._count, "sha256": self._digest.hexdigest()})


# --------------------------------------------------------------------------------------------
# An interrupted prepare, and the progress line


def _partial_prefix(out: Path) -> str:
    return f".{out.name}.partial-"  # scaletrain.atomic.replacing's temporary name, less the pid


def _unfinished(out: Path) -> list[Path]:
    """Temporary folders of earlier prepares into `out` that no running prepare holds."""
    if not out.parent.is_dir():
        return []
    found = []
    for p in sorted(out.parent.iterdir()):
        if p.name.startswith(_partial_prefix(out)) and p.is_dir() and not p.is_symlink():
            try:
                with _locked_folder(p):
                    found.append(p)
            except BlockingIOError:
                pass  # another prepare is writing it right now
    return found


@contextlib.contextmanager
def _locked_folder(folder: Path):
    """Hold an exclusive lock on `folder` (created if missing) for the block; raises
    BlockingIOError when another process holds it."""
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        yield folder
    finally:
        os.close(fd)  # closing drops the lock


class ProgressLine:
    """How far a prepare is: bytes of input read, MB/s, tokens written, ETA. On a terminal one
    line redrawn in place; elsewhere (a log file) a new line every `every` seconds."""

    def __init__(self, total_bytes: int, stream: IO[str], every: float | None = None):
        self.total, self.stream = max(total_bytes, 1), stream
        self.tty = stream.isatty()
        self.every = every if every is not None else (0.5 if self.tty else 30.0)
        self.done = self.tokens = 0
        self.t0 = self.last = time.perf_counter()

    def advance(self, nbytes: int, tokens: int) -> None:
        self.done += nbytes
        self.tokens += tokens
        now = time.perf_counter()
        if now - self.last >= self.every:
            self.last = now
            self._write(self.text(now))

    def text(self, now: float | None = None) -> str:
        elapsed = max((now or time.perf_counter()) - self.t0, 1e-9)
        rate = self.done / elapsed
        left = max(self.total - self.done, 0)
        eta = fmt.clock(left / rate) if rate > 0 else "?"
        return (f"prepare: {fmt.size(self.done)} of {fmt.size(self.total)} ({100 * self.done / self.total:.0f}%), "
                f"{rate / 1e6:.1f} MB/s, {fmt.count(self.tokens)} tokens, eta {eta}")

    def note(self, line: str) -> None:
        self._write(f"prepare: {line}")
        if self.tty:
            self.stream.write("\n")

    def finish(self) -> None:
        self.done = self.total
        elapsed = time.perf_counter() - self.t0
        self._write(f"{self.text()} -> done in {fmt.clock(elapsed)}")
        if self.tty:
            self.stream.write("\n")
        self.stream.flush()

    def _write(self, text: str) -> None:
        self.stream.write(f"\r\033[K{text}" if self.tty else text + "\n")
        self.stream.flush()
