"""optim.name=muon on one process: the same steps as torch.optim.Muon (and AdamW for the rest), Newton-Schulz
against a hand computation, the parameter split, the state, the options' errors; and the whole-matrix
exchange (optim/whole.py) on 4 forked ranks against torch's Newton-Schulz on the whole matrices."""

from __future__ import annotations

import json
import math

import pytest
import torch

from scaletrain.errors import ConfigError
from scaletrain.model.flops import ns_flops
from scaletrain.model.transformer import Transformer
from scaletrain.optim import build_optimizer, optimizer_state_bytes, param_groups
from scaletrain.optim.muon import adjusted_lr, muon_split, newton_schulz

from conftest import micro_cfg, one_line_exit_2, read_metrics, run_here

A, B, C = 3.4445, -4.7750, 2.0315  # Keller Jordan's coefficients (torch.optim.Muon's defaults)
MOE = {"model.moe_experts": 3, "model.moe_top_k": 2, "model.activation": "swiglu", "model.tie_embeddings": False}


def _model(tmp_path, **extra):
    cfg = micro_cfg(tmp_path, **{"optim.name": "muon", **extra})
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    for p in model.parameters():  # (the layers' own init leaves some weights at zero or one)
        torch.nn.init.normal_(p, std=0.05)
    return cfg, model


def _fake_grads(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g) * 0.01


@pytest.mark.parametrize("adjust", ["match_rms_adamw", "original"])
def test_three_steps_equal_torch_muon_and_adamw_bit_for_bit(tmp_path, adjust):
    """Our optimizer against torch.optim.Muon on the matrices and torch.optim.AdamW on the rest, from the
    same weights and gradients: the same bits (bf16 Newton-Schulz, as torch's), weights and state."""
    cfg, ours = _model(tmp_path, **{"optim.muon.adjust_lr": adjust, "optim.muon.momentum": 0.9})
    _, ref = _model(tmp_path)
    named = list(ours.named_parameters())
    opt = build_optimizer(cfg.optim, named, 0.02, torch.device("cpu"))
    ref_named = dict(ref.named_parameters())
    hidden = [ref_named[n] for n, _ in named if n.startswith("layers.") and ref_named[n].ndim == 2]
    rest = [(n, p) for n, p in ref_named.items() if not any(p is h for h in hidden)]
    o = cfg.optim
    ref_opts = [torch.optim.Muon(hidden, lr=0.02, weight_decay=o.weight_decay, momentum=0.9, nesterov=True,
                                 adjust_lr_fn=adjust),
                torch.optim.AdamW(param_groups(rest, o.weight_decay), lr=0.02, betas=(o.beta1, o.beta2), eps=o.eps,
                                  fused=True)]
    for step in range(3):
        _fake_grads(ours, step)
        _fake_grads(ref, step)
        opt.step()
        for r in ref_opts:
            r.step()
    for (name, p), q in zip(named, ref.parameters(), strict=True):
        assert torch.equal(p, q), name
    buffers = [opt.state[p]["momentum_buffer"] for n, p in named if n.startswith("layers.") and p.ndim == 2]
    assert all(torch.equal(b, ref_opts[0].state[h]["momentum_buffer"]) for b, h in zip(buffers, hidden, strict=True))


def _phi(x: float, steps: int) -> float:
    for _ in range(steps):
        x = A * x + B * x ** 3 + C * x ** 5
    return x


@pytest.mark.parametrize("shape", [(5, 3), (3, 5)], ids=["tall", "wide"])
def test_newton_schulz_moves_each_singular_value_as_the_quintic_does(shape):
    """G = U diag(s) V' with U, V orthogonal: NS(G) = U diag(phi^5(s / |s|)) V', phi(x) = ax + bx^3 + cx^5,
    worked out here in Python floats (the quintic acts on each singular value alone)."""
    s = [3.0, 1.0, 0.25]
    q1, _ = torch.linalg.qr(torch.randn(shape[0], shape[0], generator=torch.Generator().manual_seed(1),
                                        dtype=torch.float64))
    q2, _ = torch.linalg.qr(torch.randn(shape[1], shape[1], generator=torch.Generator().manual_seed(2),
                                        dtype=torch.float64))
    k = min(shape)
    norm = math.sqrt(sum(x * x for x in s))
    g = q1[:, :k] @ torch.diag(torch.tensor(s, dtype=torch.float64)) @ q2[:, :k].T
    want = q1[:, :k] @ torch.diag(torch.tensor([_phi(x / norm, 5) for x in s], dtype=torch.float64)) @ q2[:, :k].T
    got = newton_schulz(g.float(), (A, B, C), 5, 1e-7, torch.float32)
    assert got.shape == shape
    torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=0)
    # the classic cubic (1.5, -0.5, 0) converges to the orthogonal factor U V': its rows orthonormal (wide)
    polar = newton_schulz(g.float(), (1.5, -0.5, 0.0), 60, 1e-7, torch.float32)
    small = polar.T @ polar if shape[0] > shape[1] else polar @ polar.T
    torch.testing.assert_close(small, torch.eye(k), atol=1e-5, rtol=0)


