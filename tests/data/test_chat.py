"""Chat and instruction data (prepare --chat-format): the loss mask marks exactly the assistant's
tokens, training counts those alone (the prompt gets no gradient), the loss is normalised by
the counted tokens of the whole global batch (data parallelism and accumulation match one
process with unequal counts per rank), and bad input is refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from scaletrain.data import prepare
from scaletrain.data.dataset import IGNORE_INDEX, TokenData, WindowDataset
from scaletrain.errors import ConfigError, DataError
from scaletrain.model.loss import cross_entropy_sum
from scaletrain.train.trainer import Trainer
from scaletrain.verify import TOLERANCES

from conftest import assert_same_run, fit_reference, micro_cfg, micro_overrides, run_group, run_here

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex café".split()


def conversations(n: int = 60) -> list[dict]:
    """Records of both shapes, answers of very different lengths (so ranks count unequally)."""
    out = []
    for i in range(n):
        question = " ".join(WORDS[(i * 3 + j) % len(WORDS)] for j in range(2 + i % 5))
        answer = " ".join(WORDS[(i * 5 + j) % len(WORDS)] for j in range(1 + (i * 7) % 13))
        if i % 2:
            out.append({"prompt": question + "?", "response": answer})
        else:
            out.append({"messages": [{"role": "system", "content": "be brief"},
                                     {"role": "user", "content": question},
                                     {"role": "assistant", "content": answer},
                                     {"role": "user", "content": "again"},
                                     {"role": "assistant", "content": answer.upper()}]})
    return out


def assistant_texts(record: dict, end: str) -> list[str]:
    if "messages" in record:
        return [m["content"] + end for m in record["messages"] if m["role"] == "assistant"]
    return [record["response"] + end]


def write_jsonl(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def tokens_and_mask(folder: Path) -> tuple[np.ndarray, np.ndarray]:
    data = TokenData.open(folder)
    return data.read(0, data.num_tokens), data.mask.read(0, data.num_tokens)


def spans(ids: np.ndarray, mask: np.ndarray) -> list[np.ndarray]:
    """The runs of masked tokens, in order."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))
    return [ids[a:b] for a, b in zip(edges[::2], edges[1::2])]


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("plain")
    records = conversations()
    prepare([write_jsonl(tmp / "chat.jsonl", records)], tmp / "tok", chat_format="plain", shard_tokens=1000)
    return records, tmp / "tok"


def test_plain_format_masks_exactly_the_assistants_tokens(plain, tmp_path):
    records, folder = plain
    meta = json.loads((folder / "meta.json").read_text())
    assert len(meta["mask_shards"]) == len(meta["shards"]) > 1  # cut like the token shards
    ids, mask = tokens_and_mask(folder)
    got = [bytes(s.astype(np.uint8)).decode() for s in spans(ids, mask)]
    assert got == [t for r in records for t in assistant_texts(r, "\n")]
    assert meta["num_counted_tokens"] == int(mask.sum())
    text = bytes(ids.astype(np.uint8)).decode()
    assert text.startswith("System: be brief\nUser: the quick\nAssistant: the\nUser: again\nAssistant: THE\n\n\n")
    prepare([folder.parent / "chat.jsonl"], tmp_path / "all", chat_format="plain", loss_on_prompt=True)
    all_ids, all_mask = tokens_and_mask(tmp_path / "all")
    assert np.array_equal(all_ids, ids) and all_mask.all()


@pytest.mark.parametrize("variant", ["no-special", "bos"])
def test_chat_template_masks_exactly_the_assistants_tokens(tmp_path, variant):
    """bos: a tokenizer whose encoding adds <s> itself; the template writes its own, so the rendered text is
    encoded without special tokens (as transformers' apply_chat_template does)."""
    transformers = pytest.importorskip("transformers")
    from test_hf_tokenizer import make_hf_folder

    hf = make_hf_folder(tmp_path / "hf", variant,
                        chat_template=("{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
                                       "{% if add_generation_prompt %}<s>assistant\n{% endif %}"))
    records = conversations(12)
    prepare([write_jsonl(tmp_path / "chat.jsonl", records)], tmp_path / "tok", tokenizer=str(hf),
            chat_format="template")
    ids, mask = tokens_and_mask(tmp_path / "tok")
    auto = transformers.AutoTokenizer.from_pretrained(hf)
    got = [auto.decode(s.tolist()) for s in spans(ids, mask)]
    assert got == [t for r in records for t in assistant_texts(r, "</s>\n")]
    # the tokens are transformers' own rendering and tokenization, record after record
    first = records[0]["messages"]
    expected = auto.apply_chat_template(first, tokenize=True, return_dict=True)["input_ids"]
    assert ids[:len(expected)].tolist() == list(expected)


