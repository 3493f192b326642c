"""Hugging Face in and out: for each family, a tiny model made by transformers (from_config,
save_pretrained; nothing downloaded) computes the same logits in scaletrain after import, and
transformers computes ours after export."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from scaletrain.config import ModelConfig, load_config  # noqa: E402
from scaletrain.errors import CheckpointError, ConfigError  # noqa: E402
from scaletrain.model.hf import load_hf_weights, rows_hf_to_ours, rows_ours_to_hf  # noqa: E402
from scaletrain.model.hf_config import hf_config_from_model, model_config_from_hf  # noqa: E402
from scaletrain.model.transformer import Transformer, apply_rope, rope_frequencies  # noqa: E402
from scaletrain.plan.spec import hf_config_to_model  # noqa: E402
from scaletrain.trained.export_hf import byte_tokenizer_json, export_hf, save_hf  # noqa: E402

from conftest import assert_same_run, micro_cfg, micro_overrides, model_from_hf, run_group, run_here  # noqa: E402

TOL = 1e-5
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=64, rms_norm_eps=1e-6)
FAMILIES = {
    # Llama 3.1-style rope scaling, untied head
    "llama-rope-scaling": ("LlamaConfig", dict(TINY, num_key_value_heads=4, rope_theta=500000.0,
                                               rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                             "original_max_position_embeddings": 16})),
    # Llama with a tied head and biases on every linear layer
    "llama-tied-bias": ("LlamaConfig", dict(TINY, tie_word_embeddings=True, attention_bias=True, mlp_bias=True,
                                            rope_scaling={"rope_type": "linear", "factor": 2.0})),
    # Mistral: grouped-query attention, a window longer than the sequences
    "mistral-gqa": ("MistralConfig", dict(TINY, num_key_value_heads=2, sliding_window=32)),
    # Qwen2: biases on q, k and v only
    "qwen2-qkv-bias": ("Qwen2Config", dict(TINY, num_key_value_heads=2, tie_word_embeddings=True)),
    # Qwen3: head_dim apart from dim / n_heads, q/k norms
    "qwen3-head-dim-qk-norm": ("Qwen3Config", dict(TINY, num_key_value_heads=2, head_dim=24)),
    "gpt2-tied": ("GPT2Config", dict(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64)),
    "gpt2-untied": ("GPT2Config", dict(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64, n_inner=80,
                                       tie_word_embeddings=False, layer_norm_epsilon=1e-6)),
}


def hf_config(name: str, **change):
    """The transformers config make_hf builds its model from."""
    cls, kw = FAMILIES[name]
    return getattr(transformers, cls)(**{**kw, **change})


def make_hf(name: str, folder, save_kw: dict | None = None, **change):
    """A seeded tiny transformers model (FAMILIES' config, `change`d), its norms and biases moved
    off their 1/0 init (a wrong permutation of them must show), saved to `folder` (`save_kw`:
    save_pretrained's options)."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(name, **change), attn_implementation="eager",
                                                          dtype=torch.float32)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("bias") or "norm" in n or ".ln_" in n:
                p.add_(0.2 * torch.randn_like(p))
    model.eval().save_pretrained(folder, **(save_kw or {}))
    return model


def hf_logits(model, tokens):
    with torch.no_grad():
        return model(tokens).logits


def ours_from(folder, seq_len: int = 16) -> Transformer:
    return model_from_hf(folder, seq_len)


def our_logits(model, tokens):
    with torch.no_grad():
        return model(tokens)


@pytest.fixture
def tokens():
    return torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("name", FAMILIES)
def test_import_then_export_matches_transformers(name, tmp_path, tokens):
    hf = make_hf(name, tmp_path / "hf")
    ours = ours_from(tmp_path / "hf")
    ref = hf_logits(hf, tokens)
    assert ref.abs().max() > 0.1  # the comparison below is not of near-zeros
    assert (our_logits(ours, tokens) - ref).abs().max() <= TOL

    # change our weights (as training would), export, and let transformers load the folder on its own
    with torch.no_grad():
        for p in ours.parameters():
            p.add_(0.01 * torch.randn_like(p))
    save_hf(ours, tmp_path / "out")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    assert back.config.model_type == hf.config.model_type
    assert (hf_logits(back, tokens) - our_logits(ours, tokens)).abs().max() <= TOL


def test_the_features_land_where_the_family_puts_them(tmp_path):
    for name in FAMILIES:
        make_hf(name, tmp_path / name)
    m = {n: ModelConfig(**model_config_from_hf(tmp_path / n)) for n in FAMILIES}
    assert (m["llama-rope-scaling"].rope_scaling, m["llama-rope-scaling"].rope_factor) == ("llama3", 8.0)
    assert m["llama-rope-scaling"].rope_original_max_seq_len == 16 and m["llama-rope-scaling"].rope_theta == 500000
    assert m["llama-tied-bias"].bias and m["llama-tied-bias"].tie_embeddings
    assert (m["mistral-gqa"].kv_heads, m["mistral-gqa"].sliding_window) == (2, 32)
    assert m["qwen2-qkv-bias"].qkv_bias and not m["qwen2-qkv-bias"].bias
    q3 = m["qwen3-head-dim-qk-norm"]
    assert (q3.head_dim, q3.head_size, q3.qk_norm, q3.qkv_bias) == (24, 24, True, False)
    assert m["gpt2-untied"].hidden_dim == 80 and not m["gpt2-untied"].tie_embeddings and m["gpt2-tied"].bias
    # the planner reads the same configs
    assert hf_config_to_model(json.loads((tmp_path / "qwen3-head-dim-qk-norm" / "config.json").read_text())) == q3


def test_the_rope_permutation_is_what_makes_the_match(tmp_path, tokens):
    """Without reordering q/k rows the model loads, and computes something else."""
    hf = make_hf("mistral-gqa", tmp_path / "hf")
    ours = ours_from(tmp_path / "hf")
    with torch.no_grad():
        for block in ours.layers.values():
            block.attn.wq.weight.copy_(rows_ours_to_hf(block.attn.wq.weight, 4))
            block.attn.wk.weight.copy_(rows_ours_to_hf(block.attn.wk.weight, 2))
    assert (our_logits(ours, tokens) - hf_logits(hf, tokens)).abs().max() > 1e-3


def test_row_permutation_and_rotation():
    w = torch.arange(2 * 8).reshape(2 * 8, 1).float()  # two heads of width 8
    assert rows_hf_to_ours(w, 2)[:8, 0].tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
    assert torch.equal(rows_ours_to_hf(rows_hf_to_ours(w, 2), 2), w)
    # rotate-half of the HF layout equals our pairwise rotation, reordered
    cfg = ModelConfig(dim=8, n_heads=1, position="rope", max_seq_len=4)
    x = torch.randn(1, 4, 1, 8)
    angles = torch.outer(torch.arange(4.0), rope_frequencies(cfg))
    cos, sin = angles.cos(), angles.sin()
    hf_cos, hf_sin = torch.cat([cos, cos], -1)[None, :, None], torch.cat([sin, sin], -1)[None, :, None]
    hf_rot = x * hf_cos + torch.cat([-x[..., 4:], x[..., :4]], -1) * hf_sin
    ours = apply_rope(rows_hf_to_ours(x[0, :, 0].t(), 1).t()[None, :, None], cos, sin)
    assert torch.allclose(rows_ours_to_hf(ours[0, :, 0].t(), 1).t(), hf_rot[0, :, 0], atol=1e-6)


def test_sharded_checkpoints_load_and_export_sharded(tmp_path, tokens):
    hf = make_hf("qwen3-head-dim-qk-norm", tmp_path / "hf", save_kw={"max_shard_size": "40KB"})
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    ours = ours_from(tmp_path / "hf")
    assert (our_logits(ours, tokens) - hf_logits(hf, tokens)).abs().max() <= TOL
    save_hf(ours, tmp_path / "out", max_shard_bytes=40_000)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    assert (hf_logits(back, tokens) - our_logits(ours, tokens)).abs().max() <= TOL
    # and our own reader takes our own folder back
    again = ours_from(tmp_path / "out")
    assert torch.equal(our_logits(again, tokens), our_logits(ours, tokens))


def one_line(excinfo) -> str:
    assert len(excinfo.value.lines) == 1, excinfo.value.lines
    return excinfo.value.lines[0]


@pytest.mark.parametrize("change,field", [
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}, "rope_scaling"),
    ({"attention_bias": True}, "attention_bias"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
])
def test_fields_that_change_the_math_are_refused(tmp_path, change, field):
    make_hf("llama-rope-scaling", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ConfigError) as e:
        load_config(None, {"model.from_hf": str(tmp_path), "data.seq_len": 16})
    line = one_line(e)
    assert line.startswith("model.from_hf: ") and f"{field}=" in line and str(tmp_path) in line


