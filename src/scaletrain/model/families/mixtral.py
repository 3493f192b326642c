"""Mixtral: a Mistral whose every MLP is a mixture of experts (scaletrain.model.families._moe)
that always rescales the chosen experts' weights to sum to one. Its files name each expert's
matrices `block_sparse_moe.experts.E.w1` (w1, w2, w3 as ours) and the router
`block_sparse_moe.gate`."""

from __future__ import annotations

from typing import Any

from scaletrain.model.config import ModelConfig
from scaletrain.model.families._common import ROTARY, Reader, Refuse, every_layer_window
from scaletrain.model.families._moe import MoeFamily


class Mixtral(MoeFamily):
    model_type = "mixtral"
    architecture = "MixtralForCausalLM"
    known = ROTARY | {"sliding_window", "num_local_experts", "num_experts", "num_experts_per_tok",
                      "router_jitter_noise"}
    defaults = dict(num_key_value_heads=8, head_dim=None, hidden_act="silu", max_position_embeddings=131072,
                    rms_norm_eps=1e-5, tie_word_embeddings=False, sliding_window=None, rope_theta=1e6,
                    num_local_experts=8, num_experts_per_tok=2, router_jitter_noise=0.0)
    expert_style = "block_sparse_moe"

    def renorm(self, get: Reader) -> bool:
        return True

    def router_checks(self, get: Reader, refuse: Refuse) -> None:
        if get.float("router_jitter_noise"):
            refuse("router_jitter_noise", "scales the router's input by random noise in training; scaletrain's "
                                          "router has no jitter: set it to 0")

    def window(self, get: Reader, n_layers: int, refuse: Refuse) -> int:
        return every_layer_window(get)

    def hf_extra(self, cfg: ModelConfig, out: dict[str, Any]) -> None:
        super().hf_extra(cfg, out)
        out.update(intermediate_size=cfg.expert_hidden)  # every block a mixture: the experts' width
        out.update(sliding_window=cfg.sliding_window or None)
        out.update(num_local_experts=cfg.moe_experts, router_jitter_noise=0.0)


FAMILY = Mixtral()