def test_bad_chat_input_is_one_line_each(tmp_path):
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "a", "response": "b"}, {"text": "no chat here"}])
    r = run_here("prepare", str(bad), "--out", str(tmp_path / "o1"), "--chat-format", "plain")
    assert r.returncode == 2 and f"{bad}:2: no chat fields (found text); expected a `messages` list" in r.stderr
    assert "prompt, instruction, question with one of response, completion, output, answer" in r.stderr
    good = write_jsonl(tmp_path / "good.jsonl", conversations(4))
    r = run_here("prepare", str(good), "--out", str(tmp_path / "o2"), "--chat-format", "template")
    assert r.returncode == 2 and "the byte tokenizer has none: give --chat-format plain" in r.stderr
    pytest.importorskip("transformers")
    from test_hf_tokenizer import make_hf_folder

    hf = make_hf_folder(tmp_path / "hf", "bos")  # no chat_template
    r = run_here("prepare", str(good), "--out", str(tmp_path / "o3"), "--tokenizer", str(hf), "--chat-format",
                 "template")
    assert r.returncode == 2 and "the tokenizer has no chat_template" in r.stderr
    assert "give --chat-format plain" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_a_misspelled_role_is_refused_with_its_line_and_the_known_roles(tmp_path):
    """Issue 47: "assitant" was rendered as an "Assitant: ..." prompt turn and never trained on."""
    records = conversations(3)
    records[2]["messages"][2]["role"] = "assitant"  # (record 1 is a prompt/response one)
    bad = write_jsonl(tmp_path / "bad.jsonl", records)
    r = run_here("prepare", str(bad), "--out", str(tmp_path / "o"), "--chat-format", "plain")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert f"{bad}:3: role 'assitant' is not one of system, developer, user, assistant, tool (did you mean " \
           "assistant?)" in r.stderr
    assert not (tmp_path / "o").exists()


def test_a_chat_template_that_raises_is_one_line_with_the_record_and_its_message(tmp_path):
    """Issue 47: Llama-2 / Mistral / Gemma templates raise on a role or an order they refuse; that was a
    jinja traceback."""
    pytest.importorskip("transformers")
    from test_hf_tokenizer import make_hf_folder

    hf = make_hf_folder(tmp_path / "hf", "no-special",
                        chat_template=("{% for m in messages %}{% if m['role'] == 'system' %}"
                                       "{{ raise_exception('System role not supported') }}{% endif %}"
                                       "<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
                                       "{% if add_generation_prompt %}<s>assistant\n{% endif %}"))
    records = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
               {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                             {"role": "assistant", "content": "yo"}]}]
    chat = write_jsonl(tmp_path / "chat.jsonl", records)
    r = run_here("prepare", str(chat), "--out", str(tmp_path / "o"), "--tokenizer", str(hf), "--chat-format",
                 "template")
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert f"{chat}:2: the tokenizer's chat template refuses this conversation (System role not supported)" \
        in r.stderr


def test_a_mask_asked_of_data_without_one_is_refused(tmp_path):
    (tmp_path / "doc.txt").write_text(" ".join(WORDS) * 40)
    prepare([tmp_path / "doc.txt"], tmp_path / "text")
    with pytest.raises(ConfigError, match=r"data.loss_mask=true, but .*text was prepared without a loss mask; "
                                          r"prepare chat data with `scaletrain prepare FILE.jsonl --chat-format"):
        Trainer(micro_cfg(tmp_path, **{"data.path": str(tmp_path / "text"), "data.loss_mask": "true"}))
    with pytest.raises(ConfigError, match="data.loss_mask=true, but builtin"):
        Trainer(micro_cfg(tmp_path, **{"data.loss_mask": "true"}))


