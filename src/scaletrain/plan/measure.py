"""Predicted against measured: one real step of a layout on the devices at hand.

Measured from live tensors on each rank: model states (parameters with any master copies or
ZeRO shards, gradients, optimizer state) during the first step, the activations one
micro-batch's forward keeps for backward, and the step's peak allocation (the CUDA allocator,
or on CPU the profiler's record); the figures are the largest over ranks.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from scaletrain.plan.memory_model import GiB


def measure(trainer, steps: int = 2) -> dict:
    """Run a few real steps and measure (every rank calls this); `steps` are timed."""
    from scaletrain.memory import peak_allocated_bytes

    batches = iter(trainer._loader())
    trainer.train_step(batches)  # also measures the model states
    trainer.train_step(batches)  # DDP rebuilds its buckets in the second forward: not activations
    activations = trainer.measure_activation_bytes(batches)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        trainer.train_step(batches)
        times.append(time.perf_counter() - t0)
    peak = peak_allocated_bytes(lambda: trainer.train_step(batches), trainer.device)
    if trainer.device.type != "cuda":  # the profiler counts from the step's start: add what lives across steps
        from scaletrain.optim import optimizer_state_bytes, tensor_bytes

        params = [p for _, p in trainer.named_params] + [p for _, p in trainer.optim_params]
        peak += tensor_bytes(params) + optimizer_state_bytes(trainer.optimizer)
    return {**trainer.state_bytes, "activations": activations, "peak": peak, "step_time_s": statistics.median(times)}


def predicted_components(ev, cfg, wl, layout) -> dict:
    """The planner's figures in the measured components' terms: per-micro-batch activations."""
    from scaletrain.plan.memory_model import in_flight

    m = ev.memory
    flight = max(in_flight(layout.schedule, layout.pp, layout.grad_accum, layout.virtual)) if layout.pp > 1 else 1
    return {"params": m.params + m.master, "grads": m.grads, "optimizer": m.optimizer,
            "activations": m.activations / flight + m.logits_loss, "peak": m.total - m.reserve,
            "step_time_s": ev.time.step_time_s}


def _worker(config: str, overrides: list[str], out: str) -> None:
    import torch.distributed as dist

    from scaletrain.config import load_config
    from scaletrain.parallel.launch import exit_worker, init_worker
    from scaletrain.train.trainer import Trainer

    cfg = load_config(config, overrides)
    rt = init_worker(cfg)
    row = measure(Trainer(cfg, rt, stream=open(os.devnull, "w")))
    rows = [None] * rt.world_size
    dist.all_gather_object(rows, row)
    if rt.rank == 0:
        Path(out).write_text(json.dumps(rows))
    exit_worker(0)


def run_layout(config: str, layout, nproc: int) -> list[dict]:
    """Measure `layout` with the model and data of `config` on `nproc` local ranks."""
    overrides = [f"--{k}={v}" for k, v in layout.config_overrides().items()]
    run_dir = tempfile.mkdtemp(prefix="plan-measure-")
    overrides += [f"--log.run_dir={run_dir}", "--log.tensorboard=false", "--log.progress=off",
                  "--checkpoint.save_final=false", "--train.sample_tokens=0",
                  f"--train.global_batch={layout.micro_batch * layout.grad_accum * layout.dp}"]
    if nproc == 1:
        from scaletrain.config import load_config
        from scaletrain.train.trainer import Trainer

        return [measure(Trainer(load_config(config, overrides), stream=open(os.devnull, "w")))]
    from scaletrain.parallel.launch import launch

    out = Path(tempfile.mkdtemp(prefix="plan-measure-out-")) / "rows.json"
    code = launch([config, out.as_posix(), *overrides], nproc=nproc, program=("-m", "scaletrain.plan.measure"))
    if code:
        raise SystemExit(code)
    return json.loads(out.read_text())


def measure_and_print(config: str, layout, nproc: int) -> int:
    from scaletrain.config import load_config
    from scaletrain.plan import plan
    from scaletrain.plan.hardware import local_hardware
    from scaletrain.parallel.launch import pick_device

    cfg = load_config(config)
    device = pick_device(cfg.train.device)
    hw = local_hardware(device)
    result = plan(cfg.model, hardware=hw, nodes=1, gpus_per_node=nproc, seq_len=cfg.data.seq_len,
                  global_batch=layout.micro_batch * layout.grad_accum * layout.dp, precision=cfg.precision.mode,
                  optimizer=cfg.optim.name, layout=layout, gpu=device.type == "cuda")
    ev = result["layouts"][0]
    predicted = predicted_components(ev, result["cfg"], result["workload"], layout)
    rows = run_layout(config, layout, nproc)
    print(f"\nmeasured on {nproc} × {hw.name} ({layout.describe()}), largest over ranks:")
    print(f"{'component':<22}{'predicted':>14}{'measured':>14}{'ratio':>8}")
    for key in ("params", "grads", "optimizer", "activations", "peak", "step_time_s"):
        values = [r[key] for r in rows if r.get(key) is not None]
        if not values:
            print(f"{key:<22}{_fmt(key, predicted[key]):>14}{'(n/a)':>14}")
            continue
        got = max(values)
        ratio = predicted[key] / got if got else float("nan")
        print(f"{key:<22}{_fmt(key, predicted[key]):>14}{_fmt(key, got):>14}{ratio:>8.2f}")
    return 0


def _fmt(key: str, v: float) -> str:
    return f"{v * 1e3:.0f} ms" if key == "step_time_s" else f"{v / 2**20:.1f} MiB" if v < GiB else f"{v / GiB:.2f} GiB"


if __name__ == "__main__":  # a worker of run_layout
    _worker(sys.argv[1], sys.argv[3:], sys.argv[2])
