"""Qwen3-Next: a hybrid of Gated DeltaNet linear attention (scaletrain.model.deltanet;
model.linear_*) and gated full attention, every full_attention_interval-th block full (layer_types:
model.full_every). Beside Qwen3-MoE's parts (q/k norms of each head, experts in the blocks
decoder_sparse_step and mlp_only_layers choose, a renormalised softmax router) it has:

* zero-centred RMSNorms everywhere but inside linear attention: the scale is (1 + weight)
  (model.norm_unit_offset), the q/k norms too;
* the full attention's output gate: q_proj is twice as wide, each head's rows [query | gate]
  (model.attn_gate), and a partial rotary (partial_rotary_factor, 0.25 by default);
* one shared expert of its own width (shared_expert_intermediate_size: model.moe_shared_hidden)
  behind a sigmoid gate (shared_expert_gate: model.moe_shared_gate).

Its checkpoints keep the linear attention's projections grouped by key head, as ours; only the
convolution differs: Hugging Face's conv1d channels are [all q | all k | all v], ours grouped by
key head (so that tensor parallelism's share of the rows is whole heads). `fused_key` says which
of its rows make ours, both ways. The multi-token prediction weights (mtp.*) are left out on
import, as transformers does."""

from __future__ import annotations

from typing import Any

from scaletrain.model.config import ModelConfig
from scaletrain.model.families._common import LLAMA_BLOCK, ROTARY, Reader, Refuse, short
from scaletrain.model.families.qwen3_moe import Qwen3Moe

BLOCK = {**LLAMA_BLOCK, "attn.in_qkvz": "linear_attn.in_proj_qkvz", "attn.in_ba": "linear_attn.in_proj_ba",
         "attn.conv": "linear_attn.conv1d.weight", "attn.A_log": "linear_attn.A_log",
         "attn.dt_bias": "linear_attn.dt_bias", "attn.z_norm": "linear_attn.norm", "attn.out": "linear_attn.out_proj",
         "moe.shared_gate": "mlp.shared_expert_gate"}
LINEAR = {"linear_num_key_heads": "linear_heads", "linear_num_value_heads": "linear_value_heads",
          "linear_key_head_dim": "linear_head_dim", "linear_value_head_dim": "linear_value_dim",
          "linear_conv_kernel_dim": "linear_conv"}


