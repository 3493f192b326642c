"""Preference data (prepare --preference, issue 49 #2): TRL's pair and KTO rows, as text or conversations,
become prompt and completion ids whose completion mask covers exactly the completion's tokens (checked
against a hand tokenization with the byte tokenizer); truncation cuts prompts from the left and completions
from the right to the exact ids; dropped and identical rows are counted and said; bad rows are one line,
exit 2, and nothing is written; the collate keeps a pair's two sequences together."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from scaletrain.data import prepare
from scaletrain.data.dataset import IGNORE_INDEX, TokenData
from scaletrain.data.preference_dataset import PreferenceData, collate_preference
from scaletrain.errors import DataError

from conftest import one_line_exit_2, run_here

END = b"\n\n"  # what ends a text completion with the byte tokenizer (it has no EOS): its document separator


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def as_bytes(t: torch.Tensor) -> bytes:
    return bytes(t.tolist())


def decoded(data: PreferenceData) -> list[list[tuple[bytes, bytes]]]:
    """Per example, per sequence: (the whole sequence, its masked part), as bytes."""
    return [[(as_bytes(s), as_bytes(s[m])) for s, m in zip(ex.sequences, ex.masks)] for ex in data]


def turns(*pairs) -> list[dict]:
    return [{"role": r, "content": c} for r, c in pairs]


# --------------------------------------------------------------------------------------------
# What is written


def test_text_pairs_mask_exactly_the_completion_tokens(tmp_path):
    rows = [{"prompt": "What is 2+2?", "chosen": " 4", "rejected": " five, surely"},
            {"prompt": "Say hi in French:", "chosen": " salut", "rejected": " hallo"},
            {"prompt": "", "chosen": "café au lait", "rejected": "tea"}]  # an empty prompt is allowed
    meta = prepare([write_jsonl(tmp_path / "p.jsonl", rows)], tmp_path / "out", preference="pairs")
    assert meta["format"] == "scaletrain.preference" and meta["preference"]["kind"] == "pairs"
    assert meta["num_documents"] == 3 and meta["preference"]["rows_read"] == 3
    data = PreferenceData.open(tmp_path / "out")
    assert len(data) == 3
    for row, ex in zip(rows, decoded(data)):
        prompt = row["prompt"].encode()
        assert ex == [(prompt + row[k].encode() + END, row[k].encode() + END) for k in ("chosen", "rejected")]
    # the index's lengths: prompt, chosen, rejected (bytes; "é" is two)
    assert data.index.tolist() == [[12, 4, 15], [17, 8, 8], [0, 15, 5]]
    assert data.tokens.num_tokens == meta["num_tokens"] == 12 + 4 + 15 + 17 + 8 + 8 + 15 + 5


def test_implicit_prompt_is_the_shared_start_as_trl_extracts_it(tmp_path):
    rows = [{"chosen": "The sky is blue.", "rejected": "The sky is green."},
            {"chosen": turns(("user", "hi"), ("assistant", "hello")),
             "rejected": turns(("user", "hi"), ("assistant", "go away"))}]
    prepare([write_jsonl(tmp_path / "p.jsonl", rows)], tmp_path / "out", preference="auto", chat_format="plain")
    text, chat = decoded(PreferenceData.open(tmp_path / "out"))
    # the space before the first differing word starts the completions (TRL's extract_prompt)
    assert text == [(b"The sky is blue." + END, b" blue." + END), (b"The sky is green." + END, b" green." + END)]
    assert chat == [(b"User: hi\nAssistant: hello\n", b"hello\n"), (b"User: hi\nAssistant: go away\n", b"go away\n")]
    # the same conversation with its prompt given explicitly is the same example
    explicit = {"prompt": turns(("user", "hi")), "chosen": turns(("assistant", "hello")),
                "rejected": turns(("assistant", "go away"))}
    prepare([write_jsonl(tmp_path / "e.jsonl", [explicit])], tmp_path / "e", preference="pairs", chat_format="plain")
    assert decoded(PreferenceData.open(tmp_path / "e")) == [chat]


def test_conversations_are_rendered_with_the_tokenizers_chat_template(tmp_path):
    transformers = pytest.importorskip("transformers")
    from test_hf_tokenizer import make_hf_folder

    hf = make_hf_folder(tmp_path / "hf", "no-special",
                        chat_template=("{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
                                       "{% if add_generation_prompt %}<s>assistant\n{% endif %}"))
    prompt = turns(("system", "be brief"), ("user", "the quick fox"))
    rows = [{"prompt": prompt, "chosen": turns(("assistant", "jumps over")), "rejected": turns(("assistant", "naps"))}]
    meta = prepare([write_jsonl(tmp_path / "p.jsonl", rows)], tmp_path / "out", tokenizer=str(hf),
                   preference="pairs")  # conversations: the template by default
    assert meta["preference"]["chat_format"] == "template" and meta["preference"]["conversational_rows"] == 1
    ex = PreferenceData.open(tmp_path / "out")[0]
    auto = transformers.AutoTokenizer.from_pretrained(hf)
    before = auto.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    for seq, mask, answer in zip(ex.sequences, ex.masks, ("jumps over", "naps")):
        # prompt and completion tokenized apart, as TRL does: the prompt's ids, then the completion's
        assert seq[~mask].tolist() == auto(before, add_special_tokens=False)["input_ids"]
        assert auto.decode(seq[mask].tolist()) == f"{answer}</s>\n"  # the end-of-turn marker is trained on


def test_unpaired_rows_keep_their_label(tmp_path):
    rows = [{"prompt": "2+2=", "completion": "4", "label": True}, {"prompt": "2+2=", "completion": "5", "label": False},
            {"prompt": turns(("user", "hi")), "completion": turns(("assistant", "hey")), "label": True}]
    meta = prepare([write_jsonl(tmp_path / "k.jsonl", rows)], tmp_path / "out", preference="auto", chat_format="plain")
    assert meta["preference"]["kind"] == "unpaired" and meta["preference"]["desirable"] == 2
    data = PreferenceData.open(tmp_path / "out")
    assert [ex.label for ex in data] == [True, False, True]
    assert decoded(data) == [[(b"2+2=4" + END, b"4" + END)], [(b"2+2=5" + END, b"5" + END)],
                             [(b"User: hi\nAssistant: hey\n", b"hey\n")]]
    batch = collate_preference(list(data))
    assert batch.label.tolist() == [True, False, True] and batch.chosen is None
    assert batch.pair_index.tolist() == [0, 1, 2]


def test_parquet_rows_and_a_validation_split(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = [{"prompt": f"question {i}:", "chosen": f" good {i}", "rejected": f" bad {i}"} for i in range(40)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "p.parquet")
    meta = prepare([tmp_path / "p.parquet"], tmp_path / "out", preference="pairs", val_fraction=0.3)
    train, val = PreferenceData.open(tmp_path / "out"), PreferenceData.open(tmp_path / "out", split="val")
    assert len(train) + len(val) == 40 and len(train) > 0 and len(val) > 0
    assert meta["num_val_documents"] == len(val)
    seen = sorted(as_bytes(ex.sequences[0]) for ex in [*train, *val])
    assert seen == sorted(f"question {i}: good {i}".encode() + END for i in range(40))


# --------------------------------------------------------------------------------------------
# Truncation, and what is dropped


def test_truncation_cuts_prompts_from_the_left_and_completions_from_the_right(tmp_path):
    rows = [{"prompt": "abcdefgh", "chosen": "xyz12", "rejected": "uv"},
            {"prompt": "ab", "chosen": "klmnopq", "rejected": "rs"}]
    prepare([write_jsonl(tmp_path / "p.jsonl", rows)], tmp_path / "out", preference="pairs",
            max_prompt_tokens=4, max_length=7)
    first, second = decoded(PreferenceData.open(tmp_path / "out"))
    # prompt: its last 4 tokens; each completion: its first 7 - 4
    assert first == [(b"efghxyz", b"xyz"), (b"efghuv\n", b"uv\n")]
    # a short prompt is kept whole, and leaves its completions more room
    assert second == [(b"abklmno", b"klmno"), (b"abrs\n\n", b"rs\n\n")]
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())["preference"]
    assert (meta["prompts_truncated"], meta["completions_truncated"], meta["dropped_no_completion"]) == (1, 2, 0)


def test_rows_without_a_completion_token_and_identical_pairs_are_dropped_counted_and_said(tmp_path):
    rows = [{"prompt": "0123456789", "chosen": "yes", "rejected": "no"},   # the prompt fills --max-length
            {"prompt": "ok", "chosen": "yes", "rejected": "no"},
            {"prompt": "ok", "chosen": "same", "rejected": "same"},         # identical: teaches nothing
            {"prompt": "long one", "chosen": "yes", "rejected": "no"},      # no room left for a completion
            {"prompt": "", "chosen": "y", "rejected": "n"},                 # the first token has nothing before it
            {"prompt": "ok", "chosen": "yes indeed", "rejected": "no"}]     # cut, and kept
    src = write_jsonl(tmp_path / "p.jsonl", rows)
    r = run_here("prepare", str(src), "--out", str(tmp_path / "out"), "--preference", "--max-length", "8",
                 "--quiet")
    assert r.returncode == 0, r.stderr
    assert r.stderr.splitlines() == [
        f"scaletrain: prepare: 2 row(s) dropped, no completion token left to train on (first: {src}:1); raise "
        "--max-length or lower --max-prompt-tokens",
        f"scaletrain: prepare: warning: 1 pair(s) dropped whose chosen and rejected are the same tokens (first: "
        f"{src}:3): they teach nothing; fix or remove them",
        "scaletrain: prepare: truncated 1 row(s)' completions from the right (--max-length 8); 3 of 6 row(s) kept"]
    assert r.stdout.splitlines() == [f"wrote 3 preference pairs (29 tokens, uint16, 1 shard(s), vocabulary 256) to "
                                     f"{tmp_path / 'out'}; 3 of 6 row(s) dropped"]
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())["preference"]
    assert (meta["dropped_no_completion"], meta["dropped_identical"], meta["completions_truncated"]) == (2, 1, 1)
    # an empty prompt: the completion's second token on is trained on (the first has nothing to predict it)
    kept = decoded(PreferenceData.open(tmp_path / "out"))
    assert kept[1:] == [[(b"y\n\n", b"y\n\n"), (b"n\n\n", b"n\n\n")],
                        [(b"okyes in", b"yes in"), (b"okno\n\n", b"no\n\n")]]
    assert collate_preference([PreferenceData.open(tmp_path / "out")[1]]).completion_mask.sum(1).tolist() == [2, 2]


# --------------------------------------------------------------------------------------------
# Bad input: one line, exit 2, nothing written


@pytest.mark.parametrize("row, message", [
    ({"prompt": "q", "chosen": "a"},
     "{src}:2: no `rejected` field (found chosen, prompt); a preference pair needs `chosen` and `rejected` (and a "
     "`prompt`, or conversations that share their first turns)"),
    ({"prompt": "q", "chosen": "", "rejected": "b"},
     "{src}:2: `chosen` is empty, so there is nothing to train on; fix the row or remove it"),
    ({"prompt": "q", "chosen": "a", "rejected": [{"role": "assistant", "content": "b"}]},
     "{src}:2: `rejected` is a list of turns where `prompt` is text; give every field as text, or every one as a "
     "list of {{\"role\", \"content\"}} turns"),
    ({"prompt": [], "chosen": turns(("user", "a")), "rejected": turns(("assistant", "b"))},
     "{src}:2: `chosen` holds no assistant turn; a completion is the assistant's answer"),
    ({"prompt": [], "chosen": turns(("asistant", "a")), "rejected": turns(("assistant", "b"))},
     "{src}:2: role 'asistant' is not one of system, developer, user, assistant, tool (did you mean assistant?); "
     "fix the record (only the assistant's turns are trained on)"),
])
def test_a_bad_pair_row_is_one_line_exit_2_and_nothing_is_written(tmp_path, row, message):
    src = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "q", "chosen": "a", "rejected": "b"}, row])
    out = tmp_path / "out"
    r = run_here("prepare", str(src), "--out", str(out), "--preference", "--quiet")
    one_line_exit_2(r)
    assert r.stderr.strip() == f"scaletrain: error: {message.format(src=src)}"
    assert not out.exists() and list(tmp_path.iterdir()) == [src]  # no folder, no partial one


@pytest.mark.parametrize("args, rows, message", [
    (["--preference", "unpaired"], [{"prompt": "q", "completion": "a", "label": 1}],
     "{src}:1: `label` is 1; give true (a desirable completion) or false (an undesirable one)"),
    (["--preference"], [{"text": "hello"}],
     "{src}:1: neither a preference pair nor an unpaired example (found text); a preference pair needs `chosen` and "
     "`rejected` (and a `prompt`, or conversations that share their first turns); an unpaired example needs "
     "`prompt`, `completion` and a boolean `label`"),
    (["--preference", "--max-length", "3"], [{"prompt": "long", "chosen": "a", "rejected": "b"}],
     "no preference example to write: of 1 row(s), none is left (1 row(s) dropped, no completion token left to "
     "train on (first: {src}:1); raise --max-length or lower --max-prompt-tokens); nothing was written"),
    (["--max-length", "3"], [{"text": "hello"}],
     "--max-length truncates preference data: give it with --preference (nothing was written)"),
    (["--preference", "--loss-on-prompt"], [{"prompt": "q", "chosen": "a", "rejected": "b"}],
     "--loss-on-prompt does not apply to --preference data: a preference loss counts the completions' tokens alone "
     "(nothing was written)"),
])
def test_bad_preference_input_is_one_line_exit_2(tmp_path, args, rows, message):
    src = write_jsonl(tmp_path / "p.jsonl", rows)
    r = run_here("prepare", str(src), "--out", str(tmp_path / "out"), *args, "--quiet")
    one_line_exit_2(r)
    assert r.stderr.strip() == f"scaletrain: error: {message.format(src=src)}"
    assert not (tmp_path / "out").exists()


def test_a_bad_parquet_row_is_named_by_its_row_and_text_files_are_refused(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"prompt": "q", "chosen": "a", "rejected": "b"},
                                         {"prompt": "q", "chosen": "a", "rejected": ""}]), tmp_path / "p.parquet")
    r = run_here("prepare", str(tmp_path / "p.parquet"), "--out", str(tmp_path / "o"), "--preference", "--quiet")
    one_line_exit_2(r, f"{tmp_path / 'p.parquet'}:row 1: `rejected` is empty")
    (tmp_path / "t.txt").write_text("hello")
    r = run_here("prepare", str(tmp_path / "t.txt"), "--out", str(tmp_path / "o"), "--preference", "--quiet")
    one_line_exit_2(r, f"{tmp_path / 't.txt'}: preference data is read from .jsonl, .jsonl.gz, .jsonl.zst, .parquet "
                       "files, one row an example; convert it to jsonl or parquet")


def test_text_training_refuses_preference_data_and_a_corrupt_index_is_caught(tmp_path):
    prepare([write_jsonl(tmp_path / "p.jsonl", [{"prompt": "q", "chosen": "a", "rejected": "b"}])], tmp_path / "out",
            preference="pairs")
    with pytest.raises(DataError, match="holds preference data .prepare --preference., which language-model training"):
        TokenData.open(tmp_path / "out")
    index = tmp_path / "out" / "index_00000.bin"
    raw = bytearray(index.read_bytes())
    raw[0] ^= 1
    index.write_bytes(bytes(raw))
    with pytest.raises(DataError, match="the index is corrupt"):
        PreferenceData.open(tmp_path / "out")


# --------------------------------------------------------------------------------------------
# The collate


def test_the_collate_keeps_each_pair_on_adjacent_rows_with_uneven_lengths(tmp_path):
    rows = [{"prompt": "p" * (1 + i % 4), "chosen": "c" * (1 + (i * 3) % 7), "rejected": "r" * (1 + (i * 5) % 3)}
            for i in range(9)]
    prepare([write_jsonl(tmp_path / "p.jsonl", rows)], tmp_path / "out", preference="pairs")
    data = PreferenceData.open(tmp_path / "out")
    for indices in ([0, 1, 2, 3], [8, 4], [5], [7, 6, 3]):  # micro-batches of any size and order
        examples = [data[i] for i in indices]
        batch = collate_preference(examples, pad_id=0)
        R, T = batch.input_ids.shape
        assert R == 2 * len(indices) and T == max(s.numel() for ex in examples for s in ex.sequences) - 1
        assert batch.pair_index.tolist() == [k for k in range(len(indices)) for _ in (0, 1)]
        assert batch.chosen.tolist() == [True, False] * len(indices)
        for k, i in enumerate(indices):
            for side, key in ((0, "chosen"), (1, "rejected")):
                r = 2 * k + side
                # the counted targets are exactly the completion's tokens with its end, and nothing else is counted
                assert as_bytes(batch.targets[r][batch.completion_mask[r]]) == rows[i][key].encode() + END
                assert (batch.targets[r][~batch.completion_mask[r]] == IGNORE_INDEX).all()
                seq = data[i].sequences[side]
                n = seq.numel() - 1
                assert torch.equal(batch.input_ids[r, :n], seq[:-1]) and (batch.input_ids[r, n:] == 0).all()
        assert np.array_equal(batch.completion_mask.sum(1).numpy(),
                              [int(m.sum()) for ex in examples for m in ex.masks])
