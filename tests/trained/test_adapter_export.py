"""Adapters out of scaletrain (scaletrain.trained.adapters): a PEFT adapter folder that the real
`peft` package loads onto the Hugging Face base with scaletrain's logits, a merged Hugging Face
model with them too, eval and generate of an adapter run or a PEFT folder equal to the merged
model's, and bad input (another base, peft missing, ...) one line each."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from scaletrain.train.trainer import Trainer
from scaletrain.trained.adapters import adapted_from_checkpoint, load_peft, merge_adapters

from conftest import micro_cfg, one_line_exit_2, run_here

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

TOL = 1e-5  # fp32, absolute, on logits of order 1


def tokens() -> torch.Tensor:
    return torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))


def hf_model(folder, family: str, noise: float = 0.0) -> dict:
    """A tiny random Llama or Qwen3 saved by transformers: the run's model.init_from."""
    torch.manual_seed(0)
    shape = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64)
    config = transformers.LlamaConfig(**shape) if family == "llama" else transformers.Qwen3Config(**shape, head_dim=24)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(noise * torch.randn_like(p))
    model.save_pretrained(folder)
    return {"model.from_hf": str(folder), "model.init_from": str(folder), "data.seq_len": 16, "model.max_seq_len": 64}


def adapter_run(tmp_path, family: str, **adapter) -> str:
    """An adapter run on an HF base, trained hard enough (lr 1e-2) that B A is far from zero;
    its final checkpoint."""
    run = {"train.steps": 3, "optim.lr": 0.01, "checkpoint.save_final": True, **hf_model(tmp_path / "hf", family),
           **{f"adapter.{k}": v for k, v in adapter.items()}}
    return Trainer(micro_cfg(tmp_path, **run)).fit()["checkpoint"]


def hf_logits(folder, adapters=None) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    if adapters is not None:
        model = peft.PeftModel.from_pretrained(model, str(adapters))
    with torch.no_grad():
        return model.eval()(tokens()).logits


def assert_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    err = (got - want).abs().max().item()
    assert err <= TOL, f"{what}: logits differ by {err:.3g}"


