"""The package's shape (issue 13): one Layout, one worker entry point, and the import
boundaries ARCHITECTURE.md draws — the config does not reach into the parallel engines, and
the planner and the trainer stand apart (what both need lives beside them: scaletrain.layout,
scaletrain.hardware, scaletrain.model.loss; what uses both sits above them: measure, verify)."""

from __future__ import annotations

import ast
import re
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
    (sorted((PACKAGE / "plan").glob("*.py")), ("scaletrain.train", "scaletrain.launch.launcher")),
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
    would do nothing, and the launcher can only start scaletrain.launch.worker."""
    mains = [str(f.relative_to(PACKAGE)) for f in PACKAGE.rglob("*.py")
             if 'if __name__ == "__main__"' in f.read_text()]
    assert sorted(mains) == ["cli/__main__.py", "launch/worker.py"]  # (__main__.py runs the CLI unguarded)


def test_an_unknown_worker_task_is_one_line_and_exit_2():
    r = subprocess.run([sys.executable, "-m", "scaletrain.launch.worker", "nope"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip() == ("scaletrain: error: rank 0: unknown worker task 'nope'; known: train, verify, "
                                "measure, bench-techniques, bench-comms, calibrate or MODULE:FUNCTION")


# ------------------------------------------------------------------------------------------
# The house's shape (issue 18): no import loop, parallel/ holds techniques only, model/ stands
# alone, no mutable module state, each vocabulary defined once


def module_name(path: Path, package: Path = PACKAGE) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (at the top or inside a function): `from
    scaletrain.x import y` is an edge to scaletrain.x.y where that is a module, else to scaletrain.x."""
    files = {module_name(f, package): f for f in package.rglob("*.py")}
    graph = {}
    for name, f in files.items():
        found = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.update(f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in files else node.module
                             for a in node.names)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
        graph[name] = {m for m in found if m in files} - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_anywhere_in_the_package():
    assert cycles(import_graph()) == []


def test_the_cycle_check_finds_a_loop_through_a_local_import(tmp_path):
    pkg = tmp_path / "scaletrain"
    (pkg / "model").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "model" / "__init__.py").write_text("")
    (pkg / "config.py").write_text("def f():\n    from scaletrain.model.hf import g\n")
    (pkg / "model" / "hf.py").write_text("from scaletrain.config import f\n")
    assert cycles(import_graph(pkg)) == [["scaletrain.config", "scaletrain.model.hf"]]


@pytest.mark.parametrize("folder,forbidden", [
    ("parallel", ("scaletrain.plan", "scaletrain.train", "scaletrain.cli", "scaletrain.launch.launcher",
                  "scaletrain.launch.worker", "scaletrain.launch.job")),
    ("model", ("scaletrain.config", "scaletrain.parallel", "scaletrain.train", "scaletrain.plan")),
    ("model/families", ("scaletrain.config", "scaletrain.parallel", "scaletrain.train", "scaletrain.plan")),
    ("rollout", ("scaletrain.config", "scaletrain.parallel", "scaletrain.train", "scaletrain.plan")),
])
def test_folder_boundaries(folder, forbidden):
    files = sorted((PACKAGE / folder).glob("*.py"))
    assert files and not offenders(files, forbidden)


def test_the_worker_does_not_import_the_cli():
    assert not offenders([PACKAGE / "launch" / "worker.py"], ("scaletrain.cli",))


def test_parallel_holds_techniques_only():
    """The launcher, the runtime, the watchdog and the schedule simulator live outside parallel/."""
    names = {f.stem for f in (PACKAGE / "parallel").glob("*.py")}
    assert not names & {"launch", "launcher", "runtime", "watchdog", "timeline"}


_MUTABLE_CALLS = ("list", "dict", "set", "defaultdict", "OrderedDict", "deque", "Counter")


def mutable_module_state(path: Path) -> list[str]:
    """`global` statements, and module-level names bound to a mutable container that are not
    constants (UPPER_CASE)."""
    tree = ast.parse(path.read_text())
    found = [f"{path.name}:{n.lineno} global {', '.join(n.names)}" for n in ast.walk(tree) if isinstance(n, ast.Global)]

    def mutable(value) -> bool:
        if isinstance(value, (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)):
            return True
        return isinstance(value, ast.Call) and getattr(value.func, "id", getattr(value.func, "attr", "")) in \
            _MUTABLE_CALLS

    def top_level(body):
        for node in body:
            if isinstance(node, (ast.If, ast.Try)):
                yield from top_level(node.body + node.orelse + getattr(node, "finalbody", []) +
                                     [s for h in getattr(node, "handlers", []) for s in h.body])
            else:
                yield node

    for node in top_level(tree.body):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
        for t in targets:
            name = getattr(t, "id", None)
            if name and not name.isupper() and name != "__all__" and node.value is not None and mutable(node.value):
                found.append(f"{path.name}:{node.lineno} {name}")
    return found


