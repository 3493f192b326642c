"""`scaletrain plot`: several runs overlaid, read back from the PNG (its size, the lines it
records, and each run's colour in each panel)."""

from __future__ import annotations

import json

import pytest

from scaletrain.train.trainer import Trainer

from conftest import micro_cfg, run_here


def fake_run(folder, n: int, lr: float, slower: float = 1.0) -> None:
    folder.mkdir(parents=True)
    rows = []
    for step in range(1, n + 1):
        row = {"step": step, "tokens": step * 256, "loss": 5.0 / step ** 0.3, "lr": lr * min(1, step / 3),
               "tokens_per_s": 1000.0 / slower + step}
        if step % 4 == 0:
            row.update(val_loss=row["loss"] + 0.1, val_ppl=1.0)
        rows.append(row)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def pixels_near(img, rgb, box, tol=40) -> int:
    region = img.crop(box).convert("RGB")
    return sum(1 for p in region.getdata() if sum(abs(a - b) for a, b in zip(p, rgb)) < tol)


def test_plot_overlays_runs_with_a_legend(tmp_path):
    Image = pytest.importorskip("PIL.Image", reason="the plot extra (matplotlib, pillow) is missing")
    pytest.importorskip("matplotlib", reason="the plot extra is missing")
    fake_run(tmp_path / "ddp", 20, 3e-3)
    fake_run(tmp_path / "local-sgd", 16, 1e-3, slower=2)
    Trainer(micro_cfg(tmp_path / "real", **{"train.steps": 4, "train.eval_every": 2, "train.eval_batches": 1})).fit()
    out = tmp_path / "runs.png"
    r = run_here("plot", str(tmp_path / "ddp"), str(tmp_path / "local-sgd"), str(tmp_path / "real" / "run"),
                 "--out", str(out))
    assert r.returncode == 0, r.stderr
    img = Image.open(out)
    assert img.size == (1500, 450)
    drawn = json.loads(img.info["Description"])
    assert drawn["runs"] == ["ddp", "local-sgd", "run"]
    loss = {line["label"]: line["points"] for line in drawn["panels"]["loss"]}
    assert loss == {"ddp": 20, "ddp (validation)": 5, "local-sgd": 16, "local-sgd (validation)": 4,
                    "run": 4, "run (validation)": 2}
    assert [line["points"] for line in drawn["panels"]["tokens/s"]] == [19, 15, 3]  # the warm-up row left out
    assert [line["label"] for line in drawn["panels"]["learning rate"]] == ["ddp", "local-sgd", "run"]
    # each run's colour is there in each of the three panels
    for color in ((31, 119, 180), (255, 127, 14), (44, 160, 44)):  # matplotlib's C0, C1, C2
        for left in (0, 500, 1000):
            assert pixels_near(img, color, (left, 0, left + 500, 450)) > 50, (color, left)
    # bad input: one line, exit 2
    r = run_here("plot", str(tmp_path / "nothing"), "--out", str(out))
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"scaletrain: error: {tmp_path / 'nothing'}: no metrics.jsonl; give run folders (log.run_dir) of runs that "
        "logged a step"]
    r = run_here("plot", str(tmp_path / "ddp"), "--out", str(tmp_path / "x.jpg"))
    assert r.returncode == 2 and "give a file name ending in .png" in r.stderr
