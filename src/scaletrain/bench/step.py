"""`scaletrain bench step`: one config's training step, measured, with variants beside it.

    scaletrain bench step --config FILE [--section.key=value ...] [--vs KEY=VALUE ...] [--vs-plain-loop]

The baseline is the config (with any overrides); each `--vs` is a variant of it (one or more
settings joined by commas: `--vs train.compile=true,precision.mode=bf16-mixed`), and
`--vs-plain-loop` adds the minimal hand-written PyTorch loop of the same model (`plain.py`).
All run in this one process, interleaved (`interleave.py`): after the warm-up, each round
takes one step of each. Reported: median step time, tokens/s, MFU, peak memory, and each
variant's speed (tokens/s) and peak memory as ratios to the baseline.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

from scaletrain.bench.interleave import Entry, Row, rows_table, run, trainer_runner
from scaletrain.errors import ConfigError, UserError
from scaletrain.launch.ranks import quiet


def parse_variant(text: str) -> dict[str, str]:
    """`section.key=value`, several joined by commas (a comma inside a value stays in it)."""
    out = {}
    for part in re.split(r",(?=\s*(?:--)?[A-Za-z_]\w*\.[A-Za-z_]\w*=)", text):
        key, eq, value = part.strip().removeprefix("--").partition("=")
        if not eq or "." not in key or not value:
            raise UserError(f"--vs {text!r}: a variant is section.key=value, several joined by commas "
                            "(e.g. --vs train.compile=true,precision.mode=bf16-mixed)")
        out[key] = value
    return out


def bench_config(config: str | None, overrides: list[str] | dict, variant: dict, run_dir: str, steps_needed: int):
    """The config a benchmark runs: the file, the user's overrides, the variant, and ours."""
    from scaletrain.config import load_config, parse_override_args

    if isinstance(overrides, dict):
        base = overrides
    else:
        base, errors = parse_override_args(overrides)
        if errors:
            raise ConfigError(*errors)
    cfg = load_config(config, {**base, **variant, **quiet(run_dir)})
    if cfg.parallel.layout == "auto":
        raise ConfigError("parallel.layout=auto: a benchmark measures one fixed layout; set parallel.layout=manual "
                          "and the layout `scaletrain plan` chose")
    if cfg.train.steps < steps_needed:  # the loader serves train.steps steps
        cfg = cfg.replace(**{"train.steps": steps_needed})
    return cfg


@contextmanager
def scratch_dir():
    """A folder for the runs' files (nothing is kept), and a sink for their log lines."""
    path = tempfile.mkdtemp(prefix="scaletrain-bench-")
    sink = open(os.devnull, "w")
    try:
        yield path, sink
    finally:
        sink.close()
        shutil.rmtree(path, ignore_errors=True)


def trainer_entry(name: str, cfg, sink, runtime=None, note: str = "") -> Entry:
    def make():
        from scaletrain.train.trainer import Trainer

        return trainer_runner(Trainer(cfg, runtime, stream=sink))

    return Entry(name, make, note=note)


def plain_entry(cfg, batch) -> Entry:
    """The hand-written loop on the baseline's model, batch (`batch`: its Layout) and precision."""
    from scaletrain.bench.plain import PLAIN_MODES

    if batch.grad_accum != 1:
        raise UserError(f"--vs-plain-loop compares single micro-batch steps; the config accumulates {batch.grad_accum} "
                        "micro-batches (set train.micro_batch equal to train.global_batch)")
    if cfg.precision.mode not in PLAIN_MODES:
        raise UserError(f"--vs-plain-loop runs precision.mode {', '.join(PLAIN_MODES)} (the hand-written loop has no "
                        f"loss scaling or master weights), not {cfg.precision.mode}")

    def make():
        import torch

        from scaletrain.bench.interleave import Runner
        from scaletrain.bench.plain import PlainLoop
        from scaletrain.data.dataset import open_data
        from scaletrain.hardware import device_peak_flops
        from scaletrain.model.flops import flops_per_token
        from scaletrain.precision import COMPUTE_DTYPES
        from scaletrain.runtime import pick_device

        device = pick_device(cfg.train.device)
        data = open_data(cfg.data.path, cfg.data.verify_checksums)
        loop = PlainLoop(cfg, torch.from_numpy(data.read(0, data.num_tokens)), device, batch.micro_batch)
        peak, _ = device_peak_flops(device, COMPUTE_DTYPES[cfg.precision.mode], tf32=cfg.precision.mode == "tf32")
        return Runner(loop.step, batch.micro_batch * cfg.data.seq_len,
                      flops_per_token(cfg.model, cfg.data.seq_len), peak, 1, loop.enter)

    return Entry("hand-written loop", make, note="minimal PyTorch loop: same model class, AdamW, autocast"
                 + (", torch.compile of the whole model" if cfg.train.compile else ""))


def bench_step(config: str | None, overrides: list[str], vs: list[str], *, steps: int = 10, warmup: int = 3,
               plain_loop: bool = False, progress=None) -> dict:
    """Measure the config and its variants, interleaved; returns the header facts and the rows.
    Each config's layout is derived once: the baseline's here, a variant's by its trainer."""
    from scaletrain.model.transformer import count_params
    from scaletrain.runtime import single_process

    variants = [(text, parse_variant(text)) for text in vs]
    with scratch_dir() as (tmp, sink):
        need = warmup + steps + 2
        base = bench_config(config, overrides, {}, str(Path(tmp) / "0"), need)
        cfgs, errors = [], []
        for i, (text, v) in enumerate(variants):  # every bad key or value, before anything runs
            try:
                # from the file again: a --vs of model.preset or model.from_hf must fill the model
                cfgs.append(bench_config(config, overrides, v, str(Path(tmp) / str(i + 1)), need))
            except ConfigError as e:
                errors += [f"--vs {text}: {line}" for line in e.lines]
        if errors:
            raise ConfigError(*errors)
        rt = single_process(base)
        batch, device = rt.layout, rt.device
        entries = [trainer_entry("baseline", base, sink, rt)]
        entries += [trainer_entry(text, cfg, sink) for (text, _), cfg in zip(variants, cfgs)]
        if plain_loop:
            entries.append(plain_entry(base, batch))
        rows = run(entries, steps=steps, warmup=warmup, device=device, progress=progress)
    return {"config": config or "(built-in default)", "device": str(device), "precision": base.precision.mode,
            "compile": base.train.compile, "global_batch": batch.global_batch, "micro_batch": batch.micro_batch,
            "grad_accum": batch.grad_accum, "seq_len": base.data.seq_len, "params": count_params(base.model),
            "steps": steps, "warmup": warmup, "rows": [r.to_dict() for r in rows]}


def header(result: dict, what: str) -> str:
    return (f"bench {what}: {result['config']} on {result['device']}, {result['precision']}"
            f"{', compiled' if result['compile'] else ''}, {result['params'] / 1e6:.2f}M params, batch "
            f"{result['global_batch']} x {result['seq_len']} tokens (micro-batch {result['micro_batch']} x "
            f"{result['grad_accum']}); median of {result['steps']} steps each after {result['warmup']} warm-up, "
            "interleaved; ratios to the baseline")


def report(result: dict) -> str:
    rows = [Row(**r) for r in result["rows"]]
    return header(result, "step") + "\n" + rows_table(rows)


def progress_line(text: str) -> None:
    print(f"scaletrain bench: {text}", file=sys.stderr, flush=True)