def test_learning_rate_adjustment_by_the_whole_matrix_shape():
    assert adjusted_lr(1.0, "match_rms_adamw", torch.Size([256, 64])) == pytest.approx(0.2 * 16)
    assert adjusted_lr(1.0, "original", torch.Size([256, 64])) == pytest.approx(2.0)
    assert adjusted_lr(1.0, "original", torch.Size([64, 256])) == 1.0
    assert adjusted_lr(1.0, "original", torch.Size([3, 192, 64])) == pytest.approx(math.sqrt(3))  # an expert's
    assert adjusted_lr(0.5, "none", torch.Size([7, 3])) == 0.5
    assert ns_flops(64, 256) == 4 * 64 * 64 * 256 + 2 * 64 ** 3


def test_the_split_takes_block_and_expert_matrices_and_leaves_embeddings_head_norms(tmp_path):
    cfg, model = _model(tmp_path, **MOE)
    muon, rest = muon_split(list(model.named_parameters()), cfg.optim.muon)
    names = {n for n, _ in muon}
    assert {"layers.0.attn.wq.weight", "layers.1.moe.w1", "layers.1.moe.router.weight"} <= names
    assert all(p.ndim >= 2 for _, p in muon)
    assert {n for n, _ in rest} == {n for n, p in model.named_parameters() if n not in names}
    assert not any(n.startswith(("tok_emb", "pos_emb", "output")) or "norm" in n for n in names)
    cfg2 = micro_cfg(tmp_path, **{"optim.name": "muon", **MOE, "optim.muon.exclude": "*.router.*"})
    muon2, _ = muon_split(list(model.named_parameters()), cfg2.optim.muon)
    assert {n for n, _ in muon2} == names - {n for n in names if ".router." in n}


def test_an_expert_tensor_is_orthogonalised_expert_by_expert(tmp_path):
    from torch.optim._muon import _zeropower_via_newtonschulz

    cfg, model = _model(tmp_path, **MOE, **{"optim.muon.momentum": 0.0, "optim.weight_decay": 0.0,
                                             "optim.muon.adjust_lr": "none"})
    w1 = dict(model.named_parameters())["layers.0.moe.w1"]  # (3, 192, 64)
    before = w1.detach().clone()
    opt = build_optimizer(cfg.optim, list(model.named_parameters()), 1.0, torch.device("cpu"))
    _fake_grads(model, 0)
    grad = w1.grad.clone()
    opt.step()
    want = torch.stack([_zeropower_via_newtonschulz(g, (A, B, C), 5, 1e-7) for g in grad])
    assert torch.equal(w1.detach(), before - want.float())  # one Newton-Schulz per expert


def test_state_is_one_buffer_per_matrix_value_as_the_planner_counts(tmp_path):
    from scaletrain.layout import Layout
    from scaletrain.optim import init_optimizer_state
    from scaletrain.plan.params import optimizer_bytes, rank_params

    cfg, model = _model(tmp_path)
    opt = build_optimizer(cfg.optim, list(model.named_parameters()), 1e-3, torch.device("cpu"))
    init_optimizer_state(opt)
    measured = optimizer_state_bytes(opt)
    planned = optimizer_bytes("muon", rank_params(cfg.model, Layout(), 0))
    hidden = sum(p.numel() for n, p in model.named_parameters() if n.startswith("layers.") and p.ndim == 2)
    rest = sum(p.numel() for p in model.parameters()) - hidden
    assert planned == 4 * hidden + 8 * rest
    assert abs(measured - planned) / planned < 0.01, (measured, planned)  # (+ AdamW's step counters)


def test_resume_is_bitwise(tmp_path):
    from scaletrain.train.trainer import Trainer
    from test_checkpoint import run_until

    base = {"train.steps": 6, "checkpoint.every": 3, "optim.name": "muon"}
    history = Trainer(micro_cfg(tmp_path / "a", **base)).fit()["history"]
    straight = [(r["step"], r["loss"], r["grad_norm"]) for r in history]
    cfg = micro_cfg(tmp_path / "b", **{**base, "checkpoint.resume": "auto"})
    run_until(cfg, stop_after=3)
    Trainer(cfg).fit()
    assert [(r["step"], r["loss"], r["grad_norm"]) for r in read_metrics(tmp_path / "b" / "run")] == straight


