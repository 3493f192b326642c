"""Multi-token prediction (model/mtp.py) against a hand implementation of the DeepSeek-V3 report's
equations (section 2.2): each depth's hidden states from the previous depth's and the embeddings of the
tokens k ahead, sequences cut to the T - k positions that have a target (the report's indexing, no
padding), the loss L_main + lambda / D * sum_k L_k with every L_k divided by the main loss's count.
Packed documents: the packed window's loss equals the documents' run one by one. Evaluation and
generation see the main head alone. Shapes that do not divide (T = 11, vocab 37, D = 3)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from scaletrain.errors import ConfigError
from scaletrain.model.config import model_config
from scaletrain.model.mtp import IGNORE, MTPLoss, depth_targets
from scaletrain.model.transformer import Transformer

BASE = dict(dim=24, n_layers=2, n_heads=3, vocab_size=37, norm="rmsnorm", position="rope", activation="swiglu",
            max_seq_len=32, init_std=0.2)
MLA = dict(BASE, head_dim=12, mla_kv_rank=10, mla_rope_dim=4, mla_v_dim=6, moe_experts=4, moe_top_k=2,
           moe_score="sigmoid", moe_first_dense=1, moe_hidden=16, moe_shared_experts=1)


def model_of(depth: int, separator: int | None = None, **extra) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(model_config({**BASE, "mtp_depth": depth, **extra}), separator=separator)
    with torch.no_grad():  # (the experts start empty); norms off their init: one on the wrong input must show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.2)
        model.init_buffers()
    return model


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm by hand: x / sqrt(mean(x^2) + eps) * w."""
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def main_hidden(model: Transformer, inputs: torch.Tensor) -> torch.Tensor:
    """The main model's last block output (before its final norm): h^0 of the report."""
    seen = {}
    last = model.layers[str(model.cfg.n_layers - 1)]
    handle = last.register_forward_hook(lambda m, a, out: seen.setdefault("h", out))
    model.eval()
    model(inputs)
    handle.remove()
    return seen["h"]


