"""The mixture-of-experts layer (model/moe.py) and its step hook (parallel/moe_balance.py) in one
process: the layer's output against a hand-written per-token reference, the grouped matmul
against a per-expert loop, the capacity, the expert bias, the auxiliary losses' gradients, and
what activation checkpointing, gradient accumulation, a run's metrics and a resume must keep."""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from scaletrain.errors import ConfigError
from scaletrain.layout import Layout
from scaletrain.legality import check_job
from scaletrain.model import moe as moe_module
from scaletrain.model.config import ModelConfig
from scaletrain.model.moe import MoE, expert_mlp
from scaletrain.model.transformer import Transformer
from scaletrain.parallel.moe_balance import MoEBalance
from scaletrain.quant.layers import layer_plan
from scaletrain.train.trainer import Trainer

from conftest import micro_cfg, read_metrics, run_until

E, D, H = 4, 32, 48  # experts, model width, expert width (fp32 rows of 128 and 192 bytes: grouped matmul)


def layer(seed: int = 0, **overrides) -> MoE:
    cfg = ModelConfig(**{"dim": D, "n_layers": 1, "n_heads": 4, "moe_experts": E, "moe_hidden": H,
                         "moe_top_k": 2, **overrides})
    m = MoE(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    m.reset_state()
    return m


def tokens(B: int = 3, T: int = 8, seed: int = 1) -> torch.Tensor:
    return torch.randn(B, T, D, generator=torch.Generator().manual_seed(seed))


def clamped_swiglu_by_hand(gate, up, alpha: float, limit: float):
    """gpt-oss's gated unit as its config documents it: the gate clamped above at limit, the up
    projection to [-limit, limit], (up + 1) * gate * sigmoid(alpha * gate)."""
    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return (up + 1) * gate * torch.sigmoid(alpha * gate)


def reference(m: MoE, x: torch.Tensor, keep=lambda token, expert: True, glu=None, scale_input=False) -> torch.Tensor:
    """The layer written token by token: scores (with the router's bias), the top_k choice (with the
    expert bias), the weights (without it), each chosen expert's MLP (with its matrices' biases),
    the shared experts. `keep(token, expert)`: whether that choice survives the capacity; `glu`(gate,
    up): the gated unit, SwiGLU if None; `scale_input`: Llama 4's weighted inputs."""
    flat = x.reshape(-1, D)
    out = torch.zeros_like(flat)

    def linear(w, b, e, v):
        return w[e] @ v + (b[e] if b is not None else 0)

    for i, v in enumerate(flat):
        logits = m.router.weight @ v + (m.router.bias if m.router.bias is not None else 0)
        scores = logits.softmax(-1) if m.score == "softmax" else logits.sigmoid()
        chosen = torch.topk(scores + m.expert_bias, m.top_k).indices
        weights = scores[chosen]
        if m.renorm:
            weights = weights / weights.sum()
        for e, w in zip(chosen.tolist(), weights * m.route_scale):
            if not keep(i, e):
                continue
            seen = w * v if scale_input else v  # Llama 4: the expert sees the weighted token
            h = linear(m.w1, m.b1, e, seen)
            if m.w3 is not None:
                h = (glu or (lambda g, u: F.silu(g) * u))(h, linear(m.w3, m.b3, e, seen))
            else:
                h = F.gelu(h, approximate="tanh")
            out[i] += linear(m.w2, m.b2, e, h) * (1 if scale_input else w)
        if m.shared is not None:
            out[i] += m.shared(v)
    return out.view_as(x)


@pytest.mark.parametrize("options", [
    {},
    {"activation": "swiglu", "moe_score": "sigmoid", "moe_renorm": True, "moe_route_scale": 2.5,
     "moe_shared_experts": 1},
    {"activation": "swiglu", "moe_renorm": True, "moe_shared_experts": 2, "moe_top_k": 3},
    {"activation": "swiglu_clamped", "swiglu_limit": 1.0, "moe_bias": True},
    {"moe_bias": True},
    {"activation": "swiglu", "moe_score": "sigmoid", "moe_top_k": 1, "moe_scale_input": True, "moe_shared_experts": 1},
], ids=["softmax-gelu", "sigmoid-swiglu-renorm-scale-shared", "softmax-swiglu-renorm-2shared-top3",
        "gpt-oss-biases-clamped-swiglu", "biases-gelu", "llama4-scaled-input"])
def test_output_equals_the_per_token_reference(options):
    m = layer(**options)
    glu = None
    if options.get("activation") == "swiglu_clamped":  # a limit of 1: most gates and ups are clamped
        glu = lambda g, u: clamped_swiglu_by_hand(g, u, alpha=1.702, limit=1.0)  # noqa: E731
    if options.get("moe_bias"):  # gpt-oss: a bias on the router and on each of an expert's matrices
        assert m.router.bias is not None and m.b1 is not None and m.b2 is not None
        assert (m.b3 is not None) == (options.get("activation", "gelu") != "gelu")
    with torch.no_grad():
        m.expert_bias.copy_(torch.tensor([0.3, -0.2, 0.0, 0.1]))  # moves some choices, never a weight
        x = tokens()
        for mode in (m.eval, m.train):  # training adds the counters and the losses' gradients only
            mode()
            want = reference(m, x, glu=glu, scale_input=options.get("moe_scale_input", False))
            torch.testing.assert_close(m(x), want, rtol=1e-5, atol=1e-5)


def test_llama4s_weighted_input_reaches_the_experts_in_the_weights_dtype():
    """bf16 weights (bf16-true): the weighted tokens go to the experts in bf16, not in the router
    weight's fp32 (an fp32 copy of every routed token and a matmul of mismatched dtypes), and the
    layer's output is the per-token reference's within bf16's rounding."""
    m = layer(activation="swiglu", moe_score="sigmoid", moe_top_k=1, moe_scale_input=True).eval()
    want = reference(m.double(), tokens().double(), scale_input=True)
    m = m.to(torch.bfloat16)
    seen, run_experts = [], m.run_experts
    m.run_experts = lambda h, counts: (seen.append(h.dtype), run_experts(h, counts))[1]
    with torch.no_grad():
        out = m(tokens().to(torch.bfloat16))
    assert seen == [torch.bfloat16] and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), want, rtol=0.05, atol=0.05)


