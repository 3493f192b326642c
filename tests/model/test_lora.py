"""Adapters (adapter.kind = lora | dora, scaletrain.model.lora): the base frozen, the adapters alone
trained, zero-initialised updates that start exactly at the base, numerics against PEFT's, and
the configuration errors one line each."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from scaletrain.errors import ConfigError
from scaletrain.model.lora import AdapterSpec, LoRALinear, apply_adapters, init_magnitudes, resolve_targets
from scaletrain.model.transformer import Transformer
from scaletrain.train.trainer import Trainer
from scaletrain.verify import TOLERANCES

from conftest import (
    MICRO_ARGS,
    Lazy,
    assert_same_run,
    assert_same_weights,
    fit_reference,
    micro_cfg,
    micro_overrides,
    one_line_exit_2,
    run_group,
    run_here,
    wanted_params,
)

ADAPTED = ("attn.wq", "attn.wk", "attn.wv", "attn.wo", "mlp.w1", "mlp.w2")  # the micro model's block linears


def tokens() -> torch.Tensor:
    return torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("kind", ["lora", "dora"])
def test_zero_initialised_adapters_give_exactly_the_base_models_logits(tmp_path, kind):
    base = Trainer(micro_cfg(tmp_path / "base", **{"train.steps": 1}))
    adapted = Trainer(micro_cfg(tmp_path / kind, **{"train.steps": 1, "adapter.kind": kind}))
    lora = [m for m in adapted.model.modules() if isinstance(m, LoRALinear)]
    assert len(lora) == 2 * len(ADAPTED)
    assert all(m.lora_a.abs().sum() > 0 and m.lora_b.abs().sum() == 0 for m in lora)
    # A drawn from normal(0, 1/rank), the module's rule (rank 8: std 0.125), over its ~9k values
    a = torch.cat([m.lora_a.detach().reshape(-1) for m in lora])
    assert abs(a.mean().item()) < 0.01 and abs(a.std().item() - 1 / 8) < 0.005, (a.mean().item(), a.std().item())
    # the base's weights keep their names and their (seed, name) values
    base_weights = dict(base.pm.dp.named_params)
    for name, p in adapted.pm.dp.named_params:
        if name in base_weights:
            assert torch.equal(p, base_weights[name]), name
    with torch.no_grad():
        assert torch.equal(adapted.model(tokens()), base.model(tokens()))


@pytest.mark.parametrize("kind", ["lora", "dora"])
def test_only_the_adapters_train_and_hold_optimizer_state(tmp_path, kind):
    trainer = Trainer(micro_cfg(tmp_path, **{"train.steps": 6, "adapter.kind": kind, "optim.warmup_steps": 1}))
    before = {n: p.detach().clone() for n, p in trainer.pm.dp.named_params}
    leaves = ("lora_a", "lora_b", "lora_magnitude") if kind == "dora" else ("lora_a", "lora_b")
    want = sorted(f"layers.{i}.{lin}.{leaf}" for i in range(2) for lin in ADAPTED for leaf in leaves)
    assert sorted(n for n, _ in trainer.pm.optim_params) == want
    losses = trainer.fit()["losses"]
    assert losses[-1] < losses[0] - 0.05, losses  # the adapters alone move the loss
    state_of = {id(p) for p in trainer.optimizer.state}
    for name, p in trainer.pm.dp.named_params:
        adapter = name in want
        assert p.requires_grad == adapter and (id(p) in state_of) == adapter, name
        assert p.grad is None, name  # zeroed after the step; a frozen one never had one
        moved = not torch.equal(p, before[name])
        assert moved == adapter, f"{name} {'moved' if moved else 'stayed'}"


def test_a_frozen_base_gets_no_gradient_in_backward(tmp_path):
    trainer = Trainer(micro_cfg(tmp_path, **{"train.steps": 1, "adapter.kind": "lora", "adapter.targets": "attention"}))
    trainer.model(tokens()).float().square().mean().backward()
    got = sorted(n for n, p in trainer.pm.dp.named_params if p.grad is not None)
    assert got == sorted(f"layers.{i}.attn.{w}.{leaf}" for i in range(2) for w in ("wq", "wk", "wv", "wo")
                         for leaf in ("lora_a", "lora_b"))


def test_targets_resolve_groups_names_and_patterns():
    cfg = micro_cfg(__import__("pathlib").Path("/nonexistent"), **{"model.activation": "swiglu"}).model
    with torch.device("meta"):
        model = Transformer(cfg)
    block = [f"layers.{i}.{n}" for i in range(2) for n in ("attn.wq", "attn.wk", "attn.wv", "attn.wo",
                                                           "mlp.w1", "mlp.w3", "mlp.w2")]
    assert resolve_targets(model, "all-linear") == block  # not the output head
    assert resolve_targets(model, "attention") == [n for n in block if ".attn." in n]
    assert resolve_targets(model, "mlp") == [n for n in block if ".mlp." in n]
    assert resolve_targets(model, "*.wq, layers.1.mlp.w2") == ["layers.0.attn.wq", "layers.1.attn.wq",
                                                               "layers.1.mlp.w2"]
    assert resolve_targets(model, "output") == ["output"]  # by name, the head can be adapted
    with pytest.raises(ConfigError, match=r"'attn' matches no linear of the model \(did you mean attention\?\); "
                                          r"its linears are layers\.\*\.attn\.wq, .*, layers\.\*\.mlp\.w2, "
                                          r"output \(\* = block 0 to 1\)"):
        resolve_targets(model, "attn")
    with pytest.raises(ConfigError, match=r"'MLPX' matches no linear of the model \(did you mean mlp\?\)"):
        resolve_targets(model, "MLPX")  # a misspelt group in capitals is not a pattern either


@pytest.mark.parametrize("rslora", [False, True])
@pytest.mark.parametrize("kind", ["lora", "dora"])
def test_numerics_match_peft(kind, rslora):
    peft = pytest.importorskip("peft")

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = nn.Linear(24, 40, bias=True), nn.Linear(40, 24, bias=False)

        def forward(self, x):
            return self.down(torch.tanh(self.up(x)))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([Block()])

        def forward(self, x):
            return self.layers[0](x)

    torch.manual_seed(0)
    ours, theirs = Net(), Net()
    theirs.load_state_dict(ours.state_dict())
    spec = AdapterSpec(kind, rank=4, alpha=12.0, targets="all-linear", rslora=rslora)
    assert apply_adapters(ours, spec) == ["layers.0.up", "layers.0.down"]
    init_magnitudes(ours) if kind == "dora" else None
    theirs = peft.get_peft_model(theirs, peft.LoraConfig(r=4, lora_alpha=12.0, target_modules=["up", "down"],
                                                         use_dora=kind == "dora", use_rslora=rslora))
    # in float64: the same formula computed in another order (ours scales the rank-r intermediate, PEFT
    # the output) then differs by far less than the tolerances, where float32's last bits, through
    # tanh's nearly flat tails and the sums' cancellations, reach them
    ours, theirs = ours.double(), theirs.double()
    with torch.no_grad():
        for i in range(2):
            mine, peer = (getattr(m.layers[0], ("up", "down")[i]) for m in (ours, theirs.base_model.model))
            mine.lora_a.normal_()
            mine.lora_b.normal_()  # a trained-looking update, not the zero start
            peer.lora_A["default"].weight.copy_(mine.lora_a)
            peer.lora_B["default"].weight.copy_(mine.lora_b)
            if kind == "dora":
                # the magnitude peft starts from is the base's row norms, as ours
                torch.testing.assert_close(peer.lora_magnitude_vector["default"].weight, mine.lora_magnitude,
                                           rtol=0, atol=1e-6)
                mine.lora_magnitude.mul_(1.5)
                peer.lora_magnitude_vector["default"].weight.copy_(mine.lora_magnitude)
    x = torch.randn(3, 5, 24, dtype=torch.float64)
    a, b = ours(x), theirs(x)
    assert (a - b).abs().max().item() <= 1e-6 * max(1.0, b.abs().max().item())
    a.square().sum().backward()
    b.square().sum().backward()
    for i in range(2):
        mine, peer = (getattr(m.layers[0], ("up", "down")[i]) for m in (ours, theirs.base_model.model))
        pairs = [(mine.lora_a, peer.lora_A["default"].weight), (mine.lora_b, peer.lora_B["default"].weight)]
        if kind == "dora":
            pairs.append((mine.lora_magnitude, peer.lora_magnitude_vector["default"].weight))
        for p, q in pairs:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-5)
        assert mine.weight.grad is None


@pytest.mark.parametrize("kind", ["lora", "dora"])
def test_a_chosen_subset_with_adapter_dropout_matches_peft_in_training_and_in_eval(kind):
    """Targets by name and pattern (not every linear) and dropout on the adapters' input, against PEFT's
    LoraConfig of the same modules: PEFT adapts the same linears; in eval both give the same output,
    forward after forward; in training each forward draws a new mask, and from the same seed both
    draw the same one (dropout on x before A, the base's output left whole; DoRA: the magnitude's
    share of the base's output sees the dropped input too)."""
    peft = pytest.importorskip("peft")

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = nn.Linear(24, 40, bias=True), nn.Linear(40, 24, bias=False)

        def forward(self, x):
            return x + self.down(torch.tanh(self.up(x)))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([Block(), Block()])

        def forward(self, x):
            return self.layers[1](self.layers[0](x))

    torch.manual_seed(0)
    ours, theirs = Net().double(), Net().double()
    theirs.load_state_dict(ours.state_dict())
    spec = AdapterSpec(kind, rank=4, alpha=12.0, dropout=0.3, targets="layers.1.up, *.down")
    assert apply_adapters(ours, spec) == ["layers.0.down", "layers.1.up", "layers.1.down"]
    ours.double()
    init_magnitudes(ours)
    theirs = peft.get_peft_model(theirs, peft.LoraConfig(r=4, lora_alpha=12.0, lora_dropout=0.3,
                                                         use_dora=kind == "dora",
                                                         target_modules=r"layers\.1\.up|layers\.\d\.down"))
    adapted = [n.removeprefix("base_model.model.") for n, m in theirs.named_modules() if hasattr(m, "lora_A")]
    assert adapted == ["layers.0.down", "layers.1.up", "layers.1.down"]
    assert not isinstance(ours.layers[0].up, LoRALinear)
    with torch.no_grad():
        for name in adapted:
            mine, peer = ours.get_submodule(name), theirs.base_model.model.get_submodule(name)
            mine.lora_a.normal_()
            mine.lora_b.normal_()
            peer.lora_A["default"].weight.copy_(mine.lora_a)
            peer.lora_B["default"].weight.copy_(mine.lora_b)
            if kind == "dora":
                mine.lora_magnitude.mul_(1.5)
                peer.lora_magnitude_vector["default"].weight.copy_(mine.lora_magnitude)
    x = torch.randn(3, 5, 24, dtype=torch.float64)
    tol = 1e-10 if kind == "lora" else 1e-6  # DoRA's row norms are taken in fp32 (as test_numerics_match_peft)
    with torch.no_grad():
        ours.eval(), theirs.eval()
        a, again, b = ours(x), ours(x), theirs(x)
        assert torch.equal(a, again)
        assert (a - b).abs().max().item() <= tol * b.abs().max().item()
        ours.train(), theirs.train()
        torch.manual_seed(7)
        a1, a2 = ours(x), ours(x)
        torch.manual_seed(7)
        b1, b2 = theirs(x), theirs(x)
    assert not torch.allclose(a1, a2) and not torch.allclose(a1, a)  # a new mask each forward, and one at all
    assert (a1 - b1).abs().max().item() <= tol * b1.abs().max().item()
    assert (a2 - b2).abs().max().item() <= tol * b2.abs().max().item()


def test_merged_weight_computes_what_the_adapted_linear_does():
    torch.manual_seed(1)
    for kind in ("lora", "dora"):
        lin = nn.Linear(16, 8)
        adapted = LoRALinear(lin, AdapterSpec(kind, rank=2, alpha=4.0))
        with torch.no_grad():
            adapted.lora_a.normal_()
            adapted.lora_b.normal_()
            if kind == "dora":
                adapted.lora_magnitude.uniform_(0.5, 2.0)
        x = torch.randn(4, 16)
        torch.testing.assert_close(adapted(x), nn.functional.linear(x, adapted.merged_weight(), lin.bias))


def test_the_spec_carries_every_adapter_option_of_the_config(tmp_path):
    """adapter.* as the layers receive them: the dropout and rslora too (the scale by hand: alpha / sqrt(rank)
    = 6 / 3 with rslora, 6 / 9 without), and no spec at all for adapter.kind=none."""
    cfg = micro_cfg(tmp_path, **{"adapter.kind": "dora", "adapter.rank": 9, "adapter.alpha": 6.0,
                                 "adapter.dropout": 0.25, "adapter.targets": "mlp", "adapter.rslora": True})
    spec = AdapterSpec.of(cfg.adapter)
    assert (spec.kind, spec.rank, spec.alpha, spec.dropout, spec.targets, spec.rslora) == ("dora", 9, 6.0, 0.25,
                                                                                          "mlp", True)
    assert spec.scale == 2.0 and AdapterSpec(rank=9, alpha=6.0).scale == pytest.approx(6 / 9)
    lin = LoRALinear(nn.Linear(8, 5), spec)
    assert lin.scale == 2.0 and isinstance(lin.dropout, nn.Dropout) and lin.dropout.p == 0.25
    assert AdapterSpec.of(micro_cfg(tmp_path).adapter) is None


@pytest.mark.parametrize("kind", ["lora", "dora"])
def test_an_adapted_linear_is_made_on_its_bases_device_with_its_base_frozen(kind):
    """The adapters are created where the base is (the meta device before materializing; a GPU's base on the
    GPU), and the base's weight and bias stop taking gradients, whoever builds the linear."""
    with torch.device("meta"):
        base = nn.Linear(24, 40)
    lin = LoRALinear(base, AdapterSpec(kind, rank=3))
    adapters = [lin.lora_a, lin.lora_b] + ([lin.lora_magnitude] if kind == "dora" else [])
    assert [p.device.type for p in adapters] == ["meta"] * len(adapters)
    assert [tuple(p.shape) for p in adapters][:2] == [(3, 24), (40, 3)]
    assert not lin.weight.requires_grad and not lin.bias.requires_grad
    assert lin.weight is base.weight and lin.bias is base.bias


@pytest.mark.parametrize("bias", [True, False])
def test_adapters_off_computes_the_base_alone_then_the_adapters_again(bias):
    """Inside adapters_off (a preference run's reference) each adapted linear gives what its base linear
    gave before adapting, on inputs of any leading shape; after the block, the adapted output again."""
    from scaletrain.model.lora import adapters_off

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(24, 40, bias=bias), nn.Tanh(), nn.Linear(40, 7, bias=bias))
    plain = nn.Sequential(*(m for m in __import__("copy").deepcopy(net)))
    apply_adapters(net, AdapterSpec("lora", rank=3, targets="0, 2"))
    with torch.no_grad():
        for m in (net[0], net[2]):  # (apply_adapters leaves A and B as allocated: a model's init fills them)
            m.lora_a.normal_(std=1 / 3)
            m.lora_b.normal_()  # a trained-looking update
    x = torch.randn(3, 5, 24)
    with torch.no_grad():
        adapted = net(x)
        with adapters_off([net]):
            off = net(x)
        again = net(x)
        want = plain(x)
    assert off.shape == (3, 5, 7) and torch.equal(off, want)
    assert torch.equal(again, adapted) and (adapted - want).abs().max() > 0.1