class Qwen3Next(Qwen3Moe):
    model_type = "qwen3_next"
    architecture = "Qwen3NextForCausalLM"
    known = ROTARY | {"attention_bias", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                      "shared_expert_intermediate_size", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers",
                      "layer_types", "full_attention_interval", *LINEAR}
    defaults = dict(num_key_value_heads=2, head_dim=256, hidden_act="silu", max_position_embeddings=32768,
                    rms_norm_eps=1e-6, tie_word_embeddings=False, partial_rotary_factor=0.25, attention_bias=False,
                    num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512,
                    shared_expert_intermediate_size=512, norm_topk_prob=True, decoder_sparse_step=1,
                    mlp_only_layers=None, layer_types=None, full_attention_interval=4, linear_conv_kernel_dim=4,
                    linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
                    linear_num_value_heads=32)
    block = BLOCK
    partial_rotary = True
    hybrid = True

    def window(self, get: Reader, n_layers: int, refuse: Refuse) -> int:
        return 0  # (no sliding window: layer_types names linear and full blocks)

    def fields(self, get: Reader, refuse: Refuse, strict: bool) -> dict[str, Any]:
        out = super().fields(get, refuse, strict)
        out.update(norm_unit_offset=True, attn_gate=True)
        every = self._full_every(get, refuse, out["n_layers"])
        if every > 1:  # (1: every block full attention, no linear keys matter)
            heads = get.int("linear_num_key_heads")
            out.update({ours: get.int(theirs) for theirs, ours in LINEAR.items()}, full_every=every)
            if heads < 1 or out["linear_value_heads"] % heads:
                refuse("linear_num_value_heads", f"must be a multiple of linear_num_key_heads={heads}")
        if out.get("moe_experts"):
            out.update(moe_shared_experts=1, moe_shared_gate=True,
                       moe_shared_hidden=get.int("shared_expert_intermediate_size"))
        return out

    def _full_every(self, get: Reader, refuse: Refuse, n_layers: int) -> int:
        """model.full_every of layer_types (or full_attention_interval, transformers' default)."""
        types = get.raw("layer_types")
        if types is None:
            return get.int("full_attention_interval")
        kinds = {"linear_attention", "full_attention"}
        if not isinstance(types, list) or len(types) != n_layers or not set(types) <= kinds:
            refuse("layer_types", f"should list linear_attention or full_attention for each of the {n_layers} "
                                  f"layers, got {short(types)}")
            return n_layers + 1
        every = types.index("full_attention") + 1 if "full_attention" in types else n_layers + 1
        if types != ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n_layers)]:
            refuse("layer_types", f"puts its full-attention layers where model.full_every (every n-th block full) "
                                  f"cannot: {short(types)}")
        return every

    def hf_extra(self, cfg: ModelConfig, out: dict[str, Any]) -> None:
        super().hf_extra(cfg, out)
        for key in ("use_sliding_window", "sliding_window"):
            del out[key]
        out["rope_parameters"]["partial_rotary_factor"] = cfg.rotary_fraction
        out.update({theirs: getattr(cfg, ours) for theirs, ours in LINEAR.items()},
                   partial_rotary_factor=cfg.rotary_fraction, linear_num_value_heads=cfg.linear_v_heads,
                   linear_value_head_dim=cfg.linear_v_dim,
                   layer_types=["linear_attention" if cfg.is_linear_block(i) else "full_attention"
                                for i in range(cfg.n_layers)],
                   shared_expert_intermediate_size=cfg.shared_hidden if cfg.moe_experts else 0)
        if not cfg.linear_heads:  # (transformers builds no linear block: any shape will do)
            out.update(linear_num_key_heads=1, linear_num_value_heads=1)

    def chosen(self, cfg: ModelConfig, no) -> str:
        """This family, if it computes what `cfg` (with linear attention or the gated full attention) computes."""
        unlike = [why for why, differs in (
            ("is rope, zero-centred rmsnorm (model.norm_unit_offset), swiglu with norms before the sub-blocks",
             not (cfg.position == "rope" and cfg.norm == "rmsnorm" and cfg.norm_unit_offset
                  and cfg.activation == "swiglu" and cfg.norm_placement == "pre")),
            ("gates its full attention's output (model.attn_gate) and has q/k norms of each head",
             not cfg.attn_gate or not cfg.qk_norm or cfg.qk_norm_scope != "head"),
            ("has no biases, window, soft caps, sinks nor Gemma's options",
             cfg.bias or cfg.qkv_bias or cfg.sliding_window or cfg.attn_softcap or cfg.logit_softcap
             or cfg.attn_scale_dim or cfg.global_every or cfg.embed_scale or cfg.parallel_residual),
            ("routes by a softmax to experts with one gated shared expert (model.moe_shared_experts=1, "
             "moe_shared_gate), dropless, no routed scale",
             cfg.moe_experts and (cfg.moe_score != "softmax" or cfg.moe_shared_experts != 1 or not cfg.moe_shared_gate
                                  or cfg.moe_route_scale != 1.0 or cfg.moe_capacity_factor))) if differs]
        if unlike:
            raise no(f"linear attention and the gated full attention are Qwen3-Next's, which {unlike[0]}")
        return self.model_type

    # weights ------------------------------------------------------------------------------------

    fused = True  # its convolution's rows reordered (fused_key)

    def recognises(self, keys) -> bool:
        return any(".linear_attn." in k for k in keys)

    def beside_the_model(self, key: str, cfg: ModelConfig) -> bool:
        # the multi-token prediction module, which transformers leaves out
        return key.startswith(("mtp.", "model.mtp."))

    def fused_key(self, key: str, cfg: ModelConfig) -> tuple[str, list[tuple[int, int]] | None]:
        """Our convolution's rows (grouped by key head: q, k, then its value heads') in
        Hugging Face's [all q | all k | all v]."""
        if not key.endswith(".linear_attn.conv1d.weight"):
            return key, None
        hk, dk, width = cfg.linear_heads, cfg.linear_head_dim, cfg.linear_v_dim * cfg.linear_v_heads // cfg.linear_heads
        ranges = []
        for h in range(hk):
            ranges += [(h * dk, (h + 1) * dk), ((hk + h) * dk, (hk + h + 1) * dk),
                       (2 * hk * dk + h * width, 2 * hk * dk + (h + 1) * width)]
        return key, ranges


FAMILY = Qwen3Next()