def reference_losses(model: Transformer, stream: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """From the report: `stream` holds t_1 .. t_{T+1} (the window and its last target). The main model
    reads t_1 .. t_T; depth k reads h^{k-1}_{1..T-k} and Emb(t_{k+1..T}), its block TRM_k attending over
    those T - k positions, and OutHead predicts t_{k+2..T+1}. Returns (summed main loss, [summed L_k])
    over the positions each has (no padding, no mask)."""
    cfg, eps = model.cfg, model.cfg.norm_eps
    inputs, T = stream[:, :-1], stream.shape[1] - 1
    h = main_hidden(model, inputs)
    head = model.output.weight
    main = F.cross_entropy((rms(h, model.norm.weight, eps) @ head.T).flatten(0, 1), stream[:, 1:].flatten(),
                           reduction="sum")
    losses = []
    for k in range(1, cfg.mtp_depth + 1):
        depth = model.mtp[str(k - 1)]
        n = T - k  # positions i = 1 .. T - k have a token k + 1 ahead inside t_1 .. t_{T+1}
        emb = model.tok_emb.weight[stream[:, k:k + n]]  # Emb(t_{i+k})
        h = h[:, :n]
        # the report's M_k [RMSNorm(h); RMSNorm(Emb)]: the checkpoints store M_k's columns embedding first, so the
        # report's matrix is theirs with its two halves of columns swapped
        W = depth.eh_proj.weight
        M = torch.cat([W[:, cfg.dim:], W[:, :cfg.dim]], dim=1)
        x = torch.cat([rms(h, depth.hnorm.weight, eps), rms(emb, depth.enorm.weight, eps)], dim=-1) @ M.T
        h = depth.block(x, (model.rope_cos[:n], model.rope_sin[:n]))  # TRM_k over positions 1 .. T - k
        logits = rms(h, depth.head_norm.weight, eps) @ head.T
        losses.append(F.cross_entropy(logits.flatten(0, 1), stream[:, k + 1:k + 1 + n].flatten(), reduction="sum"))
    return main, losses


@pytest.mark.parametrize("extra", [{}, MLA], ids=["plain", "latent-moe"])
def test_the_loss_is_the_reports_by_hand(extra):
    D, lam = 3, 0.3
    model = model_of(D, **extra, mtp_loss_weight=lam)
    stream = torch.randint(0, 37, (2, 12), generator=torch.Generator().manual_seed(1))  # T = 11
    with torch.no_grad():
        main, per_depth = reference_losses(model, stream)
        model.train()
        loss_fn = MTPLoss(D, lam)
        got = loss_fn(model(stream[:, :-1]), stream[:, 1:])
    want = main + lam / D * sum(per_depth)
    assert got.item() == pytest.approx(want.item(), rel=1e-5)
    sums, counts = loss_fn.take()
    assert counts.tolist() == [2 * (11 - k) for k in (1, 2, 3)]  # T - k positions a row
    assert sums.tolist() == pytest.approx([x.item() for x in per_depth], rel=1e-5)
    # each depth carries weight: the loss without depth 3's module differs
    assert abs(per_depth[2].item()) > 1.0


def test_gradients_reach_the_modules_and_the_shared_embedding_and_head():
    model = model_of(2, tie_embeddings=False).train()
    stream = torch.randint(0, 37, (3, 10), generator=torch.Generator().manual_seed(2))
    MTPLoss(2, 0.3)(model(stream[:, :-1]), stream[:, 1:]).backward()
    for name, p in model.named_parameters():
        if name.startswith("mtp.") and not name.endswith("expert_bias"):
            assert p.grad is not None and p.grad.abs().sum() > 0, name
    # the head's gradient holds the depths' share: it differs from the main loss's alone
    head_grad = model.output.weight.grad.clone()
    model.zero_grad()
    F.cross_entropy(model(stream[:, :-1])[:, :9].flatten(0, 1), stream[:, 1:].flatten(), reduction="sum").backward()
    assert not torch.allclose(model.output.weight.grad, head_grad)


def test_evaluation_and_generation_see_the_main_head_alone():
    with_mtp, without = model_of(2), model_of(0)
    without.load_state_dict({k: v for k, v in with_mtp.state_dict().items() if not k.startswith("mtp.")})
    tokens = torch.randint(0, 37, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(with_mtp.eval()(tokens), without.eval()(tokens))
        train_out = with_mtp.train()(tokens)
        assert train_out.shape == (2, 27, 37)
        assert torch.allclose(train_out[:, :9], without(tokens), atol=1e-6)  # the main head's part
    loss_fn = MTPLoss(2, 0.3)  # the evaluation's output (the main head's alone) gets the main loss
    targets = torch.randint(0, 37, (2, 9))
    assert torch.equal(loss_fn(without(tokens), targets),
                       F.cross_entropy(without(tokens).flatten(0, 1), targets.flatten(), reduction="sum"))


def test_depth_targets_by_hand():
    t = torch.tensor([[5, 6, IGNORE, 8, 9, 10, 11]])
    # depth 1 at i: targets[i + 1] when targets i, i + 1 count; the last position has none
    assert depth_targets(t, 1).tolist() == [[6, IGNORE, IGNORE, 9, 10, 11, IGNORE]]
    assert depth_targets(t, 2).tolist() == [[IGNORE, IGNORE, IGNORE, 10, 11, IGNORE, IGNORE]]
    assert depth_targets(t, 7).tolist() == [[IGNORE] * 7]


@settings(max_examples=60, deadline=None)
@given(T=st.integers(1, 13), k=st.integers(1, 5), data=st.data())
def test_depth_targets_count_only_unbroken_chains(T, k, data):
    row = data.draw(st.lists(st.sampled_from([IGNORE, 1, 2, 3]), min_size=T, max_size=T))
    got = depth_targets(torch.tensor([row]), k)[0].tolist()
    for i in range(T):
        chain = i + k < T and all(row[j] != IGNORE for j in range(i, i + k + 1))
        assert got[i] == (row[i + k] if chain else IGNORE)


def test_packed_documents_equal_the_documents_run_one_by_one():
    """data.document_mask: a separator's target is not counted (data.dataset), so no depth predicts across a
    document's end; each document's positions, attention and depths are its own. The packed window's summed
    losses equal those of its documents run apart, each with its own targets (the separator ending it: none)."""
    sep, D = 0, 2
    packed = model_of(D, separator=sep)
    docs = [[4, 7, 9, 3, 11, sep], [5, 8, sep], [6, 12, 13, 14, 15]]  # 14 tokens, the last document cut
    window = torch.tensor([sum(docs, [])])
    after = 16  # the token after the window: the last position's target
    inputs = window
    targets = torch.cat([window[:, 1:], torch.tensor([[after]])], dim=1)
    targets[inputs == sep] = IGNORE
    loss_fn = MTPLoss(D, 0.5)
    with torch.no_grad():
        got = loss_fn(packed.train()(inputs), targets)
        got_sums, got_counts = loss_fn.take()
        want, counts = torch.zeros(()), torch.zeros(D)
        sums = torch.zeros(D)
        for n, doc in enumerate(docs):
            x = torch.tensor([doc])
            last = [after] if n == len(docs) - 1 else [IGNORE]  # a separator's next token is not counted
            y = torch.tensor([doc[1:] + last])
            each = MTPLoss(D, 0.5)
            want = want + each(packed(x), y)
            s, c = each.take()
            sums, counts = sums + s, counts + c
    assert got.item() == pytest.approx(want.item(), rel=1e-5)
    assert got_counts.tolist() == counts.tolist() == [4 + 1 + 4, 3 + 0 + 3]
    assert got_sums.tolist() == pytest.approx(sums.tolist(), rel=1e-5)


def test_the_keys_refuse_what_does_nothing_in_one_line():
    with pytest.raises(ConfigError, match=r"model.mtp_loss_weight=0.1 weighs multi-token prediction, but "
                                          r"model.mtp_depth=0"):
        model_config({**BASE, "mtp_loss_weight": 0.1})
    assert math.isclose(model_config({**BASE, "mtp_depth": 1}).mtp_loss_weight, 0.3)


# ---- the planner: parameters, FLOPs and activation memory of the depths ------------------------------------

def test_the_planner_counts_the_depths_parameters_by_hand():
    from scaletrain.layout import Layout
    from scaletrain.model.transformer import count_params
    from scaletrain.plan.params import rank_params

    d, f, D = 24, 64, 3  # swiglu's hidden width: 64 * ceil(8 * 24 / 3 / 64)
    block = 4 * d * d + 3 * d * f + 2 * d  # q, k, v, o; w1, w2, w3; two norms
    depth = block + 2 * d * d + 3 * d  # and eh_proj, enorm, hnorm, head_norm
    with_mtp, without = model_config({**BASE, "mtp_depth": D}), model_config(BASE)
    assert count_params(with_mtp) - count_params(without) == D * depth
    assert rank_params(with_mtp, Layout(), 0).total == count_params(with_mtp)
    # on each of 2 tp ranks the blocks' matrices halve (the planner's even share); eh_proj and the norms stay whole
    tp2 = rank_params(with_mtp, Layout(tp=2), 0).total - rank_params(without, Layout(tp=2), 0).total
    assert tp2 == D * ((4 * d * d + 3 * d * f) // 2 + 2 * d + 2 * d * d + 3 * d)
    latent = model_config({**MLA, "mtp_depth": 2})  # the second depth's block a mixture of experts
    assert rank_params(latent, Layout(), 0).total == count_params(latent)


def test_the_depths_flops_by_hand():
    from scaletrain.model.flops import flops_per_token

    d, f, V, T, H, D = 24, 64, 37, 11, 3, 2
    per_depth = 6 * (4 * d * d + 3 * d * f + 2 * d * d + d * V) + 6 * H * (8 + 8) * T  # matmuls; scores and sum
    assert flops_per_token(model_config({**BASE, "mtp_depth": D}), T) - \
        flops_per_token(model_config(BASE), T) == D * per_depth


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_the_depths_activation_memory_near_the_traced_count(precision):
    """The closed form's share of the depths against the real model's saved tensors, counted on fake tensors
    (scaletrain.plan.trace): within 10%."""
    from scaletrain.plan.activations import formula_activation_bytes
    from scaletrain.plan.spec import Workload
    from scaletrain.plan.trace import traced_activation_bytes

    base = model_config({**BASE, "dim": 48, "n_heads": 4, "vocab_size": 101, "max_seq_len": 64})
    mtp = model_config({**BASE, "dim": 48, "n_heads": 4, "vocab_size": 101, "max_seq_len": 64, "mtp_depth": 2})
    wl = Workload(seq_len=23, global_batch=4, precision=precision)
    traced = traced_activation_bytes(mtp, wl, 2, 1, False, "none")[1] - \
        traced_activation_bytes(base, wl, 2, 1, False, "none")[1]
    formula = formula_activation_bytes(mtp, wl, 2, 1, False, "none")[1] - \
        formula_activation_bytes(base, wl, 2, 1, False, "none")[1]
    assert traced > 0 and abs(formula - traced) <= 0.1 * traced, (formula, traced)