def test_lora_under_autocast_gives_the_fp32_answer_to_its_precision():
    """bf16-mixed: the base's matmul and the adapters' run in bf16 under autocast; the output is
    W x + b + s B (A x) computed by hand in float64, within bf16's rounding of these magnitudes."""
    torch.manual_seed(0)
    lin = LoRALinear(nn.Linear(24, 40), AdapterSpec("lora", rank=3, alpha=6.0))
    with torch.no_grad():
        lin.lora_a.normal_()
        lin.lora_b.normal_()
    x = torch.randn(3, 5, 24)
    w, b, a, bb = (t.detach().double() for t in (lin.weight, lin.bias, lin.lora_a, lin.lora_b))
    want = x.double() @ w.T + b + 2.0 * (x.double() @ a.T) @ bb.T
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        got = lin(x)
    assert got.dtype == torch.bfloat16
    assert (got.double() - want).abs().max() <= 2 ** -7 * want.abs().max()


def _net_with_root_parameter():
    """A custom module: a parameter of its own (no dot in its name), a linear outside any block list, a
    block list whose items are linears themselves, and blocks with linears named by a group word."""
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn, self.ffn = nn.Linear(6, 6), nn.Linear(6, 6)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.gain = nn.Parameter(torch.ones(6))
            self.embed = nn.Sequential(nn.Linear(5, 6))
            self.layers = nn.ModuleList([nn.Linear(6, 6) for _ in range(2)])
            self.blocks = nn.ModuleList([Block() for _ in range(3)])
            self.head = nn.Linear(6, 5)

    return Net()


