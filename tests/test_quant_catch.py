"""Quantization checked where a bug would show (issue: tests that catch, round 2).

* The weight QAT trains against is, value for value, what PTQ stores for the same weight, and
  both are the scheme's rounding derived here by hand (symmetric, per row for int8, per group of
  32 inputs for int4), on weights whose rows and groups differ in magnitude, so that a wrong
  group size, symmetry or axis changes most values, not a few.
* QAT's activation rounding (int8, per token, asymmetric) is PTQ's: the same by hand, and a QAT
  linear's output is the PTQ linear's.
* A QAT model is evaluated through its fake quantizers: during training and by `scaletrain eval`
  of its checkpoint, on weights where the quantizers move the loss by far more than the
  tolerance.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("torchao")

from scaletrain.config import load_config  # noqa: E402
from scaletrain.model.transformer import Transformer  # noqa: E402

from conftest import micro_cfg  # noqa: E402

# scheme: (bits of a weight, inputs per weight scale; None: the whole row)
SCHEMES = {"int8-dynamic": (8, None), "int8-int4": (4, 32)}
LINEARS = ("layers.0.attn.wq", "layers.0.attn.wo", "layers.0.mlp.w1", "layers.0.mlp.w2")
# a QAT linear's output against the PTQ linear's, relative (measured 0 for int8-int4, 1.7e-7 for
# int8-dynamic, whose int8 matmul accumulates in another order); activations left unrounded
# move it by 5e-3 (measured: 519x)
OUTPUT_TOLERANCE = 1e-5


def symmetric(w: torch.Tensor, bits: int, group: int | None) -> torch.Tensor:
    """w rounded to `bits`-bit integers, symmetric: per row (group None) or per `group` inputs,
    the scale is the largest magnitude over half the integer range (2^bits - 1) / 2."""
    rows, cols = w.shape
    g = w.reshape(rows, -1, group or cols)
    lo, hi = -2 ** (bits - 1), 2 ** (bits - 1) - 1
    scale = g.abs().amax(-1, keepdim=True) / ((hi - lo) / 2)
    return ((g / scale).round().clamp(lo, hi) * scale).reshape(rows, cols)


def ties(w: torch.Tensor, bits: int, group: int | None) -> torch.Tensor:
    """Where w / scale lies on a half step (a group's largest magnitude lands on ±(2^bits - 1) / 2
    exactly): either rounding is right there, and the last bit of the division decides."""
    rows, cols = w.shape
    g = w.reshape(rows, -1, group or cols)
    x = (g / (g.abs().amax(-1, keepdim=True) / ((2 ** bits - 1) / 2))).abs()
    return ((x - x.floor() - 0.5).abs() < 1e-3).reshape(rows, cols)


def asymmetric_per_token(x: torch.Tensor) -> torch.Tensor:
    """x rounded to int8 per token (last dimension), asymmetric: the range [min(x, 0), max(x, 0)]
    over 255 steps, an integer zero point."""
    lo = x.amin(-1, keepdim=True).clamp(max=0)
    hi = x.amax(-1, keepdim=True).clamp(min=0)
    scale = (hi - lo) / 255
    zero = (-128 - (lo / scale).round()).clamp(-128, 127)
    return (((x / scale).round() + zero).clamp(-128, 127) - zero) * scale


@pytest.fixture(scope="module")
def uneven_model():
    """A one-block model whose linears' rows span 100x in magnitude and whose groups of 32
    inputs alternate between 1x and 1/20x, the second row of groups differently: a per-row
    scale, or groups of 64, round the small groups far more coarsely than groups of 32."""
    cfg = load_config(None, {"model.dim": 64, "model.n_layers": 1, "model.n_heads": 4, "model.max_seq_len": 32,
                             "data.seq_len": 32}).model
    torch.manual_seed(0)
    model = Transformer(cfg)
    model.init_buffers("cpu")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("layers.") and p.dim() == 2:
                rows, cols = p.shape
                groups = torch.tensor([1.0, 0.05, 0.3, 1.0])[torch.arange(cols // 32) % 4].repeat_interleave(32)
                p.mul_(torch.logspace(-1, 1, rows).unsqueeze(1) * groups)
    return model


@pytest.fixture(scope="module")
def converted(uneven_model):
    """{scheme: (the QAT model, the PTQ model)} of the same weights."""
    from scaletrain.quant.ptq import quantize_model
    from scaletrain.quant.qat import prepare_qat

    out = {}
    for scheme in SCHEMES:
        qat, ptq = copy.deepcopy(uneven_model), copy.deepcopy(uneven_model)
        prepare_qat(qat, scheme)
        quantize_model(ptq, scheme)
        out[scheme] = (qat.eval(), ptq)
    return out


@pytest.mark.parametrize("scheme", SCHEMES)
def test_qat_trains_against_the_weight_ptq_stores(converted, uneven_model, scheme):
    bits, group = SCHEMES[scheme]
    qat, ptq = converted[scheme]
    for name in LINEARS:
        w = uneven_model.get_submodule(name).weight.detach()
        fake_linear = qat.get_submodule(name)
        with torch.no_grad():
            trained_against = fake_linear.weight_fake_quantizer(fake_linear.weight)
        stored = ptq.get_submodule(name).weight.dequantize()
        assert torch.equal(trained_against, stored), (
            f"{scheme} {name}: QAT's fake-quantized weight differs from PTQ's in "
            f"{int((trained_against != stored).sum())} of {w.numel()} values")
        # and both are the scheme's rounding, wherever it is not a tie
        hand, exact = symmetric(w, bits, group), ~ties(w, bits, group)
        assert exact.float().mean() > 0.9  # the ties are the groups' extremes, a few per cent
        wrong = int((stored != hand)[exact].sum())
        assert wrong == 0, f"{scheme} {name}: {wrong} of {int(exact.sum())} values are not the scheme's rounding"
        # a tie rounds to one of its two neighbours: a step (of the largest scale) at most
        assert (stored - hand)[~exact].abs().max() <= 1.01 * w.abs().amax() / ((2 ** bits - 1) / 2)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_qat_rounds_activations_as_ptq_and_its_linears_give_ptq_outputs(converted, scheme):
    qat, ptq = converted[scheme]
    g = torch.Generator().manual_seed(1)
    for name in LINEARS:
        fake_linear, linear = qat.get_submodule(name), ptq.get_submodule(name)
        # tokens of different spreads and offsets (an asymmetric range per token)
        n = fake_linear.in_features
        x = torch.randn(2, 16, n, generator=g) * torch.logspace(-1, 1, 16).unsqueeze(-1) + \
            torch.linspace(-0.5, 1.0, 16).unsqueeze(-1)
        with torch.no_grad():
            got, want = fake_linear(x), linear(x)
        err = float((got - want).norm() / want.norm())
        assert err <= OUTPUT_TOLERANCE, (f"{scheme} {name}: the QAT linear's output is {err:.3g} off the PTQ linear's "
                                         f"({err / OUTPUT_TOLERANCE:.3g}x tolerance)")
        assert fake_linear.activation_fake_quantizer is not None, f"{scheme} {name}: activations not fake-quantized"
        with torch.no_grad():
            activations = fake_linear.activation_fake_quantizer(x)
        assert torch.equal(activations, asymmetric_per_token(x)), f"{scheme} {name}: QAT's activation rounding"


# ------------------------------------------------------------------------------------------
# Evaluation of a QAT model: through its fake quantizers

# the evaluation's loss against the loss derived here (the same windows, the same model, a
# summation of another order: measured 8e-8 relative)
EVAL_TOLERANCE = 1e-6


def plant_outliers(model: torch.nn.Module) -> None:
    """One large weight per 32 inputs of every block linear: int4 groups then round most of
    their other weights to 0, so that the fake quantizers move the loss by far more than
    EVAL_TOLERANCE (measured 1.6e-3 relative, 1600x)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("layers.") and name.endswith(".weight") and p.dim() == 2:
                p[:, ::32] = 0.5


