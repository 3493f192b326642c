"""Packing without cross-document attention (data.document_mask): each document of a packed window
attends within itself with positions that restart at its first token, so its losses are those of
the document alone; the target after each separator (the next document's first token) is not
counted; data parallelism and tensor parallelism with accumulation match one process; what
cannot honour it is refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from scaletrain.data import prepare
from scaletrain.data.dataset import IGNORE_INDEX, WindowDataset
from scaletrain.model.loss import cross_entropy_sum
from scaletrain.model.transformer import document_ids, document_positions
from scaletrain.train.trainer import Trainer
from scaletrain.verify import TOLERANCES

from conftest import (
    assert_same_run,
    fit_reference,
    margin_text,
    micro_cfg,
    micro_overrides,
    one_line_exit_2,
    run_group,
    run_here,
)

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex one café".split()
# Llama-shaped (rotary, grouped-query) and GPT-2-shaped (learned positions): both restart per document
FAMILIES = {"rope": {"model.position": "rope", "model.norm": "rmsnorm", "model.activation": "swiglu",
                     "model.n_kv_heads": 2},
            "learned": {}}
TOL = 2e-6  # fp32: the same sums over more (masked) keys, in another order


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> Path:
    """BPE data of short documents of many lengths, each ended by <|endoftext|>: windows of 32
    tokens hold several."""
    tmp = tmp_path_factory.mktemp("docs")
    docs = [" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(1 + (i * 5) % 11)) for i in range(300)]
    (tmp / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    prepare([tmp / "docs.jsonl"], tmp / "tok", tokenizer="bpe", vocab_size=300, val_fraction=0.1)
    return tmp / "tok"


def doc_cfg(folder: Path, tmp_path: Path, family: str = "learned", **extra):
    return micro_cfg(tmp_path, **{"data.path": str(folder), "model.vocab_size": 0, "data.document_mask": True,
                                  **FAMILIES[family], **extra})


def per_token_losses(model, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        logits = model(inputs)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none",
                           ignore_index=IGNORE_INDEX).view(targets.shape)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_packed_window_gives_each_document_the_losses_it_has_alone(packed, tmp_path, family):
    trainer = Trainer(doc_cfg(packed, tmp_path, family))
    model, sep = trainer.model, trainer.data.dataset.separator
    windows = trainer.sampler(0).global_batch_indices(0)[:4]
    inputs, targets = trainer.data.dataset[windows]
    losses = per_token_losses(model, inputs, targets)
    model.separator = None  # each document alone: a window of its own, nothing to mask
    unmasked = per_token_losses(model, inputs, targets)
    worst, documents, changed = 0.0, 0, 0.0
    for b in range(len(windows)):
        ends = [int(t) + 1 for t in torch.nonzero(inputs[b] == sep).flatten()]
        for lo, hi in zip([0, *ends], [*ends, inputs.shape[1]]):
            if lo == hi:  # the window ends with a separator
                continue
            alone = per_token_losses(model, inputs[b:b + 1, lo:hi], targets[b:b + 1, lo:hi])[0]
            worst = max(worst, (losses[b, lo:hi] - alone).abs().max().item())
            documents += 1
            if lo:  # a later document: without the mask it sees those before it
                changed = max(changed, (unmasked[b, lo:hi] - alone).abs().max().item())
    assert documents >= 3 * len(windows)  # several documents a window
    assert worst <= TOL, f"a packed document's token losses differ from its alone by {margin_text(worst, TOL)}"
    assert changed > 1e-2  # the comparison can fail: attention across documents changes them


def test_rotary_positions_restart_at_each_document(packed, tmp_path):
    trainer = Trainer(doc_cfg(packed, tmp_path, "rope"))
    model, sep = trainer.model, trainer.data.dataset.separator
    seen = []
    model.layers["0"].attn.register_forward_pre_hook(lambda module, args: seen.append(args[1]))
    inputs = torch.tensor([[5, 6, sep, 7, 8, 9, sep, 10], [sep, 11, 12, 13, 14, 15, 16, 17]])
    model(inputs)
    expected = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0], [0, 0, 1, 2, 3, 4, 5, 6]])
    assert torch.equal(document_positions(document_ids(inputs, sep)), expected)
    cos, sin = seen[0]
    assert cos.shape[:2] == inputs.shape  # a table row per sequence and position
    assert torch.equal(cos, model.rope_cos[expected]) and torch.equal(sin, model.rope_sin[expected])


def test_the_target_after_a_separator_is_not_counted(packed, tmp_path):
    captured = []

    def loss_fn(logits, targets):  # the training loss, keeping the logits' gradient
        logits.retain_grad()
        captured.append((logits, targets))
        return cross_entropy_sum(logits, targets)

    cfg = doc_cfg(packed, tmp_path, "rope", **{"train.micro_batch": 4})  # accumulation 2
    trainer = Trainer(cfg, loss_fn=loss_fn)
    sep = trainer.data.dataset.separator
    windows = trainer.sampler(0).global_batch_indices(0)
    inputs, targets = trainer.data.dataset[windows]
    raw_inputs, raw_targets = WindowDataset(trainer.data.corpus, cfg.data.seq_len)[windows]  # every target kept
    boundary = raw_inputs == sep
    assert torch.equal(inputs, raw_inputs) and boundary.sum() > len(windows)
    assert torch.equal(targets == IGNORE_INDEX, boundary)  # exactly the separators' targets left out
    assert torch.equal(targets[~boundary], raw_targets[~boundary])
    assert trainer.counted_tokens(0) == boundary.numel() - int(boundary.sum())
    by_hand = per_token_losses(trainer.model, inputs, targets)[~boundary].mean().item()
    loss, _, _, _ = trainer.train_step(trainer.batches())
    assert abs(loss.item() - by_hand) <= 1e-6 * by_hand
    grads = torch.cat([logits.grad.flatten(0, 1) for logits, _ in captured])
    seen = torch.cat([t.flatten() for _, t in captured])
    assert torch.equal(seen == IGNORE_INDEX, boundary.flatten())
    assert grads[seen == IGNORE_INDEX].abs().max().item() == 0.0
    assert (grads[seen != IGNORE_INDEX].abs().amax(dim=1) > 0).all()


def test_validation_counts_and_masks_alike(packed, tmp_path):
    trainer = Trainer(doc_cfg(packed, tmp_path, "rope", **{"train.eval_every": 1, "train.eval_batches": 1}))
    (v,) = trainer.data.val_sets
    total, counted, separators = 0.0, 0, 0
    for windows in v.batches:
        inputs, targets = v.dataset[windows]
        losses = per_token_losses(trainer.model, inputs, targets)
        total += losses[targets != IGNORE_INDEX].double().sum().item()
        counted, separators = counted + int((targets != IGNORE_INDEX).sum()), separators + int(
            (inputs == v.dataset.separator).sum())
    assert separators > 0 and counted == v.batches.size * trainer.cfg.data.seq_len - separators
    assert trainer.evaluate()["val_loss"] == pytest.approx(total / counted, rel=1e-6)


@pytest.mark.parametrize("variant", ["bos", "bos-eos"])
def test_a_hugging_face_tokenizers_documents_end_at_its_eos(tmp_path, variant):
    """EOS as prepare's separator (bos), or as the token the encoding already ends each document with
    (bos-eos): either way one id per document, after its last token."""
    pytest.importorskip("transformers")
    from scaletrain.data.dataset import TokenData
    from scaletrain.data.documents import document_separator
    from test_hf_tokenizer import make_hf_folder, write_docs

    hf = make_hf_folder(tmp_path / "hf", variant)
    meta = prepare([write_docs(tmp_path / "docs.jsonl")], tmp_path / "tok", tokenizer=str(hf))
    data = TokenData.open(tmp_path / "tok")
    eos = json.loads((hf / "tokenizer_config.json").read_text())["eos_token"]
    sep = document_separator(data, data.source)
    assert sep == data.tokenizer.tok.token_to_id(eos)
    assert int((data.read(0, data.num_tokens) == sep).sum()) == meta["num_documents"]


STEPS = 3
# (overrides of the 2-rank run, of its one-process reference): dp 2 under ZeRO-3, tp 2 (+ sp) accumulating
LAYOUTS = {"zero3": ({"parallel.zero": 3}, {}),
           "tp2-sp-accum": ({"parallel.tp": 2, "parallel.sp": True, "train.micro_batch": 2},
                            {"train.micro_batch": 2})}


@pytest.mark.multiproc
def test_document_masks_train_alike_under_zero3_and_tp_with_accumulation(packed, tmp_path):
    base = {"data.path": str(packed), "model.vocab_size": 0, "data.document_mask": True, "train.steps": STEPS,
            **FAMILIES["rope"]}
    jobs = [{"overrides": micro_overrides(tmp_path / name, **base, **extra)} for name, (extra, _) in LAYOUTS.items()]
    code, results, err = run_group(2, jobs, tmp_path)
    assert code == 0, err
    for (name, (_, ref_extra)), result in zip(LAYOUTS.items(), results, strict=True):
        ref = fit_reference(micro_cfg(tmp_path / f"ref-{name}", **base, **ref_extra))
        assert_same_run(result["history"], ref["history"], steps=STEPS, tol=TOLERANCES["32-true"],
                        what=f"2 ranks {name}, document mask")
    # the runs counted the targets the mask leaves: fewer than every token
    assert ref["history"][-1]["tokens_trained"] < STEPS * 8 * 32


def test_activation_checkpointing_changes_nothing(packed, tmp_path):
    base = {"train.steps": 2, "memory.activation_checkpointing": "full"}
    got = fit_reference(doc_cfg(packed, tmp_path / "ac", "rope", **base))
    ref = fit_reference(doc_cfg(packed, tmp_path / "plain", "rope", **{"train.steps": 2}))
    assert [r["loss"] for r in got["history"]] == [r["loss"] for r in ref["history"]]


@pytest.mark.parametrize("args, fragments", [
    # (settled where the job starts, before its 2 ranks are)
    (("--parallel.pp=2", "--train.grad_accum=2", "--nproc=2"),
     ("data.document_mask with parallel.pp=2 is not supported: later pipeline stages",
      "set parallel.pp=1 or data.document_mask=false")),
    (("--parallel.cp=2", "--nproc=2"), ("data.document_mask with parallel.cp=2 is not supported",)),
    (("--data.mix=a=1,b=1",), ("data.document_mask with data.mix is not supported",)),
    ((), ("data.document_mask=true finds documents by the token that ends each one, but builtin",
          "byte-level, whose documents are joined by a blank line", "--tokenizer bpe",
          "or set data.document_mask=false")),
], ids=["pp", "cp", "mix", "byte-level"])
def test_what_cannot_honour_document_masks_is_refused_in_one_line(tmp_path, args, fragments):
    r = run_here("train", "--data.document_mask=true", "--train.steps=1", "--train.device=cpu",
                 f"--log.run_dir={tmp_path / 'run'}", *args)
    one_line_exit_2(r, *fragments)


def test_a_tokenizer_without_an_end_of_document_token_is_refused_for_what_it_is():
    """A BPE vocabulary without <|endoftext|> (and no EOS) cannot find documents either, but its refusal
    names that, not the byte-level reason: the one line tells the user which of the two to fix."""
    import tokenizers as tk

    from scaletrain.data.documents import document_separator
    from scaletrain.data.tokenizer import HFTokenizer
    from scaletrain.errors import ConfigError

    words = tk.Tokenizer(tk.models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok = HFTokenizer(words, "file")
    assert tok.separator == [] and tok.eos_id is None
    with pytest.raises(ConfigError) as refused:
        document_separator(type("Data", (), {"tokenizer": tok})(), "FOLDER")
    text = str(refused.value)
    assert "but FOLDER is written by a tokenizer without an end-of-document token" in text
    assert "byte-level" not in text and text.endswith("; prepare the data with --tokenizer bpe or a Hugging Face "
                                                      "tokenizer, or set data.document_mask=false")


def test_the_mask_and_positions_are_made_on_the_documents_device():
    """On a GPU the ids are on the GPU, and so must be the causal part of the mask and the positions counted
    (the meta device stands in for another device here: a tensor made on the CPU cannot be combined with it)."""
    from scaletrain.model.transformer import document_mask

    docs = document_ids(torch.tensor([[5, 9, 0, 5, 0, 7, 7]]), separator=0)
    expected = torch.tensor([[1, 0, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0, 0],
                             [0, 0, 0, 1, 0, 0, 0], [0, 0, 0, 1, 1, 0, 0], [0, 0, 0, 0, 0, 1, 0],
                             [0, 0, 0, 0, 0, 1, 1]], dtype=torch.bool)
    assert torch.equal(document_mask(docs)[0, 0], expected)
    assert document_mask(docs.to("meta")).device.type == "meta"
    assert document_positions(docs).tolist() == [[0, 1, 2, 0, 1, 0, 1]]
    assert document_positions(docs.to("meta")).device.type == "meta"
