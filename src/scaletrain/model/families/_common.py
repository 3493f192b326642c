"""What the Hugging Face families share: the reader of config.json values (`Reader`), the keys
that never change the logits, the rotary fields (`rope_fields`), the Llama weight names, and the
`Family` interface with its Llama-like default (`RotaryFamily`): rope, RMSNorm, SwiGLU, q/k/v
and o projections, norms before the sub-blocks. A family file overrides what differs.

A family answers four questions, both ways: which config.json keys it knows (and their defaults
when left out), which ModelConfig fields they make (`fields`), the config.json of a ModelConfig
(`to_hf`), and how its checkpoints name and lay out the tensors (`block`, `top`, `conv1d`,
`expert_style`, `fused_key`, `saved`).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from scaletrain.errors import ConfigError
from scaletrain.model.config import ModelConfig

if TYPE_CHECKING:  # reading a config.json does not load torch
    import torch

CONFIG_FILE = "config.json"

# Keys that never change the logits of a causal language model: metadata, token ids, generation
# settings of old configs, initialisation and dropout (dropout is a training choice: model.dropout).
HARMLESS = frozenset("""
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
# Keys every rotary family's modeling code reads; a family adds its own.
ROTARY = frozenset({"vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                    "head_dim", "intermediate_size", "max_position_embeddings", "hidden_act", "rms_norm_eps",
                    "rope_theta", "rope_scaling", "rope_parameters", "partial_rotary_factor", "tie_word_embeddings",
                    "is_encoder_decoder", "pruned_heads"})
WINDOWED = frozenset({"use_sliding_window", "sliding_window", "max_window_layers", "layer_types", "use_mrope"})
GELU_TANH = ("gelu_new", "gelu_pytorch_tanh")  # both are tanh-approximated GELU, as ours
SILU = ("silu", "swish")
ROPE_KEYS = {"default": {"rope_type", "type", "rope_theta"},
             "linear": {"rope_type", "type", "rope_theta", "factor", "original_max_position_embeddings"},
             "llama3": {"rope_type", "type", "rope_theta", "factor", "low_freq_factor", "high_freq_factor",
                        "original_max_position_embeddings"},
             "yarn": {"rope_type", "type", "rope_theta", "factor", "original_max_position_embeddings", "beta_fast",
                      "beta_slow", "mscale", "mscale_all_dim", "truncate"}}
# YaRN's keys -> ours, with transformers' value when left out
YARN_KEYS = {"beta_fast": ("rope_beta_fast", 32.0), "beta_slow": ("rope_beta_slow", 1.0),
             "mscale": ("rope_mscale", 0.0), "mscale_all_dim": ("rope_mscale_all_dim", 0.0)}

# Weight names, ours -> Hugging Face, inside block i of a Llama-like family, and outside the blocks
LLAMA_BLOCK = {"attn_norm": "input_layernorm", "attn.wq": "self_attn.q_proj", "attn.wk": "self_attn.k_proj",
               "attn.wv": "self_attn.v_proj", "attn.wo": "self_attn.o_proj", "attn.q_norm": "self_attn.q_norm",
               "attn.k_norm": "self_attn.k_norm", "mlp_norm": "post_attention_layernorm",
               "mlp.w1": "mlp.gate_proj", "mlp.w3": "mlp.up_proj", "mlp.w2": "mlp.down_proj",
               "attn.sinks": "self_attn.sinks",  # (a parameter of the attention module itself: gpt-oss)
               # a mixture's shared experts, one MLP (Llama 4's files name it their own way: its view)
               "moe.shared.w1": "mlp.shared_expert.gate_proj", "moe.shared.w3": "mlp.shared_expert.up_proj",
               "moe.shared.w2": "mlp.shared_expert.down_proj"}
LLAMA_TOP = {"tok_emb": "model.embed_tokens", "norm": "model.norm", "output": "lm_head"}
LLAMA_KEY = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")  # a Llama name inside block i