def test_the_command_line_exits_2_with_one_line(tmp_path):
    make_hf("qwen2-qkv-bias", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "use_mrope": True}))
    r = run_here("train", "--print-config", f"--model.from_hf={tmp_path}")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [f"scaletrain: error: model.from_hf: {tmp_path / 'config.json'}: "
                                             "use_mrope=true is multimodal rotary positions; scaletrain has text "
                                             "positions only"]


def test_new_parameters_start_from_their_names(tmp_path):
    """q/k norms start at one, q/k/v biases at zero, like the other norms and biases; the
    default model's parameters keep their names."""
    from scaletrain.parallel.init import init_weights

    make_hf("qwen3-head-dim-qk-norm", tmp_path)
    cfg = ModelConfig(**{**model_config_from_hf(tmp_path), "qkv_bias": True})
    model = Transformer(cfg)
    init_weights(model, seed=0)
    attn = model.layers["1"].attn
    assert torch.equal(attn.q_norm.weight, torch.ones(24)) and torch.equal(attn.k_norm.weight, torch.ones(24))
    assert torch.equal(attn.wk.bias, torch.zeros(2 * 24)) and attn.wo.bias is None
    assert attn.wq.weight.shape == (4 * 24, 64) and attn.wq.weight.std() > 0.01
    assert [n for n, _ in Transformer(ModelConfig()).named_parameters()][:6] == [
        "tok_emb.weight", "pos_emb.weight", "layers.0.attn_norm.weight", "layers.0.attn.wq.weight",
        "layers.0.attn.wk.weight", "layers.0.attn.wv.weight"]


