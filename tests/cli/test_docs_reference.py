"""The docs' reference cannot drift from the code (issue 54): the generated pages name every config option,
every verb and flag, every Hugging Face family and every user error, each checked against another way of
reading the program (the resolved config's JSON, argparse's own --help, config.json's model_type), and a new
option or verb appears with no page written; the code maps name every module."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import re

import pytest

from scaletrain.cli import VERBS, main
from scaletrain.cli.reference import config_page, errors_page, families_page
from scaletrain.cli.reference_verbs import cli_page, verb_parsers
from scaletrain.options import option

from conftest import REPO

PACKAGE = REPO / "src" / "scaletrain"


def flat(tree: dict, prefix: str = "") -> list[str]:
    return [k for key, value in tree.items()
            for k in (flat(value, f"{prefix}{key}.") if isinstance(value, dict) else [f"{prefix}{key}"])]


def test_every_config_option_is_on_the_page_with_its_default_and_reason(capsys):
    assert main(["train", "--print-config=json"]) == 0  # the resolved config, as a user sees it
    keys = flat(json.loads(capsys.readouterr().out))
    page = config_page()
    options, aliases = page.split("## Old names")
    rows = dict(re.findall(r"^\| `([\w.]+)` \| (.*) \|$", options, re.M))
    assert len(keys) > 150 and sorted(set(keys) - set(rows)) == [] and sorted(set(rows) - set(keys)) == []
    # rows written out by hand from config.py's declarations
    assert rows["precision.mode"] == ("str | `'32-true'` | `32-true`, `tf32`, `16-mixed`, `bf16-mixed`, `bf16-true`, "
                                      "`fp8` | numerics, with Lightning's names")
    assert rows["train.steps"] == "int | `250` | at least 1 | optimizer steps to train"
    assert "| `parallel.dp_sync` | `parallel.sync.mode` |" in aliases
    assert "`parallel.sync.every`" in page and "## `[parallel.sync]`" in page  # a table inside a section


def test_a_new_option_appears_with_no_page_written(monkeypatch):
    from scaletrain import config

    @dataclasses.dataclass
    class Muon:
        momentum: float = option(0.95, "the momentum of the new optimizer", min=0.0, max=1.0)

    monkeypatch.setitem(config.SECTIONS, "muon", Muon)
    assert "| `muon.momentum` | float | `0.95` | 0.0 to 1.0 | the momentum of the new optimizer |" in config_page()


def help_flags(argv: list[str], capsys) -> set[str]:
    """The flags argparse's own --help prints for a command."""
    with pytest.raises(SystemExit):
        main([*argv, "--help"])
    text = capsys.readouterr().out
    options = text.split("options:", 1)[1] if "options:" in text else text
    return set(re.findall(r"^  (?:-\w+, )?(--[a-z][\w-]*)", options, re.M)) - {"--help"}  # each option's own line


def test_every_verb_and_flag_is_on_the_page(capsys):
    page = cli_page()
    commands = re.findall(r"^## `scaletrain ([\w -]+)`$", page, re.M)
    assert [c for c in VERBS if c not in commands] == [] and len(commands) == len(set(commands))
    assert {"bench comms", "bench step", "bench techniques"} <= set(commands)
    for command in commands:
        section = page.split(f"## `scaletrain {command}`", 1)[1].split("\n## ", 1)[0]
        on_page = set(re.findall(r"`(--[\w-]+)", section))
        if command != "bench":  # a verb of verbs: its --help lists its verbs, not flags
            assert help_flags(command.split(), capsys) - on_page == set(), command
    train = page.split("## `scaletrain train`", 1)[1].split("\n## ", 1)[0]
    assert "| `--max-restarts MAX_RESTARTS` | `0` |  | restart the group this often after a failure |" in train
    assert "--rank-hook" not in page  # hidden (argparse.SUPPRESS): tests only
    assert "every config option as `--section.key=value`" in train


def test_a_new_verb_appears_with_no_page_written(monkeypatch):
    import types

    from scaletrain import cli

    def add_parser(sub):
        p = sub.add_parser("distill", help="a verb added later", description="Teach a small model from a big one.")
        p.add_argument("--teacher", required=True, help="the big model's folder")
        p.set_defaults(func=None, takes_overrides=True, parser=p)

    monkeypatch.setitem(cli.VERBS, "distill", types.SimpleNamespace(add_parser=add_parser))
    page = cli_page()
    assert "## `scaletrain distill`\n\nTeach a small model from a big one." in page
    assert "| `--teacher TEACHER` |  |  | the big model's folder |" in page
    assert isinstance(verb_parsers()["distill"], argparse.ArgumentParser)


def test_every_family_and_error_is_on_its_page():
    families = set(re.findall(r"^\| `(\w+)` \| `(\w+)` \|", families_page(), re.M))
    # model_type and transformers class, as the families' own files declare them (read from their text)
    declared = set()
    for f in (PACKAGE / "model" / "families").glob("[!_]*.py"):
        text = f.read_text()
        kinds = re.findall(r'^\s+model_type = "(\w+)"', text, re.M)
        classes = re.findall(r'^\s+architecture = "(\w+)"', text, re.M)
        declared |= set(zip(kinds, classes))
    assert len(declared) >= 13 and families == declared
    page = errors_page()
    defined = {node.name for f in PACKAGE.rglob("*.py") for node in ast.walk(ast.parse(f.read_text()))
               if isinstance(node, ast.ClassDef) and any(getattr(b, "id", "").endswith(("Error", "Stopped", "Formed"))
                                                         for b in node.bases)}
    listed = set(re.findall(r"^\| `[\w.]+\.(\w+)` \| \d+ \|", page, re.M))
    assert {"ConfigError", "DataError", "TrainingStopped"} <= listed and defined <= listed | {"UserError"}


def modules() -> list[str]:
    return sorted(p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py"))


def test_the_code_map_names_every_module_and_nothing_that_is_not_one():
    text = (REPO / "docs" / "how-it-works" / "code-map.md").read_text()
    named = re.findall(r"^- `([\w/]+\.py)`", text, re.M)
    assert [m for m in modules() if m not in named] == [], "add these to docs/how-it-works/code-map.md"
    assert [n for n in named if n not in modules()] == [] and len(named) == len(set(named))


def test_the_readme_code_layout_names_every_top_level_module_and_package():
    readme = (REPO / "README.md").read_text()
    block = readme.split("## Code layout", 1)[1].split("```", 2)[1]
    words = set(re.findall(r"[\w.]+/?", block))
    tops = sorted({m.split("/")[0] + "/" if "/" in m else m for m in modules()})
    assert [t for t in tops if t not in words] == []
