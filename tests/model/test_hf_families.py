"""Hugging Face families beyond GPT-2 and the Llama-likes: OLMo 2 (norms after the sub-blocks,
q/k norms over the whole projections), GPT-NeoX / Pythia (parallel residual, partial rotary, q/k/v
fused per head), Phi-3 / Phi-4 (fused qkv and gate/up, partial rotary) and Gemma 2 / 3 ((1 + w)
norms before and after, GeGLU, scaled embeddings, soft-caps, per-kind rotary bases). For each, a
tiny model made by transformers (from_config; nothing downloaded): the import computes its
logits, the export gives its state dict back exactly, greedy generation with our KV cache picks
its tokens, and the planner counts the model scaletrain builds. The multi-rank cases of every
family run in one 2-rank launch."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from scaletrain.config import ModelConfig, load_config  # noqa: E402
from scaletrain.errors import ConfigError  # noqa: E402
from scaletrain.model.hf_config import model_config_from_hf  # noqa: E402
from scaletrain.model.transformer import Transformer, count_params  # noqa: E402
from scaletrain.trained.export_hf import save_hf  # noqa: E402

from conftest import assert_same_run, assert_same_weights, fit_reference, micro_overrides, model_from_hf, run_group  # noqa: E402

TOL = 1e-5
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=64, rms_norm_eps=1e-6)
PHI_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)  # (its defaults lie outside a tiny vocabulary)
FAMILIES = {
    "olmo2": ("Olmo2Config", dict(TINY, num_key_value_heads=2)),
    # Pythia: parallel residual, a quarter of each head rotated (its default), exact GELU
    "neox-parallel": ("GPTNeoXConfig", dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                           num_attention_heads=4, max_position_embeddings=64)),
    "neox-sequential": ("GPTNeoXConfig", dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                             num_attention_heads=4, max_position_embeddings=64, rotary_pct=0.5,
                                             use_parallel_residual=False, hidden_act="gelu_new",
                                             tie_word_embeddings=True)),
    "phi3": ("Phi3Config", dict(TINY, **PHI_IDS, num_key_value_heads=2, sliding_window=48)),
    # Phi-4-mini: three quarters of each head rotated, a tied head
    "phi4-partial": ("Phi3Config", dict(TINY, **PHI_IDS, tie_word_embeddings=True,
                                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                         "partial_rotary_factor": 0.75})),
    # Gemma 2: caps low enough to bite on a tiny random model, a query scale apart from head_dim
    "gemma2": ("Gemma2Config", dict(TINY, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24,
                                    sliding_window=48, attn_logit_softcapping=1.0, final_logit_softcapping=2.0)),
    # Gemma 3: q/k norms, head_dim apart, global blocks every 2nd with their own (linearly scaled) rotary base
    "gemma3": ("Gemma3TextConfig", dict(TINY, num_hidden_layers=4, num_key_value_heads=2, head_dim=24,
                                        sliding_window=48, sliding_window_pattern=2,
                                        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                            "rope_theta": 1000000.0},
                                                         "sliding_attention": {"rope_type": "default",
                                                                               "rope_theta": 10000.0}})),
}


def hf_config(name: str, **change):
    """The transformers config make_hf builds its model from."""
    cls, kw = FAMILIES[name]
    return getattr(transformers, cls)(**{**kw, **change})


def make_hf(name: str, folder, **change):
    """A seeded tiny transformers model, its norms and biases moved off their init (a wrong
    mapping of them must show), saved to `folder`."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(name, **change), attn_implementation="eager",
                                                          dtype=torch.float32)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("bias") or "norm" in n:
                p.add_(0.2 * torch.randn_like(p))
    model.eval().save_pretrained(folder)
    return model


def ours_from(folder, seq_len: int = 16) -> Transformer:
    return model_from_hf(folder, seq_len)


@pytest.fixture
def tokens():
    return torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("name", FAMILIES)