def test_a_mask_under_fault_tolerance_is_refused_before_any_group_connects(plain, tmp_path):
    """The replica groups average their gradients without weighing each group's counted tokens."""
    ft = {"fault_tolerance.enabled": True, "fault_tolerance.lighthouse": "http://127.0.0.1:1"}
    with pytest.raises(ConfigError, match=r"has a loss mask \(chat data\), and fault_tolerance.enabled averages"):
        Trainer(micro_cfg(tmp_path, **{"data.path": str(plain[1]), **ft}))
    Trainer(micro_cfg(tmp_path, **{"data.path": str(plain[1]), "data.loss_mask": "false",
                                   "log.run_dir": str(tmp_path / "b")}))  # every token counted: no refusal here


def test_a_mask_shard_cut_short_is_refused(plain, tmp_path):
    import shutil

    shutil.copytree(plain[1], tmp_path / "tok")
    with (tmp_path / "tok" / "mask_00000.bin").open("r+b") as f:
        f.truncate(10)
    with pytest.raises(DataError, match="the loss mask shard is missing, misnamed or not 1000 bytes"):
        TokenData.open(tmp_path / "tok")


def test_first_step_loss_is_the_mean_over_the_assistants_tokens_and_the_prompt_gets_no_gradient(plain, tmp_path):
    _, folder = plain
    captured = []

    def loss_fn(logits, targets):  # the training loss, keeping each micro-batch's logits' gradient
        logits.retain_grad()
        captured.append((logits, targets))
        return cross_entropy_sum(logits, targets)

    cfg = micro_cfg(tmp_path, **{"data.path": str(folder), "train.micro_batch": 4})  # accumulation 2
    trainer = Trainer(cfg, loss_fn=loss_fn)
    windows = trainer.sampler(0).global_batch_indices(0)
    raw = WindowDataset(trainer.data.corpus, cfg.data.seq_len)  # the same windows, every target kept
    inputs, targets = raw[windows]
    T = cfg.data.seq_len  # window i's targets are tokens i*T + 1 .. i*T + T: their mask, read here
    counted = torch.from_numpy(np.stack([trainer.data.corpus.mask.read(int(i) * T + 1, T) for i in windows])).bool()
    with torch.no_grad():
        per_token = F.cross_entropy(trainer.model(inputs).flatten(0, 1), targets.flatten(), reduction="none")
    by_hand = per_token[counted.flatten()].mean().item()
    assert 0 < counted.sum() < counted.numel()  # a real mask: some targets are the prompts', some answers
    loss, _, _, _ = trainer.train_step(trainer.batches())
    assert abs(loss.item() - by_hand) <= 1e-6 * by_hand
    assert trainer.counted_tokens(0) == int(counted.sum())
    # the loss's gradient reaches the predictions of the assistant's tokens alone
    grads = torch.cat([logits.grad.flatten(0, 1) for logits, _ in captured])
    seen = torch.cat([t.flatten() for _, t in captured])
    assert torch.equal(seen == IGNORE_INDEX, ~counted.flatten())
    assert grads[seen == IGNORE_INDEX].abs().max().item() == 0.0
    assert (grads[seen != IGNORE_INDEX].abs().amax(dim=1) > 0).all()


STEPS = 3
LAYOUTS = {"zero1": ({"parallel.zero": 1}, {}),  # (overrides of the 2-rank run, of its one-process reference)
           "zero1-accum": ({"parallel.zero": 1, "train.micro_batch": 2}, {"train.micro_batch": 4}),
           # the other layouts see the whole batch on each rank: the counts come from the data alike
           "tp2-sp": ({"parallel.tp": 2, "parallel.sp": True}, {}),
           "pp2-1f1b": ({"parallel.pp": 2, "parallel.pp_schedule": "1f1b", "train.micro_batch": 2}, {}),
           "cp2-ring": ({"parallel.cp": 2, "parallel.cp_method": "ring"}, {})}