def test_targets_of_a_custom_module_by_group_follow_its_blocks_and_words():
    """The groups choose linears inside the repeated blocks only (a block list's items may be linears
    themselves; a linear in another container is outside), a linear named by a group word belongs to that
    group, and a parameter of the module itself (no dot in its name) stays frozen and plain."""
    from scaletrain.model.lora import adapter_init_rule
    from scaletrain.model.transformer import InitRule

    net = _net_with_root_parameter()
    blocks = [f"blocks.{i}.{n}" for i in range(3) for n in ("attn", "ffn")]
    assert resolve_targets(net, "all-linear") == ["layers.0", "layers.1", *blocks]
    assert resolve_targets(net, "attention") == [n for n in blocks if n.endswith("attn")]
    assert resolve_targets(net, "mlp") == [n for n in blocks if n.endswith("ffn")]
    wrapper = nn.Module()
    wrapper.model = net  # nested, as Hugging Face's models hold their blocks (model.layers.0...)
    assert resolve_targets(wrapper, "all-linear") == [f"model.{n}" for n in ["layers.0", "layers.1", *blocks]]
    apply_adapters(net, AdapterSpec("lora", rank=2, targets="all-linear"))
    assert isinstance(net.layers[1], LoRALinear) and not isinstance(net.embed[0], LoRALinear)
    assert sorted(n for n, p in net.named_parameters() if p.requires_grad) == sorted(
        f"{m}.{leaf}" for m in ["layers.0", "layers.1", *blocks] for leaf in ("lora_a", "lora_b"))
    rule = adapter_init_rule(lambda name: InitRule("zeros") if name == "gain" else InitRule("normal", 0.02),
                             AdapterSpec(rank=4))
    assert rule("gain") == InitRule("zeros") and rule("blocks.0.attn.lora_a") == InitRule("normal", 0.25)


