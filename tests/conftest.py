"""Shared helpers: a micro config that trains in milliseconds per step on a CPU."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

# keep the tests on few threads: the suite runs beside other work on 2 cores
os.environ.setdefault("OMP_NUM_THREADS", "1")
# a suite started in the background by a shell without job control (`make test &` in a script) inherits
# SIGINT ignored, as does every process it starts, and scaletrain keeps an ignored SIGINT ignored (as
# under nohup): the tests of Ctrl-C need the interpreter's default, as from a terminal
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

import torch  # noqa: E402
from hypothesis import settings  # noqa: E402

torch.set_num_threads(1)

# Hypothesis's profiles for the property tests (test_*_properties.py): "suite", the default, draws 50
# examples and the same ones on every run (derandomize: a CI failure is one a rerun shows again);
# HYPOTHESIS_PROFILE=long draws 1,000 random ones per property (docs/testing.md, "Properties"). No
# deadline: a first example pays for imports and warm-up, and the machines are shared.
settings.register_profile("suite", max_examples=50, deadline=None, derandomize=True, database=None,
                          print_blob=True)
settings.register_profile("long", max_examples=1000, deadline=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "suite"))

from scaletrain.config import load_config  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

# tests/ mirrors src/scaletrain/: a folder of test files per subject, the helpers (this file, dist_worker,
# forked_ranks, ...) at its top, on sys.path through pyproject's pythonpath. Every folder goes on sys.path
# too, so that a test module imports another's helpers by plain name from any folder (test_qlora uses
# test_lora's), whichever files a run selects, and forked ranks (handed this sys.path) import a probe by
# its module's name. dist_worker does the same for ranks started by the launcher.
# (a folder inside a folder too: tests/model/families/ for scaletrain/model/families/)
TEST_FOLDERS = sorted({p.parent for p in (REPO / "tests").rglob("test_*.py")} - {REPO / "tests"})
sys.path.extend(str(p) for p in TEST_FOLDERS if str(p) not in sys.path)

MICRO = {
    "model.dim": 64, "model.n_layers": 2, "model.n_heads": 4, "model.max_seq_len": 32,
    "data.seq_len": 32, "train.global_batch": 8, "train.steps": 10, "train.device": "cpu",
    "log.every": 1, "log.tensorboard": False, "log.progress": "off", "checkpoint.save_final": False,
    "optim.warmup_steps": 2, "train.sample_tokens": 0,
    # a tracker a test starts must start on a loaded machine too: MLflow's first database took over the default
    # 30 s at a load average of 20, and the run then (rightly) went on without it
    "log.tracker_wait_s": 600,
}


# The files that take longest (10 s and more in a clean-clone run), slowest first, the fault-tolerance
# file (mostly waiting on restarts and timeouts) first.
# pytest-xdist hands whole files to its processes in the collection's order (`make test` passes
# --no-loadscope-reorder), so with these first the last file to start is a short one and neither
# process waits alone at the end.
SLOWEST_FIRST = ("test_fault_tolerance.py", "test_slurm.py", "test_docs_blocks.py", "test_expert_parallel.py",
                 "test_reliability.py",
                 "test_launch.py", "test_model_parallel.py", "test_quantize.py", "test_planner_accuracy.py",
                 "test_lora.py", "test_preference_training.py", "test_training.py", "test_bench.py",
                 "test_planner.py", "test_signals_startup.py",
                 "test_data_parallel.py", "test_fp8.py", "test_init_from.py", "test_calibration.py",
                 "test_checkpoint.py", "test_local_sgd.py", "test_hf_families.py", "test_window_parallel.py",
                 "test_eval.py", "test_verify.py", "test_preference_layouts.py",
                 "test_run_folders.py", "test_cli.py", "test_planner_moe_accuracy.py", "test_ft_layouts.py",
                 "test_moe_parallel.py", "test_run_folder.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file keeps its order


def micro_cfg(tmp_path: Path, **overrides):
    """A tiny, fast config writing into tmp_path; overrides use dotted names."""
    values = {**MICRO, "log.run_dir": str(tmp_path / "run"), **overrides}
    return load_config(None, values)


def model_from_hf(folder, seq_len: int, **overrides):
    """Our Transformer of a Hugging Face folder (model.from_hf), filled as training fills it (parameters and
    routing biases), in eval mode; `overrides`: dotted config keys beside the import's."""
    from scaletrain.model.hf import load_hf_weights
    from scaletrain.model.transformer import Transformer
    from scaletrain.parallel.init import load_weights

    cfg = load_config(None, {"model.from_hf": str(folder), "data.seq_len": seq_len, **overrides}).model
    model = Transformer(cfg)
    load_weights(model, load_hf_weights(folder, cfg), str(folder))
    return model.eval()


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def run_here(*args: str):
    """`scaletrain ARGS` through the CLI's main in this process, from the repository (no
    interpreter start-up, ~3 s saved): for commands that start no ranks and need no fresh
    process. Returns a CompletedProcess like run_cli; an unexpected exception propagates."""
    import contextlib
    import io

    from scaletrain import cli

    out, err, before = io.StringIO(), io.StringIO(), os.getcwd()
    os.chdir(REPO)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = cli.main(list(args))
    finally:
        os.chdir(before)
    return subprocess.CompletedProcess(["scaletrain", *args], code, out.getvalue(), err.getvalue())


