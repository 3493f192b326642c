"""Every shell block of the docs is marked, and every block marked runnable runs (docs/testing.md, "Runnable
docs"): a doctest for the shell, each page's blocks in order in a fresh folder, on the CPU, with the sizes
their markers give; a block that needs a GPU, several nodes or the user's own files says so and is skipped."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import scaletrain

from conftest import REPO
from docs_blocks import SIZES, all_blocks, blocks_of, expand, with_sizes, write_shims

BLOCKS = all_blocks(REPO)
RUNNABLE_PAGES = sorted({b.page for b in BLOCKS if b.run})
BLOCK_TIMEOUT_S = 300


def test_every_shell_block_says_whether_it_runs():
    unmarked = [b.where for b in BLOCKS if b.run is None]
    assert unmarked == [], "put <!-- run: SIZES --> or <!-- no-run: REASON --> on the line before each block"
    assert [b.where for b in BLOCKS if b.run is False and not b.reason] == [], "a no-run marker needs its reason"
    # the floor: the getting-started path, the adapters and Hugging Face journeys and a guide per
    # capability run
    guides = sorted(p.name for p in (REPO / "docs" / "guides").glob("*.md"))
    ran = {Path(page).name for page in RUNNABLE_PAGES}
    assert {"getting-started.md", "adapters.md", "hugging-face.md"} <= ran
    assert [g for g in guides if g not in ran] == ["nodes.md"]  # several nodes: none here


def test_a_marker_gives_sizes_that_fill_only_what_a_command_leaves_unset(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("text\n\n<!-- run: @short --train.steps=7 -->\n\n```bash\nscaletrain train\n```\n\n"
                    "```bash\nls\n```\n\n<!-- no-run: needs 8 GPUs -->\n```sh\nscaletrain train --nproc 8\n```\n"
                    "```text\n<!-- run -->\n```\n")
    one, two, three = blocks_of(page, tmp_path)
    assert (one.run, one.line, one.text) == (True, 5, "scaletrain train\n")
    assert one.sizes == [*SIZES["@short"], "--train.steps=7"]
    assert two.run is None and (three.run, three.reason) == (False, "needs 8 GPUs")
    # the block's own keys win over the marker's; commands without config options get none
    args = with_sizes(["train", "--train.steps=40", "--data.seq_len", "64"], ["--train.steps=2", "--log.every=1"])
    assert args == ["train", "--train.steps=40", "--data.seq_len", "64", "--log.every=1"]
    assert with_sizes(["bench", "step", "--steps", "2"], ["--train.steps=2"])[-1] == "--train.steps=2"
    assert with_sizes(["bench", "comms", "--nproc", "2"], ["--train.steps=2"]) == ["bench", "comms", "--nproc", "2"]
    assert with_sizes(["plan", "llama-8b"], ["--train.steps=2"]) == ["plan", "llama-8b"]
    with pytest.raises(ValueError, match="unknown size set @huge"):
        expand("@huge")


def test_the_shim_runs_this_tree_with_the_sizes(tmp_path):
    write_shims(tmp_path / "bin", sys.executable, ["--train.steps=3"])
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}",
           "PYTHONPATH": str(Path(scaletrain.__file__).parents[1])}
    r = subprocess.run(["bash", "-c", "scaletrain train --print-config=json"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert '"steps": 3' in r.stdout


def run_page(page: str, folder: Path) -> str | None:
    """A page's runnable blocks, in order, in one fresh folder: None, or what failed (the block's place, its
    text and the end of its output)."""
    env = {**os.environ, "PATH": f"{folder / 'bin'}:{os.environ['PATH']}", "MPLBACKEND": "Agg",
           "PYTHONPATH": os.pathsep.join([str(Path(scaletrain.__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    work = folder / "work"
    work.mkdir(parents=True)
    for block in (b for b in BLOCKS if b.page == page and b.run):
        write_shims(folder / "bin", sys.executable, block.sizes)
        try:
            r = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", block.text], cwd=work, env=env,
                               capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return f"{block.where} did not end within {BLOCK_TIMEOUT_S} s:\n{block.text}"
        if r.returncode != 0:
            return f"{block.where} exited {r.returncode}:\n{block.text}\n{(r.stdout + r.stderr)[-3000:]}"
    return None


@pytest.mark.slow
@pytest.mark.multiproc
def test_every_runnable_block_runs(tmp_path):
    """Two pages at a time (most of a block's time is an interpreter starting, on one core)."""
    t0, cpu0 = time.monotonic(), resource.getrusage(resource.RUSAGE_CHILDREN)
    with ThreadPoolExecutor(2) as pool:
        failed = [f for f in pool.map(lambda i_page: run_page(i_page[1], tmp_path / str(i_page[0])),
                                      enumerate(RUNNABLE_PAGES)) if f]
    cpu = resource.getrusage(resource.RUSAGE_CHILDREN)
    runnable = sum(1 for b in BLOCKS if b.run)
    print(f"\n{runnable} runnable blocks on {len(RUNNABLE_PAGES)} pages: {time.monotonic() - t0:.0f} s, "
          f"{cpu.ru_utime + cpu.ru_stime - cpu0.ru_utime - cpu0.ru_stime:.0f} s of CPU")
    assert failed == [], "\n\n".join(failed)
