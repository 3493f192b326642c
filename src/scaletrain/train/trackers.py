"""Experiment trackers beside metrics.jsonl and TensorBoard: Weights & Biases (log.wandb =
PROJECT) and MLflow (log.mlflow = EXPERIMENT), both optional extras.

Each gets the same rows as metrics.jsonl (every number of a row, at its step) and the resolved
config as the run's parameters; log.run_name and log.tags name and tag the run in both. A resumed
run continues the same tracker run: W&B's run id is the scaletrain run's own id (kept across
resumes), and the MLflow run is found again by its tag scaletrain.run_id.

Only rank 0 logs. A tracker asked for whose package is not installed stops the run before it
starts (one line, exit 2); one that cannot start (no network, no login) is one line at start-up
and the run goes on without it; one that fails later is one line and is dropped: a tracker never
stops training.
"""

from __future__ import annotations

import importlib.util
import math
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from scaletrain.config import flat_keys

PACKAGES = {"wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow")}  # option -> (module, extra)


def missing_packages(log_cfg) -> list[str]:
    """One line for each tracker asked for whose package is not installed."""
    out = []
    for option, (module, extra) in PACKAGES.items():
        if getattr(log_cfg, option) and importlib.util.find_spec(module) is None:
            out.append(f"log.{option}={getattr(log_cfg, option)!r} needs the {module} package, which is not installed: "
                       f"pip install 'scaletrain[{extra}]' (or set log.{option} to \"\" to train without it)")
    return out