def test_qwen2s_window_is_read_where_transformers_slides_every_layer():
    """Qwen2's window counts only with use_sliding_window, on the layers transformers' own config marks
    sliding (its layer_types, from max_window_layers): every layer gives model.sliding_window, none gives 0
    whatever sliding_window says, and a mix is refused naming the key."""
    def read(**kw):
        config = transformers.Qwen2Config(**TINY, **kw)
        return config.layer_types, model_config_from_hf(config.to_dict())

    types, cfg = read(use_sliding_window=True, sliding_window=16, max_window_layers=0)
    assert types == ["sliding_attention"] * 2 and cfg["sliding_window"] == 16
    for off in (dict(use_sliding_window=False, sliding_window=16, max_window_layers=0),
                dict(use_sliding_window=True, sliding_window=None, max_window_layers=0),
                dict(use_sliding_window=True, sliding_window=16, max_window_layers=2)):
        types, cfg = read(**off)
        assert "sliding_attention" not in types and cfg["sliding_window"] == 0, off
    old = transformers.Qwen2Config(**TINY, use_sliding_window=True, sliding_window=16, max_window_layers=0).to_dict()
    del old["layer_types"]  # a config.json from before layer_types: max_window_layers says it
    assert model_config_from_hf(old)["sliding_window"] == 16
    with pytest.raises(ConfigError, match=r"layer_types=.* slides 1 of the 2 layers; scaletrain slides every layer"):
        read(use_sliding_window=True, sliding_window=16, max_window_layers=1)
    with pytest.raises(ConfigError, match=r"max_window_layers=1 slides 1 of the 2 layers"):
        model_config_from_hf({**old, "max_window_layers": 1})


def test_other_families_and_bad_files_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="model_type='gemma' is not one scaletrain imports"):
        model_config_from_hf({"model_type": "gemma", "hidden_size": 64})
    with pytest.raises(ConfigError, match="activation_function='gelu' is not supported"):
        model_config_from_hf({"model_type": "gpt2", "vocab_size": 8, "n_embd": 8, "n_layer": 1, "n_head": 1,
                              "activation_function": "gelu"})
    with pytest.raises(ConfigError, match="not found; give a Hugging Face model folder"):
        load_config(None, {"model.from_hf": str(tmp_path / "nowhere")})
    with pytest.raises(ConfigError, match="model.preset and model.from_hf both"):
        load_config(None, {"model.from_hf": str(tmp_path), "model.preset": "tiny"})