@pytest.mark.multiproc
def test_each_step_counts_its_own_batchs_targets(plain, tmp_path):
    """The targets a step's loss is divided by are that step's (read from the mask here, window by
    window), whatever step was asked before: a count kept from another step would pass a test of one
    step, or of steps that all count alike (these do not)."""
    _, folder = plain
    cfg = micro_cfg(tmp_path, **{"data.path": str(folder), "train.micro_batch": 4})
    trainer = Trainer(cfg)
    T, sampler = cfg.data.seq_len, trainer.sampler(0)
    by_hand = [int(sum(trainer.data.corpus.mask.read(int(i) * T + 1, T).sum() for i in
                       sampler.global_batch_indices(step))) for step in range(6)]
    assert len(set(by_hand)) > 1, by_hand  # the steps differ, so a kept count shows
    for step in [0, 1, 2, 1, 5, 3, 4, 0]:  # out of order and again
        assert trainer.counted_tokens(step) == max(1, by_hand[step]), (step, by_hand)
    trainer.folder.release()


def test_masked_loss_matches_one_process_on_every_layout(plain, tmp_path):
    _, folder = plain
    base = {"data.path": str(folder), "train.steps": STEPS}
    # the ranks count unequally at every step: the normalisation must be the global batch's
    probe = Trainer(micro_cfg(tmp_path / "probe", **base))
    for step in range(STEPS):
        halves = probe.sampler(step).global_batch_indices(step).reshape(2, -1)
        counts = [int(probe.data.dataset.target_mask(h).sum()) for h in halves]
        assert counts[0] != counts[1], counts
    jobs = [{"overrides": micro_overrides(tmp_path / name, **base, **extra)} for name, (extra, _) in LAYOUTS.items()]
    code, results, err = run_group(2, jobs, tmp_path)
    assert code == 0, err
    for (name, (_, ref_extra)), result in zip(LAYOUTS.items(), results, strict=True):
        ref = fit_reference(micro_cfg(tmp_path / f"ref-{name}", **base, **ref_extra))
        assert_same_run(result["history"], ref["history"], steps=STEPS, tol=TOLERANCES["32-true"],
                        what=f"2 ranks {name}, masked")
    assert ref["history"][-1]["tokens_trained"] == sum(probe.counted_tokens(s) for s in range(STEPS))


def test_masked_loss_under_fp16_loss_scaling_tracks_fp32(plain, tmp_path):
    """16-mixed's path of a masked loss: the loss scale stands in for the factor that divides by the
    counted targets, and unscaling must leave the counted targets' mean; the loss and the gradient
    norm before clipping of each of the first steps within verify's 16-mixed tolerance of 32-true."""
    from scaletrain.verify import CALIBRATED_STEPS

    _, folder = plain
    run = {"data.path": str(folder), "train.steps": CALIBRATED_STEPS, "optim.lr": 1e-3}
    fp32 = Trainer(micro_cfg(tmp_path / "fp32", **run))
    assert all(fp32.counted_tokens(s) < fp32.step_tokens(s) for s in range(CALIBRATED_STEPS))  # a real mask
    rows = Trainer(micro_cfg(tmp_path / "fp16", **run, **{"precision.mode": "16-mixed"})).fit()["history"]
    assert_same_run(rows, fp32.fit()["history"], steps=CALIBRATED_STEPS, tol=TOLERANCES["16-mixed"],
                    what="16-mixed against 32-true, masked")


def test_validation_loss_is_the_mean_over_the_held_out_answers(tmp_path):
    prepare([write_jsonl(tmp_path / "chat.jsonl", conversations(80))], tmp_path / "tok", chat_format="plain",
            val_fraction=0.3)
    trainer = Trainer(micro_cfg(tmp_path, **{"data.path": str(tmp_path / "tok"), "train.eval_every": 1,
                                             "train.eval_batches": 2}))
    (v,) = trainer.data.val_sets
    held_out, T = TokenData.open(tmp_path / "tok", split="val"), trainer.cfg.data.seq_len
    total, counted = 0.0, 0
    for windows in v.batches:
        inputs, targets = WindowDataset(held_out, T)[windows]
        mask = torch.from_numpy(np.stack([held_out.mask.read(int(i) * T + 1, T) for i in windows])).bool()
        with torch.no_grad():
            per_token = F.cross_entropy(trainer.model(inputs).flatten(0, 1), targets.flatten(), reduction="none")
        total, counted = total + per_token[mask.flatten()].double().sum().item(), counted + int(mask.sum())
    assert 0 < counted < v.batches.size * T
    assert trainer.evaluate()["val_loss"] == pytest.approx(total / counted, rel=1e-6)


