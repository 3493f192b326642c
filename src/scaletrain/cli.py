"""`scaletrain VERB ...`: one thin sub-command per verb, each a call into the library.

A user error (bad config, data, checkpoint or launch request) prints one line per problem
and exits with code 2; there is no traceback for those.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from typing import Sequence

from scaletrain.errors import UserError, config_paths, os_errors_named, user_error_from_os
from scaletrain.vocab import QUANT_SCHEMES, did_you_mean

PROG = "scaletrain"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2, like our other user errors
        where = f"{self.prog}: " if self.prog != PROG else ""  # a verb's parser names its verb
        raise UserError(f"{where}{message} (see {self.prog} --help)")

    def _check_value(self, action, value):
        """A value outside an option's choices (or an unknown verb): the closest one named."""
        if action.choices is None or value in action.choices:
            return super()._check_value(action, value)
        choices = [str(c) for c in action.choices]
        if isinstance(action, argparse._SubParsersAction):
            raise argparse.ArgumentError(None, f"invalid choice: {value!r} is not a command"
                                               f"{did_you_mean(value, choices)}; choose from {', '.join(choices)}")
        raise argparse.ArgumentError(action, f"invalid choice: {value!r}{did_you_mean(str(value), choices)}; "
                                             f"choose from {', '.join(choices)}")


class _Done(Exception):
    """An option that answered and ends the command (--version), exit 0."""


class _Version(argparse.Action):
    def __init__(self, option_strings, dest, **kw):
        super().__init__(option_strings, dest, nargs=0, help="print scaletrain's version (and torch's) and exit")

    def __call__(self, parser, namespace, values, option_string=None):
        from importlib import metadata

        from scaletrain import __version__

        try:
            torch_version = metadata.version("torch")  # without importing torch
        except metadata.PackageNotFoundError:
            torch_version = "not installed"
        print(f"scaletrain {__version__} (torch {torch_version}, python {sys.version.split()[0]})")
        raise _Done()


def _train(args: argparse.Namespace, extra: list[str]) -> int:
    from scaletrain.config import describe_options

    if args.help_config:
        print(describe_options())
        return 0
    cfg, note = _train_config(args.config, extra)
    if args.print_config:
        print(cfg.to_toml() if args.print_config == "toml" else cfg.to_json())
        return 0
    from scaletrain.runtime import is_worker

    if is_worker():  # started by torchrun (our launcher starts scaletrain.worker itself)
        from scaletrain import worker
        from scaletrain.train import job

        worker.run(job.train, cfg)  # does not return
    with os_errors_named(config_paths(cfg)):
        if args.nproc is None:
            from scaletrain.plan.auto import resolve
            from scaletrain.runtime import pick_device, single_process
            from scaletrain.train.job import exit_code
            from scaletrain.train.trainer import Trainer

            cfg, layout = resolve(cfg, 1, pick_device(cfg.train.device), note=_note, measure=_measure_module())
            if cfg.train.compile:
                _check_compiler(cfg.train.device, 1)
            trainer = Trainer(cfg, single_process(cfg, layout))  # checked: the resume included
            if note:
                _note(note)
            return exit_code(trainer.fit())
        return _launch(args, cfg, note)


def _train_config(config: str | None, extra: list[str]):
    """(the config `train` runs, a line that says where it came from or None). --config FILE
    (TOML, or a run's config.json); without it, when the options resume a run
    (checkpoint.resume=auto with its log.run_dir, or a checkpoint folder), that run's own saved
    config; else the demo (configs/tiny.toml). The command line's options go on top and are
    checked, by the config and, on resuming, against the checkpoint."""
    from scaletrain.config import DEMO_CONFIG, from_dict, load_config, parse_override_args

    if config:
        return load_config(config, extra), None
    from scaletrain.train.run_folder import saved_config

    saved = saved_config(parse_override_args(extra)[0])
    if saved is None:
        return load_config(DEMO_CONFIG, extra), None
    raw, source = saved
    cfg = from_dict(raw, overrides=extra, source=source)
    before = from_dict(raw, source=source).to_dict()
    changed = [f"{s}.{k}={v}" for s, values in cfg.to_dict().items() for k, v in values.items()
               if before[s][k] != v]
    return cfg, f"config: the run's own ({source}){', with ' + ', '.join(changed) if changed else ''}"


def _check_compiler(device_name: str, ranks: int) -> None:
    """torch.compile's C++ compiler, checked before anything is built or written."""
    from scaletrain.runtime import pick_device
    from scaletrain.parallel.parallelize import check_compiler

    check_compiler(pick_device(device_name, 0, ranks))


def _note(line: str) -> None:
    """A line about a choice made for the user (parallel.layout=auto's), on stderr."""
    print(f"scaletrain: {line}", file=sys.stderr)