def parse_tags(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def flat_config(cfg_dict: dict) -> dict[str, object]:
    """{"section.key": value} of a config tree ("parallel.sync.every": a sub-table's keys)."""
    return flat_keys(cfg_dict)


def numbers(row: dict) -> dict[str, float]:
    return {k: float(v) for k, v in row.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


class Trackers:
    """The trackers of one run (rank 0). `say`: where their one-line notes go."""

    def __init__(self, cfg, run_dir: Path, run_id: str, say: Callable[[str], None],
                 stopping: Callable[[], bool] = lambda: False):
        """`stopping`: whether a signal asked the run to stop (then no tracker is waited for)."""
        self.say = say
        self.active: dict[str, object] = {}
        name = cfg.log.run_name or Path(run_dir).resolve().name
        tags = parse_tags(cfg.log.tags)
        for option, start in (("wandb", _WandB), ("mlflow", _MLflow)):
            if not getattr(cfg.log, option):
                continue
            try:
                self.active[option] = _started_within(cfg.log.tracker_wait_s, stopping, start, cfg, Path(run_dir),
                                                      run_id, name, tags)
            except Exception as e:  # noqa: BLE001 - whatever the client raises, the run goes on
                say(f"log.{option}: the tracker could not start ({_reason(e)}); this run logs to metrics.jsonl "
                    f"{'and TensorBoard ' if cfg.log.tensorboard else ''}without it")
            else:
                say(f"log.{option}: logging to {self.active[option].where}")

    def log(self, row: dict) -> None:
        for option, tracker in list(self.active.items()):
            try:
                tracker.log(row)
            except Exception as e:  # noqa: BLE001
                del self.active[option]
                self.say(f"log.{option}: the tracker failed at step {row.get('step')} ({_reason(e)}); the run goes "
                         "on without it")

    def close(self) -> None:
        for option, tracker in list(self.active.items()):
            try:
                tracker.close()
            except Exception as e:  # noqa: BLE001
                self.say(f"log.{option}: closing the tracker's run failed ({_reason(e)})")
        self.active = {}


def _started_within(wait_s: float, stopping: Callable[[], bool], start, *args):
    """start(*args) in a thread of its own, waited for `wait_s` seconds at most, or until a signal
    asks the run to stop: a client's retries against a server that does not answer (MLflow's last
    minutes) neither stall the run nor hold off its Ctrl-C. The thread left behind is a daemon."""
    outcome: dict = {}

    def target():
        try:
            outcome["tracker"] = start(*args)
        except Exception as e:  # noqa: BLE001 - reported by the caller, in the main thread
            outcome["error"] = e

    thread = threading.Thread(target=target, name="scaletrain-tracker-start", daemon=True)
    thread.start()
    deadline = time.monotonic() + wait_s
    while thread.is_alive() and time.monotonic() < deadline and not stopping():
        thread.join(0.1)  # short waits: the signal handlers run in between
    if "error" in outcome:
        raise outcome["error"]
    if "tracker" in outcome:
        return outcome["tracker"]
    if stopping():
        raise TimeoutError("the run was stopped by a signal while it started")
    raise TimeoutError(f"no answer within log.tracker_wait_s={wait_s:g} s")


def _reason(e: Exception, limit: int = 300) -> str:
    """The error's first line, whole, or, when longer than `limit`, up to the end of its last
    sentence within it (never cut mid-word: "…" says the rest was left out)."""
    text = str(e).strip().splitlines()
    if not text:
        return type(e).__name__
    first = text[0]
    if len(first) > limit:
        head = first[:limit]
        end = max(head.rfind(". "), head.rfind("; "))
        first = head[:end + 1] if end > limit // 3 else head[:head.rfind(" ")] + " …"
    return f"{type(e).__name__}: {first}"


class _WandB:
    def __init__(self, cfg, run_dir: Path, run_id: str, name: str, tags: list[str]):
        import wandb

        run_dir.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=cfg.log.wandb, name=name, tags=tags, id=run_id, resume="allow",
                              dir=str(run_dir), config=cfg.to_dict(), allow_val_change=True,
                              settings=wandb.Settings(console="off", silent=True,
                                                      init_timeout=cfg.log.tracker_wait_s))
        self.run.define_metric("*", step_metric="step")  # our step is the x axis (a resume logs steps again)
        self.where = f"W&B project {cfg.log.wandb}, run {run_id} ({self.run.settings.mode}, {run_dir / 'wandb'})"

    def log(self, row: dict) -> None:
        self.run.log(numbers(row))

    def close(self) -> None:
        self.run.finish()


class _MLflow:
    def __init__(self, cfg, run_dir: Path, run_id: str, name: str, tags: list[str]):
        from mlflow import MlflowClient
        from mlflow.entities import Param

        # no URI given anywhere: a database in the run folder (MLflow's own default is the working folder)
        uri = cfg.log.mlflow_uri or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{run_dir / 'mlflow.db'}"
        run_dir.mkdir(parents=True, exist_ok=True)
        self.client = client = MlflowClient(tracking_uri=uri)
        experiment = client.get_experiment_by_name(cfg.log.mlflow)
        experiment_id = experiment.experiment_id if experiment else client.create_experiment(cfg.log.mlflow)
        found = client.search_runs([experiment_id], filter_string=f"tags.`scaletrain.run_id` = '{run_id}'",
                                   max_results=1)
        if found:  # a resumed run: the same MLflow run
            self.run_id = found[0].info.run_id
            logged = set(found[0].data.params)
            client.update_run(self.run_id, status="RUNNING")
        else:
            tag_map = {"scaletrain.run_id": run_id, "scaletrain.run_dir": str(run_dir)}
            for tag in tags:
                key, eq, value = tag.partition("=")
                tag_map[key.strip()] = value.strip() if eq else "true"
            self.run_id = client.create_run(experiment_id, run_name=name, tags=tag_map).info.run_id
            logged = set()
        # parameters are fixed once logged: a resume adds only those that were not
        params = [Param(k, str(v)[:6000]) for k, v in flat_config(cfg.to_dict()).items() if k not in logged]
        for i in range(0, len(params), 100):  # MLflow takes 100 parameters per call
            client.log_batch(self.run_id, params=params[i:i + 100])
        self.where = f"MLflow experiment {cfg.log.mlflow}, run {self.run_id} ({client.tracking_uri})"

    def log(self, row: dict) -> None:
        from mlflow.entities import Metric

        now, step = int(time.time() * 1000), int(row["step"])
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in numbers(row).items()
                                                    if k != "step"])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)
