"""GPT-2: learned positions, LayerNorm, a tanh-GELU MLP, biases everywhere, a tied head. Its
checkpoints keep q, k and v in one fused `c_attn` and store each linear weight transposed (a
Conv1D's (in, out), ours (out, in)); scaletrain.model.hf splits and turns them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from scaletrain.model.config import ModelConfig
from scaletrain.model.families._common import GELU_TANH, Family, Reader, Refuse, complete

if TYPE_CHECKING:  # reading a config.json does not load torch
    import torch


class GPT2(Family):
    model_type = "gpt2"
    architecture = "GPT2LMHeadModel"
    known = frozenset({"vocab_size", "n_embd", "n_layer", "n_head", "n_positions", "n_ctx", "n_inner",
                       "activation_function", "layer_norm_epsilon", "tie_word_embeddings", "scale_attn_weights",
                       "scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn", "add_cross_attention",
                       "summary_type", "summary_use_proj", "summary_activation", "summary_proj_to_labels",
                       "summary_first_dropout", "is_encoder_decoder", "pruned_heads"})
    defaults = dict(n_positions=1024, n_inner=None, activation_function="gelu_new", layer_norm_epsilon=1e-5,
                    tie_word_embeddings=True, scale_attn_weights=True)
    conv1d = True
    fused_qkv = "attn.c_attn"
    prefix = "transformer."
    layers = "transformer.h"
    # ours -> GPT-2's, inside block i (q, k and v are fused into attn.c_attn) and outside the blocks
    block = {"attn_norm": "ln_1", "attn.wo": "attn.c_proj", "mlp_norm": "ln_2", "mlp.w1": "mlp.c_fc",
             "mlp.w2": "mlp.c_proj"}
    top = {"tok_emb": "transformer.wte", "pos_emb": "transformer.wpe", "norm": "transformer.ln_f",
           "output": "lm_head"}
    adapter_refusal = ("GPT-2 keeps q, k and v in one fused, transposed c_attn, which separate adapters on them "
                       "do not map onto")

    def recognises(self, keys) -> bool:
        return any(k.split(".")[-2] in ("wte", "c_attn") for k in keys)

    def saved(self, tensors: dict[str, torch.Tensor], weights: Mapping[str, torch.Tensor],
              cfg: ModelConfig) -> dict[str, torch.Tensor]:
        """q, k and v fused into each block's c_attn, transposed as Conv1D keeps it, and zero biases
        where ours has none (the same function)."""
        import torch

        out = dict(tensors)
        for i in range(cfg.n_layers):
            p = f"layers.{i}."
            out[f"{self.layers}.{i}.{self.fused_qkv}.weight"] = torch.cat(
                [weights[p + f"attn.{w}.weight"].detach() for w in ("wq", "wk", "wv")], 0).t().contiguous()
            zeros = torch.zeros(cfg.dim, dtype=weights[p + "attn.wq.weight"].dtype)
            out[f"{self.layers}.{i}.{self.fused_qkv}.bias"] = torch.cat(
                [weights.get(p + f"attn.{w}.bias", zeros).detach() for w in ("wq", "wk", "wv")]).contiguous()
            for ours, width in (("attn_norm", cfg.dim), ("attn.wo", cfg.dim), ("mlp_norm", cfg.dim),
                                ("mlp.w1", cfg.hidden_dim), ("mlp.w2", cfg.dim)):
                out.setdefault(f"{self.layers}.{i}.{self.block[ours]}.bias", torch.zeros(width, dtype=zeros.dtype))
        out.setdefault("transformer.ln_f.bias", torch.zeros(cfg.dim, dtype=out["transformer.ln_f.weight"].dtype))
        return out

    def fields(self, get: Reader, refuse: Refuse, strict: bool) -> dict[str, Any]:
        vocab, dim = get.int("vocab_size"), get.int("n_embd")
        if get.raw("activation_function") not in GELU_TANH:
            refuse("activation_function",
                   f"is not supported; scaletrain's GELU is the tanh one ({', '.join(GELU_TANH)})")
        if get.raw("scale_attn_weights") is False:
            refuse("scale_attn_weights", "leaves the scores unscaled; scaletrain divides them by sqrt(head_dim)")
        if get.raw("scale_attn_by_inverse_layer_idx"):
            refuse("scale_attn_by_inverse_layer_idx", "scales each layer's scores differently; scaletrain does not")
        if get.raw("add_cross_attention"):
            refuse("add_cross_attention", "adds cross-attention; scaletrain imports decoder-only language models")
        return complete(dict(
            vocab_size=vocab, dim=dim, n_layers=get.int("n_layer"), n_heads=get.int("n_head"),
            n_kv_heads=0, head_dim=0, ffn_dim=get.int("n_inner", optional=True) or 4 * dim, norm="layernorm",
            norm_eps=get.float("layer_norm_epsilon"), activation="gelu", position="learned",
            max_seq_len=get.int("n_positions"), tie_embeddings=get.bool("tie_word_embeddings"), bias=True))

    def to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        out = self.hf_base(cfg)
        out.update(n_embd=cfg.dim, n_layer=cfg.n_layers, n_head=cfg.n_heads, n_positions=cfg.max_seq_len,
                   n_inner=cfg.hidden_dim, activation_function="gelu_new", layer_norm_epsilon=cfg.norm_eps,
                   attn_pdrop=cfg.dropout, resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout,
                   scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False, reorder_and_upcast_attn=False,
                   add_cross_attention=False)
        return out


FAMILY = GPT2()