Refuse = Callable[[str, str], None]


class Family:
    """One Hugging Face family (a `model_type`): its config keys, reader, writer and weight names."""

    model_type: ClassVar[str]
    architecture: ClassVar[str]  # transformers' class, written into config.json's architectures
    known: ClassVar[frozenset[str]]  # config.json keys its modeling code reads, beyond HARMLESS
    defaults: ClassVar[dict[str, Any]]  # what a key left out means: transformers' config class defaults
    # weights
    conv1d: ClassVar[bool] = False  # GPT-2's layout: q, k, v fused in one module, linear weights stored (in, out)
    fused_qkv: ClassVar[str] = ""  # ...that module, in each block (a Conv1D family only)
    prefix: ClassVar[str] = "model."  # what the base model's tensor names start with
    layers: ClassVar[str] = "model.layers"  # ...and those of block i, `{layers}.{i}.`
    block: ClassVar[Mapping[str, str]] = LLAMA_BLOCK  # ours -> theirs inside block i
    top: ClassVar[Mapping[str, str]] = LLAMA_TOP  # ours -> theirs outside the blocks
    norm_placement: ClassVar[str] = "pre"  # where its norms sit (model.norm_placement), which names them
    expert_style: ClassVar[str] = "mlp"  # how its files name each expert's matrices (scaletrain.model.hf)
    adapter_refusal: ClassVar[str] = ""  # why adapters on its separate linears cannot map (empty: they can)
    latent_attention: ClassVar[bool] = False  # its blocks attend by latent attention (model.mla_kv_rank)
    hybrid: ClassVar[bool] = False  # it names linear-attention blocks and gated shared experts (model.linear_heads)
    routing_bias: ClassVar[str] = ""  # where block i stores the experts' routing bias (our expert_bias); "" none

    def fields(self, get: Reader, refuse: Refuse, strict: bool) -> dict[str, Any]:
        """The ModelConfig fields of its config.json (`get` reads it, `refuse` records a problem)."""
        raise NotImplementedError

    def to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        """Its config.json for `cfg` (which hf_family has matched to it)."""
        raise NotImplementedError

    def hf_base(self, cfg: ModelConfig) -> dict[str, Any]:
        return {"architectures": [self.architecture], "model_type": self.model_type, "vocab_size": cfg.vocab_size,
                "tie_word_embeddings": cfg.tie_embeddings, "dtype": "float32"}

    def saved(self, tensors: dict[str, torch.Tensor], weights: Mapping[str, torch.Tensor],
              cfg: ModelConfig) -> dict[str, torch.Tensor]:
        """Its checkpoint's tensors, from `tensors` (ours under its names, each in its layout, but
        what it fuses still apart) and our `weights`: the fused tensors put together."""
        return fuse(tensors, cfg, self) if self.fused else tensors

    def beside_the_model(self, key: str, cfg: ModelConfig) -> bool:
        """Whether a checkpoint's tensor `key` is one the import leaves out, as transformers does
        (DeepSeek-V3's multi-token prediction modules); never for most families."""
        return False

    def recognises(self, keys) -> bool:
        """Whether a checkpoint with these tensor names is laid out as this family's own (and not
        as Llama's, which every Llama-like shares)."""
        return False

    def llama_view(self, source: Mapping[str, torch.Tensor], cfg: ModelConfig) -> Mapping[str, torch.Tensor] | None:
        """Its checkpoint `source` under Llama's names and layouts, for a family whose tensors differ
        from Llama's by more than fused rows (Llama 4); None: `fused_key` says it all."""
        return None

    # fused tensors (GPT-NeoX, Phi-3): a checkpoint's names seen as Llama's
    fused: ClassVar[bool] = False  # some of its tensors hold several of Llama's (fused_key says which rows)

    def fused_key(self, key: str, cfg: ModelConfig) -> tuple[str, list[tuple[int, int]] | None]:
        """Where the tensor Llama calls `key` lives in this family's checkpoint: (its name, the row
        ranges of it that make `key`, concatenated; None = all of it)."""
        return key, None


