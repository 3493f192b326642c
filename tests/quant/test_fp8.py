"""fp8 training (precision.mode=fp8) through torchao's float8, emulated on the CPU.

Emulation casts and scales exactly as the GPU path does and multiplies the fp8 values in high
precision, so the numerics are fp8's; the speed is not (benchmarks/fp8.py measures that on a GPU).
Single-process checkpoint resume under fp8 is two of test_checkpoint's bitwise resume cases;
ZeRO-3's is here.
"""

from __future__ import annotations

import copy
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("torchao")

from scaletrain.errors import ConfigError  # noqa: E402
from scaletrain.train.trainer import Trainer  # noqa: E402

from conftest import (  # noqa: E402
    MICRO,
    REPO,
    Case,
    assert_one_clear_line,
    micro_cfg,
    micro_overrides,
    one_line_exit_2,
    read_metrics,
    run_group,
    run_here,
    train_args,
)

# the micro model's linears are 64 wide: a threshold of 64 converts all 12 block linears
FP8 = {"precision.mode": "fp8", "precision.fp8_emulate": True, "precision.fp8_min_dim": 64}

# torchao's own bound for a Float8Linear against the high-precision Linear it came from
# (pytorch/ao test/float8/test_base.py, TestFloat8Linear._test_linear_impl): SQNR of the output
# >= 18 dB and of the weight gradient >= 17 dB. We hold the input gradient to the same 17 dB.
OUTPUT_SQNR, GRAD_SQNR = 18.0, 17.0


def float8_kinds(trainer) -> list[str]:
    return [n for n, m in trainer.pm.dp.module.named_modules() if type(m).__name__ == "Float8Linear"]


# ------------------------------------------------------------------------------------------
# numerics of one layer


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("bias", [False, True])
def test_a_float8_linear_matches_bf16_within_torchaos_tolerance(recipe, bias):
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.float8_utils import compute_error

    from scaletrain.quant.fp8 import float8_config

    torch.manual_seed(0)
    ref = nn.Linear(64, 128, bias=bias, dtype=torch.bfloat16)
    fp8 = Float8Linear.from_float(copy.deepcopy(ref), float8_config(recipe, emulate=True, fp8_all_gather=False))
    x = torch.randn(4, 16, 64, dtype=torch.bfloat16)
    x_ref, x_fp8 = x.clone().requires_grad_(), x.clone().requires_grad_()
    for _ in range(2):  # as torchao's test: the second pass sees accumulated gradients too
        y_fp8 = fp8(x_fp8)
        y_fp8.sum().backward()
        y_ref = ref(x_ref)
        y_ref.sum().backward()
    assert compute_error(y_ref, y_fp8) >= OUTPUT_SQNR
    assert compute_error(ref.weight.grad, fp8.weight.grad) >= GRAD_SQNR
    assert compute_error(x_ref.grad, x_fp8.grad) >= GRAD_SQNR
    if bias:
        torch.testing.assert_close(ref.bias.grad, fp8.bias.grad)
    # and it is not bf16 under another name: fp8 rounds visibly
    assert not torch.equal(y_ref, y_fp8)


# ------------------------------------------------------------------------------------------
# training


# Every step's loss of the emulated fp8 run against bf16-mixed from the same weights and data,
# 30 steps of the micro model at lr 1e-3 (as test_precision): relative difference within
# LOSS_TOL, test_precision's bound for bf16-mixed against fp32. Measured: 1.0e-3 for tensorwise,
# 4.4e-3 for rowwise (both at step 25; under 2.2e-4 over the first 10 steps); bf16-mixed against
# fp32 on the same run: 4.2e-4. (At the micro default lr 3e-3 the runs drift apart late: bf16
# itself is then 3.8e-2 from fp32.)
STEPS, LOSS_TOL, LR = 30, 1e-2, {"optim.lr": 1e-3}


