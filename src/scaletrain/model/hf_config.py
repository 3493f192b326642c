"""Hugging Face configs in and out: config.json <-> ModelConfig for GPT-2, Llama, Mistral, Qwen2,
Qwen3, OLMo 2, GPT-NeoX / Pythia, Phi-3 / Phi-4, Gemma 2 and Gemma 3 (text), and the mixtures of
experts Mixtral, Qwen3-MoE and OLMoE.

A field that changes what the model computes and that scaletrain does not implement (another
RoPE scaling, a bias on the output projection alone, partial rotary, ...) is refused with one
line naming it, never dropped: a model that loads and silently computes something else is the
failure this module exists to prevent. So is a field we do not know. The weights' names and
layouts: scaletrain.model.hf.

Mixtures of experts: all three families route by a softmax over experts, keep the top k and run
every token (dropless), as ours does with moe_score=softmax and no capacity. Mixtral always
rescales the chosen weights to sum to one, Qwen3-MoE and OLMoE when norm_topk_prob says so
(model.moe_renorm). Qwen3-MoE's q/k norms act on each head as Qwen3's do; OLMoE's act on the whole
query and key projections (model.qk_norm_scope=projection). None of them has a routing bias, so
the import turns ours off (model.moe_bias_rate=0: a bias learned in fine-tuning could not be
exported). `router_aux_loss_coef` is not carried over: transformers' load-balancing loss pools
the whole batch and all layers into one product, ours (model.moe_aux_loss) is the Switch loss of
each layer and each sequence, so the same coefficient would weigh another quantity; set
moe_aux_loss (or keep the bias) for fine-tuning. DeepSeek-V3 (and V2) attend by multi-head latent
attention, which scaletrain's attention does not compute: refused.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from scaletrain.errors import ConfigError
from scaletrain.model.config import ModelConfig
from scaletrain.model.hf_export_family import newer_family, phi3_family, uses_newer_options

FAMILIES = ("gpt2", "llama", "mistral", "qwen2", "qwen3", "olmo2", "gpt_neox", "phi3", "gemma2", "gemma3_text",
            "mixtral", "qwen3_moe", "olmoe")
_GEMMA = ("gemma2", "gemma3_text")
MOE_FAMILIES = ("mixtral", "qwen3_moe", "olmoe")
# mixtures of experts whose attention scaletrain lacks: refused with what to do instead
_MLA = ("deepseek_v3", "deepseek_v2")
CONFIG_FILE = "config.json"

# --------------------------------------------------------------------------------------------
# config.json -> ModelConfig

# Keys that never change the logits of a causal language model: metadata, token ids, generation
# settings of old configs, initialisation and dropout (dropout is a training choice: model.dropout).
_HARMLESS = frozenset("""
    _name_or_path architectures model_type transformers_version torch_dtype dtype use_cache
    bos_token_id eos_token_id pad_token_id sep_token_id decoder_start_token_id initializer_range
    output_attentions output_hidden_states return_dict torchscript use_bfloat16 tf_legacy_loss
    task_specific_params id2label label2id num_labels problem_type finetuning_task tokenizer_class
    prefix chunk_size_feed_forward tie_encoder_decoder cross_attention_hidden_size max_length
    min_length do_sample early_stopping num_beams num_beam_groups diversity_penalty temperature
    top_k top_p typical_p repetition_penalty length_penalty no_repeat_ngram_size
    encoder_no_repeat_ngram_size bad_words_ids num_return_sequences output_scores
    return_dict_in_generate forced_bos_token_id forced_eos_token_id remove_invalid_values
    exponential_decay_length_penalty suppress_tokens begin_suppress_tokens attn_implementation
    _attn_implementation _attn_implementation_autoset gradient_checkpointing _commit_hash is_decoder
    attention_dropout attn_pdrop resid_pdrop embd_pdrop output_router_logits router_aux_loss_coef
