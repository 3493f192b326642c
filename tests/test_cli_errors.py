"""The command line itself: verbs and flags that do not exist get a "did you mean", `--version`
says what runs, and the bad-input corpus of every subject together stays large and distinct."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

from conftest import Case, assert_one_clear_line, run_here, train_args


def test_did_you_mean_for_verbs_and_launcher_flags_and_a_version():
    r = run_here("trian")
    assert r.returncode == 2 and r.stderr.count("scaletrain") <= 3  # no "scaletrain: error: scaletrain:"
    assert "scaletrain: error: scaletrain:" not in r.stderr and "(did you mean train?)" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    r = run_here("train", "--nprocs", "2")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "'--nprocs' (did you mean --nproc?)" in r.stderr
    r = run_here("--version")
    assert r.returncode == 0 and re.fullmatch(r"scaletrain \S+ \(torch \S+, python \S+\)\n", r.stdout), r.stdout


BAD_INPUT = [
    Case("no-subcommand", [], ("the following arguments are required: verb",)),
    Case("unknown-subcommand", ["fit"], ("invalid choice: 'fit'",)),
    Case("train-unknown-flag", train_args("--verbose"), ("unexpected argument '--verbose'",)),
]


@pytest.mark.parametrize("case", BAD_INPUT, ids=[c.id for c in BAD_INPUT])
def test_bad_input_gives_one_clear_line(case: Case, workdir: Path, capsys):
    assert_one_clear_line(case, workdir, capsys)


def every_bad_input() -> list[Case]:
    """The BAD_INPUT cases of every test file (each subject lists its own)."""
    cases = []
    for path in sorted(Path(__file__).parent.glob("test_*.py")):
        if "\nBAD_INPUT = [" in path.read_text():
            cases += importlib.import_module(path.stem).BAD_INPUT
    return cases


def test_corpus_is_large_and_distinct():
    CASES = every_bad_input()
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids))
    plain = [tuple(c.argv) for c in CASES if c.prep is None]  # (a prepared case differs by its files)
    assert len(plain) == len(set(plain))
    assert len(CASES) >= 55