@pytest.fixture(scope="module")
def bf16_losses(tmp_path_factory):
    cfg = micro_cfg(tmp_path_factory.mktemp("bf16"), **{"train.steps": STEPS, "precision.mode": "bf16-mixed", **LR})
    return Trainer(cfg).fit()["losses"]


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_an_fp8_run_tracks_bf16_mixed(tmp_path, bf16_losses, recipe):
    trainer = Trainer(micro_cfg(tmp_path, **{**FP8, "train.steps": STEPS, "precision.fp8_recipe": recipe, **LR}))
    assert len(float8_kinds(trainer)) == 12  # every block linear converted, the head not
    assert type(trainer.pm.dp.module.output) is nn.Linear
    losses = trainer.fit()["losses"]
    rel = [abs(a - b) / b for a, b in zip(losses, bf16_losses)]
    assert len(losses) == STEPS and max(rel) <= LOSS_TOL, f"worst {max(rel):.2e} at step {rel.index(max(rel)) + 1}"
    assert losses != bf16_losses  # the fp8 casts did run
    assert losses[-1] < losses[0] - 1.0  # and it learns (measured: 1.53 lower)


@pytest.mark.slow  # ~45 s of inductor compilation on 2 shared cores
def test_compile_with_fp8_gives_the_eager_losses(tmp_path):
    """torch.compile of each block with its Float8Linears (after conversion, as torchtitan
    orders it): inductor fuses the casts; the losses stay within 1e-3 of eager."""
    from scaletrain.parallel.checks import check_compiler

    try:
        check_compiler(torch.device("cpu"))
    except ConfigError as e:
        pytest.skip(str(e))
    steps = 3
    eager = Trainer(micro_cfg(tmp_path / "e", **{**FP8, "train.steps": steps})).fit()["losses"]
    compiled = Trainer(micro_cfg(tmp_path / "c", **{**FP8, "train.steps": steps, "train.compile": True})).fit()
    rel = [abs(a - b) / b for a, b in zip(compiled["losses"], eager)]
    assert len(rel) == steps and max(rel) <= 1e-3, rel  # measured 2.4e-5 (inductor reorders the casts' reductions)


@pytest.mark.multiproc
@pytest.mark.usefixtures("forked_launches")  # verify's ranks forked (conftest.forked_launches)
def test_fp8_under_zero3_with_fp8_all_gather_tracks_one_process(tmp_path):
    """2 ranks of ZeRO-3 whose tensorwise weights are all-gathered in fp8 (and their scales
    precomputed after each step) against one process of fp8, through `scaletrain verify`: the
    losses within 1e-3 (measured 2.5e-4: the sharded reductions round differently, and fp8
    rounding can move a value a whole e4m3 step)."""
    args = [f"--{k}={v}" for k, v in {**MICRO, **FP8}.items() if not k.startswith(("log.", "checkpoint."))]
    # (that a run of this layout says its all-gather is in fp8, which verify does not print, the
    # resume test below checks on its first run)
    r = run_here("verify", "--steps=4", *args, "--nproc=2", "--parallel.zero=3")
    verdict = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else r.stderr
    m = re.match(r"largest relative difference: loss ([\d.e+-]+) at step \d+", verdict)
    assert m, f"{r.stdout}{r.stderr}"
    assert float(m.group(1)) <= 1e-3, verdict
    assert verdict.endswith("PASS"), verdict  # the gradient norms within verify's fp8 tolerance too


def conversion_notes(trainer):
    """dist_worker's probe: what the run's log says of its conversions (parallelize's notes)."""
    return lambda: trainer.pm.notes


@pytest.mark.multiproc
def test_a_zero3_fp8_checkpoint_resumes_bitwise(tmp_path):
    """ZeRO-3 with fp8 all-gather keeps each weight shard inside torchao's fp8-casting tensor
    subclass; the distributed checkpoint saves and loads through it: resumed at step 2 of 4, steps
    3 and 4 are bit for bit those of the run that went straight on. (One group of 2 forked ranks,
    the straight run then the resumed one.)"""
    base = {**FP8, "train.steps": 4, "parallel.zero": 3}
    step2 = tmp_path / "a" / "checkpoints" / "step_00000002"
    jobs = [{"overrides": micro_overrides(tmp_path / "a", **base, **{"checkpoint.every": 2}),
             "probe": "test_fp8:conversion_notes"},
            {"overrides": micro_overrides(tmp_path / "b", **base, **{"checkpoint.resume": str(step2)})}]
    code, results, err = run_group(2, jobs, tmp_path)
    assert code == 0, err
    notes = results[0]["ranks"][0]["probe"]
    assert any("(tensorwise scales, emulated, fp8 all-gather)" in n for n in notes), notes  # the run says so

    def rows(run):
        return [(m["step"], m["loss"], m["grad_norm"]) for m in read_metrics(tmp_path / run) if "loss" in m]

    assert rows("b") == rows("a")[2:] and len(rows("a")) == 4