def test_from_hf_fills_the_shape_and_explicit_keys_win(tmp_path):
    make_hf("mistral-gqa", tmp_path)
    cfg = load_config(None, {"model.from_hf": str(tmp_path), "model.n_layers": 1, "data.seq_len": 32}).model
    assert (cfg.n_layers, cfg.dim, cfg.kv_heads, cfg.norm, cfg.position) == (1, 64, 2, "rmsnorm", "rope")
    # training sequences longer than the window: attended within it (tests/model/test_window.py)
    assert load_config(None, {"model.from_hf": str(tmp_path), "data.seq_len": 48}).model.sliding_window == 32
    # a saved config gives every key, and loads without the folder
    saved = load_config(None, {"model.from_hf": str(tmp_path / "gone"), **{
        f"model.{k}": v for k, v in cfg.__dict__.items() if k not in ("from_hf",)}, "data.seq_len": 32}).model
    assert saved == ModelConfig(**{**cfg.__dict__, "from_hf": str(tmp_path / "gone")})


def test_weights_that_do_not_fit_the_config_are_refused(tmp_path):
    make_hf("qwen2-qkv-bias", tmp_path / "hf")
    cfg = ModelConfig(**model_config_from_hf(tmp_path / "hf"))
    with pytest.raises(CheckpointError, match="has shape"):
        load_hf_weights(tmp_path / "hf", ModelConfig(**{**cfg.__dict__, "vocab_size": 64}))
    with pytest.raises(ConfigError, match="model.qkv_bias=false differs from .*config.json .true."):
        load_hf_weights(tmp_path / "hf", ModelConfig(**{**cfg.__dict__, "qkv_bias": False}))
    with pytest.raises(ConfigError, match="model.rope_theta=500.0 differs"):
        load_hf_weights(tmp_path / "hf", ModelConfig(**{**cfg.__dict__, "rope_theta": 500.0}))
    # a file alone carries no config: the tensors themselves must fit
    (tmp_path / "hf" / "model.safetensors").rename(tmp_path / "bare.safetensors")
    with pytest.raises(CheckpointError, match="self_attn.k_proj.bias has no place in the model"):
        load_hf_weights(tmp_path / "bare.safetensors", ModelConfig(**{**cfg.__dict__, "qkv_bias": False}))
    names = dict(Transformer(cfg).named_parameters()).keys()
    assert load_hf_weights(tmp_path / "bare.safetensors", cfg).keys() == names
    with pytest.raises(CheckpointError, match="no model.safetensors nor model.safetensors.index.json"):
        load_hf_weights(tmp_path / "hf", cfg)


def test_export_refuses_what_transformers_cannot_compute():
    with pytest.raises(ConfigError, match="no Hugging Face family: position=rope, norm=layernorm"):
        hf_config_from_model(ModelConfig(position="rope"))
    with pytest.raises(ConfigError, match="GPT-2 has neither grouped-query"):
        hf_config_from_model(ModelConfig(n_kv_heads=2))


def test_byte_tokenizer_exports_as_bytes(tmp_path):
    from tokenizers import Tokenizer, pre_tokenizers

    tok = Tokenizer.from_str(byte_tokenizer_json())
    text = "héllo wörld\n\t€ 1+1"
    assert tok.encode(text).ids == list(text.encode("utf-8"))
    assert tok.decode(list(text.encode("utf-8"))) == text
    assert set(tok.get_vocab()) == set(pre_tokenizers.ByteLevel.alphabet())


