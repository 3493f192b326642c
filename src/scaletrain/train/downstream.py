"""Downstream task scores through lm-evaluation-harness: eval.tasks every eval.every steps of a run, on
the live model however it is sharded (`TaskEvaluation`), and `scaletrain eval CKPT --tasks` of a
checkpoint (scaletrain.trained.task_eval), both by `evaluate_tasks`.

The model answers lm-eval's requests as `HarnessLM` (train.lm_eval_model). Task names are lm-eval's
(`lm-eval ls tasks`), those of the YAML files in eval.include, and the two shipped with scaletrain
(src/scaletrain/eval_tasks: scaletrain_choice, multiple choice; scaletrain_complete, generation), whose
data sets are files beside them. Data sets are read with the Hugging Face Hub switched off: a task
whose data is neither local nor cached is one line that names it, unless eval.download allows it.

The scores (each task's metrics, e.g. tasks/scaletrain_choice/acc) go into the row of metrics.jsonl of
their step, to TensorBoard and the trackers like every other figure. lm-eval seeds Python's, NumPy's and
torch's random generators: they are put back as they were, so a run with eval.tasks trains the same
steps as one without. Cost: a forward over every request (generation: one per new token, on the whole
window, no cache), on every rank of the group; the steps' tokens/s leave it out.
"""

from __future__ import annotations

import contextlib
import functools
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from scaletrain.errors import ConfigError
from scaletrain.vocab import did_you_mean

SHIPPED = Path(__file__).resolve().parents[1] / "eval_tasks"
INSTALL = "pip install 'scaletrain[eval]'"


def task_names(text: str, what: str) -> list[str]:
    """The names in a comma-separated list, each once, in order."""
    names = list(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    if not names:
        raise ConfigError(f"{what} names no task; give task names separated by commas, e.g. scaletrain_choice")
    return names


def shipped_tasks() -> dict[str, Path]:
    """The tasks shipped with scaletrain, by name (their YAML file's stem)."""
    return {p.stem: p for p in sorted(SHIPPED.glob("*.yaml"))}


def require_lm_eval(what: str) -> None:
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise ConfigError(f"{what} runs lm-evaluation-harness, which is not installed: {INSTALL}") from None


def task_specs(names: list[str], include: str, what: str) -> tuple[list, object]:
    """What lm-eval loads for `names` (a shipped task as its config, its data files made absolute; any
    other by name), and the TaskManager that knows them (eval.include's YAML files as well). An
    unknown name or a missing folder: a ConfigError."""
    if include and not Path(include).is_dir():
        raise ConfigError(f"{what}: include folder {include} does not exist; give a folder of lm-eval task YAML files")
    shipped = shipped_tasks()
    others = [n for n in names if n not in shipped]
    # lm-eval's own index of its ~15,000 tasks takes seconds to build: only when a name needs it, and once a
    # process (a run's evaluations and the eval command each asked for it again: seconds every time)
    manager = _task_index(str(Path(include).resolve()) if include else "", bool(others))
    for name in others:
        if name not in manager.all_tasks:
            raise ConfigError(f"{what}: unknown task {name!r}{did_you_mean(name, [*shipped, *manager.all_tasks])}; "
                              f"scaletrain ships {', '.join(shipped)}; lm-eval's are listed by `lm-eval ls tasks`")
    return [_shipped_spec(shipped[n]) if n in shipped else n for n in names], manager


@functools.lru_cache(maxsize=8)
def _task_index(include: str, defaults: bool):
    """lm-eval's TaskManager over the YAML files of `include` (an absolute folder, or "") and, with
    `defaults`, lm-eval's own tasks: what it indexed first is kept for the rest of the process."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include or None, include_defaults=defaults)


def _shipped_spec(path: Path) -> dict:
    """A shipped task's YAML as a config, its data files named by absolute path (lm-eval would
    read a relative path from the working folder)."""
    import yaml

    spec = yaml.safe_load(path.read_text())
    files = {split: str(path.parent / name) for split, name in spec["dataset_kwargs"]["data_files"].items()}
    spec["dataset_kwargs"] = {**spec["dataset_kwargs"], "data_files": files}
    return spec


@contextlib.contextmanager
def hub(allowed: bool):
    """The Hugging Face Hub switched off for `datasets` (unless `allowed`) while lm-eval loads tasks."""
    import datasets
    import huggingface_hub.constants as hub_constants

    before = datasets.config.HF_HUB_OFFLINE, hub_constants.HF_HUB_OFFLINE
    if not allowed:
        datasets.config.HF_HUB_OFFLINE = hub_constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, hub_constants.HF_HUB_OFFLINE = before


@contextlib.contextmanager
def random_state_kept(device: torch.device):
    """Python's, NumPy's and torch's random generators as they were before (lm-eval seeds them all)."""
    py, npy = random.getstate(), np.random.get_state()
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            random.setstate(py)
            np.random.set_state(npy)


