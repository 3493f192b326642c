"""Faults in data files are reported (file, place, fix), never passed over."""

from __future__ import annotations

import json

import numpy as np
import pytest

from scaletrain.data import TokenData, WindowDataset, open_data, prepare
from scaletrain.data.tokenizer import ByteTokenizer
from scaletrain.errors import DataError

from conftest import run_cli

TEXT = "The quick brown fox jumps over the lazy dog. " * 20


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
    r = run_cli("prepare", str(f), "--out", str(tmp_path / "out"))
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
    (tmp_path / "a.txt").write_text(TEXT)
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
    (tmp_path / "a.txt").write_text(TEXT)
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
    (tmp_path / "b.txt").write_text(TEXT.replace("fox", "cat"))
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
