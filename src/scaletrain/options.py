"""Declaring config options: a dataclass field with its default, a one-line reason and the
values that are valid, and the one routine that checks a value against them (TOML values, and
text from the command line). The config sections (scaletrain.config, scaletrain.model.config)
are declared with it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import field
from typing import Any

from scaletrain.vocab import did_you_mean


def option(default: Any, help: str, *, choices: Sequence[str] | None = None,
           min: float | None = None, max: float | None = None, open_max: bool = False) -> Any:
    """A config field: its default, a one-line reason, and what values are valid."""
    meta = {"help": help, "choices": tuple(choices) if choices else None,
            "min": min, "max": max, "open_max": open_max}
    return field(default=default, metadata=meta)


def option_table(cls: type, help: str) -> Any:
    """A table of options inside a section (`[parallel.sync]`, `--parallel.sync.every=10`,
    `cfg.parallel.sync.every`): one level deep, its own dataclass of `option` fields."""
    return field(default_factory=cls, metadata={"help": help, "section": cls})


def table_class(f: dataclasses.Field) -> type | None:
    """The dataclass of a field declared with `option_table`, else None."""
    return f.metadata.get("section")


def build_section(section: str, cls: type, values: Mapping[str, Any],
                  from_cli: set[tuple[str, str]], errors: list[str]) -> Any:
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in values.items():
        f = fields.get(key)
        if f is None:
            errors.append(f"{section}.{key}: unknown key{did_you_mean(key, fields, prefix=section + '.')}; "
                          f"keys of [{section}] are {', '.join(fields)}")
            continue
        if (inner := table_class(f)) is not None:
            if not isinstance(value, Mapping):
                errors.append(f"{section}.{key} is a table of options ([{section}.{key}]), got {value!r}; "
                              f"keys of it are {', '.join(g.name for g in dataclasses.fields(inner))}")
                continue
            kwargs[key] = build_section(f"{section}.{key}", inner, value, from_cli, errors)
            continue
        try:
            kwargs[key] = coerce(f, value, (section, key) in from_cli)
        except ValueError as e:
            errors.append(f"{section}.{key}: {e}")
    return cls(**kwargs)


def coerce(f: dataclasses.Field, value: Any, is_text: bool) -> Any:
    typ = f.type if isinstance(f.type, type) else {"int": int, "float": float, "bool": bool, "str": str}[f.type]
    meta = f.metadata
    if typ is bool:
        if is_text:
            low = value.strip().lower()
            if low in ("true", "1", "yes", "on"):
                value = True
            elif low in ("false", "0", "no", "off"):
                value = False
            else:
                raise ValueError(f"expected true or false, got {value!r}")
        elif not isinstance(value, bool):
            raise ValueError(f"expected true or false, got {value!r}")
    elif typ is int:
        if is_text:
            try:
                value = int(value.strip().replace("_", ""))
            except ValueError:
                raise ValueError(f"expected an integer, got {value!r}") from None
        elif isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"expected an integer, got {value!r}")
    elif typ is float:
        if is_text:
            try:
                value = float(value.strip())
            except ValueError:
                raise ValueError(f"expected a number, got {value!r}") from None
        elif isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"expected a number, got {value!r}")
        try:
            value = float(value)
        except OverflowError:  # an integer too large for a float
            raise ValueError(f"expected a finite number, got {value!r}") from None
        if not math.isfinite(value):
            raise ValueError(f"expected a finite number, got {value!r}")
    elif typ is str:
        if not isinstance(value, str):
            raise ValueError(f"expected a string, got {value!r}")
        if "\x00" in value:  # no path or prompt holds one; the OS would refuse it later, less clearly
            raise ValueError(f"{value!r} contains a NUL character")
    choices = meta.get("choices")
    if choices and value not in choices:
        raise ValueError(f"{value!r} is not one of {', '.join(choices)}{did_you_mean(str(value), choices)}")
    lo, hi = meta.get("min"), meta.get("max")
    if lo is not None and value < lo:
        raise ValueError(f"{value!r} is below the minimum {lo}")
    if hi is not None and (value > hi or (meta.get("open_max") and value >= hi)):
        raise ValueError(f"{value!r} must be {'below' if meta.get('open_max') else 'at most'} {hi}")
    return value


def divisors(n: int, limit: int | None = None) -> list[int]:
    ds = [d for d in range(1, n + 1) if n % d == 0]
    return ds[:limit] if limit else ds