def test_a_mixtures_router_is_never_in_a_group():
    """all-linear and mlp leave each block's router plain and frozen (it decides, it does not compute);
    the experts' shared MLP and the attention's linears are chosen."""
    cfg = micro_cfg(Path("/nonexistent"), **{"model.moe_experts": 3, "model.moe_top_k": 1,
                                             "model.moe_shared_experts": 1, "model.activation": "swiglu"}).model
    with torch.device("meta"):
        model = Transformer(cfg)
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    routers = [n for n in linears if n.endswith(".router")]
    assert len(routers) == 2
    shared = [f"layers.{i}.moe.shared.{w}" for i in range(2) for w in ("w1", "w3", "w2")]
    assert resolve_targets(model, "mlp") == shared
    assert resolve_targets(model, "all-linear") == [n for n in linears if n not in routers and n != "output"]
    assert len(resolve_targets(model, "all-linear")) == 2 * 4 + len(shared)
    dense = micro_cfg(Path("/nonexistent"), **{"model.moe_experts": 3}).model
    with torch.device("meta"), pytest.raises(ConfigError, match=r"'mlp' matches no linear of the model; its linears "
                                                                r"are .*layers\.\*\.moe\.router"):
        resolve_targets(Transformer(dense), "mlp")  # (a group is not told to mean itself)


def test_an_empty_entry_in_targets_is_skipped_and_the_rest_still_read():
    cfg = micro_cfg(Path("/nonexistent")).model
    with torch.device("meta"):
        model = Transformer(cfg)
    assert resolve_targets(model, "attention, ,mlp,") == resolve_targets(model, "all-linear")


