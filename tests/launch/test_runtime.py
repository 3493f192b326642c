"""The process side without a launcher: `prepare_worker` under plain python is one process."""

from __future__ import annotations

from conftest import MICRO, REPO


def test_prepare_worker_without_a_launcher_is_one_process(monkeypatch, tmp_path):
    from scaletrain.config import load_config
    from scaletrain.runtime import prepare_worker
    from scaletrain.train.trainer import Trainer

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    cfg = load_config(REPO / "configs" / "tiny.toml", {**MICRO, "train.steps": 2, "log.run_dir": str(tmp_path / "r")})
    cfg, rt = prepare_worker(cfg)  # the README's snippet, under plain python
    assert rt.world_size == 1 and not rt.distributed
    assert Trainer(cfg, rt).fit()["step"] == 2