# ------------------------------------------------------------------------------------------
# the layer rule: printed, and the planner's


def test_the_layer_rule_is_printed_and_keeps_narrow_layers_in_bf16(tmp_path, capsys):
    # grouped-query attention: wk and wv are 64 -> 16, under a threshold of 32; the rest convert
    trainer = Trainer(micro_cfg(tmp_path, **{**FP8, "precision.fp8_min_dim": 32, "model.n_kv_heads": 1,
                                             "train.steps": 1}))
    converted = float8_kinds(trainer)
    assert len(converted) == 8 and not any(n.endswith((".wk", ".wv")) for n in converted)
    trainer.fit()
    captured = capsys.readouterr()
    out = captured.out + captured.err
    assert "precision.mode=fp8 (tensorwise scales, emulated): 8 linear layer(s) converted" in out
    assert re.search(r"high precision: layers\.0\.attn\.wk, .*small \(64x16, under precision.fp8_min_dim=32", out)
    assert "high precision: output: output head" in out


def test_the_planner_counts_only_the_layers_the_rule_converts():
    from scaletrain.config import load_config
    from scaletrain.model.transformer import Transformer
    from scaletrain.plan import plan
    from scaletrain.quant.layers import block_linears, fp8_block_plan, fp8_share, layer_plan

    model = load_config("configs/llama-1b.toml").model  # GQA: wk, wv are 2048 -> 512
    with torch.device("meta"):
        built = Transformer(model)
    trainer_rule = {n.split(".", 2)[2]: why is None for n, why in layer_plan(built, "fp8").items()
                    if n.startswith("layers.0.")}
    assert trainer_rule == {n: why is None for n, why in fp8_block_plan(model).items()}  # one rule
    assert trainer_rule["attn.wk"] is False and trainer_rule["mlp.w1"] is True
    shapes = block_linears(model)
    assert 0 < fp8_share(model) < 1
    assert fp8_share(model) == pytest.approx(
        sum(a * b for n, (a, b) in shapes.items() if trainer_rule[n]) / sum(a * b for a, b in shapes.values()))

    def compute_s(config, fp8):
        return plan(config, layout={"parallel.zero": 3, "train.micro_batch": 4}, fp8=fp8)["layouts"][0].time.compute_s

    # GPT-2 124M is 768 wide: nothing converts, so --fp8 changes nothing; Llama 1B gets faster
    assert compute_s("configs/gpt2-124m.toml", True) == compute_s("configs/gpt2-124m.toml", False)
    assert compute_s("configs/llama-1b.toml", True) < compute_s("configs/llama-1b.toml", False)


# ------------------------------------------------------------------------------------------
# bad input: one line, exit 2


def micro_args(tmp_path, **extra) -> list[str]:
    return [f"--{k}={v}" for k, v in {**MICRO, **extra, "log.run_dir": tmp_path / "r"}.items()]


def test_fp8_on_the_cpu_without_emulation_is_one_line(tmp_path):
    r = run_here("train", *micro_args(tmp_path, **{**FP8, "precision.fp8_emulate": False}))
    one_line_exit_2(r, "precision.mode=fp8 on cpu", "precision.fp8_emulate=true", "bf16-mixed")
    assert not (tmp_path / "r").exists()


def test_a_model_with_no_layer_wide_enough_is_one_line(tmp_path):
    r = run_here("train", *micro_args(tmp_path, **{**FP8, "precision.fp8_min_dim": 1024}))
    one_line_exit_2(r, "no block linear layer qualifies", "precision.fp8_min_dim=1024", "bf16-mixed")


def test_fp8_with_qat_is_one_line(tmp_path):
    one_line_exit_2(run_here("train", *micro_args(tmp_path, **FP8, **{"train.qat": "int8-dynamic"})),
                    "precision.mode=fp8 and train.qat=int8-dynamic")


def test_a_gpu_before_sm89_is_refused_in_one_line(monkeypatch):
    from scaletrain.quant.fp8 import check_fp8_device

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ConfigError, match=r"A100-SXM4-80GB is sm80, and fp8 matmuls need sm89\+") as e:
        check_fp8_device(torch.device("cuda", 0), emulate=False)
    assert len(e.value.lines) == 1
    check_fp8_device(torch.device("cuda", 0), emulate=True)  # emulation runs anywhere
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_fp8_device(torch.device("cuda", 0), emulate=False)