def test_a_target_that_matches_nothing_lists_the_linears_whatever_their_blocks():
    """The message lists each linear once, a block's index written * with the blocks' range (three blocks:
    0 to 2); a module without blocks lists its names as they are, one without linears says none; a pattern
    is given the names, not a group's spelling."""
    net = _net_with_root_parameter()
    with pytest.raises(ConfigError, match=r"its linears are embed\.\*, layers\.\*, blocks\.\*\.attn, blocks\.\*\.ffn, "
                                          r"head \(\* = block 0 to 2\); name them"):
        resolve_targets(net, "wq")
    flat = nn.Sequential()
    flat.add_module("proj", nn.Linear(4, 4))
    flat.add_module("head", nn.Linear(4, 2))
    with pytest.raises(ConfigError, match=r"its linears are proj, head; name them"):
        resolve_targets(flat, "wq")
    with pytest.raises(ConfigError, match=r"its linears are none; name them"):
        resolve_targets(nn.Sequential(nn.ReLU()), "attention")
    with pytest.raises(ConfigError) as e:
        resolve_targets(flat, "mlp*")
    assert "'mlp*' matches no linear of the model; its linears" in str(e.value)  # no "(did you mean mlp?)"


def test_adapting_again_adds_the_new_targets_and_keeps_the_adapted_ones():
    cfg = micro_cfg(Path("/nonexistent")).model
    model = Transformer(cfg)
    apply_adapters(model, AdapterSpec("lora", rank=2, targets="attention"))
    first = model.get_submodule("layers.0.attn.wq")
    every = resolve_targets(model, "all-linear")
    assert apply_adapters(model, AdapterSpec("lora", rank=2, targets="all-linear")) == every
    assert model.get_submodule("layers.0.attn.wq") is first  # not an adapter wrapped in another
    assert all(isinstance(model.get_submodule(n), LoRALinear) for n in every)


def test_a_converted_linear_is_refused_by_name_and_kind():
    class FakeQuantLinear(nn.Linear):
        pass

    net = nn.Sequential(nn.Linear(4, 4), FakeQuantLinear(4, 4))
    with pytest.raises(ConfigError, match=r"^adapter.kind=lora: 1 is a FakeQuantLinear, not a plain linear; adapters "
                                          r"go on plain linears \(train.qat=none"):
        apply_adapters(net, AdapterSpec("lora", targets="0, 1"))


def test_bad_adapter_settings_are_one_line_and_exit_2(tmp_path):
    one_line_exit_2(run_here("train", "--adapter.kind=lora", "--adapter.rank=0"), "adapter.rank=0",
                    "at least 1")
    one_line_exit_2(run_here("train", "--adapter.kind=lorra"), "adapter.kind", "did you mean lora?")
    r = run_here("train", *MICRO_ARGS, f"--log.run_dir={tmp_path / 'r'}", "--adapter.kind=lora",
                 "--adapter.targets=layers.*.attn.wz")
    one_line_exit_2(r, "'layers.*.attn.wz' matches no linear", "layers.*.attn.wq", "all-linear, attention, mlp")
    r = run_here("train", *MICRO_ARGS, f"--log.run_dir={tmp_path / 'q'}", "--adapter.kind=dora",
                 "--train.qat=int8-dynamic", "--model.dim=128")  # refused where the job is settled
    one_line_exit_2(r, "adapter.kind=dora with train.qat=int8-dynamic")


# --- every layout: the adapters train on 2 and 4 ranks as in one process ----------------------

STEPS = 4
KV1 = {"model.norm": "rmsnorm", "model.activation": "swiglu", "model.position": "rope", "model.n_kv_heads": 1}
REFERENCES = {"lora": ("lora", {}), "dora": ("dora", {}), "lora-kv1": ("lora", KV1),  # name: (kind, model)
              "lora+nf4": ("lora+nf4", {}), "lora+int8": ("lora+int8", {})}  # kind+adapter.base_dtype
TP_SPLIT = {"parallel.tp": 2}
LAYOUTS = {  # ranks: (name, reference, overrides), each group in one launch
    2: [("lora-ddp", "lora", {"parallel.dp_shard": 2, "parallel.zero": 0}),
        ("lora-zero2", "lora", {"parallel.dp_shard": 2, "parallel.zero": 2}),
        ("lora-zero3", "lora", {"parallel.dp_shard": 2, "parallel.zero": 3, "checkpoint.save_final": True}),
        ("dora-zero1", "dora", {"parallel.dp_shard": 2, "parallel.zero": 1}),
        ("dora-zero3", "dora", {"parallel.dp_shard": 2, "parallel.zero": 3, "checkpoint.save_final": True}),
        # QLoRA: FSDP2 shards and all-gathers the NF4 base (quantized whole, then split by rows)
        ("qlora-nf4-zero3", "lora+nf4", {"parallel.dp_shard": 2, "parallel.zero": 3}),
        ("qlora-nf4-ddp", "lora+nf4", {"parallel.dp_shard": 2, "parallel.zero": 0}),
        # ... compiled (the base's matmul one opaque op), and split into pipeline stages (each fills its own bases)
        ("qlora-nf4-ddp-compile", "lora+nf4", {"parallel.dp_shard": 2, "parallel.zero": 0, "train.compile": True}),
        ("qlora-nf4-pp2", "lora+nf4", {"parallel.pp": 2, "parallel.pp_schedule": "1f1b",
                                       "checkpoint.save_final": True}),
        ("qlora-int8-zero2", "lora+int8", {"parallel.dp_shard": 2, "parallel.zero": 2}),
        ("lora-tp2", "lora", {**TP_SPLIT, "checkpoint.save_final": True}),
        ("lora-tp2-sp", "lora", {**TP_SPLIT, "parallel.sp": True}),
        ("dora-tp2", "dora", {**TP_SPLIT, "checkpoint.save_final": True}),
        ("dora-tp2-sp", "dora", {**TP_SPLIT, "parallel.sp": True}),
        # one K/V head for 2 tp ranks: wk, wv and their adapters whole on each, used in part
        ("lora-tp2-kv1", "lora-kv1", TP_SPLIT),
        ("lora-pp2", "lora", {"parallel.pp": 2, "parallel.pp_schedule": "1f1b", "checkpoint.save_final": True}),
        ("dora-cp2", "dora", {"parallel.cp": 2, "parallel.cp_method": "ring"}),
        ("lora-ddp-compile-ac", "lora", {"parallel.dp_shard": 2, "parallel.zero": 0, "train.compile": True,
                                         "memory.activation_checkpointing": "full"})],
    4: [("dora-dp2xtp2-zero3", "dora", {**TP_SPLIT, "parallel.zero": 3}),
        ("lora-dp2xtp2-zero1-sp", "lora", {**TP_SPLIT, "parallel.zero": 1, "parallel.sp": True}),
        ("lora-hsdp", "lora", {"parallel.dp_replicate": 2, "parallel.dp_shard": 2, "parallel.zero": 3})],
}
EVERY = [(n, r) for group in LAYOUTS.values() for n, r, _ in group]


