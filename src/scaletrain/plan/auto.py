"""`parallel.layout = "auto"`: the planner picks the layout for the devices at hand.

It searches the layouts of `world` ranks of this machine's device (a known GPU from the
catalog, or the CPU measured here), keeps the global batch and precision of the config, and
fills in `[parallel]`, the micro-batch and accumulation, and `[memory]`.

With `parallel.auto_measure_s = S` (and scaletrain's launcher, one node) the planner predicts
from this machine's calibration (`scaletrain.plan.calibrate`, measured once and cached) and
then times real steps of its best layouts, as many as fit in about S seconds (at least two),
in one group of processes; the fastest measured is trained, and what was measured is said.

`resolve` is the layout's part of settling a job, once, where the job starts
(`scaletrain.launch.job.settle`: one process, `--nproc N`, or rank 0 under torchrun; and `verify`):
the config as it will run and its `Layout`, which every rank is then given.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from scaletrain.config import JobConfig, ParallelConfig, flat_keys
from scaletrain.errors import ConfigError
from scaletrain.layout import Layout

CHOSEN = ("parallel.dp_replicate", "parallel.dp_shard", "parallel.tp", "parallel.pp", "parallel.ep", "parallel.zero",
          "parallel.sp", "parallel.pp_schedule", "parallel.pp_virtual_stages", "parallel.sync.mode")


MEASURE_MAX = 5  # layouts timed at most under auto_measure_s


def auto_layout(cfg: JobConfig, world: int, device: torch.device, gpus_per_node: int | None = None, note=None,
                measure=None):
    """(the config with the planner's layout, the planner's evaluation of it). `measure`:
    `scaletrain.measure`, given by a caller that may start groups of processes (scaletrain's
    launcher), as auto_measure_s needs."""
    from scaletrain.hardware import local_hardware
    from scaletrain.plan import plan

    given = flat_keys({"parallel": dataclasses.asdict(cfg.parallel)})
    defaults = flat_keys({"parallel": dataclasses.asdict(ParallelConfig())})
    set_by_hand = [k for k in CHOSEN if given[k] != defaults[k]]
    if set_by_hand:
        raise ConfigError(f"parallel.layout=auto chooses the layout itself; leave {', '.join(set_by_hand)} at their "
                          "defaults, or set parallel.layout=manual")
    global_batch = cfg.train.global_batch or Layout.from_config(cfg, world).global_batch
    per_node = gpus_per_node or (min(world, torch.cuda.device_count()) if device.type == "cuda" else world)
    nodes = max(1, world // per_node)
    measuring = cfg.parallel.auto_measure_s > 0
    if measuring and not (measure is not None and nodes == 1):
        measuring = False
        if note is not None:
            note("parallel.auto_measure_s: measuring needs scaletrain's launcher on one node; predicting only")
    # every setting that changes which layouts are legal or what they hold: the planner ranks only
    # layouts this job can train (scaletrain.legality), and plans an adapter run as one
    result = plan(cfg.model, hardware=local_hardware(device), nodes=nodes, gpus_per_node=world // nodes,
                  seq_len=cfg.data.seq_len, global_batch=global_batch, precision=cfg.precision.mode,
                  optimizer=cfg.optim.name, adapter=cfg.adapter.kind, adapter_rank=cfg.adapter.rank,
                  adapter_targets=cfg.adapter.targets, base_dtype=cfg.adapter.base_dtype, qat=cfg.train.qat,
                  document_mask=cfg.data.document_mask,
                  gpu=device.type == "cuda", top_k=MEASURE_MAX if measuring else 1,
                  calibrate=functools.partial(measure.calibration, note=note) if measuring else None)
    best = result["layouts"][0]
    if not best.fits:
        raise ConfigError(f"parallel.layout=auto: no layout of {world} rank(s) fits — the leanest "
                          f"({best.layout.describe()}) {best.why_not[0]}")
    if measuring:
        best = measure.measured_best(cfg, result["layouts"], world, cfg.parallel.auto_measure_s, note)
    chosen = {"parallel.layout": "manual", "parallel.pp_microbatches": 0, "train.global_batch": global_batch,
              **best.layout.config_overrides()}
    return cfg.replace(**chosen), best


def resolve(cfg: JobConfig, world: int, device: torch.device, *, gpus_per_node: int | None = None,
            note=None, measure=None) -> tuple[JobConfig, Layout]:
    """(the config as the job runs it, its layout on `world` ranks), derived once, where the job
    starts: for `parallel.layout = "auto"` the planner's choice for `device` (said in one line to
    `note`, a function of a str, if given), else the config's own layout. `measure`
    (`scaletrain.measure`, from a caller that may start processes) lets parallel.auto_measure_s
    time layouts. Not checked against the model: that is `layout.check(cfg.model)`."""
    if cfg.parallel.layout == "auto":
        cfg, best = auto_layout(cfg, world, device, gpus_per_node, note=note, measure=measure)
        if note is not None:
            # the catalog's time model is calibrated on GPUs: on a CPU without this machine's
            # calibration it ranks layouts but predicts no throughput
            known = device.type == "cuda" or cfg.parallel.auto_measure_s > 0
            speed = f"{best.time.tokens_per_s:,.0f} tokens/s, " if known else ""
            note(f"parallel.layout=auto chose {best.layout.describe()} (planner: {speed}"
                 f"{best.memory.total / 2**30:.2f} GiB per rank"
                 f"{'; on a CPU it predicts no tokens/s without parallel.auto_measure_s' if not known else ''})")
    return cfg, Layout.from_config(cfg, world)
