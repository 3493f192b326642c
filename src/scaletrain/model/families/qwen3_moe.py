"""Qwen3-MoE: Qwen3 (q/k norms of each head) whose MLPs are mixtures of experts
(scaletrain.model.families._moe) of their own width (moe_intermediate_size), in the blocks that
decoder_sparse_step and mlp_only_layers choose; the rest are dense. A sliding window, with
use_sliding_window, covers every layer."""

from __future__ import annotations

from typing import Any

from scaletrain.errors import ConfigError
from scaletrain.model.config import ModelConfig
from scaletrain.model.families._common import ROTARY, WINDOWED, Reader, Refuse, every_layer_window, short
from scaletrain.model.families._moe import MoeFamily


class Qwen3Moe(MoeFamily):
    model_type = "qwen3_moe"
    architecture = "Qwen3MoeForCausalLM"
    known = ROTARY | WINDOWED | {"attention_bias", "num_experts", "num_local_experts", "num_experts_per_tok",
                                 "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers"}
    defaults = dict(num_key_value_heads=4, head_dim=None, hidden_act="silu", max_position_embeddings=32768,
                    rms_norm_eps=1e-6, tie_word_embeddings=False, use_sliding_window=False, sliding_window=4096,
                    num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=False,
                    decoder_sparse_step=1, mlp_only_layers=None)
    qk_norm = True
    output_bias_refused = True

    def window(self, get: Reader, n_layers: int, refuse: Refuse) -> int:
        # every layer, whatever max_window_layers says
        return every_layer_window(get) if get.raw("use_sliding_window") else 0

    def moe_blocks(self, get: Reader, refuse: Refuse, out: dict[str, Any], n_layers: int) -> dict[str, Any]:
        out["moe_hidden"] = get.int("moe_intermediate_size")
        step, dense = get.raw("decoder_sparse_step"), get.raw("mlp_only_layers") or []
        if isinstance(step, bool) or not isinstance(step, int) or step < 1:
            raise ConfigError(f"{get.where}: decoder_sparse_step should be a positive integer, got {short(step)}")
        if not isinstance(dense, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in dense):
            raise ConfigError(f"{get.where}: mlp_only_layers should be a list of layer indices, got {short(dense)}")
        # transformers: block i is a mixture of experts when (i + 1) % step == 0 and i is not in mlp_only_layers
        moe = [i for i in range(n_layers) if (i + 1) % step == 0 and i not in dense]
        if not out["moe_experts"] or not moe:
            return {}  # a dense model
        first = moe[0]
        every = moe[1] - moe[0] if len(moe) > 1 else n_layers
        out.update(moe_first_dense=first, moe_every=every)
        ours = [i for i in range(n_layers) if i >= first and (i - first) % every == 0]
        if ours != moe:
            refuse("mlp_only_layers", f"with decoder_sparse_step={step} makes blocks {moe} mixtures of experts, "
                                      "which model.moe_first_dense and moe_every (every n-th block after the first "
                                      "dense ones) cannot express")
        return out

    def hf_extra(self, cfg: ModelConfig, out: dict[str, Any]) -> None:
        super().hf_extra(cfg, out)
        # which blocks hold experts: every one but those listed dense
        out.update(num_experts=cfg.moe_experts, norm_topk_prob=cfg.moe_renorm, moe_intermediate_size=cfg.expert_hidden,
                   decoder_sparse_step=1, mlp_only_layers=[i for i in range(cfg.n_layers) if not cfg.is_moe_block(i)],
                   use_sliding_window=bool(cfg.sliding_window), sliding_window=cfg.sliding_window or None,
                   attention_bias=False)


FAMILY = Qwen3Moe()
