"""Verifiable rewards for RL (issue 50): Python callables named `module:function`, several with weights.

A reward is called once per batch of rollouts as

    fn(prompts, completions, **fields) -> one float per completion

prompts and completions are lists of strings (row i's prompt repeated for each of its G completions);
fields holds the prompt dataset's other columns, row-aligned (an `answer` column, say), and
`completion_ids`, the completions' token ids. A reward names the fields it needs as positional
parameters and ignores the rest (`**_`); its settings (a pattern, a maximum length) are keyword-only
parameters (after `*`), bound from the config when the reward is loaded:

    def my_reward(prompts, completions, answer, *, tolerance=0.0, **_): ...

Everything the user can get wrong is one ConfigError line naming the reward: a module that does not
import, a function it lacks, an argument the function does not take, a field the data lacks, a reward
that raises (with the first row it raises on), returns the wrong number of values or a value that is not
a finite number (with the row).

Built in: `answer_match` (the answer extracted from a completion, the last \\boxed{...} or the last number,
equals the row's answer), `format_match` (a completion matches a regular expression whole) and
`overlong_penalty` (DAPO's soft punishment of completions near or over the length limit).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from scaletrain.errors import ConfigError
from scaletrain.model import rl

KEY = "rl.rewards"  # the config key the errors name

# --------------------------------------------------------------------------------------------
# Loading


@dataclass(frozen=True)
class Reward:
    """A loaded reward: its `module:function` name, weight, and the callable with its arguments bound.

    The function's parameters after (prompts, completions) say what it takes: positional ones are row
    fields of the data, keyword-only ones (after `*`) are arguments set in the config."""

    name: str
    fn: Callable[..., Sequence[float]]
    weight: float = 1.0
    args: Mapping[str, object] = field(default_factory=dict)

    def needs(self) -> list[str]:
        """The row fields the function requires: its keyword parameters without a default, unbound."""
        params = list(inspect.signature(self.fn).parameters.values())[2:]  # after prompts, completions
        return [p.name for p in params if p.default is p.empty and p.kind is p.POSITIONAL_OR_KEYWORD]


def _import(spec: str):
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"{KEY}: {spec!r} is not module:function (e.g. scaletrain.objectives.rewards:answer_match)")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # a module that fails to import, for any reason, is the user's to fix
        raise ConfigError(f"{KEY}: reward module {module_name!r} does not import ({type(e).__name__}: {e}); "
                          f"check it is on PYTHONPATH and imports alone") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        have = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
                      and getattr(v, "__module__", None) == module.__name__)
        raise ConfigError(f"{KEY}: module {module_name!r} has no function {attr!r}; it defines: "
                          f"{', '.join(have) or 'no functions'}")
    return fn


def load_reward(spec: str, weight: float = 1.0, args: Mapping[str, object] | None = None) -> Reward:
    """The reward named `module:function`, its configured keyword arguments bound."""
    fn, args = _import(spec), dict(args or {})
    if not math.isfinite(weight):
        raise ConfigError(f"{KEY}: the weight of {spec} is {weight}; give a finite number")
    try:
        params = inspect.signature(fn).bind_partial([], [], **args).signature.parameters.values()
    except TypeError as e:
        raise ConfigError(f"{KEY}: {spec} does not take the arguments {sorted(args)} ({e})") from None
    unset = [p.name for p in params if p.kind is p.KEYWORD_ONLY and p.default is p.empty and p.name not in args]
    if unset:
        raise ConfigError(f"{KEY}: {spec} needs the argument(s) {', '.join(unset)}; set them in its args")
    reward = Reward(spec, functools.partial(fn, **args) if args else fn, float(weight), args)
    if fn.__module__ == __name__:  # a built-in checks its arguments on an empty batch, before any rollout
        try:
            fn([], [], **{f: [] for f in reward.needs()}, **args)
        except (ValueError, re.error) as e:
            raise ConfigError(f"{KEY}: {spec}: {e}") from None
    return reward


def check_fields(rewards: Sequence[Reward], fields: Sequence[str]) -> None:
    """Refuse, before any rollout, a reward that needs a field the prompt dataset does not have."""
    have = set(fields) | {"completion_ids"}
    for reward in rewards:
        missing = [f for f in reward.needs() if f not in have]
        if missing:
            raise ConfigError(f"{KEY}: {reward.name} needs the field(s) {', '.join(missing)}, which the prompt "
                              f"dataset lacks (it has: {', '.join(sorted(fields)) or 'no other fields'})")


# --------------------------------------------------------------------------------------------
# Scoring


@dataclass
class Scores:
    """The weighted sum of the rewards per completion (B,) and each reward's own scores, unweighted."""

    total: torch.Tensor
    each: dict[str, torch.Tensor]


