"""`scaletrain plot RUN [RUN ...] --out FILE.png`: runs side by side from their metrics.jsonl.

Three panels against tokens trained on: the training loss (solid) with the validation loss
(dashed, dots), tokens/s, and the learning rate; one colour per run, named in the legend by its
folder. The PNG records what it draws in its "Description" text chunk (JSON: each panel's lines
and their point counts), so a reader (a test) can check it without reading pixels.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from scaletrain.errors import ConfigError, DataError

WIDTH, HEIGHT, DPI = 15.0, 4.5, 100  # inches, dots per inch: 1500 x 450 pixels
PANELS = (("loss", "loss"), ("tokens/s", "tokens_per_s"), ("learning rate", "lr"))


def read_run(folder: str | Path) -> list[dict]:
    """A run's metrics rows, each with "tokens" (rows written before it was logged get it from
    the run's config.json: step x global batch x sequence length)."""
    folder = Path(folder)
    f = folder / "metrics.jsonl"
    if not f.is_file():
        raise DataError(f"{folder}: no metrics.jsonl; give run folders (log.run_dir) of runs that logged a step")
    rows = []
    for line in f.read_text(errors="replace").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a row cut short by a crash
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            rows.append(row)
    if not rows:
        raise DataError(f"{f}: holds no metrics rows; give a run that logged at least one step")
    if any("tokens" not in r for r in rows):
        per_step = _tokens_per_step(folder)
        for r in rows:
            r.setdefault("tokens", r["step"] * per_step)
    return rows


def _tokens_per_step(folder: Path) -> int:
    try:
        cfg = json.loads((folder / "config.json").read_text())
        per_step = int(cfg["train"]["global_batch"]) * int(cfg["data"]["seq_len"])
    except (OSError, ValueError, KeyError, TypeError):
        per_step = 0
    if per_step <= 0:
        raise DataError(f"{folder}: its metrics rows have no token counts and its config.json no global batch; "
                        "plot a run written by this version of scaletrain")
    return per_step


def labels_of(folders: list[Path]) -> list[str]:
    """Each run's folder name; with the parent's too where two names are alike."""
    names = [f.resolve().name for f in folders]
    return [f"{f.resolve().parent.name}/{n}" if names.count(n) > 1 else n for f, n in zip(folders, names)]


def plot_runs(folders: list[str | Path], out: str | Path) -> dict:
    """Draw `folders`' runs into the PNG `out`; returns what was drawn (also in the PNG)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("scaletrain plot needs matplotlib: pip install matplotlib (or 'scaletrain[plot]')") from None
    paths = [Path(f) for f in folders]
    runs = [read_run(p) for p in paths]
    labels = labels_of(paths)
    fig, axes = plt.subplots(1, len(PANELS), figsize=(WIDTH, HEIGHT), dpi=DPI)
    drawn: dict[str, list] = {title: [] for title, _ in PANELS}
    for i, (rows, label) in enumerate(zip(runs, labels)):
        color = f"C{i % 10}"
        for ax, (title, key) in zip(axes, PANELS):
            points = [(r["tokens"], r[key]) for r in rows if _finite(r.get(key))]
            if key == "tokens_per_s":
                points = points[1:] or points  # the first row includes warm-up (and compile)
            if points:
                ax.plot(*zip(*points), color=color, label=label, linewidth=1.5)
                drawn[title].append({"label": label, "points": len(points), "color": color})
            if key == "loss":
                val = [(r["tokens"], r["val_loss"]) for r in rows if _finite(r.get("val_loss"))]
                if val:
                    ax.plot(*zip(*val), color=color, linestyle="--", marker="o", markersize=3,
                            label=f"{label} (validation)")
                    drawn[title].append({"label": f"{label} (validation)", "points": len(val), "color": color})
    for ax, (title, _) in zip(axes, PANELS):
        ax.set_title(title)
        ax.set_xlabel("tokens")
        ax.grid(alpha=0.3)
        if drawn[title]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    summary = {"runs": labels, "panels": drawn, "size": [int(WIDTH * DPI), int(HEIGHT * DPI)]}
    fig.savefig(out, dpi=DPI, metadata={"Description": json.dumps(summary)})
    plt.close(fig)
    return summary


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
