"""`model.init_from`: a new run that starts from a Hugging Face model's weights (or a
safetensors file, or a scaletrain export), under any layout; and the round trip HF -> train ->
export -> transformers."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from scaletrain.config import load_config  # noqa: E402
from scaletrain.errors import CheckpointError, ConfigError  # noqa: E402
from scaletrain.train.trainer import Trainer  # noqa: E402
from scaletrain.trained.export import load_model_from_checkpoint  # noqa: E402

from conftest import MICRO, MICRO_ARGS, REPO, micro_cfg, read_metrics, run_here, verdict_margin  # noqa: E402

# byte-level vocabulary (the built-in data), so the HF model and the data agree
FAMILIES = {
    "llama": ("LlamaConfig", dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)),
    "gpt2": ("GPT2Config", dict(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=64)),
    "qwen3": ("Qwen3Config", dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                                  max_position_embeddings=64)),
}


def make_hf(family: str, folder):
    cls, kw = FAMILIES[family]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls)(**kw),
                                                          attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("bias") or "norm" in n or ".ln_" in n:
                p.add_(0.2 * torch.randn_like(p))
    model.eval().save_pretrained(folder)
    return model


def hf_overrides(folder, **more) -> dict:
    return {"model.from_hf": str(folder), "model.init_from": str(folder), "data.seq_len": 16,
            "model.max_seq_len": 64, **more}


TOKENS = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_new_run_starts_from_the_hf_weights(tmp_path, family):
    hf = make_hf(family, tmp_path / "hf")
    trainer = Trainer(micro_cfg(tmp_path, **hf_overrides(tmp_path / "hf", **{"train.steps": 2})))
    module = trainer.pm.dp.module.eval()
    with torch.no_grad():
        ours, theirs = module(TOKENS), hf(TOKENS).logits
    assert (ours - theirs).abs().max() <= 1e-5
    module.train()
    result = trainer.fit()
    assert result["step"] == 2 and math_finite(result["losses"])


def math_finite(values) -> bool:
    return all(v == v and abs(v) != float("inf") for v in values)


@pytest.mark.slow
def test_hf_in_train_export_transformers_loads_and_matches(tmp_path):
    """HF -> 5 steps of fine-tuning -> export --format hf -> transformers, no scaletrain code."""
    hf = make_hf("llama", tmp_path / "hf")
    Trainer(micro_cfg(tmp_path, **hf_overrides(tmp_path / "hf", **{"train.steps": 5,
                                                                   "checkpoint.save_final": True}))).fit()
    ckpt = max((tmp_path / "run" / "checkpoints").glob("step_*"))
    ours = load_model_from_checkpoint(ckpt).eval()
    out = subprocess.run([sys.executable, "-m", "scaletrain", "export", str(ckpt), "--format", "hf",
                          "--out", str(tmp_path / "export")], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stderr
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    with torch.no_grad():
        trained, exported, start = ours(TOKENS), back(TOKENS).logits, hf(TOKENS).logits
    assert (trained - exported).abs().max() <= 1e-5
    assert (trained - start).abs().max() > 1e-3  # the 5 steps did move the weights


def test_resuming_a_run_started_from_hf_takes_the_checkpoint(tmp_path):
    make_hf("gpt2", tmp_path / "hf")
    overrides = hf_overrides(tmp_path / "hf", **{"train.steps": 4, "checkpoint.every": 2})
    straight = Trainer(micro_cfg(tmp_path, **{**overrides, "log.run_dir": str(tmp_path / "a")})).fit()
    Trainer(micro_cfg(tmp_path, **{**overrides, "train.steps": 2, "log.run_dir": str(tmp_path / "b")})).fit()
    resumed = Trainer(micro_cfg(tmp_path, **{**overrides, "log.run_dir": str(tmp_path / "b"),
                                             "checkpoint.resume": "auto"}))
    assert resumed.step == 2
    resumed.fit()
    assert [(r["step"], r["loss"], r["grad_norm"]) for r in read_metrics(tmp_path / "b")] == \
        [(r["step"], r["loss"], r["grad_norm"]) for r in straight["history"]]  # every step, every bit


def test_init_from_weights_of_another_shape_is_refused(tmp_path):
    make_hf("llama", tmp_path / "hf")
    with pytest.raises(ConfigError, match=r"model.rope_theta=500.0 differs from .*config.json \(10000.0\)"):
        Trainer(micro_cfg(tmp_path, **hf_overrides(tmp_path / "hf", **{"model.rope_theta": 500.0})))
    with pytest.raises(CheckpointError, match=r"the tensor for tok_emb.weight has shape \(256, 64\), the model "
                                              r"expects \(512, 64\)"):
        Trainer(micro_cfg(tmp_path, **hf_overrides(tmp_path / "hf", **{"model.vocab_size": 512})))
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        Trainer(micro_cfg(tmp_path, **hf_overrides(tmp_path / "hf", **{"model.init_from": str(tmp_path)})))


@pytest.mark.multiproc
@pytest.mark.usefixtures("forked_launches")  # verify's ranks forked (conftest.forked_launches)
@pytest.mark.parametrize("layout", [
    ["--nproc=2", "--parallel.zero=3"],
    ["--parallel.tp=2"],
    ["--parallel.pp=2", "--parallel.pp_schedule=gpipe"],
], ids=["dp2-zero3", "tp2", "pp2"])
def test_fine_tuning_from_hf_passes_verify(tmp_path, layout):
    make_hf("qwen3", tmp_path / "hf")
    args = [f"--{k}={v}" for k, v in {**MICRO, **hf_overrides(tmp_path / "hf")}.items()
            if not k.startswith(("log.", "checkpoint."))]
    r = run_here("verify", "--steps=4", *args, *layout)
    verdict = r.stdout.strip().splitlines()[-1]  # verify's last line is its verdict
    assert r.returncode == 0 and verdict.startswith("largest relative difference: loss ") and \
        verdict.endswith(" (precision 32-true): PASS"), f"{verdict_margin(verdict)}\n{r.stdout}{r.stderr}"


def test_config_loading_reads_only_the_shape(tmp_path):
    make_hf("qwen3", tmp_path / "hf")
    cfg = load_config(None, hf_overrides(tmp_path / "hf"))
    assert (cfg.model.head_dim, cfg.model.qk_norm, cfg.model.n_kv_heads) == (24, True, 2)
    assert cfg.model.init_from == str(tmp_path / "hf")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_shard_reads_only_its_part_and_equals_the_full_tensor(tmp_path, family):
    """What a sharded rank reads (rows of whole heads through the rotary permutation, Conv1D's
    transposed columns, an offset into GPT-2's fused q/k/v) equals the slice of the full tensor."""
    from scaletrain.model.hf import load_hf_weights

    make_hf(family, tmp_path / "hf")
    cfg = load_config(None, hf_overrides(tmp_path / "hf")).model
    weights = load_hf_weights(tmp_path / "hf", cfg)
    gen = torch.Generator().manual_seed(0)
    for name in weights:
        full = weights[name]
        for _ in range(3):
            index = []
            for size in full.shape:
                a = int(torch.randint(0, size, (), generator=gen))
                b = int(torch.randint(a + 1, size + 1, (), generator=gen))
                index.append(slice(a, b))
            before = weights.bytes_read
            part = weights.read(name, tuple(index))
            assert torch.equal(part, full[tuple(index)]), (name, index)
            assert weights.bytes_read - before <= full.numel() * full.element_size()  # a part, at most whole heads
        empty = weights.read(name, (slice(0, 0), *[slice(0, n) for n in full.shape[1:]]))
        assert empty.shape[0] == 0


@pytest.mark.multiproc
def test_zero3_ranks_each_read_about_half_of_the_weights(tmp_path):
    make_hf("llama", tmp_path / "hf")
    args = [f"--{k}={v}" for k, v in {**MICRO, **hf_overrides(tmp_path / "hf"), "train.steps": 1}.items()
            if not k.startswith("log.run_dir")]

    def read_share(*extra):
        r = subprocess.run([sys.executable, "-m", "scaletrain", "train", *args, *extra], capture_output=True,
                           text=True, cwd=REPO, timeout=300)
        assert r.returncode == 0, r.stderr
        read, total = re.search(r"^weights from .*: rank 0 read ([\d.]+) MiB of ([\d.]+) MiB", r.stderr, re.M).groups()
        return float(read) / float(total)

    one = read_share(f"--log.run_dir={tmp_path / 'one'}")
    two = read_share("--nproc", "2", "--parallel.zero=3", f"--log.run_dir={tmp_path / 'two'}")
    assert one > 0.95  # one process reads everything once
    assert 0.4 < two < 0.6  # rank 0 of 2 reads its half


# --------------------------------------------------------------------------------------------
# A checkpoint of another tokenizer


@pytest.mark.slow
def test_fine_tuning_weights_of_another_tokenizer_is_one_line(tmp_path):
    """A BPE export fine-tuned on byte-level data: refused before training, in one line."""
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda".split()
    (tmp_path / "corpus").mkdir()
    for i in range(40):
        (tmp_path / "corpus" / f"{i}.txt").write_text(" ".join(words[(i + j) % len(words)] for j in range(400)))
    assert run_here("prepare", str(tmp_path / "corpus"), "--out", str(tmp_path / "bpe"), "--tokenizer", "bpe",
                    "--vocab-size", "300").returncode == 0
    common = [*MICRO_ARGS, "--train.eval_every=0", "--train.steps=1", "--checkpoint.save_final=true"]
    r = run_here("train", *common, f"--data.path={tmp_path / 'bpe'}", "--model.vocab_size=0",
                 f"--log.run_dir={tmp_path / 'run'}")
    assert r.returncode == 0, r.stderr
    step = tmp_path / "run" / "checkpoints" / "step_00000001"
    assert run_here("export", str(step), "--format", "hf", "--out", str(tmp_path / "exp")).returncode == 0
    tune = ["train", *common, f"--model.from_hf={tmp_path / 'exp'}", f"--model.init_from={tmp_path / 'exp'}"]
    r = run_here(*tune, f"--log.run_dir={tmp_path / 'tuned'}")  # on the built-in byte-level data
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "was trained with another tokenizer (a vocabulary of 300 tokens) than data.path the built-in data " \
           "(byte-level, 256 tokens)" in r.stderr
    fix = re.search(r"\(scaletrain prepare INPUT\.\.\. --out NEW_FOLDER --tokenizer (\S+)\)", r.stderr).group(1)
    assert run_here("prepare", str(tmp_path / "corpus"), "--out", str(tmp_path / "same"), "--tokenizer",
                    fix).returncode == 0
    r = run_here(*tune, f"--data.path={tmp_path / 'same'}", f"--log.run_dir={tmp_path / 'tuned2'}")
    assert r.returncode == 0, r.stderr  # the export's own tokenizer: accepted
    # and a scaletrain safetensors export records its tokenizer, so a single file is checked too
    assert run_here("export", str(step), "--out", str(tmp_path / "m.safetensors")).returncode == 0
    r = run_here("train", *common, f"--model.from_hf={tmp_path / 'exp'}",
                 f"--model.init_from={tmp_path / 'm.safetensors'}", f"--log.run_dir={tmp_path / 'tuned3'}")
    assert r.returncode == 2 and "another tokenizer" in r.stderr


@pytest.mark.slow
def test_a_run_from_a_relative_hugging_face_folder_resumes_from_another_directory(tmp_path):
    """Issue 47: the model's folder was stored as given (relative), so resuming from another directory
    failed with "'tiny-qwen3': not found". Every path a run stores works from any directory."""
    import json
    import os

    from conftest import run_cli

    common = [*MICRO_ARGS, "--train.eval_every=0", "--checkpoint.save_final=true"]
    assert run_here("train", *common, "--train.steps=1", f"--log.run_dir={tmp_path / 'base'}").returncode == 0
    step = tmp_path / "base" / "checkpoints" / "step_00000001"
    assert run_here("export", str(step), "--format", "hf", "--out", str(tmp_path / "exp")).returncode == 0
    relative = os.path.relpath(tmp_path / "exp", REPO)  # run_here runs from the repository
    r = run_here("train", *common, "--train.steps=1", f"--model.from_hf={relative}", f"--model.init_from={relative}",
                 f"--log.run_dir={tmp_path / 'tuned'}")
    assert r.returncode == 0, r.stderr
    saved = json.loads((tmp_path / "tuned" / "config.json").read_text())["model"]
    assert saved["from_hf"] == saved["init_from"] == str(tmp_path / "exp")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    r = run_cli("train", "--checkpoint.resume=auto", f"--log.run_dir={tmp_path / 'tuned'}", "--train.steps=2",
                cwd=elsewhere)  # the run's own config, from another directory
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "tuned" / "checkpoints" / "step_00000002").is_dir()