def adapter_run(kind: str) -> dict:
    kind, _, base = kind.partition("+")
    return {"train.steps": STEPS, "adapter.kind": kind, "adapter.dropout": 0.0, "train.micro_batch": 2,
            **({"adapter.base_dtype": base} if base else {})}


def adapter_layout(trainer):
    """dist_worker's probe: how this rank holds each adapter (placements, local and whole shape)."""
    def report():
        return {n: [[repr(pl) for pl in p.placements], list(p.to_local().shape), list(p.shape)]
                for n, p in trainer.pm.dp.named_params if ".lora_" in n and hasattr(p, "placements")}
    return report


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    return Lazy({name: (lambda name=name, kind=kind, model=model: fit_reference(micro_cfg(
        tmp_path_factory.mktemp(name), **adapter_run(kind), **model))) for name, (kind, model) in REFERENCES.items()})


@pytest.fixture(scope="module")
def group_runs(tmp_path_factory, request):
    """group_runs(name): a layout's results; each group of ranks runs (the layouts of it this
    session's tests ask for) when a test first needs one of them."""
    wanted = wanted_params(request, "name")
    tmp, done = tmp_path_factory.mktemp("lora-mp"), {}

    def get(name: str) -> dict:
        if name not in done:
            ranks = next(n for n, group in LAYOUTS.items() if name in {g[0] for g in group})
            chosen = [(n, ref, extra) for n, ref, extra in LAYOUTS[ranks] if wanted is None or n in wanted]
            jobs = [{"overrides": micro_overrides(tmp / n, **{**adapter_run(REFERENCES[ref][0]), **REFERENCES[ref][1],
                                                             **extra}),
                     "probe": "test_lora:adapter_layout" if "parallel.tp" in extra else None}
                    for n, ref, extra in chosen]
            code, results, err = run_group(ranks, jobs, tmp)
            assert code == 0, err
            done.update({n: r for (n, _, _), r in zip(chosen, results, strict=True)})
        return done[name]

    get.folder = tmp  # each layout's run folder is folder / name
    return get


@pytest.mark.multiproc
@pytest.mark.parametrize("name,ref", EVERY, ids=[n for n, _ in EVERY])
def test_adapters_on_every_layout_match_one_process(group_runs, references, name, ref):
    """Losses and gradient norms before clipping every step, and the final adapters, as in one
    process; the frozen base stays where it started on the ranks."""
    got, want = group_runs(name), references[ref]
    frozen = [n for n, w in want["weights"].items() if w[2] == 0]
    assert frozen and all(".lora_" not in n for n in frozen)  # the base stayed where it started in one process
    for n in frozen:  # ... and on the ranks
        assert got["weights"][n][:2] == want["weights"][n][:2], f"{name}: the frozen {n} moved"
    assert_same_run(got["history"], want["history"], steps=STEPS, tol=TOLERANCES["32-true"], what=name)
    assert_same_weights(got["weights"], want["weights"], tol=1e-3, what=name)