def per_expert_loop(x, counts, w1, w2, w3):
    """The experts' MLPs one expert at a time (the reference the grouped matmul must match)."""
    outs = []
    for e, part in enumerate(x.split(counts.tolist())):
        h = part @ w1[e].T
        h = F.silu(h) * (part @ w3[e].T) if w3 is not None else F.gelu(h, approximate="tanh")
        outs.append(h @ w2[e].T)
    return torch.cat(outs)


@pytest.mark.parametrize("dim,hidden,grouped", [(32, 48, True), (10, 6, False), (32, 7, False)],
                         ids=["grouped", "fallback-dim10", "fallback-hidden7"])
@pytest.mark.parametrize("swiglu", [False, True], ids=["gelu", "swiglu"])
def test_grouped_matmul_equals_a_per_expert_loop(monkeypatch, dim, hidden, grouped, swiglu):
    """Values and gradients, with an expert that gets no token; shapes whose rows are not a
    multiple of 16 bytes are refused by torch._grouped_mm and take the loop."""
    calls = []
    real = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    g = torch.Generator().manual_seed(0)
    counts = torch.tensor([5, 0, 9, 3])
    x = torch.randn(int(counts.sum()), dim, generator=g, requires_grad=True)
    w1, w3 = (torch.randn(4, hidden, dim, generator=g, requires_grad=True) for _ in range(2))
    w2 = torch.randn(4, dim, hidden, generator=g, requires_grad=True)
    w3 = w3 if swiglu else None
    inputs = [t for t in (x, w1, w2, w3) if t is not None]
    dy = torch.randn(len(x), dim, generator=g)
    got = expert_mlp(x, counts, w1, w2, w3)
    assert bool(calls) == grouped, "the grouped matmul ran where it should not, or not where it should"
    got_grads = torch.autograd.grad(got, inputs, dy)
    want = per_expert_loop(x, counts, w1, w2, w3)
    want_grads = torch.autograd.grad(want, inputs, dy)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    calls.clear()
    torch.testing.assert_close(expert_mlp(x, counts, w1, w2, w3, loop=True), want, rtol=1e-5, atol=1e-5)
    assert not calls, "loop=True (the benchmark's reference) ran the grouped matmul"


@pytest.mark.parametrize("dim,hidden", [(32, 48), (10, 6)], ids=["grouped", "loop"])
def test_no_token_at_all_gives_no_rows_and_zero_gradients(dim, hidden):
    """An expert-parallel rank that receives no token runs its experts over nothing: (0, dim) out,
    and its weights' gradients are zeros (it still joins the gradients' reduction)."""
    g = torch.Generator().manual_seed(0)
    w1, w3 = (torch.randn(4, hidden, dim, generator=g, requires_grad=True) for _ in range(2))
    w2 = torch.randn(4, dim, hidden, generator=g, requires_grad=True)
    b1, b2 = torch.randn(4, hidden, requires_grad=True), torch.randn(4, dim, requires_grad=True)
    x = torch.zeros(0, dim, requires_grad=True)
    y = expert_mlp(x, torch.zeros(4, dtype=torch.long), w1, w2, w3, biases=(b1, b2, None))
    assert y.shape == (0, dim)
    y.sum().backward()
    for w in (w1, w2, w3, b1, b2):
        assert w.grad is not None and not w.grad.any()


