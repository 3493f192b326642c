"""GPT-NeoX / Pythia: rope with LayerNorm, biases on every linear layer and norm, a GELU MLP, a
share of each head rotated (rotary_pct), attention and MLP side by side (use_parallel_residual)
or in turn. Its checkpoints fuse q, k and v per head in `query_key_value`: the rows of head h are
[q_h; k_h; v_h] (it views the output as (heads, 3 * head_size) and chunks each), so q is every
head's first head_size rows. The head is `embed_out` (Pythia's name, which transformers keeps on disk)."""

from __future__ import annotations

from typing import Any

from scaletrain.model.config import ModelConfig
from scaletrain.model.families._common import (
    GELU_TANH,
    LLAMA_KEY,
    ROTARY,
    Family,
    Reader,
    Refuse,
    complete,
    rope_fields,
)

# Llama's names -> GPT-NeoX's, inside a block and outside
_BLOCK = {"input_layernorm": "input_layernorm", "post_attention_layernorm": "post_attention_layernorm",
          "self_attn.o_proj": "attention.dense", "mlp.gate_proj": "mlp.dense_h_to_4h",
          "mlp.down_proj": "mlp.dense_4h_to_h"}
# (the head: transformers saves it as embed_out, Pythia's name, and so does the export; a checkpoint
# naming it lm_head, as transformers 5 does in memory, is read too: FamilyView keeps a name no part claims)
_TOP = {"model.embed_tokens.": "gpt_neox.embed_in.", "model.norm.": "gpt_neox.final_layer_norm.",
        "lm_head.": "embed_out."}


class GPTNeoX(Family):
    model_type = "gpt_neox"
    architecture = "GPTNeoXForCausalLM"
    known = ROTARY - {"rms_norm_eps", "num_key_value_heads", "head_dim"} | {
        "layer_norm_eps", "rotary_pct", "rotary_emb_base", "use_parallel_residual", "attention_bias",
        "hidden_dropout", "classifier_dropout", "is_decoder"}
    defaults = dict(hidden_act="gelu", max_position_embeddings=2048, layer_norm_eps=1e-5, tie_word_embeddings=False,
                    use_parallel_residual=True, attention_bias=True, rotary_pct=0.25, rotary_emb_base=10000)
    fused = True

    def fields(self, get: Reader, refuse: Refuse, strict: bool) -> dict[str, Any]:
        dim, act = get.int("hidden_size"), get.raw("hidden_act")
        if act not in ("gelu",) + GELU_TANH:
            refuse("hidden_act",
                   f"is not supported; scaletrain's GPT-NeoX MLP computes gelu or {', '.join(GELU_TANH)}")
        if not get.raw("attention_bias"):
            refuse("attention_bias", "leaves attention without biases while GPT-NeoX's MLP keeps its own; "
                                     "scaletrain has biases on every linear layer or none")
        max_len = get.int("max_position_embeddings")
        out = dict(
            vocab_size=get.int("vocab_size"), dim=dim, n_layers=get.int("num_hidden_layers"),
            n_heads=get.int("num_attention_heads"), ffn_dim=get.int("intermediate_size"), norm="layernorm",
            norm_eps=get.float("layer_norm_eps"), activation="gelu_exact" if act == "gelu" else "gelu",
            position="rope", max_seq_len=max_len, tie_embeddings=get.bool("tie_word_embeddings"), bias=True,
            parallel_residual=get.bool("use_parallel_residual"))
        out.update(rope_fields(get, refuse, max_len, partial=True))
        return complete(out)

    def to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        out = self.hf_base(cfg)
        rope = {"rope_type": "default", "rope_theta": cfg.rope_theta, "partial_rotary_factor": cfg.rotary_fraction}
        out.update(hidden_size=cfg.dim, num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
                   intermediate_size=cfg.hidden_dim, max_position_embeddings=cfg.max_seq_len,
                   hidden_act="gelu" if cfg.activation == "gelu_exact" else "gelu_new", layer_norm_eps=cfg.norm_eps,
                   use_parallel_residual=cfg.parallel_residual, attention_bias=True, rope_parameters=rope,
                   rotary_pct=cfg.rotary_fraction, rotary_emb_base=cfg.rope_theta, attention_dropout=cfg.dropout,
                   hidden_dropout=cfg.dropout)
        return out

    def chosen(self, cfg: ModelConfig, no) -> str:
        """This family, if it computes what `cfg` (rope with layernorm) computes, else `no`'s ConfigError."""
        unlike = [why for why, differs in (
            ("biases on every linear layer and LayerNorm (model.bias=true)", not cfg.bias),
            (f"activation gelu or gelu_exact, not {cfg.activation}", cfg.activation not in ("gelu", "gelu_exact")),
            ("one K/V head per query head and head_dim = dim / n_heads",
             cfg.kv_heads != cfg.n_heads or cfg.head_size * cfg.n_heads != cfg.dim),
            ("no q/k norms, q/k/v-only biases, sliding window, experts, embed_scale nor norm_unit_offset",
             cfg.qk_norm or cfg.qkv_bias or cfg.sliding_window or cfg.moe_experts or cfg.embed_scale
             or cfg.norm_unit_offset), ("no rope scaling (model.rope_scaling=none)", cfg.rope_scaling != "none"))
            if differs]
        if unlike:
            raise no(f"rope with layernorm is GPT-NeoX's, which needs {unlike[0]}")
        return self.model_type

    def recognises(self, keys) -> bool:
        return any(k.startswith("gpt_neox.") for k in keys)

    def fused_key(self, key: str, cfg: ModelConfig) -> tuple[str, list[tuple[int, int]] | None]:
        d = cfg.head_size
        m = LLAMA_KEY.match(key)
        if m is None:
            top = next((t for t in _TOP if key.startswith(t)), None)
            return (_TOP[top] + key[len(top):], None) if top else (key, None)
        i, module, leaf = m.groups()
        parts = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
        if module in parts:
            j = parts.index(module)
            return (f"gpt_neox.layers.{i}.attention.query_key_value.{leaf}",
                    [(h * 3 * d + j * d, h * 3 * d + (j + 1) * d) for h in range(cfg.n_heads)])
        return f"gpt_neox.layers.{i}.{_BLOCK.get(module, module)}.{leaf}", None


FAMILY = GPTNeoX()