def _row_that_raises(reward: Reward, prompts, completions, fields) -> int:
    """The first row the reward raises on alone; -1 if it raises only on the whole batch."""
    for i in range(len(completions)):
        try:
            reward.fn([prompts[i]], [completions[i]], **{k: [v[i]] for k, v in fields.items()})
        except Exception:
            return i
    return -1


def _call(reward: Reward, prompts, completions, fields) -> list[float]:
    try:
        values = reward.fn(prompts, completions, **fields)
    except Exception as e:
        row = _row_that_raises(reward, prompts, completions, fields)
        where = f"on row {row}" if row >= 0 else "on the batch"
        raise ConfigError(f"{KEY}: reward {reward.name} raised {where}: {type(e).__name__}: {e}") from None
    values = list(values) if not isinstance(values, torch.Tensor) else values.tolist()
    if len(values) != len(completions):
        raise ConfigError(f"{KEY}: reward {reward.name} returned {len(values)} values for {len(completions)} "
                          f"completions; return one float per completion")
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ConfigError(f"{KEY}: reward {reward.name} returned {v!r} for row {i}; "
                              f"a reward is a finite number")
    return [float(v) for v in values]


def score(rewards: Sequence[Reward], prompts: Sequence[str], completions: Sequence[str],
          fields: Mapping[str, Sequence] | None = None) -> Scores:
    """Every reward on every completion, checked, and their weighted sum."""
    fields = dict(fields or {})
    for name, column in {"prompts": prompts, **fields}.items():  # our callers' invariant: one entry per completion
        if len(column) != len(completions):
            raise ValueError(f"{name} has {len(column)} rows for {len(completions)} completions")
    each = {r.name: torch.tensor(_call(r, list(prompts), list(completions), fields)) for r in rewards}
    total = torch.zeros(len(completions))
    for r in rewards:
        total = total + r.weight * each[r.name]
    return Scores(total, each)


# --------------------------------------------------------------------------------------------
# Built-in rewards and their answer extractors

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def last_boxed(text: str) -> str | None:
    """The contents of the last \\boxed{...}, braces inside it balanced; None if there is none (or unclosed)."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for i in range(begin, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth < 0:
            return text[begin:i].strip()
    return None


def last_number(text: str) -> str | None:
    """The last number written in the text, thousands separators dropped ("1,024" -> "1024"); None if none."""
    found = _NUMBER.findall(text)
    return found[-1].replace(",", "") if found else None


def first_line(text: str) -> str | None:
    """The completion's first line, stripped (an answer written alone on its line); None if it is empty."""
    line = text.split("\n", 1)[0].strip()
    return line or None


EXTRACTORS = {"boxed": last_boxed, "last_number": last_number, "first_line": first_line}


def _same_answer(got: str | None, want: str) -> bool:
    if got is None:
        return False
    got, want = got.strip(), str(want).strip()
    try:
        return float(got.replace(",", "")) == float(want.replace(",", ""))  # "12" is "12.0", "1,200" is "1200"
    except ValueError:
        return got == want


def answer_match(prompts, completions, answer, *, extractor: str = "boxed", **_) -> list[float]:
    """1.0 where the answer extracted from the completion equals the row's `answer` field (as numbers
    when both read as numbers, else as stripped text), else 0.0. extractor: boxed | last_number | first_line."""
    if extractor not in EXTRACTORS:
        raise ValueError(f"unknown extractor {extractor!r}; one of {tuple(EXTRACTORS)}")
    extract = EXTRACTORS[extractor]
    return [float(_same_answer(extract(c), a)) for c, a in zip(completions, answer)]


def format_match(prompts, completions, *, pattern: str, **_) -> list[float]:
    """1.0 where the whole completion matches the regular expression `pattern` (. matching newlines too)."""
    compiled = re.compile(pattern, re.DOTALL)
    return [float(compiled.fullmatch(c) is not None) for c in completions]


def overlong_penalty(prompts, completions, completion_ids, *, max_length: int, cache: int, **_) -> list[float]:
    """DAPO's soft overlong punishment on the completions' token counts: 0 up to max_length - cache,
    falling linearly to -1 at max_length, -1 beyond (scaletrain.model.rl.overlong_penalty)."""
    return rl.overlong_penalty([len(ids) for ids in completion_ids], max_length, cache).tolist()
