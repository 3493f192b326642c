"""`scaletrain bench techniques`: which technique buys speed and which buys memory, measured here.

    scaletrain bench techniques [--config FILE] [--nproc N] [--steps 5] [--warmup 2] [--skip NAME ...]
                                [--max-slowdown 10] [--png FILE] [--json]

Each technique is the baseline config with one change, run interleaved with the baseline
(`interleave.py`) and reported as a speed ratio (tokens/s) and a peak-memory ratio:

| name            | change                                              | usually buys                 |
|-----------------|-----------------------------------------------------|------------------------------|
| accum           | micro-batch /4 (or /2), ×4 accumulation, same batch | memory (activations)         |
| ac-full         | recompute whole blocks in backward                  | memory, for ~1/3 more compute|
| ac-selective    | recompute the element-wise ops only                 | some memory, little compute  |
| precision-MODE  | each other precision mode                           | speed and memory (on GPUs)   |
| batch           | twice the micro-batch and the global batch          | speed (fuller matmuls)       |
| optim-NAME      | each other optimizer                                | memory (optimizer state)     |
| workers         | 2 loader worker processes                           | speed, when loading stalls   |
| zero1..3        | ZeRO stage 1, 2, 3 (against DDP; 2+ ranks)          | memory, for communication    |
| compile         | torch.compile each block                            | speed, after a compile wait  |

A row is measured, or marked skipped (it cannot apply: ZeRO on one rank, a micro-batch of 1,
--skip; or its warmed-up step took over --max-slowdown times the baseline's, e.g. fp16 on a
CPU without fp16 matmul kernels) or failed (it was tried and raised: a mode the device lacks,
a missing package), with the reason. Nothing is estimated. With --nproc N every row runs on N ranks (the baseline is
then DDP) through scaletrain's launcher.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime
from pathlib import Path

from scaletrain.bench.interleave import Entry, Row, rows_table, run
from scaletrain.bench.step import bench_config, header, scratch_dir, trainer_entry
from scaletrain.errors import LaunchError, UserError
from scaletrain.launch.ranks import quiet, read_spec, run_on_ranks, write_result
from scaletrain.layout import Layout
from scaletrain.vocab import AC_MODES, OPTIMIZERS, PRECISIONS, ZERO_STAGES


def techniques(cfg, b: Layout, device_type: str) -> list[tuple[str, str, dict | None, Layout | None, str]]:
    """(key, row name, config values or None, its layout, skip reason or note) for each technique,
    in table order. `b` is the baseline's layout; a technique's layout is `b` with its change,
    and its config values are the same change (`{"parallel.zero": 3}`), so the two agree."""
    world = b.world
    out = []
    k = 4 if b.micro_batch % 4 == 0 else 2 if b.micro_batch % 2 == 0 else 0
    if k:  # the accumulation count is train.grad_accum's alone (not parallel.pp_microbatches)
        out.append(("accum", f"grad accumulation x{k * b.grad_accum} (micro-batch {b.micro_batch // k})",
                    {"train.global_batch": b.global_batch, "train.micro_batch": b.micro_batch // k,
                     "train.grad_accum": b.grad_accum * k, "parallel.pp_microbatches": 0},
                    replace(b, micro_batch=b.micro_batch // k, grad_accum=b.grad_accum * k), ""))
    else:
        out.append(("accum", "grad accumulation", None, None, f"the micro-batch of {b.micro_batch} cannot be split"))
    for ac in AC_MODES:
        if ac != cfg.memory.activation_checkpointing:
            out.append((f"ac-{ac}", f"activation checkpointing {ac}", {"memory.activation_checkpointing": ac},
                        replace(b, activation_checkpointing=ac), ""))
    for mode in PRECISIONS:
        if mode == "fp8" and device_type != "cuda" and cfg.precision.mode != "fp8":  # emulated fp8 is no speed
            out.append(("precision-fp8", "precision fp8", None, None, "needs a CUDA GPU with fp8 matmuls (sm89+)"))
        elif mode != cfg.precision.mode:
            note = "TF32 is a CUDA matmul mode: on CPU the matmuls stay fp32" \
                if mode == "tf32" and device_type != "cuda" else ""
            out.append((f"precision-{mode}", f"precision {mode}", {"precision.mode": mode}, b, note))
    out.append(("batch", f"larger batch x2 (micro-batch {2 * b.micro_batch})",
                {"train.global_batch": 2 * b.global_batch, "train.micro_batch": 2 * b.micro_batch,
                 "train.grad_accum": b.grad_accum, "parallel.pp_microbatches": 0},
                replace(b, micro_batch=2 * b.micro_batch), ""))
    for name in OPTIMIZERS:
        if name != cfg.optim.name:
            extra = {"optim.implementation": "auto"} if name == "adamw8bit" else {}
            out.append((f"optim-{name}", f"optimizer {name}", {"optim.name": name, **extra}, b, ""))
    workers = 2 if cfg.data.num_workers == 0 else 0
    out.append(("workers", f"loader workers {workers}", {"data.num_workers": workers}, b,
                "memory of worker processes not counted" if workers else ""))
    for z in ZERO_STAGES:
        if z == cfg.parallel.zero:
            continue
        if world < 2:
            out.append((f"zero{z}", f"ZeRO stage {z}", None, None,
                        "needs --nproc >= 2 (it shards over data-parallel ranks)"))
        else:
            out.append((f"zero{z}", f"ZeRO stage {z}" if z else "DDP (ZeRO stage 0)", {"parallel.zero": z},
                        replace(b, zero=z), ""))
    compiled = cfg.train.compile
    out.append(("compile", "no compile" if compiled else "compile", {"train.compile": not compiled}, b,
                "" if compiled else "torch.compile per block; the compile itself is in the warm-up"))
    return out


def variant_config(base, values: dict, run_dir: str, steps_needed: int):
    """A technique's config: the baseline's (a bench_config) with `values` ({"section.key":
    value}, Python values), ours again on top. (Not for a change of model.preset or
    model.from_hf, which fill the model only where a file leaves it: see bench_config.)"""
    cfg = base.replace(**{**values, **quiet(run_dir)})
    if cfg.train.steps < steps_needed:  # the loader serves train.steps steps
        cfg = cfg.replace(**{"train.steps": steps_needed})
    return cfg


def _check_skip(base, skip: list[str], device_type: str) -> None:
    known = [t[0] for t in techniques(base, Layout(dp_shard=2), device_type)]  # the names: the same in any layout
    unknown = [s for s in skip if s not in known]
    if unknown:
        raise UserError(f"--skip {' '.join(unknown)}: unknown technique(s); known here: {', '.join(known)}")


def _measure(config_name: str | None, base, *, steps, warmup, skip, max_slowdown, runtime=None,
             progress=None) -> dict:
    """Every rank calls this (or the one process) with the baseline's config (a bench_config) and
    the runtime of its layout (None: one process); returns the result dict."""
    from scaletrain.model.transformer import count_params
    from scaletrain.runtime import single_process

    with scratch_dir() as (tmp, sink):
        need = warmup + steps + 2
        base = variant_config(base, {}, str(Path(tmp) / "base"), need)
        rt = runtime or single_process(base)  # the baseline's layout, derived once
        device, world, batch = rt.device, rt.world_size, rt.layout
        _check_skip(base, skip, device.type)
        entries = [trainer_entry("baseline" if world == 1 or base.parallel.zero else "baseline (DDP)", base, sink,
                                 rt)]
        for key, name, values, layout, text in techniques(base, batch, device.type):
            if key in skip:
                entries.append(Entry(name, None, "left out (--skip)"))
            elif values is None:
                entries.append(Entry(name, None, text))
            else:
                try:
                    cfg = variant_config(base, values, str(Path(tmp) / key), need)
                except UserError as e:
                    entries.append(Entry(name, None, "; ".join(e.lines)))
                    continue
                entries.append(trainer_entry(name, cfg, sink, rt.with_layout(layout), note=text))
        rows = run(entries, steps=steps, warmup=warmup, device=device, tolerate_failures=True,
                   max_slowdown=max_slowdown, progress=progress)
    return {"config": config_name or "(built-in default)", "device": str(device), "world_size": world,
            "precision": base.precision.mode, "compile": base.train.compile, "global_batch": batch.global_batch,
            "micro_batch": batch.micro_batch, "grad_accum": batch.grad_accum, "seq_len": base.data.seq_len,
            "params": count_params(base.model), "steps": steps, "warmup": warmup,
            "rows": [r.to_dict() for r in rows]}


def bench_techniques(config: str | None, overrides: list[str], *, nproc: int | None = None, steps: int = 5,
                     warmup: int = 2, skip: list[str] = (), max_slowdown: float | None = 10.0,
                     progress=None) -> dict:
    """Measure every technique against the baseline, on one process or `nproc` ranks."""
    nproc = nproc or 1
    if nproc < 1:
        raise LaunchError(f"--nproc must be at least 1, got {nproc}")
    with scratch_dir() as (tmp, _):  # the baseline, read once, here (run folders are the ranks' own)
        base = bench_config(config, overrides, {}, tmp, 1)
    if nproc == 1:
        return _measure(config, base, steps=steps, warmup=warmup, skip=list(skip), max_slowdown=max_slowdown,
                        progress=progress)
    from scaletrain.runtime import pick_device

    _check_skip(base, list(skip), pick_device(base.train.device, 0, nproc).type)  # before starting the ranks
    return run_on_ranks("bench-techniques", {"config_name": config, "config": base.to_dict(), "steps": steps,
                                             "warmup": warmup, "skip": list(skip), "max_slowdown": max_slowdown},
                        nproc)


def bench_rank(spec_path: str, out_path: str) -> int:
    """One rank of bench_techniques (the `bench-techniques` task of scaletrain.launch.worker): SPEC_PATH
    is a JSON file of the baseline's config (read once, where the job started) and the settings."""
    from scaletrain.config import from_dict
    from scaletrain.runtime import prepare_worker

    spec = read_spec(spec_path)
    base, runtime = prepare_worker(from_dict(spec["config"]))  # the group's mesh: the baseline's layout
    result = _measure(spec["config_name"], base, steps=spec["steps"], warmup=spec["warmup"],
                      skip=spec["skip"], max_slowdown=spec["max_slowdown"], runtime=runtime)
    if runtime.rank == 0:
        write_result(out_path, result)
    return 0


