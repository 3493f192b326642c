"""The package's shape (issue 13): one Layout, one worker entry point, and the import
boundaries ARCHITECTURE.md draws — the config does not reach into the parallel engines, and
the planner and the trainer stand apart (what both need lives beside them: scaletrain.layout,
scaletrain.hardware, scaletrain.model.loss; what uses both sits above them: measure, verify)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import scaletrain

PACKAGE = Path(scaletrain.__file__).parent


def imported_modules(path: Path) -> set[str]:
    """Every scaletrain module `path` imports, at the top or inside a function."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m.startswith("scaletrain")}


def offenders(files, forbidden: tuple[str, ...]) -> list[str]:
    return [f"{f.relative_to(PACKAGE)} imports {m}" for f in files for m in sorted(imported_modules(f))
            if m.startswith(forbidden)]


@pytest.mark.parametrize("files,forbidden", [
    ([PACKAGE / "config.py"], ("scaletrain.parallel", "scaletrain.plan", "scaletrain.train")),
    (sorted((PACKAGE / "plan").glob("*.py")), ("scaletrain.train", "scaletrain.parallel.launch")),
    (sorted((PACKAGE / "train").glob("*.py")), ("scaletrain.plan",)),
    ([PACKAGE / "layout.py"], ("scaletrain.parallel", "scaletrain.plan", "scaletrain.train", "torch")),
], ids=["config", "plan", "train", "layout"])
def test_import_boundaries(files, forbidden):
    assert files and not offenders(files, forbidden)


def test_the_boundary_check_sees_a_local_import(tmp_path):
    f = tmp_path / "x.py"
    f.write_text("def g():\n    from scaletrain.train.trainer import Trainer\n")
    assert imported_modules(f) == {"scaletrain.train.trainer", "scaletrain.train.trainer.Trainer"}


def test_every_rank_starts_through_the_one_worker_program():
    """No module of the package is a worker program of its own any more: `python -m` of it
    would do nothing, and the launcher can only start scaletrain.worker."""
    mains = [str(f.relative_to(PACKAGE)) for f in PACKAGE.rglob("*.py")
             if 'if __name__ == "__main__"' in f.read_text()]
    assert sorted(mains) == ["cli.py", "worker.py"]  # (__main__.py runs the CLI unguarded)


def test_an_unknown_worker_task_is_one_line_and_exit_2():
    r = subprocess.run([sys.executable, "-m", "scaletrain.worker", "nope"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip() == ("scaletrain: error: rank 0: unknown worker task 'nope'; known: train, verify, "
                                "measure, bench-techniques, bench-comms or MODULE:FUNCTION")
