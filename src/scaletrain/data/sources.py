"""The inputs of `scaletrain prepare`, read as a stream of chunks: memory stays bounded by a
chunk whatever the size of the corpus.

Kinds of input, by name:
    .txt                 one document per file (read whole)
    .jsonl               one JSON object per line; the text in its --text-key field
    .jsonl.gz .jsonl.zst the same, compressed (gzip from the standard library, zstd with the
                         zstandard package); a truncated or corrupt file is an error, never a
                         silently shorter corpus
    .parquet .arrow      one row per document, the text in column --text-key (pyarrow); .arrow is
                         an Arrow IPC file or stream, as Hugging Face datasets writes its cache
    a folder             every file above inside it, in sorted order; a folder written by the
                         `datasets` library's `save_to_disk` is read as that dataset, row by row

Reading happens in the main process and yields `Chunk`s; turning a chunk into texts (decoding,
JSON parsing, type checks) is `texts_of`, which the tokenizer workers run, so that the costly
part of parsing is spread over the cores too. Errors name the file, the line or row, and the fix.
"""

from __future__ import annotations

import gzip
import io
import json
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from scaletrain.errors import DataError

SUFFIXES = (".jsonl.gz", ".jsonl.zst", ".txt", ".jsonl", ".parquet", ".arrow")  # longest first
COMPRESSED = (".jsonl.gz", ".jsonl.zst")
DATASET = "dataset"  # the kind of a save_to_disk folder
DATASET_FILES = ("state.json", "dataset_info.json")  # what save_to_disk writes beside its .arrow files
DATASET_DICT_FILE = "dataset_dict.json"  # save_to_disk of a DatasetDict: one folder per split
CHUNK_BYTES = 1 << 20  # jsonl text per chunk (1 MiB)
PIECE_BYTES = 1 << 16  # read from a (compressed) stream at a time
CHUNK_ROWS = 2048  # parquet / arrow rows per chunk
REENCODE = "re-encode the file as UTF-8 (e.g. iconv -f LATIN1 -t UTF-8) or remove it from the inputs"
KINDS_TEXT = ".txt, .jsonl, .jsonl.gz, .jsonl.zst, .parquet or .arrow"


@dataclass
class Chunk:
    """Part of one input: `kind` txt (payload: the file's bytes), lines (the bytes of whole
    jsonl lines, the first of them line `first` at byte `offset`), or arrow (an Arrow IPC
    stream of one string column, its first row `first`). `nbytes`: the share of the input's
    size on disk it stands for (progress)."""

    kind: str
    payload: bytes
    file: str
    first: int = 0
    offset: int = 0
    nbytes: int = 0


def input_kind(path: Path) -> str | None:
    if path.is_dir():
        return DATASET if all((path / name).is_file() for name in DATASET_FILES) else None
    return next((s for s in SUFFIXES if path.name.endswith(s)), None)


def find_inputs(inputs: Sequence[str | Path]) -> list[Path]:
    files: list[Path] = []
    for item in inputs:
        p = Path(item)
        if p.is_dir():
            if (p / DATASET_DICT_FILE).is_file():
                splits = sorted(d.name for d in p.iterdir() if d.is_dir())
                raise DataError(f"{p}: a Hugging Face DatasetDict with splits {', '.join(splits) or '(none)'}; "
                                f"give one split's folder, e.g. {p / (splits[0] if splits else 'train')}")
            if input_kind(p) == DATASET:
                files.append(p)
                continue
            found = sorted(f for f in p.rglob("*") if f.is_file() and input_kind(f))
            if not found:
                raise DataError(f"{p}: no .txt, .jsonl or .parquet files in this folder (nor .jsonl.gz, .jsonl.zst, "
                                ".arrow or a dataset saved with save_to_disk)")
            files.extend(found)
        elif p.is_file():
            if input_kind(p) is None:
                raise DataError(f"{p}: unsupported file type {''.join(p.suffixes) or p.name!r}; give {KINDS_TEXT} "
                                "files, or a folder written by a Hugging Face dataset's save_to_disk")
            files.append(p)
        else:
            raise DataError(f"{p}: no such file or folder")
    return files


def input_bytes(files: Sequence[Path]) -> int:
    """The size on disk of the inputs (what progress counts against)."""
    total = 0
    for f in files:
        total += sum(p.stat().st_size for p in f.rglob("*.arrow")) if f.is_dir() else f.stat().st_size
    return total


