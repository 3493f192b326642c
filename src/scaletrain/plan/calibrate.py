"""Calibration of the machine at hand: what the planner's time model needs, measured here.

The catalog's figures (a datasheet peak, a link's nominal bandwidth, an efficiency taken from
published runs) describe a GPU cluster; they say little about the machine the user sits at,
where, on a CPU, two ranks share two cores, a tensor-parallel layer pays DTensor's dispatch on
every operation and gloo's collectives copy through loopback. So, for a plan of the machine at
hand, every figure the time model uses is measured by a group of as many ranks as the plan has,
all running at once (the cores and memory bandwidth they share are part of what is measured):

* **compute** — one forward and backward of this model's own layers, built as the trainer builds
  them (tensor and sequence parallel over the group's ranks, activation checkpointing, the
  precision's dtypes), at each tp, sp and checkpointing the layouts use, at their smallest and
  largest micro-batch: a model of 1 and of 3 blocks, timed in turn, gives a block's seconds
  (half the difference) and the rest (embedding, head and loss). Its tensor-parallel
  collectives run inside it, as they do in training.
* **expert load** — for a mixture of experts, the same probe counts the tokens its router sends
  to each expert: max / mean in the worst layer (the trainer's `moe_imbalance`), the router at
  initialisation on the probe's random tokens. The plan takes it as `Workload.moe_imbalance`
  unless one is given (a trained router's, from a run's metrics, is usually larger).
* **collectives** — all-reduce, all-gather, reduce-scatter, all-to-all and send/recv at several
  sizes (`scaletrain bench comms`'s measurement), fitted as latency + bus volume / bandwidth.
* **overlap** — how much of a collective hides behind compute when both run at once
  (issued asynchronously beside a matmul loop): on GPUs they use different engines; on a CPU
  they compete for the same cores.
* **optimizer** — seconds per parameter of the configured optimizer's step.
* **engine** — what the trainer adds around forward and backward for a data- or tensor-parallel
  layout (DDP's or ZeRO's hooks and reductions, FSDP's gathers, DTensor's optimizer step and
  clipping, the data loader): real training steps of the model at 1 and 3 blocks in that
  layout, of 1 and of 2 micro-batches (the smallest micro-batch), less the bare forward and
  backward of the same models timed in turn with them — per block and for the rest, once per
  step and again per micro-batch (ZeRO-2 reduce-scatters every micro-batch and steps once; the
  trainer has work of its own on each micro-batch). It is not split into
  collectives and overlap: on a CPU the two share the cores, and the sum is what a step pays.

* **pace** — a fixed piece of work (`scaletrain.measure.pace_seconds`: one thread's matmuls)
  timed by the planning process just before the group starts. A shared machine's speed moves
  with what else runs on it: each later plan times the pace again and scales every calibrated
  figure by now / then (`Calibration.slowdown`), and probes added later are brought to the
  first calibration's pace before they are merged — so a plan predicts the step on the machine
  as loaded as it is when planned, not as it was when calibrated (on this 2-core machine under a
  load of 20 the figures of a quieter moment had predicted 2-3x the measured steps).

Results are cached in the user's cache folder under the machine's key (CPU or GPU name, cores,
torch version, backend, ranks, probe version): a new machine, core count, PyTorch or probe is
measured afresh; compute probes are added as new shapes are planned. Links across nodes cannot
be measured from one node: there the catalog's figures stay, and the explanation says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

PROBE_VERSION = 6
OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
SIZES = (4 << 10, 64 << 10, 1 << 20, 8 << 20)  # bytes per collective buffer
PROBE_REPS = 5  # timed calls per probe (the median is kept), after one warm-up


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' busbw / algbw for `op` on `n` ranks (`scaletrain bench comms`): the bytes each
    rank moves over the link per byte of the buffer, for a ring."""
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    if op in ("broadcast", "reduce", "send_recv"):
        return 1.0
    raise ValueError(f"unknown collective {op!r}")