""".split())
# Keys each family's modeling code reads, beyond _HARMLESS (anything else is refused as unknown).
_ROTARY = {"vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
           "head_dim", "intermediate_size", "max_position_embeddings", "hidden_act", "rms_norm_eps", "rope_theta",
           "rope_scaling", "rope_parameters", "partial_rotary_factor", "tie_word_embeddings",
           "is_encoder_decoder", "pruned_heads"}
_WINDOWED = {"use_sliding_window", "sliding_window", "max_window_layers", "layer_types", "use_mrope"}
_KNOWN = {
    "gpt2": {"vocab_size", "n_embd", "n_layer", "n_head", "n_positions", "n_ctx", "n_inner", "activation_function",
             "layer_norm_epsilon", "tie_word_embeddings", "scale_attn_weights", "scale_attn_by_inverse_layer_idx",
             "reorder_and_upcast_attn", "add_cross_attention", "summary_type", "summary_use_proj",
             "summary_activation", "summary_proj_to_labels", "summary_first_dropout",
             "is_encoder_decoder", "pruned_heads"},
    "llama": _ROTARY | {"attention_bias", "mlp_bias", "pretraining_tp"},
    "mistral": _ROTARY | {"sliding_window"},
    "qwen2": _ROTARY | _WINDOWED,
    "qwen3": _ROTARY | _WINDOWED | {"attention_bias"},
    "olmo2": _ROTARY | {"attention_bias"},
    "gpt_neox": _ROTARY - {"rms_norm_eps", "num_key_value_heads", "head_dim"} | {
        "layer_norm_eps", "rotary_pct", "rotary_emb_base", "use_parallel_residual", "attention_bias",
        "hidden_dropout", "classifier_dropout", "is_decoder"},
    "phi3": _ROTARY | {"original_max_position_embeddings", "sliding_window"},
    "gemma2": _ROTARY | {"hidden_activation", "attention_bias", "query_pre_attn_scalar", "sliding_window",
                         "layer_types", "final_logit_softcapping", "attn_logit_softcapping",
                         "use_bidirectional_attention", "cache_implementation"},
    "gemma3_text": _ROTARY | {"hidden_activation", "attention_bias", "query_pre_attn_scalar", "sliding_window",
                              "layer_types", "final_logit_softcapping", "attn_logit_softcapping",
                              "use_bidirectional_attention", "cache_implementation", "rope_local_base_freq",
                              "sliding_window_pattern", "_sliding_window_pattern"},
    "mixtral": _ROTARY | {"sliding_window", "num_local_experts", "num_experts", "num_experts_per_tok",
                          "router_jitter_noise"},
    "qwen3_moe": _ROTARY | _WINDOWED | {"attention_bias", "num_experts", "num_local_experts", "num_experts_per_tok",
                                        "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step",
                                        "mlp_only_layers"},
    "olmoe": _ROTARY | {"attention_bias", "clip_qkv", "num_experts", "num_local_experts", "num_experts_per_tok",
                        "norm_topk_prob"},
}
# What a key left out of config.json means: the defaults of transformers' config classes.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "gpt2": dict(n_positions=1024, n_inner=None, activation_function="gelu_new", layer_norm_epsilon=1e-5,
                 tie_word_embeddings=True, scale_attn_weights=True),
    "llama": dict(num_key_value_heads=None, head_dim=None, hidden_act="silu", max_position_embeddings=2048,
                  rms_norm_eps=1e-6, tie_word_embeddings=False),
    "mistral": dict(num_key_value_heads=8, head_dim=None, hidden_act="silu", max_position_embeddings=131072,
                    rms_norm_eps=1e-6, tie_word_embeddings=False, sliding_window=4096),
    "qwen2": dict(num_key_value_heads=32, head_dim=None, hidden_act="silu", max_position_embeddings=32768,
                  rms_norm_eps=1e-6, tie_word_embeddings=False, sliding_window=4096, max_window_layers=28),
    "qwen3": dict(num_key_value_heads=32, head_dim=128, hidden_act="silu", max_position_embeddings=32768,
                  rms_norm_eps=1e-6, tie_word_embeddings=False, sliding_window=4096, max_window_layers=28),
    "olmo2": dict(num_key_value_heads=None, head_dim=None, hidden_act="silu", max_position_embeddings=2048,
                  rms_norm_eps=1e-5, tie_word_embeddings=False, attention_bias=False),
    "gpt_neox": dict(hidden_act="gelu", max_position_embeddings=2048, layer_norm_eps=1e-5, tie_word_embeddings=False,
                     use_parallel_residual=True, attention_bias=True, rotary_pct=0.25, rotary_emb_base=10000),
    "phi3": dict(num_key_value_heads=None, head_dim=None, hidden_act="silu", max_position_embeddings=4096,
                 rms_norm_eps=1e-5, tie_word_embeddings=False, sliding_window=None),
    "gemma2": dict(num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh",
                   max_position_embeddings=8192, rms_norm_eps=1e-6, tie_word_embeddings=True, attention_bias=False,
                   query_pre_attn_scalar=256, sliding_window=4096, final_logit_softcapping=30.0,
                   attn_logit_softcapping=50.0, sliding_window_pattern=2),
    "gemma3_text": dict(num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh",
                        max_position_embeddings=131072, rms_norm_eps=1e-6, tie_word_embeddings=True,
                        attention_bias=False, query_pre_attn_scalar=256, sliding_window=4096,
                        final_logit_softcapping=None, attn_logit_softcapping=None, rope_theta=1000000.0,
                        rope_local_base_freq=10000.0, sliding_window_pattern=6),
    "mixtral": dict(num_key_value_heads=8, head_dim=None, hidden_act="silu", max_position_embeddings=131072,
                    rms_norm_eps=1e-5, tie_word_embeddings=False, sliding_window=None, rope_theta=1e6,
                    num_local_experts=8, num_experts_per_tok=2, router_jitter_noise=0.0),
    "qwen3_moe": dict(num_key_value_heads=4, head_dim=None, hidden_act="silu", max_position_embeddings=32768,
                      rms_norm_eps=1e-6, tie_word_embeddings=False, use_sliding_window=False, sliding_window=4096,
                      num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=False,
                      decoder_sparse_step=1, mlp_only_layers=None),
    "olmoe": dict(num_key_value_heads=None, head_dim=None, hidden_act="silu", max_position_embeddings=4096,
                  rms_norm_eps=1e-5, tie_word_embeddings=False, num_experts=64, num_experts_per_tok=8,
                  norm_topk_prob=False, clip_qkv=None),
}
_GELU_TANH = ("gelu_new", "gelu_pytorch_tanh")  # both are tanh-approximated GELU, as ours
_SILU = ("silu", "swish")
_ROPE_KEYS = {"default": {"rope_type", "type", "rope_theta"},
              "linear": {"rope_type", "type", "rope_theta", "factor", "original_max_position_embeddings"},
              "llama3": {"rope_type", "type", "rope_theta", "factor", "low_freq_factor", "high_freq_factor",
                         "original_max_position_embeddings"}}


def read_hf_config(source: str | Path) -> tuple[dict, str]:
    """The parsed config.json of a Hugging Face model folder (or the file itself), and its path."""
    path = Path(source)
    try:
        if path.is_dir():
            path = path / CONFIG_FILE
        found = path.is_file()
    except (OSError, ValueError):  # a name too long for the file system, or with a NUL byte
        found = False
    if not found:
        raise ConfigError(f"{str(path)!r}: not found; give a Hugging Face model folder (holding {CONFIG_FILE}) "
                          f"or a {CONFIG_FILE}")
    try:
        hf = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not valid JSON ({getattr(e, 'msg', e)}); "
                          f"give a Hugging Face {CONFIG_FILE}") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot be read ({e.strerror})") from None
    if not isinstance(hf, dict):
        raise ConfigError(f"{path}: expected a JSON object (a Hugging Face config.json), got {type(hf).__name__}")
    return hf, str(path)


def model_config_from_hf(source: str | Path | Mapping[str, Any], *, strict: bool = True,
                         where: str | None = None) -> dict[str, Any]:
    """The ModelConfig fields (a dict) of a Hugging Face config: a model folder, a config.json
    path, or the parsed dict. Raises ConfigError, one line per problem, for a field scaletrain
    does not implement or does not know (`strict`); the planner passes strict=False to read the
    shape of any decoder and ignore what does not change its size."""
    if isinstance(source, Mapping):
        hf, where = dict(source), where or CONFIG_FILE
    else:
        hf, path = read_hf_config(source)
        where = where or path
    if not isinstance(hf, dict):
        raise ConfigError(f"{where}: expected a JSON object (a Hugging Face config.json), got {type(hf).__name__}")
    kind = hf.get("model_type", "")
    family = kind if kind in FAMILIES else ("gpt2" if "n_embd" in hf else "llama")
    errors: list[str] = []
    if strict and kind in _MLA:
        raise ConfigError(f"{where}: model_type={kind!r} attends by multi-head latent attention (compressed keys and "
                          "values), which scaletrain's attention does not compute; import a Mixtral, Qwen3-MoE or "
                          "OLMoE model, or train a DeepSeek-style mixture from scratch (model.moe_score=sigmoid, "
                          "moe_shared_experts, moe_first_dense)")
    if strict and kind not in FAMILIES:
        raise ConfigError(f"{where}: model_type={kind!r} is not one scaletrain imports; "
                          f"supported: {', '.join(FAMILIES)}")
    if strict:
        for key in sorted(set(hf) - _HARMLESS - _KNOWN[family]):
            errors.append(f"{where}: field {key}={_short(hf[key])} is unknown to scaletrain's {family} import and "
                          f"may change the model; remove it from {CONFIG_FILE} if it does not")
    get = _Reader(hf, _DEFAULTS[family], where)

    def refuse(key: str, why: str) -> None:
        if strict:
            errors.append(f"{where}: {key}={_short(hf.get(key, _DEFAULTS[family].get(key)))} {why}")

    try:
        if family == "gpt2":
            out = _gpt2_fields(get, refuse)
        elif family == "gpt_neox":
            out = _neox_fields(get, refuse)
        elif family in _GEMMA:
            out = _gemma_fields(get, refuse, family)
        else:
            out = _rotary_fields(get, refuse, family, strict)
    except KeyError as e:
        raise ConfigError(f"{where}: no {e.args[0]!r}; expected a decoder config with hidden_size, "
                          "num_hidden_layers, num_attention_heads, intermediate_size, vocab_size") from None
    if hf.get("is_encoder_decoder"):
        refuse("is_encoder_decoder", "is not a decoder-only language model, which is what scaletrain imports")
    if hf.get("pruned_heads"):
        refuse("pruned_heads", "removes heads from some layers; scaletrain's layers all have n_heads")
    if errors:
        raise ConfigError(*errors)
    return out


def _gpt2_fields(get: _Reader, refuse) -> dict[str, Any]:
    vocab, dim = get.int("vocab_size"), get.int("n_embd")
    if get.raw("activation_function") not in _GELU_TANH:
        refuse("activation_function", f"is not supported; scaletrain's GELU is the tanh one ({', '.join(_GELU_TANH)})")
    if get.raw("scale_attn_weights") is False:
        refuse("scale_attn_weights", "leaves the scores unscaled; scaletrain divides them by sqrt(head_dim)")
    if get.raw("scale_attn_by_inverse_layer_idx"):
        refuse("scale_attn_by_inverse_layer_idx", "scales each layer's scores differently; scaletrain does not")
    if get.raw("add_cross_attention"):
        refuse("add_cross_attention", "adds cross-attention; scaletrain imports decoder-only language models")
    return _complete(dict(
        vocab_size=vocab, dim=dim, n_layers=get.int("n_layer"), n_heads=get.int("n_head"),
        n_kv_heads=0, head_dim=0, ffn_dim=get.int("n_inner", optional=True) or 4 * dim, norm="layernorm",
        norm_eps=get.float("layer_norm_epsilon"), activation="gelu", position="learned",
        max_seq_len=get.int("n_positions"), tie_embeddings=get.bool("tie_word_embeddings"), bias=True))


def _neox_fields(get: _Reader, refuse) -> dict[str, Any]:
    """GPT-NeoX / Pythia: LayerNorm and every linear layer with biases, a GELU MLP, q/k/v fused per
    head, a share of each head rotated (rotary_pct), attention and MLP in parallel or in turn."""
    dim, act = get.int("hidden_size"), get.raw("hidden_act")
    if act not in ("gelu",) + _GELU_TANH:
        refuse("hidden_act", f"is not supported; scaletrain's GPT-NeoX MLP computes gelu or {', '.join(_GELU_TANH)}")
    if not get.raw("attention_bias"):
        refuse("attention_bias", "leaves attention without biases while GPT-NeoX's MLP keeps its own; scaletrain "
                                 "has biases on every linear layer or none")
    max_len = get.int("max_position_embeddings")
    out = dict(
        vocab_size=get.int("vocab_size"), dim=dim, n_layers=get.int("num_hidden_layers"),
        n_heads=get.int("num_attention_heads"), ffn_dim=get.int("intermediate_size"), norm="layernorm",
        norm_eps=get.float("layer_norm_eps"), activation="gelu_exact" if act == "gelu" else "gelu", position="rope",
        max_seq_len=max_len, tie_embeddings=get.bool("tie_word_embeddings"), bias=True,
        parallel_residual=get.bool("use_parallel_residual"))
    out.update(_rope_fields(get, refuse, max_len, partial=True))
    return _complete(out)


def _gemma_fields(get: _Reader, refuse, family: str) -> dict[str, Any]:
    """Gemma 2 and Gemma 3 (text): embeddings scaled by sqrt(dim), GeGLU, (1 + w) RMSNorms before and
    after each sub-block, scores scaled by query_pre_attn_scalar, soft-capped scores and logits
    (Gemma 2), q/k norms and a rotary base of their own for the sliding-window blocks (Gemma 3)."""
    dim, n_heads, head_dim = get.int("hidden_size"), get.int("num_attention_heads"), get.int("head_dim")
    n_layers, max_len = get.int("num_hidden_layers"), get.int("max_position_embeddings")
    act = get.raw("hidden_activation") or get.raw("hidden_act")
    if act not in _GELU_TANH:
        refuse("hidden_activation", f"is not supported; scaletrain's GeGLU gates by {' or '.join(_GELU_TANH)}")
    if get.raw("attention_bias"):
        refuse("attention_bias", "puts biases on the attention projections; scaletrain's Gemma has none")
    if get.raw("use_bidirectional_attention"):
        refuse("use_bidirectional_attention", "lets every token attend to later ones; scaletrain's attention is causal")
    scalar = get.raw("query_pre_attn_scalar")
    if isinstance(scalar, bool) or not isinstance(scalar, int) or scalar <= 0:
        refuse("query_pre_attn_scalar", "should be a positive integer (the scores are divided by its square root)")
        scalar = head_dim
    caps = {}
    for key, ours in (("attn_logit_softcapping", "attn_softcap"), ("final_logit_softcapping", "logit_softcap")):
        cap = get.raw(key)
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float)) or cap <= 0):
            refuse(key, "should be a positive number or null")
            cap = None
        caps[ours] = float(cap or 0.0)
    # which blocks slide: layer_types, or (configs without it) every block but each pattern-th
    pattern = get.raw("sliding_window_pattern")
    types = get.raw("layer_types")
    if not isinstance(types, list):
        ok = isinstance(pattern, int) and not isinstance(pattern, bool) and pattern > 0
        types = ["sliding_attention" if ok and (i + 1) % pattern else "full_attention" for i in range(n_layers)]
    window = get.raw("sliding_window")
    slides = "sliding_attention" in types and isinstance(window, int) and not isinstance(window, bool) and window > 0
    every = 0
    if slides and "full_attention" in types:
        every = types.index("full_attention") + 1
        if types != ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(n_layers)]:
            refuse("layer_types", f"has its global blocks where model.global_every (every n-th block global) cannot "
                                  f"put them: {_short(types)}")
    out = dict(
        vocab_size=get.int("vocab_size"), dim=dim, n_layers=n_layers, n_heads=n_heads,
        n_kv_heads=get.int("num_key_value_heads"), head_dim=0 if head_dim * n_heads == dim else head_dim,
        ffn_dim=get.int("intermediate_size"), norm="rmsnorm", norm_eps=get.float("rms_norm_eps"),
        norm_unit_offset=True, norm_placement="both", activation="geglu", embed_scale=True, position="rope",
        max_seq_len=max_len, tie_embeddings=get.bool("tie_word_embeddings"), bias=False,
        qk_norm=family == "gemma3_text", sliding_window=window if slides else 0, global_every=every,
        attn_scale_dim=0 if scalar == head_dim else scalar, **caps)
    if out["n_kv_heads"] == n_heads:
        out["n_kv_heads"] = 0
    params = get.raw("rope_parameters")
    if family == "gemma3_text" and isinstance(params, dict) and "full_attention" in params:
        # transformers 5: one set of rotary parameters per kind of block
        glob, local = params.get("full_attention") or {}, params.get("sliding_attention") or {}
        out.update(_rope_fields(_Reader({"rope_parameters": glob}, {"rope_theta": 1000000.0}, get.where), refuse,
                                max_len))
        local_kind = local.get("rope_type", local.get("type", "default")) if isinstance(local, dict) else None
        if local_kind != "default" or set(local) - {"rope_type", "type", "rope_theta"}:
            refuse("rope_parameters", f"scales the sliding-window blocks' rotary ({_short(local)}); scaletrain "
                                      "scales the global blocks' only")
        local_theta = local.get("rope_theta", 10000.0) if isinstance(local, dict) else 10000.0
    else:
        out.update(_rope_fields(get, refuse, max_len))
        local_theta = get.raw("rope_local_base_freq") if family == "gemma3_text" else None
    if local_theta is not None and not every and types and types[0] == "sliding_attention":
        out["rope_theta"] = float(local_theta)  # every block slides: the local base is the only one
        out["rope_scaling"], out["rope_factor"] = "none", 1.0
    elif local_theta is not None and every:
        out["rope_local_theta"] = float(local_theta)
    return _complete(out)


def _rotary_fields(get: _Reader, refuse, family: str, strict: bool) -> dict[str, Any]:
    vocab, dim, n_heads = get.int("vocab_size"), get.int("hidden_size"), get.int("num_attention_heads")
    head_dim = get.int("head_dim", optional=True) or 0
    max_len = get.int("max_position_embeddings")
    if get.raw("hidden_act") not in _SILU:
        refuse("hidden_act", "is not supported; scaletrain's gated MLP uses silu (SwiGLU)")
    out = dict(
        vocab_size=vocab, dim=dim, n_layers=get.int("num_hidden_layers"), n_heads=n_heads,
        n_kv_heads=get.int("num_key_value_heads", optional=True) or 0,
        head_dim=0 if head_dim * n_heads == dim else head_dim,  # 0: the usual dim / n_heads
        ffn_dim=get.int("intermediate_size"), norm="rmsnorm", norm_eps=get.float("rms_norm_eps"),
        activation="swiglu", position="rope", max_seq_len=max_len, tie_embeddings=get.bool("tie_word_embeddings"),
        bias=False, qkv_bias=family == "qwen2", qk_norm=family in ("qwen3", "qwen3_moe", "olmoe", "olmo2"),
        qk_norm_scope="projection" if family in ("olmoe", "olmo2") else "head",
        norm_placement="post" if family == "olmo2" else "pre", export_as="phi3" if family == "phi3" else "auto")
    if out["n_kv_heads"] == n_heads:
        out["n_kv_heads"] = 0
    out.update(_rope_fields(get, refuse, max_len, partial=family == "phi3"))

    attention_bias, mlp_bias = bool(get.raw("attention_bias")), bool(get.raw("mlp_bias"))
    if family == "llama" and attention_bias and mlp_bias:
        out["bias"] = True  # every linear layer has one, as model.bias gives (RMSNorm has none)
    elif family == "llama" and attention_bias:
        refuse("attention_bias", "puts a bias on the output projection too, without mlp_bias; scaletrain has "
                                 "biases on q/k/v only (qkv_bias) or on every linear layer (bias)")
    elif family == "llama" and mlp_bias:
        refuse("mlp_bias", "puts biases on the MLP alone; scaletrain has them on every linear layer or none")
    elif family in ("qwen3", "qwen3_moe", "olmoe", "olmo2") and attention_bias:
        refuse("attention_bias", f"puts a bias on the output projection too; scaletrain's {family} has none there")
    if family in ("olmoe", "olmo2") and out["head_dim"]:
        refuse("head_dim", f"differs from hidden_size / num_attention_heads, which {family}'s q/k norms assume")
    if family == "olmoe" and get.raw("clip_qkv") is not None:
        refuse("clip_qkv", "clamps the queries, keys and values; scaletrain does not")
    if family in MOE_FAMILIES:
        out.update(_moe_fields(get, refuse, family, out["n_layers"]))
    if not strict and attention_bias and not out["bias"]:
        out["qkv_bias"] = True  # (planning: close enough for counting)

    window = _sliding_window(get, family, out["n_layers"])
    if window and window < max_len:
        out["sliding_window"] = window  # config loading then keeps data.seq_len within it
    if get.raw("use_mrope"):
        refuse("use_mrope", "is multimodal rotary positions; scaletrain has text positions only")
    return _complete(out)


def _rope_fields(get: _Reader, refuse, max_len: int, partial: bool = False) -> dict[str, Any]:
    """rope_theta and the scaling, from transformers 5's `rope_parameters` or 4's
    `rope_theta` + `rope_scaling` (which 5 also reads, and lets win); with `partial` (GPT-NeoX,
    Phi-3) the share of each head that turns, else only a whole head is accepted. GPT-NeoX's
    rotary_pct and rotary_emb_base are its older names of partial_rotary_factor and rope_theta."""
    params = get.raw("rope_scaling") or get.raw("rope_parameters") or {}
    key = "rope_scaling" if get.raw("rope_scaling") else "rope_parameters"
    if not isinstance(params, dict):
        refuse(key, "is not a JSON object of rotary parameters")
        params = {}
    kind = params.get("rope_type", params.get("type", "default"))
    theta = params.get("rope_theta", get.raw("rope_theta") or get.raw("rotary_emb_base") or 10000.0)
    out: dict[str, Any] = dict(rope_theta=float(theta) if isinstance(theta, (int, float)) else theta)
    share = params.get("partial_rotary_factor", get.raw("partial_rotary_factor"))
    share = get.raw("rotary_pct") if share is None else share
    if partial and share is not None:
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1:
            refuse("partial_rotary_factor", "should be a number in (0, 1], the share of each head that turns")
        else:
            out["rotary_fraction"] = float(share)
    elif share not in (None, 1, 1.0):
        refuse("partial_rotary_factor", "rotates part of each head; scaletrain's import of this family rotates all "
                                        "of it")
    if not isinstance(kind, str) or kind not in _ROPE_KEYS:
        refuse(key, f"has rope_type {kind!r}; scaletrain implements default, linear and llama3")
        return out
    extra = sorted(set(params) - _ROPE_KEYS[kind] - {"partial_rotary_factor"})
    if extra:
        refuse(key, f"has {', '.join(extra)}, unknown to rope_type {kind}; scaletrain may not compute it alike")
    numbers = {"default": (), "linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor")}
    for k in numbers[kind]:
        if isinstance(params.get(k), bool) or not isinstance(params.get(k), (int, float)):
            refuse(key, f"needs a number {k} for rope_type {kind}")
            return out
    if kind != "default":
        out.update(rope_scaling=kind, rope_factor=float(params["factor"]))
    if kind == "llama3":
        out.update(rope_low_freq_factor=float(params["low_freq_factor"]),
                   rope_high_freq_factor=float(params["high_freq_factor"]),
                   rope_original_max_seq_len=params.get("original_max_position_embeddings", max_len))
    return out


def _sliding_window(get: _Reader, family: str, n_layers: int) -> int:
    """The window that some layer attends within, or 0. Mistral slides on every layer when
    sliding_window is set; Qwen2/3 only with use_sliding_window, on the layers layer_types (or
    max_window_layers) marks."""
    window = get.raw("sliding_window")
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        return 0  # null: no window (a value of another type is left to the planner's guess)
    if family in ("mistral", "mixtral", "phi3"):
        return window
    if family not in ("qwen2", "qwen3", "qwen3_moe") or not get.raw("use_sliding_window"):
        return 0
    if family == "qwen3_moe":  # every layer, whatever max_window_layers says
        return window
    types, first = get.raw("layer_types"), get.raw("max_window_layers")
    if isinstance(types, list):
        return window if "sliding_attention" in types else 0
    return window if not isinstance(first, int) or first < n_layers else 0


def _moe_fields(get: _Reader, refuse, family: str, n_layers: int) -> dict[str, Any]:
    """The mixture-of-experts fields of Mixtral, Qwen3-MoE or OLMoE: experts, top k, renormalisation,
    expert width and which blocks hold experts."""
    names = ("num_local_experts", "num_experts") if family != "olmoe" else ("num_experts", "num_local_experts")
    given = [k for k in names if k in get.hf]
    if len(given) == 2 and get.hf[names[0]] != get.hf[names[1]]:
        refuse(names[1], f"differs from {names[0]}={_short(get.hf[names[0]])}; they name the same count of experts")
    experts = get.int(given[0] if given else next(k for k in names if k in get.defaults))
    out: dict[str, Any] = dict(moe_experts=experts, moe_top_k=get.int("num_experts_per_tok"),
                               moe_renorm=True if family == "mixtral" else get.bool("norm_topk_prob"),
                               moe_score="softmax", moe_bias_rate=0.0)
    if family == "mixtral" and get.float("router_jitter_noise"):
        refuse("router_jitter_noise", "scales the router's input by random noise in training; scaletrain's router "
                                      "has no jitter: set it to 0")
    if family != "qwen3_moe":
        return out if experts else {}
    out["moe_hidden"] = get.int("moe_intermediate_size")
    step, dense = get.raw("decoder_sparse_step"), get.raw("mlp_only_layers") or []
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ConfigError(f"{get.where}: decoder_sparse_step should be a positive integer, got {_short(step)}")
    if not isinstance(dense, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in dense):
        raise ConfigError(f"{get.where}: mlp_only_layers should be a list of layer indices, got {_short(dense)}")
    # transformers: block i is a mixture of experts when (i + 1) % step == 0 and i is not in mlp_only_layers
    moe = [i for i in range(n_layers) if (i + 1) % step == 0 and i not in dense]
    if not experts or not moe:
        return {}  # a dense model
    first = moe[0]
    every = moe[1] - moe[0] if len(moe) > 1 else n_layers
    out.update(moe_first_dense=first, moe_every=every)
    ours = [i for i in range(n_layers) if i >= first and (i - first) % every == 0]
    if ours != moe:
        refuse("mlp_only_layers", f"with decoder_sparse_step={step} makes blocks {moe} mixtures of experts, which "
                                  "model.moe_first_dense and moe_every (every n-th block after the first dense ones) "
                                  "cannot express")
    return out


def _complete(out: dict[str, Any]) -> dict[str, Any]:
    """Every field model.from_hf may set, so nothing of a preset or the defaults leaks in."""
    base = dict(n_kv_heads=0, head_dim=0, rope_theta=10000.0, rope_scaling="none", rope_factor=1.0,
                rope_low_freq_factor=ModelConfig.rope_low_freq_factor,
                rope_high_freq_factor=ModelConfig.rope_high_freq_factor,
                rope_original_max_seq_len=ModelConfig.rope_original_max_seq_len,
                sliding_window=0, bias=False, qkv_bias=False, qk_norm=False, qk_norm_scope="head",
                norm_placement="pre", norm_unit_offset=False, parallel_residual=False, embed_scale=False,
                rotary_fraction=1.0, export_as="auto", global_every=0, rope_local_theta=0.0, attn_scale_dim=0,
                attn_softcap=0.0, logit_softcap=0.0,
                **{f.name: f.default for f in dataclasses.fields(ModelConfig) if f.name.startswith("moe_")})
    return {**base, **out}


class _Reader:
    """Reads config.json values with their family's defaults and checks their types."""

    def __init__(self, hf: dict, defaults: dict, where: str):
        self.hf, self.defaults, self.where = hf, defaults, where

    def raw(self, key: str) -> Any:
        return self.hf[key] if key in self.hf else self.defaults.get(key)

    def _get(self, key: str, optional: bool) -> Any:
        if key not in self.hf and key not in self.defaults:
            if optional:
                return None
            raise KeyError(key)
        return self.raw(key)

    def int(self, key: str, optional: bool = False) -> int | None:
        v = self._get(key, optional)
        if v is None and optional:
            return None
        if isinstance(v, bool) or not isinstance(v, int):
            raise ConfigError(f"{self.where}: {key} should be an integer, got {_short(v)}")
        return v

    def float(self, key: str) -> float:
        v = self._get(key, False)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ConfigError(f"{self.where}: {key} should be a number, got {_short(v)}")
        return float(v)

    def bool(self, key: str) -> bool:
        v = self._get(key, False)
        if not isinstance(v, bool):
            raise ConfigError(f"{self.where}: {key} should be true or false, got {_short(v)}")
        return v


