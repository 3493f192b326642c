"""`scaletrain VERB ...`: one thin sub-command per verb, each a call into the library.

Each verb has one parser function; the planner's verbs (plan, schedule) keep theirs in
scaletrain.plan_cli, the benchmarks' in scaletrain.bench_cli. `train` settles its job in
scaletrain.launch.job. A user error (bad config, data, checkpoint or launch request) prints one line
per problem and exits with code 2; there is no traceback for those.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from collections.abc import Sequence

from scaletrain.errors import UserError, config_paths, os_errors_named, user_error_from_os
from scaletrain.interrupt import STOP_SIGNALS, EarlySignals, Terminated
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
    """The config chosen and shown, or the job settled (scaletrain.launch.job) and run: here, on
    --nproc ranks, or as this rank of torchrun's."""
    from scaletrain.config import describe_options
    from scaletrain.launch import job, worker

    if args.help_config:
        print(describe_options())
        return 0
    cfg, notes = job.train_config(args.config, extra)
    if args.print_config:
        print(cfg.to_toml() if args.print_config == "toml" else cfg.to_json())
        return 0
    from scaletrain.runtime import is_worker, pick_device

    if is_worker():  # started by torchrun (our launcher starts scaletrain.launch.worker itself)
        worker.run(job.train, cfg, None, _note, args.rank_hook)  # rank 0 settles the job for all; does not return
    with os_errors_named(config_paths(cfg)):
        if args.nproc is None:  # this process is the whole job
            from scaletrain import measure
            from scaletrain.train.trainer import Trainer

            cfg, rt = job.start(cfg, note=_note, measure=measure)
            trainer = job.call_rank_hook(args.rank_hook, Trainer(cfg, rt))  # checked: the resume included
            for line in notes:
                _note(line)
            return job.exit_code(trainer.fit())
        from scaletrain.launch.launcher import check_launch

        check_launch(args.nproc, args.nnodes, args.rdzv_endpoint or "")  # before any arithmetic on the world size
        from scaletrain import measure

        cfg, layout = job.settle(cfg, args.nproc * args.nnodes, pick_device(cfg.train.device, 0, args.nproc),
                                 per_node=args.nproc, note=_note, measure=measure if args.nnodes == 1 else None)
        for line in notes:
            _note(line)
        return job.launch(cfg, layout, nproc=args.nproc, nnodes=args.nnodes, node_rank=args.node_rank,
                          rdzv_endpoint=args.rdzv_endpoint or "", rdzv_id=args.rdzv_id,
                          max_restarts=args.max_restarts, rank_hook=args.rank_hook)


def _note(line: str) -> None:
    """A line about a choice made for the user (parallel.layout=auto's), on stderr."""
    print(f"scaletrain: {line}", file=sys.stderr)


def _prepare(args: argparse.Namespace, extra: list[str]) -> int:
    from scaletrain.data.prepare import prepare

    with os_errors_named({"--out": args.out}):
        meta = prepare(args.inputs, args.out, tokenizer=args.tokenizer, vocab_size=args.vocab_size,
                       tokenizer_file=args.tokenizer_file, text_key=args.text_key, shard_tokens=args.shard_tokens,
                       val_fraction=args.val_fraction, workers=args.workers, chat_format=args.chat_format,
                       loss_on_prompt=args.loss_on_prompt, progress=None if args.quiet else sys.stderr,
                       report=lambda line: _note(f"prepare: {line}"))
    if "mask_shards" in meta:
        print(f"loss mask: {meta['num_counted_tokens']:,} of the training tokens counted "
              f"(--chat-format {meta['chat_format']}{', the prompt included' if meta['loss_on_prompt'] else ''})")
    model_vocab = meta["tokenizer"].get("model_vocab_size")
    padded = f", {model_vocab} in the model" if model_vocab else ""
    print(f"wrote {meta['num_tokens']:,} tokens ({meta['dtype']}, {len(meta['shards'])} shard(s), "
          f"{meta['num_documents']:,} documents, vocabulary {meta['tokenizer']['vocab_size']}{padded}) to {args.out}")
    if "val_shards" in meta:
        print(f"validation split: {meta['num_val_tokens']:,} tokens, {meta['num_val_documents']:,} documents "
              f"({len(meta['val_shards'])} shard(s), --val-fraction {meta['val_fraction']:g} by document)")
    return 0


