"""Every shell block of the docs is marked, and every block marked runnable runs (docs/testing.md, "Runnable
docs"): a doctest for the shell, each page's blocks in order in a fresh folder, on the CPU, with the sizes
their markers give; a block that needs a GPU, several nodes or the user's own files says so and is skipped."""

from __future__ import annotations

import os
import subprocess
import sys
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


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("page", RUNNABLE_PAGES)
def test_the_runnable_blocks_of_each_page_run(page, tmp_path):
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}",
           "PYTHONPATH": os.pathsep.join([str(Path(scaletrain.__file__).parents[1]), os.environ.get("PYTHONPATH", "")]),
           "MPLBACKEND": "Agg"}
    work = tmp_path / "work"
    work.mkdir()
    for block in (b for b in BLOCKS if b.page == page):
        if not block.run:
            continue
        write_shims(tmp_path / "bin", sys.executable, block.sizes)
        r = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", block.text], cwd=work, env=env,
                           capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)
        assert r.returncode == 0, f"{block.where} exited {r.returncode}:\n{block.text}\n{(r.stdout + r.stderr)[-3000:]}"