def test_import_export_and_generation_match_transformers(name, tmp_path, tokens):
    """Logits within 1e-5 (fp32); greedy generation with our KV cache picks transformers' tokens;
    after our weights change, transformers computes our logits from the export. (The export of the
    untouched import is the file transformers wrote, byte for byte: families/test_weights_round_trip.py.)"""
    from scaletrain.model.generate import generate
    from scaletrain.model.kv_cache import KVCache

    hf = make_hf(name, tmp_path / "hf")
    ours = ours_from(tmp_path / "hf", seq_len=32)
    with torch.no_grad():
        ref, mine = hf(tokens).logits, ours(tokens)
    assert ref.abs().max() > 0.1  # not a comparison of near-zeros
    assert (mine - ref).abs().max() <= TOL

    prompt = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(2))
    greedy = hf.generate(prompt, max_new_tokens=10, do_sample=False, pad_token_id=0)
    mine = generate(lambda x, cache: ours(x, cache), prompt, 10, window=32, temperature=1.0, top_k=1,
                    cache=KVCache(32))
    assert mine.tolist() == greedy.tolist()

    with torch.no_grad():  # as training would
        for p in ours.parameters():
            p.add_(0.01 * torch.randn_like(p))
    save_hf(ours, tmp_path / "out")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    assert again.config.model_type == hf.config.model_type
    with torch.no_grad():
        assert (again(tokens).logits - ours(tokens)).abs().max() <= TOL


# fields away from their defaults (and from the FAMILIES' values), each far enough to move the logits
# and not so far as to hide another (an epsilon of 1e-2 flattened OLMo 2's q/k norms, and its rotary base
# no longer showed): the HF config's change, and the values our reader must give. Each field read as its
# default, the logits alone fail (checked by hand, the config assertion taken out)
OFF_DEFAULT = {
    "olmo2": ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}, "rms_norm_eps": 1e-3},
              {"rope_theta": 1e6, "norm_eps": 1e-3}),
    "neox-sequential": ({"rope_parameters": {"rope_type": "default", "rope_theta": 100.0, "partial_rotary_factor": 0.5},
                         "layer_norm_eps": 1e-3}, {"rope_theta": 100.0, "norm_eps": 1e-3, "rotary_fraction": 0.5}),
    "gemma2": ({"rope_parameters": {"rope_type": "default", "rope_theta": 500.0}, "rms_norm_eps": 1e-3,
                "attn_logit_softcapping": 3.0, "final_logit_softcapping": 7.0, "query_pre_attn_scalar": 40},
               {"rope_theta": 500.0, "norm_eps": 1e-3, "attn_softcap": 3.0, "logit_softcap": 7.0,
                "attn_scale_dim": 40}),
}


@pytest.mark.parametrize("name", OFF_DEFAULT)
def test_fields_off_their_defaults_are_read_and_give_transformers_logits(name, tmp_path, tokens):
    """Rotary bases, norm epsilons, soft caps and the query scale set away from their defaults: the
    config reader gives each value, and the model gives the logits transformers computes with them,
    which differ from those of the same weights at the family's values (each field bites)."""
    change, ours_expected = OFF_DEFAULT[name]
    hf = make_hf(name, tmp_path / "hf", **change)
    usual = make_hf(name, tmp_path / "usual")  # the same seed: the same weights, FAMILIES' values
    assert all(torch.equal(a, b) for a, b in zip(hf.state_dict().values(), usual.state_dict().values()))
    ours = ours_from(tmp_path / "hf")
    assert {k: getattr(ours.cfg, k) for k in ours_expected} == ours_expected
    with torch.no_grad():
        ref, before, mine = hf(tokens).logits, usual(tokens).logits, ours(tokens)
    assert (ref - before).abs().max() > 1e-2  # the fields change the logits
    assert (mine - ref).abs().max() <= TOL


