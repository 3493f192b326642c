"""The shell blocks of the docs (README.md and docs/**/*.md) and their markers: what test_docs_blocks.py runs.

Every ```bash (or ```sh, ```shell) block carries a marker in an HTML comment on the line before it, invisible
on the site:

    <!-- run -->               run as written
    <!-- run: @tiny -->        run, with these sizes added to each command that takes config options
    <!-- run: @short --train.steps=3 -->
    <!-- no-run: REASON -->    not run here (a GPU, several nodes, your own files): skipped with REASON

Sizes are config options (`--section.key=value`) or a named set (SIZES below); they are added to every
`scaletrain` command that takes config options (train, verify, ft-local, bench step, bench techniques),
each only where the command does not give that key itself. A page's blocks run in order, in one fresh
folder, so a later block uses what an earlier one made.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

# the named sizes a marker may give: a model that trains in milliseconds a step, two steps, nothing extra
SIZES = {
    "@short": ["--train.steps=2", "--data.seq_len=32", "--train.global_batch=4", "--train.eval_every=0",
               "--train.sample_tokens=0", "--log.progress=off", "--log.tensorboard=false", "--train.device=cpu"],
    "@tiny": ["--model.dim=64", "--model.n_layers=2", "--model.n_heads=4", "--model.max_seq_len=64",
              "--optim.warmup_steps=1"],
}
SIZES["@tiny"] = SIZES["@tiny"] + SIZES["@short"]

MARKER = re.compile(r"^<!--\s*(run|no-run)(?::\s*(.*?))?\s*-->\s*$")
FENCE = re.compile(r"^```(bash|sh|shell)\s*$")


@dataclass
class Block:
    page: str  # relative to the repository
    line: int  # the fence's line, from 1
    text: str
    run: bool | None  # None: no marker
    sizes: list[str] = field(default_factory=list)
    reason: str = ""

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def expand(words: str) -> list[str]:
    out = []
    for word in words.split():
        if word.startswith("@"):
            if word not in SIZES:
                raise ValueError(f"unknown size set {word}; the sets are {', '.join(SIZES)}")
            out += SIZES[word]
        else:
            out.append(word)
    return out


def blocks_of(path: Path, repo: Path) -> list[Block]:
    lines = path.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        if not FENCE.match(lines[i]):
            if lines[i].startswith("```"):  # another block: skip to its end, so its contents are not read
                i = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), len(lines))
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        marker = MARKER.match(before.strip())
        block = Block(str(path.relative_to(repo)), i + 1, "\n".join(lines[i + 1:end]) + "\n", None)
        if marker:
            block.run = marker.group(1) == "run"
            if block.run:
                block.sizes = expand(marker.group(2) or "")
            else:
                block.reason = (marker.group(2) or "").strip()
        out.append(block)
        i = end + 1
    return out


def doc_pages(repo: Path) -> list[Path]:
    return [repo / "README.md", *sorted((repo / "docs").rglob("*.md"))]


def all_blocks(repo: Path) -> list[Block]:
    return [b for page in doc_pages(repo) for b in blocks_of(page, repo)]


# the commands that take config options, to which a marker's sizes are added
TAKES_OPTIONS = ("train", "verify", "ft-local", "bench step", "bench techniques")


def with_sizes(args: list[str], sizes: list[str]) -> list[str]:
    """A `scaletrain` command line with the sizes added that it does not set itself (only for a command that
    takes config options)."""
    words = [a for a in args[:2] if not a.startswith("-")]
    command = " ".join(words[:2]) if words[:1] == ["bench"] else " ".join(words[:1])
    if command not in TAKES_OPTIONS:
        return list(args)
    given = {a[2:].split("=", 1)[0] for a in args if a.startswith("--") and "." in a.split("=", 1)[0]}
    return [*args, *(s for s in sizes if s[2:].split("=", 1)[0] not in given)]


SHIM = """#!{python}
# `scaletrain` for one docs block: the tree under test, with the block's sizes (tests/cli/docs_blocks.py); a
# fork of the test's command server where SCALETRAIN_CLI_SERVER names one (tests/cli_server.py), else a fresh
# `python -m scaletrain`
import os, sys
path = sys.path[1:]  # a fresh interpreter's, less this script's folder
sys.path[:0] = [{tests!r}, os.path.dirname({tests!r})]
from docs_blocks import with_sizes
args = with_sizes(sys.argv[1:], {sizes!r})
if os.environ.get("SCALETRAIN_CLI_SERVER"):
    from cli_server import client
    client(os.environ["SCALETRAIN_CLI_SERVER"], args, path)
os.execv(sys.executable, [sys.executable, "-m", "scaletrain", *args])
"""


def write_shims(bin_dir: Path, python: str, sizes: list[str]) -> None:
    """`scaletrain` and `python` on the block's PATH: this interpreter, and the sizes its marker gives."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    shims = {"scaletrain": SHIM.format(python=python, tests=str(Path(__file__).parent), sizes=sizes),
             "python": f'#!/bin/sh\nexec "{python}" "$@"\n'}
    for name, text in shims.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