def test_no_mutable_module_state():
    found = [x for f in sorted(PACKAGE.rglob("*.py")) for x in mutable_module_state(f)]
    assert found == []


def test_the_state_check_sees_a_global_and_a_module_cache(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("LIMITS = {'a': 1}\n_cache = {}\n_seen = set()\n_progress = None\n"
                 "def g():\n    global _progress\n    _progress = 1\n")
    assert mutable_module_state(f) == ["m.py:6 global _progress", "m.py:2 _cache", "m.py:3 _seen"]


def test_each_vocabulary_is_defined_once_and_the_tables_keyed_by_it_cover_it():
    """The names live in scaletrain.vocab; tables that say what each name means cover exactly them."""
    from scaletrain import vocab
    from scaletrain.config import option_fields
    from scaletrain.precision import COMPUTE_DTYPES

    fields = {tuple(key.rsplit(".", 1)): f.metadata.get("choices") for key, f in option_fields().items()}
    assert fields[("precision", "mode")] == vocab.PRECISIONS
    assert fields[("optim", "name")] == vocab.OPTIMIZERS
    assert fields[("memory", "activation_checkpointing")] == vocab.AC_MODES
    assert fields[("parallel", "pp_schedule")] == vocab.PP_SCHEDULES
    assert fields[("parallel.sync", "mode")] == vocab.DP_SYNC_MODES
    assert fields[("parallel.sync", "outer_optimizer")] == vocab.OUTER_OPTIMIZERS
    assert fields[("parallel.sync", "dtype")] == vocab.SYNC_DTYPES
    assert set(COMPUTE_DTYPES) == set(vocab.PRECISIONS) == set(vocab.PEAK_KIND)
    # no module types a vocabulary's names as a tuple of its own
    spelled = {"PRECISIONS": '"32-true", "tf32", "16-mixed"', "OPTIMIZERS": '"adamw", "sgd", "adafactor"',
               "PP_SCHEDULES": '"gpipe", "1f1b", "interleaved-1f1b"'}
    for f in PACKAGE.rglob("*.py"):
        if f.name != "vocab.py":
            for name, text in spelled.items():
                assert text not in f.read_text(), f"{f.relative_to(PACKAGE)} types the {name} again"


def test_an_unknown_data_parallel_engine_is_an_error_not_zero():
    import torch

    from scaletrain.config import load_config
    from scaletrain.layout import Layout
    from scaletrain.parallel.parallelize import _engine
    from scaletrain.precision import Precision
    from scaletrain.runtime import Runtime

    cfg = load_config(None, {"parallel.zero": 3})
    layout = Layout(dp_shard=2, zero=5)  # a stage that does not exist
    rt = Runtime(0, 0, 2, 2, torch.device("cpu"), layout)
    with pytest.raises(ValueError, match="unknown data-parallel engine 'zero5'"):
        _engine([], cfg, rt, Precision(cfg.precision, torch.device("cpu")))


# ------------------------------------------------------------------------------------------
# The house, round 2 (issue 30): the techniques own their step work, the Trainer stays small and
# private, no source file grows past what one can read

TRAINER = PACKAGE / "train" / "trainer.py"
STEP_METHODS = ("train_step", "forward_backward", "update")
# what names a technique in a condition of the step: an axis, an engine, a mode
TECHNIQUE_WORDS = {"cp", "tp", "pp", "sp", "ep", "outer", "tied", "fp8", "fp8_scales", "master", "local_sync",
                   "dp_sync", "zero", "dp_engine", "pipeline", "stages", "moe", "experts", "adapter", "lora",
                   "qat", "fault_tolerance", "quorum", "custom_model", "kv"}


def _trainer_class(path: Path) -> ast.ClassDef:
    return next(n for n in ast.parse(path.read_text()).body if isinstance(n, ast.ClassDef) and n.name == "Trainer")


def technique_branches(path: Path) -> list[str]:
    """Conditions (if, conditional expressions, boolean operands) in the Trainer's step methods
    that name a technique."""
    found = []
    for fn in _trainer_class(path).body:
        if not isinstance(fn, ast.FunctionDef) or fn.name not in STEP_METHODS:
            continue
        for node in ast.walk(fn):
            tests = [node.test] if isinstance(node, (ast.If, ast.IfExp, ast.While)) else \
                node.values if isinstance(node, ast.BoolOp) else []
            for test in tests:
                words = {n.attr for n in ast.walk(test) if isinstance(n, ast.Attribute)} | \
                        {n.id for n in ast.walk(test) if isinstance(n, ast.Name)}
                if hit := sorted(words & TECHNIQUE_WORDS):
                    found.append(f"{fn.name}:{test.lineno} {', '.join(hit)}")
    return found


def test_the_trainer_step_names_no_technique():
    assert technique_branches(TRAINER) == []


# what names a technique anywhere in the Trainer (its build included): the step words but the user's own
# module (a Trainer input), and the techniques' own names
TECHNIQUE_NAMES = (TECHNIQUE_WORDS - {"custom_model"}) | {"scaler", "pipeline", "fault_tolerance", "local_sgd",
                                                        "diloco", "replica_groups", "fsdp", "ddp", "dp_replicate",
                                                        "dp_shard", "ReplicaGroups", "LocalSGD", "MasterWeights"}


def technique_names(path: Path) -> list[str]:
    """Names and attributes anywhere in `path` that name a technique."""
    return sorted({f"{path.name}:{n.lineno} {name}" for n in ast.walk(ast.parse(path.read_text()))
                   if isinstance(n, (ast.Name, ast.Attribute))
                   and (name := n.attr if isinstance(n, ast.Attribute) else n.id) in TECHNIQUE_NAMES})


def test_the_trainer_names_no_technique_anywhere():
    """Not in its step (above), nor where it is built: the composition (parallelize, step_hooks), the
    legality check and the layout's facts by role answer for the techniques."""
    assert technique_names(TRAINER) == []


def test_the_name_check_sees_a_technique_built_by_the_trainer(tmp_path):
    planted = tmp_path / "trainer.py"
    planted.write_text("def build(self):\n    self.sync = LocalSGD.for_run(self.layout.dp_replicate)\n")
    assert technique_names(planted) == ["trainer.py:2 LocalSGD", "trainer.py:2 dp_replicate"]


def test_the_trainer_reaches_the_techniques_through_the_composition_alone():
    """The Trainer imports one module of parallel/, the composition: the hooks it calls, the pipeline
    schedule, the norm and the engines' bytes come through parallelize's ParallelModel and step_hooks."""
    files = {module_name(f) for f in PACKAGE.rglob("*.py")}
    reached = {m for m in imported_modules(TRAINER) if m.startswith("scaletrain.parallel") and m in files}
    assert reached == {"scaletrain.parallel.parallelize"}


def test_the_branch_check_sees_a_planted_technique_branch(tmp_path):
    text = TRAINER.read_text()
    anchor = "        self.hooks.reduce_gradients(named)\n"
    assert anchor in text
    planted = tmp_path / "trainer.py"
    planted.write_text(text.replace(anchor, anchor + "        if self.layout.cp > 1:\n            pass\n"))
    assert [b.split(" ", 1)[1] for b in technique_branches(planted)] == ["cp"]
    planted.write_text(text.replace(anchor, anchor + "        x = 1 if self.outer is not None else 0\n"))
    assert [b.split(" ", 1)[1] for b in technique_branches(planted)] == ["outer"]


def trainer_private_names(path: Path = TRAINER) -> set[str]:
    """The Trainer's private members: its _methods and the self._attributes it sets."""
    cls = _trainer_class(path)
    names = {n.name for n in cls.body if isinstance(n, ast.FunctionDef) and n.name.startswith("_")}
    names |= {t.attr for n in ast.walk(cls) if isinstance(n, (ast.Assign, ast.AnnAssign))
              for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
              for t in ast.walk(t) if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
              and t.value.id == "self" and t.attr.startswith("_")}
    return {n for n in names if not n.startswith("__")}


def hook_members(package: Path = PACKAGE, protocol: str = "StepHook") -> dict[str, set[str]]:
    """Each member of `protocol` (scaletrain/hooks.py) -> the modules whose classes below it override it."""
    hooks_py = package / "hooks.py"
    classes = {n.name: n for n in ast.parse(hooks_py.read_text()).body if isinstance(n, ast.ClassDef)}

    def members(cls: ast.ClassDef) -> set[str]:
        return {n.name for n in cls.body if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")} | \
            {t.id for n in cls.body if isinstance(n, (ast.Assign, ast.AnnAssign))
             for t in (n.targets if isinstance(n, ast.Assign) else [n.target]) if isinstance(t, ast.Name)} | \
            {t.attr for n in ast.walk(cls) if isinstance(n, ast.Assign) for t in n.targets
             if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}

    # (phase and key name a hook; say is where the run sends its lines, interruptible what its waits run inside:
    # none is work a technique implements)
    below, found = {protocol}, {m: set() for m in members(classes[protocol]) - {"phase", "key", "say", "interruptible"}}
    trees = {f: ast.parse(f.read_text()) for f in sorted(package.rglob("*.py")) if f != hooks_py}
    grew, every = True, [ast.parse(hooks_py.read_text()), *trees.values()]
    while grew:  # the classes below the protocol, however deep
        grew = False
        for tree in every:
            for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name not in below):
                if any(isinstance(b, ast.Name) and b.id in below for b in cls.bases):
                    below.add(cls.name)
                    grew = True
    for f, tree in trees.items():
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name in below):
            for m in members(cls) & found.keys():
                found[m].add(f.relative_to(package).as_posix())
    return found