def _launch(args: argparse.Namespace, cfg, note: str | None = None) -> int:
    """Check the whole request here, once, settle the config and its layout (`auto` chosen),
    and start the workers, each handed both (scaletrain.train.job)."""
    from scaletrain import launcher
    from scaletrain.plan.auto import resolve
    from scaletrain.runtime import pick_device
    from scaletrain.train import job
    from scaletrain.train.trainer import default_run_dir

    from scaletrain.errors import LaunchError

    for flag, value in (("--nproc", args.nproc), ("--nnodes", args.nnodes)):
        if value < 1:  # before any arithmetic on the world size
            raise LaunchError(f"{flag} must be at least 1, got {value}")
    world = args.nproc * args.nnodes
    device = pick_device(cfg.train.device, 0, args.nproc)
    if cfg.train.compile:  # every rank would fail the same way: say it once, here
        _check_compiler(cfg.train.device, args.nproc)
    cfg, layout = resolve(cfg, world, device, gpus_per_node=args.nproc, note=_note,
                          measure=_measure_module() if args.nnodes == 1 else None)
    layout.check(cfg.model, seq_len=cfg.data.seq_len)
    _check_resume_sync(cfg, layout)
    if not cfg.log.run_dir:  # every rank (and node) must write to the same folder
        cfg = cfg.replace(**{"log.run_dir": default_run_dir()})
    run_dir = cfg.log.run_dir
    _check_writable({"log.run_dir": run_dir, "checkpoint.dir": cfg.checkpoint.dir})
    if note:
        _note(note)
    if device.type == "cpu":  # said once the request is known to be valid, as the ranks start
        from scaletrain.hardware import cpu_cores

        if args.nproc > (cores := cpu_cores()):
            _note(f"{args.nproc} ranks on {cores} CPU core(s): oversubscribed, the ranks take turns on the cores "
                  f"and each step is slower than with --nproc {cores}")
    with launcher.spec_file(job.spec(cfg, layout), prefix="scaletrain-train-") as spec:
        return launcher.launch("train", [spec], nproc=args.nproc, nnodes=args.nnodes, node_rank=args.node_rank,
                               rdzv_endpoint=args.rdzv_endpoint or "", rdzv_id=args.rdzv_id,
                               max_restarts=args.max_restarts,
                               checkpoint_dir=cfg.checkpoint.dir or os.path.join(run_dir, "checkpoints"))


def _check_resume_sync(cfg, layout) -> None:
    """A checkpoint of another parallel.dp_sync, or of another number of workers, is refused here,
    in one line, before any rank starts (the ranks check it again)."""
    from pathlib import Path

    from scaletrain.errors import CheckpointError
    from scaletrain.train import checkpoint as ckpt

    res = cfg.checkpoint.resume
    if res == "none":
        return
    if res == "auto":
        folder = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else Path(cfg.log.run_dir) / "checkpoints"
        path = ckpt.latest_checkpoint(folder)
        if path is None:
            return
    else:
        path = Path(res)
    try:
        state = ckpt.read_trainer_state(path)
    except CheckpointError:
        return  # the ranks report it (or, with auto, fall back to an older checkpoint, naming this one)
    ckpt.check_sync(path, state, layout)


def _check_writable(paths: dict[str, str]) -> None:
    """Refuse a folder on a read-only or full disk, or one we may not write to, before any rank
    starts: on this node they would all fail on it, in a line each."""
    import errno

    for option, path in paths.items():
        if not path:
            continue
        folder = os.path.abspath(path)
        while not os.path.exists(folder) and os.path.dirname(folder) != folder:
            folder = os.path.dirname(folder)  # the folder it will be created in
        if not os.path.isdir(folder):
            continue  # the trainer names a file in the way
        disk = os.statvfs(folder)
        code = (errno.EROFS if disk.f_flag & os.ST_RDONLY else errno.EACCES if not os.access(folder, os.W_OK)
                else errno.ENOSPC if disk.f_blocks and (disk.f_bfree if os.geteuid() == 0 else disk.f_bavail) == 0
                else None)
        if code is not None:
            raise user_error_from_os(OSError(code, os.strerror(code), folder), {option: path})


def _prepare(args: argparse.Namespace, extra: list[str]) -> int:
    from scaletrain.data.prepare import prepare

    with os_errors_named({"--out": args.out}):
        meta = prepare(args.inputs, args.out, tokenizer=args.tokenizer, vocab_size=args.vocab_size,
                       tokenizer_file=args.tokenizer_file, text_key=args.text_key, shard_tokens=args.shard_tokens,
                       val_fraction=args.val_fraction, workers=args.workers,
                       progress=None if args.quiet else sys.stderr)
    model_vocab = meta["tokenizer"].get("model_vocab_size")
    padded = f", {model_vocab} in the model" if model_vocab else ""
    print(f"wrote {meta['num_tokens']:,} tokens ({meta['dtype']}, {len(meta['shards'])} shard(s), "
          f"{meta['num_documents']:,} documents, vocabulary {meta['tokenizer']['vocab_size']}{padded}) to {args.out}")
    if "val_shards" in meta:
        print(f"validation split: {meta['num_val_tokens']:,} tokens, {meta['num_val_documents']:,} documents "
              f"({len(meta['val_shards'])} shard(s), --val-fraction {meta['val_fraction']:g} by document)")
    return 0


def _checkpoint_of(path: str) -> str:
    """A checkpoint folder, or a run folder's newest complete checkpoint (said on stderr); a
    folder written by `scaletrain quantize` as it is."""
    from scaletrain.quant.ptq import is_quantized_folder
    from scaletrain.train.checkpoint import checkpoint_of

    if is_quantized_folder(path):
        return path

    return str(checkpoint_of(path, report=_note))


