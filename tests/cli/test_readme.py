"""What the README shows a new user is what happens: the files it names exist, and the error lines it
prints are the ones the command prints (issue 47: a config that did not exist, an old suggestion)."""

from __future__ import annotations

import re

from conftest import REPO, run_here

README = (REPO / "README.md").read_text()


def test_every_config_file_the_docs_name_exists():
    docs = [README, *(p.read_text() for p in sorted((REPO / "docs").rglob("*.md")))]
    named = sorted({m for text in docs for m in re.findall(r"\bconfigs/[\w.-]+\.toml\b", text)})
    assert named and [n for n in named if not (REPO / n).is_file()] == []


def shown_output(command: str) -> list[str]:
    """The lines the README shows under `$ COMMAND` in a code block, up to the block's end."""
    block = README.split(f"$ {command}\n", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line]


def test_the_bad_input_example_prints_what_the_readme_shows():
    command = "scaletrain train --train.stpes=5 --precision.mode=bf16"
    r = run_here(*command.split()[1:])
    assert r.returncode == 2
    got = r.stderr.splitlines()
    shown = shown_output(command)
    assert len(got) == len(shown)
    for line, want in zip(got, shown):  # "..." in the README stands for the rest of a long line
        assert line.startswith(want.removesuffix("...")) if want.endswith("...") else line == want, (line, want)
