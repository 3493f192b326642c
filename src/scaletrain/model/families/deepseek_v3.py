"""DeepSeek-V3 (and Kimi K2, its shape): multi-head latent attention (scaletrain.model.mla;
model.mla_*), YaRN rotary scaling, and a mixture of experts after the first dense blocks
(first_k_dense_replace) with shared experts, a sigmoid router, group-limited top-k (n_group,
topk_group), the chosen scores rescaled (norm_topk_prob) and multiplied by
routed_scaling_factor, and the auxiliary-loss-free routing bias (e_score_correction_bias: our
expert_bias, which model.moe_bias_rate moves in training; the import keeps the rate at 0 unless
set, so fine-tuning routes as the checkpoint did).

The rotary part is stored interleaved ((x0, x1), (x2, x3) pairs, transformers' rope_interleave,
true by default and in DeepSeek's own code), as ours: no rows are permuted; rope_interleave=false
is refused.

Multi-token prediction (model/mtp.py): DeepSeek's checkpoints store its modules as the layers after
the last (model.layers.{num_hidden_layers + j}: enorm, hnorm, eh_proj, shared_head.norm, a whole
block, and copies of the shared embedding and head, embed_tokens and shared_head.head), which
transformers' DeepseekV3ForCausalLM leaves out when it loads (_keys_to_ignore_on_load_unexpected).
Training them is asked for, never implied: model.from_hf leaves model.mtp_depth at 0 (transformers
writes num_nextn_predict_layers=1 into every config it saves, with no such tensors), and the import
then leaves them out (`beside_the_model`) and the export writes num_nextn_predict_layers=0. With
model.mtp_depth=D the import reads the first D modules (their copies of the embedding and head must
equal the model's, which ours share), refuses a checkpoint without them in one line, and the export
writes them back, bitwise, with num_nextn_predict_layers=D."""

from __future__ import annotations

import re
from typing import Any

from scaletrain.model.config import ModelConfig
from scaletrain.model.families._common import LLAMA_BLOCK, ROTARY, Reader, Refuse
from scaletrain.model.families._moe import MoeFamily

BLOCK = {**LLAMA_BLOCK, "attn.wq_a": "self_attn.q_a_proj", "attn.q_a_norm": "self_attn.q_a_layernorm",
         "attn.wq_b": "self_attn.q_b_proj", "attn.wkv_a": "self_attn.kv_a_proj_with_mqa",
         "attn.kv_a_norm": "self_attn.kv_a_layernorm", "attn.wkv_b": "self_attn.kv_b_proj",
         "moe.shared.w1": "mlp.shared_experts.gate_proj", "moe.shared.w3": "mlp.shared_experts.up_proj",
         "moe.shared.w2": "mlp.shared_experts.down_proj",
         # a multi-token prediction module's own (model/mtp.py), in the layer after the last (its block's as above)
         "enorm": "enorm", "hnorm": "hnorm", "eh_proj": "eh_proj", "head_norm": "shared_head.norm"}
BLOCK_KEY = re.compile(r"^model\.layers\.(\d+)\.")  # any tensor of block i
# what DeepSeek's own config.json says of its router and experts, and the one value transformers computes
ROUTER = {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1}