class RotaryFamily(Family):
    """A Llama-like family: rope, RMSNorm, a SwiGLU MLP, separate q/k/v/o projections."""

    qkv_bias: ClassVar[bool] = False  # biases on q, k and v alone (Qwen2)
    qk_norm: ClassVar[bool] = False  # RMSNorms on the queries and keys
    qk_norm_scope: ClassVar[str] = "head"  # ...of each head, or over the whole projection
    export_as: ClassVar[str] = "auto"  # model.export_as: set where only the option picks this family
    partial_rotary: ClassVar[bool] = False  # reads partial_rotary_factor (else refuses a share below 1)
    output_bias_refused: ClassVar[bool] = False  # attention_bias would put a bias on o_proj, which we lack

    def fields(self, get: Reader, refuse: Refuse, strict: bool) -> dict[str, Any]:
        vocab, dim, n_heads = get.int("vocab_size"), get.int("hidden_size"), get.int("num_attention_heads")
        head_dim = get.int("head_dim", optional=True) or 0
        max_len = get.int("max_position_embeddings")
        if get.raw("hidden_act") not in SILU:
            refuse("hidden_act", "is not supported; scaletrain's gated MLP uses silu (SwiGLU)")
        out = dict(
            vocab_size=vocab, dim=dim, n_layers=get.int("num_hidden_layers"), n_heads=n_heads,
            n_kv_heads=get.int("num_key_value_heads", optional=True) or 0,
            head_dim=0 if head_dim * n_heads == dim else head_dim,  # 0: the usual dim / n_heads
            ffn_dim=get.int("intermediate_size"), norm="rmsnorm", norm_eps=get.float("rms_norm_eps"),
            activation="swiglu", position="rope", max_seq_len=max_len, tie_embeddings=get.bool("tie_word_embeddings"),
            bias=False, qkv_bias=self.qkv_bias, qk_norm=self.qk_norm, qk_norm_scope=self.qk_norm_scope,
            norm_placement=self.norm_placement, export_as=self.export_as)
        if out["n_kv_heads"] == n_heads:
            out["n_kv_heads"] = 0
        out.update(rope_fields(get, refuse, max_len, partial=self.partial_rotary))

        attention_bias, mlp_bias = bool(get.raw("attention_bias")), bool(get.raw("mlp_bias"))
        self.biases(out, attention_bias, mlp_bias, refuse)
        if self.qk_norm_scope == "projection" and out["head_dim"]:
            refuse("head_dim", f"differs from hidden_size / num_attention_heads, which {self.model_type}'s q/k norms "
                               "assume")
        out.update(self.moe_fields(get, refuse, out["n_layers"]))
        if not strict and attention_bias and not out["bias"]:
            out["qkv_bias"] = True  # (planning: close enough for counting)

        window = self.window(get, out["n_layers"], refuse)
        if window and window < max_len:
            out["sliding_window"] = window  # (one at least max_len changes nothing)
        if get.raw("use_mrope"):
            refuse("use_mrope", "is multimodal rotary positions; scaletrain has text positions only")
        return complete(out)

    def biases(self, out: dict[str, Any], attention_bias: bool, mlp_bias: bool, refuse: Refuse) -> None:
        """Set or refuse the biases attention_bias and mlp_bias ask for."""
        if self.output_bias_refused and attention_bias:
            refuse("attention_bias", f"puts a bias on the output projection too; scaletrain's {self.model_type} has "
                                     "none there")

    def moe_fields(self, get: Reader, refuse: Refuse, n_layers: int) -> dict[str, Any]:
        """The mixture-of-experts fields (a dense family: none)."""
        return {}

    def window(self, get: Reader, n_layers: int, refuse: Refuse) -> int:
        """The window that some layer attends within, or 0 (a family without one: 0)."""
        return 0

    def to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        out = self.hf_base(cfg)
        out.update(hidden_size=cfg.dim, num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
                   num_key_value_heads=cfg.kv_heads, head_dim=cfg.head_size, intermediate_size=cfg.hidden_dim,
                   max_position_embeddings=cfg.max_seq_len, hidden_act="silu", rms_norm_eps=cfg.norm_eps,
                   attention_dropout=cfg.dropout)
        rope = hf_rope(cfg)
        # transformers 5 reads rope_parameters; 4 reads rope_theta and rope_scaling (and 5 lets those win)
        legacy = {k: v for k, v in rope.items() if k != "rope_theta"} if cfg.rope_scaling != "none" else None
        out.update(rope_parameters=rope, rope_theta=cfg.rope_theta, rope_scaling=legacy)
        self.hf_extra(cfg, out)
        return out

    def hf_extra(self, cfg: ModelConfig, out: dict[str, Any]) -> None:
        """The family's own config.json keys, added to (or changed in) the Llama-like `out` (its rotary
        parameters: out["rope_parameters"])."""


