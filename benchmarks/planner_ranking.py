"""Does the planner name the fastest layout on this machine? Predicted against measured step times.

For each of two models, a dozen layouts of `--nproc` local ranks (DDP, ZeRO 1-3, gradient
accumulation, activation checkpointing, tensor parallel with and without sequence parallel,
pipeline schedules) are predicted twice — by the catalog's time model for the CPU at hand, and
by the time model calibrated on this machine (`scaletrain.plan.calibrate`; measured first if
the cache lacks it) — and then run for real, all in one group of processes per model (median of
`--steps` timed steps after two warm-up steps, the slowest rank's, in `--rounds` rounds of every
layout in turn, the median round kept). Printed per model: the
layouts re-ranked by measured step time with each prediction beside it, Kendall's tau between
the predicted and the measured order, the range of predicted/measured, and whether the
predicted best is the measured best (or how far from it); then the machine's pace (the
planner's pace probe, `scaletrain.measure.pace_seconds`) when calibrated, when predicted (the
calibrated figures are scaled by the ratio) and after the measurement: on a shared machine a
load that moves while the layouts run moves their step times, which no prediction made before
can follow.

    python benchmarks/planner_ranking.py [--nproc 2] [--steps 3] [--models issue,wide]
"""

from __future__ import annotations

import argparse
import functools
import os
import time

MODELS = {  # overrides of configs/tiny.toml
    "issue": {"model.dim": 256, "model.n_layers": 4, "model.n_heads": 4, "data.seq_len": 128,
              "train.global_batch": 16},  # the model of the issue that asked for this
    "wide": {"model.dim": 384, "model.n_layers": 4, "model.n_heads": 6, "data.seq_len": 64,
             "model.max_seq_len": 64, "train.global_batch": 16},
}
LAYOUTS = [  # the plan command's names; what is left out is derived as the config derives it
    {"zero": 0, "micro_batch": 8},
    {"zero": 0, "micro_batch": 4},
    {"zero": 1, "micro_batch": 8},
    {"zero": 2, "micro_batch": 4},
    {"zero": 3, "micro_batch": 8},
    {"zero": 0, "micro_batch": 8, "ac": "full"},
    {"zero": 3, "micro_batch": 4, "ac": "selective"},
    {"tp": 2, "sp": False, "micro_batch": 8},
    {"tp": 2, "sp": True, "micro_batch": 8},
    {"pp": 2, "schedule": "1f1b", "micro_batch": 4},
    {"pp": 2, "schedule": "gpipe", "micro_batch": 4},
    {"pp": 2, "schedule": "interleaved-1f1b", "virtual": 2, "micro_batch": 4},
]


def rank_model(name: str, nproc: int, steps: int, rounds: int, config: str = "configs/tiny.toml") -> dict:
    import torch

    from scaletrain.config import load_config
    from scaletrain.hardware import local_hardware
    from scaletrain.measure import calibration, kendall_tau, measure_evaluations, pace_seconds, print_ranking
    from scaletrain.plan import calibrated, evaluate, plan

    overrides = {**MODELS[name], "train.device": "cpu"}
    cfg = load_config(config, overrides)
    hw = local_hardware(torch.device("cpu"))
    common = dict(hardware=hw, nodes=1, gpus_per_node=nproc, seq_len=cfg.data.seq_len,
                  global_batch=cfg.train.global_batch, precision=cfg.precision.mode, optimizer=cfg.optim.name,
                  gpu=False)
    catalog = [plan(cfg.model, layout=lay, **common)["layouts"][0] for lay in LAYOUTS]
    first = plan(cfg.model, layout=LAYOUTS[0], **common)
    t0 = time.perf_counter()
    cluster = calibrated(first["cfg"], first["workload"], first["cluster"], [e.layout for e in catalog], gpu=False,
                         measure=functools.partial(calibration, note=print))
    took = time.perf_counter() - t0
    predicted = [evaluate(first["cfg"], first["workload"], cluster, e.layout, gpu=False) for e in catalog]
    rows, seconds = measure_evaluations(config, predicted, nproc, overrides, steps=steps, memory=False, rounds=rounds)
    pace = cluster.calibration.pace
    print(f"pace (one thread's fixed work, the machine's load): {1e3 * pace:.0f} ms at calibration, "
          f"{1e3 * pace * cluster.calibration.slowdown:.0f} ms at prediction (x{cluster.calibration.slowdown:.2f}), "
          f"{1e3 * pace_seconds():.0f} ms after the measurement; load average {os.getloadavg()[0]:.1f}")
    print(f"\n{name}: {cfg.model.dim} wide, {cfg.model.n_layers} layers, sequence {cfg.data.seq_len}, global batch "
          f"{cfg.train.global_batch}, {cfg.precision.mode}; {len(rows)} layouts on {nproc} rank(s), median of {steps} "
          f"timed steps, median of {rounds} round(s) ({seconds:.0f} s; calibration {took:.0f} s); "
          "fastest measured first, calibrated prediction:")
    summary = print_ranking(rows)
    measured = [r["measured_s"] for r in rows]
    tau_catalog = kendall_tau([e.time.step_time_s for e in catalog], measured)
    ratios = [e.time.step_time_s / m for e, m in zip(catalog, measured)]
    print(f"the catalog's time model on the same runs: tau {tau_catalog:+.2f}, predicted/measured "
          f"{min(ratios):.2f}-{max(ratios):.2f}")
    return summary


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3, help="each layout measured once per round, in turn; the "
                                                          "median round counts")
    ap.add_argument("--models", default=",".join(MODELS))
    args = ap.parse_args()
    for model in args.models.split(","):
        rank_model(model, args.nproc, args.steps, args.rounds)