def test_a_vector_given_to_muon_is_one_line_and_exit_2(tmp_path):
    r = run_here("train", "--optim.name=muon", "--optim.muon.params=layers.*", "--train.steps=1",
                 f"--log.run_dir={tmp_path / 'run'}", "--model.dim=64", "--model.n_layers=2", "--model.n_heads=4")
    one_line_exit_2(r, "optim.muon.params: layers.0.attn_norm.weight has shape (64,)", "optim.muon.exclude")
    r = run_here("train", "--optim.name=muon", "--optim.muon.params=nothing.*", "--train.steps=1",
                 f"--log.run_dir={tmp_path / 'run2'}", "--model.dim=64", "--model.n_layers=2", "--model.n_heads=4")
    one_line_exit_2(r, "optim.muon.params: 'nothing.*' matches no trainable parameter")
    with pytest.raises(ConfigError, match="optim.muon.ns_coefficients='1,2': give three numbers"):
        micro_cfg(tmp_path, **{"optim.name": "muon", "optim.muon.ns_coefficients": "1,2"})


@pytest.mark.parametrize("name,keys", [("adamw8bit", ["--optim.muon.lr=0.02"]),
                                       ("adafactor", ["--optim.muon.momentum=0.9", "--optim.muon.ns_dtype=fp32"])])
def test_muon_keys_given_to_an_8bit_or_factored_optimizer_are_one_line_and_exit_2(tmp_path, name, keys):
    """An 8-bit or factored Muon is not built: [optim.muon] keys with optim.name=adamw8bit or adafactor would be
    dropped without a word, so they stop the run; without them each optimizer is as before (its own tests)."""
    given = ", ".join(k.split("=")[0].lstrip("-") for k in sorted(keys))
    r = run_here("train", f"--optim.name={name}", *keys, "--train.steps=1", f"--log.run_dir={tmp_path / 'run'}")
    one_line_exit_2(r, f"optim.name={name} with {given}: Muon with an 8-bit or factored state is not built",
                    "use optim.name=muon")
    micro_cfg(tmp_path, **{"optim.name": name})  # the same optimizer without Muon's keys loads


def test_muon_with_optimizer_offload_is_refused_in_one_line(tmp_path):
    """FSDP2's CPU offload keeps ZeRO-3's shards in host memory, and Muon's exchange runs on the GPUs'
    collectives (NCCL takes no host tensors): refused by the one legality check, so `train` and the planner
    (its explicit layout and its search) alike; AdamW with offload stays legal on a GPU."""
    from scaletrain.layout import Layout
    from scaletrain.legality import Techniques, job_errors

    layout = Layout(dp_shard=2, zero=3, offload_optimizer=True)
    [line] = job_errors(layout, None, Techniques(optimizer="muon", device_type="cuda"))
    assert line.startswith("optim.name=muon with memory.offload_optimizer: not supported")
    assert job_errors(layout, None, Techniques(optimizer="adamw", device_type="cuda")) == []
    r = run_here("plan", "llama-8b", "--hardware", "H100-SXM", "--nodes", "1", "--gpus-per-node", "8", "--zero", "3",
                 "--dp-shard", "8", "--offload", "--optimizer", "muon")
    one_line_exit_2(r, "optim.name=muon with memory.offload_optimizer: not supported",
                    "drop memory.offload_optimizer")


def test_the_start_says_which_parameters_muon_takes(tmp_path, capsys):
    from scaletrain.train.trainer import Trainer

    Trainer(micro_cfg(tmp_path, **{"optim.name": "muon", "train.steps": 1})).fit()
    assert "optim: Muon steps 12 matrices (98,304 values, 84.0%), AdamW 7 other parameters (18,752, 16.0%)" in \
        capsys.readouterr().err