def test_every_step_hook_member_has_more_than_one_technique():
    """A member of the step-hook protocol that one technique alone implements belongs to that technique:
    the outer loop's (OuterLoop), the precision's (Precision.loss_scale), the parallel model's
    (ParallelModel.batch_share)."""
    step = hook_members()
    single = {m: where for m, where in step.items() if len(where) < 2}
    assert single == {}, f"step-hook members with one implementer: {single}"
    outer = hook_members(protocol="OuterLoop")
    assert {"start", "writes_checkpoint", "skip_reason", "reported_norm", "data_outer"} <= outer.keys()
    assert all(where <= {"parallel/local_sgd.py", "parallel/fault_tolerance.py"} and where
               for m, where in outer.items() if m not in step), outer


def test_the_member_count_sees_a_member_one_technique_implements(tmp_path):
    package = tmp_path / "scaletrain"
    (package / "parallel").mkdir(parents=True)
    hooks = (PACKAGE / "hooks.py").read_text()
    (package / "hooks.py").write_text(hooks.replace("    def begin_step(", "    def only_mine(self):\n"
                                                    "        pass\n\n    def begin_step(", 1))
    (package / "parallel" / "t.py").write_text("from scaletrain.hooks import StepHook\n\n\nclass A(StepHook):\n"
                                               "    def only_mine(self):\n        return 1\n")
    assert hook_members(package)["only_mine"] == {"parallel/t.py"}


