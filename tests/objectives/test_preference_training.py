"""Preference training in one process (issue 49): the trainer's loss and gradients against a hand computation
that shares none of its code, the three ways to the reference log-probs giving one result, the metrics, resume,
export and generation of a preference-trained run, and bad input refused in one line."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from scaletrain.bench.preference_task import write_rule_pairs
from scaletrain.data.prepare import prepare
from scaletrain.errors import CheckpointError, ConfigError, DataError
from scaletrain.train.trainer import Trainer

from conftest import micro_cfg, one_line_exit_2, read_metrics, run_here

# 3 accumulated micro-batches of 2 pairs: 12 rows a step, completions and prompts of uneven lengths
PREF = {"train.objective": "preference", "train.global_batch": 6, "train.micro_batch": 2, "train.steps": 4,
        "optim.warmup_steps": 1, "optim.lr": 3e-3, "checkpoint.save_final": False}


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """The rule task (scaletrain.bench.preference_task) prepared with a held-out split; a row or two with an
    uneven completion, so that rows differ in length within a micro-batch."""
    root = tmp_path_factory.mktemp("pairs")
    rows = root / "rows.jsonl"
    write_rule_pairs(rows, 240, seed=3)
    with rows.open("a") as f:
        for i in range(12):
            row = {"prompt": "digits: ", "chosen": "7" * (1 + i % 5), "rejected": "xyz"[: 1 + i % 3]}
            f.write(json.dumps(row) + "\n")
    prepare([rows], root / "data", preference="pairs", val_fraction=0.1)
    return str(root / "data")


@pytest.fixture(scope="module")
def unpaired(tmp_path_factory):
    """KTO's examples: the rule task's completions, each desirable (follows the rule) or not, one of each per pair."""
    from scaletrain.bench.preference_task import rule_pairs

    root = tmp_path_factory.mktemp("unpaired")
    rows = [{"prompt": r["prompt"], "completion": r["chosen"] if i % 3 else r["rejected"][: 3 + i % 6],
             "label": bool(i % 3)} for i, r in enumerate(rule_pairs(240, seed=4))]
    (root / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    prepare([root / "rows.jsonl"], root / "data", preference="unpaired", val_fraction=0.1)
    return str(root / "data")


def cfg_for(tmp_path, data, **extra):
    return micro_cfg(tmp_path, **{**PREF, "data.path": data, **extra})


def completion_logp(model, sequence: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum of log p(token) over the completion's tokens of one sequence, unpadded, from log_softmax."""
    logits = model(sequence[None, :-1])[0].float()
    logp = logits.log_softmax(-1).gather(-1, sequence[1:, None])[:, 0]
    return logp[mask[1:]].sum()


def completion_tokens(mask: torch.Tensor) -> int:
    return int(mask[1:].sum())


def by_hand(policy, reference, examples, loss: str, beta: float) -> torch.Tensor:
    """The mean over pairs, written out: DPO's -log sigmoid(beta (log-ratio chosen - log-ratio rejected)), or
    SimPO's -log sigmoid(beta (mean token log-prob chosen - rejected) - gamma), gamma = 0.5."""
    losses = []
    for ex in examples:
        (c, r), (mc, mr) = ex.sequences, ex.masks
        pc, pr = completion_logp(policy, c, mc), completion_logp(policy, r, mr)
        if loss == "simpo":
            z = beta * (pc / completion_tokens(mc) - pr / completion_tokens(mr)) - 0.5
        else:
            with torch.no_grad():
                ref_c, ref_r = completion_logp(reference, c, mc), completion_logp(reference, r, mr)
            z = beta * ((pc - ref_c) - (pr - ref_r))
        losses.append(-F.logsigmoid(z))
    return torch.stack(losses).mean()