def one_line_exit_2(r, *fragments):
    """A refused command: exit code 2 and one line on stderr, "scaletrain: error: ...", holding
    each of `fragments`."""
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("scaletrain: error:"), r.stderr
    for f in fragments:
        assert f in lines[0], lines[0]


def run_cli(*args: str, timeout: float = 300, env: dict | None = None, cwd: Path | None = None):
    """Run `python -m scaletrain ARGS` in a fresh process; returns CompletedProcess."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "scaletrain", *args], capture_output=True, text=True,
                          timeout=timeout, env=full_env, cwd=cwd or REPO)


@pytest.fixture
def micro(tmp_path):
    return lambda **kw: micro_cfg(tmp_path, **kw)


def wanted_params(request, argname: str) -> set | None:
    """The values of parameter `argname` of the tests this session runs that use the calling
    fixture (a tuple value counts as each of its items), or None when one of them is not
    parametrized by it (it needs every value). A
    module-scoped fixture that runs a group of layouts runs only those asked for: one test id
    (tests/mutations.py, or -k while working) then costs one layout, not its whole group."""
    users = [item for item in request.session.items
             if request.fixturename in getattr(item, "fixturenames", ())
             and getattr(item, "module", None) is request.module]
    values = set()
    for item in users:
        params = getattr(item, "callspec", None)
        if params is None or argname not in params.params:
            return None
        value = params.params[argname]
        values.update(value if isinstance(value, tuple) else (value,))
    return values


# the faults of tests/dist_worker.py that fail a rank (the launcher's part is then under test); the
# others ("inf_grad") happen inside a step that every rank finishes
RANK_FAILURES = ("kill_during_save", "raise_at_start", "sleep_in_step")


def run_group(nproc: int, jobs: list[dict], tmp_path: Path, timeout: float = 600) -> tuple[int, list | None, str]:
    """Run `jobs` (dicts with "overrides", optional "fault") in one group of `nproc` real
    processes; returns (exit code, rank 0's results, stderr). The ranks are forked from a process
    that has imported torch and the trainer already (tests/forked_ranks.py: about 3 s of CPU saved
    per rank); a group with a fault that fails a rank (it dies, raises or stalls) is started by
    scaletrain's launcher, whose handling of the failure the test checks."""
    from forked_ranks import run_forked

    spec = tmp_path / f"spec-{len(list(tmp_path.glob('spec-*')))}.json"
    out = spec.with_suffix(".out.json")
    spec.write_text(json.dumps({"jobs": jobs, "out": str(out)}))
    start = launch_here if any((job.get("fault") or {}).get("kind") in RANK_FAILURES for job in jobs) else run_forked
    code, err = start("dist_worker:main", [str(spec)], nproc, timeout)
    results = json.loads(out.read_text()) if out.exists() else None
    return code, results, err


@pytest.fixture(scope="module")
def forked_launches():
    """For a module whose tests measure through scaletrain.launch.ranks.run_on_ranks (the
    planner's measured runs, the calibration): the launcher's ranks forked instead
    (tests/forked_ranks.py), the ranks' stderr passed on when they fail. The launcher itself is
    tested where it is what the test is about."""
    from forked_ranks import run_forked

    def launch(task, worker_args, *, nproc, **_):
        code, err = run_forked(task, list(worker_args), nproc)
        if code:
            sys.stderr.write(err)
        return code

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("scaletrain.launch.launcher.launch", launch)
        yield


def launch_here(task: str, args: list[str], nproc: int, timeout: float = 600) -> tuple[int, str]:
    """scaletrain's launcher called from this process (torch is imported already: no extra
    interpreter start-up per group), its stderr and its ranks' captured; returns (exit code,
    stderr). Past `timeout` the launcher gets SIGTERM, as from a user: the ranks stop and it
    returns 143."""
    from scaletrain.launch.launcher import launch

    return stderr_of(lambda: launch(task, args, nproc=nproc, pythonpath=(str(REPO / "tests"),)), timeout)


def stderr_of(call, timeout: float) -> tuple:
    """(call(), what was written to fd 2 meanwhile: this process's stderr and that of every process it
    starts, which inherit it). Past `timeout` this process gets SIGTERM, as from a user, for `call` (a
    launcher, ft-local) to pass on to what it started."""
    import signal
    import tempfile
    import threading

    with tempfile.TemporaryFile(mode="w+") as captured:
        sys.stderr.flush()
        saved_fd, saved_stream = os.dup(2), sys.stderr
        os.dup2(captured.fileno(), 2)
        sys.stderr = os.fdopen(os.dup(2), "w", buffering=1)
        timer = threading.Timer(timeout, os.kill, (os.getpid(), signal.SIGTERM))
        timer.start()
        try:
            result = call()
        finally:
            timer.cancel()
            sys.stderr.close()
            sys.stderr = saved_stream
            os.dup2(saved_fd, 2)
            os.close(saved_fd)
        captured.seek(0)
        return result, captured.read()


def mount_tmpfs(path: Path, options: str) -> bool:
    """Mount a tmpfs with mount OPTIONS (e.g. "size=64k", "ro,size=1m") at `path`, for tests
    of real full or read-only disks; False where this user cannot mount (not root)."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                          capture_output=True).returncode == 0


def unmount(path: Path) -> None:
    """Undo mount_tmpfs; a file still open there (a lock, a log) detaches it instead."""
    if subprocess.run(["umount", str(path)], capture_output=True).returncode:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def micro_overrides(run_dir: Path, **overrides) -> dict:
    return {**MICRO, "log.run_dir": str(run_dir), **overrides}


# --------------------------------------------------------------------------------------------
# Parity: a run against a reference run, whole, on the gradients as well as the losses.
#
# Why the gradient norm: on the micro models the norm before clipping is above train.grad_clip
# (1.0) at every step, so every update reaches AdamW clipped to unit norm, and AdamW is nearly
# blind to a scale anyway: a bug that multiplies the gradients by k leaves the losses as they
# were. The norm before clipping shows k at the first step. A failure says how far past the
# tolerance it is ("N x tolerance"): tests/mutations.py reports that margin.

def _record(what: str, **worst: float) -> None:
    """With PARITY_LOG=FILE, append each comparison's worst differences to FILE (one JSON line):
    how the tolerances below were measured."""
    if os.environ.get("PARITY_LOG"):
        with open(os.environ["PARITY_LOG"], "a") as f:
            f.write(json.dumps({"what": what, **worst}) + "\n")


def margin_text(rel: float, tol: float) -> str:
    return f"{rel / tol:.3g}x tolerance {tol:.0e}"


def assert_same_run(got: list[dict], ref: list[dict], *, steps: int, first: int = 1,
                    tol: tuple[float, float] = (1e-5, 1e-4), what: str = "",
                    loss_floor: float = 0.0) -> tuple[float, float]:
    """`got`'s metrics rows against `ref`'s: every step from `first` to `steps` logged (no step
    dropped, none extra), and at each the loss and the gradient norm before clipping within
    `tol` = (loss, grad norm) relative. `ref` is a run from step 1 (a resumed `got` is held
    against its later steps). `loss_floor`: losses that differ by less, absolutely, agree (an RL
    policy loss, 0 up to rounding at each round's first update). Returns the worst (loss, grad norm)
    relative differences."""
    from scaletrain.verify import rel_diff

    got_steps, ref_steps = [r["step"] for r in got], [r["step"] for r in ref]
    assert got_steps == list(range(first, steps + 1)), f"{what}: logged steps {got_steps}, not {first} to {steps}"
    assert ref_steps == list(range(1, steps + 1)), f"{what}: reference steps {ref_steps}, not 1 to {steps}"
    by_step = {r["step"]: r for r in ref}
    worst = []
    problems = []
    for key, name, t in (("loss", "loss", tol[0]), ("grad_norm", "grad norm", tol[1])):
        floor = loss_floor if key == "loss" else 0.0
        diffs = [(0.0 if abs(r[key] - by_step[r["step"]][key]) <= floor else rel_diff(r[key], by_step[r["step"]][key]),
                  r["step"], r[key], by_step[r["step"]][key]) for r in got]
        rel, step, a, b = max(diffs)
        worst.append(rel)
        if not rel <= t:
            problems.append(f"{name} at step {step}: {a:.7g} vs {b:.7g}, relative difference {rel:.2e} = "
                            f"{margin_text(rel, t)}")
    _record(what, loss=worst[0], grad_norm=worst[1])
    assert not problems, f"{what}: " + "; ".join(problems)
    return worst[0], worst[1]


class Lazy(dict):
    """A dict whose values are made on first use from `makers` (name -> function): a module's
    reference runs cost only those its selected tests read."""

    def __init__(self, makers: dict):
        super().__init__()
        self.makers = makers

    def __missing__(self, key):
        self[key] = value = self.makers[key]()
        return value


def fit_reference(cfg, **trainer_kw) -> dict:
    """Train `cfg` in this process: its metrics rows ("history") and its final weights
    fingerprinted as tests/dist_worker.py does a group's, with the norm of each parameter's
    change over the run (what assert_same_weights measures a difference against)."""
    from scaletrain.train.trainer import Trainer

    from dist_worker import weight_fingerprint

    trainer = Trainer(cfg, **trainer_kw)
    before = {n: p.detach().double().clone() for n, p in trainer.pm.dp.named_params}
    history = trainer.fit()["history"]
    weights = weight_fingerprint(trainer.pm.dp.named_params)
    for n, p in trainer.pm.dp.named_params:
        weights[n].append((p.detach().double() - before[n]).norm().item())
    return {"history": history, "weights": weights}


def layouts_on_two_ranks(tmp: Path, layouts: list[tuple[str, dict]], overrides_of: Callable[[dict], dict]) -> dict:
    """Every (name, extra) of `layouts` trained on 2 ranks in one shared process group, `overrides_of(extra)` its
    whole overrides: {name: its result}."""
    jobs = [{"overrides": micro_overrides(tmp / name, **overrides_of(extra))} for name, extra in layouts]
    code, results, err = run_group(2, jobs, tmp)
    assert code == 0, err
    return dict(zip([name for name, _ in layouts], results, strict=True))


def one_process_key(extra: dict, not_layout: tuple[str, ...] = ("parallel.", "train.micro_batch")) -> str:
    """What one process trains for a layout's settings (its model, objective, reference, not its layout): the key
    of one_process_references."""
    return json.dumps({k: v for k, v in extra.items() if not k.startswith(not_layout)}, sort_keys=True)


def one_process_references(tmp: Path, layouts: list[tuple[str, dict]], overrides_of: Callable[[dict], dict]) -> Lazy:
    """The one-process run of each distinct one_process_key among `layouts`, trained in this process when a test
    first asks for it; `overrides_of(settings)` is its whole config (every row in one micro-batch)."""
    keys = {one_process_key(extra) for _, extra in layouts}
    return Lazy({key: (lambda key=key: fit_reference(micro_cfg(tmp / str(abs(hash(key))),
                                                               **overrides_of(json.loads(key)))))
                 for key in keys})


def assert_same_weights(got: dict, ref: dict, *, tol: float, what: str = "") -> float:
    """Final weights (dist_worker.weight_fingerprint) against a reference's (fit_reference): the
    same parameters, and for each the difference of the random projections over the norm of
    the reference's change of that parameter over the run (about |w - w_ref| / |w_ref - w_0|)
    within `tol`. Returns the worst."""
    assert sorted(got) == sorted(ref), f"{what}: parameters {sorted(set(got) ^ set(ref))} in one run only"
    diffs = sorted(((abs(got[n][1] - ref[n][1]) / ref[n][2], n) for n in ref if ref[n][2] > 0), reverse=True)
    rel, name = diffs[0]
    _record(what, weights=rel, worst=diffs[:3])
    assert rel <= tol, f"{what}: final weights of {name} differ by {rel:.2e} of their change = {margin_text(rel, tol)}"
    return rel


def verdict_margin(verdict: str) -> str:
    """How far over its tolerances a `scaletrain verify` verdict line is ("N x tolerance")."""
    import re

    m = re.search(r"loss ([\d.e+-]+|inf) at step \d+, grad norm ([\d.e+-]+|inf) at step \d+; "
                  r"tolerance loss ([\d.e+-]+), grad norm ([\d.e+-]+)", verdict)
    if not m:
        return "margin unknown"
    loss, norm, tol_loss, tol_norm = (float(x) for x in m.groups())
    return f"{max(loss / tol_loss, norm / tol_norm):.3g}x tolerance"


def forge_checksums(checkpoint: Path) -> None:
    """Rewrite a checkpoint's recorded checksums to match its files, as an attacker who can
    write the folder can: what then stops a malicious file is the loader, not the checksum."""
    import hashlib

    f = Path(checkpoint) / "trainer.json"
    state = json.loads(f.read_text())
    for name in state["files"]:
        data = (Path(checkpoint) / name).read_bytes()
        state["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    f.write_text(json.dumps(state))


def run_until(cfg, stop_after: int) -> dict:
    """Train with cfg but stop (as SIGTERM would) once `stop_after` steps are done."""
    import signal

    from scaletrain.train.trainer import Trainer

    trainer = Trainer(cfg)
    step = trainer.train_step

    def step_then_maybe_stop(batches):
        out = step(batches)
        if trainer.step + 1 >= stop_after:
            trainer.health.signals.received = signal.SIGTERM
        return out

    trainer.train_step = step_then_maybe_stop
    return trainer.fit()


MICRO_ARGS = [f"--{key}={value}" for key, value in MICRO.items()]  # MICRO as `scaletrain train` options

# a small CLI config (no train.device): what `popen_train` starts
CLI_MICRO = ["--model.dim=64", "--model.n_layers=2", "--model.max_seq_len=32", "--data.seq_len=32",
             "--train.global_batch=4", "--log.every=1", "--log.progress=off", "--log.tensorboard=false",
             "--train.sample_tokens=0"]


def language_models(root: Path, lines: list[str]) -> dict[str, str]:
    """Two exported micro models (4 untied blocks), "policy" trained as a language model on `lines` and
    "reference" its starting weights: KTO's KL, clamped at 0 where a policy starts at its reference, is
    well above 0 between them (tests/objectives)."""
    text = root / "lm.txt"
    text.write_text("".join(line + "\n" for line in lines) * 20)
    from scaletrain.data.prepare import prepare

    prepare([text], root / "lm")
    models = {}
    for name, steps, lr in (("policy", 30, 3e-3), ("reference", 1, 1e-9)):
        fit_reference(micro_cfg(root / name, **{"data.path": str(root / "lm"), "train.steps": steps,
                                               "model.n_layers": 4, "model.tie_embeddings": False, "optim.lr": lr,
                                               "checkpoint.save_final": True}))
        models[name] = str(root / f"{name}.safetensors")
        assert run_here("export", str(root / name / "run"), "--out", models[name]).returncode == 0
    return models


def train_micro(tmp_path: Path, **overrides) -> dict:
    """Train micro_cfg(tmp_path, **overrides) in this process; fit()'s result."""
    from scaletrain.train.trainer import Trainer

    return Trainer(micro_cfg(tmp_path, **overrides)).fit()


def popen_train(*args: str) -> subprocess.Popen:
    """`python -m scaletrain train` on CLI_MICRO plus ARGS, started in the background."""
    return subprocess.Popen([sys.executable, "-m", "scaletrain", "train", *CLI_MICRO, *args], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


def wait_for_rows(run_dir: Path, rows: int, proc: subprocess.Popen, timeout: float = 600) -> None:
    """Until `proc`'s run has logged `rows` metrics rows (an AssertionError if it ends first)."""
    import time

    deadline = time.time() + timeout
    f = run_dir / "metrics.jsonl"
    while time.time() < deadline and proc.poll() is None:
        if f.exists() and len(f.read_text().splitlines()) >= rows:
            return
        time.sleep(0.05)
    raise AssertionError(f"the run did not log {rows} rows: {proc.poll()=}")


# --------------------------------------------------------------------------------------------
# One finished run, shared by the tests that resume, evaluate or export it (read-only: a test
# that changes it works on a copy_run)


@pytest.fixture(scope="session")
def finished_run(tmp_path_factory) -> Path:
    """A run of the micro model that ended at step 4 with a checkpoint (and its validation loss)."""
    run = tmp_path_factory.mktemp("finished") / "run"
    r = run_here("train", *MICRO_ARGS, "--train.steps=4", "--checkpoint.save_final=true", f"--log.run_dir={run}")
    assert r.returncode == 0, r.stderr
    return run


def copy_run(run: Path, to: Path) -> Path:
    import shutil

    shutil.copytree(run, to)
    config = json.loads((to / "config.json").read_text())
    config["log"]["run_dir"] = str(to)  # the copy is its own run folder
    (to / "config.json").write_text(json.dumps(config))
    return to


# --------------------------------------------------------------------------------------------
# Bad input: each case gives one `scaletrain: error:` line that names the problem (and the fix,
# where there is one), exits with code 2, prints no traceback, and leaves every file where it
# was. Each subject's test file lists its cases (BAD_INPUT) and runs them with
# assert_one_clear_line; `scaletrain.cli.main` runs in this process (the CLI validates
# everything before it launches ranks), inside `workdir`: a private copy of a prepared data
# folder and a small real checkpoint, made once per session.

CKPT = "run/checkpoints/step_00000002"  # the assets' checkpoint, relative to a case's folder
CORPUS = "the quick brown fox jumps over the lazy dog while the model trains one step at a time\n" * 200


@pytest.fixture(scope="session")
def assets(tmp_path_factory) -> Path:
    """One prepared data folder ("data"), one too small ("tiny") and one real run with a
    checkpoint ("run"), made once: cases work on copies (`workdir`)."""
    from scaletrain.data.prepare import prepare
    from scaletrain.train.trainer import Trainer

    root = tmp_path_factory.mktemp("assets")
    (root / "corpus.txt").write_text(CORPUS)
    prepare([root / "corpus.txt"], root / "data")
    (root / "hello.txt").write_text("hello")
    prepare([root / "hello.txt"], root / "tiny")  # 7 tokens: too few for one window of 32
    cfg = load_config(None, {**MICRO, "train.steps": 2, "checkpoint.save_final": True,
                             "data.path": str(root / "data"), "log.run_dir": str(root / "run")})
    Trainer(cfg).fit()
    assert (root / CKPT / "trainer.json").is_file()
    for name in ("corpus.txt", "hello.txt"):
        (root / name).unlink()
    return root


@pytest.fixture
def workdir(assets, tmp_path, monkeypatch) -> Path:
    """A private copy of the shared inputs, as the current folder."""
    import shutil

    for name in ("data", "tiny", "run"):
        shutil.copytree(assets / name, tmp_path / name)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def folder_snapshot(root: Path) -> dict[str, tuple]:
    """Every file and folder under root with its size, mtime and content hash."""
    import hashlib

    out = {}
    for p in sorted(root.rglob("*")):
        info = p.lstat()
        digest = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else None
        out[str(p.relative_to(root))] = (p.is_dir(), info.st_size if p.is_file() else 0, info.st_mtime_ns, digest)
    return out


def run_main(argv: list[str], capsys) -> tuple[int, str, str]:
    """`scaletrain ARGV` in this process: (exit code, stdout, stderr)."""
    from scaletrain.cli import main

    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own exits (--help), should a parser bypass our error()
        code = e.code if isinstance(e.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


def train_args(*extra: str, data: str = "data", run_dir: str = "newrun") -> list[str]:
    """`train` on the micro model with the prepared data, into a fresh run folder."""
    return ["train", *MICRO_ARGS, f"--data.path={data}", f"--log.run_dir={run_dir}", *extra]


def with_toml(text: str, name: str = "c.toml") -> Callable[[Path], None]:
    return lambda d: (d / name).write_text(text)


def write(rel: str, content: str | bytes) -> Callable[[Path], None]:
    def prep(d: Path) -> None:
        p = d / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(content) if isinstance(content, bytes) else p.write_text(content)
    return prep


def edit_json(rel: str, change: Callable[[dict], None]) -> Callable[[Path], None]:
    def prep(d: Path) -> None:
        data = json.loads((d / rel).read_text())
        change(data)
        (d / rel).write_text(json.dumps(data))
    return prep


def truncate(rel: str, keep: int) -> Callable[[Path], None]:
    def prep(d: Path) -> None:
        p = d / rel
        p.write_bytes(p.read_bytes()[:keep])
    return prep


@dataclass
class Case:
    id: str
    argv: list[str]
    expect: tuple[str, ...]  # fragments of the error line(s), naming the problem and the fix
    prep: Callable[[Path], None] | None = None
    lines: int = 1  # problems reported; each gets its own line


def assert_one_clear_line(case: Case, workdir: Path, capsys) -> None:
    """The bad-input contract above, for one case."""
    if case.prep:
        case.prep(workdir)
    before = folder_snapshot(workdir)
    code, out, err = run_main(case.argv, capsys)
    assert "Traceback" not in out + err, err
    assert code == 2, (code, err)
    assert out.strip() == "", out  # nothing half-done printed before the error
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == case.lines, err
    assert all(line.startswith("scaletrain: error: ") for line in lines), err
    for fragment in case.expect:
        assert fragment in err, (fragment, err)
    assert folder_snapshot(workdir) == before  # nothing written, nothing overwritten


def assert_group_trains_alike(nproc: int, tmp: Path, cases: list[tuple[str, dict, dict]], *, steps: int,
                              weights_tol: float = 1e-3) -> None:
    """Each case (what, its whole overrides, its reference: a fit_reference result) trained on `nproc` ranks, every
    case in one group of processes: every step's loss and gradient norm, and the final weights, as its reference's."""
    code, results, err = run_group(nproc, [{"overrides": overrides} for _, overrides, _ in cases], tmp)
    assert code == 0, err
    for (what, _, ref), result in zip(cases, results, strict=True):
        assert_same_run(result["history"], ref["history"], steps=steps, what=what)
        assert_same_weights(result["weights"], ref["weights"], tol=weights_tol, what=what)