def loss_by_hand(trainer, fake_quantize: bool) -> float:
    """The mean token loss of the trainer's model over its validation windows, its fake
    quantizers on or off."""
    from torchao.quantization.qat.linear import FakeQuantizedLinear

    model = trainer.dp.module
    linears = [m for m in model.modules() if isinstance(m, FakeQuantizedLinear)]
    assert linears
    before = [(m.activation_fake_quantizer.enabled, m.weight_fake_quantizer.enabled) for m in linears]
    for m in linears:
        m.activation_fake_quantizer.enabled = m.weight_fake_quantizer.enabled = fake_quantize
    total, tokens = 0.0, 0
    try:
        with torch.no_grad():
            model.eval()
            for v in trainer.val_sets:
                for batch in v.batches:
                    inputs, targets = v.dataset[batch]
                    logits = model(inputs)
                    total += float(torch.nn.functional.cross_entropy(logits.flatten(0, 1).double(), targets.flatten(),
                                                                     reduction="sum"))
                    tokens += targets.numel()
    finally:
        for m, (a, w) in zip(linears, before):
            m.activation_fake_quantizer.enabled, m.weight_fake_quantizer.enabled = a, w
        model.train()
    return total / tokens


def test_a_qat_model_is_evaluated_through_its_fake_quantizers(tmp_path):
    from scaletrain.train.trainer import Trainer
    from scaletrain.trained.evaluate import evaluate_checkpoint

    trainer = Trainer(micro_cfg(tmp_path, **{"train.qat": "int8-int4", "train.steps": 1, "train.eval_every": 1,
                                                  "train.eval_batches": 2}))
    plant_outliers(trainer.dp.module)
    on, off = loss_by_hand(trainer, True), loss_by_hand(trainer, False)
    effect = abs(on - off) / on
    assert effect > 1000 * EVAL_TOLERANCE, f"the fake quantizers move the loss by only {effect:.2e}"

    def check(got: float, where: str) -> None:
        err = abs(got - on) / on
        assert err <= EVAL_TOLERANCE, (
            f"{where}: val_loss {got:.6f}, through the fake quantizers {on:.6f}, without them {off:.6f} "
            f"({err / EVAL_TOLERANCE:.3g}x tolerance)")

    check(trainer.evaluate()["val_loss"], "the run's evaluation")
    result = evaluate_checkpoint(trainer.save())
    check(result["val_loss"], "scaletrain eval of its checkpoint")
    assert result["fake_quantized"] == "int8-int4"