def chunks(files: Sequence[Path], text_key: str) -> Iterator[Chunk]:
    for f in files:
        kind = input_kind(f)
        if kind == ".txt":
            raw = f.read_bytes()
            yield Chunk("txt", raw, str(f), nbytes=len(raw))
        elif kind in (".jsonl",) + COMPRESSED:
            yield from _jsonl_chunks(f, kind)
        elif kind == ".parquet":
            yield from _parquet_chunks(f, text_key)
        elif kind == ".arrow":
            yield from _arrow_chunks(f, text_key)
        elif kind == DATASET:
            yield from _dataset_chunks(f, text_key)


def iter_documents(files: Sequence[Path], text_key: str = "text") -> Iterator[str]:
    """Each .txt file is one document; each jsonl line and parquet/arrow row is one. Text must be
    valid UTF-8: a bad byte is reported with its place, never replaced."""
    for chunk in chunks(files, text_key):
        yield from texts_of(chunk, text_key)


ROW_KINDS = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".parquet")  # what iter_rows reads


def iter_rows(files: Sequence[Path], what: str = "preference data") -> Iterator[tuple[str, dict]]:
    """(where, row) for each row of jsonl (plain, .gz, .zst) and parquet files, whole rows with every field:
    `where` is FILE:LINE for jsonl, FILE:row N (from 0, as `datasets` counts) for parquet."""
    for f in files:
        kind = input_kind(f)
        if kind not in ROW_KINDS:
            raise DataError(f"{f}: {what} is read from {', '.join(ROW_KINDS)} files, one row an example; convert "
                            "it to jsonl or parquet")
        if kind == ".parquet":
            yield from _parquet_rows(f)
            continue
        for chunk in _jsonl_chunks(f, kind):
            for where, row in _json_lines(chunk):
                if not isinstance(row, dict):
                    raise DataError(f"{where}: a row of {what} must be a JSON object, not {type(row).__name__}")
                yield where, row


def _parquet_rows(f: Path) -> Iterator[tuple[str, dict]]:
    _pyarrow(f)
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(f)
    except Exception as e:  # pyarrow raises its own exception types for bad files
        raise DataError(f"{f}: not a readable parquet file ({e})") from None
    n = 0
    try:
        for batch in pf.iter_batches(batch_size=CHUNK_ROWS):
            for row in batch.to_pylist():
                yield f"{f}:row {n}", row
                n += 1
    except OSError as e:  # a file cut short after its footer was read
        raise DataError(f"{f}: not a readable parquet file ({e}); copy it again") from None


# --------------------------------------------------------------------------------------------
# Turning a chunk into texts (in the workers)


def texts_of(chunk: Chunk, text_key: str) -> list[str]:
    if chunk.kind == "txt":
        return [_txt_text(chunk.payload, chunk.file)]
    if chunk.kind == "lines":
        return _jsonl_texts(chunk, text_key)
    import pyarrow as pa

    column = pa.ipc.open_stream(chunk.payload).read_all().column(0)
    return [t for t in column.to_pylist() if t is not None]


def _txt_text(raw: bytes, f: str) -> str:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise DataError(f"{f}: invalid UTF-8 at byte {e.start} (line {line}): "
                        f"{raw[e.start:e.end]!r} ({e.reason}); {REENCODE}") from None
    # universal newlines, as text-mode reading gives: \r\n and \r become \n
    return text.replace("\r\n", "\n").replace("\r", "\n")


def _json_lines(chunk: Chunk) -> Iterator[tuple[str, object]]:
    """("FILE:LINE", the line's JSON value) for each non-blank line of a jsonl chunk; a line that is not
    UTF-8 (its byte in the file and column named) or not JSON is one line of error."""
    f, offset = chunk.file, chunk.offset  # of the current line in the (uncompressed) file
    lines = chunk.payload.split(b"\n")
    if lines and not lines[-1]:
        lines.pop()  # the payload ends with a newline
    for lineno, raw in enumerate(lines, chunk.first):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"{f}:{lineno}: invalid UTF-8 at byte {offset + e.start} of the file "
                            f"(column {e.start + 1}): {raw[e.start:e.end]!r} ({e.reason}); {REENCODE}") from None
        offset += len(raw) + 1
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{f}:{lineno}: not valid JSON ({e.msg} at column {e.colno}); "
                            "each line must hold one JSON object") from None
        yield f"{f}:{lineno}", value


