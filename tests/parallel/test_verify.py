"""`scaletrain verify` for real: layouts of 2 ranks (gloo on CPU) against one process, the
faults it must catch, the reference it falls back to, and the user errors it refuses."""

from __future__ import annotations

import functools
import math
from pathlib import Path

import pytest

from scaletrain import cli
from scaletrain.verify import TOLERANCES, StepDiff, notes, rel_diff, table, verdict

from conftest import MICRO

pytestmark = [pytest.mark.multiproc, pytest.mark.usefixtures("forked_launches")]

STEPS = 4
# the micro model with 4 untied blocks (pipelining splits them), micro-batches of 2 sequences
MODEL = {**MICRO, "model.n_layers": 4, "model.tie_embeddings": False, "train.micro_batch": 2}


def write_config(tmp_path, **extra) -> str:
    """A TOML config whose run folder is tmp_path/userrun (which verify must never create)."""
    sections: dict[str, dict] = {}
    for key, value in {**MODEL, "log.run_dir": str(tmp_path / "userrun"), **extra}.items():
        section, name = key.rsplit(".", 1)  # "parallel.sync.every": the table [parallel.sync]
        sections.setdefault(section, {})[name] = value
    lines = []
    for section, body in sections.items():
        lines.append(f"[{section}]")
        lines += [f"{k} = {_toml(v)}" for k, v in body.items()]
    path = tmp_path / "verify.toml"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _toml(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return f'"{v}"'
    return repr(v)


@pytest.fixture
def verify(monkeypatch, capfd):
    """`scaletrain verify --config CONFIG --steps STEPS ARGS` through the CLI's main in this
    process (the ranks are real processes, forked: see conftest.forked_launches); returns (exit code,
    stdout)."""

    def run(config: str, *args: str, fault: str = "") -> tuple[int, str]:
        if fault:  # a bug planted in the layout run by tests/verify_faults.py (verify's layout_hook)
            import scaletrain.verify

            planted = functools.partial(scaletrain.verify.verify, layout_hook=f"verify_faults:{fault}",
                                        hook_path=[str(Path(__file__).parents[1])])
            monkeypatch.setattr(scaletrain.verify, "verify", planted)
        code = cli.main(["verify", "--config", config, f"--steps={STEPS}", *args])
        out, err = capfd.readouterr()
        return code, out + err

    return run


def summary(stdout: str) -> str:
    return next(line for line in stdout.splitlines() if line.startswith("largest relative difference"))


def test_an_honest_layout_passes_and_leaves_the_run_folder_alone(tmp_path, verify):
    config = write_config(tmp_path)
    code, out = verify(config, "--parallel.tp=2", "--parallel.sp=true")
    assert code == 0, out
    assert "layout:    2 rank(s) = pp 1 × dp_replicate 1 × dp_shard 1 × tp 2; tensor parallel + sequence parallel" \
        in out
    assert "reference: 1 process" in out
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert [int(row[0]) for row in rows] == list(range(1, STEPS + 1))  # every step in the table
    line = summary(out)
    assert line.endswith("tolerance loss 1e-05, grad norm 1e-04 (precision 32-true): PASS"), line
    assert not (tmp_path / "userrun").exists()
    assert "final loss" not in out  # the runs' own summary tables are not verify's output


def test_qlora_under_zero3_passes(tmp_path, verify):
    """QLoRA: an NF4 base that FSDP2 shards by rows and all-gathers as NF4, LoRA adapters on it."""
    config = write_config(tmp_path, **{"adapter.kind": "lora", "adapter.base_dtype": "nf4"})
    code, out = verify(config, "--parallel.dp_shard=2", "--parallel.zero=3")
    assert code == 0, out
    assert "dp_shard 2" in out and "reference: 1 process" in out, out
    assert summary(out).endswith("(precision 32-true): PASS"), summary(out)


def test_the_built_in_config_is_the_one_train_runs(capfd):
    """Without --config verify runs train's built-in config: the batch `train --nproc 2` derives
    (it derived another from the bare defaults)."""
    from scaletrain.launch.job import train_config
    from scaletrain.layout import Layout

    small = ["--model.dim=32", "--model.n_layers=1", "--model.n_heads=2", "--data.seq_len=32",
             "--model.max_seq_len=32"]
    lay = Layout.from_config(train_config(None, small)[0], 2)
    code = cli.main(["verify", "--steps=1", "--nproc=2", *small])
    out, err = capfd.readouterr()
    assert code == 0, out + err
    assert f"batch {lay.global_batch} = micro {lay.micro_batch} × accum {lay.grad_accum} × dp 2" in out, out
    assert "final loss" not in out + err


def test_one_ranks_perturbed_gradient_fails(tmp_path, verify):
    """Rank 1's gradients × 1.01 before the data-parallel reduction: the reduced gradient
    leans towards rank 1's half of the batch; the norm shows it at the first step."""
    code, out = verify(write_config(tmp_path), "--nproc=2", "--parallel.zero=2", fault="perturb_grad_rank1")
    assert code == 1, out
    assert summary(out).endswith("FAIL")
    first = next(line.split() for line in out.splitlines() if line.strip().startswith("1 "))
    assert float(first[-1]) > 1e-3  # grad norm, step 1


def test_a_wrong_loss_normalisation_fails_on_the_gradient_norm(tmp_path, verify):
    """Each rank normalises by its own tokens but the average over ranks still divides by dp:
    gradients twice too large. Clipping and AdamW hide it from the losses, not from the norm."""
    code, out = verify(write_config(tmp_path), "--nproc=2", "--parallel.zero=1", fault="local_loss_norm")
    assert code == 1, out
    line = summary(out)
    # twice the gradient at every step: relative difference 1.0 on each (the largest is a tie)
    assert line.endswith("first step over it: 1: FAIL") and "grad norm 1.0e+00 at step" in line, line


def test_workers_that_sync_every_few_steps_are_checked_against_their_simulation(tmp_path, verify):
    """DiLoCo, streamed and delayed, over 2 workers of one rank (tp inside a worker: tests/parallel/test_local_sgd.py):
    the reference is the 2 workers simulated in one process; a worker that applies its syncs early FAILs."""
    config = write_config(tmp_path, **{"parallel.dp_replicate": 2, "parallel.sync.mode": "diloco",
                                       "parallel.sync.every": 3, "parallel.sync.fragments": 2,
                                       "parallel.sync.delay": 1})
    code, out = verify(config)
    assert code == 0, out
    assert "reference: 2 workers simulated in one process" in out and "(diloco every 3 steps, 2 fragments, delay 1, " \
        "fp32)" in out
    assert summary(out).endswith("PASS")
    code, out = verify(config, fault="skip_delay_on_worker1")
    assert code == 1, out
    assert summary(out).endswith("FAIL")


def test_a_model_too_big_for_one_process_is_checked_against_zero3(tmp_path, verify):
    """With a device of 4 MiB the planner puts one process over it and ZeRO-3 over 2 ranks under
    it: the reference says so, with the planner's figures, and runs on 2 ranks."""
    import dataclasses

    import torch

    from scaletrain.config import load_config
    from scaletrain.hardware import local_hardware
    from scaletrain.layout import Layout
    from scaletrain.plan.search import evaluate
    from scaletrain.plan.spec import Cluster, Workload

    device_gib = 0.004
    hw = dataclasses.replace(local_hardware(torch.device("cpu")), memory_GB=device_gib * 2**30 / 1e9)
    model = load_config(None, MODEL).model
    wl = Workload(seq_len=MODEL["data.seq_len"], global_batch=MODEL["train.global_batch"], precision="32-true",
                  optimizer="adamw")
    one = evaluate(model, wl, Cluster(hw, 1, 1), Layout(micro_batch=2, grad_accum=4), gpu=False).memory.total
    two = evaluate(model, wl, Cluster(hw, 1, 2), Layout(dp_shard=2, zero=3, micro_batch=2, grad_accum=2),
                   gpu=False).memory.total
    assert two < hw.memory_bytes < one  # the premise: one process does not fit, ZeRO-3 over 2 does

    code, out = verify(write_config(tmp_path), "--parallel.pp=2", "--parallel.pp_schedule=gpipe",
                       f"--device-memory={device_gib}")
    assert code == 0, out
    assert f"reference: ZeRO-3 over 2 ranks (dp 2 zero3, mb 2x2, {two / 2**20:.1f} MiB per rank), the simplest " \
           f"layout that fits: one process does not (the planner puts it at {one / 2**20:.1f} MiB" in out, out
    assert summary(out).endswith("(precision 32-true): PASS")


@pytest.mark.parametrize("args,words", [
    (["--config", "/no/such/config.toml"], "config file /no/such/config.toml not found"),
    (["--parallel.tp=3"], "parallel.tp"),
    (["--steps=0"], "--steps must be at least 1"),
    (["--nproc=1"], "the layout is one process"),
    (["--parallel.zero=3"], "--nproc N or parallel.dp_shard=N"),
    (["--nproc=2", "--parallel.zero=3", "--device-memory=0.002"], "no reference fits"),
    (["--nproc=2", "--parallel.zero=3", "--device-memory=0.004"], "no simpler reference"),
])
def test_bad_input_is_one_line_per_problem_and_exit_2(tmp_path, capsys, args, words):
    argv = ["verify", *args] if args[0] == "--config" else ["verify", "--config", write_config(tmp_path), *args]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    # one line per problem (tp 3 divides neither the heads nor the vocabulary: two lines)
    assert all(line.startswith("scaletrain: error: ") for line in err.strip().splitlines()), err
    assert len(err.strip().splitlines()) == (2 if "tp=3" in args[0] else 1), err
    assert words in err, err


def test_comparison_and_verdict():
    assert rel_diff(2.0, 2.0) == 0.0 and rel_diff(math.inf, math.inf) == 0.0  # a step both skipped
    assert rel_diff(1.01, 1.0) == pytest.approx(0.01)
    assert rel_diff(math.inf, 1.0) == math.inf and rel_diff(math.nan, math.nan) == math.inf
    tol_loss, tol_norm = TOLERANCES["bf16-mixed"]
    good = [StepDiff(1, (5.0, 5.0), (2.0, 2.0)), StepDiff(2, (4.0, 4.0 * (1 + tol_loss / 2)), (2.0, 2.0))]
    ok, line = verdict(good, 2, "bf16-mixed")
    assert ok and line.endswith("(precision bf16-mixed): PASS") and "at step 2" in line
    bad = good[:1] + [StepDiff(2, (4.0, 4.0), (2.0, 2.0 * (1 + 2 * tol_norm)))]
    assert verdict(bad, 2, "bf16-mixed")[0] is False
    assert verdict(good[:1], 2, "bf16-mixed")[0] is False  # a step missing from a run fails
    skipped = [StepDiff(1, (5.0, 5.0), (math.inf, 2.0))]  # an fp16 overflow in the layout only
    assert verdict(skipped, 1, "16-mixed")[0] is False
    assert notes(skipped, 1) == ["note: step 1: the layout skipped the step (non-finite gradients, e.g. an fp16 "
                                 "overflow of the loss scale) and the reference did not; from there on they train "
                                 "different weights"]
    assert "measured over 10 steps" in notes(good, 20)[0] and notes(good, 10) == []
    assert table(good).splitlines()[0].split() == ["step", "loss", "(layout)", "loss", "(reference)", "rel", "diff",
                                                   "grad", "norm", "(layout)", "grad", "norm", "(reference)", "rel",
                                                   "diff"]


def test_verify_runs_a_quiet_run_of_n_steps_without_dropout(tmp_path):
    """Whatever the config says about logging, evaluation and checkpoints, verify's runs are quiet."""
    from scaletrain.config import load_config
    from scaletrain.launch.ranks import QUIET
    from scaletrain.verify import isolated

    cfg = load_config(None, {"checkpoint.resume": "auto", "checkpoint.every": 5, "train.eval_every": 5,
                             "log.tensorboard": True, "log.every": 10, "model.dropout": 0.1})
    got = isolated(cfg, tmp_path / "layout", 3).to_dict()
    flat = {f"{section}.{key}": value for section, values in got.items() for key, value in values.items()}
    assert {k: flat[k] for k in QUIET} == QUIET
    assert (flat["log.run_dir"], flat["train.steps"], flat["model.dropout"]) == (str(tmp_path / "layout"), 3, 0.0)


@pytest.mark.parametrize("layout", [("--nproc=2", "--parallel.zero=3"), ("--parallel.tp=2",), ("--parallel.pp=2",)],
                         ids=["zero3", "tp2", "pp2"])
def test_lora_fine_tuning_passes_on_zero3_tp_and_pp(tmp_path, verify, layout):
    """Adapters (the base frozen) under ZeRO-3, tensor and pipeline parallelism: the loss and the
    pre-clip gradient norm of the adapters every step as one process's."""
    code, out = verify(write_config(tmp_path, **{"adapter.kind": "lora", "adapter.targets": "all-linear"}), *layout)
    assert code == 0, out
    line = summary(out)
    assert line.endswith("(precision 32-true): PASS"), line
