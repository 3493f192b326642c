"""Every shell block of the docs is marked, and every block marked runnable runs (docs/testing.md, "Runnable
docs"): a doctest for the shell, each page's blocks in order in a fresh folder, on the CPU, with the sizes
their markers give; a block that needs a GPU, several nodes or the user's own files says so and is skipped."""

from __future__ import annotations

import os
import resource
import signal
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
SRC = str(Path(scaletrain.__file__).parents[1])  # the tree under test


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


@pytest.fixture(scope="module")
def cli_server(tmp_path_factory):
    """One command server for the blocks (tests/cli_server.py: torch and scaletrain imported once, each
    command a fork), on this tree."""
    from cli_server import Server

    server = Server(tmp_path_factory.mktemp("cli-server"), SRC)
    yield server
    server.close()


@pytest.mark.slow  # fresh interpreters beside the server's forks
def test_a_command_forked_from_the_server_is_what_a_fresh_interpreter_gives(tmp_path, cli_server):
    """The same script through the shim, its commands fresh interpreters and forks of the command server: the same
    output, errors and exit codes, the folder and the environment the shell gave (tests/cli_server.py); and the
    forks were the server's (it counts what it ran), but where torch would have read another OMP_NUM_THREADS."""
    script = ("scaletrain train --print-config=json --optim.name=sgd --log.run_dir=\"$RUN\"\n"
              "scaletrain trian || echo \"exit $?\"\n"
              "mkdir -p sub && cd sub && scaletrain train --config my.toml || echo \"exit $?\"\n")
    write_shims(tmp_path / "bin", sys.executable, ["--train.steps=3"])
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "PYTHONPATH": SRC, "RUN": "runs/x"}
    served = len(Path(cli_server.log).read_text().splitlines())
    outputs = []
    for extra in ({}, {"SCALETRAIN_CLI_SERVER": cli_server.socket}):
        r = subprocess.run(["bash", "-c", script], cwd=tmp_path, env={**env, **extra}, capture_output=True, text=True,
                           timeout=600)
        outputs.append((r.returncode, r.stdout, r.stderr))
    assert outputs[0] == outputs[1]
    code, out, err = outputs[1]
    assert code == 0 and '"name": "sgd"' in out and '"steps": 3' in out and '"run_dir": "runs/x"' in out
    assert out.count("exit 2") == 2 and "did you mean train?" in err and "my.toml" in err
    assert len(Path(cli_server.log).read_text().splitlines()) == served + 3
    r = subprocess.run(["bash", "-c", "scaletrain --version"], cwd=tmp_path, capture_output=True, text=True,
                       env={**env, "SCALETRAIN_CLI_SERVER": cli_server.socket, "OMP_NUM_THREADS": "2"}, timeout=600)
    assert r.returncode == 0 and r.stdout.startswith("scaletrain ")
    assert len(Path(cli_server.log).read_text().splitlines()) == served + 3  # a fresh interpreter ran it


def run_page(page: str, folder: Path, server: str) -> str | None:
    """A page's runnable blocks, in order, in one fresh folder, their `scaletrain` commands forked from the
    command server at `server` (tests/cli_server.py): None, or what failed (the block's place, its text and the
    end of its output)."""
    env = {**os.environ, "PATH": f"{folder / 'bin'}:{os.environ['PATH']}", "MPLBACKEND": "Agg",
           "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]), "SCALETRAIN_CLI_SERVER": server}
    work = folder / "work"
    work.mkdir(parents=True)
    for block in (b for b in BLOCKS if b.page == page and b.run):
        write_shims(folder / "bin", sys.executable, block.sizes)
        r = run_block(block.text, work, env)
        if r is None:
            return f"{block.where} did not end within {BLOCK_TIMEOUT_S} s:\n{block.text}"
        if r.returncode != 0:
            return f"{block.where} exited {r.returncode}:\n{block.text}\n{(r.stdout + r.stderr)[-3000:]}"
    return None


def run_block(text: str, cwd: Path, env: dict) -> subprocess.CompletedProcess | None:
    """A block's text run by bash in a session of its own; None if it outlasts BLOCK_TIMEOUT_S, and then every
    process of the session is killed (a command a block started goes too, not only its shell)."""
    proc = subprocess.Popen(["bash", "-e", "-o", "pipefail", "-c", text], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=BLOCK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.slow
@pytest.mark.multiproc
def test_every_runnable_block_runs(tmp_path, cli_server):
    """Two pages at a time (a block's commands wait on each other's ranks, and on the shared machine)."""
    t0, cpu0 = time.monotonic(), resource.getrusage(resource.RUSAGE_CHILDREN)
    with ThreadPoolExecutor(2) as pool:
        failed = [f for f in pool.map(lambda i_page: run_page(i_page[1], tmp_path / str(i_page[0]), cli_server.socket),
                                      enumerate(RUNNABLE_PAGES)) if f]
    cpu = resource.getrusage(resource.RUSAGE_CHILDREN)
    runnable = sum(1 for b in BLOCKS if b.run)
    print(f"\n{runnable} runnable blocks on {len(RUNNABLE_PAGES)} pages: {time.monotonic() - t0:.0f} s, "
          f"{cpu.ru_utime + cpu.ru_stime - cpu0.ru_utime - cpu0.ru_stime:.0f} s of CPU here, "
          f"{cli_server.cpu_s():.0f} s in the server's commands")
    assert failed == [], "\n\n".join(failed)
