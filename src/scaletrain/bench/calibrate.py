"""The calibration probes, run on every rank of a group of processes at once (the `calibrate`
task of scaletrain.launch.worker, started by `scaletrain.measure.calibration`): what each measures and
how is described in `scaletrain.plan.calibrate`, which holds the figures and the cache."""

from __future__ import annotations

import math
import os
import statistics
import time
from dataclasses import replace

import torch

from scaletrain.launch.ranks import quiet, read_spec, write_result
from scaletrain.plan.calibrate import OPS, PROBE_REPS, SIZES, probe_key


def calibrate_rank(spec_path: str, out_path: str) -> int:
    """One rank of `scaletrain.measure.calibration` (the `calibrate` task of scaletrain.launch.worker)."""
    import torch.distributed as dist

    from scaletrain.model.config import ModelConfig
    from scaletrain.runtime import pick_device

    job = read_spec(spec_path)
    local_rank, local_world = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    device = pick_device(job["device"], local_rank, local_world)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            device_id=device if device.type == "cuda" else None)
    model_cfg = ModelConfig(**job["model"])
    result = {"compute": {}, "optimizer": {}, "collectives": None, "overlap": None, "engine": {}}
    plain = [p for p in job["probes"] if not p.get("engine")]
    for p in plain:
        result["compute"].setdefault(probe_key(model_cfg, p), {})[str(p["micro_batch"])] = \
            probe_compute(model_cfg, device, **{k: v for k, v in p.items() if k != "engine"})
    for p in job["probes"]:
        if p.get("engine"):
            shape = {k: v for k, v in p.items() if k != "engine"}
            result["engine"][probe_key(model_cfg, p)] = probe_engine(model_cfg, device, **shape, **p["engine"])
    for name, precision in job["optimizers"]:
        result["optimizer"][f"{name}|{precision}"] = probe_optimizer(model_cfg, device, name, precision)
    if job["collectives"]:
        result["collectives"] = probe_collectives(device) if dist.get_world_size() > 1 else \
            {op: (0.0, math.inf) for op in OPS}
        result["overlap"] = probe_overlap(device, result["collectives"]) if dist.get_world_size() > 1 else 0.0
    if dist.get_rank() == 0:
        write_result(out_path, result)
    dist.barrier()
    return 0


def _timed(fn, device, reps: int = PROBE_REPS) -> float:
    """Seconds of `fn` run on every rank at once (after a barrier): the slowest rank's median of
    `reps` calls after one untimed warm-up call. The median, as
    `scaletrain.measure` times training steps: on a busy machine the fastest call is one that
    found the cores free, and a prediction built from such calls comes out faster than the
    steps it is compared with (DDP's ratio moved between 0.79 and 0.94 with the load)."""
    return _timed_together([fn], device, reps)[0]


