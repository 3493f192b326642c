"""The docs site's reference pages, written from the code when the site is built (docs/hooks/reference.py):
every config option from the sections' dataclasses, every verb and flag from the parsers, the Hugging Face
families from their registry and the user errors from their classes. Nothing here is typed by hand, so a new
option, verb, family or error appears in the site without a page being written for it."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
import pkgutil

from scaletrain.config import ALIASES, SECTIONS, option_fields
from scaletrain.errors import UserError
from scaletrain.model.families import FAMILIES
from scaletrain.options import table_class


def cell(text: object) -> str:
    """Text fit for one cell of a Markdown table: no pipe or line break ends it early."""
    return " ".join(str(text).split()).replace("|", "\\|")


def code(value: object) -> str:
    text = repr(value) if isinstance(value, str) else str(value).lower() if isinstance(value, bool) else str(value)
    return f"`{cell(text)}`" if text != "" else ""


def default_of(f: dataclasses.Field) -> object:
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def allowed(meta) -> str:
    """The values an option takes: its choices, or the bounds of a number."""
    if meta.get("choices"):
        return ", ".join(f"`{c}`" for c in meta["choices"])
    lo, hi = meta.get("min"), meta.get("max")
    if lo is not None and hi is not None:
        return f"{lo} to {hi}" + (" (below)" if meta.get("open_max") else "")
    if lo is not None:
        return f"at least {lo}"
    return f"{'below' if meta.get('open_max') else 'at most'} {hi}" if hi is not None else ""


def section_table(name: str, cls: type) -> list[str]:
    """One `## [name]` table, then each table of options inside it (`[parallel.sync]`) after its own keys."""
    lines = [f"## `[{name}]`", "", "| key | type | default | allowed | what it is |", "|---|---|---|---|---|"]
    inner = []
    for f in dataclasses.fields(cls):
        if (sub := table_class(f)) is not None:
            inner.append((f"{name}.{f.name}", sub))
            continue
        lines.append(f"| `{name}.{f.name}` | {f.type} | {code(default_of(f))} | {allowed(f.metadata)} | "
                     f"{cell(f.metadata['help'])} |")
    lines.append("")
    for args in inner:
        lines += section_table(*args)
    return lines


def config_page() -> str:
    n = len(option_fields())
    lines = ["# Configuration options", "",
             f"Every option of the config tree ({n} in {len(SECTIONS)} sections), generated from the code when the "
             "site was built. Each has one name in a TOML file (`[train]` `steps = 500`), on the command line "
             "(`--train.steps=500`) and in Python (`cfg.train.steps`); `scaletrain train --help-config` prints the "
             "same list. A table inside a section (`[parallel.sync]`) is written `--parallel.sync.every=10`.", ""]
    for name, cls in SECTIONS.items():
        lines += section_table(name, cls)
    lines += ["## Old names", "", "Still read, in files, on the command line and in saved runs, each with a note; "
              "giving both names of one option is an error.", "", "| old name | new name |", "|---|---|"]
    lines += [f"| `{old}` | `{new}` |" for old, new in ALIASES.items()]
    return "\n".join(lines) + "\n"


def families_page() -> str:
    lines = ["# Hugging Face families", "",
             f"The {len(FAMILIES)} families `model.from_hf`, `model.init_from` and `scaletrain export --format hf` "
             "read and write, from the registry (`scaletrain.model.families`), keyed by `config.json`'s "
             "`model_type`. A key of `config.json` that changes what the model computes and that the family does "
             "not read is refused in one line, naming it. The [Hugging Face guide](../guides/hugging-face.md) "
             "says what each one supports.", "",
             "| `model_type` | transformers class | what is particular to it | config.json keys it reads |",
             "|---|---|---|---|"]
    for kind, family in FAMILIES.items():
        doc = inspect.getmodule(type(family)).__doc__ or ""
        first = doc.strip().split("\n\n")[0]
        keys = ", ".join(f"`{k}`" for k in sorted(family.known))
        lines.append(f"| `{kind}` | `{family.architecture}` | {cell(first)} | {keys} |")
    return "\n".join(lines) + "\n"


def load_package() -> None:
    """Import every module of scaletrain that imports here, so that each error class defined anywhere is known
    (one whose optional dependency is missing is left out)."""
    import scaletrain

    for info in pkgutil.walk_packages(scaletrain.__path__, "scaletrain."):
        if info.name.endswith("__main__"):  # a program, not a module: importing it runs it
            continue
        with contextlib.suppress(ImportError):
            importlib.import_module(info.name)


def error_classes(cls: type = UserError) -> list[type]:
    out = [cls]
    for sub in cls.__subclasses__():
        out += error_classes(sub)
    return out


def errors_page() -> str:
    load_package()
    lines = ["# Errors and exit codes", "",
             "What the user can fix raises one of these; the command prints each problem as one line "
             "`scaletrain: error: ...` naming the key, file or value and the fix, and exits with the class's code. "
             "No traceback. Generated from `scaletrain.errors` and the modules that define more.", "",
             "| error | exit code | when |", "|---|---|---|"]
    for cls in error_classes():
        lines.append(f"| `{cls.__module__}.{cls.__name__}` | {cls.exit_code} | {cell(inspect.getdoc(cls) or '')} |")
    return "\n".join(lines) + "\n"