def test_under_autocast_the_experts_compute_in_its_dtype_and_the_layer_keeps_its_inputs():
    """A grouped matmul is on none of autocast's lists: the experts' operands (inputs, matrices and biases)
    are cast to autocast's dtype by hand, so the experts' outputs are what a loop over bf16 copies gives;
    the layer returns its input's dtype (the residual stream's)."""
    g = torch.Generator().manual_seed(0)
    counts = torch.tensor([5, 0, 9, 3])
    x = torch.randn(17, 32, generator=g)
    w1, w2 = torch.randn(4, 48, 32, generator=g) * 0.2, torch.randn(4, 32, 48, generator=g) * 0.2
    b1, b2 = torch.randn(4, 48, generator=g), torch.randn(4, 32, generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = expert_mlp(x, counts, w1, w2, None, biases=(b1, b2, None))
    bf = [t.bfloat16() for t in (x, w1, w2, b1, b2)]
    parts, start = [], 0
    for e, n in enumerate(counts.tolist()):  # each expert over its rows, all in bf16
        h = F.gelu(bf[0][start:start + n] @ bf[1][e].T + bf[3][e], approximate="tanh")
        parts.append(h @ bf[2][e].T + bf[4][e])
        start += n
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, torch.cat(parts), rtol=2e-2, atol=2e-2)
    m = layer(moe_bias=True).train()
    xs = tokens()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = m(xs)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, reference(m, xs).detach(), rtol=5e-2, atol=5e-2)


def test_capacity_drops_each_experts_later_tokens_and_counts_them():
    m = layer(moe_capacity_factor=1.0).train()
    x = tokens(B=2, T=8)
    n, k = 16, 2
    capacity = math.ceil(1.0 * n * k / E)  # 8 choices per expert
    with torch.no_grad():
        m.expert_bias.copy_(torch.tensor([9.0, 0.0, 0.0, 0.0]))  # every token chooses expert 0
        flat = x.reshape(-1, D)
        scores = (flat @ m.router.weight.T).softmax(-1)
        chosen = torch.topk(scores + m.expert_bias, k).indices
        seen = {e: 0 for e in range(E)}
        kept = set()
        for i in range(n):  # tokens in order: each expert keeps its first `capacity`
            for e in chosen[i].tolist():
                if seen[e] < capacity:
                    kept.add((i, e))
                seen[e] += 1
        dropped = sum(max(c - capacity, 0) for c in seen.values())
        assert dropped == 8  # the 16 tokens sent to expert 0, of which 8 fit
        want = reference(m, x, keep=lambda i, e: (i, e) in kept)
    torch.testing.assert_close(m(x), want, rtol=1e-5, atol=1e-5)  # a training forward counts
    assert m.stats[:E].tolist() == [float(seen[e]) for e in range(E)]  # the load counts every choice
    assert m.stats[E].item() == dropped


def test_the_expert_bias_steers_the_choice_but_not_the_weights():
    m = layer().eval()
    x = tokens()
    with torch.no_grad():
        unbiased = m(x)
        m.expert_bias[3] = 100.0
        biased = m(x)
        flat = x.reshape(-1, D)
        scores = (flat @ m.router.weight.T).softmax(-1)
        # every token now takes expert 3, weighted by its score (not by its score + 100)
        assert torch.topk(scores + m.expert_bias, 2).indices.eq(3).any(-1).all()
        torch.testing.assert_close(biased, reference(m, x), rtol=1e-5, atol=1e-5)
        assert not torch.allclose(biased, unbiased)
        assert biased.abs().max() < 10 * unbiased.abs().max()  # no weight near 100