@pytest.mark.parametrize("name", FAMILIES)
def test_the_planner_counts_the_imported_shape(name, tmp_path):
    """Parameters as the model holds them, and FLOPs from the same matmul count."""
    from scaletrain.layout import Layout
    from scaletrain.model.flops import matmul_params
    from scaletrain.plan.params import rank_params

    make_hf(name, tmp_path)
    cfg = ModelConfig(**model_config_from_hf(tmp_path))
    assert rank_params(cfg, Layout(), 0).total == count_params(cfg)
    model = Transformer(cfg)
    linear = sum(m.weight.numel() for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "output")
    assert matmul_params(cfg) == linear + cfg.dim * cfg.vocab_size


# --------------------------------------------------------------------------------------------
# Under ZeRO-3, tensor and pipeline parallelism: every family's cases in one 2-rank launch

# the families' layouts (OLMo 2 under tp: its q/k norms' sum of squares over the tp ranks)
LAYOUTS = {
    "olmo2": {"zero3": {"parallel.zero": 3}, "tp2": {"parallel.tp": 2},
              "tp2-sp": {"parallel.tp": 2, "parallel.sp": True}, "pp2": {"parallel.pp": 2}},
    "neox-parallel": {"zero3": {"parallel.zero": 3}, "tp2-sp": {"parallel.tp": 2, "parallel.sp": True},
                      "pp2": {"parallel.pp": 2}},
    "phi4-partial": {"zero3": {"parallel.zero": 3}, "tp2": {"parallel.tp": 2}, "pp2": {"parallel.pp": 2}},
    "gemma2": {"zero3": {"parallel.zero": 3}, "tp2": {"parallel.tp": 2}, "pp2": {"parallel.pp": 2}},
    "gemma3": {"zero3": {"parallel.zero": 3}, "tp2-sp": {"parallel.tp": 2, "parallel.sp": True},
               "pp2": {"parallel.pp": 2}},
}
# trained from scratch with the new options alone (no import): Gemma- and NeoX-shaped micro models
SCRATCH = {
    "gemma-shaped": {"model.norm": "rmsnorm", "model.norm_unit_offset": True, "model.norm_placement": "both",
                     "model.activation": "geglu", "model.embed_scale": True, "model.position": "rope",
                     "model.attn_softcap": 5.0, "model.logit_softcap": 10.0, "model.attn_scale_dim": 24,
                     "model.sliding_window": 32, "model.global_every": 2, "model.rope_local_theta": 1000.0,
                     "model.qk_norm": True, "model.n_kv_heads": 2},
    "neox-shaped": {"model.position": "rope", "model.bias": True, "model.parallel_residual": True,
                    "model.rotary_fraction": 0.5, "model.activation": "gelu_exact", "model.tie_embeddings": False},
}
# SGD without clipping: each update is the gradient itself, so a gradient that misses a rank's share
# shows in the final weights (AdamW would take nearly the same step from a halved gradient)
SCRATCH_LAYOUTS = {"tp2-sp": {"parallel.tp": 2, "parallel.sp": True}}
SGD = {"optim.name": "sgd", "optim.lr": 0.1, "train.grad_clip": 0.0}