def _jsonl_texts(chunk: Chunk, text_key: str) -> list[str]:
    texts = []
    for where, row in _json_lines(chunk):
        if not isinstance(row, dict) or not isinstance(row.get(text_key), str):
            raise DataError(f"{where}: expected an object with a string field "
                            f"{text_key!r}; set --text-key to the field that holds the text")
        texts.append(row[text_key])
    return texts


# --------------------------------------------------------------------------------------------
# Reading the inputs (in the main process)


def _jsonl_chunks(f: Path, kind: str) -> Iterator[Chunk]:
    with f.open("rb") as raw:
        stream = _decompressed(raw, f, kind)
        lineno, offset, read = 1, 0, 0
        while True:
            block = bytearray()  # read in pieces: a broken stream is said with the text read before it
            try:
                while len(block) < CHUNK_BYTES and (piece := stream.read(min(PIECE_BYTES, CHUNK_BYTES - len(block)))):
                    block += piece
                if block and not block.endswith(b"\n"):
                    block += stream.readline()  # whole lines only
            except (EOFError, OSError, zlib.error) as e:
                raise _broken(f, kind, offset + len(block), e) from None
            except Exception as e:  # zstandard's own error type
                if type(e).__name__ != "ZstdError":
                    raise
                raise _broken(f, kind, offset + len(block), e) from None
            block = bytes(block)
            if not block:
                return
            now = raw.tell()
            yield Chunk("lines", block, str(f), lineno, offset, now - read)
            lineno += block.count(b"\n") + (not block.endswith(b"\n"))
            offset += len(block)
            read = now


def _broken(f: Path, kind: str, offset: int, e: Exception) -> DataError:
    what = "gzip" if kind == ".jsonl.gz" else "zstd"
    reason = "it ends before the end of its compressed stream (truncated: an interrupted download or copy?)" \
        if isinstance(e, EOFError) else f"it is not valid {what} data ({e})"
    return DataError(f"{f}: {reason}, after {offset:,} bytes of text; download or copy the file again, or check "
                     f"it with `{'gzip -t' if what == 'gzip' else 'zstd -t'} {f}`")


def _decompressed(raw, f: Path, kind: str):
    if kind == ".jsonl":
        return raw
    if kind == ".jsonl.gz":
        return gzip.GzipFile(fileobj=raw, mode="rb")
    try:
        import zstandard
    except ImportError:
        raise DataError(f"{f}: reading .zst files needs the zstandard package: pip install zstandard "
                        "(or pip install 'scaletrain[zstd]')") from None
    return io.BufferedReader(_ZstdReader(raw, zstandard), buffer_size=1 << 20)


class _ZstdReader(io.RawIOBase):
    """zstd frames, one after another, decompressed; a file that stops inside a frame raises
    EOFError (zstandard's own stream reader returns the partial data without a word)."""

    def __init__(self, raw, zstandard):
        self.raw, self.zstd = raw, zstandard
        self.obj = zstandard.ZstdDecompressor().decompressobj()
        self.buf, self.pos = b"", 0
        self.in_frame = False  # data fed since the last frame's end

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        while self.pos >= len(self.buf):
            data = self.raw.read(1 << 20)
            if not data:
                if self.in_frame:
                    raise EOFError("zstd stream ended inside a frame")
                return 0
            self.buf, self.pos = self._feed(data), 0
        n = min(len(b), len(self.buf) - self.pos)
        b[:n] = self.buf[self.pos:self.pos + n]
        self.pos += n
        return n

    def _feed(self, data: bytes) -> bytes:
        out = []
        while data:
            out.append(self.obj.decompress(data))
            self.in_frame = not self.obj.eof
            data = self.obj.unused_data if self.obj.eof else b""
            if self.obj.eof:  # the next frame needs a new decompressor
                self.obj = self.zstd.ZstdDecompressor().decompressobj()
        return b"".join(out)


def _pyarrow(f: Path):
    try:
        import pyarrow as pa
    except ImportError:
        raise DataError(f"{f}: reading parquet and Arrow files needs pyarrow: pip install pyarrow "
                        "(or pip install 'scaletrain[parquet]')") from None
    return pa