def test_steps_without_a_counted_target_report_no_loss_and_stay_out_of_the_statistics(tmp_path):
    """Issue 47: windows holding prompt tokens only logged `loss 0.0`, fed the early-loss mean, and
    then crashed the divergence check (ZeroDivisionError). Such a step reports no loss, is kept out of
    the early-loss and divergence statistics, and is said once with what to change."""
    import io

    # long prompts, short answers: about one window in seven holds an answer's tokens, so some global
    # batches of 8 windows hold none
    records = [{"prompt": " ".join(WORDS[(i + j) % len(WORDS)] for j in range(40)), "response": WORDS[i % 7]}
               for i in range(120)]
    prepare([write_jsonl(tmp_path / "chat.jsonl", records)], tmp_path / "tok", chat_format="plain")
    log = io.StringIO()
    trainer = Trainer(micro_cfg(tmp_path, **{"data.path": str(tmp_path / "tok"), "train.steps": 20,
                                             "train.eval_every": 0}), stream=log)
    empty = [s for s in range(20) if trainer.data.dataset.counts_nothing(s, trainer.sampler)]
    assert 1 <= len(empty) and 20 - len(empty) >= 6, empty  # the case is exercised, and the early mean too
    result = trainer.fit()  # (the divergence check ran: train.divergence_factor is on by default)
    losses = {r["step"]: r["loss"] for r in result["history"]}
    assert [s for s, loss in losses.items() if loss is None] == [s + 1 for s in empty]
    assert all(loss > 0 for loss in losses.values() if loss is not None)
    early = [losses[s] for s in sorted(losses) if losses[s] is not None][:5]
    assert trainer.state.early_loss == pytest.approx(sum(early) / 5)
    said = [line for line in log.getvalue().splitlines() if "no token of its batch is a training target" in line]
    assert len(said) == 1 and f"step {empty[0] + 1}:" in said[0] and "lengthen data.seq_len" in said[0]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["loss"] is None] == [s + 1 for s in empty]


def test_a_chat_template_kept_apart_survives_prepare_training_and_export(tmp_path):
    """Issue 47: the export lost the chat template. A folder that keeps it in chat_template.jinja (as
    transformers writes it now) renders the chat data, and the exported model's tokenizer has it."""
    transformers = pytest.importorskip("transformers")
    from test_hf_tokenizer import make_hf_folder

    hf = make_hf_folder(tmp_path / "hf", "no-special")
    template = ("{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
                "{% if add_generation_prompt %}<s>assistant\n{% endif %}")
    (hf / "chat_template.jinja").write_text(template)
    assert "chat_template" not in json.loads((hf / "tokenizer_config.json").read_text())
    prepare([write_jsonl(tmp_path / "chat.jsonl", conversations(12))], tmp_path / "tok", tokenizer=str(hf),
            chat_format="template")
    options = micro_overrides(tmp_path / "run", **{"train.steps": 1, "train.eval_every": 0,
                                                   "checkpoint.save_final": True, "data.path": str(tmp_path / "tok"),
                                                   "model.vocab_size": 0})
    r = run_here("train", *(f"--{k}={v}" for k, v in options.items()))
    assert r.returncode == 0, r.stderr
    step = tmp_path / "run" / "checkpoints" / "step_00000001"
    assert run_here("export", str(step), "--format", "hf", "--out", str(tmp_path / "exp")).returncode == 0
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "exp").chat_template == template