def test_train_export_transformers_round_trip(tmp_path, tokens):
    """HF shape -> scaletrain trains -> export --format hf -> transformers (model and tokenizer)
    computes the logits of the checkpoint, with no scaletrain code."""
    from scaletrain.train.trainer import Trainer
    from scaletrain.trained.export import load_model_from_checkpoint

    make_hf("qwen3-head-dim-qk-norm", tmp_path / "hf")
    cfg = micro_cfg(tmp_path, **{"model.from_hf": str(tmp_path / "hf"), "model.vocab_size": 256,
                                 "data.seq_len": 16, "model.max_seq_len": 64, "train.steps": 3,
                                 "checkpoint.save_final": True})
    Trainer(cfg).fit()
    ckpt = next((tmp_path / "run" / "checkpoints").glob("step_*"))
    out = export_hf(ckpt, tmp_path / "export")
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json"} <= {p.name for p in out.iterdir()}
    ours = load_model_from_checkpoint(ckpt).eval()
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert (hf_logits(back, tokens) - our_logits(ours, tokens)).abs().max() <= TOL
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok("The ü")["input_ids"] == list("The ü".encode())
    with pytest.raises(CheckpointError, match="already exists"):
        export_hf(ckpt, out)
    # scaletrain's own safetensors export reads back too (our names, its config in the metadata)
    from scaletrain.trained.export import export_safetensors

    mine = export_safetensors(ckpt, tmp_path / "mine.safetensors")
    weights = load_hf_weights(mine, ours.cfg)
    assert all(torch.equal(weights[n], p) for n, p in ours.named_parameters())
    with pytest.raises(ConfigError, match="model.qk_norm=false differs from .*mine.safetensors .true."):
        load_hf_weights(mine, ModelConfig(**{**ours.cfg.__dict__, "qk_norm": False}))
    (tmp_path / "bad.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="bad.safetensors: cannot be read as safetensors"):
        load_hf_weights(tmp_path / "bad.safetensors", ours.cfg)


def test_tensor_parallel_shards_the_new_parameters(tmp_path):
    """q/k norms (replicated, their gradients summed over the heads of the ranks), q/k/v biases
    and a head_dim apart from dim / n_heads train under tp 2 (and with sequence parallelism)
    as in one process: the same losses and the same final weights."""
    from scaletrain.train.trainer import Trainer
    from scaletrain.trained.export import load_model_from_checkpoint

    # SGD: each update follows its gradient (AdamW's first updates nearly follow its sign only,
    # which would hide a gradient summed over half the heads)
    qwen = {"train.steps": 3, "model.norm": "rmsnorm", "model.activation": "swiglu", "model.position": "rope",
            "model.n_kv_heads": 2, "model.head_dim": 24, "model.qk_norm": True, "model.qkv_bias": True,
            "model.tie_embeddings": False, "train.micro_batch": 4, "optim.name": "sgd", "optim.lr": 1.0,
            "checkpoint.save_final": True}
    ref = Trainer(micro_cfg(tmp_path / "one", **qwen)).fit()["history"]
    names = ("tp2", "tp2-sp")
    jobs = [{"overrides": micro_overrides(tmp_path / n, **qwen, **extra)}
            for n, extra in zip(names, ({"parallel.tp": 2}, {"parallel.tp": 2, "parallel.sp": True}))]
    code, results, err = run_group(2, jobs, tmp_path)
    assert code == 0, err
    final = lambda run: dict(load_model_from_checkpoint(  # noqa: E731
        tmp_path / run / "checkpoints" / "step_00000003").named_parameters())
    one = final("one/run")
    for name, result in zip(names, results, strict=True):  # every step's loss and gradient norm
        assert_same_run(result["history"], ref, steps=3, tol=(1e-5, 1e-4), what=name)
        tp = final(name)
        worst = {n: (tp[n] - one[n]).abs().max().item() for n in one}
        assert max(worst.values()) < 1e-6, (name, sorted(worst.items(), key=lambda kv: -kv[1])[:3])


# --------------------------------------------------------------------------------------------
# The special ids of an export


def test_a_gpt2_export_states_the_datas_special_ids(finished_run, tmp_path):
    """Byte-level data has no end-of-text token: the config says none (not GPT-2's 50256, an id
    outside the 256-token vocabulary), and transformers reads it so."""
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "hf"
    step = finished_run / "checkpoints" / "step_00000004"
    assert run_here("export", str(step), "--format", "hf", "--out", str(out)).returncode == 0
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "gpt2" and config["vocab_size"] == 256
    assert config["bos_token_id"] is None and config["eos_token_id"] is None
    loaded = transformers.AutoConfig.from_pretrained(out)
    assert loaded.bos_token_id is None and loaded.eos_token_id is None
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] is None
