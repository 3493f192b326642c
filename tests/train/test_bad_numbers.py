"""Bad numbers: non-finite steps are skipped untouched, a run that keeps diverging stops with
the step and the parameter, fp16 that cannot recover suggests bf16, loss spikes are logged."""

from __future__ import annotations

import io
import math

import pytest
import torch

from scaletrain.cli import main
from scaletrain.errors import TrainingStopped
from scaletrain.train.trainer import Trainer

from conftest import micro_cfg, read_metrics


def poison(trainer, steps, value=float("nan"), param=3):
    """Make one gradient element of parameter number `param` non-finite at the given steps."""
    real = trainer.update

    def update():
        if trainer.step + 1 in steps:
            trainer.pm.dp.named_params[param][1].grad.view(-1)[0] = value
        return real()

    trainer.update = update
    return trainer.pm.dp.named_params[param][0]


def snapshot(trainer):
    weights = {n: p.detach().clone() for n, p in trainer.pm.dp.named_params}
    state = {id(p): {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
             for p, s in trainer.optimizer.state.items()}
    return weights, state


def same(a, b) -> bool:
    weights_a, state_a = a
    weights_b, state_b = b
    return (weights_a.keys() == weights_b.keys() and all(torch.equal(weights_a[n], weights_b[n]) for n in weights_a)
            and state_a.keys() == state_b.keys()
            and all(torch.equal(state_a[k][s], state_b[k][s]) if torch.is_tensor(state_a[k][s])
                    else state_a[k][s] == state_b[k][s] for k in state_a for s in state_a[k]))


@pytest.mark.parametrize("mode", ["32-true", "bf16-mixed", "bf16-true"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_gradient_skips_the_step_untouched(tmp_path, mode, value):
    log = io.StringIO()
    trainer = Trainer(micro_cfg(tmp_path, **{"precision.mode": mode, "train.steps": 6}), stream=log)
    name = poison(trainer, {3}, value)
    states = {}
    real = trainer.update

    def recording_update():
        out = real()
        states[trainer.step + 1] = snapshot(trainer)
        return out

    trainer.update = recording_update
    trainer.fit()
    assert same(states[3], states[2])  # step 3 changed neither the weights nor the optimizer state
    assert not same(states[4], states[3])  # and training went on
    rows = read_metrics(tmp_path / "run")
    assert [r["skipped_steps"] for r in rows] == [0, 0, 1, 1, 1, 1]
    assert f"step 3: non-finite gradient (first in {name}); step skipped, weights untouched" in log.getvalue()


def test_consecutive_skips_stop_the_run_naming_step_and_parameter(tmp_path):
    trainer = Trainer(micro_cfg(tmp_path, **{"train.steps": 20, "train.max_skipped_steps": 3}))
    name = poison(trainer, set(range(5, 21)))
    with pytest.raises(TrainingStopped, match=rf"^step 7: 3 steps in a row had non-finite gradients \(the first in "
                                              rf"{name}\); stopping \(train.max_skipped_steps=3\)"):
        trainer.fit()
    assert [r["step"] for r in read_metrics(tmp_path / "run")][-1] == 6  # nothing past the last good step


def test_a_diverging_run_exits_3_with_one_line(tmp_path, capsys):
    # a learning rate this large overflows the weights within a few steps: a real divergence
    code = main(["train", "--model.dim=64", "--model.n_layers=2", "--data.seq_len=32", "--train.global_batch=8",
                 "--train.steps=40", "--optim.name=sgd", "--optim.lr=1e30", "--train.grad_clip=0",
                 "--train.max_skipped_steps=2", "--log.progress=off", "--log.tensorboard=false",
                 "--checkpoint.save_final=false", f"--log.run_dir={tmp_path / 'run'}", "--train.sample_tokens=0"])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("scaletrain: error:")]
    assert code == 3, err
    assert len(lines) == 1 and "2 steps in a row had non-finite gradients" in lines[0], err
    assert "Traceback" not in err


def test_fp16_scale_collapse_stops_and_suggests_bf16(tmp_path):
    trainer = Trainer(micro_cfg(tmp_path, **{
        "precision.mode": "16-mixed", "precision.init_scale": 8.0, "precision.min_scale": 1.0,
        "train.steps": 30, "train.max_skipped_steps": 3}))
    poison(trainer, set(range(2, 31)), float("inf"))
    # the scale halves 8 -> 4 -> 2 -> 1 on steps 2-4, then overflows 3 times at the minimum
    with pytest.raises(TrainingStopped, match=r"^step 7: the fp16 loss scale collapsed to its minimum .*"
                                              r"train with precision.mode=bf16-mixed$"):
        trainer.fit()
    assert trainer.precision.scaler.scale == 1.0


def test_fp16_overflows_that_recover_do_not_stop_the_run(tmp_path):
    trainer = Trainer(micro_cfg(tmp_path, **{"precision.mode": "16-mixed", "precision.init_scale": 1024.0,
                                             "train.steps": 12, "train.max_skipped_steps": 2}))
    poison(trainer, {2, 3, 4, 5, 6}, float("inf"))  # five overflows in a row, but the scale stays above 1
    result = trainer.fit()
    assert result["step"] == 12 and trainer.state.skipped_steps == 5 and trainer.precision.scaler.scale == 1024.0 / 32


def test_loss_spikes_are_logged(tmp_path):
    log = io.StringIO()
    trainer = Trainer(micro_cfg(tmp_path, **{"train.steps": 30, "log.spike_factor": 2.0,
                                             "train.divergence_factor": 0}), stream=log)
    real = trainer.end_of_step

    def spiking(local_loss, grad_norm):
        loss, grad_norm, stop = real(local_loss, grad_norm)
        return (loss * 5 if trainer.step == 25 else loss), grad_norm, stop

    trainer.end_of_step = spiking
    trainer.fit()
    spikes = [line for line in log.getvalue().splitlines() if line.startswith("loss spike at")]
    assert len(spikes) == 1 and spikes[0].startswith("loss spike at step 25: "), log.getvalue()
    assert "(log.spike_factor=2)" in spikes[0] and trainer.health.spikes == 1


def test_spike_logging_can_be_turned_off(tmp_path):
    log = io.StringIO()
    trainer = Trainer(micro_cfg(tmp_path, **{"train.steps": 20, "log.spike_factor": 0,
                                             "train.divergence_factor": 0}), stream=log)
    real = trainer.end_of_step
    trainer.end_of_step = lambda t, g: (lambda out: (out[0] * (100 if trainer.step == 15 else 1), *out[1:]))(real(t, g))
    trainer.fit()
    assert "loss spike" not in log.getvalue()


# --------------------------------------------------------------------------------------------
# Divergence and skipped steps stop the run


def _override_loss(trainer: Trainer, loss_at) -> None:
    """The global loss each step reports becomes loss_at(step, real loss)."""
    real = trainer.end_of_step
    trainer.end_of_step = lambda t, g: (lambda out: (loss_at(trainer.step, out[0]), *out[1:]))(real(t, g))


def test_a_loss_far_above_its_early_value_stops_with_exit_3(tmp_path):
    trainer = Trainer(micro_cfg(tmp_path, **{"train.steps": 20, "train.divergence_factor": 3.0,
                                             "train.divergence_margin": 100.0}))
    _override_loss(trainer, lambda step, loss: 5.0 if step <= 5 else 15.5 if step == 12 else loss)
    with pytest.raises(TrainingStopped, match=r"^step 12: the loss 15.5000 is 3.1x its early value 5.0000 "
                                              r"\(train.divergence_factor=3\): the run diverged"):
        trainer.fit()
    assert TrainingStopped.exit_code == 3


def test_a_loss_worse_than_uniform_after_warm_up_stops(tmp_path):
    trainer = Trainer(micro_cfg(tmp_path, **{"train.steps": 20, "optim.warmup_steps": 5}))
    uniform = math.log(256)
    _override_loss(trainer, lambda step, loss: uniform + 1.5 if step >= 4 else loss)  # from step 4, in warm-up
    with pytest.raises(TrainingStopped, match=r"^step 6: after warm-up the loss 7.0452 is above ln\(vocab_size\) \+ "
                                              r"train.divergence_margin = 5.5452 \+ 1, worse than guessing"):
        trainer.fit()


def test_divergence_checks_can_be_turned_off(tmp_path):
    trainer = Trainer(micro_cfg(tmp_path, **{"train.steps": 12, "train.divergence_factor": 0}))
    _override_loss(trainer, lambda step, loss: 100.0 if step > 8 else loss)
    assert trainer.fit()["step"] == 12


def test_every_step_skipped_under_fp16_stops(tmp_path):
    # the scale starts so high that every step of this short run overflows and backs off
    trainer = Trainer(micro_cfg(tmp_path, **{"precision.mode": "16-mixed", "precision.init_scale": 2.0**100,
                                             "train.steps": 6, "train.max_skipped_steps": 5}))
    with pytest.raises(TrainingStopped, match=r"^every one of the 6 steps of this run was skipped \(non-finite "
                                              r"gradients or fp16 overflow\): the weights never changed; lower "
                                              r"precision.init_scale or train with precision.mode=bf16-mixed$"):
        trainer.fit()
    assert trainer.health.applied_steps == 0 and trainer.state.skipped_steps == 6