def _check_column(f: Path, schema, text_key: str, what: str = "column") -> None:
    pa = _pyarrow(f)
    if text_key not in schema.names:
        raise DataError(f"{f}: no {what} {text_key!r} ({what}s: {', '.join(schema.names)}); "
                        f"set --text-key to the {what} that holds the text")
    typ = schema.field(text_key).type
    if not (pa.types.is_string(typ) or pa.types.is_large_string(typ) or
            (hasattr(pa.types, "is_string_view") and pa.types.is_string_view(typ))):
        raise DataError(f"{f}: {what} {text_key!r} holds {typ}, not text; set --text-key to a string {what}")


def _arrow_payload(column) -> bytes:
    """One string column as an Arrow IPC stream: only the rows it holds (pickling a slice
    would copy its whole parent buffer)."""
    pa = __import__("pyarrow")
    sink = pa.BufferOutputStream()
    batch = pa.record_batch([column], names=["text"])
    with pa.ipc.new_stream(sink, batch.schema) as writer:
        writer.write_batch(batch)
    return sink.getvalue().to_pybytes()


def _parquet_chunks(f: Path, text_key: str) -> Iterator[Chunk]:
    _pyarrow(f)
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(f)
    except Exception as e:  # pyarrow raises its own exception types for bad files
        raise DataError(f"{f}: not a readable parquet file ({e})") from None
    _check_column(f, pf.schema_arrow, text_key)
    rows, size, first = max(pf.metadata.num_rows, 1), f.stat().st_size, 0
    try:
        for batch in pf.iter_batches(batch_size=CHUNK_ROWS, columns=[text_key]):
            yield Chunk("arrow", _arrow_payload(batch.column(0)), str(f), first, nbytes=size * batch.num_rows // rows)
            first += batch.num_rows
    except OSError as e:  # a file cut short after its footer was read
        raise DataError(f"{f}: not a readable parquet file ({e}); copy it again") from None


def _arrow_chunks(f: Path, text_key: str) -> Iterator[Chunk]:
    pa = _pyarrow(f)
    with pa.memory_map(str(f)) as source:
        try:
            try:
                reader = pa.ipc.open_file(source)
                batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
            except pa.ArrowInvalid:  # not the file format: the stream format (what datasets writes)
                source.seek(0)
                reader = pa.ipc.open_stream(source)
                batches = iter(reader)
            _check_column(f, reader.schema, text_key)
            first, read = 0, 0
            for batch in batches:
                column, now = batch.column(text_key), source.tell()
                for start in range(0, len(column), CHUNK_ROWS):
                    part = column.slice(start, CHUNK_ROWS)
                    last = start + CHUNK_ROWS >= len(column)  # the batch's bytes count when its last part is done
                    yield Chunk("arrow", _arrow_payload(part), str(f), first, nbytes=now - read if last else 0)
                    first += len(part)
                read = now
        except pa.ArrowInvalid as e:
            raise DataError(f"{f}: not a readable Arrow file ({e})") from None


def _dataset_chunks(folder: Path, text_key: str) -> Iterator[Chunk]:
    try:
        import datasets
    except ImportError:
        raise DataError(f"{folder}: reading a Hugging Face dataset folder needs the datasets library: pip install "
                        "'scaletrain[datasets]'; or give its .arrow files, which pyarrow reads alone") from None
    try:
        ds = datasets.load_from_disk(str(folder))
    except Exception as e:  # the library's own errors for a damaged folder
        raise DataError(f"{folder}: not a readable Hugging Face dataset folder ({type(e).__name__}: {e})") from None
    if not isinstance(ds, datasets.Dataset):
        raise DataError(f"{folder}: holds a {type(ds).__name__}, not one dataset; give one split's folder")
    _check_column(folder, ds.data.schema, text_key)
    rows, size = max(len(ds), 1), input_bytes([folder])
    ds = ds.select_columns([text_key]).with_format("arrow")
    first = 0
    for table in ds.iter(batch_size=CHUNK_ROWS):
        yield Chunk("arrow", _arrow_payload(table.column(0).combine_chunks()), str(folder), first,
                    nbytes=size * table.num_rows // rows)
        first += table.num_rows