@pytest.mark.parametrize("loss", ["sigmoid", "simpo"])
def test_the_step_loss_and_gradients_equal_the_loss_written_out(tmp_path, pairs, loss):
    """After two steps the policy and the reference differ; step 3's loss and every gradient (3 accumulated
    micro-batches of padded fixed-width rows) equal the loss computed pair by pair on unpadded sequences. (DPO's
    margin cancels the shared prompt; SimPO's per-token mean does not: it sees a prompt counted.)"""
    t = Trainer(cfg_for(tmp_path, pairs, **{"preference.beta": 0.5, "preference.loss": loss}))
    model = t.pm.dp.module
    reference = type(model)(t.cfg.model)
    reference.load_state_dict(model.state_dict())  # the starting weights
    reference.eval()
    batches = t.batches()
    for _ in range(2):
        t.train_step(batches)
        t.state.step += 1
    examples = [t.data.dataset.data[int(i)] for i in t.sampler(2).global_batch_indices(2)]
    t.hooks.begin_step(t.loss_factor())
    loss_value, _ = t.forward_backward(batches)
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    expected = by_hand(model, reference, examples, loss, beta=0.5)
    expected.backward()
    got_loss, want = float(loss_value.detach()), float(expected.detach())
    assert abs(got_loss - want) < 1e-5 * max(1.0, want), (got_loss, want)
    if loss == "sigmoid":
        assert want != pytest.approx(math.log(2), abs=1e-3)  # the policy has moved off the reference
    for n, p in model.named_parameters():
        torch.testing.assert_close(got[n], p.grad, rtol=1e-4, atol=1e-6, msg=n)


def kto_by_hand(policy, reference, dataset, ids, beta: float, weights=(1.0, 1.0)) -> torch.Tensor:
    """KTO written out (Ethayarajh et al. 2024): the KL estimate the mean over the batch of the policy's log-ratio
    on each example's prompt with the next example's completion (no gradient, at least 0); a desirable example
    costs w_d (1 - sigmoid(beta (r - KL))), an undesirable one w_u (1 - sigmoid(beta (KL - r)))."""
    data = dataset.data
    n = len(data)
    with torch.no_grad():
        kls = []
        for i in ids:
            ex, other = data[int(i)], data[(int(i) + 1) % n]
            seq = torch.cat([ex.sequences[0][:ex.prompt_len], other.sequences[0][other.prompt_len:]])
            mask = torch.arange(seq.numel()) >= ex.prompt_len
            kls.append(completion_logp(policy, seq, mask) - completion_logp(reference, seq, mask))
        kl = torch.stack(kls).mean().clamp(min=0)
    losses = []
    for i in ids:
        ex = data[int(i)]
        with torch.no_grad():
            ref = completion_logp(reference, ex.sequences[0], ex.masks[0])
        r = completion_logp(policy, ex.sequences[0], ex.masks[0]) - ref
        losses.append(weights[0] * (1 - torch.sigmoid(beta * (r - kl))) if ex.label else
                      weights[1] * (1 - torch.sigmoid(beta * (kl - r))))
    return torch.stack(losses).mean()


def test_kto_step_loss_and_gradients_equal_kto_written_out(tmp_path, unpaired):
    """From a model trained on the completions' text against its starting weights as the reference: a KL
    estimate well above 0 (it is clamped at 0, where a policy starting at its reference stays at first)."""
    from scaletrain.bench.preference_task import rule_pairs
    from scaletrain.model.hf import load_hf_weights

    from conftest import language_models

    models = language_models(tmp_path, [r["prompt"] + r["chosen"] for r in rule_pairs(60, seed=4)])
    shape = {"model.n_layers": 4, "model.tie_embeddings": False}
    t = Trainer(cfg_for(tmp_path / "kto", unpaired, **{
        "preference.loss": "kto", "preference.beta": 0.5, "preference.undesirable_weight": 1.5, **shape,
        "model.init_from": models["policy"], "preference.reference_from": models["reference"]}))
    model = t.pm.dp.module
    reference = type(model)(t.cfg.model)
    reference.load_state_dict(dict(load_hf_weights(models["reference"], t.cfg.model)), strict=False)
    reference.init_buffers("cpu")
    reference.eval()
    batches = t.batches()
    for _ in range(2):
        t.train_step(batches)
        t.state.step += 1
    ids = t.sampler(2).global_batch_indices(2)
    t.hooks.begin_step(t.loss_factor())
    loss_value, _ = t.forward_backward(batches)
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    expected = kto_by_hand(model, reference, t.data.dataset, ids, beta=0.5, weights=(1.0, 1.5))
    expected.backward()
    assert t.objective.window.metrics["kl"].value() > 0.1  # the KL counts
    assert float(loss_value.detach()) == pytest.approx(float(expected.detach()), rel=1e-5)
    for n, p in model.named_parameters():
        torch.testing.assert_close(got[n], p.grad, rtol=1e-4, atol=1e-6, msg=n)


