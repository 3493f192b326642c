"""Preference losses (issue 49, scaletrain.model.preference): each held to TRL 1.16's trainers on a tiny
random Llama (loss and every parameter's gradient, fp32), known answers worked out by hand, the
prompt never counted, and the reduction contract over uneven micro-batches."""

from __future__ import annotations

import contextlib
import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from scaletrain.config import PreferenceConfig, preference_config
from scaletrain.errors import ConfigError
from scaletrain.model.preference import (
    Mean,
    combined,
    dpo_loss,
    hinge_loss,
    ipo_loss,
    kl_completions,
    kto_kl,
    kto_loss,
    orpo_loss,
    preference_loss,
    robust_dpo_loss,
    sequence_logps,
    simpo_loss,
    token_logps,
)

TOL = 1e-5  # fp32, loss and gradients, relative to their size where that is above 1 (IPO's loss is ~25)
VOCAB = 64

# prompt, chosen and rejected lengths of uneven sizes: a one-token completion, a prompt longer than both
SHAPES = [(3, 4, 2), (5, 1, 5), (2, 6, 3), (4, 3, 3)]


def examples(seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    draw = lambda n: torch.randint(1, VOCAB, (n,), generator=g).tolist()  # 0 is the pad
    return [{"prompt_ids": draw(p), "chosen_ids": draw(c), "rejected_ids": draw(r)} for p, c, r in SHAPES]


# ------------------------------------------------------------------------------------------
# TRL's side: its trainers' loss methods called on a stub holding the attributes they read


def trl():
    return pytest.importorskip("trl", minversion="1.16")


def tiny_llama(seed: int):
    transformers = pytest.importorskip("transformers")
    from trl.trainer.utils import add_fused_lm_head

    torch.manual_seed(seed)
    # a wide initialisation, so that the log-probabilities are far from uniform and the losses far from log 2
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      initializer_range=0.3)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # TRL's DPO and KTO trainers read log-probabilities from their fused LM head (logits otherwise unchanged)
    add_fused_lm_head(model, outputs=("log_probs", "entropy", "mean_logits", "is_top1"))
    return model


class Accelerator:
    """What TRL's loss methods ask of accelerate on one process."""

    device = torch.device("cpu")

    def gather_for_metrics(self, x):
        return x

    gather = gather_for_metrics

    def unwrap_model(self, model):
        return model

    def autocast(self):
        return contextlib.nullcontext()


def stub(trainer_cls, methods=(), static=(), **attrs):
    """An object with the given attributes and trainer_cls's methods, in place of a trainer built around a
    dataset, a tokenizer and accelerate: the methods run TRL's own code."""
    body = {m: getattr(trainer_cls, m) for m in methods} | {m: staticmethod(getattr(trainer_cls, m)) for m in static}
    obj = type("Stub", (), body)()
    defaults = dict(accelerator=Accelerator(), aux_loss_enabled=False, precompute_ref_logps=False,
                    args=SimpleNamespace(gradient_checkpointing_kwargs=None, discopop_tau=0.05),
                    _metrics={"train": defaultdict(list), "eval": defaultdict(list)}, _total_train_tokens=0,
                    _tp_size=1, is_encoder_decoder=False, pad_token_id=0, padding_value=0, alpha=0.0,
                    store_metrics=lambda *a, **k: None)
    for k, v in (defaults | attrs).items():
        setattr(obj, k, v)
    return obj


