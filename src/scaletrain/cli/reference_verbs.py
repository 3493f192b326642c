"""The docs site's command-line reference, read from the parsers the program itself uses (scaletrain.cli's
VERBS, each module's add_parser): every verb, its sub-verbs, and every flag with its default, choices and help.
Hidden flags (argparse.SUPPRESS) stay hidden."""

from __future__ import annotations

import argparse

from scaletrain.cli.reference import cell


def verb_parsers() -> dict[str, argparse.ArgumentParser]:
    """Each verb's parser by its command ("train", "bench step"), in the order --help lists them."""
    from scaletrain.cli import build_parser

    out: dict[str, argparse.ArgumentParser] = {}

    def walk(prefix: str, parser: argparse.ArgumentParser) -> None:
        if prefix:
            out[prefix] = parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                helps = {a.dest: a.help for a in action._choices_actions}
                for name, child in action.choices.items():
                    child.description = child.description or helps.get(name)
                    walk(f"{prefix} {name}".strip(), child)

    walk("", build_parser())
    return out


def flag_row(action: argparse.Action) -> str | None:
    if action.help == argparse.SUPPRESS or isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
        return None
    metavar = action.metavar or action.dest.upper()
    takes = f" {metavar}" if action.option_strings and action.nargs != 0 else ""
    name = ", ".join(f"`{cell(s + takes)}`" for s in action.option_strings) or f"`{cell(metavar)}`"
    choices = ", ".join(f"`{c}`" for c in action.choices) if action.choices else ""
    default = action.default
    hidden = default is None or default is False or default in (argparse.SUPPRESS, "", [])
    shown = "" if hidden else f"`{cell(default)}`"
    return f"| {name} | {shown} | {choices} | {cell(action.help or '')} |"


def verb_section(command: str, parser: argparse.ArgumentParser) -> list[str]:
    lines = [f"## `scaletrain {command}`", "", cell(parser.description or ""), ""]
    rows = [row for action in parser._actions if (row := flag_row(action)) is not None]
    if rows:
        lines += ["| argument | default | choices | what it does |", "|---|---|---|---|", *rows, ""]
    if parser.get_default("takes_overrides"):
        lines += ["It also takes every config option as `--section.key=value` "
                  "([configuration options](config.md)).", ""]
    return lines


def cli_page() -> str:
    parsers = verb_parsers()
    lines = ["# Command line", "",
             f"Every command of `scaletrain` ({len(parsers)}), read from the program's own parsers when the site was "
             "built; `scaletrain COMMAND --help` prints the same. A bad flag or value is one line with the closest "
             "valid one, exit code 2.", ""]
    for command, parser in parsers.items():
        lines += verb_section(command, parser)
    return "\n".join(lines) + "\n"