def _short(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# --------------------------------------------------------------------------------------------
# ModelConfig -> config.json


def hf_family(cfg: ModelConfig) -> str:
    """The Hugging Face model_type that computes what `cfg` computes, or ConfigError."""
    def no(why: str) -> ConfigError:
        return ConfigError(f"this model has no Hugging Face family: {why}")

    if uses_newer_options(cfg):
        return newer_family(cfg, no)
    if cfg.export_as == "phi3":
        return phi3_family(cfg, no)
    if cfg.position == "learned" and cfg.norm == "layernorm" and cfg.activation == "gelu":
        if cfg.kv_heads != cfg.n_heads or cfg.head_size * cfg.n_heads != cfg.dim:
            raise no("GPT-2 has neither grouped-query attention nor a head_dim apart from dim / n_heads")
        if cfg.qk_norm:
            raise no("GPT-2 has no q/k norms (model.qk_norm)")
        if cfg.sliding_window:
            raise no("GPT-2 has no sliding window (model.sliding_window)")
        return "gpt2"
    if not (cfg.position == "rope" and cfg.norm == "rmsnorm" and cfg.activation == "swiglu"):
        raise no(f"position={cfg.position}, norm={cfg.norm}, activation={cfg.activation}; GPT-2 is learned, "
                 "layernorm, gelu, Llama-likes are rope, rmsnorm, swiglu and GPT-NeoX is rope, layernorm with "
                 "biases (model.bias=true)")
    if cfg.moe_experts:
        return _moe_family(cfg, no)
    if cfg.qk_norm and cfg.qk_norm_scope != "head":
        raise no("q/k norms over the whole projections (model.qk_norm_scope=projection) are exported for OLMoE, "
                 "a mixture of experts, only")
    if cfg.qk_norm:
        if cfg.bias or cfg.qkv_bias:
            raise no("Qwen3 (q/k norms) has no q/k/v-only nor MLP biases (model.qkv_bias, model.bias)")
        return "qwen3"
    if cfg.qkv_bias and not cfg.bias:
        return "qwen2"
    if cfg.bias:
        if cfg.sliding_window:
            raise no("Llama (biases everywhere) has no sliding window (model.sliding_window)")
        return "llama"
    return "mistral" if cfg.sliding_window else "llama"


def _moe_family(cfg: ModelConfig, no) -> str:
    """Mixtral, Qwen3-MoE or OLMoE, whichever computes what the mixture of experts `cfg` computes."""
    unlike = [why for why, differs in (
        ("shared experts (model.moe_shared_experts)", cfg.moe_shared_experts),
        ("sigmoid scores (model.moe_score)", cfg.moe_score != "softmax"),
        ("a routed scale (model.moe_route_scale)", cfg.moe_route_scale != 1.0),
        ("an expert capacity (model.moe_capacity_factor): they are dropless", cfg.moe_capacity_factor),
        ("biases (model.bias, model.qkv_bias)", cfg.bias or cfg.qkv_bias)) if differs]
    if unlike:
        raise no(f"Mixtral, Qwen3-MoE and OLMoE have no {unlike[0]}")
    every_block = cfg.moe_blocks == cfg.n_layers
    if cfg.qk_norm and cfg.qk_norm_scope == "head":
        return "qwen3_moe"
    if cfg.qk_norm:
        if not every_block or cfg.sliding_window or cfg.head_size * cfg.n_heads != cfg.dim:
            raise no("OLMoE (q/k norms over the whole projections) has experts in every block, no sliding window "
                     "and head_dim = dim / n_heads")
        return "olmoe"
    if not every_block or not cfg.moe_renorm:
        raise no("Mixtral (no q/k norms) has experts in every block and rescales the chosen experts' weights to "
                 "sum to 1 (model.moe_renorm=true)")
    return "mixtral"


def hf_config_from_model(cfg: ModelConfig, **extra: Any) -> dict[str, Any]:
    """The config.json of `cfg` (`extra` adds keys such as bos_token_id / eos_token_id)."""
    family = hf_family(cfg)
    arch = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
            "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "mixtral": "MixtralForCausalLM",
            "qwen3_moe": "Qwen3MoeForCausalLM", "olmoe": "OlmoeForCausalLM", "olmo2": "Olmo2ForCausalLM",
            "gpt_neox": "GPTNeoXForCausalLM", "phi3": "Phi3ForCausalLM", "gemma2": "Gemma2ForCausalLM",
            "gemma3_text": "Gemma3ForCausalLM"}[family]
    out: dict[str, Any] = {"architectures": [arch], "model_type": family, "vocab_size": cfg.vocab_size,
                           "tie_word_embeddings": cfg.tie_embeddings, "dtype": "float32"}
    if family == "gpt2":
        out.update(n_embd=cfg.dim, n_layer=cfg.n_layers, n_head=cfg.n_heads, n_positions=cfg.max_seq_len,
                   n_inner=cfg.hidden_dim, activation_function="gelu_new", layer_norm_epsilon=cfg.norm_eps,
                   attn_pdrop=cfg.dropout, resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout,
                   scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False, reorder_and_upcast_attn=False,
                   add_cross_attention=False)
        return {**out, **extra}
    if family == "gpt_neox":
        rope = {"rope_type": "default", "rope_theta": cfg.rope_theta, "partial_rotary_factor": cfg.rotary_fraction}
        out.update(hidden_size=cfg.dim, num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
                   intermediate_size=cfg.hidden_dim, max_position_embeddings=cfg.max_seq_len,
                   hidden_act="gelu" if cfg.activation == "gelu_exact" else "gelu_new", layer_norm_eps=cfg.norm_eps,
                   use_parallel_residual=cfg.parallel_residual, attention_bias=True, rope_parameters=rope,
                   rotary_pct=cfg.rotary_fraction, rotary_emb_base=cfg.rope_theta, attention_dropout=cfg.dropout,
                   hidden_dropout=cfg.dropout)
        return {**out, **extra}
    out.update(hidden_size=cfg.dim, num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
               num_key_value_heads=cfg.kv_heads, head_dim=cfg.head_size, intermediate_size=cfg.hidden_dim,
               max_position_embeddings=cfg.max_seq_len, hidden_act="silu", rms_norm_eps=cfg.norm_eps,
               attention_dropout=cfg.dropout)
    rope: dict[str, Any] = {"rope_type": "default" if cfg.rope_scaling == "none" else cfg.rope_scaling,
                            "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling != "none":
        rope["factor"] = cfg.rope_factor
    if cfg.rope_scaling == "llama3":
        rope.update(low_freq_factor=cfg.rope_low_freq_factor, high_freq_factor=cfg.rope_high_freq_factor,
                    original_max_position_embeddings=cfg.rope_original_max_seq_len)
    # transformers 5 reads rope_parameters; 4 reads rope_theta and rope_scaling (and 5 lets those win)
    legacy = {k: v for k, v in rope.items() if k != "rope_theta"} if cfg.rope_scaling != "none" else None
    out.update(rope_parameters=rope, rope_theta=cfg.rope_theta, rope_scaling=legacy)
    if family in MOE_FAMILIES:
        # router_aux_loss_coef is left to transformers' default: its loss is not ours (see above)
        out.update(num_experts_per_tok=cfg.moe_top_k, output_router_logits=False)
    if family in ("mixtral", "olmoe"):  # every block a mixture: intermediate_size is the experts' width
        out.update(intermediate_size=cfg.expert_hidden)
    if family == "llama":
        out.update(attention_bias=cfg.bias, mlp_bias=cfg.bias)
    elif family == "olmo2":
        out.update(attention_bias=False)
    elif family in _GEMMA:
        out.update(hidden_activation="gelu_pytorch_tanh", attention_bias=False,
                   query_pre_attn_scalar=cfg.attn_scale_dim or cfg.head_size,
                   attn_logit_softcapping=cfg.attn_softcap or None, final_logit_softcapping=cfg.logit_softcap or None,
                   sliding_window=cfg.sliding_window or None, use_bidirectional_attention=False,
                   layer_types=["sliding_attention" if cfg.is_local_block(i) or (cfg.sliding_window and not
                                                                                cfg.global_every) else "full_attention"
                                for i in range(cfg.n_layers)])
        del out["hidden_act"]
        if family == "gemma3_text":  # one set of rotary parameters per kind of block
            local = {"rope_type": "default", "rope_theta": cfg.rope_local_theta or cfg.rope_theta}
            if not cfg.rope_local_theta and cfg.rope_scaling != "none":
                local = rope  # every block alike
            out.update(rope_parameters={"full_attention": rope, "sliding_attention": local}, rope_scaling=None)
            del out["rope_theta"]
    elif family == "phi3":
        rope["partial_rotary_factor"] = cfg.rotary_fraction
        # (Phi-3's default padding id, 32000, lies outside a smaller vocabulary: transformers then fails to load)
        out.update(rope_scaling=None, sliding_window=cfg.sliding_window or None,
                   original_max_position_embeddings=cfg.max_seq_len, pad_token_id=None)
        del out["head_dim"]
    elif family in ("mistral", "mixtral"):
        out.update(sliding_window=cfg.sliding_window or None)
    if family == "mixtral":
        out.update(num_local_experts=cfg.moe_experts, router_jitter_noise=0.0)
    elif family == "olmoe":
        out.update(num_experts=cfg.moe_experts, norm_topk_prob=cfg.moe_renorm, clip_qkv=None, attention_bias=False)
    elif family == "qwen3_moe":  # which blocks hold experts: every one but those listed dense
        out.update(num_experts=cfg.moe_experts, norm_topk_prob=cfg.moe_renorm, moe_intermediate_size=cfg.expert_hidden,
                   decoder_sparse_step=1, mlp_only_layers=[i for i in range(cfg.n_layers) if not cfg.is_moe_block(i)],
                   use_sliding_window=bool(cfg.sliding_window), sliding_window=cfg.sliding_window or None,
                   attention_bias=False)
    elif family in ("qwen2", "qwen3"):  # the window, if any, on every layer
        slide = bool(cfg.sliding_window)
        out.update(use_sliding_window=slide, sliding_window=cfg.sliding_window or None, max_window_layers=0,
                   layer_types=["sliding_attention" if slide else "full_attention"] * cfg.n_layers)
        if family == "qwen3":
            out.update(attention_bias=False)
    return {**out, **extra}