@pytest.mark.multiproc
@pytest.mark.parametrize("name", ["lora-tp2", "dora-tp2-sp"])
def test_tensor_parallelism_splits_the_adapters_like_their_base(group_runs, name):
    """Column-parallel base (rows split): B's rows and the magnitude split, A whole; row-parallel
    base (wo, w2: columns split): A's columns split, B and the magnitude whole."""
    layout = group_runs(name)["ranks"][0]["probe"]
    leaves = ("lora_a", "lora_b", "lora_magnitude") if name.startswith("dora") else ("lora_a", "lora_b")
    assert sorted(layout) == sorted(f"layers.{i}.{lin}.{leaf}" for i in range(2) for lin in ADAPTED
                                    for leaf in leaves)
    for n, (placements, local, whole) in layout.items():
        linear, leaf = n.split(".")[-2:]
        rowwise = linear in ("wo", "w2")
        split = {"lora_a": 1 if rowwise else None, "lora_b": None if rowwise else 0,
                 "lora_magnitude": None if rowwise else 0}[leaf]
        assert placements == ["Replicate()" if split is None else f"Shard(dim={split})"], (n, placements)
        assert local == [w // 2 if d == split else w for d, w in enumerate(whole)], (n, local, whole)


@pytest.mark.multiproc
@pytest.mark.parametrize("name", ["lora-pp2", "qlora-nf4-pp2"])
def test_a_pipelined_checkpoint_holds_each_stages_adapters_alone(group_runs, name):
    group_runs(name)
    keys = checkpoint_keys(group_runs.folder / name / "checkpoints" / f"step_{STEPS:08d}")
    assert keys and all(".lora_" in k for k in keys), keys  # no base weight, no base optimizer state
    assert sorted(k for k in keys if k.startswith("model.")) == sorted(
        f"model.layers.{i}.{lin}.{leaf}" for i in range(2) for lin in ADAPTED for leaf in ("lora_a", "lora_b"))


@pytest.mark.multiproc
@pytest.mark.parametrize("name", ["lora-zero3", "dora-zero3", "lora-tp2", "dora-tp2"])
def test_adapters_saved_sharded_merge_into_a_hugging_face_model_with_the_same_logits(group_runs, tmp_path, name):
    """PEFT cannot merge under FSDP; the export merges from the resharded checkpoint (ZeRO-3's
    row shards, or tp's: B and the magnitude split by rows on column-parallel bases, A by columns
    on row-parallel ones)."""
    transformers = pytest.importorskip("transformers")
    from scaletrain.trained.adapters import adapted_from_checkpoint

    group_runs(name)
    saved = group_runs.folder / name / "checkpoints" / f"step_{STEPS:08d}"
    ours, _ = adapted_from_checkpoint(saved)  # the ranks' row shards read back whole
    assert all(torch.count_nonzero(m.lora_b) for m in ours.modules() if isinstance(m, LoRALinear))
    r = run_here("export", str(saved), "--format", "hf", "--out", str(tmp_path / "merged"))
    assert r.returncode == 0, r.stderr
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32)
    with torch.no_grad():
        err = (merged(tokens()).logits - ours(tokens())).abs().max().item()
    assert err <= 1e-5, f"{name}: the merged export's logits differ by {err:.3g}"


# --- checkpoints: the adapters and the base's fingerprint, resumed bitwise ----------------------

def stopped_after(trainer: Trainer, steps: int) -> Trainer:
    """The trainer stops (and saves) once `steps` steps are done, as on a signal."""
    trainer.end_of_step = lambda t, g, real=trainer.end_of_step: (*real(t, g)[:2], trainer.step >= steps)
    return trainer


def checkpoint_keys(path) -> list[str]:
    from torch.distributed.checkpoint import FileSystemReader

    return sorted(FileSystemReader(str(path)).read_metadata().state_dict_metadata)


def hf_base(folder, noise: float = 0.0):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(noise * torch.randn_like(p))
    model.save_pretrained(folder)
    return {"model.from_hf": str(folder), "model.init_from": str(folder), "data.seq_len": 16,
            "model.max_seq_len": 64}


@pytest.mark.parametrize("kind,base", [("lora", "hf"), ("dora", "seed")])
def test_adapter_checkpoints_hold_the_adapters_and_resume_bitwise(tmp_path, capsys, kind, base):
    run = {"train.steps": 6, "adapter.kind": kind, "adapter.dropout": 0.1, "adapter.targets": "attention,mlp",
           **(hf_base(tmp_path / "hf") if base == "hf" else {})}
    straight = Trainer(micro_cfg(tmp_path, **run, **{"log.run_dir": str(tmp_path / "a")})).fit()["losses"]
    b = {**run, "log.run_dir": str(tmp_path / "b"), "checkpoint.save_final": True}
    first = stopped_after(Trainer(micro_cfg(tmp_path, **b)), 3)
    trainable = sum(p.numel() for _, p in first.pm.optim_params)
    whole = sum(p.numel() for _, p in first.pm.dp.named_params)
    saved = first.fit()["checkpoint"]
    assert saved.endswith("step_00000003")
    # the adapters and their two AdamW moments (12 bytes each), DCP's ~2 KiB a tensor and the small
    # files: a third of what the whole model's weights and moments would take
    size = sum(f.stat().st_size for f in __import__("pathlib").Path(saved).iterdir())
    tensors = len(checkpoint_keys(saved))
    assert size < 12 * trainable + 2560 * tensors + 64 * 1024 and size < 12 * whole / 3, (size, trainable, whole)
    summary = [line for line in capsys.readouterr().out.splitlines() if line.startswith("checkpoint ")]
    assert summary and summary[-1].endswith(f"{saved} ({__import__('scaletrain.fmt').fmt.size(size)})"), summary
    keys = checkpoint_keys(saved)
    assert keys and all(".lora_" in k for k in keys), keys  # no base weight, no base optimizer state
    leaves = 3 if kind == "dora" else 2
    linears = 7 if base == "hf" else 6  # Llama's MLP is gated (w1, w3, w2)
    assert len([k for k in keys if k.startswith("model.")]) == 2 * linears * leaves
    state = __import__("json").loads((__import__("pathlib").Path(saved) / "trainer.json").read_text())["adapter"]
    assert state["kind"] == kind and len(state["base"]["sha256"]) == 64
    if base == "hf":
        assert state["base"]["name"] == str((tmp_path / "hf").resolve())
    resumed = Trainer(micro_cfg(tmp_path, **{**b, "checkpoint.resume": "auto"}))
    assert resumed.step == 3
    resumed.fit()
    assert [r["loss"] for r in __import__("conftest").read_metrics(tmp_path / "b")] == straight