@pytest.fixture(scope="module")
def dora_llama(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dora-llama")
    return tmp, adapter_run(tmp, "llama", kind="dora", rslora=True, targets="all-linear")


@pytest.mark.parametrize("family,kind,targets", [("llama", "dora", "all-linear"), ("qwen3", "lora", "attention")])
def test_peft_and_merged_exports_give_scaletrains_logits(request, tmp_path, family, kind, targets):
    if family == "llama":
        tmp_path, saved = request.getfixturevalue("dora_llama")
    else:
        saved = adapter_run(tmp_path, family, kind=kind, targets=targets)
    ours, cfg = adapted_from_checkpoint(saved)
    with torch.no_grad():
        want = ours(tokens())
    assert (want - hf_logits(tmp_path / "hf")).abs().max() > 0.1  # the adapters changed the model

    peft_dir = tmp_path / f"peft-{family}"
    r = run_here("export", saved, "--format", "peft", "--out", str(peft_dir))
    assert r.returncode == 0, r.stderr
    config = json.loads((peft_dir / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 8, 16.0)
    assert (config["use_dora"], config["use_rslora"]) == (kind == "dora", family == "llama")
    assert config["base_model_name_or_path"] == str((tmp_path / "hf").resolve())
    leaves = {"q_proj", "k_proj", "v_proj", "o_proj"} | ({"gate_proj", "up_proj", "down_proj"} if family == "llama"
                                                         else set())
    assert set(config["target_modules"]) == leaves
    assert_close(hf_logits(tmp_path / "hf", peft_dir), want, f"{family} {kind}: PeftModel.from_pretrained")

    merged_dir = tmp_path / f"merged-{family}"
    r = run_here("export", saved, "--format", "hf", "--out", str(merged_dir))
    assert r.returncode == 0, r.stderr
    assert_close(hf_logits(merged_dir), want, f"{family} {kind}: the merged export")

    back, _ = load_peft(peft_dir)  # PEFT's names read back onto the base, rows and all
    with torch.no_grad():
        assert_close(back(tokens()), want, f"{family} {kind}: the PEFT folder read back")
        assert_close(merge_adapters(back)(tokens()), want, f"{family} {kind}: the PEFT folder merged")


def test_module_names_and_rows_follow_the_family():
    from scaletrain.errors import ConfigError
    from scaletrain.model.config import model_config
    from scaletrain.model.hf import hf_linear

    llama = model_config({"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "position": "rope",
                          "norm": "rmsnorm", "activation": "swiglu"})
    assert hf_linear("layers.1.attn.wq", llama) == ("model.layers.1.self_attn.q_proj", 4)
    assert hf_linear("layers.1.attn.wk", llama) == ("model.layers.1.self_attn.k_proj", 2)  # kv heads' rows
    assert hf_linear("layers.0.attn.wv", llama) == ("model.layers.0.self_attn.v_proj", 0)
    assert hf_linear("layers.0.mlp.w3", llama) == ("model.layers.0.mlp.up_proj", 0)
    assert hf_linear("output", llama) == ("lm_head", 0)
    with pytest.raises(ConfigError, match="GPT-2 keeps q, k and v in one fused"):
        hf_linear("layers.0.attn.wq", model_config({"dim": 64, "n_layers": 2, "n_heads": 4}))


def test_a_folder_saved_by_peft_itself_reads_back_onto_its_base(tmp_path):
    hf_model(tmp_path / "hf", "llama")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32)
    pm = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"],
                                                    use_dora=True))
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.add_(0.3 * torch.randn_like(p))
        want = pm.eval()(tokens()).logits
    pm.save_pretrained(str(tmp_path / "theirs"))
    config = json.loads((tmp_path / "theirs" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(tmp_path / "hf")
    # without base_model_name_or_path, --base names the base
    (tmp_path / "theirs" / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": None}))
    one_line_exit_2(run_here("generate", str(tmp_path / "theirs"), "--prompt", "x"), "names no base",
                    "give --base FOLDER")
    ours, meta = load_peft(tmp_path / "theirs", tmp_path / "hf")
    assert meta == {"format": "pt"}
    with torch.no_grad():
        assert_close(ours(tokens()), want, "a PEFT-saved DoRA folder")
    # no run's config in it: eval needs --data ("" = the built-in byte-level text, this base's vocabulary)
    base = ("--base", str(tmp_path / "hf"))
    one_line_exit_2(run_here("eval", str(tmp_path / "theirs"), *base), "names no run", "give --data FOLDER")
    r = run_here("eval", str(tmp_path / "theirs"), *base, "--data", "", "--batches", "1", "--device", "cpu", "--json")
    assert r.returncode == 0, r.stderr
    assert 0 < json.loads(r.stdout)["val_loss"] < 10


def test_eval_and_generate_of_the_run_and_of_its_peft_folder_equal_the_merged_models(dora_llama):
    tmp_path, saved = dora_llama
    peft_dir, merged = tmp_path / "peft-eval", tmp_path / "merged-eval"
    for fmt, out in (("peft", peft_dir), ("hf", merged)):
        assert run_here("export", saved, "--format", fmt, "--out", str(out)).returncode == 0
    greedy = ("--prompt", "The ", "--max-new-tokens", "12", "--top-k", "1", "--device", "cpu")
    texts = {}
    for what, args in (("checkpoint", [saved]), ("peft", [str(peft_dir)]),
                       ("peft+base", [str(peft_dir), "--base", str(tmp_path / "hf")]), ("merged", [str(merged)])):
        r = run_here("generate", *args, *greedy)
        assert r.returncode == 0, (what, r.stderr)
        texts[what] = r.stdout
    assert len(set(texts.values())) == 1 and len(texts["merged"]) > len("The "), texts
    r = run_here("quantize", saved, "--scheme", "int8-weight", "--out", str(tmp_path / "q"))  # merged, then quantized
    assert r.returncode == 0, r.stderr
    losses = {}
    for what, args in (("checkpoint", [saved]), ("peft", [str(peft_dir), "--base", str(tmp_path / "hf")])):
        r = run_here("eval", *args, "--batches", "1", "--device", "cpu", "--json")
        assert r.returncode == 0, (what, r.stderr)
        losses[what] = json.loads(r.stdout)["val_loss"]
    assert losses["checkpoint"] == pytest.approx(losses["peft"], abs=1e-6), losses
    # ... and that is the merged model's loss, against the unmerged model's logits
    ours, _ = adapted_from_checkpoint(saved)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(merged), dtype=torch.float32)
    with torch.no_grad():
        assert_close(model(tokens()).logits, ours(tokens()), "the merged export")


def test_bad_adapter_input_is_one_line_each(dora_llama, tmp_path, monkeypatch):
    run_dir, saved = dora_llama
    other = tmp_path / "other"
    hf_model(other, "llama", noise=0.01)
    peft_dir = tmp_path / "peft"
    assert run_here("export", saved, "--format", "peft", "--out", str(peft_dir)).returncode == 0
    # another base: the checkpoint's and the PEFT folder's fingerprints refuse it
    one_line_exit_2(run_here("eval", saved, "--base", str(other)), "adapters were trained on the base",
                    "give --base FOLDER, the base they were trained on")
    one_line_exit_2(run_here("generate", str(peft_dir), "--base", str(other), "--prompt", "x"),
                    "adapters were trained on the base", f"{other} has sha256")
    one_line_exit_2(run_here("export", saved, "--format", "hf", "--out", str(tmp_path / "m"), "--base",
                             str(tmp_path / "nowhere")), "is not there; give --base FOLDER")
    one_line_exit_2(run_here("generate", str(peft_dir), "--base", str(tmp_path), "--prompt", "x"),
                    "is not a Hugging Face model folder")
    one_line_exit_2(run_here("export", saved, "--format", "peft", "--out", str(peft_dir)), "already exists",
                    "nothing was overwritten")
    for verb in (["export", str(peft_dir), "--format", "hf"], ["quantize", str(peft_dir), "--scheme", "int8-weight"]):
        one_line_exit_2(run_here(*verb, "--out", str(tmp_path / "q")), "is a PEFT adapter folder; this command takes "
                                                                       "an adapter run")
    # peft missing: the export says how to get it, and writes nothing
    monkeypatch.setitem(sys.modules, "peft", None)
    one_line_exit_2(run_here("export", saved, "--format", "peft", "--out", str(tmp_path / "p2")),
                    "needs the peft package: pip install peft==0.21.2")
    assert not (tmp_path / "p2").exists()
    monkeypatch.undo()
    # adapter folders that scaletrain cannot compute as PEFT would
    config = json.loads((peft_dir / "adapter_config.json").read_text())
    (peft_dir / "adapter_config.json").write_text(json.dumps({**config, "rank_pattern": {"q_proj": 4}}))
    one_line_exit_2(run_here("generate", str(peft_dir), "--prompt", "x"), 'rank_pattern={"q_proj": 4} is not '
                                                                           "supported")
    # --base where there are no adapters; PEFT of a base that is no Hugging Face folder
    one_line_exit_2(run_here("generate", str(run_dir / "hf"), "--base", str(other), "--prompt", "x"),
                    "holds none: drop --base")
    seeded = Trainer(micro_cfg(tmp_path / "seed", **{"train.steps": 1, "adapter.kind": "lora",
                                                     "checkpoint.save_final": True})).fit()["checkpoint"]
    one_line_exit_2(run_here("export", seeded, "--format", "peft", "--out", str(tmp_path / "p3")),
                    "initialised from seed", "not a Hugging Face model folder", "--format hf")
