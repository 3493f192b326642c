"""config.json -> ModelConfig -> config.json, judged by transformers' own config classes: every
tiny config of the family tests (and each off-default case of test_fields_off_defaults.py) is read
by our import, written back by our export, and the export given to transformers' class of that
model_type. Each key of transformers' view of the export must be its view of the original, or
one of the few keys below that say the same thing another way (each with its reason). The
logits tests show an export computes alike for the keys those tiny models exercise; this one
sees every key the exporter writes, including those a tiny model never reads (a wrong
max_window_layers, a wrong mlp_only_layers on a model where both are dense), with transformers'
defaults and derived fields (moe_layers, layer_types) as the reference."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

transformers = pytest.importorskip("transformers")

import test_deepseek  # noqa: E402
import test_fields_off_defaults  # noqa: E402
import test_gpt_oss  # noqa: E402
import test_hf  # noqa: E402
import test_hf_families  # noqa: E402
import test_hf_moe  # noqa: E402
import test_llama4  # noqa: E402
import test_qwen3_next  # noqa: E402
from scaletrain.model.config import ModelConfig  # noqa: E402
from scaletrain.model.hf_config import hf_config_from_model, model_config_from_hf  # noqa: E402


def _tiny_models() -> dict[str, tuple[Any, tuple, dict]]:
    """Each tiny model of the family tests: (its test module, the leading arguments of its hf_config and
    make_hf, the config changes), by name."""
    out = {}
    for module in (test_hf, test_hf_families, test_hf_moe):
        out.update({name: (module, (name,), {}) for name in module.FAMILIES})
    for module in (test_deepseek, test_llama4, test_qwen3_next):
        out.update({f"{module.__name__[5:]}:{name}": (module, (name,), {}) for name in module.SHAPES})
    out.update({f"gpt_oss:{name}": (test_gpt_oss, (), change) for name, change in test_gpt_oss.SHAPES.items()})
    return out


TINY_MODELS = _tiny_models()


def _configs() -> dict[str, Callable[[], Any]]:
    out: dict[str, Callable[[], Any]] = {name: (lambda m=module, a=args, c=change: m.hf_config(*a, **c))
                                         for name, (module, args, change) in TINY_MODELS.items()}
    out.update({f"off:{name}": (lambda c=case: c.build.config(**c.shape, **c.change))
                for name, case in test_fields_off_defaults.CASES.items()})
    out.update({f"off:{name}-epsilons": (lambda n=name, c=change: test_hf_families.hf_config(n, **c))
                for name, (change, _) in test_hf_families.OFF_DEFAULT.items()})
    return out


CONFIGS = _configs()


def _sparse_layers(d: dict) -> list[int]:
    """Which blocks hold experts, as transformers' Qwen3-MoE and Qwen3-Next decide it."""
    if not d.get("num_experts", d.get("num_local_experts")):  # (Qwen3-Next's name; Qwen3-MoE's in transformers 5)
        return []
    return [i for i in range(d["num_hidden_layers"])
            if i not in (d.get("mlp_only_layers") or []) and (i + 1) % d["decoder_sparse_step"] == 0]


def _rope(d: dict) -> dict:
    """rope_parameters with the keys transformers fills in when left out, and numbers as floats."""
    params = dict(d.get("rope_parameters") or {})
    if params.get("rope_type") == "yarn":
        params.setdefault("truncate", True)
    return {k: float(v) if isinstance(v, int) and not isinstance(v, bool) else v for k, v in params.items()}


def _slides(d: dict) -> bool:
    return "sliding_attention" in (d.get("layer_types") or [])


