"""The planner states one prediction per layout, the same in its table and beside what
`--measure` measured (calibrated or not), and its report says what it assumed: the model's
name and size, why the memory rows outsum the total, a sequence above the model's
max_seq_len, and the memory savers when the model states alone do not fit."""

from __future__ import annotations

import re

import pytest

from scaletrain import measure
from scaletrain.plan import calibrate, plan, report
from scaletrain.plan.calibrate import Calibration

from conftest import run_here

# a small config's layout on 2 local ranks, as in the issue (zero 0, dp_shard 2), at the test's size
SMALL = ["--config", "configs/tiny.toml", "--model.dim=64", "--model.n_layers=2", "--data.seq_len=32",
         "--train.device=cpu"]
LAYOUT = ["--nproc", "2", "--zero", "0", "--dp-shard", "2", "--micro-batch", "2", "--global-batch", "4"]


def fake_calibration(model_cfg, probes, optimizers, ranks, device_type="cpu", note=None) -> Calibration:
    """A calibration with stated figures for whatever the plan asks: no processes started."""
    cal = Calibration("test|probe=0", ranks, {op: (1e-3, 1e8) for op in calibrate.OPS}, overlap=0.0)
    for p in probes:
        key = calibrate.probe_key(model_cfg, p)
        if p.get("engine"):
            cal.engine[key] = {"block": 0.004, "rest": 0.03}
        else:
            cal.compute.setdefault(key, {})[str(p["micro_batch"])] = {"block": 0.02 * p["micro_batch"],
                                                                      "rest": 0.01 * p["micro_batch"]}
    cal.optimizer.update({"|".join(o): 1e-8 for o in optimizers})
    return cal


@pytest.fixture
def no_runs(monkeypatch):
    """--measure without processes: the calibration is stated, each measured step takes 0.5 s."""
    monkeypatch.setattr(measure, "calibration", fake_calibration)
    row = {"params": 2**20, "grads": 2**20, "optimizer": 2**21, "activations": 2**20, "peak": 2**23,
           "step_time_s": 0.5}
    monkeypatch.setattr(measure, "run_layout", lambda config, layout, nproc, overrides=None: [row, row])
    monkeypatch.setattr(measure, "measure_layouts",
                        lambda jobs, nproc, **kw: [[dict(row, step_time_s=0.5 + i)] * 2 for i in range(len(jobs))])


def table_step_ms(stdout: str) -> list[float]:
    """The step times (ms) of the plan's table rows, in its order."""
    rows = re.findall(r"^\s+\d+\s+.+?\s+\d+\.\d\s+(?:yes|NO)\s+(\d+\.\d+)\s", stdout, flags=re.M)
    return [1e3 * float(s) for s in rows]


def test_measure_prints_the_plans_own_prediction(no_runs):
    r = run_here("plan", *SMALL, *LAYOUT, "--measure")
    assert r.returncode == 0, r.stderr
    [planned] = table_step_ms(r.stdout)
    step = re.search(r"^step_time_s\s+(\d+) ms\s+(\d+) ms", r.stdout, flags=re.M)
    assert step, r.stdout
    assert float(step.group(1)) == round(planned)  # one prediction: the table's, not a second derivation
    assert float(step.group(2)) == 500
    assert "predicted: the plan above (calibrated on this machine)" in r.stdout


def test_measure_top_ranks_by_the_same_predictions(no_runs):
    r = run_here("plan", *SMALL, "--nproc", "2", "--global-batch", "4", "--measure", "--top", "2")
    assert r.returncode == 0, r.stderr
    planned = table_step_ms(r.stdout.split("measured:")[0])
    ranking = r.stdout.split("fastest measured first:")[1].splitlines()
    predicted = [float(m.group(1)) for line in ranking if (m := re.search(r"\s(\d+) ms\s+\d+ ms\s", line))]
    assert len(predicted) == 2 and sorted(predicted) == sorted(round(ms) for ms in planned[:2])


def test_header_names_a_config_files_model_and_counts_it_in_millions():
    r = run_here("plan", "--config", "configs/tiny.toml", "--top", "1")
    assert r.returncode == 0, r.stderr
    header = r.stdout.splitlines()[0]
    assert header.startswith("model configs/tiny.toml [model]: 3.25M parameters;"), header
    big = run_here("plan", "llama-8b", "--top", "1")
    assert big.stdout.startswith("model llama-8b: 8.03B parameters;")


def test_memory_rows_that_outsum_the_total_say_why():
    result = plan("llama-8b", gpus_per_node=8, seq_len=2048, global_batch=64, layout={"zero": 3, "micro_batch": 2})
    ev = result["layouts"][0]
    rows = sum(getattr(ev.memory, c) for c in ev.memory.COMPONENTS)
    text = report.breakdown(ev)
    assert rows > ev.memory.total + 2**30  # FSDP's gathered blocks and the gradients: not all at once
    assert f"the rows sum to {rows / 2**30:.2f} GiB, but not all are alive at once" in text


def test_a_sequence_above_the_models_max_seq_len_is_said():
    r = run_here("plan", "tiny", "--top", "1")
    assert r.returncode == 0, r.stderr
    assert "Sequence 2048 is above tiny's max_seq_len 128: planned as if it were 2048" in r.stdout
    within = run_here("plan", "tiny", "--seq-len", "128", "--top", "1")
    assert "max_seq_len" not in within.stdout


def test_model_states_that_do_not_fit_name_the_memory_savers_with_figures():
    result = plan("llama-8b", gpus_per_node=1, seq_len=2048, global_batch=16)
    assert not result["layouts"][0].fits
    text = " ".join(result["explanation"])
    assert "The model states alone (" in text
    for saver in ("8-bit AdamW (--optimizer adamw8bit): ", "Adafactor (--optimizer adafactor): "):
        assert re.search(re.escape(saver) + r"[0-9.]+ GiB per GPU, (fits|still too large)", text), text
    assert "Adafactor (--optimizer adafactor): " in text and "fits" in text.split("Adafactor")[1]
    # a fixed layout on 2 GPUs: ZeRO-3 is possible there, so offloading is offered beside the optimizers
    two = plan("llama-8b", gpus_per_node=2, seq_len=2048, global_batch=16, layout={"zero": 0, "micro_batch": 1})
    assert not two["layouts"][0].fits
    text = " ".join(two["explanation"])
    assert re.search(r"ZeRO-3 with offload \(--zero 3 --offload\): [0-9.]+ GiB per GPU and [0-9.]+ GiB in host "
                     r"memory, fits", text), text
    fits = plan("llama-8b", gpus_per_node=8, seq_len=2048, global_batch=64)
    assert not any("memory savers" in line for line in fits["explanation"])