def reads_of(attr: str, files) -> list[str]:
    """Where `.attr` is read in `files`, as "FILE:LINE"."""
    return [f"{f.name}:{n.lineno}" for f in files for n in ast.walk(ast.parse(f.read_text()))
            if isinstance(n, ast.Attribute) and n.attr == attr]


def test_the_local_sync_predicate_is_read_in_the_layout_alone():
    """Whether copies train apart between syncs is answered by the layout's roles (step_axis, step_replicas,
    expert_step_axis, outer: the outer sync's mode, period, dtype and workers), never re-derived."""
    files = [f for f in sorted(PACKAGE.rglob("*.py")) if f != PACKAGE / "layout.py"]
    assert reads_of("local_sync", files) == []
    assert len(reads_of("local_sync", [PACKAGE / "layout.py"])) >= 5  # the check sees the reads


def trainer_public_attributes(path: Path = TRAINER) -> list[str]:
    """The Trainer's public attributes (what it holds, not what it does): the self.X it sets and its
    properties, as "NAME (FILE:LINE)" where each first appears."""
    cls, seen = _trainer_class(path), {}
    for n in ast.walk(cls):
        if isinstance(n, ast.FunctionDef) and any(isinstance(d, ast.Name) and d.id == "property"
                                                  for d in n.decorator_list):
            seen.setdefault(n.name, n.lineno)
        if isinstance(n, (ast.Assign, ast.AnnAssign)):
            for target in n.targets if isinstance(n, ast.Assign) else [n.target]:
                for t in ast.walk(target):
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self" \
                            and not t.attr.startswith("_"):
                        seen.setdefault(t.attr, t.lineno)
    return [f"{name} ({path.name}:{line})" for name, line in sorted(seen.items(), key=lambda kv: kv[1])]