# keys whose values may differ and still say the same (original, export -> the same?), with why
SAME_BY: dict[str, tuple[str, Callable[[dict, dict], bool]]] = {
    "dtype": ("the weights' file says it; no field of the model", lambda a, b: True),
    "architectures": ("the export names its class; a config made in memory has none", lambda a, b: True),
    "bos_token_id": ("the tokenizer's, stated from the data (test_hf's special ids test)", lambda a, b: True),
    "eos_token_id": ("as bos_token_id", lambda a, b: True),
    "pad_token_id": ("as bos_token_id", lambda a, b: True),
    **{k: ("dropout is a training choice (model.dropout, left to the user)", lambda a, b: True)
       for k in ("attn_pdrop", "resid_pdrop", "embd_pdrop", "attention_dropout")},
    "num_nextn_predict_layers": ("multi-token prediction is asked for, never implied (model.mtp_depth)",
                                 lambda a, b: b["num_nextn_predict_layers"] == 0),
    "head_dim": ("left out (or null) it is hidden_size / num_attention_heads",
                 lambda a, b: (a.get("head_dim") or a["hidden_size"] // a["num_attention_heads"]) == b["head_dim"]),
    "n_inner": ("GPT-2's null is 4 x n_embd", lambda a, b: (a["n_inner"] or 4 * a["n_embd"]) == b["n_inner"]),
    "max_window_layers": ("read only with use_sliding_window",
                          lambda a, b: not a.get("use_sliding_window") and not b.get("use_sliding_window")),
    "sliding_window": ("layer_types name no sliding block (gpt-oss's all full)",
                       lambda a, b: a.get("layer_types") is not None and not _slides(a) and not _slides(b)),
    "mlp_only_layers": ("the same blocks hold experts", lambda a, b: _sparse_layers(a) == _sparse_layers(b)),
    "decoder_sparse_step": ("as mlp_only_layers", lambda a, b: _sparse_layers(a) == _sparse_layers(b)),
    "moe_intermediate_size": ("no block holds experts", lambda a, b: _sparse_layers(a) == _sparse_layers(b) == []),
    "shared_expert_intermediate_size": ("as moe_intermediate_size",
                                        lambda a, b: _sparse_layers(a) == _sparse_layers(b) == []),
    "norm_topk_prob": ("as moe_intermediate_size", lambda a, b: _sparse_layers(a) == _sparse_layers(b) == []),
    "interleave_moe_layer_step": ("Llama 4 reads moe_layers, which the export states and which agrees",
                                  lambda a, b: a["moe_layers"] == b["moe_layers"]),
    "original_max_position_embeddings": ("Phi-3 reads it for longrope only, which scaletrain refuses",
                                         lambda a, b: (a.get("rope_parameters") or {}).get("rope_type") != "longrope"),
    "sliding_window_pattern": ("Gemma 3 reads layer_types, which agree", lambda a, b: a["layer_types"] ==
                               b["layer_types"]),
    "_sliding_window_pattern": ("as sliding_window_pattern", lambda a, b: a["layer_types"] == b["layer_types"]),
    "use_bidirectional_attention": ("null is false (causal)", lambda a, b: not a.get(
        "use_bidirectional_attention") and b["use_bidirectional_attention"] is False),
    "rope_parameters": ("YaRN's truncate left out is true; an integer is its float",
                        lambda a, b: _rope(a) == _rope(b)),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_an_imported_config_exports_to_what_transformers_reads_as_the_original(name):
    original = CONFIGS[name]()
    theirs = original.to_dict()
    exported = hf_config_from_model(ModelConfig(**model_config_from_hf(theirs)))
    assert exported["model_type"] == original.model_type
    kw = {k: v for k, v in exported.items() if k != "model_type"}
    back = transformers.AutoConfig.for_model(original.model_type, **kw).to_dict()
    differ = {k: (theirs.get(k, "<absent>"), back.get(k, "<absent>")) for k in set(theirs) | set(back)
              if theirs.get(k, "<absent>") != back.get(k, "<absent>")}
    assert {k: v for k, v in differ.items() if k not in SAME_BY or not SAME_BY[k][1](theirs, back)} == {}


def test_the_keys_said_the_same_are_told_apart_when_they_differ():
    """The looser keys above still see a change that matters."""
    qwen = test_hf_moe.hf_config("qwen3-moe-step").to_dict()
    assert not SAME_BY["decoder_sparse_step"][1](qwen, {**qwen, "decoder_sparse_step": 1})
    assert SAME_BY["mlp_only_layers"][1](qwen, {**qwen, "decoder_sparse_step": 1, "mlp_only_layers": [0, 2]})
    assert not SAME_BY["head_dim"][1]({"hidden_size": 64, "num_attention_heads": 4}, {"head_dim": 24})
    assert not SAME_BY["max_window_layers"][1]({"use_sliding_window": True}, {"use_sliding_window": True})
    assert not SAME_BY["sliding_window"][1]({"sliding_window": 32}, {"sliding_window": None})  # no layer_types
    assert not SAME_BY["rope_parameters"][1]({"rope_parameters": {"rope_type": "yarn", "factor": 4}},
                                             {"rope_parameters": {"rope_type": "yarn", "factor": 4,
                                                                  "truncate": False}})


# the dropout keys of a causal LM (the classifier's and summary's are of heads scaletrain does not export)
DROPOUT = ("attention_dropout", "attn_pdrop", "resid_pdrop", "embd_pdrop", "hidden_dropout")


@pytest.mark.parametrize("name", [name for name in CONFIGS if not name.startswith("off:")])
def test_the_models_dropout_is_exported_to_each_place_the_family_has_one(name):
    """model.dropout is on the embeddings, the attention weights and the residual branches (as GPT-2's
    three keys); an export fine-tuned by transformers drops out as the model trained. (0.25: no family's
    default, as GPT-2's 0.1 is.)"""
    original = CONFIGS[name]()
    exported = hf_config_from_model(ModelConfig(**{**model_config_from_hf(original.to_dict()), "dropout": 0.25}))
    back = transformers.AutoConfig.for_model(original.model_type, **{k: v for k, v in exported.items()
                                                                     if k != "model_type"}).to_dict()
    assert {k: back[k] for k in DROPOUT if k in back} == {k: 0.25 for k in DROPOUT if k in back} != {}


@pytest.mark.parametrize("name", [name for name in CONFIGS if not name.startswith(("off:", "gpt2"))] +
                         ["off:llama-yarn"])
def test_the_older_rotary_keys_say_what_rope_parameters_says(name):
    """transformers 4 reads a Llama-like's base and scaling from rope_theta and rope_scaling, GPT-NeoX's
    from rotary_emb_base and rotary_pct (transformers 5 reads rope_parameters, and lets the older keys
    win where both are): the export writes both, alike. Gemma 3's two bases exist in rope_parameters only."""
    original = CONFIGS[name]()
    exported = hf_config_from_model(ModelConfig(**model_config_from_hf(original.to_dict())))
    rope = exported["rope_parameters"]
    if exported["model_type"] == "gemma3_text":
        assert "rope_theta" not in exported and exported["rope_scaling"] is None and set(rope) == {
            "full_attention", "sliding_attention"}
        return
    if exported["model_type"] == "gpt_neox":
        assert (exported["rotary_emb_base"], exported["rotary_pct"]) == (rope["rope_theta"],
                                                                         rope["partial_rotary_factor"])
        return
    assert exported["rope_theta"] == rope["rope_theta"]
    scaled = {k: v for k, v in rope.items() if k != "rope_theta"} if rope["rope_type"] != "default" else None
    assert exported["rope_scaling"] == scaled
    assert scaled or name not in ("llama-rope-scaling", "deepseek:query-latent-yarn", "off:llama-yarn")


def test_gemma3_without_a_base_of_its_own_exports_its_sliding_blocks_as_the_global_ones():
    """A Gemma 3 with no rotary base of its own for the sliding blocks (model.rope_local_theta=0) turns
    every block alike: both sets of rotary parameters are the model's, scaling included."""
    cfg = ModelConfig(**{**model_config_from_hf(CONFIGS["gemma3"]().to_dict()), "rope_local_theta": 0.0})
    rope = hf_config_from_model(cfg)["rope_parameters"]
    assert rope["full_attention"] == rope["sliding_attention"] == {"rope_type": "linear", "rope_theta": 1000000.0,
                                                                   "factor": 8.0}


def test_qwen3_next_from_scratch_exports_its_value_heads_and_width_resolved():
    """model.linear_value_heads and linear_value_dim 0 mean the key heads' count and width; the export
    states the numbers (transformers has no such 0)."""
    read = model_config_from_hf(CONFIGS["qwen3_next:moe-grouped-values"]().to_dict())
    exported = hf_config_from_model(ModelConfig(**{**read, "linear_value_heads": 0, "linear_value_dim": 0}))
    assert (exported["linear_num_value_heads"], exported["linear_value_head_dim"]) == (
        read["linear_heads"], read["linear_head_dim"]) == (2, 8)