def test_records_are_read_alike_from_jsonl_and_gzip_and_another_file_is_refused(tmp_path):
    import gzip

    from scaletrain.data.chat import iter_records

    records = conversations(5)
    plain_file = write_jsonl(tmp_path / "chat.jsonl", records)
    lines = plain_file.read_text().splitlines(keepends=True)
    plain_file.write_text("".join(lines[:2]) + "\n  \n" + "".join(lines[2:]))  # two blank lines: skipped, counted
    packed = tmp_path / "chat.jsonl.gz"
    packed.write_bytes(gzip.compress(plain_file.read_bytes()))
    from_plain, from_gzip = list(iter_records([plain_file])), list(iter_records([packed]))
    assert [m for _, m in from_gzip] == [m for _, m in from_plain] and len(from_gzip) == 5
    assert [m for _, m in from_plain][4] == records[4]["messages"]
    assert [w for w, _ in from_gzip] == [f"{packed}:{n}" for n in (1, 2, 5, 6, 7)]
    broken = tmp_path / "broken.jsonl"
    broken.write_text(lines[0] + '{"prompt": "a",\n')
    with pytest.raises(DataError) as refused:
        list(iter_records([broken]))
    assert str(refused.value).startswith(f"{broken}:2: not valid JSON (")
    other = write_jsonl(tmp_path / "chat.json", records)
    with pytest.raises(DataError) as refused:
        list(iter_records([other]))
    assert str(refused.value) == (f"{other}: chat data is read from .jsonl or .jsonl.gz files; convert it to jsonl, "
                                  "one conversation a line")


@pytest.mark.parametrize("messages", [
    "hi",  # not a list
    [{"role": "user", "content": "hi"}, {"role": "assistant"}],  # a turn without its content
    [{"role": "user", "content": "hi"}, {"role": 3, "content": "yo"}],  # a role that is not a string
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}],  # nor a content
    [{"role": "user", "content": "hi"}, ["assistant", "yo"]],  # a turn that is not an object
], ids=["not-a-list", "no-content", "role-3", "content-none", "turn-a-list"])
def test_a_turn_that_is_not_a_role_and_a_content_is_refused_by_its_record(messages):
    from scaletrain.data.chat import messages_of

    with pytest.raises(DataError) as refused:
        messages_of({"messages": messages}, "chat.jsonl:7")
    assert str(refused.value) == 'chat.jsonl:7: `messages` must be a list of {"role": str, "content": str} turns'


def test_the_plain_format_renders_what_generation_continues():
    """`render` (what generation is prompted with): the turns as prepare writes them, then the assistant's
    label alone when a generation prompt is asked for."""
    from scaletrain.data.chat import ChatRenderer
    from scaletrain.data.tokenizer import ByteTokenizer

    chat = ChatRenderer(ByteTokenizer(), "plain")
    turns = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert chat.render(turns) == "System: be brief\nUser: hi\n"
    assert chat.render(turns, generation_prompt=True) == "System: be brief\nUser: hi\nAssistant: "


def test_templates_that_rewrite_a_prefix_are_refused_and_an_empty_answer_is_counted_as_nothing(tmp_path):
    """The assistant's span is where rendering the turns before it (with the generation prompt) ends and
    rendering it too ends: a template whose prefix is not the start of the whole cannot be read so, and is
    refused; an empty answer under a template that writes nothing around it is an empty span, not a refusal."""
    pytest.importorskip("transformers")
    from scaletrain.data.chat import PREFIX_REWRITTEN
    from test_hf_tokenizer import make_hf_folder

    records = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
               {"messages": [{"role": "user", "content": "hey"}, {"role": "assistant", "content": ""}]}]
    chat = write_jsonl(tmp_path / "chat.jsonl", records)
    templates = {"counting": "{{ messages|length }}{% for m in messages %}{{ m['content'] }}\n{% endfor %}",
                 "bare": "{% for m in messages %}{{ m['content'] }}{% endfor %}"}
    for name, template in templates.items():
        hf = make_hf_folder(tmp_path / name, "no-special", chat_template=template)
        if name == "counting":
            with pytest.raises(DataError) as refused:
                prepare([chat], tmp_path / f"{name}-tok", tokenizer=str(hf), chat_format="template")
            assert str(refused.value) == PREFIX_REWRITTEN
        else:
            prepare([chat], tmp_path / f"{name}-tok", tokenizer=str(hf), chat_format="template")
            ids, mask = tokens_and_mask(tmp_path / f"{name}-tok")
            from transformers import AutoTokenizer
            assert [AutoTokenizer.from_pretrained(hf).decode(s.tolist()) for s in spans(ids, mask)] == ["yo"]