def test_missing_torchao_is_one_line(monkeypatch):
    from scaletrain.quant.fp8 import float8_config

    for name in [m for m in sys.modules if m == "torchao" or m.startswith("torchao.")]:
        monkeypatch.setitem(sys.modules, name, None)  # `import torchao` now fails
    with pytest.raises(ConfigError, match=r"precision.mode=fp8 .* needs torchao: pip install"):
        float8_config("tensorwise", emulate=True, fp8_all_gather=False)


def test_a_custom_module_is_refused_in_one_line(tmp_path):
    """Its linears are not scaletrain's to choose: the run would silently train bf16-mixed."""
    module = nn.Sequential(nn.Embedding(256, 64), nn.Linear(64, 256))
    with pytest.raises(ConfigError, match="precision.mode=fp8 converts scaletrain's own transformer") as e:
        Trainer(micro_cfg(tmp_path, **FP8), model=module)
    assert len(e.value.lines) == 1


def test_model_parallel_axes_are_refused_in_one_line(tmp_path):
    from scaletrain.layout import Layout
    from scaletrain.legality import Techniques, check_job

    fp8 = Techniques(fp8=True)
    for axis, extra in (("tp", {}), ("pp", {"grad_accum": 2}), ("cp", {})):  # each legal without fp8
        with pytest.raises(ConfigError, match=f"precision.mode=fp8 with parallel.{axis}=2: not supported yet") as e:
            check_job(Layout(**{axis: 2}, **extra), None, fp8)
        assert len(e.value.lines) == 1
    check_job(Layout(dp_shard=2, zero=3), None, fp8)  # data parallelism composes


# ------------------------------------------------------------------------------------------
# a GPU with fp8 matmuls


def _has_fp8_gpu() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.gpu
@pytest.mark.skipif(not _has_fp8_gpu(), reason="real fp8 matmuls need a CUDA GPU of compute capability 8.9+")
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_real_fp8_on_a_gpu_tracks_bf16_mixed(tmp_path, recipe):
    shape = {"train.device": "cuda", "model.dim": 256, "model.n_heads": 4, "train.steps": 20}
    bf16 = Trainer(micro_cfg(tmp_path / "b", **shape, **{"precision.mode": "bf16-mixed"})).fit()["losses"]
    cfg = micro_cfg(tmp_path / "f", **shape, **{"precision.mode": "fp8", "precision.fp8_min_dim": 256,
                                                "precision.fp8_recipe": recipe})
    losses = Trainer(cfg).fit()["losses"]
    rel = [abs(a - b) / b for a, b in zip(losses, bf16)]
    assert max(rel) <= 2e-2, rel  # bf16-mixed's own bound against fp32 (test_precision), with margin


# ------------------------------------------------------------------------------------------
# the benchmark


def test_the_benchmarks_variants_parse_and_it_says_in_one_line_that_it_needs_a_gpu():
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import fp8 as bench
    finally:
        sys.path.pop(0)
    from scaletrain.bench.step import parse_variant

    # keys with digits in them (fp8_recipe) split at the comma like any other
    assert [parse_variant(v) for v in bench.variants(compile=False)] == [
        {"precision.mode": "fp8", "precision.fp8_recipe": "tensorwise"},
        {"precision.mode": "fp8", "precision.fp8_recipe": "rowwise"}]
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the benchmark would run")
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "fp8.py")], capture_output=True, text=True,
                       cwd=REPO, timeout=120)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert r.stdout.strip().splitlines() == [
        "benchmarks/fp8.py needs a CUDA GPU with fp8 matmuls (sm89+); here: no CUDA GPU. Nothing measured."]


# --------------------------------------------------------------------------------------------
# Bad input


BAD_INPUT = [
    Case("fp8-on-cpu-without-emulation", train_args("--precision.mode=fp8", "--precision.fp8_min_dim=64"),
         ("precision.mode=fp8 on cpu", "set precision.fp8_emulate=true")),
    Case("fp8-model-too-narrow", train_args("--precision.mode=fp8", "--precision.fp8_emulate=true"),
         ("no block linear layer qualifies", "precision.fp8_min_dim=1024")),
]


@pytest.mark.parametrize("case", BAD_INPUT, ids=[c.id for c in BAD_INPUT])
def test_bad_input_gives_one_clear_line(case: Case, workdir: Path, capsys):
    assert_one_clear_line(case, workdir, capsys)