@dataclass
class Calibration:
    """What was measured on this machine for `ranks` ranks (see the module's docstring)."""

    machine: str  # the cache key: what the figures are valid for
    ranks: int
    collectives: dict[str, tuple[float, float]] = field(default_factory=dict)  # op -> (latency s, bus B/s)
    overlap: float = 0.0  # share of a collective hidden behind concurrent compute
    compute: dict[str, dict[str, float]] = field(default_factory=dict)  # probe key -> {"block", "rest"} seconds
    optimizer: dict[str, float] = field(default_factory=dict)  # optimizer|precision -> seconds per parameter
    engine: dict[str, dict[str, float]] = field(default_factory=dict)  # engine key -> extra seconds: block, rest
    # (once per step), block_micro, rest_micro (per micro-batch); plain_block, plain_rest (the bare steps timed
    # beside them) and the probe's micro_batch
    pace: float = 0.0  # seconds of the pace probe when these figures were measured (0: not known)
    slowdown: float = 1.0  # the pace now over `pace`: every calibrated figure is scaled by it (not cached)

    def collective_s(self, op: str, nbytes: float, n: int, calls: int = 1) -> float:
        """Seconds of `calls` calls of `op` moving `nbytes` in all (the whole buffer, as
        `scaletrain bench comms` counts it) over `n` of the measured ranks: the fitted latency,
        a ring's share of it for a smaller group, plus the bus volume at the fitted bandwidth."""
        if n <= 1 or nbytes <= 0:
            return 0.0
        latency, bus = self.collectives[op]
        hops = (n - 1) / max(self.ranks - 1, 1)
        factor = 1.0 if op == "send_recv" else bus_factor(op, n)
        return calls * latency * hops + nbytes * factor / bus

    def block(self, key: str, micro_batch: int) -> tuple[float, float]:
        """(a block's, the rest's) forward and backward seconds at `micro_batch` for probe key
        `key`: measured at that micro-batch, else interpolated linearly (in micro-batch size)
        between the two nearest measured ones, or extended from them."""
        got = {int(mb): v for mb, v in self.compute[key].items()}
        if micro_batch in got or len(got) == 1:
            v = got.get(micro_batch) or next(iter(got.values()))
            return v["block"], v["rest"]
        sizes = sorted(got, key=lambda mb: (abs(mb - micro_batch), mb))[:2]
        lo, hi = sorted(sizes)
        w = (micro_batch - lo) / (hi - lo)
        return tuple(max(0.0, got[lo][k] + w * (got[hi][k] - got[lo][k])) for k in ("block", "rest"))

    def imbalance(self, keys: list[str]) -> float | None:
        """A mixture of experts' load measured by the compute probes of `keys` (max / mean tokens
        per expert in the worst layer, the mean over the probes), or None where none measured it."""
        got = [v["imbalance"] for k in keys for v in self.compute.get(k, {}).values() if "imbalance" in v]
        return sum(got) / len(got) if got else None

    def has(self, key: str, micro_batch: int) -> bool:
        return str(micro_batch) in self.compute.get(key, {})


def compute_key(cfg, precision: str, seq_len: int, tp: int, sp: bool, ac: str, cp: int = 1) -> str:
    """A compute probe's cache key: the model's shape and everything the layout changes in it
    but the micro-batch (each key holds probes at several micro-batch sizes); a mixture of
    experts' shape and routing besides."""
    shape = (cfg.dim, cfg.n_heads, cfg.kv_heads, cfg.head_size, cfg.hidden_dim, cfg.vocab_size, cfg.activation,
             cfg.norm, cfg.position, cfg.tie_embeddings, cfg.dropout > 0)
    if cfg.moe_experts:
        shape += ("moe", cfg.moe_experts, cfg.moe_top_k, cfg.moe_shared_experts, cfg.expert_hidden, cfg.moe_every,
                  cfg.moe_first_dense, cfg.moe_score, cfg.moe_capacity_factor)
    return f"{precision}|{','.join(map(str, shape))}|seq={seq_len // cp}|tp={tp}|sp={sp}|ac={ac}"


def engine_reference_key(cfg, wl, layout) -> str:
    """The compute probe an engine probe's bare steps are the same shape as (the layout's tp and sp,
    no checkpointing): the engine's reference (`calibrated_time.estimate`)."""
    return compute_key(cfg, wl.precision, wl.seq_len, layout.tp, layout.sp, "none", layout.cp)


def engine_key(cfg, wl, layout) -> str:
    """An engine probe's cache key: the model's shape, precision and optimizer, and the layout's
    data- and tensor-parallel settings."""
    return (f"{engine_reference_key(cfg, wl, layout)}|opt={wl.optimizer}|zero={layout.zero}"
            f"|dp={layout.dp_replicate}x{layout.dp_shard}|sync={layout.dp_sync}")


def engine_probed(layout) -> bool:
    """Layouts whose engine is probed: every rank data or tensor parallel (no pipeline, no
    context or expert parallel, synchronous data parallelism)."""
    return layout.pp == 1 and layout.cp == 1 and layout.ep == 1 and layout.outer is None and layout.world > 1


def layout_key(cfg, wl, layout) -> str:
    return compute_key(cfg, wl.precision, wl.seq_len, layout.tp, layout.sp, layout.activation_checkpointing,
                       layout.cp)


