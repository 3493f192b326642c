"""scaletrain.console: each line a process writes carries its part of the job (ft-local's groups)."""

from __future__ import annotations

import io
import os
import subprocess
import sys

from scaletrain.console import PREFIX_ENV, PrefixedLines

from conftest import REPO


def test_every_line_gets_the_prefix_whatever_the_writes_cut():
    out = io.StringIO()
    s = PrefixedLines(out, "[group 1] ")
    s.write("step 1 ")
    s.write("loss 2.0\nstep 2\n\nhalf")
    s.write(" a line\r\x1b[Kbar 50%\rbar 100%\n")
    assert out.getvalue() == ("[group 1] step 1 loss 2.0\n[group 1] step 2\n\n[group 1] half a line\r"
                              "[group 1] \x1b[Kbar 50%\r[group 1] bar 100%\n")


def test_a_program_given_the_prefix_writes_it_on_stdout_and_stderr():
    """`scaletrain` started with SCALETRAIN_LINE_PREFIX (as ft-local starts each group): its lines, a
    refusal's included, carry the prefix."""
    done = subprocess.run([sys.executable, "-m", "scaletrain", "train", "--train.steps=-1"], cwd=REPO,
                          capture_output=True, text=True, env={**os.environ, PREFIX_ENV: "[group 3] "})
    assert done.returncode == 2
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert lines and all(line.startswith("[group 3] scaletrain: ") for line in lines), lines