def _checkpoint_of(path: str, peft: bool = True) -> str:
    """A checkpoint folder, or a run folder's newest complete checkpoint (said on stderr); a
    folder written by `scaletrain quantize` as it is, and a PEFT adapter folder where `peft`."""
    from scaletrain.quant.ptq import is_quantized_folder
    from scaletrain.train.checkpoint import checkpoint_of
    from scaletrain.trained.adapters import is_peft_folder

    if is_peft_folder(path) and not peft:
        raise UserError(f"{path} is a PEFT adapter folder; this command takes an adapter run or its checkpoint "
                        "(eval and generate take a PEFT folder, on --base)")
    if is_quantized_folder(path) or is_peft_folder(path):
        return path

    return str(checkpoint_of(path, report=_note))


def _eval(args: argparse.Namespace, extra: list[str]) -> int:
    import json

    from scaletrain.trained.evaluate import evaluate_checkpoint

    with os_errors_named({"checkpoint": args.checkpoint, "data.path": args.data or "", "--base": args.base or ""}):
        r = evaluate_checkpoint(_checkpoint_of(args.checkpoint), args.data, args.batches, args.device, report=_note,
                                base=args.base)
    if args.json:
        print(json.dumps(r, indent=1))
    else:
        scheme = f"  [quantized: {r['quantized']}]" if r.get("quantized") else \
            f"  [fake-quantized: train.qat={r['fake_quantized']}]" if r.get("fake_quantized") else ""
        print(f"val_loss {r['val_loss']:.4f}  val_ppl {r['val_ppl']:.2f}{scheme}  ({r['data']}, {r['split']}: "
              f"{r['batches']} batch(es) = {r['windows']:,} windows, {r['tokens']:,} tokens; step {r['step']})")
        for name, loss in r.get("sources", {}).items():
            print(f"  {name}: val_loss {loss:.4f}")
    return 0


def _generate(args: argparse.Namespace, extra: list[str]) -> int:
    from scaletrain.trained.generate import generate_text

    def stream(piece: str) -> None:  # each piece as it is sampled (a long sample shows as it grows)
        sys.stdout.write(piece)
        sys.stdout.flush()

    started = False

    def first(piece: str) -> None:
        nonlocal started
        if not started:  # the prompt once the model is loaded and sampling has begun
            sys.stdout.write(args.prompt)
            started = True
        stream(piece)

    with os_errors_named({"source": args.source, "--data": args.data or "", "--base": args.base or ""}):
        # a run folder: its newest complete checkpoint, as eval and export take it
        generate_text(_checkpoint_of(args.source), args.prompt, max_new_tokens=args.max_new_tokens,
                      temperature=args.temperature, top_k=args.top_k, seed=args.seed, data=args.data,
                      device=args.device, stream=first, report=_note, base=args.base)
    if not started:  # no token asked for: the prompt alone
        sys.stdout.write(args.prompt)
    print()
    return 0


def _plot(args: argparse.Namespace, extra: list[str]) -> int:
    from scaletrain.plan_cli import check_png
    from scaletrain.trained.plot import plot_runs

    check_png("--out", args.out)
    with os_errors_named({"--out": args.out}):
        summary = plot_runs(args.runs, args.out)
    print(f"wrote {args.out} ({', '.join(summary['runs'])})")
    return 0


def _export(args: argparse.Namespace, extra: list[str]) -> int:
    from scaletrain.trained.adapters import export_peft
    from scaletrain.trained.export import export_safetensors
    from scaletrain.trained.export_hf import export_hf

    write = {"hf": export_hf, "peft": export_peft, "safetensors": export_safetensors}[args.format]
    with os_errors_named({"--out": args.out, "checkpoint": args.checkpoint, "--base": args.base or ""}):
        out = write(_checkpoint_of(args.checkpoint, peft=False), args.out, overwrite=args.overwrite, base=args.base)
    print(f"wrote {out}")
    return 0


