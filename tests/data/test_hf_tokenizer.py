"""`scaletrain prepare --tokenizer HF_FOLDER` and `model.vocab_size = 0` (issue 12).

A tiny fast tokenizer is trained here and saved by transformers as a model folder; the shards
must hold exactly the ids `AutoTokenizer.from_pretrained(folder)` gives, documents separated by
EOS, and a run with `model.vocab_size = 0` takes the model's (padded) vocabulary from the data.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
tk = pytest.importorskip("tokenizers")

from scaletrain.config import from_dict  # noqa: E402
from scaletrain.data import open_data, prepare  # noqa: E402
from scaletrain.errors import ConfigError, DataError  # noqa: E402

from conftest import micro_cfg, run_here  # noqa: E402

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex ü café".split()
DOCS = [" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(5 + i % 9)) for i in range(120)]
DOCS[3] = "Ünïcode, digits 12345 and  double  spaces\nand a newline"


def make_hf_folder(folder: Path, variant: str = "bos", chat_template: str | None = None) -> Path:
    """A model folder as transformers saves it: tokenizer.json + tokenizer_config.json (with
    `chat_template` when given), and a config.json whose vocab_size is larger than the tokenizer's
    (padding rows).

    bos: tokenizer.json's post-processor adds <s>
    bos-eos: it adds <s> and </s>: encoding already ends each document
    config-only: tokenizer.json adds nothing; tokenizer_config.json says add_bos_token (which
        transformers ignores beside a tokenizer.json) and names a <pad> the vocabulary lacks
    no-special: <s> and </s> exist but nothing adds them"""
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"], show_progress=False,
                                     initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(DOCS, trainer=trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                add_bos_token=variant.startswith("bos"),
                                                add_eos_token=variant == "bos-eos")
    fast.save_pretrained(folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    if variant == "config-only":
        config.update(add_bos_token=True, pad_token="<pad>")
    if chat_template is not None:
        config["chat_template"] = chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": len(fast) + 20}))
    return folder


def write_docs(path: Path, docs=DOCS) -> Path:
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return path


def shard_ids(folder: Path) -> list[int]:
    meta = json.loads((folder / "meta.json").read_text())
    return [int(i) for s in meta["shards"] for i in np.fromfile(folder / s["file"], dtype=meta["dtype"])]


@pytest.mark.parametrize("variant", ["bos", "bos-eos", "config-only", "no-special"])
def test_prepare_encodes_like_autotokenizer(tmp_path, variant):
    hf = make_hf_folder(tmp_path / "hf", variant)
    auto = transformers.AutoTokenizer.from_pretrained(hf)
    eos, bos = auto.convert_tokens_to_ids("</s>"), auto.convert_tokens_to_ids("<s>")
    meta = prepare([write_docs(tmp_path / "docs.jsonl")], tmp_path / "data", tokenizer=hf, shard_tokens=500)

    expected = []
    for doc in DOCS:
        ids = auto(doc)["input_ids"]
        expected += ids if ids[-1:] == [eos] else ids + [eos]  # EOS separates documents, never twice
    assert shard_ids(tmp_path / "data") == expected
    assert len(meta["shards"]) > 1  # documents cross shard borders unchanged
    # the variants differ where they should: BOS leads a document only where tokenizer.json adds it
    assert (auto(DOCS[0])["input_ids"][0] == bos) == variant.startswith("bos")
    assert expected.count(eos) == len(DOCS)

    described = meta["tokenizer"]
    assert described["kind"] == "hf" and described["vocab_size"] == len(auto)
    assert described["model_vocab_size"] == json.loads((hf / "config.json").read_text())["vocab_size"] > len(auto)
    assert meta["dtype"] == "uint16"
    for name in described["files"]:  # the data folder is self-contained: the files, byte for byte
        assert (tmp_path / "data" / name).read_bytes() == (hf / name).read_bytes()
    assert set(described["files"]) == {"tokenizer.json", "tokenizer_config.json"}
    # the folder opens on its own and decodes with the copied tokenizer
    data = open_data(tmp_path / "data")
    assert data.vocab_size == len(auto)
    assert data.tokenizer.decode(auto(DOCS[3])["input_ids"]) == DOCS[3]


def test_large_vocabulary_uses_uint32(tmp_path):
    words = [f"w{i}" for i in range(70_000)]
    tok = tk.Tokenizer(tk.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0"))
    tok.pre_tokenizer = tk.pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="w69999").save_pretrained(tmp_path / "hf")
    (tmp_path / "t.txt").write_text("w1 w65536 w69998")
    meta = prepare([tmp_path / "t.txt"], tmp_path / "data", tokenizer=tmp_path / "hf")
    assert meta["dtype"] == "uint32" and meta["tokenizer"]["vocab_size"] == 70_000
    assert "model_vocab_size" not in meta["tokenizer"]  # no config.json: the tokenizer's vocabulary is the model's
    assert shard_ids(tmp_path / "data") == [1, 65536, 69998, 69999]


def test_vocab_size_zero_trains_with_the_models_vocabulary_and_exports_its_tokenizer(tmp_path):
    from scaletrain.train.trainer import Trainer
    from scaletrain.trained.export_hf import export_hf

    hf = make_hf_folder(tmp_path / "hf")
    auto = transformers.AutoTokenizer.from_pretrained(hf)
    prepare([write_docs(tmp_path / "docs.jsonl", DOCS * 3)], tmp_path / "data", tokenizer=hf)
    cfg = micro_cfg(tmp_path, **{"model.vocab_size": "0", "data.path": str(tmp_path / "data"),
                                 "data.seq_len": 16, "train.steps": 3, "checkpoint.save_final": True})
    assert cfg.model.vocab_size == len(auto) + 20  # config.json's, padding rows included
    result = Trainer(cfg).fit()
    assert result["step"] == 3

    out = export_hf(next((tmp_path / "run" / "checkpoints").glob("step_*")), tmp_path / "export")
    config = json.loads((out / "config.json").read_text())
    assert config["vocab_size"] == len(auto) + 20
    assert (config["bos_token_id"], config["eos_token_id"]) == (auto.bos_token_id, auto.eos_token_id)
    back = transformers.AutoTokenizer.from_pretrained(out)
    for doc in DOCS[:10]:
        assert back(doc)["input_ids"] == auto(doc)["input_ids"]
    assert back.model_max_length == cfg.model.max_seq_len


def test_vocab_size_zero_resolution(tmp_path):
    assert from_dict({"model": {"vocab_size": 0}}).model.vocab_size == 256  # built-in data: byte-level
    prepare([write_docs(tmp_path / "docs.jsonl")], tmp_path / "bytes")
    assert from_dict({"model": {"vocab_size": 0}, "data": {"path": str(tmp_path / "bytes")}}).model.vocab_size == 256
    # an explicit vocabulary always wins
    assert from_dict({"model": {"vocab_size": 300}, "data": {"path": str(tmp_path / "bytes")}}).model.vocab_size == 300
    with pytest.raises(ConfigError) as e:
        from_dict({"data": {"path": str(tmp_path / "missing")}}, ["--model.vocab_size=0"])
    assert len(e.value.lines) == 1
    assert "model.vocab_size=0" in e.value.lines[0] and "meta.json does not exist" in e.value.lines[0]
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "meta.json").write_text("{")
    with pytest.raises(ConfigError, match="records no tokenizer vocabulary"):
        from_dict({"model": {"vocab_size": 0}, "data": {"path": str(tmp_path / "broken")}})


def test_cli_prepare_with_model_folder(tmp_path):
    hf = make_hf_folder(tmp_path / "hf")
    r = run_here("prepare", str(write_docs(tmp_path / "docs.jsonl")), "--out", str(tmp_path / "data"),
                "--tokenizer", str(hf))
    assert r.returncode == 0, r.stderr
    meta = json.loads((tmp_path / "data" / "meta.json").read_text())
    assert meta["tokenizer"]["kind"] == "hf"
    assert f"vocabulary {meta['tokenizer']['vocab_size']}, {meta['tokenizer']['model_vocab_size']} in the model" \
        in r.stdout


def test_cli_folder_without_tokenizer_json_is_one_line(tmp_path):
    (tmp_path / "slow").mkdir()
    (tmp_path / "slow" / "tokenizer.model").write_bytes(b"\x00sentencepiece")
    (tmp_path / "slow" / "tokenizer_config.json").write_text("{}")
    (tmp_path / "t.txt").write_text("hello")
    r = run_here("prepare", str(tmp_path / "t.txt"), "--out", str(tmp_path / "data"), "--tokenizer",
                str(tmp_path / "slow"))
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr
    assert "no tokenizer.json" in lines[0] and "tokenizer.model" in lines[0] and "save_pretrained" in lines[0]
    assert not (tmp_path / "data").exists()


def test_bad_tokenizer_arguments(tmp_path):
    (tmp_path / "t.txt").write_text("hello")
    with pytest.raises(DataError, match="neither byte, bpe nor file, and no such folder"):
        prepare([tmp_path / "t.txt"], tmp_path / "a", tokenizer="sentencepiece")
    hf = make_hf_folder(tmp_path / "hf")
    with pytest.raises(DataError, match="is a file; give its Hugging Face model folder"):
        prepare([tmp_path / "t.txt"], tmp_path / "b", tokenizer=hf / "tokenizer.json")
    (hf / "config.json").write_text(json.dumps({"vocab_size": "big"}))
    with pytest.raises(DataError, match="vocab_size 'big' is not an integer"):
        prepare([tmp_path / "t.txt"], tmp_path / "c", tokenizer=hf)


def test_lost_tokenizer_config_is_refused(tmp_path):
    """Without tokenizer_config.json the vocabulary could change (no <pad>): opening says so."""
    hf = make_hf_folder(tmp_path / "hf", "config-only")
    prepare([write_docs(tmp_path / "docs.jsonl")], tmp_path / "data", tokenizer=hf)
    (tmp_path / "data" / "tokenizer_config.json").unlink()
    with pytest.raises(DataError, match="tokenizer_config.json: the tokenizer file named in the metadata is missing"):
        open_data(tmp_path / "data")
