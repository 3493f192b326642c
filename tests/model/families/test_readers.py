"""The config.json readers' rules by hand, one family's keys at a time: what each key left out means,
what each refused value is refused with (the key named), and the edge values (a window of 1, a
yarn parameter of 0, a bool where an integer goes). The readers' results against transformers' own
models are tests/model/families/test_fields_off_defaults.py's and test_hf*.py's."""

from __future__ import annotations

import pytest

from scaletrain.errors import ConfigError
from scaletrain.model.config import ModelConfig
from scaletrain.model.families import FAMILIES, Reader
from scaletrain.model.families._common import YARN_KEYS, _yarn_fields, every_layer_window, short
from scaletrain.model.hf_config import model_config_from_hf
from test_config_round_trip import CONFIGS


class Refusals(list):
    def __call__(self, key: str, why: str) -> None:
        self.append((key, why))


def test_yarns_keys_left_out_take_transformers_defaults_and_the_models_length():
    refuse = Refusals()
    out = _yarn_fields({}, refuse, "rope_parameters", 4096)
    assert refuse == [] and out == {"rope_original_max_seq_len": 4096, "rope_truncate": True,
                                    **{ours: default for ours, default in YARN_KEYS.values()}}
    # 0 is a number (not refused) and, as transformers reads it (`get("beta_fast") or 32`), the default
    out = _yarn_fields({"beta_fast": 0, "mscale": 0.5, "original_max_position_embeddings": 2048, "truncate": False},
                       refuse, "rope_parameters", 4096)
    assert refuse == [] and (out["rope_beta_fast"], out["rope_mscale"]) == (32.0, 0.5)
    assert (out["rope_original_max_seq_len"], out["rope_truncate"]) == (2048, False)


@pytest.mark.parametrize("params,why", [
    ({"truncate": "no"}, "needs true or false for truncate in rope_type yarn"),
    ({"beta_fast": -1.0}, "needs a non-negative number beta_fast for rope_type yarn"),
    ({"beta_slow": True}, "needs a non-negative number beta_slow for rope_type yarn"),
    ({"mscale": "1"}, "needs a non-negative number mscale for rope_type yarn"),
])
def test_a_bad_yarn_value_is_refused_under_its_key(params, why):
    refuse = Refusals()
    _yarn_fields(params, refuse, "rope_scaling", 4096)
    assert refuse == [("rope_scaling", why)]


@pytest.mark.parametrize("window,expected", [(None, 0), (0, 0), (-4, 0), (True, 0), ("64", 0), (1, 1), (4096, 4096)])
def test_a_window_is_a_positive_integer_or_none(window, expected):
    assert every_layer_window(Reader({"sliding_window": window}, {}, "config.json")) == expected


@pytest.mark.parametrize("config,expected", [
    ({"sliding_window": 64, "use_sliding_window": False}, 0),  # a window that is not used
    ({"sliding_window": 64, "use_sliding_window": True}, 64),  # no layer_types, no max_window_layers: every layer
    ({"sliding_window": 64, "use_sliding_window": True, "max_window_layers": "all"}, 64),  # not an integer: from 0
    ({"sliding_window": 64, "use_sliding_window": True, "max_window_layers": 4}, 0),  # from layer 4 of 4: none
    ({"sliding_window": 64, "use_sliding_window": True, "layer_types": ["sliding_attention"] * 4}, 64),
])
def test_qwen2s_window_needs_use_sliding_window_and_every_layer(config, expected):
    refuse = Refusals()
    assert FAMILIES["qwen2"].window(Reader(config, {}, "config.json"), 4, refuse) == expected
    assert refuse == []


def test_qwen2s_window_on_some_layers_is_refused_under_the_key_that_says_so():
    refuse = Refusals()
    FAMILIES["qwen2"].window(Reader({"sliding_window": 64, "use_sliding_window": True, "max_window_layers": 1},
                                      {}, "config.json"), 4, refuse)
    assert refuse == [("max_window_layers", "slides 3 of the 4 layers; scaletrain slides every layer or none (train "
                                            "it with use_sliding_window=false, or its window on every layer)")]