def _quantize(args: argparse.Namespace, extra: list[str]) -> int:
    from scaletrain.trained.quantize import quantize_source

    with os_errors_named({"--out": args.out, "source": args.source}):
        source = args.source if os.path.isfile(args.source) else _checkpoint_of(args.source, peft=False)
        out = quantize_source(source, args.scheme, args.out, overwrite=args.overwrite, report=print)
    from scaletrain.quant.ptq import folder_bytes

    print(f"wrote {out} ({folder_bytes(out) / 2**20:.2f} MiB)")
    return 0


def _verify(args: argparse.Namespace, extra: list[str]) -> int:
    from scaletrain.verify import verify

    return verify(args.config, extra, steps=args.steps, nproc=args.nproc, device_memory_gib=args.device_memory)


def _leftovers(parser: argparse.ArgumentParser, extra: list[str], takes_overrides: bool) -> list[str]:
    """What argparse left of the command line: for a command that takes config options, those
    (`--section.key=value`, checked by the config); anything else is an error, one line each,
    naming the closest of the command's own options (and of the config's keys)."""
    import difflib
    from dataclasses import fields

    from scaletrain.config import SECTIONS

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


def _train_parser(sub) -> None:
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
    p.add_argument("--rank-hook", help=argparse.SUPPRESS)  # hidden, tests only: scaletrain.launch.job.call_rank_hook
    p.set_defaults(func=_train, takes_overrides=True, parser=p)


def _prepare_parser(sub) -> None:
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
    p.add_argument("--chat-format", choices=("template", "plain"),
                   help="the inputs are chat/instruction jsonl: a `messages` list of {role, content} turns, or a "
                        "prompt|instruction|question field with a response|completion|output|answer field (and an "
                        "optional system); rendered with the tokenizer's chat_template (template: a Hugging Face "
                        "folder) or as \"User: ...\\nAssistant: ...\\n\" (plain), with a loss mask beside the tokens "
                        "that counts the assistant's tokens only")
    p.add_argument("--loss-on-prompt", action="store_true",
                   help="with --chat-format: count every token (the prompt's too), not the assistant's alone")
    p.add_argument("--quiet", action="store_true", help="no progress line (MB/s, tokens, ETA) on stderr")
    p.set_defaults(func=_prepare, takes_overrides=False, parser=p)


def _eval_parser(sub) -> None:
    p = sub.add_parser("eval", help="a checkpoint's validation loss and perplexity (one process)",
                       description="Evaluate a checkpoint. Options are the config's names (data.path, "
                                   "train.eval_batches, train.device), with short aliases.")
    p.add_argument("checkpoint", help="a checkpoint folder (runs/.../checkpoints/step_*), or a run folder: its "
                                      "newest complete checkpoint; or a PEFT adapter folder (on --base)")
    p.add_argument("--data", "--data.path", dest="data", metavar="FOLDER",
                   help="a prepared folder: its validation split, or all of it if it has none (default: the data "
                        "the checkpoint was trained on)")
    p.add_argument("--batches", "--train.eval_batches", dest="batches", type=int, metavar="N",
                   help="validation batches of the run's global batch (default: its train.eval_batches; 0 = every "
                        "whole batch)")
    p.add_argument("--device", "--train.device", dest="device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="where to run the model (default auto: cuda if available)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--base", metavar="FOLDER",
                   help="adapters only: where their base is now (default: where the run read it, or a PEFT "
                        "folder's base_model_name_or_path); its sha256 must be the one they were trained on")
    p.set_defaults(func=_eval, takes_overrides=False, parser=p)


def _plot_parser(sub) -> None:
    p = sub.add_parser("plot", help="loss, validation loss, tokens/s and learning rate of runs, overlaid, to a PNG")
    p.add_argument("runs", nargs="+", metavar="RUN", help="run folders (log.run_dir), each with its metrics.jsonl")
    p.add_argument("--out", required=True, help="the PNG to write")
    p.set_defaults(func=_plot, takes_overrides=False, parser=p)