# issue 46's "about 15", plus the training objective (issue 49): what a user reaches a run's parts by
TRAINER_ATTRIBUTES = 17


def test_the_trainer_holds_few_public_attributes():
    """A user reaches a run's parts through a few (cfg, rt, layout, data, objective, pm, model, optimizer,
    schedule, state, precision, hooks, health, metrics, meter, folder; step): the rest is theirs or private."""
    public = trainer_public_attributes()
    assert len(public) <= TRAINER_ATTRIBUTES, f"{len(public)} public Trainer attributes: {public}"


def test_the_attribute_count_sees_one_more(tmp_path):
    planted = tmp_path / "trainer.py"
    text = TRAINER.read_text()
    anchor = "        self.cfg = cfg\n"
    planted.write_text(text.replace(anchor, anchor + "        self.dp_rank, self._x = 0, 1\n", 1))
    before, after = trainer_public_attributes(), trainer_public_attributes(planted)
    assert len(after) == len(before) + 1 and any(a.startswith("dp_rank (trainer.py:") for a in after)


def private_trainer_access(files, private: set[str]) -> list[str]:
    return [f"{f.name}:{n.lineno} .{n.attr}" for f in files for n in ast.walk(ast.parse(f.read_text()))
            if isinstance(n, ast.Attribute) and n.attr in private
            and not (isinstance(n.value, ast.Name) and n.value.id == "self")]


def test_no_module_outside_the_trainer_touches_its_private_members():
    private = trainer_private_names()
    assert {"_build", "_resume", "_accumulate"} <= private  # the check sees them
    files = [f for f in sorted(PACKAGE.rglob("*.py")) if f != TRAINER]
    files += sorted((PACKAGE.parents[1] / "benchmarks").glob("*.py")) + sorted(Path(__file__).parent.rglob("*.py"))
    assert private_trainer_access(files, private) == []