def explicit_losses(m: MoE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The Switch loss (per sequence, times its length) and the z-loss (summed over tokens), as
    their papers write them."""
    B, T, _ = x.shape
    logits = x @ m.router.weight.T  # (B, T, E)
    probs = logits.softmax(-1)
    chosen = torch.topk(probs.detach() + m.expert_bias, m.top_k).indices  # (B, T, k)
    aux = 0.0
    for b in range(B):
        f = torch.stack([(chosen[b] == e).sum() for e in range(E)]).float() / (T * m.top_k)
        aux = aux + E * (f * probs[b].mean(0)).sum() * T
    z = logits.logsumexp(-1).square().sum()
    return aux, z


@pytest.mark.parametrize("aux_coef,z_coef", [(0.2, 0.05), (0.2, 0.0), (0.0, 0.05)], ids=["both", "aux", "z"])
def test_aux_and_z_loss_gradients_equal_autograd_of_the_explicit_losses(aux_coef, z_coef):
    """Each loss alone or both: each joins backward with its coefficient times the loss's factor."""
    factor = 0.37
    m = layer(moe_aux_loss=aux_coef, moe_z_loss=z_coef).train()
    m.loss_factor = factor
    plain = layer().train()  # the same weights, no losses
    x = tokens()
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(5))
    (m(x) * dy).sum().backward()
    aux, z = explicit_losses(plain, x)
    ((plain(x) * dy).sum() + factor * (aux_coef * aux + z_coef * z)).backward()
    for (name, a), (_, b) in zip(m.named_parameters(), plain.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6, msg=name)
    # and the counters hold the losses themselves (sums: the hook divides by the tokens), those that are on
    torch.testing.assert_close(m.stats[E + 1], aux.detach() if aux_coef else torch.tensor(0.0), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(m.stats[E + 2], z.detach() if z_coef else torch.tensor(0.0), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("after", [torch.square, torch.sin], ids=["layer-last", "work-after-the-layer"])
def test_activation_checkpointing_counts_no_token_twice(after):
    """The recomputation in backward stops once it has remade the last tensor backward needs: with
    nothing after the layer that saves its output (square's backward needs only its input, the
    layer's output, remade before the counting), it never reaches the counting; with a block's work
    after it (sin saves what it is given: a post-norm, say) it runs the layer to its end."""
    m, again = layer(moe_aux_loss=0.1, moe_z_loss=0.01).train(), layer(moe_aux_loss=0.1, moe_z_loss=0.01).train()
    x = tokens()
    after(m(x)).square().sum().backward()
    checkpoint(lambda t: after(again(t)), x, use_reentrant=False).square().sum().backward()  # forward again
    assert again.stats[:E].sum().item() == x.shape[0] * x.shape[1] * 2  # every token's 2 choices, once
    torch.testing.assert_close(again.stats, m.stats)
    for (name, a), (_, b) in zip(again.named_parameters(), m.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-7, msg=name)


def test_two_micro_batches_give_one_batchs_bias_losses_and_gradients():
    """Gradient accumulation: the per-sequence Switch loss and the counters are sums, so two
    halves of a batch add up to the whole batch, bias update included."""
    opts = {"moe_aux_loss": 0.1, "moe_z_loss": 0.01, "moe_bias_rate": 0.01}
    whole, halves = layer(**opts).train(), layer(**opts).train()
    x = tokens(B=4)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(5))
    for m in (whole, halves):
        m.loss_factor = 0.5
    (whole(x) * dy).sum().backward()
    for part, dpart in zip(x.split(2), dy.split(2)):
        (halves(part) * dpart).sum().backward()
    for (name, a), (_, b) in zip(halves.named_parameters(), whole.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6, msg=name)
    torch.testing.assert_close(halves.stats, whole.stats, rtol=1e-5, atol=1e-5)
    cfg = ModelConfig(dim=D, n_layers=1, n_heads=4, moe_experts=E, moe_bias_rate=0.01)
    biases = []
    for m in (whole, halves):
        hook = MoEBalance({"layers.0.moe": m}, ["layers.0.moe"], [], experts=E, bias_rate=cfg.moe_bias_rate, top_k=2,
                          aux_loss=0.1, device="cpu")
        hook.after_optimizer_step(applied=True)
        assert m.stats.abs().sum() == 0  # cleared for the next step
        biases.append(m.expert_bias.clone())
    assert torch.equal(biases[0], biases[1]) and biases[0].abs().sum() > 0


def hook_of(m: MoE, bias_rate: float) -> MoEBalance:
    return MoEBalance({"layers.0.moe": m}, ["layers.0.moe"], [], experts=E, bias_rate=bias_rate, top_k=m.top_k,
                      aux_loss=m.aux_coef, device="cpu")


def test_the_bias_moves_by_the_rate_against_each_experts_load():
    """DeepSeek-V3's rule by hand: each expert's bias moves by exactly bias_rate, down where its load
    is above the mean, up where below, not at all where equal; a skipped step moves nothing."""
    m = layer()
    start = torch.tensor([0.5, -0.25, 0.125, 0.0])
    with torch.no_grad():
        m.expert_bias.copy_(start)
    loads = torch.tensor([10.0, 2.0, 6.0, 6.0])  # mean 6: expert 0 over, expert 1 under, 2 and 3 even
    m.stats[:E] = loads
    hook_of(m, bias_rate=0.01).after_optimizer_step(applied=False)
    assert torch.equal(m.expert_bias, start)  # a skipped step moves no bias (and clears the counters)
    m.stats[:E] = loads
    hook_of(m, bias_rate=0.01).after_optimizer_step(applied=True)
    torch.testing.assert_close(m.expert_bias, start + torch.tensor([-0.01, 0.01, 0.0, 0.0]), rtol=0, atol=1e-7)


def test_after_a_bias_update_the_busiest_expert_gets_fewer_tokens_and_the_idlest_more():
    """The rule's direction: on the same tokens, the routing after one update sends fewer tokens to
    the expert that had the most and more to the one that had the fewest, and the loads draw together."""
    m = layer().train()
    x = tokens(B=8, T=32)
    m(x).sum().backward()
    before = m.stats[:E].clone()
    busiest, idlest = int(before.argmax()), int(before.argmin())
    assert before[busiest] > before.mean() > before[idlest]
    hook_of(m, bias_rate=0.005).after_optimizer_step(applied=True)  # (a larger rate overshoots: 0.05 swaps them)
    m(x).sum().backward()
    after = m.stats[:E]
    assert after.sum() == before.sum()  # the same choices made, differently
    assert after[busiest] < before[busiest] and after[idlest] > before[idlest], (before, after)
    assert after.max() - after.min() < before.max() - before.min()


def test_switch_and_z_losses_equal_their_values_worked_by_hand():
    """A router whose logits are set by hand (the log of 4, 2, 1, 1 in some order: the probabilities
    are eighths, every logsumexp is log 8). Sequence 0's two tokens both choose experts 0 and 1
    (f = 1/2, 1/2, 0, 0; mean probabilities 3/8, 3/8, 1/8, 1/8): its Switch loss E * sum f_i P_i
    = 4 * 3/8 = 3/2, times its 2 tokens = 3; sequence 1 is its mirror image, 3 again. Over the batch
    as one sequence it would be 4 (every f = 1/4): the loss is per sequence. z: (log 8)^2 per token."""
    m = layer(moe_aux_loss=1.0, moe_z_loss=1.0).train()
    logits = torch.tensor([[[4.0, 2, 1, 1], [2, 4, 1, 1]], [[1.0, 1, 2, 4], [1, 1, 4, 2]]]).log()
    with torch.no_grad():
        m.router.weight.zero_()
        m.router.weight[:, :E] = torch.eye(E)  # logits = the first E coordinates of each token
    x = torch.zeros(2, 2, D)
    x[..., :E] = logits
    m(x).sum().backward()
    assert m.stats[:E].tolist() == [2.0, 2.0, 2.0, 2.0]
    aux, z = m.stats[E + 1].item(), m.stats[E + 2].item()
    assert aux == pytest.approx(6.0, rel=1e-6)
    assert z == pytest.approx(4 * math.log(8) ** 2, rel=1e-6)
    hook = hook_of(m, bias_rate=0.0)
    hook.after_optimizer_step(applied=True)
    # the logged figures are means over the 4 tokens
    assert hook.last["moe_aux_loss"] == pytest.approx(1.5, rel=1e-6)
    assert hook.last["moe_z_loss"] == pytest.approx(math.log(8) ** 2, rel=1e-6)


MOE_RUN = {"model.moe_experts": 4, "model.moe_aux_loss": 0.01, "model.moe_z_loss": 0.001,
           "model.moe_bias_rate": 0.01}


def biases(trainer) -> dict[str, torch.Tensor]:
    return {n: m.expert_bias.clone() for n, m in trainer.hooks.find(MoEBalance).layers.items()}


def test_metrics_rows_show_the_balance(tmp_path):
    Trainer(micro_cfg(tmp_path, **{**MOE_RUN, "train.steps": 2, "model.moe_capacity_factor": 1.0})).fit()
    rows = read_metrics(tmp_path / "run")
    for row in rows:
        worst = max(row["moe_imbalance/layers.0.moe"], row["moe_imbalance/layers.1.moe"])
        assert row["moe_imbalance"] == worst >= 1.0
        assert 0 <= row["moe_dropped"] < 1
        # per token per layer; at initialisation the router is near uniform: Switch ~ top_k... here about 1
        assert 0.5 < row["moe_aux_loss"] < 4 and row["moe_z_loss"] > 0


def test_resume_is_exact_with_the_expert_bias(tmp_path):
    base = {**MOE_RUN, "train.steps": 4, "checkpoint.every": 2}
    straight = Trainer(micro_cfg(tmp_path / "a", **base))
    history = [(r["step"], r["loss"], r["grad_norm"]) for r in straight.fit()["history"]]
    cfg = micro_cfg(tmp_path / "b", **{**base, "checkpoint.resume": "auto"})
    run_until(cfg, stop_after=2)
    resumed = Trainer(cfg)
    assert resumed.step == 2
    assert all(b.abs().sum() > 0 for b in biases(resumed).values()), "the biases did not come back"
    resumed.fit()
    assert [(r["step"], r["loss"], r["grad_norm"]) for r in read_metrics(tmp_path / "b" / "run")] == history
    for name, b in biases(straight).items():
        assert torch.equal(biases(resumed)[name], b), name


@pytest.mark.parametrize("mode", ["bf16-mixed", "bf16-true", "16-mixed", "full", "selective"])
def test_every_precision_and_checkpointing_train_like_32_true(tmp_path, mode):
    """Activation checkpointing the same numbers, a 16-bit precision nearly. (Compiled blocks:
    tests/parallel/test_expert_parallel.py's ep2-zero3-compile against one eager process, every step.)"""
    extra = {"memory.activation_checkpointing": mode} if mode in ("full", "selective") else {"precision.mode": mode}
    steps = {**MOE_RUN, "train.steps": 2, "model.activation": "swiglu", "model.moe_shared_experts": 1}
    ref = Trainer(micro_cfg(tmp_path / "ref", **steps)).fit()["history"]
    got = Trainer(micro_cfg(tmp_path / mode, **steps, **extra)).fit()["history"]
    tol = 2e-2 if "precision.mode" in extra else 1e-5
    for a, b in zip(got, ref):
        assert abs(a["loss"] - b["loss"]) <= tol * b["loss"], (mode, a["loss"], b["loss"])
        assert a["moe_imbalance"] >= 1.0 and math.isfinite(a["moe_aux_loss"])


def test_fp8_and_qat_leave_the_router_and_the_routed_experts_alone():
    with torch.device("meta"):
        model = Transformer(ModelConfig(dim=128, n_layers=2, n_heads=4, moe_experts=64, moe_shared_experts=1))
    for scheme in ("fp8", "int8-dynamic"):
        plan = layer_plan(model, scheme, fp8_min_dim=16)
        assert plan["layers.0.moe.router"] is not None and "router" in plan["layers.0.moe.router"]
        assert plan["layers.0.moe.shared.w1"] is None  # the shared experts are a dense MLP: they convert
        assert not any(name.endswith(("moe.w1", "moe.w2", "moe.w3")) for name in plan)  # not linears


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(256, 16)
        self.layers = nn.ModuleList([nn.Linear(16, 16)])
        self.out = nn.Linear(16, 256)

    def forward(self, tokens):
        return self.out(self.layers[0](self.emb(tokens)))


def test_moe_options_on_a_custom_module_are_one_line(tmp_path):
    with pytest.raises(ConfigError) as e:
        Trainer(micro_cfg(tmp_path, **{"model.moe_experts": 4}), stream=open(os.devnull, "w"), model=Tiny())
    assert str(e.value).count("\n") == 0 and "model.moe_experts=4" in str(e.value)
    assert "custom nn.Module" in str(e.value)


@pytest.mark.parametrize("layout", [Layout(cp=2), Layout(tp=2, sp=True)], ids=["cp", "sp"])
def test_a_capacity_with_ranks_holding_parts_of_sequences_is_refused(layout):
    cfg = ModelConfig(dim=D, n_layers=1, n_heads=4, moe_experts=E, moe_capacity_factor=1.25)
    with pytest.raises(ConfigError, match=r"model.moe_capacity_factor=1.25 with parallel.(cp|sp)"):
        check_job(layout, cfg)
    check_job(layout, ModelConfig(dim=D, n_layers=1, n_heads=4, moe_experts=E))  # dropless: fine


def test_the_grouped_matmul_leaves_compiles_graph_outside_bf16(monkeypatch):
    """torch.compile traces the grouped matmul with a shape function that takes bf16 alone; fp32
    runs it eagerly instead (the path compile takes, called here directly)."""
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    seen = []
    monkeypatch.setattr(moe_module, "_grouped_eager", lambda *a: seen.append(1) or moe_module._grouped(*a))
    counts = torch.tensor([2, 3, 0, 1])
    w = torch.randn(4, 48, 32)
    expert_mlp(torch.randn(6, 32), counts, w, w.transpose(1, 2).contiguous(), None)
    assert len(seen) == 2
    seen.clear()  # bf16 is traced: compile keeps it in its graph
    expert_mlp(torch.randn(6, 32).bfloat16(), counts, w.bfloat16(), w.transpose(1, 2).contiguous().bfloat16(), None)
    assert not seen
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)  # eager: no graph to leave
    expert_mlp(torch.randn(6, 32), counts, w, w.transpose(1, 2).contiguous(), None)
    assert not seen