# --- every refusal of every family's reader, as the user reads it -------------------------------------
# (a tiny config of the family tests, the keys changed) -> the line the import refuses it with, after
# "config.json: ". Each line was read when it was written: the key the file used, its value, and why.
GLOBAL = {"rope_type": "default", "rope_theta": 1000000.0}
NO_THETA = {"rope_scaling": None, "rope_parameters": {"rope_type": "default"}}  # (the base left to the other keys)
REFUSED = [
    ("llama-rope-scaling", {"hidden_act": "gelu"},
     "hidden_act='gelu' is not supported; scaletrain's gated MLP uses silu (SwiGLU)"),
    ("llama-rope-scaling", {"attention_bias": True},
     "attention_bias=true puts a bias on the output projection too, without mlp_bias; scaletrain has biases on "
     "q/k/v only (qkv_bias) or on every linear layer (bias)"),
    ("llama-rope-scaling", {"mlp_bias": True},
     "mlp_bias=true puts biases on the MLP alone; scaletrain has them on every linear layer or none"),
    ("qwen3-head-dim-qk-norm", {"attention_bias": True},
     "attention_bias=true puts a bias on the output projection too; scaletrain's qwen3 has none there"),
    ("olmo2", {"head_dim": 24},
     "head_dim=24 differs from hidden_size / num_attention_heads, which olmo2's q/k norms assume"),
    ("qwen2-qkv-bias", {"use_mrope": True},
     "use_mrope=true is multimodal rotary positions; scaletrain has text positions only"),
    ("llama-rope-scaling", {"rope_scaling": "linear", "rope_parameters": None},
     "rope_scaling='linear' is not a JSON object of rotary parameters"),
    ("llama-rope-scaling", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
     'rope_scaling={"rope_type": "dynamic", "factor": 2.0} has rope_type \'dynamic\'; scaletrain implements '
     "default, linear, llama3 and yarn"),
    ("llama-rope-scaling", {"rope_scaling": {"rope_type": "linear", "factor": 2.0, "zeta": 1, "alpha": 2}},
     'rope_scaling={"rope_type": "linear", "factor": 2.0, "zeta": 1, "alpha"... has alpha, zeta, unknown to '
     "rope_type linear; scaletrain may not compute it alike"),
    ("llama-rope-scaling", {"rope_scaling": {"rope_type": "linear"}},
     'rope_scaling={"rope_type": "linear"} needs a number factor for rope_type linear'),
    ("llama-rope-scaling",
     {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": True, "high_freq_factor": 4.0}},
     'rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor":... needs a number low_freq_factor '
     "for rope_type llama3"),
    ("llama-rope-scaling",
     {"rope_scaling": None,
      "rope_parameters": {"rope_type": "default", "rope_theta": 100.0, "partial_rotary_factor": 0.5}},
     'rope_parameters={"rope_type": "default", "rope_theta": 100.0, "partial_ro... has '
     "partial_rotary_factor=0.5, which rotates part of each head; scaletrain's import of this family rotates "
     "all of it"),
    ("phi3", {"rope_parameters": {"rope_type": "default", "rope_theta": 100.0, "partial_rotary_factor": 0}},
     'rope_parameters={"rope_type": "default", "rope_theta": 100.0, "partial_ro... has partial_rotary_factor=0, '
     "which should be a number in (0, 1], the share of each head that turns"),
    ("phi3", {"rope_parameters": {"rope_type": "default", "rope_theta": 100.0, "partial_rotary_factor": 1.5}},
     'rope_parameters={"rope_type": "default", "rope_theta": 100.0, "partial_ro... has '
     "partial_rotary_factor=1.5, which should be a number in (0, 1], the share of each head that turns"),
    ("phi3", {"rope_parameters": {"rope_type": "default", "rope_theta": 100.0, "partial_rotary_factor": True}},
     'rope_parameters={"rope_type": "default", "rope_theta": 100.0, "partial_ro... has '
     "partial_rotary_factor=true, which should be a number in (0, 1], the share of each head that turns"),
    ("gemma2", {"hidden_activation": "relu"},
     "hidden_activation='relu' is not supported; scaletrain's GeGLU gates by gelu_new or gelu_pytorch_tanh"),
    ("gemma2", {"hidden_activation": None, "hidden_act": "relu"},
     "hidden_act='relu' is not supported; scaletrain's GeGLU gates by gelu_new or gelu_pytorch_tanh"),
    ("gemma2", {"attention_bias": True},
     "attention_bias=true puts biases on the attention projections; scaletrain's Gemma has none"),
    ("gemma2", {"use_bidirectional_attention": True},
     "use_bidirectional_attention=true lets every token attend to later ones; scaletrain's attention is causal"),
    ("gemma2", {"query_pre_attn_scalar": 0},
     "query_pre_attn_scalar=0 should be a positive integer (the scores are divided by its square root)"),
    ("gemma2", {"query_pre_attn_scalar": 24.0},
     "query_pre_attn_scalar=24.0 should be a positive integer (the scores are divided by its square root)"),
    ("gemma2", {"query_pre_attn_scalar": True},
     "query_pre_attn_scalar=true should be a positive integer (the scores are divided by its square root)"),
    ("gemma2", {"attn_logit_softcapping": 0},
     "attn_logit_softcapping=0 should be a positive number or null"),
    ("gemma2", {"final_logit_softcapping": True},
     "final_logit_softcapping=true should be a positive number or null"),
    ("gemma2", {"final_logit_softcapping": "30"},
     "final_logit_softcapping='30' should be a positive number or null"),
    ("gemma2",
     {"num_hidden_layers": 4,
      "layer_types": ["sliding_attention", "full_attention", "full_attention", "sliding_attention"]},
     'layer_types=["sliding_attention", "full_attention", "full_attention",... has its global blocks where '
     'model.global_every (every n-th block global) cannot put them: ["sliding_attention", "full_attention", '
     '"full_attention",...'),
    ("gemma3",
     {"rope_parameters": {"full_attention": GLOBAL,
                          "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}},
     'rope_parameters={"full_attention": {"rope_type": "default", "rope_theta":... scales the sliding-window '
     'blocks\' rotary ({"rope_type": "linear", "factor": 2.0, "rope_theta": 1000...); scaletrain scales the '
     "global blocks' only"),
    ("gemma3",
     {"rope_parameters": {"full_attention": GLOBAL,
                          "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0, "factor": 1.0}}},
     'rope_parameters={"full_attention": {"rope_type": "default", "rope_theta":... scales the sliding-window '
     'blocks\' rotary ({"rope_type": "default", "rope_theta": 10000.0, "factor":...); scaletrain scales the '
     "global blocks' only"),
    ("gpt2-tied", {"activation_function": "gelu"},
     "activation_function='gelu' is not supported; scaletrain's GELU is the tanh one (gelu_new, "
     "gelu_pytorch_tanh)"),
    ("gpt2-tied", {"scale_attn_weights": False},
     "scale_attn_weights=false leaves the scores unscaled; scaletrain divides them by sqrt(head_dim)"),
    ("gpt2-tied", {"scale_attn_by_inverse_layer_idx": True},
     "scale_attn_by_inverse_layer_idx=true scales each layer's scores differently; scaletrain does not"),
    ("gpt2-tied", {"add_cross_attention": True},
     "add_cross_attention=true adds cross-attention; scaletrain imports decoder-only language models"),
    ("neox-parallel", {"hidden_act": "relu"},
     "hidden_act='relu' is not supported; scaletrain's GPT-NeoX MLP computes gelu or gelu_new, "
     "gelu_pytorch_tanh"),
    ("neox-parallel", {"attention_bias": False},
     "attention_bias=false leaves attention without biases while GPT-NeoX's MLP keeps its own; scaletrain has "
     "biases on every linear layer or none"),
    ("gpt_oss:alternating", {"layer_types": ["sliding_attention", "full_attention"]},
     'layer_types=["sliding_attention", "full_attention"] should list sliding_attention or full_attention for '
     'each of the 3 layers, got ["sliding_attention", "full_attention"]'),
    ("gpt_oss:alternating", {"layer_types": ["sliding_attention", "chunked_attention", "full_attention"]},
     'layer_types=["sliding_attention", "chunked_attention", "full_attention"] should list sliding_attention or '
     'full_attention for each of the 3 layers, got ["sliding_attention", "chunked_attention", "full_attention"]'),
    ("gpt_oss:alternating", {"layer_types": ["full_attention", "sliding_attention", "sliding_attention"]},
     'layer_types=["full_attention", "sliding_attention", "sliding_attention"] has its full-attention layers '
     'where model.global_every (every n-th block full) cannot put them: ["full_attention", "sliding_attention", '
     '"sliding_attention"]'),
    ("deepseek:plain-query-groups", {"num_key_value_heads": 2},
     "num_key_value_heads=2 differs from num_attention_heads=4; latent attention brings up keys and values for "
     "every head"),
    ("deepseek:plain-query-groups", {"rope_interleave": False},
     "rope_interleave=false pairs the rotated coordinates by halves; scaletrain imports DeepSeek's interleaved "
     "pairs (rope_interleave=true) only"),
    ("deepseek:plain-query-groups", {"pretraining_tp": 2},
     "pretraining_tp=2 splits the projections' matmuls as transformers does not; set it to 1"),
    ("deepseek:plain-query-groups", {"attention_bias": True},
     "attention_bias=true puts biases on q_a_proj, kv_a_proj_with_mqa and o_proj; scaletrain's latent attention "
     "has none"),
    ("deepseek:plain-query-groups", {"n_group": 4, "topk_group": 2},
     "n_group=4 must cut n_routed_experts=6 into groups of at least 2 experts"),
    ("deepseek:plain-query-groups", {"n_group": 6, "topk_group": 2},
     "n_group=6 must cut n_routed_experts=6 into groups of at least 2 experts"),
    ("llama4:every-block-tied", {"floor_scale": 0},
     "floor_scale=0 should be a positive number of positions"),
    ("llama4:interleaved", {"no_rope_layers": [1, 0, 0, 1]},
     "no_rope_layers=[1, 0, 0, 1] leaves blocks [1, 2] without rotary positions; scaletrain's are every n-th "
     "block (model.nope_every)"),
    ("llama4:interleaved", {"layer_types": ["full_attention", "full_attention", "full_attention", "full_attention"]},
     'layer_types=["full_attention", "full_attention", "full_attention", "f... differs from the blocks '
     'attention_chunk_size and the no-rope blocks make (["chunked_attention", "full_attention", '
     '"chunked_attentio...); scaletrain chunks the rotary blocks only'),
    ("llama4:interleaved", {"router_jitter_noise": 0.1},
     "router_jitter_noise=0.1 scales the router's input by random noise in training; scaletrain's router has no "
     "jitter: set it to 0"),
    ("llama4:interleaved", {"moe_layers": [0, 1, 3]},
     "moe_layers=[0, 1, 3] makes blocks [0, 1, 3] mixtures of experts, which model.moe_first_dense and "
     "moe_every (every n-th block after the first dense ones) cannot express"),
    ("mixtral", {"router_jitter_noise": 0.1},
     "router_jitter_noise=0.1 scales the router's input by random noise in training; scaletrain's router has no "
     "jitter: set it to 0"),
    ("olmoe", {"clip_qkv": 8.0},
     "clip_qkv=8.0 clamps the queries, keys and values; scaletrain does not"),
    ("qwen3-moe-dense-first", {"mlp_only_layers": [2]},
     "mlp_only_layers=[2] with decoder_sparse_step=1 makes blocks [0, 1] mixtures of experts, which "
     "model.moe_first_dense and moe_every (every n-th block after the first dense ones) cannot express"),
    ("qwen3_next:moe-grouped-values", {"linear_num_value_heads": 3},
     "linear_num_value_heads=3 must be a multiple of linear_num_key_heads=2"),
    ("qwen3_next:dense", {"layer_types": ["linear_attention", "sliding_attention", "full_attention"]},
     'layer_types=["linear_attention", "sliding_attention", "full_attention"] should list linear_attention or '
     'full_attention for each of the 3 layers, got ["linear_attention", "sliding_attention", "full_attention"]'),
    ("qwen3_next:dense", {"layer_types": ["full_attention", "linear_attention", "linear_attention"]},
     'layer_types=["full_attention", "linear_attention", "linear_attention"] puts its full-attention layers '
     'where model.full_every (every n-th block full) cannot: ["full_attention", "linear_attention", '
     '"linear_attention"]'),
    # the rotary base and share wherever the file put them, and the scaling's numbers
    ("llama-rope-scaling", {"rope_scaling": None, "rope_parameters": {"rope_type": "default", "rope_theta": "fast"}},
     "rope_parameters={\"rope_type\": \"default\", \"rope_theta\": \"fast\"} has rope_theta='fast', which should be "
     "a positive number, the rotary base"),
    ("llama-rope-scaling", {**NO_THETA, "rope_theta": -1},
     "rope_theta=-1 should be a positive number, the rotary base"),
    ("neox-parallel", {**NO_THETA, "rope_theta": None, "rotary_emb_base": "x"},
     "rotary_emb_base='x' should be a positive number, the rotary base"),
    ("gemma2", {"partial_rotary_factor": 0.5},
     "partial_rotary_factor=0.5 rotates part of each head; scaletrain's import of this family rotates all of it"),
    ("gemma3", {"rope_parameters": {"full_attention": {**GLOBAL, "partial_rotary_factor": 0.5}}},
     "rope_parameters={\"full_attention\": {\"rope_type\": \"default\", \"rope_theta\":... has "
     "partial_rotary_factor=0.5, which rotates part of each head; scaletrain's import of this family rotates all "
     "of it"),
    ("llama-rope-scaling", {"rope_scaling": {"rope_type": "linear", "factor": "2"}},
     "rope_scaling={\"rope_type\": \"linear\", \"factor\": \"2\"} needs a number factor for rope_type linear"),
    ("llama-rope-scaling", {"rope_scaling": {"rope_type": "yarn", "factor": 2.0, "beta_fast": -1}},
     "rope_scaling={\"rope_type\": \"yarn\", \"factor\": 2.0, \"beta_fast\": -1} needs a non-negative number "
     "beta_fast for rope_type yarn"),
    ("gemma3", {"rope_parameters": {"full_attention": GLOBAL,
                                    "sliding_attention": {"rope_type": "default", "rope_theta": "x"}}},
     "rope_parameters={\"full_attention\": {\"rope_type\": \"default\", \"rope_theta\":... has sliding_attention's "
     "rope_theta='x', which should be a positive number, the sliding-window blocks' rotary base"),
    ("gemma3", {"rope_parameters": None, "rope_local_base_freq": 0},
     "rope_local_base_freq=0 should be a positive number, the sliding-window blocks' rotary base"),
    ("deepseek:plain-query-groups", {"n_routed_experts": 5, "n_group": 2, "topk_group": 1},
     "n_group=2 must cut n_routed_experts=5 into groups of at least 2 experts"),
    ("qwen3_next:dense", {"layer_types": ["linear_attention", "full_attention"]},
     "layer_types=[\"linear_attention\", \"full_attention\"] should list linear_attention or full_attention for "
     "each of the 3 layers, got [\"linear_attention\", \"full_attention\"]"),
    ("gemma3", {"rope_parameters": None, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
     "rope_scaling={\"rope_type\": \"dynamic\", \"factor\": 2.0} has rope_type 'dynamic'; scaletrain implements "
     "default, linear, llama3 and yarn"),
    # the count of experts under two names that disagree
    ("olmoe", {"num_experts": 4, "num_local_experts": 6},
     "num_local_experts=6 differs from num_experts=4; they name the same count of experts"),
    ("deepseek:plain-query-groups", {"n_routed_experts": 6, "num_local_experts": 4},
     "num_local_experts=4 differs from n_routed_experts=6; they name the same count of experts"),
    ("neox-parallel", {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
                       "partial_rotary_factor": None, "rotary_pct": 2},  # GPT-NeoX's older key, refused by its name
     "rotary_pct=2 should be a number in (0, 1], the share of each head that turns"),
    ("llama-rope-scaling", {**NO_THETA, "rope_theta": 0}, "rope_theta=0 should be a positive number, the rotary base"),
    ("llama-rope-scaling", {"is_encoder_decoder": True},
     "is_encoder_decoder=true is not a decoder-only language model, which is what scaletrain imports"),
    ("llama-rope-scaling", {"pruned_heads": {"0": [1]}},
     'pruned_heads={"0": [1]} removes heads from some layers; scaletrain\'s layers all have n_heads'),
]


@pytest.mark.parametrize("base,change,line", REFUSED)
def test_each_refusal_names_the_key_the_file_used_its_value_and_why(base, change, line):
    with pytest.raises(ConfigError) as e:
        model_config_from_hf({**CONFIGS[base]().to_dict(), **change})
    assert str(e.value) == f"config.json: {line}"


# the edge values each refusal leaves alone, and what they read as
ACCEPTED = [
    ("llama-rope-scaling", {"hidden_act": "swish"}, {"activation": "swiglu"}),  # silu's other name
    ("llama-rope-scaling", {"rope_scaling": {"type": "linear", "factor": 2.0}},  # the older name of rope_type
     {"rope_scaling": "linear", "rope_factor": 2.0}),
    ("llama-rope-scaling", {"attention_bias": True, "mlp_bias": True}, {"bias": True, "qkv_bias": False}),
    ("llama-rope-scaling", {"rope_scaling": None, "rope_parameters": {"rope_type": "default", "rope_theta": 5.0,
                                                                      "partial_rotary_factor": 1}},
     {"rope_theta": 5.0, "rotary_fraction": 1.0}),
    ("llama-rope-scaling", {"partial_rotary_factor": 1.0}, {"rotary_fraction": 1.0}),
    ("llama-rope-scaling", {**NO_THETA, "rope_theta": 1}, {"rope_theta": 1.0}),  # the least integer base: a float
    ("llama-rope-scaling", {"num_key_value_heads": None}, {"n_kv_heads": 0}),  # left out: one a query head
    ("mistral-gqa", {"sliding_window": 64}, {"sliding_window": 0}),  # as long as the model's length: no window
    ("mistral-gqa", {"sliding_window": 63}, {"sliding_window": 63}),
    ("neox-parallel", {"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "partial_rotary_factor": 0.25}},
     {"rope_scaling": "yarn", "rope_original_max_seq_len": 64, "rotary_fraction": 0.25}),
    ("deepseek:plain-query-groups", {"n_routed_experts": 1, "num_experts_per_tok": 1, "n_group": 1, "topk_group": 1},
     {"moe_experts": 1, "moe_groups": 0}),  # one group of one expert: no groups, nothing to refuse
    ("llama-rope-scaling", {**NO_THETA, "rope_theta": None}, {"rope_theta": 10000.0}),  # none anywhere
    # transformers' original length when the scaling leaves it out: the model's
    ("llama-rope-scaling", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                             "high_freq_factor": 4.0}},
     {"rope_scaling": "llama3", "rope_original_max_seq_len": 64}),
    ("llama-rope-scaling", {"rope_scaling": {"rope_type": "yarn", "factor": 2.0}},
     {"rope_scaling": "yarn", "rope_original_max_seq_len": 64}),
    ("phi3", {"rope_parameters": {"rope_type": "default", "rope_theta": 100.0, "partial_rotary_factor": 1}},
     {"rotary_fraction": 1.0, "rope_theta": 100.0}),
    ("neox-parallel", {"rope_parameters": {"rope_type": "default"}, "rope_theta": None, "rotary_emb_base": 500,
                       "partial_rotary_factor": None, "rotary_pct": 0.5},  # GPT-NeoX's older names
     {"rope_theta": 500.0, "rotary_fraction": 0.5}),
    ("gemma2", {"hidden_activation": None, "hidden_act": "gelu_pytorch_tanh"}, {"activation": "geglu"}),
    ("gemma2", {"query_pre_attn_scalar": 1}, {"attn_scale_dim": 1}),
    ("gemma2", {"query_pre_attn_scalar": 16}, {"attn_scale_dim": 0}),  # = head_dim: the usual scale
    ("gemma2", {"attn_logit_softcapping": None, "final_logit_softcapping": 0.5},
     {"attn_softcap": 0.0, "logit_softcap": 0.5}),
    ("llama4:every-block-tied", {"floor_scale": 1}, {"attn_temperature_floor": 1}),
    ("qwen3-moe-step", {"use_sliding_window": False, "sliding_window": 6}, {"sliding_window": 0}),  # not used
    ("gemma2", {"num_key_value_heads": 4}, {"n_kv_heads": 0}),  # one K/V head a query head: the usual 0
    ("gemma2", {"tie_word_embeddings": False}, {"tie_embeddings": False}),
    ("gemma3", {"num_hidden_layers": 1, "layer_types": ["sliding_attention"]},  # one block, sliding
     {"rope_theta": 10000.0, "global_every": 0}),
    ("gemma3", {"rope_parameters": None, "rope_local_base_freq": 1}, {"rope_local_theta": 1.0}),  # the least base
    ("gemma3", {"rope_parameters": None, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}},  # the old keys
     {"rope_scaling": "yarn", "rope_original_max_seq_len": 64}),
    ("gemma2", {"rope_parameters": {"rope_type": "yarn", "factor": 2.0}},
     {"rope_scaling": "yarn", "rope_original_max_seq_len": 64}),
    ("gemma3", {"rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 2.0}}},
     {"rope_scaling": "yarn", "rope_original_max_seq_len": 64, "rope_theta": 1000000.0}),
    ("deepseek:plain-query-groups", {"n_group": 3, "topk_group": None}, {"moe_groups": 3, "moe_topk_groups": 1}),
    # Llama 4's query temperature: on the no-rope blocks, when tuned (attn_temperature_tuning) and scaled
    ("llama4:interleaved", {}, {"attn_temperature": 0.5, "attn_temperature_floor": 3, "nope_every": 2}),
    ("llama4:interleaved", {"attn_temperature_tuning": False}, {"attn_temperature": 0.0}),
    ("llama4:interleaved", {"no_rope_layers": [1, 1, 1, 1], "layer_types": None}, {"attn_temperature": 0.0,
                                                                                    "nope_every": 0}),
    ("llama4:interleaved", {"no_rope_layers": None, "layer_types": None, "no_rope_layer_interval": -1},
     {"nope_every": 0}),
    # a mixture's reader on a dense config: no mixture field (ModelConfig refuses them without experts)
    ("mixtral", {"num_local_experts": 0, "num_experts_per_tok": 3}, {"moe_experts": 0, "moe_top_k": 2}),
    ("qwen3_next:moe-grouped-values", {"linear_num_key_heads": 1, "linear_num_value_heads": 2},
     {"linear_heads": 1, "linear_value_heads": 2}),
    ("qwen3-moe-step", {"use_sliding_window": True, "sliding_window": 6}, {"sliding_window": 6}),
    ("deepseek:plain-query-groups", {"n_group": 3, "topk_group": 1}, {"moe_groups": 3, "moe_topk_groups": 1}),
    ("deepseek:plain-query-groups", {"n_group": 1}, {"moe_groups": 0, "moe_topk_groups": 0}),
    ("qwen3_next:moe-grouped-values", {"linear_num_value_heads": 6, "linear_num_key_heads": 3},
     {"linear_value_heads": 6, "linear_heads": 3}),
]


@pytest.mark.parametrize("base,change,fields", ACCEPTED)
def test_the_edge_values_are_accepted_and_read(base, change, fields):
    out = model_config_from_hf({**CONFIGS[base]().to_dict(), **change})
    assert {k: out[k] for k in fields} == fields
    assert {k: type(out[k]) for k in fields} == {k: type(v) for k, v in fields.items()}  # 3.0, never 3


def gemma3(**change) -> dict:
    """The Gemma 3 test config (4 blocks, a global one every 2nd) as a dict, `change`d; a key changed
    to None is left out."""
    out = {**CONFIGS["gemma3"]().to_dict(), **change}
    return {k: v for k, v in out.items() if v is not None}


ROTARY = ("rope_theta", "rope_scaling", "rope_factor", "rope_local_theta", "global_every")


@pytest.mark.parametrize("config,expected", [
    # transformers 4's keys, as Google's published Gemma 3 config.json files have them
    (gemma3(rope_parameters=None, rope_theta=1000000.0, rope_local_base_freq=20000.0,
            rope_scaling={"rope_type": "linear", "factor": 8.0}), (1000000.0, "linear", 8.0, 20000.0, 2)),
    # ... without rope_local_base_freq: the family's 10,000; without rope_theta: its 1,000,000
    (gemma3(rope_parameters=None, rope_local_base_freq=None), (1000000.0, "none", 1.0, 10000.0, 2)),
    # transformers 5's: one set per kind of block; a set without rope_theta takes the family's base
    (gemma3(rope_parameters={"full_attention": {"rope_type": "default"},
                             "sliding_attention": {"rope_type": "default"}}), (1000000.0, "none", 1.0, 10000.0, 2)),
    (gemma3(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 7.0}}),  # no sliding set
     (7.0, "none", 1.0, 10000.0, 2)),
    (gemma3(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 7.0},
                             "sliding_attention": {"type": "default", "rope_theta": 3.0}}),  # its older "type"
     (7.0, "none", 1.0, 3.0, 2)),
    # every block slides: the sliding blocks' base is the model's only one, and the global scaling goes
    (gemma3(layer_types=["sliding_attention"] * 4), (10000.0, "none", 1.0, 0.0, 0)),
])
def test_gemma3s_two_rotary_bases_in_either_transformers_keys(config, expected):
    out = model_config_from_hf(config)
    assert tuple(out[k] for k in ROTARY) == expected


@pytest.mark.parametrize("local", [{"type": "linear", "factor": 2.0}, {"rope_type": "default", "factor": 1.0}, 5,
                                   "default", {"rope_type": "linear"}, {"type": "linear"}])
def test_gemma3s_sliding_blocks_rotary_is_refused_unless_a_plain_base(local):
    with pytest.raises(ConfigError) as e:
        model_config_from_hf(gemma3(rope_parameters={"full_attention": GLOBAL, "sliding_attention": local}))
    assert str(e.value).startswith("config.json: rope_parameters={")
    assert str(e.value).endswith(f"scales the sliding-window blocks' rotary ({short(local)}); scaletrain scales "
                                 "the global blocks' only")


S, F = "sliding_attention", "full_attention"


@pytest.mark.parametrize("config,n_layers,expected", [
    # configs without layer_types: every block slides but each sliding_window_pattern-th
    ({"sliding_window_pattern": 3, "sliding_window": 16}, 7, ([S, S, F, S, S, F, S], 16, 3)),
    ({"sliding_window": 16}, 3, ([S, F, S], 16, 2)),  # Gemma 2's pattern when left out: 2
    ({"sliding_window_pattern": 1, "sliding_window": 16}, 3, ([F, F, F], 0, 0)),  # every block global
    ({"sliding_window_pattern": 8, "sliding_window": 16}, 4, ([S, S, S, S], 16, 0)),  # longer than the model
    *[({"sliding_window_pattern": bad, "sliding_window": 16}, 2, ([F, F], 0, 0)) for bad in (0, -2, True, "2")],
    *[({"sliding_window_pattern": 2, "sliding_window": bad}, 2, ([S, F], 0, 0)) for bad in (0, -1, True, "16")],
    ({"sliding_window_pattern": 2, "sliding_window": 1}, 2, ([S, F], 1, 2)),  # the smallest window
    ({"layer_types": [S, S, F], "sliding_window": 16}, 3, ([S, S, F], 16, 3)),  # layer_types win over the pattern
    ({"layer_types": [S, S], "sliding_window": 16, "sliding_window_pattern": 2}, 2, ([S, S], 16, 0)),
])
def test_gemmas_sliding_blocks_from_layer_types_or_the_older_pattern(config, n_layers, expected):
    from scaletrain.model.families.gemma2 import _layer_kinds

    refuse = Refusals()
    assert _layer_kinds(Reader(config, FAMILIES["gemma2"].defaults, "config.json"), refuse, n_layers) == expected
    assert refuse == []


@pytest.mark.parametrize("config,expected", [
    ({"sliding_window": 16}, {"sliding_window": 16, "global_every": 2}),  # transformers' default layer_types
    ({"sliding_window": 16, "layer_types": [S, S, F]}, {"sliding_window": 16, "global_every": 3}),
    ({"sliding_window": 16, "layer_types": [S, S, S]}, {"sliding_window": 16, "global_every": 0}),
    ({"sliding_window": 16, "layer_types": [F, F, F]}, {"sliding_window": 0, "global_every": 0}),
    ({"sliding_window": 63}, {"sliding_window": 63, "global_every": 2}),  # one short of the model's length
    ({"sliding_window": 1}, {"sliding_window": 1, "global_every": 2}),  # the least window
    *[({"sliding_window": bad}, {"sliding_window": 0, "global_every": 0}) for bad in (64, 65, 0, -1, True, "16")],
])
def test_gpt_oss_sliding_layers_from_layer_types(config, expected):
    refuse = Refusals()
    assert FAMILIES["gpt_oss"]._layer_kinds(Reader(config, {}, "config.json"), refuse, 3, 64) == expected
    assert refuse == []


# Llama 4's derived keys left out, as an older config.json has them (the reader derives them as transformers)
DERIVED = {"moe_layers": None, "no_rope_layers": None, "layer_types": None}
BLOCKS = ("n_layers", "moe_experts", "moe_first_dense", "moe_every", "moe_shared_experts", "moe_groups",
          "moe_topk_groups", "nope_every")


# which blocks hold experts (and have no rotary), as transformers decides it, worked by hand: Qwen3-MoE's
# block i when (i + 1) % decoder_sparse_step == 0 and i is not in mlp_only_layers; Llama 4's moe_layers, or
# every interleave_moe_layer_step-th block; DeepSeek-V3's after first_k_dense_replace
@pytest.mark.parametrize("base,change,expected", [
    ("qwen3-moe-step", {"num_hidden_layers": 6, "decoder_sparse_step": 2, "mlp_only_layers": []},
     (6, 4, 1, 2, 0, 0, 0, 0)),
    ("qwen3-moe-step", {"num_hidden_layers": 6, "decoder_sparse_step": 3, "mlp_only_layers": [2]},
     (6, 4, 5, 6, 0, 0, 0, 0)),
    ("qwen3-moe-step", {"num_hidden_layers": 6, "decoder_sparse_step": 3, "mlp_only_layers": [2, 5]},
     (6, 0, 0, 1, 0, 0, 0, 0)),
    ("qwen3-moe-step", {"num_hidden_layers": 6, "decoder_sparse_step": 1, "mlp_only_layers": [0, 1]},
     (6, 4, 2, 1, 0, 0, 0, 0)),
    ("llama4:interleaved", {**DERIVED, "num_hidden_layers": 6, "interleave_moe_layer_step": 2},
     (6, 4, 1, 2, 1, 0, 0, 2)),
    ("llama4:interleaved", {**DERIVED, "num_hidden_layers": 6, "interleave_moe_layer_step": 3},
     (6, 4, 2, 3, 1, 0, 0, 2)),
    ("llama4:interleaved", {"num_hidden_layers": 4, "moe_layers": [0, 2, 4, -1]},
     (4, 4, 0, 2, 1, 0, 0, 2)),
    ("llama4:interleaved", {"num_hidden_layers": 4, "moe_layers": [3]},
     (4, 4, 3, 4, 1, 0, 0, 2)),
    ("llama4:interleaved", {"moe_layers": []},
     (4, 0, 0, 1, 0, 0, 0, 2)),
    ("llama4:interleaved", {"no_rope_layers": [1, 1, 1, 1], "layer_types": None},
     (4, 4, 1, 2, 1, 0, 0, 0)),
    ("llama4:interleaved", {"no_rope_layers": [0, 0, 0, 0], "layer_types": None},
     (4, 4, 1, 2, 1, 0, 0, 1)),
    ("llama4:interleaved", {"no_rope_layers": None, "no_rope_layer_interval": 3, "layer_types": None},
     (4, 4, 1, 2, 1, 0, 0, 3)),
    ("llama4:interleaved", {"no_rope_layers": None, "no_rope_layer_interval": 1, "layer_types": None},
     (4, 4, 1, 2, 1, 0, 0, 1)),
    ("llama4:interleaved", {"no_rope_layers": None, "no_rope_layer_interval": 0, "layer_types": None},
     (4, 4, 1, 2, 1, 0, 0, 0)),
    ("deepseek:plain-query-groups", {"first_k_dense_replace": 3},
     (3, 0, 0, 1, 0, 0, 0, 0)),
    ("deepseek:plain-query-groups", {"first_k_dense_replace": 2},
     (3, 6, 2, 1, 1, 3, 2, 0)),
    ("deepseek:plain-query-groups", {"n_group": None, "topk_group": None, "n_shared_experts": None},
     (3, 6, 1, 1, 0, 0, 0, 0)),
    ("deepseek:plain-query-groups", {"n_group": 2, "topk_group": 1},
     (3, 6, 1, 1, 1, 2, 1, 0)),
])
def test_the_blocks_holding_experts_or_no_rotary_are_transformers_own(base, change, expected):
    out = model_config_from_hf({**CONFIGS[base]().to_dict(), **change})
    assert tuple(out[k] for k in BLOCKS) == expected


@pytest.mark.parametrize("base,change,line", [
    ("qwen3-moe-step", {"decoder_sparse_step": 0},
     "decoder_sparse_step should be a positive integer, got 0"),
    ("qwen3-moe-step", {"decoder_sparse_step": True},
     "decoder_sparse_step should be a positive integer, got true"),
    ("qwen3-moe-step", {"mlp_only_layers": "0"},
     "mlp_only_layers should be a list of layer indices, got '0'"),
    ("qwen3-moe-step", {"mlp_only_layers": [True]},
     "mlp_only_layers should be a list of layer indices, got [true]"),
    ("llama4:interleaved", {"interleave_moe_layer_step": 0},
     "interleave_moe_layer_step should be a positive integer, got 0"),
    ("llama4:interleaved", {"interleave_moe_layer_step": True},
     "interleave_moe_layer_step should be a positive integer, got true"),
    ("llama4:interleaved", {"moe_layers": "1"},
     "moe_layers should be a list of layer indices, got '1'"),
    ("llama4:interleaved", {"moe_layers": [1.0]},
     "moe_layers should be a list of layer indices, got [1.0]"),
    ("llama4:interleaved", {"no_rope_layers": [1, 1, 1]},
     "no_rope_layers should be a list of 4 zeros and ones, got [1, 1, 1]"),
    ("llama4:interleaved", {"no_rope_layers": [1, 2, 1, 1]},
     "no_rope_layers should be a list of 4 zeros and ones, got [1, 2, 1, 1]"),
])
def test_a_malformed_list_or_step_of_blocks_is_one_line(base, change, line):
    with pytest.raises(ConfigError) as e:
        model_config_from_hf({**CONFIGS[base]().to_dict(), **change})
    assert str(e.value) == f"config.json: {line}"


@pytest.mark.parametrize("read,line", [
    (lambda r: r.int("a"), "a should be an integer, got true"),
    (lambda r: r.int("b"), "b should be an integer, got 2.5"),
    (lambda r: r.float("c"), "c should be a number, got 'x'"),
    (lambda r: r.float("a"), "a should be a number, got true"),
    (lambda r: r.bool("d"), "d should be true or false, got 1"),
])
def test_the_readers_types_are_refused_in_one_line(read, line):
    with pytest.raises(ConfigError) as e:
        read(Reader({"a": True, "b": 2.5, "c": "x", "d": 1}, {}, "here/config.json"))
    assert str(e.value) == f"here/config.json: {line}"


def test_a_key_missing_from_the_file_and_the_defaults_is_a_key_error_unless_optional():
    get = Reader({"n": 3, "eps": 1}, {"flag": False}, "config.json")
    assert (get.int("n"), get.float("eps"), get.bool("flag")) == (3, 1.0, False)
    assert type(get.float("eps")) is float and get.int("gone", optional=True) is None
    for read in (get.int, get.float, get.bool):
        with pytest.raises(KeyError):
            read("gone")


def test_short_keeps_60_characters_and_cuts_longer_values_to_60():
    assert short("a" * 58) == repr("a" * 58)  # 60 with its quotes
    assert short("a" * 59) == repr("a" * 59)[:57] + "..." and len(short("a" * 59)) == 60
    assert short([1, 2]) == "[1, 2]" and short(None) == "null" and short(True) == "true"


def test_a_config_of_another_model_type_is_read_by_gpt2s_or_llamas_keys():
    from scaletrain.model.families import family_of_config

    assert family_of_config({"model_type": "qwen2", "n_embd": 8}) is FAMILIES["qwen2"]
    assert family_of_config({"model_type": "bloom", "n_embd": 8}) is FAMILIES["gpt2"]
    assert family_of_config({"model_type": "falcon", "hidden_size": 8}) is FAMILIES["llama"]


LIN = "linear_attention"


@pytest.mark.parametrize("config,n_layers,every", [
    ({"full_attention_interval": 3}, 6, 3),  # no layer_types: transformers' interval
    ({"layer_types": [LIN, LIN, F, LIN, LIN, F]}, 6, 3),
    ({"layer_types": [LIN, F, LIN], "full_attention_interval": 3}, 3, 2),  # layer_types win
    ({"layer_types": [F, F, F]}, 3, 1),  # every block full attention
    ({"layer_types": [LIN, LIN, LIN]}, 3, 4),  # none: past the last block
])
def test_qwen3_nexts_full_attention_blocks_from_layer_types_or_the_interval(config, n_layers, every):
    refuse = Refusals()
    assert FAMILIES["qwen3_next"]._full_every(Reader(config, {}, "config.json"), refuse, n_layers) == every
    assert refuse == []


def test_qwen3_next_with_every_block_full_reads_no_linear_keys():
    keys = ("linear_num_key_heads", "linear_key_head_dim", "linear_num_value_heads", "linear_value_head_dim",
            "linear_conv_kernel_dim")
    config = {k: v for k, v in CONFIGS["qwen3_next:dense"]().to_dict().items() if k not in keys}
    out = model_config_from_hf({**config, "layer_types": [F, F, F]})
    assert (out["linear_heads"], out["attn_gate"], out["norm_unit_offset"]) == (0, True, True)
    assert not any(ModelConfig(**out).is_linear_block(i) for i in range(3))


def test_the_planners_loose_read_counts_an_attention_bias_as_qkv_biases():
    """The planner reads any decoder's shape (strict=False): a Llama's attention_bias alone, refused for
    training, counts as q/k/v biases (close enough for memory); with mlp_bias, biases everywhere."""
    llama = CONFIGS["llama-rope-scaling"]().to_dict()
    loose = model_config_from_hf({**llama, "attention_bias": True}, strict=False)
    assert (loose["bias"], loose["qkv_bias"]) == (False, True)
    both = model_config_from_hf({**llama, "attention_bias": True, "mlp_bias": True}, strict=False)
    assert (both["bias"], both["qkv_bias"]) == (True, False)
    assert model_config_from_hf(llama, strict=False)["qkv_bias"] is False
    gemma = CONFIGS["gemma2"]().to_dict()  # a refused query scale: the usual one
    assert model_config_from_hf({**gemma, "query_pre_attn_scalar": 0}, strict=False)["attn_scale_dim"] == 0
    qwen = CONFIGS["qwen3_next:dense"]().to_dict()  # 3 blocks; layer_types not a list: no block full
    assert model_config_from_hf({**qwen, "layer_types": "x"}, strict=False)["full_every"] == 4


@pytest.mark.parametrize("name", [name for name in CONFIGS if not name.startswith("off:")])
def test_the_head_count_is_read_from_the_file_not_the_default(name):
    """The tiny configs have 4 heads, ModelConfig's default: here 8 (whole heads of 8 columns where the
    width follows from the heads), and the shape read must say 8, and the file's own other counts."""
    config = CONFIGS[name]().to_dict()
    key = "n_head" if "n_head" in config else "num_attention_heads"
    latent = {"num_key_value_heads": 8} if config["model_type"] == "deepseek_v3" else {}  # (one K/V head a head)
    out = model_config_from_hf({**config, key: 8, **latent})
    assert out["n_heads"] == 8
    sizes = {"vocab_size": "vocab_size", "dim": ("n_embd", "hidden_size"),
             "n_layers": ("n_layer", "num_hidden_layers"), "max_seq_len": ("n_positions", "max_position_embeddings")}
    for ours, theirs in sizes.items():
        theirs = next(k for k in ((theirs,) if isinstance(theirs, str) else theirs) if k in config)
        assert out[ours] == config[theirs], ours


def test_a_mixture_without_its_count_of_experts_takes_the_familys_default():
    config = {k: v for k, v in CONFIGS["mixtral"]().to_dict().items() if k not in ("num_local_experts", "num_experts")}
    assert model_config_from_hf(config)["moe_experts"] == FAMILIES["mixtral"].defaults["num_local_experts"] == 8


def test_deepseeks_prediction_modules_are_the_blocks_after_the_last():
    cfg = ModelConfig(**model_config_from_hf(CONFIGS["deepseek:plain-query-groups"]().to_dict()))  # 3 blocks
    beside = FAMILIES["deepseek_v3"].beside_the_model
    assert [beside(f"model.layers.{i}.mlp.gate.weight", cfg) for i in (0, 2, 3, 4)] == [False, False, True, True]
    assert not beside("lm_head.weight", cfg) and not beside("model.norm.weight", cfg)


def test_qwen3_next_is_recognised_by_its_linear_attention():
    recognises = FAMILIES["qwen3_next"].recognises
    assert recognises(["model.embed_tokens.weight", "model.layers.0.linear_attn.in_proj_qkvz.weight"])
    assert not recognises(["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight"])


def test_a_config_without_a_size_is_one_line_naming_it():
    config = {k: v for k, v in CONFIGS["llama-rope-scaling"]().to_dict().items() if k != "hidden_size"}
    with pytest.raises(ConfigError) as e:
        model_config_from_hf(config)
    assert str(e.value) == ("config.json: no 'hidden_size'; expected a decoder config with hidden_size, "
                            "num_hidden_layers, num_attention_heads, intermediate_size, vocab_size")