def test_the_template_format_without_transformers_is_one_line(monkeypatch):
    import sys

    from scaletrain.data.chat import ChatRenderer

    monkeypatch.setitem(sys.modules, "transformers", None)  # what `import transformers` meets where it is absent
    tok = type("Tokenizer", (), {"kind": "hf", "source": Path("model")})()
    with pytest.raises(DataError) as refused:
        ChatRenderer(tok, "template")
    assert str(refused.value) == ("--chat-format template renders with transformers, which is not installed: pip "
                                  "install transformers, or give --chat-format plain")


@pytest.mark.parametrize("record,expected", [
    ({"system": "be brief", "prompt": "q", "response": "a"},
     [{"role": "system", "content": "be brief"}, {"role": "user", "content": "q"},
      {"role": "assistant", "content": "a"}]),
    ({"system": "", "instruction": "q", "output": "a"}, [{"role": "user", "content": "q"},
                                                         {"role": "assistant", "content": "a"}]),
    ([1, 2], "chat.jsonl:7: a chat record must be a JSON object with a `messages` list"),
    ({"prompt": "q"}, "chat.jsonl:7: no chat fields (found prompt); expected a `messages` list"),
    ({"response": "a"}, "chat.jsonl:7: no chat fields (found response); expected a `messages` list"),
    ({}, "chat.jsonl:7: no chat fields (found none); expected a `messages` list"),  # an empty object
    ({"messages": [{"role": "user", "content": "q"}, {"role": "tool", "content": "t"}]},
     "chat.jsonl:7: no assistant turn, so nothing to train on; every record needs one"),
], ids=["system-prompt-response", "empty-system", "not-an-object", "prompt-alone", "response-alone", "empty",
        "no-assistant"])
def test_a_records_turns_or_its_refusal(record, expected):
    """A prompt/response record becomes [system,] user, assistant turns (an empty system turn is left out);
    a record that is not an object, lacks one of the pair or has no assistant turn is refused by its place."""
    from scaletrain.data.chat import messages_of

    if isinstance(expected, list):
        assert messages_of(record, "chat.jsonl:7") == expected
        return
    with pytest.raises(DataError) as refused:
        messages_of(record, "chat.jsonl:7")
    assert str(refused.value).startswith(expected)


def test_a_renderer_masks_the_answers_alone_unless_told_and_knows_its_formats():
    from scaletrain.data.chat import ChatRenderer
    from scaletrain.data.tokenizer import ByteTokenizer

    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    ids, mask = ChatRenderer(ByteTokenizer(), "plain")(turns)
    assert bytes(ids.tolist()) == b"User: hi\nAssistant: yo\n\n\n"  # then the separator, a blank line
    assert bytes(ids[mask == 1].tolist()) == b"yo\n"
    assert ChatRenderer(ByteTokenizer(), "plain", loss_on_prompt=True)(turns)[1].all()
    with pytest.raises(DataError) as refused:
        ChatRenderer(ByteTokenizer(), "html")
    assert str(refused.value) == "--chat-format html: expected one of template, plain"


def test_an_opening_assistant_turn_counts_its_content_and_not_its_header(tmp_path):
    """A conversation that opens with the assistant: its role header (what the generation prompt adds to a
    conversation) is no target, as for every later assistant turn."""
    transformers = pytest.importorskip("transformers")
    from test_hf_tokenizer import make_hf_folder

    hf = make_hf_folder(tmp_path / "hf", "no-special",
                        chat_template=("[{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n"
                                       "{% endfor %}{% if add_generation_prompt %}<s>assistant\n{% endif %}"))
    turns = [{"role": "assistant", "content": "hello there"}, {"role": "user", "content": "hi"},
             {"role": "assistant", "content": "yo"}]
    prepare([write_jsonl(tmp_path / "chat.jsonl", [{"messages": turns}])], tmp_path / "tok", tokenizer=str(hf),
            chat_format="template")
    ids, mask = tokens_and_mask(tmp_path / "tok")
    auto = transformers.AutoTokenizer.from_pretrained(hf)
    assert [auto.decode(s.tolist()) for s in spans(ids, mask)] == ["hello there</s>\n", "yo</s>\n"]
    assert auto.decode(ids[:int(mask.argmax())].tolist()) == "[<s>assistant\n"  # the header: there, not counted