def test_the_private_access_check_sees_a_reach_into_the_trainer(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("def g(trainer):\n    return iter(trainer._micro_batches)\n")
    assert private_trainer_access([f], trainer_private_names()) == ["m.py:2 ._micro_batches"]


def test_the_process_side_and_the_techniques_do_not_reach_up():
    """The runtime joins a group with a settled layout (the planner resolves `auto` where the job
    is settled, scaletrain.launch.job); quantization takes model configs, not the job's; the CLI
    parses and prints (scaletrain.cli, below)."""
    assert not offenders([PACKAGE / "runtime.py"], ("scaletrain.plan", "scaletrain.launch"))
    assert not offenders(sorted((PACKAGE / "quant").glob("*.py")), ("scaletrain.config",))


def test_no_cli_module_is_over_150_lines_and_each_verb_has_its_module():
    """The front door by verb (issue 46): each verb in scaletrain.cli's table has a module of its
    own, which declares the verb's parser (add_parser) and holds the handler that parser reaches
    (a verb with verbs of its own, bench, holds each of theirs); no module of the CLI reads long,
    and nothing below the CLI imports it."""
    import argparse

    from scaletrain import cli

    files = sorted((PACKAGE / "cli").glob("*.py"))
    long = {f.name: n for f in files if (n := len(f.read_text().splitlines())) > 150}
    assert long == {}
    modules = list(cli.VERBS.values())
    assert len(set(map(id, modules))) == len(modules) == len(cli.VERBS) == 13
    verbs = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert list(verbs) == list(cli.VERBS)
    for verb, module in cli.VERBS.items():
        assert module.__name__ == f"scaletrain.cli.{verb.replace('-', '_')}"
        assert callable(module.add_parser)
        subs = [a for a in verbs[verb]._actions if isinstance(a, argparse._SubParsersAction)]
        parsers = list(subs[0].choices.values()) if subs else [verbs[verb]]
        for p in parsers:
            handler = p.get_default("func")
            assert handler.__module__ == module.__name__, f"{verb}: its handler is {handler.__module__}'s"
    outside = [f for f in PACKAGE.rglob("*.py") if "cli" not in f.relative_to(PACKAGE).parts[:1]
               and f.name != "__main__.py"]
    assert not offenders(outside, ("scaletrain.cli",))


def test_tasks_on_ranks_start_in_one_place():
    """`launch(` of the elastic launcher is called by the launcher itself, run_on_ranks (every
    task that returns a result) and the train job (its ranks return exit codes)."""
    import re

    files = [*PACKAGE.rglob("*.py"), *(PACKAGE.parents[1] / "benchmarks").glob("*.py")]
    calls = r"\blauncher\.launch\(|^\s*launch\(|= launch\("
    callers = {str(p.relative_to(p.parents[1])) for p in files if re.search(calls, p.read_text(), re.M)}
    assert callers <= {"launch/launcher.py", "launch/ranks.py", "launch/job.py"}


def test_every_mutant_plants_its_bug_in_text_found_once_and_names_tests_that_exist():
    """tests/mutations.py refuses a mutant whose text is not in its file exactly once, but only when it
    runs (minutes, outside `make test`): a refactor that moves a mutant's text fails here instead."""
    import re

    import mutations

    repo = PACKAGE.parents[1]
    rotten = [m.name for m in mutations.MUTANTS if (repo / m.file).read_text().count(m.old) != 1]
    assert rotten == [], f"mutants whose planted text is not in their file exactly once: {rotten}"
    missing = [t for m in mutations.MUTANTS for t in m.tests
               if not re.search(rf"^def {re.escape(t.split('::')[1].split('[')[0])}\(",
                                (repo / t.split("::")[0]).read_text(), re.M)]
    assert missing == [], f"tests named by mutants that do not exist: {missing}"


# ------------------------------------------------------------------------------------------
# The house, round 3 (issue 46): shape rules instead of line caps. A file is as long as its one job
# needs; what is held is the shape: floors, short functions where the hot paths are, one home for
# refusals. Each rule fails naming the file and line, and each has a test that plants a breach.

# The floors, lowest first: a module imports from its own floor or below, never above (computed from
# every import, at the top or inside a function). Keyed by the top-level module or subpackage.
FLOORS = (
    # the ground: words, errors, files, signals, the machine, the step-hook protocol, the watchdog
    ("", "errors", "vocab", "fmt", "atomic", "options", "interrupt", "console", "schedule", "ft_checks", "hardware",
     "hooks", "watchdog", "threads"),
    ("model", "data", "memory", "rollout"),  # plain parts: the model knows nothing of parallelism; sampling from it
    ("quant", "config"),  # the config reads presets, documents and the quantization rule
    ("layout", "legality", "optim", "precision"),  # what follows from a config, torch-free where it can be
    ("runtime",),  # the handle of a group of ranks: mesh and axes
    ("parallel",),  # the techniques, composed in parallelize
    ("train", "objectives", "plan"),  # the trainer and its objectives; the planner apart (test_import_boundaries)
    ("launch", "trained"),  # starting jobs; what is done with a trained model
    ("measure", "verify", "bench"),  # what runs jobs to measure or compare them
    ("cli", "__main__"),  # the front door: one module per verb
)


def floor_of(module: str) -> int:
    parts = module.split(".")
    key = parts[1] if len(parts) > 1 else ""
    return next(i for i, names in enumerate(FLOORS) if key in names)


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return [f"{a} (floor {floor_of(a)}) imports {b} (floor {floor_of(b)})" for a in sorted(graph)
            for b in sorted(graph[a]) if floor_of(b) > floor_of(a)]


def test_every_module_has_a_floor():
    unplaced = []
    for module in import_graph():
        try:
            floor_of(module)
        except StopIteration:
            unplaced.append(module)
    assert unplaced == [], "place each in FLOORS"


def test_no_import_runs_back_up():
    assert upward_imports(import_graph()) == []


def test_the_floor_check_sees_an_import_that_climbs(tmp_path):
    pkg = tmp_path / "scaletrain"
    (pkg / "model").mkdir(parents=True)
    (pkg / "train").mkdir()
    for f in ("__init__.py", "model/__init__.py", "train/__init__.py", "train/trainer.py"):
        (pkg / f).write_text("")
    (pkg / "model" / "moe.py").write_text("def f():\n    from scaletrain.train.trainer import Trainer\n")
    assert upward_imports(import_graph(pkg)) == [
        "scaletrain.model.moe (floor 1) imports scaletrain.train.trainer (floor 6)"]


FUNCTION_LINES = 60  # where the hot paths are: train/ and parallel/


def long_functions(files, limit: int = FUNCTION_LINES) -> list[str]:
    return [f"{f.relative_to(f.parents[1])}:{n.lineno} {n.name} ({n.end_lineno - n.lineno + 1} lines)"
            for f in files for n in ast.walk(ast.parse(f.read_text()))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > limit]


def test_no_function_over_60_lines_in_train_and_parallel():
    files = sorted((PACKAGE / "train").glob("*.py")) + sorted((PACKAGE / "parallel").glob("*.py"))
    assert long_functions(files) == []


def test_the_length_check_sees_a_long_function(tmp_path):
    f = tmp_path / "parallel" / "x.py"
    f.parent.mkdir()
    f.write_text("def short():\n    pass\n\n\ndef long():\n" + "    x = 1\n" * 60)
    assert long_functions([f]) == ["parallel/x.py:5 long (61 lines)"]


# A refusal of a combination names a setting and the layout axis it cannot run with: "train.qat=... with
# parallel.tp=2". Those live in the one legality check (scaletrain.legality, with Layout.errors for the
# layout's own rules), which settle, parallelize and the planner's search all ask. What is checked where
# it is met instead: the actual tensors (a quantized base whose shard rows do not split).
COMBINATION = re.compile(r"\b[a-z_]+\.[a-z_0-9]+(=\S*)? with parallel\.([a-z_]+|\{\})")
REFUSAL_HOMES = {"legality.py", "layout.py"}
MET_WHERE_CHECKED = {"quant/frozen_base.py"}  # the rows of each base weight against ZeRO-3's shards


def combination_refusals(files) -> list[str]:
    found = []
    for f in files:
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.JoinedStr):  # an f-string: its values as {}
                text = "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
            else:
                text = node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None
            if text is not None and COMBINATION.search(text):
                found.append(f"{f.name}:{node.lineno} {COMBINATION.search(text).group()}")
    return list(dict.fromkeys(found))  # (an f-string's own parts seen again)