@contextlib.contextmanager
def _quiet():
    """lm-eval's log lines (its settings, a task's version, each warning of its own) kept below errors."""
    import logging

    logger = logging.getLogger("lm_eval")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def evaluate_tasks(lm, names: list[str], *, limit: int = 0, include: str = "", download: bool = False,
                   seed: int = 0, what: str = "eval.tasks") -> dict:
    """lm-eval's results (`simple_evaluate`'s dict) of model `lm` (an lm-eval LM) on the tasks `names`,
    at most `limit` examples of each (0: all). A data set that would need a download (not allowed):
    one line naming it."""
    from lm_eval import simple_evaluate

    specs, manager = task_specs(names, include, what)
    with hub(download), random_state_kept(lm.device or torch.device("cpu")), _quiet():
        try:
            return simple_evaluate(model=lm, tasks=specs, task_manager=manager, limit=limit or None,
                                   bootstrap_iters=0, log_samples=True, random_seed=seed, numpy_random_seed=seed,
                                   torch_random_seed=seed, fewshot_random_seed=seed)
        except ConnectionError as e:  # datasets: "Couldn't reach 'NAME' on the Hub (OfflineModeIsEnabled)"
            raise ConfigError(f"{what}: a task's data set must be downloaded first ({e}); allow it with "
                              "eval.download=true (scaletrain eval: --download), or give a task whose data is "
                              "local (docs/guides/evaluation.md)") from None


def scores(results: dict) -> dict[str, float]:
    """The numbers of lm-eval's results as flat names: tasks/TASK/METRIC (tasks/TASK/METRIC/FILTER for
    a filter other than lm-eval's default), standard errors left out."""
    out = {}
    for task, metrics in sorted(results["results"].items()):
        for key, value in metrics.items():
            metric, _, kept = key.partition(",")
            if not kept or metric.endswith("_stderr") or isinstance(value, bool) \
                    or not isinstance(value, (int, float)):
                continue
            out[f"tasks/{task}/{metric}" + (f"/{kept}" if kept != "none" else "")] = float(value)
    return out


@dataclass
class TaskEvaluation:
    """eval.tasks during training: due every eval.every steps and at the last; `run(trainer)` scores
    the live model (every rank takes part) and returns the scores for the step's metrics row."""

    names: list[str]
    every: int
    limit: int
    include: str
    download: bool
    batch_size: int

    @classmethod
    def for_run(cls, cfg) -> TaskEvaluation | None:
        """None when the run evaluates no task; else checked now (lm-eval installed, every task known),
        not after hours of training."""
        e = cfg.eval
        if not (e.tasks and e.every):
            return None
        require_lm_eval("eval.tasks")
        names = task_names(e.tasks, "eval.tasks")
        task_specs(names, e.include, "eval.tasks")
        return cls(names, e.every, e.limit, e.include, e.download, e.batch_size)

    def due(self, step: int, last: int) -> bool:
        return step % self.every == 0 or step == last

    def run(self, t) -> dict[str, float]:
        """The task scores of Trainer `t`'s model as it stands, in eval mode, on every rank alike."""
        from scaletrain.train.evaluate import restore_modes
        from scaletrain.train.lm_eval_model import HarnessLM

        t.health.enter("downstream evaluation (eval.tasks)")
        modules = t.pm.dp.modules
        was_training = [m.training for m in modules]
        for m in modules:
            m.eval()
        try:
            lm = HarnessLM(t.pm.dp.module, t.data.corpus.tokenizer, max_length=t.cfg.model.max_seq_len,
                           device=t.rt.device, batch_size=self.batch_size, autocast=t.precision.autocast)
            results = evaluate_tasks(lm, self.names, limit=self.limit, include=self.include,
                                     download=self.download, seed=t.cfg.train.seed)
        finally:
            restore_modes(modules, was_training, reshard=t.pm.dp.zero == 3)
        return scores(results) if results is not None else {}