def report(result: dict) -> str:
    rows = [Row(**r) for r in result["rows"]]
    ranks = f" on {result['world_size']} ranks" if result["world_size"] > 1 else ""
    return header(result, "techniques" + ranks) + "\n" + rows_table(rows)


def default_png() -> str:
    return str(Path("runs") / f"bench-techniques-{datetime.now():%Y%m%d-%H%M%S}.png")


def _ratio_label(x: float, _pos=None) -> str:
    return f"{x:g}x" if x >= 1 else f"1/{1 / x:g}"


def chart(result: dict, path: str) -> str:
    """Speed and peak-memory ratios side by side, one bar per technique, to a PNG. Returns the
    line to print: where it went, or why there is no chart."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        return "chart skipped: matplotlib is not installed (pip install 'scaletrain[plot]')"
    rows = result["rows"][1:]
    names = [r["name"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(11, 0.32 * len(rows) + 1.6), sharey=True)
    for ax, key, title, good in ((axes[0], "speed", "speed (tokens/s) vs baseline", "#54a24b"),
                                 (axes[1], "memory", "peak memory vs baseline", "#4c78a8")):
        for y, r in enumerate(rows):
            if r["status"] != "measured":
                ax.text(1.0, y, f" {r['status']}", va="center", ha="left", fontsize=8, color="#888888")
                continue
            v = r[key]
            better = v > 1 if key == "speed" else v < 1
            ax.barh(y, v - 1.0, left=1.0, color=good if better else "#e45756", height=0.6)
            ax.text(v, y, f" {v:.2f}x ", va="center", ha="left" if v >= 1 else "right", fontsize=8)
        ax.axvline(1.0, color="black", linewidth=0.8)
        ax.set_title(title, fontsize=10)
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(_ratio_label))
        ax.margins(x=0.25)
    axes[0].set_yticks(range(len(rows)), names, fontsize=8)
    axes[0].invert_yaxis()
    ranks = f", {result['world_size']} ranks" if result["world_size"] > 1 else ""
    fig.suptitle(f"scaletrain bench techniques: {result['config']} on {result['device']}{ranks} "
                 f"({result['precision']}, batch {result['global_batch']} x {result['seq_len']})", fontsize=10)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"wrote {path}"