def _timed_together(fns: list, device, reps: int = PROBE_REPS) -> list[float]:
    """`_timed` of each of `fns`, called in turn within every repetition: a machine that slows
    down for a while slows them alike, so their differences stay sound."""
    import torch.distributed as dist

    times = [[] for _ in fns]
    for i in range(reps + 1):
        for k, fn in enumerate(fns):
            dist.barrier()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i:
                times[k].append(time.perf_counter() - t0)
    # each rank's median, then the slowest rank's: as `scaletrain.measure` summarises a layout's steps
    # (the slowest call of each repetition would take the unluckier rank's time every time)
    slowest = torch.tensor([statistics.median(row) for row in times], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return slowest.tolist()


def _split(one: float, three: float) -> tuple[float, float]:
    """(a block's, the rest's) seconds from a model of 1 and of 3 blocks."""
    block = max((three - one) / 2, 0.0)
    return block, max(one - block, 0.0)


def probe_compute(model_cfg, device, *, precision: str, seq_len: int, micro_batch: int, tp: int, sp: bool,
                  ac: str, cp: int = 1) -> dict[str, float]:
    """Seconds of one block's forward and backward, and of the rest of the model (embedding,
    head, loss), at this shape on every rank at once; for a mixture of experts also its load
    ("imbalance": max / mean tokens per expert in the worst layer, over the timed steps)."""
    steps = [_model_step(model_cfg, device, n, precision, seq_len // cp, micro_batch, tp, sp, ac) for n in (1, 3)]
    block, rest = _split(*_timed_together(steps, device))
    out = {"block": block, "rest": rest}
    if model_cfg.moe_experts:
        out["imbalance"] = _expert_load(steps[1].model, model_cfg.moe_experts)
    return out


def _expert_load(model, experts: int) -> float:
    """max / mean tokens per expert of the worst MoE layer of `model`, from the counters its
    layers keep (`scaletrain.model.moe.MoE.stats`), summed over every rank."""
    import torch.distributed as dist

    from scaletrain.model.moe import MoE

    loads = torch.stack([m.stats[:experts].detach().float() for m in model.modules() if isinstance(m, MoE)])
    dist.all_reduce(loads)  # on the device: NCCL reduces no host tensor
    return float((loads.max(1).values / loads.mean(1).clamp(min=1e-9)).max())


def _model_step(model_cfg, device, layers: int, precision: str, seq_len: int, micro_batch: int, tp: int,
                sp: bool, ac: str):
    """One forward and backward of the model at `layers` blocks, built as the trainer builds it
    (tensor and sequence parallel, checkpointing, the precision's dtypes), as a function."""
    import contextlib

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from scaletrain.config import PrecisionConfig
    from scaletrain.memory import apply_activation_checkpointing
    from scaletrain.model.loss import cross_entropy_sum
    from scaletrain.model.transformer import Transformer
    from scaletrain.parallel.init import init_weights
    from scaletrain.precision import Precision

    cfg = replace(model_cfg, n_layers=layers, max_seq_len=max(model_cfg.max_seq_len, seq_len))
    prec = Precision(PrecisionConfig(mode=precision), device)
    torch.manual_seed(0)
    with torch.device(device):
        model = Transformer(cfg)
    with torch.no_grad():  # the weights a run starts from (by name), not nn's defaults: those drive the
        init_weights(model, seed=0)  # activations into subnormal floats, which a CPU computes 10-100x slower
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

    step.model = model  # a mixture's probe reads its layers' load counters
    return step


def probe_engine(model_cfg, device, *, precision: str, seq_len: int, micro_batch: int, tp: int, sp: bool, ac: str,
                 cp: int, zero: int, dp_replicate: int, dp_shard: int, optimizer: str) -> dict:
    """What the trainer adds around forward and backward in this layout, per block and for the rest
    of the model, once per step and again per micro-batch: real training steps at 1 and 3 blocks,
    each of 1 and of 2 micro-batches, timed in turn with the bare forward and backward of the same
    models, less them (`engine_parts`)."""
    plain = [_model_step(model_cfg, device, n, precision, seq_len, micro_batch, tp, sp, ac) for n in (1, 3)]
    trained = [_trainer_step(model_cfg, n, precision, seq_len, micro_batch, tp, sp, zero, dp_replicate, dp_shard,
                             optimizer, micro_batches=m) for m in (1, 2) for n in (1, 3)]
    return {**engine_parts(*_timed_together(plain + trained, device)), "micro_batch": micro_batch}


def engine_parts(p1: float, p3: float, t11: float, t31: float, t12: float, t32: float) -> dict[str, float]:
    """The engine's cost from bare forward and backward seconds at 1 and 3 blocks (`p1`, `p3`) and
    training steps at 1 and 3 blocks of 1 and 2 micro-batches (`t11`, `t31`, `t12`, `t32`): what a
    step adds, e(n, m) = t(n, m) − m·p(n), taken as m·(n·block_micro + rest_micro) + n·block + rest.
    Per micro-batch recur a trainer's own work on each micro-batch (loading and placing it, the
    loss's bookkeeping; ZeRO-2's and FSDP's reductions and gathers); once per step the rest
    (DDP's reduction on the last micro-batch, clipping, the optimizer step, ZeRO's gathers after
    it). Also the bare step's own parts (`plain_block`, `plain_rest`), so that the training steps
    themselves are recovered whole: t(n, m) = e(n, m) + m·(n·plain_block + plain_rest).

    The parts are not clamped: each is a difference of noisy timings and may come out below 0 on a
    busy machine, but they add up to the four measured steps exactly, and a part clamped at 0 would
    add its noise to every prediction in one direction (ZeRO-1's engine came out 2-3x its cost)."""
    e11, e31, e12, e32 = t11 - p1, t31 - p3, t12 - 2 * p1, t32 - 2 * p3
    block_micro, rest_micro = _differences(e12 - e11, e32 - e31)
    block, rest = _differences(e11 - (block_micro + rest_micro), e31 - (3 * block_micro + rest_micro))
    plain_block, plain_rest = _differences(p1, p3)
    return {"block": block, "rest": rest, "block_micro": block_micro, "rest_micro": rest_micro,
            "plain_block": plain_block, "plain_rest": plain_rest}


def _differences(one: float, three: float) -> tuple[float, float]:
    """(a block's, the rest's) part of a quantity measured at 1 and 3 blocks, signed."""
    block = (three - one) / 2
    return block, one - block


def _trainer_step(model_cfg, layers: int, precision: str, seq_len: int, micro_batch: int, tp: int, sp: bool,
                  zero: int, dp_replicate: int, dp_shard: int, optimizer: str, micro_batches: int = 1):
    """A training step of the model at `layers` blocks in this layout, of `micro_batches`
    accumulated micro-batches, by the trainer, as a function."""
    import tempfile
    from dataclasses import asdict

    import torch.distributed as dist

    from scaletrain.config import load_config
    from scaletrain.runtime import init_worker
    from scaletrain.train.trainer import Trainer

    model = {f"model.{k}": v for k, v in asdict(model_cfg).items() if k not in ("preset", "from_hf", "init_from")}
    dp = dist.get_world_size() // tp
    cfg = load_config(None, {**model, **quiet(tempfile.mkdtemp(prefix="scaletrain-calibrate-")),
                             "model.n_layers": layers, "data.seq_len": seq_len,
                             "model.max_seq_len": max(model_cfg.max_seq_len, seq_len), "precision.mode": precision,
                             "optim.name": optimizer, "parallel.zero": zero, "parallel.tp": tp, "parallel.sp": sp,
                             "parallel.dp_replicate": dp_replicate, "parallel.dp_shard": dp_shard,
                             "train.micro_batch": micro_batch, "train.global_batch": micro_batch * dp * micro_batches,
                             "train.device": "cuda" if torch.cuda.is_available() else "cpu"})
    trainer = Trainer(cfg, init_worker(cfg), stream=open(os.devnull, "w"))
    batches = trainer.batches()
    trainer.train_step(batches)  # DDP builds its buckets in the first steps
    return lambda: trainer.train_step(batches)


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