@pytest.mark.parametrize("refusal,message", [
    ("{% if add_generation_prompt %}{{ raise_exception('no generation prompt') }}{% endif %}",
     "no generation prompt"),  # the turns before an answer, rendered with the generation prompt
    ("{% if messages|length == 2 %}{{ raise_exception('two turns') }}{% endif %}", "two turns"),  # through it
], ids=["before-an-answer", "through-an-answer"])
def test_a_template_that_refuses_a_prefix_names_the_record(tmp_path, refusal, message):
    """The whole conversation renders, but one of the prefixes the answers are found by does not: the one
    line still names the record (FILE:LINE)."""
    pytest.importorskip("transformers")
    from test_hf_tokenizer import make_hf_folder

    hf = make_hf_folder(tmp_path / "hf", "no-special",
                        chat_template=refusal + "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
                                                "{% endfor %}")
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    chat = write_jsonl(tmp_path / "chat.jsonl", [{"messages": turns + turns}])
    with pytest.raises(DataError) as refused:
        prepare([chat], tmp_path / "tok", tokenizer=str(hf), chat_format="template")
    assert str(refused.value).startswith(f"{chat}:1: the tokenizer's chat template refuses this conversation "
                                         f"({message})")


HEADERED = ("[{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
            "{% if add_generation_prompt %}<s>assistant\n{% endif %}")
STRICT = ("{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] or m['content'] is not "
          "defined %}{{ raise_exception('a role or a turn it does not know') }}{% endif %}<{{ m['role'] }}>"
          "{{ m['content'] }}|{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.mark.parametrize("template,content,header_end", [
    (HEADERED, "hello", len("[<s>assistant\n")),  # the header the generation prompt writes, in the opening turn
    (HEADERED[1:], "hello", len("<s>assistant\n")),  # ... at the turn's very start
    (HEADERED, "hello <s>assistant\n again", len("[<s>assistant\n")),  # the first of two: the header's own
    (STRICT, "hello", len("<assistant>")),  # a template that checks each turn's role and content
    ("{% for m in messages %}{{ m['content'] }}|{% endfor %}", "hello", 0),  # no header written
    # a header the opening turn does not hold (its own is another): nothing to skip
    ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}|{% endfor %}"
     "{% if add_generation_prompt %}ASSISTANT: {% endif %}", "hello", 0),
    # a generation prompt written before the turns: what it adds is not a suffix, no header is found
    ("{% if add_generation_prompt %}<assistant>{% endif %}{% for m in messages %}<{{ m['role'] }}>"
     "{{ m['content'] }}|{% endfor %}", "hello", 0),
    # ... even where the tail of that render happens to occur in the turn (here "?", the probe's text)
    ("{% if add_generation_prompt %}A{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}", "hello?", 0),
    # a template that refuses a one-turn conversation: no header can be found
    ("{% if messages|length == 1 %}{{ raise_exception('one turn') }}{% endif %}{% for m in messages %}"
     "{{ m['content'] }}|{% endfor %}", None, 0),
], ids=["header", "header-first", "header-twice", "strict-roles", "no-header", "header-elsewhere",
        "prompt-first", "prompt-first-tail-in-turn", "refuses-one-turn"])
def test_an_opening_assistant_turns_header_is_what_the_generation_prompt_adds(tmp_path, template, content,
                                                                              header_end):
    """In process (prepare renders in worker processes): where the content of a conversation's opening
    assistant turn starts, by hand, and the counted tokens that follow from it."""
    pytest.importorskip("transformers")
    from scaletrain.data.chat import ChatRenderer
    from scaletrain.data.tokenizer import HFTokenizer
    from test_hf_tokenizer import make_hf_folder

    chat = ChatRenderer(HFTokenizer.from_hf_folder(make_hf_folder(tmp_path / "hf", "no-special",
                                                                  chat_template=template)), "template")
    turns = [{"role": "assistant", "content": content}, {"role": "user", "content": "hi"}]
    opening = "hello|" if content is None else chat.render(turns[:1], "chat.jsonl:1")
    assert chat._opening_header_end(opening, "chat.jsonl:1") == header_end
    if template == HEADERED and content == "hello":
        assert opening[header_end:] == "hello</s>\n"
        ids, mask = chat(turns, "chat.jsonl:1")
        assert chat.tok.tok.decode(ids[mask.astype(bool)].tolist(), skip_special_tokens=False) == "hello</s>\n"