def test_kto_learns_which_completions_are_desirable(tmp_path, unpaired):
    cfg = cfg_for(tmp_path, unpaired, **{"preference.loss": "kto", "train.steps": 20, "train.global_batch": 16,
                                         "train.micro_batch": 16, "train.eval_every": 20, "train.eval_batches": 1})
    t = Trainer(cfg)
    first = t.evaluate()
    history = t.fit()["history"]
    last = history[-1]
    assert first["val_rewards/chosen"] == 0.0 == first["val_rewards/rejected"]  # the policy is the reference
    assert last["val_rewards/chosen"] > last["val_rewards/rejected"] + 1.0, last  # held out: desirable ones rise
    assert last["loss"] < history[0]["loss"]


@pytest.mark.parametrize("loss", ["sigmoid", "ipo", "kto"])
def test_the_three_reference_modes_give_one_run(tmp_path, pairs, unpaired, loss):
    """A frozen copy, the adapters switched off, and the pass before the first step: the same losses, gradient
    norms and held-out metrics (LoRA, whose adapters start at zero: the base is the starting policy)."""
    runs = {}
    for mode in ("model", "adapters", "precomputed"):
        cfg = cfg_for(tmp_path / mode, unpaired if loss == "kto" else pairs, **{
            "adapter.kind": "lora", "preference.reference": mode, "preference.loss": loss, "train.eval_every": 2,
            "train.eval_batches": 2})
        runs[mode] = Trainer(cfg).fit()["history"]
    for mode in ("adapters", "precomputed"):
        for a, b in zip(runs[mode], runs["model"]):
            for key in ("loss", "grad_norm", "val_loss", "val_rewards/margins", "val_rewards/chosen", "kl"):
                if key in b:
                    assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), (mode, a["step"], key)
    assert (tmp_path / "precomputed" / "run" / "reference_logps.pt").exists()
    assert runs["model"][-1]["loss"] != pytest.approx(runs["model"][0]["loss"])  # it trained


def test_the_metrics_rows_and_the_summary(tmp_path, pairs, capsys):
    """Every logged row holds the pairs' rewards, margins, accuracy and log-probs; the margin is the chosen's
    reward less the rejected's; the held-out split is evaluated and the summary reports its accuracy."""
    cfg = cfg_for(tmp_path, pairs, **{"train.eval_every": 4, "train.eval_batches": 2, "log.summary": True})
    Trainer(cfg).fit()
    rows = read_metrics(tmp_path / "run")
    for row in rows:
        assert row["rewards/margins"] == pytest.approx(row["rewards/chosen"] - row["rewards/rejected"], abs=1e-5)
        assert 0.0 <= row["rewards/accuracies"] <= 1.0
        assert row["logps/chosen"] < 0 and row["logps/rejected"] < 0
    assert rows[0]["rewards/margins"] == 0.0 and rows[0]["loss"] == pytest.approx(math.log(2))  # policy = reference
    last = rows[-1]
    assert {"val_loss", "val_rewards/accuracies", "val_rewards/margins"} <= set(last) and "val_ppl" not in last
    summary = [line for line in capsys.readouterr().out.splitlines() if "held-out preference accuracy" in line]
    assert len(summary) == 1 and summary[0].endswith(f"{100 * last['val_rewards/accuracies']:.1f}%"), summary


def test_it_learns_the_rule_on_held_out_pairs(tmp_path, pairs):
    """The rule task: held-out preference accuracy from 0 (the reference ties every pair) to above 90%."""
    cfg = cfg_for(tmp_path, pairs, **{"train.steps": 25, "train.global_batch": 16, "train.micro_batch": 16,
                                      "train.eval_every": 25, "train.eval_batches": 1, "optim.warmup_steps": 3})
    history = Trainer(cfg).fit()["history"]
    assert history[-1]["val_rewards/accuracies"] > 0.9, history[-1]


