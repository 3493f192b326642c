"""`prepare --workers N` (issue 37, point 12): N is capped at the cores this process may use, and
a worker process starts only when there is a chunk of the input for it; both caps are said in a
line. The first test is a real `scaletrain prepare --workers 10000` whose child processes are
counted while it runs."""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from scaletrain.data import sources

from conftest import REPO

CORES = len(os.sched_getaffinity(0))


def write_corpus(path: Path, documents: int) -> Path:
    with path.open("w") as f:
        for k in range(documents):
            f.write(json.dumps({"text": f"document {k}: " + "the quick brown fox jumps over the lazy dog " * 4}) + "\n")
    return path


def children(pid: int) -> set[int]:
    found = set()
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found.update(int(c) for c in (task / "children").read_text().split())
        except OSError:
            pass
    return found


def test_workers_10000_on_a_small_input_start_one_process_per_chunk(tmp_path):
    corpus = write_corpus(tmp_path / "small.jsonl", 4700)
    assert 0.8e6 < corpus.stat().st_size < sources.CHUNK_BYTES  # ~0.9 MB: one chunk
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO / "src")}
    proc = subprocess.Popen([sys.executable, "-m", "scaletrain", "prepare", str(corpus), "--out", str(tmp_path / "out"),
                             "--workers", "10000"], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    seen: set[int] = set()
    try:
        while proc.poll() is None:
            seen |= children(proc.pid)
            if len(seen) > CORES + 1:  # the bug: thousands of tokenizer processes; stop it before they fill memory
                os.killpg(proc.pid, signal.SIGKILL)
                break
            time.sleep(0.01)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert len(seen) <= min(CORES, 1), f"{len(seen)} child processes for one chunk on {CORES} core(s)"
    assert proc.returncode == 0, err
    cap = min(CORES, 10000)
    assert f"scaletrain: prepare: --workers 10000: {cap} tokenizer process(es) at most, one per core" in err, err
    if cap > 1:  # more than one worker allowed, one chunk of work: one started, and said
        assert "--workers 10000: 1 tokenizer process(es) started, one per chunk of the input (it came in 1)" in err
    assert "wrote " in out and (tmp_path / "out" / "meta.json").is_file()


def count_workers(prep, monkeypatch) -> list[int]:
    """The index of each tokenizer process started, in order."""
    started: list[int] = []
    real = prep._Worker.__init__

    def counted(self, encoder, index):
        started.append(index)
        real(self, encoder, index)

    monkeypatch.setattr(prep._Worker, "__init__", counted)
    return started


def test_the_workers_are_capped_by_the_cores_and_the_output_is_the_same(tmp_path, monkeypatch):
    prep = importlib.import_module("scaletrain.data.prepare")
    corpus = write_corpus(tmp_path / "c.jsonl", 1500)  # ~300 KB
    monkeypatch.setattr(sources, "CHUNK_BYTES", 1 << 15)  # ~9 chunks: more than the cores
    monkeypatch.setattr(prep, "default_workers", lambda: 2)  # the cores this process may use, as seen
    started = count_workers(prep, monkeypatch)
    lines: list[str] = []
    many = prep.prepare([corpus], tmp_path / "many", workers=10000, report=lines.append)
    assert started == [0, 1]
    assert lines == ["--workers 10000: 2 tokenizer process(es) at most, one per core this process may use (more "
                     "would only wait for each other)"]
    one = prep.prepare([corpus], tmp_path / "one", workers=1)
    assert many["shards"] == one["shards"]  # sha256 per shard: the same bytes
    assert (tmp_path / "many" / "shard_00000.bin").read_bytes() == (tmp_path / "one" / "shard_00000.bin").read_bytes()


def test_fewer_chunks_than_workers_start_fewer_processes(tmp_path, monkeypatch):
    prep = importlib.import_module("scaletrain.data.prepare")
    corpus = write_corpus(tmp_path / "c.jsonl", 300)  # ~60 KB
    monkeypatch.setattr(sources, "CHUNK_BYTES", 1 << 15)  # 2 chunks
    monkeypatch.setattr(prep, "default_workers", lambda: 4)
    started = count_workers(prep, monkeypatch)
    lines: list[str] = []
    meta = prep.prepare([corpus], tmp_path / "out", workers=3, report=lines.append)
    assert started == [0, 1] and meta["num_documents"] == 300
    assert lines == ["--workers 3: 2 tokenizer process(es) started, one per chunk of the input (it came in 2)"]
