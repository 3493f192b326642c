"""`scaletrain prepare` at real scale: every core with byte-identical output, bounded memory, a
progress line, a restartable interruption, and the inputs people bring (compressed jsonl,
parquet folders, Arrow files, Hugging Face datasets saved on disk)."""

from __future__ import annotations

import gzip
import importlib
import io
import json
import os
import signal
import subprocess
import sys
import time
import tracemalloc
import zlib
from pathlib import Path

import pytest

from scaletrain.data import sources
from scaletrain.data.dataset import TokenData
from scaletrain.data.prepare import prepare
from scaletrain.errors import DataError

from conftest import REPO, run_here

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex bad jam".split()


def documents(n: int, seed: int = 0) -> list[str]:
    import random

    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 120))) + ("\n" if i % 7 == 0 else "")
            for i in range(n)]


def write_jsonl(path: Path, docs: list[str], key: str = "text") -> Path:
    path.write_text("".join(json.dumps({key: d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return path


def folder_bytes(folder: Path) -> dict[str, bytes]:
    """Every file of a prepared folder, meta.json without its creation time."""
    out = {}
    for f in sorted(folder.iterdir()):
        data = f.read_bytes()
        if f.name == "meta.json":
            meta = json.loads(data)
            meta.pop("created")
            data = json.dumps(meta, sort_keys=True).encode()
        out[f.name] = data
    return out


@pytest.fixture
def corpus(tmp_path):
    return write_jsonl(tmp_path / "c.jsonl", documents(600))


# 1. every core, the same bytes


@pytest.mark.slow
def test_output_is_byte_identical_whatever_the_number_of_workers(corpus, tmp_path, monkeypatch):
    monkeypatch.setattr(sources, "CHUNK_BYTES", 4096)  # ~40 chunks: every worker gets several
    prepare([corpus], tmp_path / "bpe", tokenizer="bpe", vocab_size=300)
    kw = dict(tokenizer="file", tokenizer_file=tmp_path / "bpe" / "tokenizer.json", shard_tokens=3000,
              val_fraction=0.1)
    one = prepare([corpus], tmp_path / "w1", workers=1, **kw)
    three = prepare([corpus], tmp_path / "w3", workers=3, **kw)
    assert len(one["shards"]) > 3 and one["num_val_documents"] > 0  # several shards, both splits
    assert folder_bytes(tmp_path / "w1") == folder_bytes(tmp_path / "w3")
    assert three["num_tokens"] == one["num_tokens"]
    # and the same as the tokenizer's own encoding of each document, in order
    from scaletrain.data.prepare import is_validation
    from scaletrain.data.tokenizer import HFTokenizer

    tok = HFTokenizer.from_file(tmp_path / "bpe" / "tokenizer.json")
    expected = [i for d in documents(600) if not is_validation(d, 0.1) for i in tok.encode(d) + tok.separator]
    data = TokenData.open(tmp_path / "w3")
    assert data.read(0, data.num_tokens).tolist() == expected


def test_memory_stays_bounded_by_a_chunk_not_the_corpus(tmp_path, monkeypatch):
    # 6 MB of jsonl through the byte tokenizer into 6M tokens: the old writer held a whole shard
    # as a Python list (~50 MB here); now a chunk at a time is in memory
    monkeypatch.setattr(sources, "CHUNK_BYTES", 1 << 18)
    doc = "x" * 2000
    path = tmp_path / "big.jsonl"
    with path.open("w") as f:
        for _ in range(3000):
            f.write(json.dumps({"text": doc}) + "\n")
    tracemalloc.start()
    try:
        meta = prepare([path], tmp_path / "out", workers=1)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert meta["num_tokens"] == 3000 * 2002
    assert peak < 8 * 2**20, f"peak {peak / 2**20:.1f} MiB for a 6 MB corpus in 256 KiB chunks"


def test_progress_line_shows_rate_tokens_and_eta(corpus, tmp_path, monkeypatch):
    monkeypatch.setattr(sources, "CHUNK_BYTES", 8192)
    stream = io.StringIO()
    prepare([corpus], tmp_path / "out", workers=1, progress=stream, progress_every=0)
    lines = stream.getvalue().splitlines()
    assert len(lines) > 3
    assert all("MB/s" in line and " tokens, eta " in line for line in lines), lines[:2]
    assert lines[-1].startswith(f"prepare: {corpus.stat().st_size / 1024:.1f} KiB of") and "(100%)" in lines[-1]
    assert "done in" in lines[-1]


# 2. an interrupted prepare


def test_interrupted_prepare_leaves_nothing_that_looks_complete(corpus, tmp_path, monkeypatch):
    prep = importlib.import_module("scaletrain.data.prepare")  # the module (the package binds the name to the function)

    monkeypatch.setattr(sources, "CHUNK_BYTES", 4096)
    calls = []
    real = prep.Encoder.__call__

    def stop_on_the_third(self, chunk):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(self, chunk)

    monkeypatch.setattr(prep.Encoder, "__call__", stop_on_the_third)
    with pytest.raises(KeyboardInterrupt):
        prepare([corpus], tmp_path / "out", workers=1)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.partial-*"))


@pytest.mark.slow
def test_killed_prepare_can_simply_be_started_again(tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", documents(12000))  # ~3 MB: a few seconds of work
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "scaletrain", "prepare", str(path), "--out", str(out), "--workers", "2",
           "--shard-tokens", "20000"]
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + 60
    while not list(tmp_path.glob(".out.partial-*/shard_*.bin")) and time.time() < deadline:
        time.sleep(0.05)  # until it has written a shard
    proc.send_signal(signal.SIGKILL)  # no handler runs: what a power cut or the OOM killer leaves
    proc.wait()
    assert not out.exists()  # nothing that looks complete
    left = list(tmp_path.glob(".out.partial-*"))
    assert len(left) == 1 and not (left[0] / "meta.json").exists()
    r = run_here("prepare", str(path), "--out", str(out), "--workers", "2", "--shard-tokens", "20000")
    assert r.returncode == 0, r.stderr
    assert f"removed {left[0]}, left by an interrupted prepare" in r.stderr
    assert not list(tmp_path.glob(".out.partial-*"))
    assert TokenData.open(out).num_tokens > 0


# 3. inputs


def test_compressed_jsonl_reads_as_the_plain_file(corpus, tmp_path):
    zstandard = pytest.importorskip("zstandard", reason="the zstd extra (pip install 'scaletrain[zstd]') is missing")
    raw = corpus.read_bytes()
    (tmp_path / "c.jsonl.gz").write_bytes(gzip.compress(raw))
    # two zstd frames, as parallel compressors write them
    half = raw.index(b"\n", len(raw) // 2) + 1
    cz = zstandard.ZstdCompressor()
    (tmp_path / "c.jsonl.zst").write_bytes(cz.compress(raw[:half]) + cz.compress(raw[half:]))
    plain = prepare([corpus], tmp_path / "plain", workers=1)
    for name in ("c.jsonl.gz", "c.jsonl.zst"):
        meta = prepare([tmp_path / name], tmp_path / f"o-{name}", workers=1)
        assert [s["sha256"] for s in meta["shards"]] == [s["sha256"] for s in plain["shards"]]


@pytest.mark.parametrize("suffix", [".jsonl.gz", ".jsonl.zst"])
def test_truncated_compressed_file_is_one_line_exit_2(corpus, tmp_path, suffix):
    if suffix == ".jsonl.zst":
        zstandard = pytest.importorskip("zstandard", reason="the zstd extra is missing")
        data = zstandard.ZstdCompressor().compress(corpus.read_bytes())
    else:
        data = gzip.compress(corpus.read_bytes())
    bad = tmp_path / f"cut{suffix}"
    bad.write_bytes(data[:len(data) * 2 // 3])
    r = run_here("prepare", str(bad), "--out", str(tmp_path / "out"), "--quiet")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and f"{bad}: it ends before the end of its compressed stream (truncated" in lines[0]
    assert not (tmp_path / "out").exists()
    # where: the text read before the break, to within one read (it said "after 0 bytes" for a file
    # under a chunk of text)
    if suffix == ".jsonl.gz":
        readable = len(zlib.decompressobj(16 + zlib.MAX_WBITS).decompress(bad.read_bytes()))
        said = int(lines[0].split(", after ")[1].split(" bytes of text")[0].replace(",", ""))
        assert readable - sources.PIECE_BYTES <= said <= readable and said > 0, (said, readable)


def test_parquet_folder_and_arrow_files(tmp_path):
    pa = pytest.importorskip("pyarrow", reason="the parquet extra is missing")
    import pyarrow.parquet as pq

    docs = documents(300)
    (tmp_path / "pq").mkdir()
    pq.write_table(pa.table({"body": docs[:150]}), tmp_path / "pq" / "part-0.parquet", row_group_size=50)
    pq.write_table(pa.table({"body": docs[150:]}), tmp_path / "pq" / "part-1.parquet", row_group_size=50)
    table = pa.table({"body": docs, "n": list(range(300))})
    with pa.OSFile(str(tmp_path / "s.arrow"), "wb") as f, pa.ipc.new_stream(f, table.schema) as w:
        w.write_table(table, max_chunksize=64)
    with pa.OSFile(str(tmp_path / "f.arrow"), "wb") as f, pa.ipc.new_file(f, table.schema) as w:
        w.write_table(table, max_chunksize=64)
    write_jsonl(tmp_path / "j.jsonl", docs, key="body")
    want = prepare([tmp_path / "j.jsonl"], tmp_path / "ref", text_key="body", workers=1)["shards"]
    for name in ("pq", "s.arrow", "f.arrow"):
        got = prepare([tmp_path / name], tmp_path / f"o-{name}", text_key="body", workers=1)["shards"]
        assert [s["sha256"] for s in got] == [s["sha256"] for s in want], name
    with pytest.raises(DataError, match=r"s.arrow: column 'n' holds int64, not text; set --text-key"):
        prepare([tmp_path / "s.arrow"], tmp_path / "bad", text_key="n")


def test_hugging_face_dataset_saved_to_disk(tmp_path):
    datasets = pytest.importorskip("datasets", reason="the datasets extra (pip install 'scaletrain[datasets]') is "
                                                      "missing")
    docs = documents(500)
    ds = datasets.Dataset.from_dict({"content": docs, "n": list(range(500))})
    ds.save_to_disk(str(tmp_path / "ds"), max_shard_size="20KB")  # several .arrow files
    assert len(list((tmp_path / "ds").glob("*.arrow"))) > 1
    write_jsonl(tmp_path / "j.jsonl", docs)
    want = prepare([tmp_path / "j.jsonl"], tmp_path / "ref", workers=1)
    got = prepare([tmp_path / "ds"], tmp_path / "out", text_key="content", workers=2)
    assert [s["sha256"] for s in got["shards"]] == [s["sha256"] for s in want["shards"]]
    assert got["sources"] == [str(tmp_path / "ds")]
    # its Arrow files alone, without the datasets library
    files = sorted((tmp_path / "ds").glob("*.arrow"))
    alone = prepare(files, tmp_path / "arrow", text_key="content", workers=1)
    assert alone["num_tokens"] == want["num_tokens"]

    # bad input: one line, exit 2
    r = run_here("prepare", str(tmp_path / "ds"), "--out", str(tmp_path / "o2"), "--quiet")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"scaletrain: error: {tmp_path / 'ds'}: no column 'text' (columns: content, n); set --text-key to the "
        "column that holds the text"]
    datasets.DatasetDict({"train": ds, "test": ds}).save_to_disk(str(tmp_path / "dd"))
    r = run_here("prepare", str(tmp_path / "dd"), "--out", str(tmp_path / "o3"), "--quiet")
    assert r.returncode == 2 and "a Hugging Face DatasetDict with splits test, train; give one split's folder" \
        in r.stderr and len(r.stderr.strip().splitlines()) == 1
