"""Out of memory is one line with the fix: a weight larger than memory (refused before the
allocator's traceback), and activations that do not fit (the option to lower)."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from scaletrain.errors import ConfigError
from scaletrain.train.trainer import Trainer

from conftest import MICRO_ARGS, micro_cfg


def _limit_address_space():
    limit = 16 * 2**30  # far below the 4 TiB the model asks for; a refusal, never the OOM killer
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def test_model_too_large_for_memory_is_one_line(assets, tmp_path):
    """A single weight larger than memory: a clear line, not an allocator traceback."""
    r = subprocess.run([sys.executable, "-m", "scaletrain", "train", *MICRO_ARGS, "--model.dim=1048576",
                        f"--data.path={assets / 'data'}", f"--log.run_dir={tmp_path / 'run'}"],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path, preexec_fn=_limit_address_space,
                       env={**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""})  # no driver mappings
    assert r.returncode == 2, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("scaletrain: error: the model's weights"), r.stderr[-2000:]
    assert "do not fit in cpu memory" in lines[0] and "scaletrain plan" in lines[0]
    assert list(tmp_path.iterdir()) == []


def test_out_of_memory_in_activations_is_one_line_with_the_fix(tmp_path):
    overcommit = Path("/proc/sys/vm/overcommit_memory")
    if not overcommit.exists() or overcommit.read_text().strip() == "1":
        pytest.skip("the kernel grants any allocation here (overcommit_memory=1): no real out-of-memory error")
    # the logits of one micro-batch: 256 x 1024 x 262144 x 4 bytes = 256 GiB, far beyond this machine
    text = tmp_path / "t.txt"
    text.write_text("".join(chr(32 + i % 95) for i in range(300_000)))
    from scaletrain.data.prepare import prepare

    prepare([str(text)], str(tmp_path / "data"))
    trainer = Trainer(micro_cfg(tmp_path, **{
        "data.path": str(tmp_path / "data"), "model.vocab_size": 262144, "model.dim": 16, "model.n_heads": 2,
        "model.n_layers": 1, "model.max_seq_len": 1024, "data.seq_len": 1024, "train.global_batch": 256,
        "train.micro_batch": 256, "train.steps": 1}))
    with pytest.raises(ConfigError) as e:
        trainer.fit()
    assert str(e.value) == (
        "step 1: out of cpu memory on rank 0 during forward/backward (activations of micro-batch 256 x data.seq_len "
        "1024); lower train.micro_batch (now 256; gradient accumulation keeps the global batch), or set "
        "memory.activation_checkpointing=selective or full")
