from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from scaletrain.data import StepSampler, TokenData, WindowDataset, build_loader, builtin_data, open_data, prepare
from scaletrain.data.tokenizer import ByteTokenizer
from scaletrain.errors import DataError

from conftest import (
    MICRO_ARGS,
    Case,
    assert_one_clear_line,
    edit_json,
    micro_cfg,
    run_here,
    train_args,
    truncate,
    write,
)

TEXT = "The quick brown fox jumps over the lazy dog. " * 50


@pytest.fixture
def corpus(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text(TEXT)
    (src / "b.jsonl").write_text("\n".join(json.dumps({"text": f"line {i}: {TEXT[:80]}"}) for i in range(20)))
    return src


def test_prepare_byte_level_txt_and_jsonl(corpus, tmp_path):
    meta = prepare([corpus], tmp_path / "out", tokenizer="byte", shard_tokens=1000)
    assert meta["dtype"] == "uint16" and meta["tokenizer"] == {"kind": "byte", "vocab_size": 256}
    assert meta["num_documents"] == 21
    assert len(meta["shards"]) == -(-meta["num_tokens"] // 1000)
    for shard in meta["shards"]:
        assert set(shard) == {"file", "num_tokens", "sha256"}
    data = TokenData.open(tmp_path / "out")
    assert data.num_tokens == meta["num_tokens"]
    # the tokens round-trip to the text, across shard boundaries
    first = data.read(0, len(TEXT.encode()))
    assert ByteTokenizer().decode(first) == TEXT
    shards = [np.fromfile(tmp_path / "out" / f"shard_{i:05d}.bin", np.uint16) for i in (0, 1)]
    assert data.read(995, 10).tolist() == shards[0][995:].tolist() + shards[1][:5].tolist()


def test_prepare_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["hello parquet", "second row"]}), tmp_path / "d.parquet")
    meta = prepare([tmp_path / "d.parquet"], tmp_path / "out", text_key="body")
    assert meta["num_documents"] == 2
    with pytest.raises(DataError, match="no column 'text'"):
        prepare([tmp_path / "d.parquet"], tmp_path / "out2")


def test_prepare_bpe_and_tokenizer_file(corpus, tmp_path):
    meta = prepare([corpus], tmp_path / "bpe", tokenizer="bpe", vocab_size=300)
    assert meta["tokenizer"]["kind"] == "bpe" and meta["tokenizer"]["vocab_size"] <= 300
    assert (tmp_path / "bpe" / "tokenizer.json").is_file()
    bpe = TokenData.open(tmp_path / "bpe")
    assert bpe.num_tokens < len(TEXT.encode()) + 20 * 90  # BPE compresses
    assert bpe.tokenizer.decode(bpe.tokenizer.encode("quick brown fox")) == "quick brown fox"
    # a local tokenizer.json gives the same tokens as the tokenizer that made it
    meta2 = prepare([corpus], tmp_path / "file", tokenizer="file", tokenizer_file=tmp_path / "bpe" / "tokenizer.json")
    assert meta2["num_tokens"] == meta["num_tokens"]
    assert [s["sha256"] for s in meta2["shards"]] == [s["sha256"] for s in meta["shards"]]


def test_prepare_never_overwrites(corpus, tmp_path):
    prepare([corpus], tmp_path / "out")
    before = (tmp_path / "out" / "meta.json").read_text()
    with pytest.raises(DataError, match="already exists"):
        prepare([corpus], tmp_path / "out")
    assert (tmp_path / "out" / "meta.json").read_text() == before


def test_prepare_rejects_bad_inputs(tmp_path):
    (tmp_path / "x.csv").write_text("a,b")
    with pytest.raises(DataError, match="unsupported file type"):
        prepare([tmp_path / "x.csv"], tmp_path / "o")
    with pytest.raises(DataError, match="no such file"):
        prepare([tmp_path / "missing.txt"], tmp_path / "o")
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\nnot json\n')
    with pytest.raises(DataError, match="bad.jsonl:2: not valid JSON"):
        prepare([tmp_path / "bad.jsonl"], tmp_path / "o")
    assert not (tmp_path / "o").exists()