def test_a_preference_run_resumes_bitwise(tmp_path, pairs):
    """Stopped after step 2 and resumed: steps 3 and 4 as in one go, the reference rebuilt (model) or read back
    from the run folder (precomputed)."""
    from conftest import run_until

    for mode in ("model", "precomputed"):
        whole = Trainer(cfg_for(tmp_path / f"whole-{mode}", pairs, **{"preference.reference": mode})).fit()["history"]
        cfg = cfg_for(tmp_path / f"cut-{mode}", pairs, **{"preference.reference": mode, "checkpoint.resume": "auto"})
        run_until(cfg, 2)
        resumed = Trainer(cfg).fit()["history"]
        assert [r["loss"] for r in resumed if r["step"] > 2] == [r["loss"] for r in whole if r["step"] > 2], mode


def test_export_generate_and_eval_of_a_preference_run(tmp_path, pairs):
    cfg = cfg_for(tmp_path, pairs, **{"checkpoint.save_final": True, "train.eval_every": 4, "train.eval_batches": 2})
    Trainer(cfg).fit()
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000004"
    r = run_here("export", str(ckpt), "--format", "hf", "--out", str(tmp_path / "hf"))
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "hf" / "config.json").exists()
    r = run_here("generate", str(ckpt), "--prompt", "digits: ", "--max-new-tokens", "8")
    assert r.returncode == 0 and r.stdout.strip(), r.stderr
    r = run_here("eval", str(ckpt), "--json")  # the held-out pairs as the run evaluated them at its last step
    assert r.returncode == 0, r.stderr
    got, logged = json.loads(r.stdout), read_metrics(tmp_path / "run")[-1]
    for key in ("val_loss", "val_rewards/accuracies", "val_rewards/margins", "val_logps/chosen"):
        assert got[key] == pytest.approx(logged[key], rel=1e-5, abs=1e-6), key


# ---- bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize("extra, fragment", [
    ({"preference.beta": 0.0}, "preference.beta=0 must be above 0"),
    ({"preference.reference": "adapters"}, "preference.reference=adapters takes the reference log-probs"),
    ({"train.batch_rampup": "2,2,100"}, "train.batch_rampup is not used by train.objective=preference"),
    ({"fault_tolerance.enabled": True}, "fault_tolerance.enabled with train.objective=preference"),
])
def test_bad_settings_are_one_line(tmp_path, pairs, extra, fragment):
    with pytest.raises(ConfigError, match=fragment.replace(".", r"\.").replace("(", r"\(")):
        cfg_for(tmp_path, pairs, **extra)


def test_kto_needs_unpaired_examples_and_the_paired_losses_pairs(tmp_path, pairs, unpaired):
    with pytest.raises(ConfigError, match="preference.loss=kto trains on unpaired examples, and .* holds pairs"):
        Trainer(cfg_for(tmp_path / "a", pairs, **{"preference.loss": "kto"}))
    with pytest.raises(ConfigError, match="preference.loss=sigmoid trains on pairs, and .* holds unpaired"):
        Trainer(cfg_for(tmp_path / "b", unpaired))


def test_text_data_short_windows_and_the_cli_are_one_line_exit_2(tmp_path, pairs):
    with pytest.raises(ConfigError, match="set data.path to it"):
        Trainer(micro_cfg(tmp_path, **PREF))  # the built-in text is no preference data
    with pytest.raises(DataError, match="raise data.seq_len to at least"):
        Trainer(cfg_for(tmp_path, pairs, **{"data.seq_len": 12}))
    r = run_here("train", f"--data.path={pairs}", "--train.objective=preference", "--preference.beta=-1",
                 f"--log.run_dir={tmp_path / 'cli'}")
    one_line_exit_2(r, "preference.beta")
    assert not (tmp_path / "cli").exists()


