"""`scaletrain schedule` through its command line: the config's names, and bad input refused in
one line (tests/conftest.py: assert_one_clear_line)."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import Case, assert_one_clear_line, run_here


def test_schedule_takes_the_config_names():
    short = run_here("schedule", "--pp", "4", "--microbatches", "8", "--schedule", "interleaved-1f1b",
                     "--virtual", "2")
    named = run_here("schedule", "--parallel.pp=4", "--parallel.pp_microbatches=8",
                     "--parallel.pp_schedule=interleaved-1f1b", "--parallel.pp_virtual_stages=2")
    assert short.returncode == named.returncode == 0, named.stderr
    assert named.stdout == short.stdout and "interleaved-1f1b: 4 stages" in named.stdout


BAD_INPUT = [
    # ---- schedule
    Case("schedule-one-stage", ["schedule", "--pp", "1", "--microbatches", "4"], ("--pp must be at least 2",)),
    Case("schedule-zero-microbatches", ["schedule", "--pp", "2", "--microbatches", "0"],
         ("--microbatches at least 1",)),
    Case("schedule-unknown", ["schedule", "--pp", "2", "--microbatches", "4", "--schedule", "2f2b"],
         ("--schedule '2f2b' is not one of",)),
    Case("schedule-interleaved-one-chunk", ["schedule", "--pp", "2", "--microbatches", "4", "--schedule",
                                            "interleaved-1f1b"], ("interleaved-1f1b needs --virtual 2 or more",)),
    Case("schedule-zero-bubble-three-chunks", ["schedule", "--pp", "2", "--microbatches", "4", "--schedule",
                                               "zero-bubble", "--virtual", "3"], ("--virtual 2",)),
    Case("schedule-too-large-to-draw", ["schedule", "--pp", "2", "--microbatches", "100000000"],
         ("too many to draw (at most 65,536)",)),
    Case("schedule-png-not-png", ["schedule", "--pp", "2", "--microbatches", "4", "--png", "data/meta.json"],
         ("give a file name ending in .png",)),
    Case("schedule-png-folder-missing", ["schedule", "--pp", "2", "--microbatches", "4", "--png", "nodir/s.png"],
         ("the folder nodir does not exist",)),
    Case("schedule-without-microbatches", ["schedule", "--pp", "2"], ("required: --microbatches",)),
    Case("schedule-unknown-flag", ["schedule", "--pp", "2", "--microbatches", "4", "--verbose"],
         ("unexpected arguments: --verbose",)),
]


@pytest.mark.parametrize("case", BAD_INPUT, ids=[c.id for c in BAD_INPUT])
def test_bad_input_gives_one_clear_line(case: Case, workdir: Path, capsys):
    assert_one_clear_line(case, workdir, capsys)