def grads(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def differences(a_loss, a_grads, b_loss, b_grads) -> dict[str, float]:
    """The largest differences of the loss and of any gradient entry, and the sizes they are measured against."""
    assert a_grads.keys() == b_grads.keys() and len(a_grads) > 0
    grad = max(g.abs().max().item() for g in a_grads.values())
    assert grad > 1e-3  # gradients worth comparing
    return {"loss": a_loss.item(), "dloss": abs(a_loss.item() - b_loss.item()), "grad": grad,
            "dgrad": max((a_grads[n] - b_grads[n]).abs().max().item() for n in a_grads)}


def paired_batch(exs):
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    return DataCollatorForPreference(pad_token_id=0)([dict(e) for e in exs])


def our_paired_sums(model, batch, ref=None):
    """Our side: logits from the model's plain forward, our log-probabilities of the completions."""
    ids, attn, comp = batch["input_ids"], batch["attention_mask"], batch["completion_mask"]
    with torch.no_grad() if ref else contextlib.nullcontext():
        logits = (ref or model)(input_ids=ids, attention_mask=attn).logits
    sums, counts = sequence_logps(logits[:, :-1], ids[:, 1:], comp[:, 1:])
    return sums.chunk(2), counts.chunk(2), logits


DPO_FAMILY = {  # TRL's DPOTrainer loss_type -> ours, with label_smoothing
    "sigmoid": (0.0, lambda c, r, rc, rr, n, beta, eps: dpo_loss(c, r, rc, rr, beta=beta)),
    "robust": (0.1, lambda c, r, rc, rr, n, beta, eps: robust_dpo_loss(c, r, rc, rr, beta=beta, label_smoothing=eps)),
    "hinge": (0.0, lambda c, r, rc, rr, n, beta, eps: hinge_loss(c, r, rc, rr, beta=beta)),
    "ipo": (0.0, lambda c, r, rc, rr, n, beta, eps: ipo_loss(c, r, rc, rr, *n, beta=beta)),
}


def compare_dpo(loss_type: str, beta: float = 0.1):
    from trl.trainer.dpo_trainer import DPOTrainer

    eps, ours = DPO_FAMILY[loss_type]
    policy, ref = tiny_llama(0), tiny_llama(1)
    batch = paired_batch(examples())
    s = stub(DPOTrainer, model=policy, ref_model=ref, ld_alpha=None, f_divergence_type="reverse_kl",
             f_alpha_divergence_coef=0.5, loss_types=[loss_type], loss_weights=[1.0], beta=beta,
             label_smoothing=eps, use_weighting=False)
    theirs = DPOTrainer._compute_loss(s, policy, batch, return_outputs=False)
    theirs.backward()
    their_grads = grads(policy)

    (c, r), (nc, nr), _ = our_paired_sums(policy, batch)
    (rc, rr), _, _ = our_paired_sums(policy, batch, ref=ref)
    got = ours(c, r, rc, rr, (nc, nr), beta, eps)
    mine = got.loss.total / len(SHAPES)  # the contract: a sum, divided by the global batch's pairs
    mine.backward()
    m = s._metrics["train"]
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"):
        assert got.metrics[name].value().item() == pytest.approx(m[name][-1], abs=TOL), name
    return differences(theirs, their_grads, mine, grads(policy))


def cpo_batch(exs, labels_from_prompt=False):
    """CPO's and ORPO's tokenized rows: prompt + completion, the prompt's labels -100, right-padded."""
    out = {}
    for side in ("chosen", "rejected"):
        rows = [e["prompt_ids"] + e[f"{side}_ids"] for e in exs]
        width = max(map(len, rows))
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        attn = torch.zeros_like(ids)
        labels = torch.full_like(ids, -100)
        for i, (e, row) in enumerate(zip(exs, rows)):
            ids[i, :len(row)], attn[i, :len(row)] = torch.tensor(row), 1
            labels[i, len(e["prompt_ids"]):len(row)] = torch.tensor(e[f"{side}_ids"])
        out |= {f"{side}_input_ids": ids, f"{side}_attention_mask": attn, f"{side}_labels": labels}
    return out


def cpo_stub(trainer_cls, **attrs):
    return stub(trainer_cls, methods=("concatenated_forward", "get_batch_loss_metrics",
                                      "cpo_loss" if trainer_cls.__name__ == "CPOTrainer" else "odds_ratio_loss"),
                static=("concatenated_inputs", "get_batch_logps"), **attrs)


def our_side_sums(model, rows, side):
    ids, attn, labels = rows[f"{side}_input_ids"], rows[f"{side}_attention_mask"], rows[f"{side}_labels"]
    logits = model(input_ids=ids, attention_mask=attn).logits
    completion = sequence_logps(logits[:, :-1], ids[:, 1:], labels[:, 1:] != -100)
    attended = sequence_logps(logits[:, :-1], ids[:, 1:], attn[:, 1:])  # ORPO's NLL: the prompt's tokens too
    return completion, attended


def compare_simpo(beta: float = 0.1, gamma: float = 0.5, label_smoothing: float = 0.0):
    from trl.experimental.cpo.cpo_trainer import CPOTrainer

    policy = tiny_llama(0)
    rows = cpo_batch(examples())
    s = cpo_stub(CPOTrainer, loss_type="simpo", cpo_alpha=0.0, beta=beta, simpo_gamma=gamma,
                 label_smoothing=label_smoothing)
    theirs, their_metrics = CPOTrainer.get_batch_loss_metrics(s, policy, rows)
    theirs.backward()
    their_grads = grads(policy)
    ((c, nc), _), ((r, nr), _) = our_side_sums(policy, rows, "chosen"), our_side_sums(policy, rows, "rejected")
    got = simpo_loss(c, r, nc, nr, beta=beta, gamma=gamma, label_smoothing=label_smoothing)
    mine = got.loss.total / len(SHAPES)
    mine.backward()
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"):
        assert got.metrics[name].value().item() == pytest.approx(their_metrics[name], abs=TOL), name
    return differences(theirs, their_grads, mine, grads(policy))


def compare_orpo(beta: float = 0.1):
    from trl.experimental.orpo.orpo_trainer import ORPOTrainer

    policy = tiny_llama(0)
    rows = cpo_batch(examples())
    s = cpo_stub(ORPOTrainer, beta=beta)
    theirs, their_metrics = ORPOTrainer.get_batch_loss_metrics(s, policy, rows)
    theirs.backward()
    their_grads = grads(policy)
    ((c, nc), (lp, nt)), ((r, nr), _) = our_side_sums(policy, rows, "chosen"), our_side_sums(policy, rows, "rejected")
    got = orpo_loss(c, r, nc, nr, -lp.sum(), nt.sum(), beta=beta)
    mine = got.loss.total / len(SHAPES) + got.nll.total / got.nll.count  # both terms over the global batch
    mine.backward()
    for name in ("rewards/chosen", "rewards/rejected", "log_odds_ratio", "log_odds_chosen"):
        assert got.metrics[name].value().item() == pytest.approx(their_metrics[name], abs=TOL), name
    assert got.nll.value().item() == pytest.approx(their_metrics["nll_loss"], abs=TOL)
    return differences(theirs, their_grads, mine, grads(policy))


LABELS = [True, False, False, True, True]  # desirable or not: unpaired and unbalanced


def kto_examples():
    g = torch.Generator().manual_seed(5)
    shapes = [(3, 4), (2, 1), (5, 3), (1, 6), (4, 2)]
    exs = [{"prompt_ids": torch.randint(1, VOCAB, (p,), generator=g).tolist(),
            "completion_ids": torch.randint(1, VOCAB, (c,), generator=g).tolist(), "label": lab}
           for (p, c), lab in zip(shapes, LABELS)]
    for e, kl in zip(exs, kl_completions([e["completion_ids"] for e in exs])):
        e["KL_completion_ids"] = kl
    return exs


def compare_kto(beta: float = 0.1, desirable_weight: float = 1.0, undesirable_weight: float = 1.0):
    from trl.trainer.kto_trainer import DataCollatorForUnpairedPreference, KTOTrainer

    policy, ref = tiny_llama(0), tiny_llama(1)
    batch = DataCollatorForUnpairedPreference(pad_token_id=0)(kto_examples())
    s = stub(KTOTrainer, methods=("_compute_kl_logps",), model=policy, ref_model=ref, calculate_KL=True,
             loss_type="kto", beta=beta, desirable_weight=desirable_weight, undesirable_weight=undesirable_weight)
    theirs = KTOTrainer._compute_loss(s, policy, batch, return_outputs=False)
    theirs.backward()
    their_grads = grads(policy)

    def sums(model, prefix, grad):
        ids, attn, comp = (batch[prefix + k] for k in ("input_ids", "attention_mask", "completion_mask"))
        with contextlib.nullcontext() if grad else torch.no_grad():
            logits = model(input_ids=ids, attention_mask=attn).logits
        return sequence_logps(logits[:, :-1], ids[:, 1:], comp[:, 1:])[0]

    kl = kto_kl(sums(policy, "KL_", False), sums(ref, "KL_", False)).value().clamp(min=0)
    got = kto_loss(sums(policy, "", True), sums(ref, "", False), batch["label"], kl, beta=beta,
                   desirable_weight=desirable_weight, undesirable_weight=undesirable_weight)
    mine = got.loss.total / len(LABELS)
    mine.backward()
    m = s._metrics["train"]
    assert kl.item() == pytest.approx(m["kl"][-1], abs=TOL)
    for name in ("rewards/chosen", "rewards/rejected"):
        assert got.metrics[name].value().item() == pytest.approx(m[name][-1], abs=TOL), name
    return differences(theirs, their_grads, mine, grads(policy))


def compare_cdpo(beta: float = 0.1, label_smoothing: float = 0.2):
    """cDPO: TRL 1.16's DPOTrainer no longer smooths its sigmoid loss; its CPOTrainer's "sigmoid" keeps the
    conservative form, which on the log-ratios (the reference's log-probabilities subtracted) is cDPO."""
    from trl.experimental.cpo.cpo_trainer import CPOTrainer

    policy, ref = tiny_llama(0), tiny_llama(1)
    batch = paired_batch(examples())
    (c, r), _, _ = our_paired_sums(policy, batch)
    (rc, rr), _, _ = our_paired_sums(policy, batch, ref=ref)
    s = stub(CPOTrainer, loss_type="sigmoid", beta=beta, label_smoothing=label_smoothing)
    theirs = CPOTrainer.cpo_loss(s, c - rc, r - rr)[0].mean()
    theirs.backward()
    their_grads = grads(policy)
    (c, r), _, _ = our_paired_sums(policy, batch)
    mine = dpo_loss(c, r, rc, rr, beta=beta, label_smoothing=label_smoothing).loss.total / len(SHAPES)
    mine.backward()
    return differences(theirs, their_grads, mine, grads(policy))


COMPARISONS = {
    "sigmoid": lambda: compare_dpo("sigmoid"),
    "sigmoid-beta0.5": lambda: compare_dpo("sigmoid", beta=0.5),
    "cdpo-label_smoothing0.2": compare_cdpo,
    "robust-label_smoothing0.1": lambda: compare_dpo("robust"),
    "hinge": lambda: compare_dpo("hinge"),
    "hinge-beta0.5": lambda: compare_dpo("hinge", beta=0.5),  # two of the four pairs past the hinge (Δ > 1/β = 2)
    "ipo": lambda: compare_dpo("ipo"),
    "simpo": compare_simpo,
    "simpo-beta2-gamma1.4-ls0.1": lambda: compare_simpo(beta=2.0, gamma=1.4, label_smoothing=0.1),
    "orpo": compare_orpo,
    "orpo-beta0.5": lambda: compare_orpo(beta=0.5),
    "kto": compare_kto,
    "kto-weights1.3,0.7": lambda: compare_kto(desirable_weight=1.3, undesirable_weight=0.7),
}


@pytest.mark.parametrize("name", COMPARISONS)
def test_loss_and_gradients_match_trl(name):
    trl()
    d = COMPARISONS[name]()
    assert d["dloss"] <= TOL * max(1.0, abs(d["loss"])) and d["dgrad"] <= TOL * max(1.0, d["grad"]), d


def test_sequence_logps_match_trl_fused_head_and_batch_logps():
    """Our completion log-probabilities against TRL's two computations: the fused LM head of its DPO and KTO
    trainers, and CPO's and ORPO's get_batch_logps over the concatenated forward's logits."""
    trl()
    from trl.experimental.cpo.cpo_trainer import CPOTrainer

    policy = tiny_llama(0)
    batch = paired_batch(examples())
    ids, attn, comp = batch["input_ids"], batch["attention_mask"], batch["completion_mask"]
    with torch.no_grad():
        labels = ids.masked_fill(comp == 0, -100)
        fused = policy(input_ids=ids, attention_mask=attn, labels=labels, fused_lm_head=True).log_probs.sum(-1)
        logits = policy(input_ids=ids, attention_mask=attn).logits
        mine, counts = sequence_logps(logits[:, :-1], ids[:, 1:], comp[:, 1:])
        batched = CPOTrainer.get_batch_logps(logits, labels)
        mean = CPOTrainer.get_batch_logps(logits, labels, average_log_prob=True)
    torch.testing.assert_close(mine, fused, atol=TOL, rtol=0)
    torch.testing.assert_close(mine, batched, atol=TOL, rtol=0)
    torch.testing.assert_close(mine / counts, mean, atol=TOL, rtol=0)
    assert counts.tolist() == [c for _, c, _ in SHAPES] + [r for _, _, r in SHAPES]


# ------------------------------------------------------------------------------------------
# Known answers, independent of TRL


def logps(*values):
    return torch.tensor(values, dtype=torch.float32)


def test_dpo_with_every_logp_equal_is_log_2():
    x = logps(-3.0, -7.0, -1.5)
    out = dpo_loss(x, x, x, x)
    assert out.loss.value().item() == pytest.approx(math.log(2), abs=1e-7)
    assert out.metrics["rewards/margins"].value().item() == 0 and out.metrics["rewards/accuracies"].value() == 0
    # cDPO at the same point: log 2 whatever ε, since σ(0) = 1/2 either way; robust DPO too
    assert dpo_loss(x, x, x, x, label_smoothing=0.3).loss.value().item() == pytest.approx(math.log(2), abs=1e-7)
    assert robust_dpo_loss(x, x, x, x, label_smoothing=0.3).loss.value().item() == pytest.approx(math.log(2), abs=1e-6)


def test_dpo_by_hand():
    # β = 0.5, log-ratios 2 (chosen) and -2 (rejected): -log σ(0.5 × 4) = log(1 + e^-2)
    out = dpo_loss(logps(-1.0), logps(-6.0), logps(-3.0), logps(-4.0), beta=0.5)
    assert out.loss.value().item() == pytest.approx(math.log1p(math.exp(-2)), abs=1e-7)
    assert out.metrics["rewards/chosen"].value().item() == pytest.approx(1.0)
    assert out.metrics["rewards/rejected"].value().item() == pytest.approx(-1.0)
    assert out.metrics["rewards/accuracies"].value().item() == 1.0
    # reference-free: the log-probabilities alone; Δ = 5, -log σ(2.5)
    free = dpo_loss(logps(-1.0), logps(-6.0), beta=0.5)
    assert free.loss.value().item() == pytest.approx(math.log1p(math.exp(-2.5)), abs=1e-7)
    # cDPO, ε = 0.25: 0.75 log(1 + e^-2) + 0.25 log(1 + e^2)
    smooth = dpo_loss(logps(-1.0), logps(-6.0), logps(-3.0), logps(-4.0), beta=0.5, label_smoothing=0.25)
    assert smooth.loss.value().item() == pytest.approx(0.75 * math.log1p(math.exp(-2)) + 0.25 * math.log1p(math.exp(2)))
    # robust, ε = 0.25: (0.75 log(1 + e^-2) - 0.25 log(1 + e^2)) / 0.5
    robust = robust_dpo_loss(logps(-1.0), logps(-6.0), logps(-3.0), logps(-4.0), beta=0.5, label_smoothing=0.25)
    assert robust.loss.value().item() == pytest.approx((0.75 * math.log1p(math.exp(-2))
                                                        - 0.25 * math.log1p(math.exp(2))) / 0.5)


def test_hinge_is_zero_past_a_margin_of_one_over_beta():
    beta, ref = 0.25, logps(-5.0, -5.0, -5.0)
    out = hinge_loss(logps(-1.0, 0.0, -3.0), logps(-5.0, -5.0, -5.0), ref, ref, beta=beta)  # margins 4 = 1/β, 5, 2
    assert out.loss.total.item() == pytest.approx(0.5)  # only the last: 1 - β × 2
    free = hinge_loss(logps(-1.0), logps(-9.0), beta=beta)  # reference-free, margin 8
    assert free.loss.value().item() == 0.0


def test_ipo_is_zero_at_its_target_margin_per_token():
    # β = τ = 0.5: the target per-token margin 1/(2τ) = 1; chosen 3 tokens with log-ratio 3, rejected 2 tokens 0
    tokens = logps(3.0), logps(2.0)
    at = ipo_loss(logps(-1.0), logps(-4.0), logps(-4.0), logps(-4.0), *tokens, beta=0.5)
    assert at.loss.value().item() == pytest.approx(0.0, abs=1e-12)
    # per-token margin 0: the loss is the square of the target, 1
    off = ipo_loss(logps(-4.0), logps(-4.0), logps(-4.0), logps(-4.0), *tokens, beta=0.5)
    assert off.loss.value().item() == pytest.approx(1.0)


def test_simpo_by_hand():
    # means -1 (chosen, 4 tokens) and -2 (rejected, 2): -log σ(β × 1 - γ) with β = 2, γ = 0.5
    out = simpo_loss(logps(-4.0), logps(-4.0), logps(4.0), logps(2.0), beta=2.0, gamma=0.5)
    assert out.loss.value().item() == pytest.approx(math.log1p(math.exp(-1.5)))
    assert out.metrics["rewards/chosen"].value().item() == pytest.approx(-2.0)


def test_orpo_by_hand():
    # mean log-probs log 0.5 (odds 1) and log 0.2 (odds 1/4): log odds ratio log 4
    c, r = logps(2 * math.log(0.5)), logps(3 * math.log(0.2))
    out = orpo_loss(c, r, logps(2.0), logps(3.0), torch.tensor(6.0), 4, beta=0.1)
    want_or = -0.1 * math.log(4 / 5)  # -λ log σ(log 4) = -λ log(4/5)
    assert out.loss.value().item() == pytest.approx(want_or, rel=1e-6)
    assert out.value().item() == pytest.approx(want_or + 6.0 / 4, rel=1e-6)
    assert out.metrics["log_odds_chosen"].value().item() == pytest.approx(math.log(4), rel=1e-6)


def test_kto_by_hand():
    # log-ratios 1 (desirable) and -1 (undesirable), KL 0.5, β = 1: 1 - σ(0.5) and 1 - σ(1.5), weights 2 and 1
    out = kto_loss(logps(0.0, -3.0), logps(-1.0, -2.0), torch.tensor([True, False]), torch.tensor(0.5),
                   beta=1.0, desirable_weight=2.0)
    sig = lambda z: 1 / (1 + math.exp(-z))
    assert out.loss.value().item() == pytest.approx((2 * (1 - sig(0.5)) + (1 - sig(1.5))) / 2)
    assert out.metrics["rewards/chosen"].value().item() == 1.0
    assert out.metrics["rewards/rejected"].value().item() == -1.0
    # the KL estimate: the mean over the mismatched pairs, clamped at 0 by the caller
    assert kto_kl(logps(-1.0, -2.0), logps(-2.0, -1.0)).value().item() == 0.0
    assert kl_completions([[1], [2, 2], [3]]) == [[3], [1], [2, 2]]


@pytest.mark.parametrize("loss", ["sigmoid", "ipo", "hinge", "simpo", "orpo"])
def test_a_step_raises_the_chosen_over_the_rejected(loss):
    """Direction: a gradient step on the loss moves the chosen's log-probability up relative to the
    rejected's, on a model whose logits are a table of parameters."""
    torch.manual_seed(0)
    table = torch.randn(6, VOCAB, requires_grad=True)
    mask = torch.tensor([[0, 0, 0, 1, 1, 1]])  # a prompt of 3, completions of 3
    chosen, rejected = torch.tensor([[5, 9, 2, 7, 1, 3]]), torch.tensor([[5, 9, 2, 8, 8, 4]])

    def sums():
        (c, n), (r, _) = (sequence_logps(table[None], t, mask) for t in (chosen, rejected))
        return {"chosen": c, "rejected": r, "chosen_tokens": n, "rejected_tokens": n, "nll": -c.sum(),
                "nll_tokens": 3}

    with torch.no_grad():
        reference = {k: v for k, v in sums().items() if k in ("chosen", "rejected")}
        before = reference["chosen"] - reference["rejected"]
    preference_loss(PreferenceConfig(loss=loss), sums(), reference).value().backward()
    with torch.no_grad():
        table -= 0.5 * table.grad
        after = sums()
    assert (after["chosen"] - after["rejected"]).item() > before.item() + 1e-3


def test_the_prompt_and_padding_are_never_counted():
    torch.manual_seed(1)
    logits = torch.randn(2, 7, VOCAB)
    targets = torch.randint(0, VOCAB, (2, 7))
    mask = torch.tensor([[0, 0, 1, 1, 1, 0, 0], [0, 0, 0, 0, 1, 1, 1]])
    sums, counts = sequence_logps(logits, targets, mask)
    assert counts.tolist() == [3, 3]
    # anything at a masked position (another token, the ignore index, other logits) changes nothing
    noisy_targets = torch.where(mask == 1, targets, -100)
    noisy_logits = torch.where(mask.unsqueeze(-1) == 1, logits, 1e4 * torch.randn_like(logits))
    torch.testing.assert_close(sequence_logps(noisy_logits, noisy_targets, mask)[0], sums, atol=0, rtol=0)
    by_hand = torch.log_softmax(logits.double(), -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(sums.double(), (by_hand * mask).sum(-1), atol=1e-5, rtol=0)
    per_token = token_logps(logits, targets, mask)
    assert (per_token[mask == 0] == 0).all()


def test_sequence_logps_of_uneven_lengths_are_each_rows_own():
    """A row's sum depends on its own tokens alone: padded to any width, alone or in a batch."""
    torch.manual_seed(2)
    rows = [(torch.randn(n, VOCAB), torch.randint(0, VOCAB, (n,))) for n in (1, 4, 9)]
    width = 12
    logits = torch.zeros(len(rows), width, VOCAB)
    targets = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, (lg, tg) in enumerate(rows):
        logits[i, :len(tg)], targets[i, :len(tg)], mask[i, :len(tg)] = lg, tg, 1
    sums, counts = sequence_logps(logits, targets, mask)
    for i, (lg, tg) in enumerate(rows):
        alone, n = sequence_logps(lg[None], tg[None], torch.ones(1, len(tg)))
        assert sums[i].item() == pytest.approx(alone.item(), abs=1e-6) and counts[i] == n == len(tg)


# ------------------------------------------------------------------------------------------
# The reduction contract: micro-batches' sums over the global batch's count = the whole batch's loss


def random_pairs(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    lp = lambda: -torch.rand(n, generator=g, dtype=torch.float64).float() * 20
    tokens = lambda: torch.randint(1, 9, (n,), generator=g).float()
    return {"chosen": lp(), "rejected": lp(), "chosen_tokens": tokens(), "rejected_tokens": tokens(),
            "nll": -lp()[0], "nll_tokens": int(torch.randint(5, 50, (1,), generator=g))}, \
        {"chosen": lp(), "rejected": lp()}


SPLITS = [(7,), (3, 4), (1, 5, 1), (2, 2, 2, 1)]  # uneven micro-batches of the same 7 pairs


@pytest.mark.parametrize("loss", ["sigmoid", "robust", "hinge", "ipo", "simpo"])
@pytest.mark.parametrize("split", SPLITS[1:], ids=str)
def test_micro_batches_add_up_to_the_whole_batch(loss, split):
    policy, reference = random_pairs(7, seed=3)
    cfg = PreferenceConfig(loss=loss, beta=0.7, label_smoothing=0.1 if loss in ("sigmoid", "robust") else 0.0)
    paired = [k for k in policy if k not in ("nll", "nll_tokens")]
    whole = preference_loss(cfg, policy, reference)
    parts, start = [], 0
    for n in split:
        part = {k: policy[k][start:start + n] for k in paired}
        parts.append(preference_loss(cfg, part, {k: v[start:start + n] for k, v in reference.items()}))
        start += n
    total = combined(parts)
    assert total.loss.count.item() == 7
    assert total.value().item() == pytest.approx(whole.value().item(), rel=1e-6)
    for name, m in whole.metrics.items():
        assert total.metrics[name].value().item() == pytest.approx(m.value().item(), rel=1e-6, abs=1e-7), name
    # dividing each micro-batch's sum by the global count before adding: the same loss
    assert sum(p.loss.total / 7 for p in parts).item() == pytest.approx(whole.value().item(), rel=1e-6)


@pytest.mark.parametrize("split", SPLITS[1:], ids=str)
def test_orpo_and_kto_micro_batches_add_up(split):
    policy, _ = random_pairs(7, seed=4)
    g = torch.Generator().manual_seed(4)
    nll_sums, nll_tokens = torch.rand(7, generator=g) * 30, torch.randint(3, 40, (7,), generator=g)
    cfg = PreferenceConfig(loss="orpo", beta=0.3)

    def orpo(sl):
        return preference_loss(cfg, {k: policy[k][sl] for k in ("chosen", "rejected", "chosen_tokens",
                                                               "rejected_tokens")}
                               | {"nll": nll_sums[sl].sum(), "nll_tokens": nll_tokens[sl].sum()})

    bounds = torch.tensor((0,) + split).cumsum(0).tolist()
    parts = [orpo(slice(a, b)) for a, b in zip(bounds, bounds[1:])]
    assert combined(parts).value().item() == pytest.approx(orpo(slice(0, 7)).value().item(), rel=1e-6)

    desirable = torch.tensor([True, False, True, True, False, False, True])
    ref = policy["rejected"]
    kl = kto_kl(policy["chosen"], ref).value().clamp(min=0)  # one estimate for the whole batch
    kto = lambda sl: kto_loss(policy["chosen"][sl], ref[sl], desirable[sl], kl, undesirable_weight=1.5)
    total = combined(kto(slice(a, b)) for a, b in zip(bounds, bounds[1:]))
    assert total.value().item() == pytest.approx(kto(slice(0, 7)).value().item(), rel=1e-6)
    assert total.metrics["rewards/rejected"].count.item() == 3
    # the KL estimate itself adds up the same way
    kls = [kto_kl(policy["chosen"][a:b], ref[a:b]) for a, b in zip(bounds, bounds[1:])]
    assert sum(kls[1:], kls[0]).value().item() == pytest.approx(kto_kl(policy["chosen"], ref).value().item(), rel=1e-6)


def test_a_micro_batch_without_one_kind_of_kto_example_still_adds_up():
    m = kto_loss(logps(-1.0), logps(-2.0), torch.tensor([True]), torch.tensor(0.0))
    assert m.metrics["rewards/rejected"].count.item() == 0 and m.metrics["rewards/rejected"].value().item() == 0
    assert Mean(torch.tensor(0.0), torch.tensor(0.0)).value().item() == 0


# ------------------------------------------------------------------------------------------
# [preference]


def test_the_defaults_are_trls():
    p = preference_config({})
    assert (p.loss, p.beta, p.label_smoothing, p.gamma, p.desirable_weight, p.undesirable_weight) == \
        ("sigmoid", 0.1, 0.0, 0.5, 1.0, 1.0)
    assert p.needs_reference and not preference_config({"loss": "simpo"}).needs_reference


@pytest.mark.parametrize("values,line", [
    ({"beta": 0.0}, "preference.beta=0 must be above 0: it divides the margin (1/β, 1/(2β)); 0.1 is usual"),
    ({"beta": -1.0}, "preference.beta: -1.0 is below the minimum 0.0"),
    ({"label_smoothing": 0.5, "loss": "robust"}, "preference.label_smoothing: 0.5 must be below 0.5"),
    ({"label_smoothing": 0.1, "loss": "ipo"}, "preference.label_smoothing=0.1 is read by the sigmoid, robust and "
                                              "simpo losses, not by preference.loss=ipo; drop it"),
    ({"loss": "dop"}, "preference.loss: 'dop' is not one of sigmoid, robust, ipo, hinge, simpo, orpo, kto"),
])
def test_bad_settings_are_one_line_each(values, line):
    with pytest.raises(ConfigError) as e:
        preference_config(values)
    assert str(e.value).splitlines()[0].startswith(line)