class DeepseekV3(MoeFamily):
    model_type = "deepseek_v3"
    architecture = "DeepseekV3ForCausalLM"
    known = ROTARY | {"attention_bias", "moe_intermediate_size", "n_shared_experts", "n_routed_experts",
                      "num_local_experts", "routed_scaling_factor", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim",
                      "qk_nope_head_dim", "v_head_dim", "qk_head_dim", "n_group", "topk_group", "num_experts_per_tok",
                      "first_k_dense_replace", "norm_topk_prob", "rope_interleave", "num_nextn_predict_layers",
                      "num_mtp_layers", "pretraining_tp", "aux_loss_alpha", "seq_aux", "ep_size", *ROUTER}
    defaults = dict(num_key_value_heads=None, head_dim=None, hidden_act="silu", max_position_embeddings=4096,
                    rms_norm_eps=1e-6, tie_word_embeddings=False, moe_intermediate_size=2048, n_shared_experts=1,
                    n_routed_experts=256, routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536,
                    qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, n_group=8, topk_group=4,
                    num_experts_per_tok=8, first_k_dense_replace=3, norm_topk_prob=True, rope_interleave=True,
                    attention_bias=False, pretraining_tp=1)
    block = BLOCK
    expert_count_keys = ("n_routed_experts", "num_local_experts")
    latent_attention = True
    routing_bias = "mlp.gate.e_score_correction_bias"

    def fields(self, get: Reader, refuse: Refuse, strict: bool) -> dict[str, Any]:
        out = super().fields(get, refuse, strict)
        heads = out["n_heads"]
        kv_heads = get.raw("num_key_value_heads")
        if kv_heads not in (None, heads):
            refuse("num_key_value_heads", f"differs from num_attention_heads={heads}; latent attention brings "
                                          "up keys and values for every head")
        rope, nope = get.int("qk_rope_head_dim"), get.int("qk_nope_head_dim")
        out.update(n_kv_heads=0, head_dim=nope + rope, mla_rope_dim=rope, mla_kv_rank=get.int("kv_lora_rank"),
                   mla_q_rank=get.int("q_lora_rank", optional=True) or 0, mla_v_dim=get.int("v_head_dim"))
        if get.raw("rope_interleave") is not True:
            refuse("rope_interleave", "pairs the rotated coordinates by halves; scaletrain imports DeepSeek's "
                                      "interleaved pairs (rope_interleave=true) only")
        if get.raw("pretraining_tp") not in (None, 1):
            refuse("pretraining_tp", "splits the projections' matmuls as transformers does not; set it to 1")
        for key, want in ROUTER.items():
            if key in get.hf and get.hf[key] != want:
                refuse(key, f"is not DeepSeek-V3's {want!r}, the only one scaletrain imports")
        return out

    def beside_the_model(self, key: str, cfg: ModelConfig) -> bool:
        # the multi-token prediction modules: the blocks after the last
        m = BLOCK_KEY.match(key)
        return m is not None and int(m.group(1)) >= cfg.n_layers

    def biases(self, out: dict[str, Any], attention_bias: bool, mlp_bias: bool, refuse: Refuse) -> None:
        if attention_bias:
            refuse("attention_bias", "puts biases on q_a_proj, kv_a_proj_with_mqa and o_proj; scaletrain's latent "
                                     "attention has none")

    def moe_fields(self, get: Reader, refuse: Refuse, n_layers: int) -> dict[str, Any]:
        out = super().moe_fields(get, refuse, n_layers)
        first = get.int("first_k_dense_replace")
        if not out or first >= n_layers:
            return {}  # every block dense
        groups, topk_groups = get.int("n_group", optional=True) or 1, get.int("topk_group", optional=True) or 1
        out.update(moe_score="sigmoid", moe_hidden=get.int("moe_intermediate_size"), moe_first_dense=first,
                   moe_shared_experts=get.int("n_shared_experts", optional=True) or 0,
                   moe_route_scale=get.float("routed_scaling_factor"), moe_groups=groups if groups > 1 else 0,
                   moe_topk_groups=topk_groups if groups > 1 else 0)
        if groups > 1 and (out["moe_experts"] % groups or out["moe_experts"] // groups < 2):
            refuse("n_group", f"must cut n_routed_experts={out['moe_experts']} into groups of at least 2 experts")
        return out

    def chosen(self, cfg: ModelConfig, no) -> str:
        """This family, if it computes what `cfg` (with latent attention) computes, else `no`'s ConfigError."""
        unlike = [why for why, differs in (
            ("is rope, rmsnorm, swiglu with norms before the sub-blocks",
             not (cfg.position == "rope" and cfg.norm == "rmsnorm" and cfg.activation == "swiglu"
                  and cfg.norm_placement == "pre")),
            ("has no parallel residual, embed_scale, norm_unit_offset nor soft caps",
             cfg.parallel_residual or cfg.embed_scale or cfg.norm_unit_offset or cfg.logit_softcap),
            ("routes by sigmoid scores (model.moe_score=sigmoid)", cfg.moe_experts and cfg.moe_score != "sigmoid"),
            ("has experts in every block after the first dense ones (model.moe_every=1)", cfg.moe_every != 1),
            ("has no expert capacity (model.moe_capacity_factor): it is dropless", cfg.moe_capacity_factor)) if differs]
        if unlike:
            raise no(f"latent attention (model.mla_kv_rank) is DeepSeek-V3's, which {unlike[0]}")
        return self.model_type

    def hf_extra(self, cfg: ModelConfig, out: dict[str, Any]) -> None:
        super().hf_extra(cfg, out)
        moe = bool(cfg.moe_experts)
        out.update(head_dim=cfg.mla_rope_dim, qk_rope_head_dim=cfg.mla_rope_dim,
                   qk_nope_head_dim=cfg.head_size - cfg.mla_rope_dim, v_head_dim=cfg.value_dim,
                   kv_lora_rank=cfg.mla_kv_rank, q_lora_rank=cfg.mla_q_rank or None, rope_interleave=True,
                   attention_bias=False, num_nextn_predict_layers=cfg.mtp_depth,
                   first_k_dense_replace=cfg.moe_first_dense if moe else cfg.n_layers,
                   n_routed_experts=cfg.moe_experts or 1, moe_intermediate_size=cfg.expert_hidden,
                   n_shared_experts=cfg.moe_shared_experts, routed_scaling_factor=cfg.moe_route_scale,
                   norm_topk_prob=cfg.moe_renorm, n_group=cfg.moe_groups or 1, topk_group=cfg.moe_topk_groups or 1)
        if not moe:
            out["num_experts_per_tok"] = 1


FAMILY = DeepseekV3()