def test_resuming_adapters_onto_another_base_is_refused_in_one_line(tmp_path):
    from scaletrain.errors import CheckpointError

    run = {"train.steps": 4, "adapter.kind": "lora", **hf_base(tmp_path / "hf"), "checkpoint.save_final": True}
    saved = stopped_after(Trainer(micro_cfg(tmp_path, **run)), 2).fit()["checkpoint"]
    other = hf_base(tmp_path / "other", noise=0.01)
    for verb in (["export", saved, "--out", str(tmp_path / "x.safetensors")], ["eval", saved]):  # merged onto it
        one_line_exit_2(run_here(*verb, "--base", other["model.init_from"]), "adapters were trained on the base",
                        "/other has sha256")
    with pytest.raises(CheckpointError, match=r"^the checkpoint's adapters were trained on the base .*/hf "
                                              r"\(sha256 [0-9a-f]{12}\), but this run's base is .*/other "
                                              r"\(sha256 [0-9a-f]{12}\); set model.init_from"):
        Trainer(micro_cfg(tmp_path, **{**run, **other, "checkpoint.resume": "auto"}))
    with pytest.raises(CheckpointError, match=r"saved with other adapters: adapter.rank=8 \(now 4\)"):
        Trainer(micro_cfg(tmp_path, **{**run, "adapter.rank": 4, "checkpoint.resume": "auto"}))
    with pytest.raises(CheckpointError, match=r"saved with other adapters: adapter.kind='lora' \(now 'none'\)"):
        Trainer(micro_cfg(tmp_path, **{**run, "adapter.kind": "none", "checkpoint.resume": "auto"}))


def test_a_custom_module_takes_adapters_through_the_same_targets_and_resumes_bitwise(tmp_path):
    from test_any_module import tiny_lm

    run = {"train.steps": 6, "adapter.kind": "lora", "adapter.rank": 4}
    straight = Trainer(micro_cfg(tmp_path, **run, **{"log.run_dir": str(tmp_path / "a")}), model=tiny_lm())
    assert sorted(n for n, _ in straight.pm.optim_params) == sorted(
        f"blocks.{i}.{j}.{leaf}" for i in range(3) for j in (1, 3) for leaf in ("lora_a", "lora_b"))
    losses = straight.fit()["losses"]
    fresh = dict(tiny_lm().named_parameters())
    for name, p in straight.pm.dp.named_params:  # the base as given, the adapters moved
        assert torch.equal(p, fresh[name]) if name in fresh else not torch.equal(p, torch.zeros_like(p)), name
    b = {**run, "log.run_dir": str(tmp_path / "b"), "checkpoint.save_final": True}
    saved = stopped_after(Trainer(micro_cfg(tmp_path, **b), model=tiny_lm()), 3).fit()["checkpoint"]
    assert all(".lora_" in k for k in checkpoint_keys(saved))
    resumed = Trainer(micro_cfg(tmp_path, **{**b, "checkpoint.resume": "auto"}), model=tiny_lm())
    resumed.fit()
    assert [r["loss"] for r in __import__("conftest").read_metrics(tmp_path / "b")] == losses
    other = tiny_lm()
    with torch.no_grad():
        other.blocks[0][1].weight.add_(1e-3)  # another base: one weight moved
    with pytest.raises(__import__("scaletrain.errors").errors.CheckpointError,
                       match=r"trained on the base the TinyLM given to the Trainer \(sha256"):
        Trainer(micro_cfg(tmp_path, **{**b, "checkpoint.resume": "auto", "train.steps": 8}), model=other)


def test_bf16_true_keeps_fp32_masters_of_the_adapters_alone(tmp_path):
    trainer = Trainer(micro_cfg(tmp_path, **{"train.steps": 3, "adapter.kind": "dora", "precision.mode": "bf16-true"}))
    adapters = sorted(n for n, p in trainer.pm.dp.named_params if p.requires_grad)
    assert len(adapters) == 2 * len(ADAPTED) * 3
    assert sorted(n for n, _ in trainer.pm.master.named_master) == adapters  # no master copy of the frozen base
    assert all(p.dtype == torch.float32 for _, p in trainer.pm.optim_params)
    before = {n: p.detach().clone() for n, p in trainer.pm.dp.named_params}
    losses = trainer.fit()["losses"]
    assert all(map(__import__("math").isfinite, losses))
    for n, p in trainer.pm.dp.named_params:
        assert torch.equal(p, before[n]) == (n not in adapters), n


def test_activation_checkpointing_keeps_the_adapters_names_and_losses(tmp_path):
    run = {"train.steps": 3, "adapter.kind": "dora", "adapter.dropout": 0.1}
    plain = Trainer(micro_cfg(tmp_path, **run, **{"log.run_dir": str(tmp_path / "p")}))
    names, losses = [n for n, _ in plain.pm.optim_params], plain.fit()["losses"]  # (a Trainer seeds dropout's RNG)
    ac = Trainer(micro_cfg(tmp_path, **run, **{"log.run_dir": str(tmp_path / "c"),
                                               "memory.activation_checkpointing": "full"}))
    assert [n for n, _ in ac.pm.optim_params] == names  # canonical names
    assert ac.fit()["losses"] == losses  # the recomputed forward draws the same dropout masks
