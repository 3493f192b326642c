"""Quantize and eval faults (issue 37, point 10): an export of a model whose context is shorter
than the default data.seq_len quantizes and evaluates; a quantized folder whose model.safetensors
is cut short, random bytes or of other dtypes is one line, exit 2, no traceback. The files are
real: written by the CLI, then damaged on disk."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

pytest.importorskip("torchao")

from scaletrain.train.trainer import Trainer  # noqa: E402

from conftest import micro_cfg, one_line_exit_2, run_here  # noqa: E402


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """A 2-step run of a model of max_seq_len 32 (MICRO's), its export, and that export quantized
    by int8-weight and int8-int4 (qdata int8, and int4 packed in uint8)."""
    root = tmp_path_factory.mktemp("qfaults")
    cfg = micro_cfg(root, **{"train.steps": 2, "checkpoint.save_final": True})
    assert cfg.model.max_seq_len == 32 < 128  # shorter than the default data.seq_len
    Trainer(cfg).fit()
    ckpt = sorted((root / "run" / "checkpoints").glob("step_*"))[-1]
    export = root / "model.safetensors"
    r = run_here("export", str(ckpt), "--out", str(export))
    assert r.returncode == 0, r.stderr
    out = {"root": root, "export": export}
    for scheme in ("int8-weight", "int8-int4"):
        folder = root / f"q-{scheme}"
        r = run_here("quantize", str(export), "--scheme", scheme, "--out", str(folder))
        assert r.returncode == 0, r.stderr  # before the fix: data.seq_len=128 exceeds model.max_seq_len=32
        out[scheme] = folder
    return out


def test_an_export_of_a_short_context_model_quantizes_and_evaluates(made):
    info = json.loads((made["int8-weight"] / "quantization.json").read_text())
    assert info["config"]["model"]["max_seq_len"] == 32
    assert info["config"]["data"]["seq_len"] == 32  # the default 128, cut to what the model reads
    r = run_here("eval", str(made["int8-weight"]), "--json", "--batches", "1")
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    assert result["quantized"] == "int8-weight" and result["tokens"] == 32 * result["windows"]
    assert 0 < result["val_loss"] < 10


def damaged_copy(made, scheme, tmp_path):
    folder = tmp_path / f"copy-{scheme}"
    shutil.copytree(made[scheme], folder)
    return folder, folder / "model.safetensors"


@pytest.mark.parametrize("cut", ["half", "header", "one_byte"])
def test_a_truncated_weights_file_is_one_line(made, tmp_path, cut):
    folder, weights = damaged_copy(made, "int8-weight", tmp_path)
    size = weights.stat().st_size
    os.truncate(weights, {"half": size // 2, "header": 20, "one_byte": size - 1}[cut])
    one_line_exit_2(run_here("eval", str(folder)), str(weights), "truncated or corrupt",
                    "quantize the checkpoint again")


def test_random_bytes_in_the_weights_file_are_one_line(made, tmp_path):
    folder, weights = damaged_copy(made, "int8-weight", tmp_path)
    weights.write_bytes(os.urandom(weights.stat().st_size))
    one_line_exit_2(run_here("eval", str(folder)), str(weights), "truncated or corrupt")
    weights.write_bytes(b"")  # empty
    one_line_exit_2(run_here("eval", str(folder)), str(weights), "truncated or corrupt")


@pytest.mark.parametrize("scheme, tensor, dtype, said", [
    ("int8-weight", "layers.0.attn.wq.qdata", torch.float32, "layers.0.attn.wq.qdata is float32, not int8"),
    ("int8-int4", "layers.0.mlp.w1.qdata", torch.int8, "layers.0.mlp.w1.qdata is int8, not uint8"),
    ("int8-weight", "layers.1.mlp.w2.scale", torch.float16, "layers.1.mlp.w2.scale is float16, not float32"),
    ("int8-int4", "layers.0.attn.wo.zero_point", torch.int32, "layers.0.attn.wo.zero_point is int32, not int8"),
    ("int8-weight", "tok_emb.weight", torch.bfloat16, "tok_emb.weight is bfloat16, not float32"),
])
def test_tensors_of_another_dtype_are_one_line(made, tmp_path, scheme, tensor, dtype, said):
    from safetensors.torch import load_file, save_file

    folder, weights = damaged_copy(made, scheme, tmp_path)
    tensors = load_file(str(weights))
    assert tensor in tensors and tensors[tensor].dtype != dtype
    tensors[tensor] = tensors[tensor].to(dtype)
    save_file(tensors, str(weights))
    one_line_exit_2(run_here("eval", str(folder)), said, "quantize the checkpoint again")


def test_a_missing_weights_file_is_one_line(made, tmp_path):
    folder, weights = damaged_copy(made, "int8-weight", tmp_path)
    weights.unlink()
    one_line_exit_2(run_here("eval", str(folder)), str(weights), "is missing")