def fuse(tensors: Mapping[str, torch.Tensor], cfg: ModelConfig, family: Family) -> dict[str, torch.Tensor]:
    """Llama-named tensors as `family` saves them: the parts of a fused tensor put back in its rows."""
    out: dict[str, torch.Tensor] = {}
    fused: dict[str, list[tuple[list[tuple[int, int]], torch.Tensor]]] = {}
    for key, t in tensors.items():
        name, ranges = family.fused_key(key, cfg)
        if ranges is None:
            out[name] = t
        else:
            fused.setdefault(name, []).append((ranges, t))
    for name, parts in fused.items():
        rows = max(b for ranges, _ in parts for _, b in ranges)
        whole = parts[0][1].new_empty(rows, *parts[0][1].shape[1:])
        for ranges, t in parts:
            at = 0
            for a, b in ranges:
                whole[a:b] = t[at:at + b - a]
                at += b - a
        out[name] = whole
    return out


def every_layer_window(get: Reader) -> int:
    """sliding_window on every layer when set (Mistral, Mixtral, Phi-3), else 0."""
    window = get.raw("sliding_window")
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        return 0  # null: no window (a value of another type is left to the planner's guess)
    return window


def hf_rope(cfg: ModelConfig) -> dict[str, Any]:
    """transformers 5's rope_parameters of `cfg`."""
    rope: dict[str, Any] = {"rope_type": "default" if cfg.rope_scaling == "none" else cfg.rope_scaling,
                            "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling != "none":
        rope["factor"] = cfg.rope_factor
    if cfg.rope_scaling == "llama3":
        rope.update(low_freq_factor=cfg.rope_low_freq_factor, high_freq_factor=cfg.rope_high_freq_factor,
                    original_max_position_embeddings=cfg.rope_original_max_seq_len)
    if cfg.rope_scaling == "yarn":
        rope.update(original_max_position_embeddings=cfg.rope_original_max_seq_len, truncate=cfg.rope_truncate,
                    **{theirs: getattr(cfg, ours) for theirs, (ours, _) in YARN_KEYS.items()
                       if getattr(cfg, ours) or theirs.startswith("beta")})
    return rope


def rope_fields(get: Reader, refuse: Refuse, max_len: int, partial: bool = False) -> dict[str, Any]:
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
    # the base and the share of each head that turns: in the rotary parameters, or beside them (GPT-NeoX's
    # older names: rotary_emb_base, rotary_pct); a refusal of one in the parameters says which it is
    theta, at = _first_given((key, params.get("rope_theta")), ("rope_theta", get.raw("rope_theta")),
                             ("rotary_emb_base", get.raw("rotary_emb_base")))
    said = f"has rope_theta={short(theta)}, which " if at == key else ""
    out: dict[str, Any] = dict(rope_theta=10000.0)  # (none given, or a refused one where the read is loose)
    if at is not None and not positive(theta):
        refuse(at, f"{said}should be a positive number, the rotary base")
    elif at is not None:
        out["rope_theta"] = float(theta)
    share, at = _first_given((key, params.get("partial_rotary_factor")),
                             ("partial_rotary_factor", get.raw("partial_rotary_factor")),
                             ("rotary_pct", get.raw("rotary_pct")))
    said = f"has partial_rotary_factor={short(share)}, which " if at == key else ""
    if partial and share is not None:
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1:
            refuse(at, f"{said}should be a number in (0, 1], the share of each head that turns")
        else:
            out["rotary_fraction"] = float(share)
    elif share not in (None, 1, 1.0):
        refuse(at, f"{said}rotates part of each head; scaletrain's import of this family rotates all of it")
    if not isinstance(kind, str) or kind not in ROPE_KEYS:
        refuse(key, f"has rope_type {kind!r}; scaletrain implements default, linear, llama3 and yarn")
        return out
    extra = sorted(set(params) - ROPE_KEYS[kind] - {"partial_rotary_factor"})
    if extra:
        refuse(key, f"has {', '.join(extra)}, unknown to rope_type {kind}; scaletrain may not compute it alike")
    numbers = {"default": (), "linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
               "yarn": ("factor",)}
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
    if kind == "yarn":
        out.update(_yarn_fields(params, refuse, key, max_len))
    return out


def positive(value: Any) -> bool:
    """Whether a config.json value is a positive number (true and false are not numbers here)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def _first_given(*candidates: tuple[str, Any]) -> tuple[Any, str | None]:
    """The first (value, its key) of the (key, value) `candidates` whose value is not None, or (None, None)."""
    return next(((value, key) for key, value in candidates if value is not None), (None, None))


def _yarn_fields(params: dict, refuse: Refuse, key: str, max_len: int) -> dict[str, Any]:
    """rope_type yarn's keys as ours (transformers' defaults where left out)."""
    out: dict[str, Any] = {"rope_original_max_seq_len": params.get("original_max_position_embeddings", max_len)}
    if not isinstance(params.get("truncate", True), bool):
        refuse(key, "needs true or false for truncate in rope_type yarn")
    out["rope_truncate"] = params.get("truncate", True)  # false (gpt-oss): the ramp between fractional pairs
    for theirs, (ours, default) in YARN_KEYS.items():
        value = params.get(theirs)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0):
            refuse(key, f"needs a non-negative number {theirs} for rope_type yarn")
        out[ours] = float(value or default)
    return out


# the fields model.from_hf leaves to the user: where the shape and weights come from, what training adds
# (multi-token prediction is asked for, never implied: deepseek_v3's docstring) and dropout and init
LEFT_TO_THE_USER = ("preset", "from_hf", "init_from", "mtp_depth", "mtp_loss_weight", "dropout", "init_std")


def complete(out: dict[str, Any]) -> dict[str, Any]:
    """Every field model.from_hf sets: `out`'s, and ModelConfig's default for each field `out`
    leaves out (so nothing of a preset leaks in), bar those LEFT_TO_THE_USER."""
    return {**{f.name: f.default for f in dataclasses.fields(ModelConfig) if f.name not in LEFT_TO_THE_USER}, **out}


class Reader:
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
            raise ConfigError(f"{self.where}: {key} should be an integer, got {short(v)}")
        return v

    def float(self, key: str) -> float:
        v = self._get(key, False)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ConfigError(f"{self.where}: {key} should be a number, got {short(v)}")
        return float(v)

    def bool(self, key: str) -> bool:
        v = self._get(key, False)
        if not isinstance(v, bool):
            raise ConfigError(f"{self.where}: {key} should be true or false, got {short(v)}")
        return v


def short(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