@pytest.mark.multiproc
def test_imported_families_train_alike_under_zero3_tp_and_pp(tmp_path):
    """Each family's imported weights (and the new options trained from scratch) give the same
    losses and gradient norms, step by step, and the same final weights under ZeRO-3, tp 2 (with
    sequence parallelism where a family has norms after the sub-blocks or a parallel residual)
    and pp 2 as in one process."""

    runs = {}
    for name in LAYOUTS:
        make_hf(name, tmp_path / name / "hf", vocab_size=256, max_position_embeddings=64)  # the built-in bytes
        hf = str(tmp_path / name / "hf")
        runs[name] = ({"model.from_hf": hf, "model.init_from": hf, "data.seq_len": 32, "model.max_seq_len": 64,
                       "train.steps": 2, "train.global_batch": 4, "train.micro_batch": 2}, LAYOUTS[name])
    for name, options in SCRATCH.items():
        runs[name] = ({**MICRO_MODEL, **options, **SGD, "train.steps": 2, "train.global_batch": 4,
                       "train.micro_batch": 2}, SCRATCH_LAYOUTS)

    def overrides(run_dir, options):
        values = micro_overrides(run_dir, **options)
        if "model.from_hf" in options:  # the shape is the checkpoint's
            values = {k: v for k, v in values.items() if not k.startswith(("model.dim", "model.n_"))}
        return values

    refs = {name: fit_reference(load_config(None, overrides(tmp_path / name / "one", options)))
            for name, (options, _) in runs.items()}
    cases = [(name, layout, extra) for name, (_, layouts) in runs.items() for layout, extra in layouts.items()]
    jobs = [{"overrides": overrides(tmp_path / name / layout, {**runs[name][0], **extra})}
            for name, layout, extra in cases]
    code, results, err = run_group(2, jobs, tmp_path)
    assert code == 0, err
    for (name, layout, _), result in zip(cases, results, strict=True):
        assert_same_run(result["history"], refs[name]["history"], steps=2, what=f"{name} {layout}")
        assert_same_weights(result["weights"], refs[name]["weights"], tol=1e-3, what=f"{name} {layout}")


MICRO_MODEL = {"model.dim": 64, "model.n_layers": 2, "model.n_heads": 4, "model.max_seq_len": 32}


# --------------------------------------------------------------------------------------------
# What a family has and scaletrain does not compute: one line naming it


def one_line(excinfo) -> str:
    assert len(excinfo.value.lines) == 1, excinfo.value.lines
    return excinfo.value.lines[0]


@pytest.mark.parametrize("name,change,words", [
    ("phi3", {"rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8,
                                  "long_factor": [2.0] * 8, "original_max_position_embeddings": 32}},
     "rope_type 'longrope'; scaletrain implements default, linear, llama3 and yarn"),
    ("phi3", {"rope_scaling": {"type": "su", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}},
     "rope_type 'su'; scaletrain implements default, linear, llama3 and yarn"),
    ("phi3", {"rope_scaling": {"type": "yarn", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}},
     "rope_type 'yarn', Phi-3's older name of longrope, which scaletrain lacks"),
    # transformers 5's key, which names it rope_type (the refusal names the key the file used)
    ("phi3", {"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 10000.0}},
     'rope_parameters={"rope_type": "yarn", "factor": 2.0, "rope_theta": 10000.0} has rope_type \'yarn\', Phi-3\'s '
     "older name of longrope"),
    ("neox-parallel", {"attention_bias": False}, "attention_bias=false leaves attention without biases"),
    ("neox-parallel", {"hidden_act": "relu"}, "hidden_act='relu' is not supported"),
    ("olmo2", {"attention_bias": True}, "attention_bias=true puts a bias on the output projection too"),
    ("olmo2", {"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5 rotates part of each head"),
    ("gemma2", {"layer_types": ["full_attention", "sliding_attention"]}, "layer_types=[\"full_attention\""),
    ("gemma3", {"use_bidirectional_attention": True}, "use_bidirectional_attention=true lets every token attend"),
    ("gemma3", {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                    "sliding_attention": {"rope_type": "linear", "factor": 2.0}}},
     "scales the sliding-window blocks' rotary"),
])
def test_family_options_we_do_not_compute_are_refused(tmp_path, name, change, words):
    make_hf(name, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ConfigError) as e:
        load_config(None, {"model.from_hf": str(tmp_path), "data.seq_len": 16})
    line = one_line(e)
    assert line.startswith(f"model.from_hf: {tmp_path / 'config.json'}: ") and words in line, line