def _eval(args: argparse.Namespace, extra: list[str]) -> int:
    import json

    from scaletrain.train.evaluate import evaluate_checkpoint

    with os_errors_named({"checkpoint": args.checkpoint, "data.path": args.data or ""}):
        r = evaluate_checkpoint(_checkpoint_of(args.checkpoint), args.data, args.batches, args.device)
    if args.json:
        print(json.dumps(r, indent=1))
    else:
        scheme = f"  [quantized: {r['quantized']}]" if r.get("quantized") else ""
        print(f"val_loss {r['val_loss']:.4f}  val_ppl {r['val_ppl']:.2f}{scheme}  ({r['data']}, {r['split']}: "
              f"{r['batches']} batch(es) = {r['windows']:,} windows, {r['tokens']:,} tokens; step {r['step']})")
        for name, loss in r.get("sources", {}).items():
            print(f"  {name}: val_loss {loss:.4f}")
    return 0


def _generate(args: argparse.Namespace, extra: list[str]) -> int:
    from scaletrain.train.sample import generate_text

    with os_errors_named({"source": args.source, "--data": args.data or ""}):
        text = generate_text(args.source, args.prompt, max_new_tokens=args.max_new_tokens,
                             temperature=args.temperature, top_k=args.top_k, seed=args.seed, data=args.data,
                             device=args.device)
    print(text)
    return 0


def _plot(args: argparse.Namespace, extra: list[str]) -> int:
    from scaletrain.train.plot import plot_runs

    _check_png("--out", args.out)
    with os_errors_named({"--out": args.out}):
        summary = plot_runs(args.runs, args.out)
    print(f"wrote {args.out} ({', '.join(summary['runs'])})")
    return 0


def _export(args: argparse.Namespace, extra: list[str]) -> int:
    from scaletrain.train.export import export_safetensors
    from scaletrain.train.export_hf import export_hf

    with os_errors_named({"--out": args.out, "checkpoint": args.checkpoint}):
        checkpoint = _checkpoint_of(args.checkpoint)
        out = export_hf(checkpoint, args.out, overwrite=args.overwrite) if args.format == "hf" else \
            export_safetensors(checkpoint, args.out, overwrite=args.overwrite)
    print(f"wrote {out}")
    return 0


def _quantize(args: argparse.Namespace, extra: list[str]) -> int:
    from scaletrain.train.quantize import quantize_source

    with os_errors_named({"--out": args.out, "source": args.source}):
        source = args.source if os.path.isfile(args.source) else _checkpoint_of(args.source)
        out = quantize_source(source, args.scheme, args.out, overwrite=args.overwrite, report=print)
    from scaletrain.quant.ptq import folder_bytes

    print(f"wrote {out} ({folder_bytes(out) / 2**20:.2f} MiB)")
    return 0


def _schedule(args: argparse.Namespace, extra: list[str]) -> int:
    from scaletrain.plan import timeline

    timeline.check(args.schedule, args.pp, args.microbatches, args.virtual)
    _check_png("--png", args.png)
    placed = timeline.simulate(args.schedule, args.pp, args.microbatches, args.virtual)
    print(timeline.render_text(args.schedule, args.pp, args.microbatches, args.virtual, placed))
    if args.png:
        timeline.render_png(args.schedule, args.pp, args.microbatches, args.virtual, placed, args.png)
        print(f"wrote {args.png}")
    return 0