def test_the_router_runs_in_fp32_under_autocast():
    """bf16 autocast casts a linear's operands; the router's scores must still be fp32 products
    (a bf16 tie decides an expert), equal to the fp32 router's bit for bit."""
    torch.manual_seed(0)
    cfg = ModelConfig(dim=32, n_heads=4, moe_experts=8, moe_top_k=2, moe_hidden=16)
    moe = MoE(cfg)
    with torch.no_grad():
        moe.router.weight.normal_(0, 0.5)
    x = torch.randn(64, 32)
    want, _, _ = moe.route(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, _, _ = moe.route(x)
    assert got.dtype == torch.float32
    assert torch.equal(got, want)


def test_only_a_training_forward_with_gradients_counts_the_load_and_adds_the_losses():
    """Evaluation (eval mode, even with gradients on) and a training-mode forward under no_grad (a
    rollout) are no part of the step: no counter moves, and the auxiliary losses add no gradient
    (an eval forward's gradients are those of the same layer without the losses)."""
    m, plain = layer(moe_aux_loss=0.5, moe_z_loss=0.5), layer()
    x = tokens()
    m.eval()
    m(x).sum().backward()
    assert m.stats.abs().sum() == 0, "an eval forward with gradients on counted its load"
    plain.eval()
    plain(x).sum().backward()
    for (name, a), (_, b) in zip(m.named_parameters(), plain.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-7, msg=name)
    m.train()
    with torch.no_grad():
        m(x)
    assert m.stats.abs().sum() == 0, "a forward under no_grad counted its load"
    m(x).sum().backward()
    assert m.stats[:E].sum() == x.shape[0] * x.shape[1] * 2  # the one that counts: every token's 2 choices


def test_the_layer_makes_its_tensors_on_its_inputs_device():
    """Every tensor the layer and its hook make (positions, counts, the output, the losses' gradient,
    the step's counters) goes on the device of the tensors it meets, never the default device: with
    the default device set to meta, a CPU layer gives the same output, gradients, counters and bias
    update as without (a tensor made on meta cannot be combined with the CPU's)."""
    opts = {"moe_capacity_factor": 1.0, "moe_aux_loss": 0.1, "moe_z_loss": 0.1, "moe_bias": True,
            "moe_bias_rate": 0.01}
    results = []
    for default in ("cpu", "meta"):
        m = layer(**opts).train()
        x = tokens(B=2, T=5).requires_grad_()
        with torch.device(default):
            y = m(x)
            y.square().sum().backward()
            cfg = ModelConfig(dim=D, n_layers=1, n_heads=4, moe_experts=E, moe_bias_rate=0.01, moe_top_k=2)
            hook = MoEBalance.for_model([nn.ModuleDict({"layers": nn.ModuleList([nn.ModuleDict({"moe": m})])})],
                                        cfg, [], device="cpu")
            stats = m.stats.clone()
            hook.after_optimizer_step(applied=True)
        assert y.device.type == "cpu"
        results.append((y, x.grad, [p.grad for p in m.parameters()], stats, m.expert_bias.clone(), hook.last))
    (y, dx, grads, stats, bias, last), want = results
    torch.testing.assert_close(y, want[0], rtol=0, atol=0)
    torch.testing.assert_close(dx, want[1], rtol=0, atol=0)
    for a, b in zip(grads, want[2]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert torch.equal(stats, want[3]) and torch.equal(bias, want[4]) and last == want[5]


GROUPED = {"moe_experts": 12, "moe_groups": 4, "moe_topk_groups": 2, "moe_top_k": 3, "moe_score": "sigmoid",
           "moe_renorm": True, "moe_route_scale": 2.5}


def grouped_layer_and_tokens() -> tuple[MoE, torch.Tensor]:
    """12 experts in 4 groups of 3 (a group's score, its two best biased scores, is not all three's),
    2 groups open per token, top 3 within them, renormalised and scaled; a random expert bias."""
    m = layer(**GROUPED)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        m.expert_bias.copy_(torch.randn(12, generator=g) * 0.1)
    return m, torch.randn(64, D, generator=g)


def test_group_limited_routing_chooses_within_the_best_groups():
    """DeepSeek-V3's group-limited routing token by token: each group scored by the sum of its two best
    biased scores, the 2 best groups open, the top 3 biased scores among their experts chosen, the
    unbiased scores as weights (renormalised, times 2.5)."""
    m, x = grouped_layer_and_tokens()
    _, chosen, weights = m.route(x)
    scores = torch.sigmoid(x @ m.router.weight.T)
    changed = 0
    for i in range(len(x)):
        biased = (scores[i] + m.expert_bias).tolist()
        groups = [sorted(biased[3 * j:3 * j + 3])[-2:] for j in range(4)]
        open_ = sorted(range(4), key=lambda j: sum(groups[j]))[-2:]
        allowed = [e for j in open_ for e in range(3 * j, 3 * j + 3)]
        want = sorted(sorted(allowed, key=lambda e: biased[e])[-3:])
        assert sorted(chosen[i].tolist()) == want, i
        w = scores[i, want] / scores[i, want].sum() * 2.5
        got = dict(zip(chosen[i].tolist(), weights[i].tolist()))
        assert [got[e] for e in want] == pytest.approx(w.tolist(), rel=1e-5)
        changed += want != sorted(sorted(range(12), key=lambda e: biased[e])[-3:])
    assert changed > 0  # the groups changed some tokens' choice


@pytest.mark.slow  # (importing transformers' DeepSeek-V3 model: 15 s)
def test_group_limited_routing_chooses_as_transformers_deepseek_v3_router():
    """The same routing against transformers' own router (the reference library): the same experts and
    weights."""
    modeling = pytest.importorskip("transformers.models.deepseek_v3.modeling_deepseek_v3")
    from transformers import DeepseekV3Config

    m, x = grouped_layer_and_tokens()
    hf = modeling.DeepseekV3TopkRouter(DeepseekV3Config(
        hidden_size=D, n_routed_experts=12, num_experts_per_tok=3, n_group=4, topk_group=2, norm_topk_prob=True,
        routed_scaling_factor=2.5))
    with torch.no_grad():
        hf.weight.copy_(m.router.weight)
        hf.e_score_correction_bias.copy_(m.expert_bias)
    _, chosen, weights = m.route(x)
    _, hf_weights, hf_chosen = hf(x)
    ours, theirs = chosen.sort(-1), hf_chosen.sort(-1)
    assert torch.equal(ours.values, theirs.values)
    torch.testing.assert_close(weights.gather(-1, ours.indices), hf_weights.gather(-1, theirs.indices))


def test_a_step_of_one_token_reports_its_losses_whole():
    """One token, top 1, logits log(4, 2, 1, 1) (probabilities 1/2, 1/4, 1/8, 1/8): it chooses expert 0,
    so the load is 1, 0, 0, 0 (imbalance 1 over a mean of 1/4: 4), its Switch loss E * 1 * 1/2 = 2, its
    z-loss (log 8)^2; the logged figures are per token: the same."""
    m = layer(moe_aux_loss=1.0, moe_z_loss=1.0, moe_top_k=1).train()
    with torch.no_grad():
        m.router.weight.zero_()
        m.router.weight[:, :E] = torch.eye(E)
    x = torch.zeros(1, 1, D)
    x[..., :E] = torch.tensor([4.0, 2, 1, 1]).log()
    m(x).sum().backward()
    hook = hook_of(m, bias_rate=0.0)
    hook.after_optimizer_step(applied=True)
    assert hook.last["moe_imbalance"] == 4.0
    assert hook.last["moe_aux_loss"] == pytest.approx(2.0, rel=1e-6)
    assert hook.last["moe_z_loss"] == pytest.approx(math.log(8) ** 2, rel=1e-6)


def test_a_checkpoint_holds_the_routing_bias_and_not_the_steps_counts():
    """expert_bias is learned state (saved, restored on resume); stats are this step's counts (not saved)."""
    keys = set(MoE(ModelConfig(dim=16, n_heads=2, moe_experts=4, moe_top_k=2)).state_dict())
    assert "expert_bias" in keys and "stats" not in keys


def test_a_layer_outside_the_trainer_adds_its_auxiliary_gradient_once():
    """loss_factor (d total loss / d sum of token losses) is the step hook's to set; a layer used on its
    own starts at 1."""
    assert MoE(ModelConfig(dim=16, n_heads=2, moe_experts=4, moe_top_k=2, moe_aux_loss=0.01)).loss_factor == 1.0


def test_the_balance_hook_names_every_moe_block_and_the_prediction_modules_and_keeps_the_warmup():
    """MoEBalance.for_model: the MoE blocks (the dense first one left out) and multi-token prediction's
    blocks after the last, numbered from n_layers; the warm-up it is given."""
    cfg = ModelConfig(dim=16, n_layers=3, n_heads=2, moe_experts=4, moe_top_k=2, moe_first_dense=1, mtp_depth=2)
    moe = MoE(cfg)
    model = nn.ModuleDict({"layers": nn.ModuleList([nn.ModuleDict({"moe": moe}) if i else nn.ModuleDict()
                                                    for i in range(3)])})
    hook = MoEBalance.for_model([model], cfg, [], device="cpu", warmup=7)
    assert hook.names == ["layers.1.moe", "layers.2.moe", "mtp.0.block.moe", "mtp.1.block.moe"]
    assert hook.warmup == 7 and list(hook.layers.values()) == [moe]
    assert MoEBalance.for_model([model], cfg, [], device="cpu").warmup == 0
    # experts every 3rd block: the prediction modules continue the count (blocks 4, 5, 6: the third holds experts)
    every = ModelConfig(dim=16, n_layers=4, n_heads=2, moe_experts=4, moe_top_k=2, moe_every=3, mtp_depth=3)
    model = nn.ModuleDict({"layers": nn.ModuleList([nn.ModuleDict({"moe": MoE(every)} if i in (0, 3) else {})
                                                    for i in range(4)])})
    assert MoEBalance.for_model([model], every, [], device="cpu").names == ["layers.0.moe", "layers.3.moe",
                                                                           "mtp.2.block.moe"]
