"""What the verbs share: the parser whose errors are one line, --version, the notes on stderr,
the words left over for the config, the one-line refusal, and the paths a verb checks first."""

from __future__ import annotations

import argparse
import os
import sys

from scaletrain.errors import UserError
from scaletrain.vocab import did_you_mean

PROG = "scaletrain"


class Parser(argparse.ArgumentParser):
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


class Done(Exception):
    """An option that answered and ends the command (--version), exit 0."""


class Version(argparse.Action):
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
        raise Done()


def note(line: str) -> None:
    """A line about a choice made for the user (parallel.layout=auto's), on stderr."""
    print(f"scaletrain: {line}", file=sys.stderr)


def refuse(lines, exit_code: int) -> int:
    """A user error: one line each on stderr, and its exit code (2 unless said otherwise)."""
    for line in lines:
        print(f"scaletrain: error: {line}", file=sys.stderr)
    return exit_code


def leftovers(parser: argparse.ArgumentParser, extra: list[str], takes_overrides: bool) -> list[str]:
    """What argparse left of the command line: for a command that takes config options, those
    (`--section.key=value`, checked by the config); anything else is an error, one line each,
    naming the closest of the command's own options (and of the config's keys)."""
    import difflib

    from scaletrain.config import SECTIONS, option_fields

    flags = [s for action in parser._actions for s in action.option_strings if s.startswith("--") and s != "--help"]
    keys = [f"--{key}" for key in option_fields()] if takes_overrides else []
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


def check_png(flag: str, path: str | None) -> None:
    """Refuse an image path that cannot be written before any work is done (plan --chart,
    schedule --png, plot --out)."""
    if not path:
        return
    folder = os.path.dirname(path) or "."
    if not path.lower().endswith(".png"):
        raise UserError(f"{flag} {path}: give a file name ending in .png")
    if not os.path.isdir(folder):
        raise UserError(f"{flag} {path}: the folder {folder} does not exist; create it or choose another path")


def checkpoint_to_read(path: str, peft: bool = True) -> str:
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

    return str(checkpoint_of(path, report=note))