def _at_least_1(name: str):
    """argparse type of a count given by one of plan's short flags: an integer of at least 1
    (the config's own names keep its meanings: train.micro_batch=0 derives, parallel.dp_shard=-1
    takes the remaining ranks)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"layout sizes must be at least 1, got {name}={value}" if " " not in name
                                             else f"{name} must be at least 1, got {value}")
        return value
    return parse


def _alias_dest(flag: str) -> str:
    return flag[2:].replace("-", "_")


def _plan(args: argparse.Namespace, extra: list[str]) -> int:
    from scaletrain.plan import plan, report
    from scaletrain.plan.options import ALIASES, read_request

    _check_png("--chart", args.chart)
    hardware, nodes, per_node = args.hardware, args.nodes, args.gpus_per_node
    here = args.measure or args.calibrate
    if here:  # plan for the devices at hand, where the step will run
        nodes, per_node = 1, args.nproc or 1
    aliases = {flag: getattr(args, _alias_dest(flag)) for flag in ALIASES}
    req = read_request(args.model, args.config, aliases, extra, world=nodes * per_node)
    if here:
        from scaletrain.runtime import pick_device
        from scaletrain.hardware import local_hardware

        hardware = local_hardware(pick_device(req.cfg.train.device))
    if args.measure and (args.engine or "scaletrain") != "scaletrain":
        raise UserError(f"--measure runs scaletrain's trainer; it cannot measure a plan for --engine {args.engine}")
    comms_note = None
    if args.comms:  # the bus bandwidth measured by `scaletrain bench comms --json`, inside a node
        from dataclasses import replace

        from scaletrain.bench.comms import read_bus_bandwidth
        from scaletrain.hardware import Hardware, lookup

        bus, comms_note = read_bus_bandwidth(args.comms)
        hw = hardware if isinstance(hardware, Hardware) else lookup(hardware, args.hardware_file)
        hardware = replace(hw, bus_GBps=bus)
    result = plan(req.model, hardware=hardware, hardware_file=args.hardware_file, nodes=nodes,
                  gpus_per_node=per_node, attention=args.attention, layout=req.layout,
                  top_k=10 if args.top is None else args.top, activations=args.activations, engine=args.engine, compile=args.compile,
                  fp8=args.fp8, workers=args.workers, workers_link=args.workers_link, sync=req.sync,
                  calibrate=_calibration_here() if here else None, **req.workload)
    if args.json:
        print(report.to_json(result))
    else:
        print(report.table(result))
        print()
        print(report.breakdown(result["layouts"][0]))
        print()
        print("\n".join(result["explanation"]))
        if comms_note:
            print(f"Collectives inside a node: {comms_note}.")
    if args.chart:
        report.chart(result, args.chart)
        if not args.json:
            print(f"wrote {args.chart}")
    if args.measure:
        from scaletrain.measure import measure_and_print

        if not args.config:
            raise UserError("--measure runs a real step and needs a training config: --config FILE")
        if args.top is not None and args.top > 1:  # the K best, re-ranked by what they measure
            from scaletrain.measure import measure_top

            candidates = [ev for ev in result["layouts"] if ev.fits][:args.top]
            if not candidates:
                raise UserError("plan --measure --top: no layout fits, so none is measured")
            measure_top(args.config, candidates, nproc=args.nproc or 1, overrides=req.overrides)
            return 0
        code = measure_and_print(args.config, result["layouts"][0].layout, nproc=args.nproc or 1,
                                 overrides=req.overrides)
        return code or (0 if result["layouts"][0].fits else 1)
    return 0 if result["layouts"][0].fits else 1


def _measure_module():
    """What parallel.auto_measure_s measures with, from a process that may start others."""
    from scaletrain import measure

    return measure


def _calibration_here():
    """The planner's `calibrate`: this machine's calibration, measured where missing (said on stderr)."""
    import functools

    from scaletrain.measure import calibration

    return functools.partial(calibration, note=lambda line: print(line, file=sys.stderr))


def _verify(args: argparse.Namespace, extra: list[str]) -> int:
    from scaletrain.verify import verify

    return verify(args.config, extra, steps=args.steps, nproc=args.nproc, device_memory_gib=args.device_memory)


def _bench_comms(args: argparse.Namespace, extra: list[str]) -> int:
    import json

    from scaletrain.bench import comms

    result = comms.run(nproc=args.nproc, sizes=args.sizes, iters=args.iters, warmup=args.warmup, device=args.device)
    print(json.dumps(result, indent=1) if args.json else comms.table(result))
    return 0


def _bench_step(args: argparse.Namespace, extra: list[str]) -> int:
    import json

    from scaletrain.bench import step

    result = step.bench_step(args.config, extra, args.vs, steps=args.steps, warmup=args.warmup,
                             plain_loop=args.vs_plain_loop, progress=_bench_progress())
    print(json.dumps(result, indent=1) if args.json else step.report(result))
    return 0


def _bench_techniques(args: argparse.Namespace, extra: list[str]) -> int:
    import json

    from scaletrain.bench import techniques

    result = techniques.bench_techniques(args.config, extra, nproc=args.nproc, steps=args.steps, warmup=args.warmup,
                                         skip=args.skip, max_slowdown=args.max_slowdown or None,
                                         progress=_bench_progress())
    print(json.dumps(result, indent=1) if args.json else techniques.report(result))
    if args.png != "":
        line = techniques.chart(result, args.png or techniques.default_png())
        print(line, file=sys.stderr if args.json else sys.stdout)
    return 0


def _bench_progress():
    from scaletrain.bench.step import progress_line

    return progress_line if sys.stderr.isatty() else None


def _leftovers(parser: argparse.ArgumentParser, extra: list[str], takes_overrides: bool) -> list[str]:
    """What argparse left of the command line: for a command that takes config options, those
    (`--section.key=value`, checked by the config); anything else is an error, one line each,
    naming the closest of the command's own options (and of the config's keys)."""
    from scaletrain.config import SECTIONS
    from dataclasses import fields

    import difflib

    flags = [s for action in parser._actions for s in action.option_strings if s.startswith("--") and s != "--help"]
    keys = [f"--{name}.{f.name}" for name, cls in SECTIONS.items() for f in fields(cls)] if takes_overrides else []
    errors, kept, i = [], [], 0
    while i < len(extra):
        arg = extra[i]
        i += 1
        name = arg.split("=", 1)[0]
        if takes_overrides and (not arg.startswith("-") or (name.startswith("--") and "." in name)):
            kept.append(arg)  # a config option, its value, or a stray word the config reports
            if "=" not in arg and arg.startswith("--") and i < len(extra) and not extra[i].startswith("--"):
                kept.append(extra[i])
                i += 1
            continue
        if arg.startswith("-"):
            if "=" not in arg and i < len(extra) and not extra[i].startswith("-"):
                i += 1  # the unknown option's value goes with it
            closest = difflib.get_close_matches(name, flags + keys, n=1, cutoff=0.6)
            if not takes_overrides:
                errors.append(f"unexpected arguments: {arg}{did_you_mean(name, flags)}; {parser.prog} takes no such "
                              f"option (see {parser.prog} --help)")
            elif closest and closest[0] in flags:
                errors.append(f"unexpected argument {arg!r}{did_you_mean(name, flags)}; see {parser.prog} --help")
            else:  # a config key is closest, or none is
                errors.append(f"unexpected argument {arg!r}{did_you_mean(name, keys)}; options look like "
                              f"--section.key=value (sections: {', '.join(SECTIONS)}); see {parser.prog} --help")
        else:
            errors.append(f"unexpected arguments: {arg}; {parser.prog} takes no such argument "
                          f"(see {parser.prog} --help)")
    if errors:
        raise UserError(*errors)
    return kept


def _check_png(flag: str, path: str | None) -> None:
    """Refuse an image path that cannot be written before any work is done."""
    if not path:
        return
    folder = os.path.dirname(path) or "."
    if not path.lower().endswith(".png"):
        raise UserError(f"{flag} {path}: give a file name ending in .png")
    if not os.path.isdir(folder):
        raise UserError(f"{flag} {path}: the folder {folder} does not exist; create it or choose another path")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="Train models too big or too slow for one GPU.")
    parser.add_argument("--version", action=_Version)
    sub = parser.add_subparsers(dest="verb", required=True, parser_class=_Parser)

    p = sub.add_parser("train", help="train a model (options: --section.key=value)",
                       description="Train. Any config option can be given as --section.key=value; "
                                   "see --help-config for the list.")
    p.add_argument("--config", help="TOML config file, or a run's config.json (default: the demo run, "
                                    "configs/tiny.toml; resuming a run folder: that run's own config)")
    p.add_argument("--print-config", nargs="?", const="json", choices=("json", "toml"),
                   help="print the resolved config and exit: JSON (the default), or --print-config=toml, a TOML "
                        "file for --config")
    p.add_argument("--help-config", action="store_true", help="list every config option and exit")
    g = p.add_argument_group("launch (several processes through PyTorch's elastic launcher)")
    g.add_argument("--nproc", type=int, help="processes (ranks) on this node; one per GPU")
    g.add_argument("--nnodes", type=int, default=1, help="number of nodes (default 1)")
    g.add_argument("--node-rank", type=int, help="this node's rank, for a fixed rendezvous at --rdzv-endpoint")
    g.add_argument("--rdzv-endpoint", help="HOST:PORT of the rendezvous, reachable from every node")
    g.add_argument("--rdzv-id", default="scaletrain",
                   help="job name shared by the nodes of one job (default scaletrain); each job needs its own "
                        "--rdzv-endpoint port")
    g.add_argument("--max-restarts", type=int, default=0, help="restart the group this often after a failure")
    p.set_defaults(func=_train, takes_overrides=True, parser=p)

    p = sub.add_parser("prepare", help="tokenize text/jsonl/parquet/Arrow files or a saved dataset into token shards")
    p.add_argument("inputs", nargs="+", help="files or folders of .txt, .jsonl, .jsonl.gz, .jsonl.zst, .parquet, "
                                             ".arrow, or a folder written by a Hugging Face dataset's save_to_disk")
    p.add_argument("--out", required=True, help="output folder (must not exist or be empty)")
    p.add_argument("--tokenizer", default="byte", metavar="byte|bpe|file|HF_FOLDER",
                   help="byte-level (256 tokens), a BPE trained here, --tokenizer-file, or a Hugging Face model "
                        "folder whose tokenizer.json (and tokenizer_config.json) to use and copy")
    p.add_argument("--vocab-size", type=int, default=8192, help="BPE vocabulary size (default 8192)")
    p.add_argument("--tokenizer-file", help="a Hugging Face tokenizer.json (with --tokenizer file)")
    p.add_argument("--text-key", default="text", help="jsonl field / parquet, Arrow or dataset column with the text")
    p.add_argument("--shard-tokens", type=int, default=100_000_000, help="tokens per shard file")
    p.add_argument("--val-fraction", type=float, default=0.0, metavar="F",
                   help="hold out this share of the documents (chosen by a hash of each document's text) as a "
                        "validation split for train.eval_every and scaletrain eval (default 0: none)")
    p.add_argument("--workers", type=int, metavar="N",
                   help="tokenizer processes (default: every core; inputs under 16 MiB are tokenized in one); the "
                        "shards are byte-identical whatever N")
    p.add_argument("--quiet", action="store_true", help="no progress line (MB/s, tokens, ETA) on stderr")
    p.set_defaults(func=_prepare, takes_overrides=False, parser=p)

    p = sub.add_parser("eval", help="a checkpoint's validation loss and perplexity (one process)",
                       description="Evaluate a checkpoint. Options are the config's names (data.path, "
                                   "train.eval_batches, train.device), with short aliases.")
    p.add_argument("checkpoint", help="a checkpoint folder (runs/.../checkpoints/step_*), or a run folder: its "
                                      "newest complete checkpoint")
    p.add_argument("--data", "--data.path", dest="data", metavar="FOLDER",
                   help="a prepared folder: its validation split, or all of it if it has none (default: the data "
                        "the checkpoint was trained on)")
    p.add_argument("--batches", "--train.eval_batches", dest="batches", type=int, metavar="N",
                   help="validation batches of the run's global batch (default: its train.eval_batches; 0 = every "
                        "whole batch)")
    p.add_argument("--device", "--train.device", dest="device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="where to run the model (default auto: cuda if available)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=_eval, takes_overrides=False, parser=p)

    p = sub.add_parser("plot", help="loss, validation loss, tokens/s and learning rate of runs, overlaid, to a PNG")
    p.add_argument("runs", nargs="+", metavar="RUN", help="run folders (log.run_dir), each with its metrics.jsonl")
    p.add_argument("--out", required=True, help="the PNG to write")
    p.set_defaults(func=_plot, takes_overrides=False, parser=p)

    p = sub.add_parser("generate", help="sample text from a checkpoint or a Hugging Face model folder",
                       description="Sample text after a prompt, one process, with a key/value cache (each new token "
                                   "costs one position). The tokenizer is the run's data folder's (or --data's); a "
                                   "Hugging Face folder's own.")
    p.add_argument("source", help="a checkpoint folder (runs/.../checkpoints/step_*) or a Hugging Face model folder")
    p.add_argument("--prompt", required=True, help="the text to continue")
    p.add_argument("--max-new-tokens", type=int, default=200, help="tokens to sample (default 200)")
    p.add_argument("--temperature", type=float, default=0.8, help="below 1: more predictable; above: more varied "
                                                                  "(default 0.8)")
    p.add_argument("--top-k", type=int, default=50, help="draw among the k likeliest tokens (default 50; 0: all)")
    p.add_argument("--seed", type=int, default=0, help="seed of the draws (default 0)")
    p.add_argument("--data", help="a prepared folder whose tokenizer to use (default: the run's data)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="where to run the model (default auto: cuda if available)")
    p.set_defaults(func=_generate, takes_overrides=False, parser=p)

    from scaletrain.plan.options import ALIASES
    from scaletrain.plan.spec import ATTENTION
    from scaletrain.vocab import AC_MODES, CP_METHODS, OPTIMIZERS, PLAN_ENGINES, PP_SCHEDULES, PRECISIONS, ZERO_STAGES

    p = sub.add_parser("plan", help="will it fit, and which layout is fastest",
                       description="Search the layouts of a model on a cluster, or evaluate the one the options fix, "
                                   "with every byte and second broken down. Takes the options of `scaletrain train`: "
                                   "--config FILE and --section.key=value (write the '='); the short flags below are "
                                   "aliases of config keys. The layout keys given fix the layout (anything left out "
                                   "is derived); with none given, it searches.")
    p.add_argument("model", nargs="?", help="preset name, TOML with a [model] section, or a Hugging Face config.json "
                                            "(default: the config's model)")
    p.add_argument("--config", help="a training config: its model, sequence length, batch, precision, optimizer, "
                                    "and the layout keys it gives")
    p.add_argument("--hardware", default="H100-SXM", help="catalog entry (V100-32GB, A100-40GB, A100-80GB, H100-SXM, "
                   "H100-PCIe, H200, B200, RTX-3090, RTX-4090) or one from --hardware-file")
    p.add_argument("--hardware-file", help="TOML with [[hardware]] tables of your own")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--attention", default="flash", choices=ATTENTION,
                   help="memory-efficient attention kernels, or materialized scores")
    p.add_argument("--activations", default="formula", choices=("formula", "traced"),
                   help="closed form, or counted on the actual model under fake tensors (slower)")
    p.add_argument("--engine", choices=PLAN_ENGINES,
                   help="the engine that trains it: what it keeps in memory and how it communicates "
                        "(default: the model TOML's [plan] engine, else scaletrain)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction,
                   help="torch.compile fuses the element-wise work (default: the [plan] table's, else off)")
    p.add_argument("--fp8", action=argparse.BooleanOptionalAction,
                   help="the block linears that precision.mode=fp8 converts (its layer rule) at the fp8 peak "
                        "(default: the [plan] table's, else off)")
    p.add_argument("--workers", type=int, default=1, metavar="N",
                   help="the cluster is N sites (e.g. datacenters) of equal size joined by --workers-link; the "
                        "data-parallel workers (dp_replicate groups) are the sites. When that link is slow the search "
                        "tries local SGD / DiLoCo (--parallel.dp_sync, sync_every, sync_fragments, sync_delay, "
                        "sync_dtype; default diloco every 50 steps) and says where it overtakes synchronous training")
    p.add_argument("--workers-link", type=float, metavar="GBPS",
                   help="bandwidth of the link between the sites, GB/s each way, shared by every rank that sends over it")
    g = p.add_argument_group("aliases of config keys (each the same as its --section.key=value)")

    def alias(flag: str, help: str = "", **kw):
        g.add_argument(flag, dest=_alias_dest(flag), help=f"alias of --{ALIASES[flag]}" + (f"; {help}" if help else ""),
                       **kw)

    alias("--seq-len", type=int, metavar="N", help="default 2048 (without --config)")
    alias("--global-batch", type=_at_least_1("global batch"), metavar="N",
          help="sequences per optimizer step, default 256 (without --config); --train.global_batch=0 derives it "
               "from the micro-batch and accumulation")
    alias("--precision", choices=PRECISIONS, help="default bf16-mixed (without --config)")
    alias("--optimizer", choices=OPTIMIZERS)
    alias("--zero", type=int, choices=ZERO_STAGES)
    alias("--tp", type=_at_least_1("tp"), metavar="N")
    alias("--pp", type=_at_least_1("pp"), metavar="N")
    alias("--dp-replicate", type=_at_least_1("dp_replicate"), metavar="N")
    alias("--dp-shard", type=_at_least_1("dp_shard"), metavar="N")
    alias("--micro-batch", type=_at_least_1("micro_batch"), metavar="N")
    alias("--ac", choices=AC_MODES)
    alias("--sp", metavar="true|false", help="default: on under tensor parallelism")
    alias("--schedule", choices=PP_SCHEDULES)
    alias("--virtual", type=_at_least_1("pp_virtual_stages"), metavar="N")
    alias("--offload", action="store_const", const=True, help="sets it to true")
    alias("--cp", type=_at_least_1("cp"), metavar="N",
          help="context parallel: ranks that split every sequence; each keeps its own tokens' activations, and "
               "--cp-method's attention backward buffers")
    alias("--cp-method", choices=CP_METHODS, help="how attention reaches the other cp ranks' keys (with --cp)")
    p.add_argument("--top", type=int, help="layouts to show (default 10); with --measure, the K best predicted "
                                           "are run and re-ranked by their measured step time")
    p.add_argument("--json", action="store_true", help="print JSON (schema in docs/planner.md)")
    p.add_argument("--chart", help="stacked memory bars of the top layouts, to this PNG")
    p.add_argument("--measure", action="store_true",
                   help="run one real step of the best (or fixed) layout here and print predicted vs measured")
    p.add_argument("--calibrate", action="store_true",
                   help="plan for this machine with --nproc local ranks, its step times from a calibration measured "
                        "here (compute, collectives, overlap; cached); --measure implies it")
    p.add_argument("--nproc", type=int, help="ranks for --measure or --calibrate (default 1)")
    p.add_argument("--comms", metavar="FILE", help="`scaletrain bench comms --json` output: use its measured "
                   "all-reduce bus bandwidth for the collectives inside a node")
    p.set_defaults(func=_plan, takes_overrides=True, parser=p)

    p = sub.add_parser("schedule", help="draw a pipeline schedule's timeline and its bubble",
                       description="Draw a pipeline schedule. Options are the config's names (parallel.pp, "
                                   "parallel.pp_microbatches, parallel.pp_schedule, parallel.pp_virtual_stages), "
                                   "with short aliases.")
    p.add_argument("--pp", "--parallel.pp", dest="pp", type=int, required=True, metavar="N",
                   help="pipeline stages (ranks)")
    p.add_argument("--microbatches", "--parallel.pp_microbatches", dest="microbatches", type=int, required=True,
                   metavar="M", help="micro-batches per step (train.grad_accum under pipelining)")
    p.add_argument("--schedule", "--parallel.pp_schedule", dest="schedule", default="1f1b", metavar="NAME",
                   help="gpipe, 1f1b, interleaved-1f1b or zero-bubble")
    p.add_argument("--virtual", "--parallel.pp_virtual_stages", dest="virtual", type=int, default=1, metavar="V",
                   help="chunks per rank (interleaved-1f1b, zero-bubble)")
    p.add_argument("--png", help="also draw it to this PNG file")
    p.set_defaults(func=_schedule, takes_overrides=False, parser=p)

    p = sub.add_parser("export", help="write a checkpoint's model weights to safetensors")
    p.add_argument("checkpoint", help="a checkpoint folder (runs/.../checkpoints/step_*), or a run folder: its "
                                      "newest complete checkpoint")
    p.add_argument("--out", required=True, help="output .safetensors file, or folder with --format hf (missing "
                                                "folders are created)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing --out (the new one is written whole first, then put in its place)")
    p.add_argument("--format", choices=("safetensors", "hf"), default="safetensors",
                   help="safetensors: one file, scaletrain names; hf: a Hugging Face model folder (config.json, "
                        "safetensors, generation_config, the data's tokenizer) that transformers loads with no code")
    p.set_defaults(func=_export, takes_overrides=False, parser=p)

    p = sub.add_parser("quantize", help="quantize a checkpoint's linear layers to int8/int4 (torchao), to a folder "
                                        "eval reads",
                       description="Post-training quantization with torchao. The transformer blocks' linear layers "
                                   "convert; the embeddings, the output head and small layers stay high precision "
                                   "(printed). The folder holds safetensors and JSON only: it loads without "
                                   "unpickling. A checkpoint trained with train.qat takes its own scheme.")
    p.add_argument("source", help="a checkpoint folder (runs/.../checkpoints/step_*), a run folder (its newest "
                                  "complete checkpoint), or a .safetensors file written by scaletrain export")
    p.add_argument("--scheme", required=True, choices=QUANT_SCHEMES,
                   help="int8-weight: int8 weights per channel; int8-dynamic: int8 activations per token and int8 "
                        "weights per channel; int8-int4: int8 activations and int4 weights in groups of 32")
    p.add_argument("--out", required=True, help="the folder to write (created; an existing one only with --overwrite)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out (written whole first)")
    p.set_defaults(func=_quantize, takes_overrides=False, parser=p)

    p = sub.add_parser("verify", help="check a layout against one process, step by step",
                       description="Run the config's first --steps steps under its layout and under a reference "
                                   "(one process, or the fewest ZeRO-3 ranks that fit), compare every step's loss "
                                   "and gradient norm, and print PASS (exit 0) or FAIL (exit 1) against a tolerance "
                                   "for the precision. Config options as --section.key=value.")
    p.add_argument("--config", help="TOML config file (default: the built-in tiny CPU run)")
    p.add_argument("--steps", type=int, default=10, help="steps to run and compare (default 10)")
    p.add_argument("--nproc", type=int, help="ranks of the layout (default: pp × dp_replicate × dp_shard × tp)")
    p.add_argument("--device-memory", dest="device_memory", type=float, metavar="GIB",
                   help="memory of one device for the reference's fit check (default: the device's own)")
    p.set_defaults(func=_verify, takes_overrides=True, parser=p)

    p = sub.add_parser("bench", help="measure this machine: collectives, a step, each technique",
                       description="Benchmarks run here, for real: collectives over N ranks; a config's step with "
                                   "variants beside it; what each technique buys in speed and memory.")
    bench = p.add_subparsers(dest="bench", required=True, parser_class=_Parser)
    b = bench.add_parser("comms", help="all-reduce, all-gather, reduce-scatter, broadcast, reduce, all-to-all",
                         description="Median time, algorithm and bus bandwidth (nccl-tests factors) of each "
                                     "collective over a range of message sizes; NCCL on GPUs, gloo on CPU.")
    b.add_argument("--nproc", type=int, help="ranks (default: the GPUs here, or 2 on CPU)")
    b.add_argument("--sizes", nargs="+", metavar="SIZE",
                   help="message sizes in bytes (64K, 16M, 1G) or a range MIN:MAX[:FACTOR] (default: 1K 32K 1M 16M "
                        "on CPU, 1M 16M 256M 1G on GPU)")
    b.add_argument("--iters", type=int, default=20, help="timed calls per collective and size (default 20)")
    b.add_argument("--warmup", type=int, default=5, help="untimed calls before them (default 5)")
    b.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: cuda if available")
    b.add_argument("--json", action="store_true", help="print JSON (for `scaletrain plan --comms FILE`)")
    b.set_defaults(func=_bench_comms, takes_overrides=False, parser=b)
    b = bench.add_parser("step", help="a config's step: time, tokens/s, MFU, peak memory; --vs variants as ratios",
                         description="Warm up, then time the config's training step interleaved with each --vs "
                                     "variant (and --vs-plain-loop): median step time, tokens/s, MFU, peak memory, "
                                     "and each variant's speed and memory as ratios to the baseline. Config "
                                     "options as --section.key=value.")
    b.add_argument("--config", help="TOML config file (default: the built-in tiny CPU run)")
    b.add_argument("--vs", action="append", default=[], metavar="KEY=VALUE",
                   help="a variant: section.key=value, several joined by commas; repeat for more variants")
    b.add_argument("--vs-plain-loop", action="store_true",
                   help="also time a minimal hand-written PyTorch loop of the same model (AdamW, autocast)")
    b.add_argument("--steps", type=int, default=10, help="timed steps of each, one per round (default 10)")
    b.add_argument("--warmup", type=int, default=3, help="untimed steps of each first (default 3)")
    b.add_argument("--json", action="store_true", help="print JSON")
    b.set_defaults(func=_bench_step, takes_overrides=True, parser=b)
    b = bench.add_parser("techniques", help="which technique buys speed, which buys memory, measured here",
                         description="Gradient accumulation, activation checkpointing, each precision mode, a "
                                     "larger batch, each optimizer, loader workers, each ZeRO stage and compile, "
                                     "each interleaved with the baseline config: speed and peak-memory ratios, "
                                     "as a table and a PNG chart. Config options as --section.key=value.")
    b.add_argument("--config", help="TOML config file (default: the built-in tiny CPU run)")
    b.add_argument("--nproc", type=int, help="ranks (default 1); the ZeRO stages need 2 or more")
    b.add_argument("--steps", type=int, default=5, help="timed steps of each, one per round (default 5)")
    b.add_argument("--warmup", type=int, default=2, help="untimed steps of each first (default 2)")
    b.add_argument("--skip", nargs="+", default=[], metavar="NAME",
                   help="leave techniques out by name (accum, ac-full, ac-selective, precision-MODE, batch, "
                        "optim-NAME, workers, zero1, zero2, zero3, compile)")
    b.add_argument("--max-slowdown", type=float, default=10.0, metavar="X",
                   help="stop timing a technique whose step takes over X times the baseline's (default 10; 0: never)")
    b.add_argument("--png", help="chart file (default runs/bench-techniques-DATE-TIME.png; '' for none)")
    b.add_argument("--json", action="store_true", help="print JSON")
    b.set_defaults(func=_bench_techniques, takes_overrides=True, parser=b)
    return parser


class _Terminated(BaseException):
    """SIGTERM outside the trainer's own handling (before training started), like SIGINT's
    KeyboardInterrupt."""


def _stopped(signum: int, verb: str | None) -> int:
    """A signal that reached the command line: the trainer was not there to save anything."""
    name = signal.Signals(signum).name
    if verb == "train":
        print(f"scaletrain: error: stopped by {name} before training started: no checkpoint was written",
              file=sys.stderr)
        return 3
    print(f"scaletrain: stopped by {name}", file=sys.stderr)
    return 128 + signum


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    old_term, verb = None, None
    try:  # from here on, a Ctrl-C (even in `import torch`) is one line
        from scaletrain.runtime import is_worker

        if not is_worker() and threading.current_thread() is threading.main_thread():
            def on_term(signum, frame):
                raise _Terminated()

            old_term = signal.signal(signal.SIGTERM, on_term)
        parser = build_parser()
        args, extra = parser.parse_known_args(argv)
        args.argv, verb = argv, args.verb
        extra = _leftovers(args.parser, extra, args.takes_overrides)
        return args.func(args, extra)
    except _Done:
        return 0
    except UserError as e:
        for line in e.lines:
            print(f"scaletrain: error: {line}", file=sys.stderr)
        return e.exit_code
    except OSError as e:  # a read-only, full or missing path the user gave: one line; anything else is ours
        error = user_error_from_os(e)
        if error is None:
            raise
        print(f"scaletrain: error: {error.lines[0]}", file=sys.stderr)
        return error.exit_code
    except KeyboardInterrupt:  # not inside the trainer's fit, which handles SIGINT itself
        return _stopped(signal.SIGINT, verb)
    except _Terminated:
        return _stopped(signal.SIGTERM, verb)
    finally:
        if old_term is not None and signal.getsignal(signal.SIGTERM) is not signal.SIG_IGN:
            signal.signal(signal.SIGTERM, old_term)


if __name__ == "__main__":
    sys.exit(main())