def test_a_reference_from_another_model_is_that_models_log_probs(tmp_path, pairs):
    """preference.reference_from: the frozen copy holds the given weights (here a trained run's, exported), so
    the first step's loss is DPO against that model, not ln 2; one of other shapes or tokenizer is one line."""
    Trainer(cfg_for(tmp_path / "sft", pairs, **{"checkpoint.save_final": True})).fit()
    export = tmp_path / "sft.safetensors"
    assert run_here("export", str(tmp_path / "sft" / "run"), "--out", str(export)).returncode == 0
    t = Trainer(cfg_for(tmp_path / "dpo", pairs, **{"preference.reference_from": str(export)}))
    model = t.pm.dp.module
    reference = type(model)(t.cfg.model)
    from safetensors.torch import load_file

    from scaletrain.model.hf import load_hf_weights

    reference.load_state_dict(dict(load_hf_weights(str(export), t.cfg.model)), strict=False)
    reference.init_buffers("cpu")
    reference.eval()
    assert load_file(str(export))  # a plain safetensors file
    examples = [t.data.dataset.data[int(i)] for i in t.sampler(0).global_batch_indices(0)]
    t.hooks.begin_step(t.loss_factor())
    got, _ = t.forward_backward(t.batches())
    want = by_hand(model, reference, examples, "sigmoid", beta=0.1)
    assert float(got.detach()) == pytest.approx(float(want.detach()), rel=1e-5)
    assert float(want) != pytest.approx(math.log(2), abs=1e-3)
    t.folder.release()
    with pytest.raises(CheckpointError, match=r"tok_emb.weight has shape \(256, 64\), the model expects \(256, 32\)"):
        Trainer(cfg_for(tmp_path / "wide", pairs, **{"preference.reference_from": str(export), "model.dim": 32,
                                                     "model.n_heads": 2}))
    with pytest.raises(ConfigError, match="preference.reference_from=.* gives the weights of a frozen reference copy"):
        cfg_for(tmp_path, pairs, **{"preference.reference_from": str(export), "preference.loss": "simpo"})


def test_a_lora_preference_run_exports_its_adapters_for_peft(tmp_path, pairs):
    """On a Hugging Face base (a run exported as one): PEFT's adapter folder, loaded back by `generate`."""
    llama = {"model.norm": "rmsnorm", "model.activation": "swiglu", "model.position": "rope"}
    Trainer(cfg_for(tmp_path / "base", pairs, **{"checkpoint.save_final": True, "train.steps": 1, **llama})).fit()
    assert run_here("export", str(tmp_path / "base" / "run"), "--format", "hf", "--out",
                    str(tmp_path / "hf")).returncode == 0
    Trainer(cfg_for(tmp_path, pairs, **{"adapter.kind": "lora", "checkpoint.save_final": True, "train.steps": 2,
                                        "model.from_hf": str(tmp_path / "hf"),
                                        "model.init_from": str(tmp_path / "hf")})).fit()
    r = run_here("export", str(tmp_path / "run"), "--format", "peft", "--out", str(tmp_path / "peft"))
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "peft" / "adapter_config.json").exists()
    r = run_here("generate", str(tmp_path / "peft"), "--prompt", "digits: ", "--max-new-tokens", "4")
    assert r.returncode == 0 and r.stdout.strip(), r.stderr


def test_a_reference_trained_with_another_tokenizer_is_one_line(tmp_path, pairs):
    """A reference whose token ids mean other text (a BPE vocabulary against the pairs' bytes): refused before
    anything is read, naming the option."""
    from scaletrain.bench.preference_task import rule_pairs

    text = tmp_path / "text.txt"
    text.write_text("".join(r["prompt"] + r["chosen"] + "\n" for r in rule_pairs(200, seed=9)) * 5)
    prepare([text], tmp_path / "bpe", tokenizer="bpe", vocab_size=300)
    Trainer(micro_cfg(tmp_path / "other", **{"data.path": str(tmp_path / "bpe"), "model.vocab_size": 300,
                                             "train.steps": 1, "checkpoint.save_final": True})).fit()
    export = tmp_path / "other.safetensors"
    assert run_here("export", str(tmp_path / "other" / "run"), "--out", str(export)).returncode == 0
    with pytest.raises(DataError, match="preference.reference_from .* was trained with another tokenizer"):
        Trainer(cfg_for(tmp_path / "dpo", pairs, **{"preference.reference_from": str(export)}))
