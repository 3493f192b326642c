"""The calibration probes, run on every rank of a group of processes at once (the `calibrate`
task of scaletrain.worker, started by `scaletrain.measure.calibration`): what each measures and
how is described in `scaletrain.plan.calibrate`, which holds the figures and the cache."""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

from scaletrain.plan.calibrate import OPS, PROBE_REPS, SIZES, probe_key



def calibrate_rank(spec_path: str, out_path: str) -> int:
    """One rank of `scaletrain.measure.calibration` (the `calibrate` task of scaletrain.worker)."""
    import torch.distributed as dist

    from scaletrain.model.config import ModelConfig
    from scaletrain.runtime import pick_device

    job = json.loads(Path(spec_path).read_text())
    local_rank, local_world = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    device = pick_device(job["device"], local_rank, local_world)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            device_id=device if device.type == "cuda" else None)
    model_cfg = ModelConfig(**job["model"])
    result = {"compute": {}, "optimizer": {}, "collectives": None, "overlap": None}
    for p in job["probes"]:
        result["compute"].setdefault(probe_key(model_cfg, p), {})[str(p["micro_batch"])] = \
            probe_compute(model_cfg, device, **p)
    for name, precision in job["optimizers"]:
        result["optimizer"][f"{name}|{precision}"] = probe_optimizer(model_cfg, device, name, precision)
    if job["collectives"]:
        result["collectives"] = probe_collectives(device) if dist.get_world_size() > 1 else \
            {op: (0.0, math.inf) for op in OPS}
        result["overlap"] = probe_overlap(device, result["collectives"]) if dist.get_world_size() > 1 else 0.0
    if dist.get_rank() == 0:
        Path(out_path).write_text(json.dumps(result))
    dist.barrier()
    return 0


def _timed(fn, device, reps: int = PROBE_REPS) -> float:
    """Median seconds of `fn` run on every rank at once (after a barrier), each call as long as
    its slowest rank; one untimed warm-up call first."""
    import torch.distributed as dist

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    times = []
    for i in range(reps + 1):
        dist.barrier()
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        if i:
            times.append(time.perf_counter() - t0)
    slowest = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return statistics.median(slowest.tolist())


def probe_compute(model_cfg, device, *, precision: str, seq_len: int, micro_batch: int, tp: int, sp: bool,
                  ac: str, cp: int = 1) -> dict[str, float]:
    """Seconds of one block's forward and backward, and of the rest of the model (embedding,
    head, loss), at this shape on every rank at once."""
    one = _model_step_s(model_cfg, device, 1, precision, seq_len // cp, micro_batch, tp, sp, ac)
    three = _model_step_s(model_cfg, device, 3, precision, seq_len // cp, micro_batch, tp, sp, ac)
    block = max((three - one) / 2, 0.0)
    return {"block": block, "rest": max(one - block, 0.0)}


def _model_step_s(model_cfg, device, layers: int, precision: str, seq_len: int, micro_batch: int, tp: int,
                  sp: bool, ac: str) -> float:
    import contextlib

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from scaletrain.config import PrecisionConfig
    from scaletrain.memory import apply_activation_checkpointing
    from scaletrain.model.loss import cross_entropy_sum
    from scaletrain.model.transformer import Transformer
    from scaletrain.precision import Precision

    cfg = replace(model_cfg, n_layers=layers, max_seq_len=max(model_cfg.max_seq_len, seq_len))
    prec = Precision(PrecisionConfig(mode=precision), device)
    torch.manual_seed(0)
    with torch.device(device):
        model = Transformer(cfg)
    if prec.param_dtype != torch.float32:
        model.to(prec.param_dtype)
    loss_context = contextlib.nullcontext
    if tp > 1:
        from torch.distributed.tensor.parallel import loss_parallel

        from scaletrain.parallel.tensor_parallel import apply_tensor_parallel

        mesh = init_device_mesh(device.type, (dist.get_world_size() // tp, tp), mesh_dim_names=("rest", "tp"))
        apply_tensor_parallel(model, mesh["tp"], sequence_parallel=sp, first_block="0")
        loss_context = loss_parallel
    apply_activation_checkpointing(model.layers, ac)
    tokens = torch.randint(cfg.vocab_size, (micro_batch, seq_len), device=device)

    def step():
        with loss_context():
            with prec.autocast():
                logits = model(tokens)
            cross_entropy_sum(logits, tokens).backward()
        model.zero_grad(set_to_none=False)

    return _timed(step, device)


def probe_optimizer(model_cfg, device, name: str, precision: str) -> float:
    """Seconds per parameter of one step of optimizer `name` over a 2-block model's parameters."""
    from scaletrain.config import OptimConfig
    from scaletrain.model.transformer import Transformer
    from scaletrain.optim import build_optimizer

    cfg = replace(model_cfg, n_layers=2)
    with torch.device(device):
        model = Transformer(cfg)
    if precision == "bf16-true":
        model.to(torch.bfloat16)
    params = list(model.named_parameters())
    for _, p in params:
        p.grad = torch.randn_like(p) * 1e-3
    opt = build_optimizer(OptimConfig(name=name), params, 1e-4, device)
    seconds = _timed(opt.step, device)
    return seconds / sum(p.numel() for _, p in params)


def probe_collectives(device) -> dict[str, tuple[float, float]]:
    """(latency s, bus bandwidth B/s) per collective over all ranks, fitted by least squares to
    the median times at SIZES (time = latency + bus volume / bandwidth)."""
    import torch.distributed as dist

    from scaletrain.bench.comms import measure, message_sizes

    n = dist.get_world_size()
    rows = measure(message_sizes(list(SIZES), n), iters=5, warmup=2, device=device, ops=OPS)
    fitted = {}
    for op in OPS:
        points = [(r["bytes"] * r["bus_factor"], r["time_s"]) for r in rows if r["op"] == op]
        fitted[op] = _fit(points)
    return fitted


def _fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares latency and bandwidth of time = latency + volume / bandwidth; a negative
    latency (noise at small sizes) is taken as 0 and the bandwidth refitted through the origin."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    latency = my - slope * mx
    if latency < 0 or slope <= 0:
        latency = max(latency, 0.0) if slope > 0 else min(ys)
        slope = max(sum(x * (y - latency) for x, y in zip(xs, ys)) / sum(x * x for x in xs), 1e-15)
    return latency, 1.0 / slope


def probe_overlap(device, collectives: dict[str, tuple[float, float]]) -> float:
    """The share of an all-reduce that hides behind compute run at the same time: a matmul loop
    and an all-reduce of about the same length, alone and together,
    (compute + collective − together) / the shorter of the two."""
    import torch.distributed as dist

    a = torch.randn(256, 256, device=device)
    one = _timed(lambda: a @ a, device)
    reps = max(1, int(0.05 / max(one, 1e-6)))

    def compute():
        for _ in range(reps):
            a @ a

    latency, bus = collectives["all_reduce"]
    n = dist.get_world_size()
    count = max(n, int(max(0.05 - latency, 0.005) * bus / (2 * (n - 1) / n) / 4) // n * n)
    buf = torch.zeros(count, device=device)
    t_compute = _timed(compute, device)
    t_comm = _timed(lambda: dist.all_reduce(buf), device)

    def both():
        work = dist.all_reduce(buf, async_op=True)
        compute()
        work.wait()

    t_both = _timed(both, device)
    return min(1.0, max(0.0, (t_compute + t_comm - t_both) / min(t_compute, t_comm)))