def test_refusals_of_combinations_live_in_the_legality_module():
    files = [f for f in sorted(PACKAGE.rglob("*.py"))
             if str(f.relative_to(PACKAGE)) not in REFUSAL_HOMES | MET_WHERE_CHECKED]
    assert combination_refusals(files) == []
    assert combination_refusals([PACKAGE / "legality.py"])  # the pattern sees the real ones


def test_the_refusal_check_sees_one_planted_elsewhere(tmp_path):
    f = tmp_path / "checks.py"
    f.write_text('def check(lay):\n    if lay.tp > 1:\n        raise ValueError(f"train.qat=int8 with parallel.tp='
                 '{lay.tp}: no")\n')
    assert combination_refusals([f]) == ["checks.py:3 train.qat=int8 with parallel.tp"]


# ------------------------------------------------------------------------------------------
# One file per model family (issue 46): what differs per Hugging Face family lives in its file
# under model/families/ and one line of its registry; no family name in a condition elsewhere

FAMILY_DIR = PACKAGE / "model" / "families"


def family_conditions(files, names: set[str], root: Path = PACKAGE) -> list[str]:
    """`file:line name` for each string constant naming a family inside a condition: the test of an
    if, a while or a conditional expression, a comprehension's if, a match case, and any boolean
    operation or comparison (`family == "llama"`, `kind in ("qwen2", "qwen3")`)."""
    found = []
    for f in files:
        tests = []
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, (ast.If, ast.IfExp, ast.While)):
                tests.append(node.test)
            elif isinstance(node, ast.comprehension):
                tests.extend(node.ifs)
            elif isinstance(node, (ast.BoolOp, ast.Compare, ast.MatchValue)):
                tests.append(node)
        hits = {(c.lineno, c.value) for t in tests for c in ast.walk(t)
                if isinstance(c, ast.Constant) and isinstance(c.value, str) and c.value in names}
        found += [f"{f.relative_to(root)}:{line} {name}" for line, name in sorted(hits)]
    return found


def test_no_family_name_in_a_condition_outside_model_families():
    from scaletrain.model.families import FAMILIES

    files = [f for f in sorted(PACKAGE.rglob("*.py")) if FAMILY_DIR not in f.parents]
    assert len(files) > 100 and family_conditions(files, set(FAMILIES)) == []


