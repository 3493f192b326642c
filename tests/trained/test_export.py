"""`scaletrain export`: the folders it creates, the umask it follows, what it overwrites (on
request only), and bad input refused in one line (tests/conftest.py: assert_one_clear_line)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from conftest import CKPT, Case, assert_one_clear_line, run_here, write


def test_export_creates_folders_follows_the_umask_and_overwrites_on_request(finished_run, tmp_path):
    old = os.umask(0o027)
    try:
        out = tmp_path / "exp" / "sub" / "model.safetensors"
        r = run_here("export", str(finished_run), "--out", str(out))
        assert r.returncode == 0, r.stderr
        assert out.stat().st_mode & 0o777 == 0o640
        again = run_here("export", str(finished_run), "--out", str(out))
        assert again.returncode == 2 and "add --overwrite to replace it" in again.stderr
        out.write_bytes(b"stale")
        assert run_here("export", str(finished_run), "--out", str(out), "--overwrite").returncode == 0
        assert out.stat().st_size > 1000 and out.stat().st_mode & 0o777 == 0o640
        hf = tmp_path / "exp" / "hf"
        assert run_here("export", str(finished_run), "--format", "hf", "--out", str(hf)).returncode == 0
        (hf / "stale.txt").write_text("old")
        assert run_here("export", str(finished_run), "--format", "hf", "--out", str(hf)).returncode == 2
        assert run_here("export", str(finished_run), "--format", "hf", "--out", str(hf), "--overwrite").returncode == 0
        assert not (hf / "stale.txt").exists()  # replaced whole
        assert {f.stat().st_mode & 0o777 for f in hf.iterdir()} == {0o640}
        assert not [p for p in hf.parent.iterdir() if p.name.startswith(".")]  # nothing left aside
    finally:
        os.umask(old)


BAD_INPUT = [
    Case("export-missing", ["export", "nope", "--out", "m.safetensors"],
         ("nope is not a complete scaletrain checkpoint",)),
    Case("export-not-a-checkpoint", ["export", "data", "--out", "m.safetensors"], ("data is not a complete",)),
    Case("export-over-existing-file", ["export", CKPT, "--out", "data/meta.json"],
         ("data/meta.json already exists", "nothing was overwritten")),
    Case("export-without-out", ["export", CKPT], ("the following arguments are required: --out",)),
    Case("export-metadata-garbage", ["export", CKPT, "--out", "m.safetensors"], ("is damaged (.metadata has 9 bytes",),
         write(f"{CKPT}/.metadata", b"\x80\x04garbage")),
    Case("export-with-overrides", ["export", CKPT, "--out", "m.safetensors", "--model.dim=3"],
         ("unexpected arguments: --model.dim=3",)),
]


@pytest.mark.parametrize("case", BAD_INPUT, ids=[c.id for c in BAD_INPUT])
def test_bad_input_gives_one_clear_line(case: Case, workdir: Path, capsys):
    assert_one_clear_line(case, workdir, capsys)


def test_what_a_killed_export_left_is_removed_by_the_next(finished_run, tmp_path):
    """A writer killed inside atomic.replacing (SIGKILL: no cleanup runs) leaves its temporary
    `.NAME.partial-PID` beside the target; the next export (or quantize) of that target removes
    it. A temporary name of a process still running is left alone."""
    import signal
    import subprocess
    import sys

    out = tmp_path / "model.safetensors"
    killed = subprocess.run([sys.executable, "-c", (
        "import os, signal, sys\n"
        "from scaletrain import atomic\n"
        "with atomic.replacing(sys.argv[1]) as tmp:\n"
        "    tmp.write_bytes(b'half of an export')\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"), str(out)], capture_output=True, text=True)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    left = [p for p in tmp_path.iterdir() if p.name.startswith(".model.safetensors.partial-")]
    assert len(left) == 1 and left[0].read_bytes() == b"half of an export"
    writer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])  # a writer still running
    try:
        alive = tmp_path / f".model.safetensors.partial-{writer.pid}"
        alive.write_bytes(b"in use")
        r = run_here("export", str(finished_run), "--out", str(out))
        assert r.returncode == 0, r.stderr
        assert not left[0].exists() and alive.exists() and out.stat().st_size > 1000
    finally:
        writer.kill()
        writer.wait()