def probes_for(cfg, wl, layouts) -> list[dict]:
    """The compute probes that calibrate `layouts`: for each shape (precision, tp, sp,
    checkpointing, cp) the smallest and the largest micro-batch the layouts use (others are
    interpolated, `Calibration.block`); an engine probe for each data- and tensor-parallel
    engine, at the smallest micro-batch of its layouts and without checkpointing, and the
    compute probe of that shape and micro-batch beside it (the engine's reference,
    `calibrated_time.estimate`)."""
    sizes: dict[tuple, set[int]] = {}
    for lay in layouts:
        shape = (wl.precision, wl.seq_len, lay.tp, lay.sp, lay.activation_checkpointing, lay.cp)
        sizes.setdefault(shape, set()).add(lay.micro_batch)
    wanted = {shape: {min(mbs), max(mbs)} for shape, mbs in sizes.items()}
    engines: dict[str, dict] = {}
    for lay in layouts:
        if engine_probed(lay):
            key = engine_key(cfg, wl, lay)
            mb = min(lay.micro_batch, engines.get(key, {}).get("micro_batch", lay.micro_batch))
            engines[key] = dict(precision=wl.precision, seq_len=wl.seq_len, tp=lay.tp, sp=lay.sp, ac="none", cp=1,
                                micro_batch=mb, engine={"zero": lay.zero, "dp_replicate": lay.dp_replicate,
                                                        "dp_shard": lay.dp_shard, "optimizer": wl.optimizer})
    for e in engines.values():  # the engine's reference: its bare steps' shape, at its micro-batch
        shape = tuple(e[k] for k in ("precision", "seq_len", "tp", "sp", "ac", "cp"))
        wanted.setdefault(shape, set()).add(e["micro_batch"])
    probes = [dict(precision=p, seq_len=s, tp=tp, sp=sp, ac=ac, cp=cp, micro_batch=mb)
              for (p, s, tp, sp, ac, cp), mbs in wanted.items() for mb in sorted(mbs)]
    return probes + list(engines.values())


def probe_key(model_cfg, probe: dict) -> str:
    """The cache key of a probe (a compute probe, or with "engine" an engine probe)."""
    base = compute_key(model_cfg, **{k: v for k, v in probe.items() if k not in ("micro_batch", "engine")})
    e = probe.get("engine")
    if not e:
        return base
    return f"{base}|opt={e['optimizer']}|zero={e['zero']}|dp={e['dp_replicate']}x{e['dp_shard']}|sync=step"


def machine_key(device_type: str, ranks: int) -> str:
    from scaletrain.hardware import _cpu_name, cpu_cores

    name = torch.cuda.get_device_name(0) if device_type == "cuda" else _cpu_name()
    backend = "nccl" if device_type == "cuda" else "gloo"
    return f"{name}|cores={cpu_cores()}|torch={torch.__version__}|{backend}|ranks={ranks}|probe={PROBE_VERSION}"


def cache_file() -> Path:
    from scaletrain.hardware import _cache_dir

    return _cache_dir() / "calibration.json"


def load(device_type: str, ranks: int) -> Calibration | None:
    """This machine's calibration for `ranks` ranks from the cache, or None if none is there."""
    from scaletrain.hardware import json_cache

    key = machine_key(device_type, ranks)
    with json_cache(cache_file()) as cache:
        entry = cache.get(key)
    if not isinstance(entry, dict) or "collectives" not in entry:
        return None
    return Calibration(key, ranks, {k: tuple(v) for k, v in entry["collectives"].items()}, entry["overlap"],
                       entry.get("compute", {}), entry.get("optimizer", {}), entry.get("engine", {}),
                       entry.get("pace", 0.0))


def _save(cal: Calibration) -> None:
    from scaletrain.hardware import json_cache

    with json_cache(cache_file()) as cache:
        cache[cal.machine] = {"collectives": {k: list(v) for k, v in cal.collectives.items()},
                              "overlap": cal.overlap, "compute": cal.compute, "optimizer": cal.optimizer,
                              "engine": cal.engine, "pace": cal.pace}


def missing(cal: Calibration | None, model_cfg, probes: list[dict], optimizers: list[tuple[str, str]]):
    """(the compute probes, the optimizer steps) that `cal` lacks of those asked for."""
    def have(p):
        if p.get("engine"):
            return probe_key(model_cfg, p) in cal.engine
        return cal.has(probe_key(model_cfg, p), p["micro_batch"])

    unique = list({(probe_key(model_cfg, p), p["micro_batch"]): p for p in probes}.values())
    return ([p for p in unique if cal is None or not have(p)],
            [o for o in optimizers if cal is None or "|".join(o) not in cal.optimizer])


def merge(cal: Calibration | None, got: dict, device_type: str, ranks: int, pace: float = 0.0) -> Calibration:
    """`cal` with what a calibration group measured (`calibrate_rank`'s output) added, saved. `pace`:
    the pace probe's seconds just before that group ran; figures measured at another pace than the
    cached ones are brought to theirs (seconds × cached pace / this pace)."""
    if cal is None:
        cal = Calibration(machine_key(device_type, ranks), ranks,
                          {k: tuple(v) for k, v in got["collectives"].items()}, got["overlap"], pace=pace)
    k = cal.pace / pace if cal.pace and pace else 1.0
    for key, by_size in got["compute"].items():
        cal.compute.setdefault(key, {}).update({mb: at_pace(v, k) for mb, v in by_size.items()})
    cal.optimizer.update({name: s * k for name, s in got["optimizer"].items()})
    cal.engine.update({key: at_pace(v, k) for key, v in got.get("engine", {}).items()})
    _save(cal)
    return cal


def at_pace(figures: dict[str, float], k: float) -> dict[str, float]:
    """A probe's seconds × `k` (a mixture's measured load, a ratio, and an engine probe's micro-batch
    as they are)."""
    return {name: v if name in ("imbalance", "micro_batch") else v * k for name, v in figures.items()}