@pytest.mark.multiproc
def test_whole_matrices_on_4_ranks_equal_torch_newton_schulz_and_send_what_theory_says(tmp_path):
    """ZeRO rows, tp columns, an empty piece, HSDP, FSDP x tp (plain and strided, rows and columns, uneven),
    experts: each rank's piece of the result is bit for bit torch.optim.Muon's Newton-Schulz of the whole
    matrix, cut as the parameter is. Bytes: matrices split 4 ways evenly (rows over 4 ranks, or rows x columns
    over dp 2 x tp 2) move 2 x 3/4 of their values each step (there and back), in bf16. Under dp x tp each
    matrix is orthogonalised once, whole, on its owner among the 4 ranks, and every rank owns some."""
    from forked_ranks import run_forked

    out = tmp_path / "probe.json"
    code, err = run_forked("muon_probe:main", [str(out)], 4, timeout=300)
    assert code == 0, err
    result = json.loads(out.read_text())
    assert result["mismatched"] == []
    for layout in ("flat", "grid"):
        r = result[layout]
        theory = 2 * 3 / 4 * r["values"] * 2
        assert abs(r["sent_bytes"] / theory - 1) < 0.01, (layout, r["sent_bytes"], theory)
        assert sorted(set(r["owners"])) == [0, 1, 2, 3], layout  # five matrices, four owners: each has work
    grid = result["grid"]
    shapes = [[64, 48], [48, 64], [128, 32], [32, 32], [16, 40]]
    owner_of = {tuple(s): grid["group_ranks"][o] for s, o in zip(shapes, grid["owners"], strict=True)}
    assert sorted(s for ran in grid["ran"] for s in ran) == sorted(shapes)  # each once, whole
    for rank, ran in enumerate(grid["ran"]):
        assert all(owner_of[tuple(s)] == rank for s in ran), (rank, ran)


@pytest.mark.parametrize("mode", ["16-mixed", "bf16-true"])
def test_each_precision_tracks_the_fp32_muon_run(tmp_path, mode):
    """fp16 with its loss scale (unscaled before Muon's step), and bf16 weights with fp32 masters (Muon steps
    the masters): every step's loss within verify's tolerance for the mode of the 32-true run's (measured
    1.4e-5 and 5.1e-4, 6 steps)."""
    from scaletrain.train.trainer import Trainer
    from scaletrain.verify import TOLERANCES

    base = {"optim.name": "muon", "train.steps": 6}
    ref = [r["loss"] for r in Trainer(micro_cfg(tmp_path / "fp32", **base)).fit()["history"]]
    got = [r["loss"] for r in Trainer(micro_cfg(tmp_path / mode, **base, **{"precision.mode": mode})).fit()["history"]]
    worst = max(abs(a - b) / b for a, b in zip(got, ref, strict=True))
    assert worst < TOLERANCES[mode][0], worst


def test_the_planner_counts_muon_state_flops_and_exchange_by_hand(tmp_path):
    """llama-8b on 8 H100s under ZeRO-3: Muon's state is 4 bytes per hidden-matrix value and AdamW's 8 for the
    rest; Newton-Schulz's time is the hand count of its FLOPs over the 8 owners at the bf16 peak (on one GPU,
    all of them and no exchange)."""
    from dataclasses import replace

    from scaletrain.hardware import lookup
    from scaletrain.model.presets import PRESETS
    from scaletrain.plan.params import optimizer_bytes, rank_params
    from scaletrain.plan.spec import Cluster, Layout
    from scaletrain.plan.time_model import hardware_efficiency, muon_seconds

    preset = {f"model.{k}": v for k, v in PRESETS["llama-8b"].items()}
    cfg = micro_cfg(tmp_path, **preset, **{"data.seq_len": 128}).model
    d, f, kv, layers = cfg.dim, cfg.hidden_dim, cfg.kv_heads * cfg.head_size, cfg.n_layers
    shapes = [(d, d), (kv, d), (kv, d), (d, d), (f, d), (f, d), (d, f)]  # wq wk wv wo w1 w3 w2 (rows, cols)
    hidden = layers * sum(r * c for r, c in shapes)
    layout = Layout(dp_shard=8, zero=3)
    counts = rank_params(cfg, layout, 0)
    assert counts.hidden == hidden
    assert optimizer_bytes("muon", counts) == 4 * hidden + 8 * (counts.total - hidden)
    flops = layers * sum(5 * (4 * min(s) ** 2 * max(s) + 2 * min(s) ** 3) for s in shapes)
    hw = lookup("H100-SXM")
    cluster = Cluster(hw, 1, 8)
    compute, exchange = muon_seconds(cfg, layout, cluster, 0)
    assert compute == pytest.approx(flops / 8 / (hw.peak_flops("bf16") * hardware_efficiency(hw)))
    one = Cluster(hw, 1, 1)
    assert muon_seconds(cfg, replace(layout, dp_shard=1, zero=0), one, 0) == (pytest.approx(compute * 8), 0.0)
    assert exchange > 0
    # ZeRO-3 x tp 2 on the same 8: one owner per matrix among all 8 (not gathered on each), the same share of
    # the values sent as ZeRO over 8 (2 x 7/8 over 8 ranks), on the same links (one node)
    assert muon_seconds(cfg, replace(layout, dp_shard=4, tp=2), cluster, 0) == (pytest.approx(compute),
                                                                                pytest.approx(exchange))