def test_phi3_longrope_exits_2_with_one_line(tmp_path):
    from conftest import run_here

    make_hf("phi3", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "rope_parameters": {
        "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}}))
    r = run_here("train", "--print-config", f"--model.from_hf={tmp_path}")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith(f"scaletrain: error: model.from_hf: {tmp_path / 'config.json'}: rope_parameters={{")
    assert line.endswith(" has rope_type 'longrope'; scaletrain implements default, linear, llama3 and yarn")


def test_the_new_options_are_checked_and_refused_where_a_method_cannot_honour_them(tmp_path):
    from scaletrain.layout import Layout

    def errors(**kw):
        with pytest.raises(ConfigError) as e:
            load_config(None, {f"model.{k}": v for k, v in kw.items()})
        return "\n".join(e.value.lines)

    assert "model.rotary_fraction=0.5 says how much of each head rotates; it needs model.position=rope" in errors(
        rotary_fraction=0.5)
    assert "rotates 1 of the 64 coordinates" in errors(position="rope", rotary_fraction=0.02)
    assert "model.norm_unit_offset=true scales RMSNorm by (1 + weight); it needs model.norm=rmsnorm" in errors(
        norm_unit_offset=True)
    assert "model.parallel_residual=true feeds attention and MLP the one normalised input" in errors(
        parallel_residual=True, norm_placement="post")
    assert "model.global_every=2 makes the other blocks sliding-window ones, but model.sliding_window=0" in errors(
        global_every=2)
    assert "model.rope_local_theta=1000 is the rotary base of the sliding-window blocks" in errors(
        position="rope", rope_local_theta=1000.0)
    assert "model.activation=geglu: the experts of a mixture compute gelu, swiglu or swiglu_clamped" in errors(
        activation="geglu", moe_experts=4)
    capped = ModelConfig(attn_softcap=50.0, attn_scale_dim=24)
    (cp,) = Layout(cp=2).errors(capped, seq_len=32)
    assert cp == ("model.attn_softcap=50 and model.attn_scale_dim=24 change the attention scores, which context "
                  "parallelism's attention (parallel.cp > 1) computes unchanged; train this model with parallel.cp=1")
    from scaletrain.plan import plan

    with pytest.raises(ConfigError, match="--attention flash: model.attn_softcap=50 caps the attention scores"):
        plan(capped, hardware="H100-SXM", nodes=1, gpus_per_node=8, seq_len=32, global_batch=8)


def test_export_names_the_family_or_why_none(tmp_path):
    from scaletrain.model.hf_config import hf_family

    gemma = dict(position="rope", norm="rmsnorm", norm_unit_offset=True, norm_placement="both", activation="geglu",
                 embed_scale=True)
    assert hf_family(ModelConfig(**gemma)) == "gemma2"
    assert hf_family(ModelConfig(**gemma, qk_norm=True)) == "gemma3_text"
    assert hf_family(ModelConfig(position="rope", bias=True, parallel_residual=True)) == "gpt_neox"
    assert hf_family(ModelConfig(position="rope", norm="rmsnorm", activation="swiglu", rotary_fraction=0.5)) == "phi3"
    olmo2 = dict(position="rope", norm="rmsnorm", activation="swiglu", norm_placement="post", qk_norm=True,
                 qk_norm_scope="projection")
    assert hf_family(ModelConfig(**olmo2)) == "olmo2"
    with pytest.raises(ConfigError, match="norms after the sub-blocks .* are OLMo 2's"):
        hf_family(ModelConfig(**{**olmo2, "qk_norm": False, "qk_norm_scope": "head"}))
    with pytest.raises(ConfigError, match="rope with layernorm is GPT-NeoX's, which needs activation gelu or "
                                          "gelu_exact, not swiglu"):
        hf_family(ModelConfig(position="rope", bias=True, activation="swiglu"))
    with pytest.raises(ConfigError, match="model.attn_softcap is Gemma's"):
        hf_family(ModelConfig(attn_softcap=5.0))
    with pytest.raises(ConfigError, match="model.export_as=phi3, but Phi-3 has no biases"):
        hf_family(ModelConfig(position="rope", norm="rmsnorm", activation="swiglu", bias=True, export_as="phi3"))