def _prepared(corpus, tmp_path):
    prepare([corpus], tmp_path / "out")
    return tmp_path / "out"


def test_truncated_shard(corpus, tmp_path):
    out = _prepared(corpus, tmp_path)
    shard = out / "shard_00000.bin"
    shard.write_bytes(shard.read_bytes()[:-6])
    with pytest.raises(DataError, match="truncated"):
        TokenData.open(out)


def test_corrupt_shard(corpus, tmp_path):
    out = _prepared(corpus, tmp_path)
    shard = out / "shard_00000.bin"
    raw = bytearray(shard.read_bytes())
    raw[10] ^= 0x01
    shard.write_bytes(bytes(raw))
    with pytest.raises(DataError, match="corrupt"):
        TokenData.open(out)
    TokenData.open(out, verify_checksums=False)  # the check can be switched off


def test_wrong_dtype(corpus, tmp_path):
    out = _prepared(corpus, tmp_path)
    meta = json.loads((out / "meta.json").read_text())
    meta["dtype"] = "uint32"  # the shard holds uint16: sizes no longer match
    (out / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(DataError, match="truncated or has the wrong dtype"):
        TokenData.open(out)
    meta["dtype"] = "float32"
    (out / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(DataError, match="token dtype 'float32' is not supported"):
        TokenData.open(out)


def test_missing_meta(tmp_path):
    with pytest.raises(DataError, match="scaletrain prepare"):
        TokenData.open(tmp_path)


def test_vocabulary_larger_than_model(corpus, tmp_path):
    from scaletrain.train.trainer import Trainer

    prepare([corpus], tmp_path / "bpe", tokenizer="bpe", vocab_size=300)
    cfg = micro_cfg(tmp_path, **{"data.path": str(tmp_path / "bpe")})
    with pytest.raises(DataError, match="set model.vocab_size to at least"):
        Trainer(cfg)


def test_windows_longer_than_data(tmp_path):
    (tmp_path / "s.txt").write_text("short")
    prepare([tmp_path / "s.txt"], tmp_path / "out")
    data = TokenData.open(tmp_path / "out")
    with pytest.raises(DataError, match="too few for one window"):
        WindowDataset(data, seq_len=64)
    with pytest.raises(DataError, match="fewer than one global batch"):
        StepSampler(num_windows=3, global_batch=4, micro_batch=4, grad_accum=1, dp_rank=0, dp_size=1, seed=0)


def test_windows_are_shifted_targets():
    data = TokenData.from_array(np.arange(100, dtype=np.uint16), ByteTokenizer(), "test")
    ds = WindowDataset(data, seq_len=10)
    assert len(ds) == 9
    x, y = ds[[0, 3]]
    assert x[1].tolist() == list(range(30, 40)) and y[1].tolist() == list(range(31, 41))


def test_builtin_text_needs_no_download():
    data = builtin_data()
    assert data.num_tokens > 400_000 and data.vocab_size == 256


@pytest.mark.parametrize("dp,accum", [(2, 1), (4, 2), (3, 1)])
def test_ranks_read_distinct_samples_whose_union_is_the_global_batch(dp, accum):
    micro = 4
    G = micro * accum * dp
    single = StepSampler(1000, G, micro * accum * dp, 1, 0, 1, seed=5)
    ranks = [StepSampler(1000, G, micro, accum, r, dp, seed=5) for r in range(dp)]
    for step in (0, 1, 7, 300):  # 300 crosses into a later epoch
        per_rank = [sum(s.rank_micro_batches(step), []) for s in ranks]
        flat = sum(per_rank, [])
        assert len(set(flat)) == len(flat) == G  # distinct
        assert sorted(flat) == sorted(single.rank_micro_batches(step)[0])  # union = global batch


def test_order_depends_on_seed_and_step_only():
    a = StepSampler(500, 8, 4, 2, 0, 1, seed=1)
    b = StepSampler(500, 8, 4, 2, 0, 1, seed=1, start_step=5)
    it_b = iter(b)
    assert [next(it_b) for _ in range(4)] == a.rank_micro_batches(5) + a.rank_micro_batches(6)
    assert StepSampler(500, 8, 4, 2, 0, 1, seed=2).rank_micro_batches(0) != a.rank_micro_batches(0)


def test_loader_with_workers_yields_the_same_batches():
    data = builtin_data()
    ds = WindowDataset(data, seq_len=64)
    sampler = lambda: StepSampler(len(ds), 8, 4, 2, 0, 1, seed=3)  # noqa: E731
    plain = iter(build_loader(ds, sampler(), num_workers=0, pin_memory=False, prefetch_factor=2))
    workers = iter(build_loader(ds, sampler(), num_workers=2, pin_memory=False, prefetch_factor=2))
    for _ in range(6):
        (x0, y0), (x1, y1) = next(plain), next(workers)
        assert torch.equal(x0, x1) and torch.equal(y0, y1)
        assert x0.shape == (4, 64) and x0.dtype == torch.int64


def test_cli_prepare(corpus, tmp_path):
    r = run_here("prepare", str(corpus), "--out", str(tmp_path / "cli"))
    assert r.returncode == 0, r.stderr
    assert "tokens" in r.stdout and (tmp_path / "cli" / "meta.json").is_file()
    r = run_here("prepare", str(corpus), "--out", str(tmp_path / "cli"))
    assert r.returncode == 2 and "already exists" in r.stderr and "Traceback" not in r.stderr


# --------------------------------------------------------------------------------------------
# A folder of raw text


def test_raw_text_folder_gets_a_prepare_command_that_works(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(20):
        (corpus / f"{i}.txt").write_text(f"document {i}: " + "some plain text to train on. " * 40)
    (tmp_path / "corpus-tokens").mkdir()  # a name already taken: the suggestion avoids it
    r = run_here("train", *MICRO_ARGS, f"--data.path={corpus}", "--train.eval_every=0")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    command = re.search(r"`scaletrain (prepare [^`]+)`", r.stderr).group(1).split()
    data = re.search(r"then train with --data.path=(\S+)", r.stderr).group(1)
    assert command == ["prepare", str(corpus), "--out", str(tmp_path / "corpus-tokens-2")]
    assert data == str(tmp_path / "corpus-tokens-2")
    assert run_here(*command).returncode == 0  # the command as printed
    r = run_here("train", *MICRO_ARGS, f"--data.path={data}", "--train.eval_every=0", "--train.steps=1",
                 f"--log.run_dir={tmp_path / 'run'}")
    assert r.returncode == 0, r.stderr


# --------------------------------------------------------------------------------------------
# Bad input


def flip_byte(d: Path) -> None:
    p = d / "data" / "shard_00000.bin"
    raw = bytearray(p.read_bytes())
    raw[100] ^= 1
    p.write_bytes(bytes(raw))


def token_outside_vocab(d: Path) -> None:
    """A shard with token id 300 (byte vocabulary: 256) and a matching checksum."""
    p = d / "data" / "shard_00000.bin"
    tokens = np.fromfile(p, dtype=np.uint16)
    tokens[5] = 300
    p.write_bytes(tokens.tobytes())
    edit_json("data/meta.json", lambda m: m["shards"][0].update(sha256=hashlib.sha256(tokens.tobytes()).hexdigest()))(d)


BAD_INPUT = [
    # ---- data folders
    Case("data-missing", train_args(data="nodata"), ("nodata: no meta.json", "scaletrain prepare")),
    Case("data-empty-folder", train_args(data="empty"), ("empty: no meta.json",), lambda d: (d / "empty").mkdir()),
    Case("data-shard-truncated", train_args(),
         ("shard is truncated or has the wrong dtype", "re-run scaletrain prepare"),
         truncate("data/shard_00000.bin", 30)),
    Case("data-shard-missing", train_args(), ("shard_00000.bin: shard listed in meta.json is missing",),
         lambda d: (d / "data" / "shard_00000.bin").unlink()),
    Case("data-meta-corrupt", train_args(), ("meta.json: not valid JSON", "re-run scaletrain prepare"),
         write("data/meta.json", "{not json")),
    Case("data-meta-not-an-object", train_args(),
         ("not a scaletrain token folder",), write("data/meta.json", "[1, 2]")),
    Case("data-checksum-mismatch", train_args(), ("shard is corrupt (its sha256 differs",), flip_byte),
    Case("data-dtype-float32", train_args(), ("token dtype 'float32' is not supported", "uint16, uint32"),
         edit_json("data/meta.json", lambda m: m.update(dtype="float32"))),
    Case("data-dtype-uint32", train_args(), ("wrong dtype", "tokens of uint32"),
         edit_json("data/meta.json", lambda m: m.update(dtype="uint32"))),
    Case("data-foreign-format", train_args(), ("not a scaletrain token folder (format 'other')",),
         edit_json("data/meta.json", lambda m: m.update(format="other"))),
    Case("data-no-shards", train_args(),
         ("lists no shards",), edit_json("data/meta.json", lambda m: m.update(shards=[]))),
    Case("data-shard-entry-broken", train_args(), ("needs a file name and a token count",),
         edit_json("data/meta.json", lambda m: m["shards"][0].pop("file"))),
    Case("data-shard-outside-folder", train_args(), ("shard file '../data/shard_00000.bin' is not a plain file name",),
         edit_json("data/meta.json", lambda m: m["shards"][0].update(file="../data/shard_00000.bin"))),
    Case("data-tokenizer-outside-folder", train_args(),
         ("tokenizer file '/etc/passwd' in the metadata is not a plain",),
         edit_json("data/meta.json", lambda m: m.update(tokenizer={"kind": "file", "file": "/etc/passwd"}))),
    Case("data-token-outside-vocab", train_args(), ("holds token id 300", "256-token vocabulary"), token_outside_vocab),
    Case("data-tokenizer-unknown", train_args(), ("unknown tokenizer kind 'sentencepiece'",),
         edit_json("data/meta.json", lambda m: m.update(tokenizer={"kind": "sentencepiece"}))),
    Case("vocab-larger-than-model", train_args("--model.vocab_size=100"),
         ("the tokenizer has 256 tokens but model.vocab_size=100", "at least 256")),
    Case("seq-len-longer-than-data", train_args(data="tiny"),
         ("too few for one window of data.seq_len=32", "lower data.seq_len")),
    # ---- prepare
    Case("prepare-missing-input", ["prepare", "nope.txt", "--out", "o"], ("nope.txt: no such file or folder",)),
    Case("prepare-unsupported-extension", ["prepare", "x.csv", "--out", "o"], ("unsupported file type '.csv'",),
         write("x.csv", "a,b")),
    Case("prepare-folder-without-text", ["prepare", "empty", "--out", "o"], ("no .txt, .jsonl or .parquet files",),
         lambda d: (d / "empty").mkdir()),
    Case("prepare-over-existing-data", ["prepare", "t.txt", "--out", "data"],
         ("data already exists and is not empty", "nothing was changed"), write("t.txt", "hello")),
    Case("prepare-out-is-a-file", ["prepare", "t.txt", "--out", "t.txt"],
         ("t.txt is a file",), write("t.txt", "hello")),
    Case("prepare-jsonl-corrupt", ["prepare", "t.jsonl", "--out", "o"], ("t.jsonl:1: not valid JSON",),
         write("t.jsonl", "{bad\n")),
    Case("prepare-jsonl-without-text", ["prepare", "t.jsonl", "--out", "o"], ("set --text-key",),
         write("t.jsonl", '{"body": "x"}\n')),
    Case("prepare-bpe-vocab-too-small", ["prepare", "t.txt", "--out", "o", "--tokenizer", "bpe", "--vocab-size", "100"],
         ("--vocab-size 100 is too small for BPE",), write("t.txt", "hello")),
    Case("prepare-tokenizer-file-missing", ["prepare", "t.txt", "--out", "o", "--tokenizer", "file"],
         ("--tokenizer file needs --tokenizer-file",), write("t.txt", "hello")),
    Case("prepare-shard-tokens-zero", ["prepare", "t.txt", "--out", "o", "--shard-tokens", "0"],
         ("--shard-tokens must be at least 1",), write("t.txt", "hello")),
    Case("prepare-parquet-garbage", ["prepare", "t.parquet", "--out", "o"],
         ("t.parquet:",), write("t.parquet", "hello")),
]


@pytest.mark.parametrize("case", BAD_INPUT, ids=[c.id for c in BAD_INPUT])
def test_bad_input_gives_one_clear_line(case: Case, workdir: Path, capsys):
    assert_one_clear_line(case, workdir, capsys)


# --------------------------------------------------------------------------------------------------
# From test_data_faults.py (merged here):
#
# Faults in data files are reported (file, place, fix), never passed over.

SHORT_TEXT = "The quick brown fox jumps over the lazy dog. " * 20


def one_line(err: pytest.ExceptionInfo) -> str:
    assert len(err.value.lines) == 1 and "\n" not in str(err.value)
    return str(err.value)


# 1. decoding errors are reported, not replaced

def test_invalid_utf8_in_txt_names_file_byte_and_fix(tmp_path):
    f = tmp_path / "latin1.txt"
    f.write_bytes(b"first line\ncaf\xe9 au lait\n")  # Latin-1 e-acute: not UTF-8
    with pytest.raises(DataError) as err:
        prepare([f], tmp_path / "out")
    msg = one_line(err)
    assert str(f) in msg and "invalid UTF-8 at byte 14 (line 2)" in msg and "re-encode the file as UTF-8" in msg
    assert not (tmp_path / "out").exists()


def test_invalid_utf8_in_jsonl_names_file_line_and_fix(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_bytes(b'{"text": "ok"}\n{"text": "bad \xff byte"}\n')
    with pytest.raises(DataError) as err:
        prepare([f], tmp_path / "out")
    msg = one_line(err)
    assert f"{f}:2: invalid UTF-8 at byte 29 of the file (column 15)" in msg and "re-encode the file as UTF-8" in msg


def test_invalid_utf8_is_reported_while_training_bpe(tmp_path):
    # the BPE trainer reads the documents itself: the error must come through it unchanged
    f = tmp_path / "a.txt"
    f.write_bytes(b"hello world\ncaf\xe9\n")
    with pytest.raises(DataError, match=r"a.txt: invalid UTF-8 at byte 15 \(line 2\)"):
        prepare([f], tmp_path / "out", tokenizer="bpe", vocab_size=300)
    assert not (tmp_path / "out").exists()


def test_valid_utf8_and_crlf_still_prepare(tmp_path):
    (tmp_path / "a.txt").write_bytes("caf\u00e9\r\nna\u00efve\r\n".encode())
    prepare([tmp_path / "a.txt"], tmp_path / "out")
    data = TokenData.open(tmp_path / "out")
    assert ByteTokenizer().decode(data.read(0, data.num_tokens)) == "caf\u00e9\nna\u00efve\n\n\n"


def test_malformed_json_line_names_file_and_line(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text('{"text": "one"}\n\n{"text": "two",}\n')
    with pytest.raises(DataError) as err:
        prepare([f], tmp_path / "out")
    assert f"{f}:3: not valid JSON" in one_line(err)


def test_cli_reports_bad_utf8_in_one_line_with_exit_2(tmp_path):
    f = tmp_path / "bad.txt"
    f.write_bytes(b"\x80abc")
    r = run_here("prepare", str(f), "--out", str(tmp_path / "out"))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [
        f"scaletrain: error: {f}: invalid UTF-8 at byte 0 (line 1): b'\\x80' (invalid start byte); "
        "re-encode the file as UTF-8 (e.g. iconv -f LATIN1 -t UTF-8) or remove it from the inputs"]


# 2. empty or degenerate tokenization

@pytest.mark.parametrize("name,content,found", [
    ("empty.txt", "", "1 document(s), all empty or whitespace;"),
    ("blank.txt", " \n\t\n  ", "1 document(s), all empty or whitespace;"),
    ("empty.jsonl", '{"text": ""}\n{"text": "   "}\n', "2 document(s), all empty or whitespace in field 'text';"),
    ("nolines.jsonl", "\n\n", "no documents in field 'text';"),
])
def test_inputs_without_text_are_an_error_at_prepare(tmp_path, name, content, found):
    (tmp_path / name).write_text(content)
    with pytest.raises(DataError) as err:
        prepare([tmp_path / name], tmp_path / "out")
    msg = one_line(err)
    assert msg.startswith(f"no text to tokenize in {tmp_path / name}: {found}") and "nothing was written" in msg
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.partial-*"))


def test_bpe_on_empty_input_is_an_error(tmp_path):
    (tmp_path / "e.txt").write_text("\n")
    with pytest.raises(DataError, match="no text to tokenize"):
        prepare([tmp_path / "e.txt"], tmp_path / "out", tokenizer="bpe", vocab_size=300)


def test_too_few_tokens_for_one_window_says_how_many(tmp_path):
    (tmp_path / "s.txt").write_text("tiny")  # 4 bytes + 2 separator tokens
    prepare([tmp_path / "s.txt"], tmp_path / "out")
    data = open_data(str(tmp_path / "out"))
    assert data.num_tokens == 6
    with pytest.raises(DataError) as err:
        WindowDataset(data, seq_len=8)
    assert one_line(err) == (f"{tmp_path / 'out'}: 6 tokens are too few for one window of data.seq_len=8, which "
                             "needs 9 (the inputs and the target shifted by one); lower data.seq_len to at most 5 "
                             "or add data")
    assert len(WindowDataset(data, seq_len=5)) == 1  # exactly seq_len + 1 tokens make one window


def test_shard_with_no_tokens_in_metadata_is_an_error(tmp_path):
    (tmp_path / "a.txt").write_text(SHORT_TEXT)
    prepare([tmp_path / "a.txt"], tmp_path / "out")
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    meta["shards"].append({"file": "shard_00001.bin", "num_tokens": 0})
    (tmp_path / "out" / "shard_00001.bin").write_bytes(b"")
    (tmp_path / "out" / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(DataError, match="shard 'shard_00001.bin' has 0 tokens"):
        TokenData.open(tmp_path / "out")


# 3. out-of-vocabulary ids are caught with or without checksums

@pytest.fixture
def prepared(tmp_path):
    (tmp_path / "a.txt").write_text(SHORT_TEXT)
    prepare([tmp_path / "a.txt"], tmp_path / "out", shard_tokens=400)
    return tmp_path / "out"


def poke(shard, index: int, value: int) -> None:
    ids = np.fromfile(shard, dtype=np.uint16)
    ids[index] = value
    ids.tofile(shard)


@pytest.mark.parametrize("verify", [True, False])
def test_token_id_outside_vocabulary_is_caught_with_or_without_checksums(prepared, verify):
    shard = prepared / "shard_00001.bin"
    poke(shard, 123, 300)
    meta = json.loads((prepared / "meta.json").read_text())
    for s in meta["shards"]:
        s.pop("sha256")  # with no checksums recorded, only the vocabulary check can see it
    (prepared / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(DataError) as err:
        TokenData.open(prepared, verify_checksums=verify)
    assert one_line(err) == (f"{shard}: holds token id 300 (token 123), outside the tokenizer's 256-token "
                             "vocabulary; the shard is corrupt or from another tokenizer: re-run scaletrain prepare")


def test_checksums_off_still_checks_vocabulary_but_not_digest(prepared):
    shard = prepared / "shard_00000.bin"
    poke(shard, 7, 65)  # in the vocabulary, but not what was written
    with pytest.raises(DataError, match="sha256 differs"):
        TokenData.open(prepared)
    TokenData.open(prepared, verify_checksums=False)  # no digest check: opens
    poke(shard, 7, 256)
    with pytest.raises(DataError,
                       match=r"holds token id 256 \(token 7\), outside the tokenizer's 256-token vocabulary"):
        TokenData.open(prepared, verify_checksums=False)


def test_oov_check_spans_chunks(prepared, monkeypatch):
    from scaletrain.data import dataset

    monkeypatch.setattr(dataset, "_CHUNK_BYTES", 64)  # 32 tokens a chunk: the bad id is in the 7th
    poke(prepared / "shard_00000.bin", 200, 999)
    with pytest.raises(DataError, match=r"holds token id 999 \(token 200\)"):
        TokenData.open(prepared, verify_checksums=False)


def test_in_memory_tokens_outside_vocabulary(tmp_path):
    with pytest.raises(DataError, match="mem: holds token id 256, outside the tokenizer's 256-token vocabulary"):
        TokenData.from_array(np.array([1, 256, 3], dtype=np.uint16), ByteTokenizer(), "mem")


# 4. a shard longer than its metadata says

def test_appended_shard_is_longer_than_metadata(prepared):
    shard = prepared / "shard_00000.bin"
    with shard.open("ab") as f:
        f.write(np.array([65, 66], dtype=np.uint16).tobytes())
    for verify in (True, False):
        with pytest.raises(DataError) as err:
            TokenData.open(prepared, verify_checksums=verify)
        msg = one_line(err)
        assert "shard is longer than meta.json records, 804 bytes against 400 tokens of uint16 (800 bytes)" in msg
        assert "appended" in msg and "shorter" not in msg


def test_truncated_shard_is_shorter_than_metadata(prepared):
    shard = prepared / "shard_00000.bin"
    shard.write_bytes(shard.read_bytes()[:-6])
    with pytest.raises(DataError) as err:
        TokenData.open(prepared)
    msg = one_line(err)
    assert "shorter than meta.json records, 794 bytes against 400 tokens of uint16 (800 bytes)" in msg
    assert "longer" not in msg


# 5. the data fingerprint

def test_fingerprint_is_stable_across_opens_and_moves(prepared, tmp_path):
    fp = TokenData.open(prepared).fingerprint
    assert isinstance(fp, str) and len(fp) == 16 and int(fp, 16) >= 0
    assert TokenData.open(prepared, verify_checksums=False).fingerprint == fp
    moved = prepared.rename(tmp_path / "elsewhere")
    assert TokenData.open(moved).fingerprint == fp
    # the same input prepared again gives the same tokens, hence the same fingerprint
    prepare([tmp_path / "a.txt"], tmp_path / "again", shard_tokens=400)
    assert TokenData.open(tmp_path / "again").fingerprint == fp


def test_fingerprint_changes_with_content_or_metadata(prepared, tmp_path):
    fp = TokenData.open(prepared).fingerprint
    # other text: other tokens, other checksums
    (tmp_path / "b.txt").write_text(SHORT_TEXT.replace("fox", "cat"))
    prepare([tmp_path / "b.txt"], tmp_path / "other", shard_tokens=400)
    assert TokenData.open(tmp_path / "other").fingerprint != fp
    # the same text cut into other shards
    prepare([tmp_path / "a.txt"], tmp_path / "resharded", shard_tokens=300)
    assert TokenData.open(tmp_path / "resharded").fingerprint != fp
    # a recorded checksum edited in meta.json (opened without checking it)
    meta = json.loads((prepared / "meta.json").read_text())
    meta["shards"][1]["sha256"] = "0" * 64
    (prepared / "meta.json").write_text(json.dumps(meta))
    assert TokenData.open(prepared, verify_checksums=False).fingerprint != fp
    # a shard edited in place near its start, checksums recorded nowhere
    meta["shards"][1].pop("sha256")
    (prepared / "meta.json").write_text(json.dumps(meta))
    before = TokenData.open(prepared, verify_checksums=False).fingerprint
    poke(prepared / "shard_00001.bin", 0, 33)
    assert TokenData.open(prepared, verify_checksums=False).fingerprint != before


def test_in_memory_fingerprint_hashes_the_tokens():
    tok = ByteTokenizer()
    a = TokenData.from_array(np.arange(200, dtype=np.uint16), tok, "a")
    assert TokenData.from_array(np.arange(200, dtype=np.uint16), tok, "b").fingerprint == a.fingerprint
    changed = np.arange(200, dtype=np.uint16)
    changed[150] = 0
    assert TokenData.from_array(changed, tok, "a").fingerprint != a.fingerprint
    assert len(a.fingerprint) == 16