def _generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="sample text from a checkpoint or a Hugging Face model folder",
                       description="Sample text after a prompt, one process, with a key/value cache (each new token "
                                   "costs one position). The tokenizer is the run's data folder's (or --data's); a "
                                   "Hugging Face folder's own.")
    p.add_argument("source", help="a checkpoint folder (runs/.../checkpoints/step_*), a Hugging Face model folder, "
                                  "or a PEFT adapter folder (on --base)")
    p.add_argument("--prompt", required=True, help="the text to continue")
    p.add_argument("--max-new-tokens", type=int, default=200, help="tokens to sample (default 200)")
    p.add_argument("--temperature", type=float, default=0.8, help="below 1: more predictable; above: more varied "
                                                                  "(default 0.8)")
    p.add_argument("--top-k", type=int, default=50, help="draw among the k likeliest tokens (default 50; 0: all)")
    p.add_argument("--seed", type=int, default=0, help="seed of the draws (default 0)")
    p.add_argument("--data", help="a prepared folder whose tokenizer to use (default: the run's data)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="where to run the model (default auto: cuda if available)")
    p.add_argument("--base", metavar="FOLDER",
                   help="adapters only: where their base is now (default: where the run read it, or a PEFT "
                        "folder's base_model_name_or_path); its sha256 must be the one they were trained on")
    p.set_defaults(func=_generate, takes_overrides=False, parser=p)


def _export_parser(sub) -> None:
    p = sub.add_parser("export", help="write a checkpoint's model weights to safetensors")
    p.add_argument("checkpoint", help="a checkpoint folder (runs/.../checkpoints/step_*), or a run folder: its "
                                      "newest complete checkpoint")
    p.add_argument("--out", required=True, help="output .safetensors file, or folder with --format hf (missing "
                                                "folders are created)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing --out (the new one is written whole first, then put in its place)")
    p.add_argument("--format", choices=("safetensors", "hf", "peft"), default="safetensors",
                   help="safetensors: one file, scaletrain names; hf: a Hugging Face model folder (config.json, "
                        "safetensors, generation_config, the data's tokenizer) that transformers loads with no code "
                        "(adapters merged into their base); peft: an adapter run's adapters alone, as a folder "
                        "that peft.PeftModel.from_pretrained loads onto the base")
    p.add_argument("--base", metavar="FOLDER",
                   help="adapters only: where their base is now (default: where the run read it, or a PEFT "
                        "folder's base_model_name_or_path); its sha256 must be the one they were trained on")

    p.set_defaults(func=_export, takes_overrides=False, parser=p)


def _quantize_parser(sub) -> None:
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


def _verify_parser(sub) -> None:
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


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="Train models too big or too slow for one GPU.")
    parser.add_argument("--version", action=_Version)
    sub = parser.add_subparsers(dest="verb", required=True, parser_class=_Parser)
    from scaletrain import bench_cli, ft_cli, plan_cli

    for verb_parser in (_train_parser, _prepare_parser, _eval_parser, _plot_parser, _generate_parser,
                        plan_cli.plan_parser, plan_cli.schedule_parser, _export_parser, _quantize_parser,
                        _verify_parser, bench_cli.bench_parser, ft_cli.lighthouse_parser, ft_cli.ft_local_parser):
        verb_parser(sub)
    return parser


def _stopped(signum: int, verb: str | None) -> int:
    """A signal that reached the command line: the trainer was not there to save anything."""
    name = signal.Signals(signum).name
    if verb == "train":
        print(f"scaletrain: error: stopped by {name} before training started: no checkpoint was written",
              file=sys.stderr)
        return 3
    print(f"scaletrain: stopped by {name}", file=sys.stderr)
    return 128 + signum


def main(argv: Sequence[str] | None = None, guard: EarlySignals | None = None) -> int:
    """The exit code of the command `argv` (default: this program's own command line, whose
    result then stands: later signals are absorbed). `guard`: the stop signals' handler the
    program installed first (scaletrain.__main__); without it, main installs one (and, given
    `argv`, restores the caller's after)."""
    program = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    verb = None
    before = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS} if guard is None and not program else {}
    try:  # from here on, a Ctrl-C or SIGTERM (even in `import torch`) is one line
        if guard is None:
            guard = EarlySignals.install()
        if guard is not None:
            guard.on_stuck = lambda signum: _stopped(signum, verb)  # the verb once known
            guard.check()  # one that came while the program started
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
    except Terminated:
        return _stopped(signal.SIGTERM, verb)
    finally:
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                if program:
                    signal.signal(sig, signal.SIG_IGN)
                elif before.get(sig) is not None and signal.getsignal(sig) is not signal.SIG_IGN:  # a stop absorbs
                    signal.signal(sig, before[sig])


if __name__ == "__main__":
    sys.exit(main())