def test_the_family_check_sees_a_planted_family_condition(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("def g(family, kinds, cfg):\n"
                 "    if family == 'gemma2':\n"
                 "        return 1\n"
                 "    x = 2 if cfg.model_type in ('llama', 'qwen2') else 3\n"
                 "    ys = [k for k in kinds if k != 'olmoe']\n"
                 "    ok = cfg.bias and family == 'mixtral'\n"
                 "    match family:\n"
                 "        case 'phi3':\n"
                 "            pass\n"
                 "    name = {'gpt2': 1}[family]  # a lookup, not a condition\n"
                 "    return x, ys, ok, 'llama' + name\n")
    names = {"gemma2", "llama", "qwen2", "olmoe", "mixtral", "phi3", "gpt2"}
    assert family_conditions([f], names, tmp_path) == [
        "m.py:2 gemma2", "m.py:4 llama", "m.py:4 qwen2", "m.py:5 olmoe", "m.py:6 mixtral", "m.py:8 phi3"]


def test_the_registry_covers_every_family_the_reader_accepts():
    """The reader's list of model_types is the registry's; each registered family reads a config.json
    of its own keys, and a model_type outside the registry is refused with the registry's list."""
    from scaletrain.errors import ConfigError
    from scaletrain.model.families import FAMILIES
    from scaletrain.model.hf_config import FAMILIES as READ
    from scaletrain.model.hf_config import model_config_from_hf

    assert READ == tuple(FAMILIES) and len(FAMILIES) == 17
    shape = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                 head_dim=8, n_embd=32, n_layer=2, n_head=4)
    for name, family in FAMILIES.items():
        fields = model_config_from_hf({"model_type": name, **{k: v for k, v in shape.items() if k in family.known}})
        assert fields["vocab_size"] == 64 and fields["n_layers"] == 2, name
    with pytest.raises(ConfigError, match=f"model_type='falcon' is not one scaletrain imports; supported: "
                                          f"{', '.join(FAMILIES)}"):
        model_config_from_hf({"model_type": "falcon", **shape})


def test_a_family_is_one_file_and_one_registry_line():
    """Each registered model_type is a module of its own name under model/families/ (its FAMILY),
    named on one line of the registry and imported by no module outside model/families/; every
    public module there is a registered family (the shared helpers are private: _common, _moe, ...)."""
    from scaletrain.model.families import FAMILIES

    for name, family in FAMILIES.items():
        assert family.model_type == name and type(family).__module__ == f"scaletrain.model.families.{name}"
        assert (FAMILY_DIR / f"{name}.py").is_file()
    assert {f.stem for f in FAMILY_DIR.glob("*.py") if not f.stem.startswith("_")} == set(FAMILIES)
    registry = (FAMILY_DIR / "__init__.py").read_text()
    table = registry[registry.index("FAMILIES = "):]
    table = table[:table.index("})") + 2]
    assert all(table.count(f"{name}.FAMILY") == 1 for name in FAMILIES)
    outside = [f for f in PACKAGE.rglob("*.py") if FAMILY_DIR not in f.parents]
    reached = {m for f in outside for m in imported_modules(f)}
    assert not {f"scaletrain.model.families.{name}" for name in FAMILIES} & reached


def test_tests_mirror_the_package():
    """tests/ mirrors src/scaletrain/ (issue 46, step 8): every test file sits in a folder named after a
    subpackage or a top-level module of the package (tests/plan/ for scaletrain/plan/, tests/cli/ for
    cli.py, with config.py's tests beside), one level deep but for a subpackage's own folder inside its
    package's (tests/model/families/ for scaletrain/model/families/), no folder holding more than 15; at the top of
    tests/ only this file (the package as a whole) and the helpers the folders share. A subject's
    catching, fault and error cases are in its own file, not in a *_catch, *_faults or *_errors file
    beside it. pytest imports a test file by its name alone (no __init__.py), so each name is unique."""
    tests = Path(__file__).parent
    areas = {p.stem for p in PACKAGE.iterdir() if (p / "__init__.py").is_file() or p.suffix == ".py"}
    areas |= {p.parent.relative_to(PACKAGE).as_posix() for p in PACKAGE.glob("*/*/__init__.py")}
    files = sorted(tests.rglob("test_*.py"))
    assert [p.name for p in files if p.parent == tests] == ["test_structure.py"]
    folders: dict[str, list[str]] = {}
    for p in files:
        if p.parent != tests:
            folders.setdefault(p.parent.relative_to(tests).as_posix(), []).append(p.name)
    assert sorted(f for f in folders if f not in areas - {"__init__", "__main__"}) == [], "folders named after no area"
    assert {f: len(names) for f, names in folders.items() if len(names) > 15} == {}
    assert [str(p.relative_to(tests)) for p in files if p.stem.endswith(("_catch", "_faults", "_errors"))] == []
    names = [p.name for p in files]
    assert sorted({n for n in names if names.count(n) > 1}) == [] and not list(tests.rglob("__init__.py"))
