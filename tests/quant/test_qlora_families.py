"""QLoRA (adapter.base_dtype=nf4) on the families of issue 52, shaped as their files describe them:
DeepSeek-V3 (latent attention, its compressions and up-projections adapted, the grouped sigmoid router,
shared experts, with multi-token prediction), gpt-oss (attention sinks, biases, the clamped SwiGLU
experts, alternating sliding layers) and Llama 4 text (chunked and no-rope layers, top-1 routing with a
shared expert), Qwen3-Next (Gated DeltaNet's projections, the gated full attention, a gated shared
expert). The adapted bases are NF4; the model computes what the dense model holding the
dequantized bases computes; the adapters alone train and the loss falls."""

from __future__ import annotations

import pytest
import torch

from scaletrain.model.lora import LoRALinear
from scaletrain.train.trainer import Trainer
from test_deepseek_parallel import MLA
from test_qlora import dequantized
from test_qwen3_next_parallel import QWEN3NEXT

from conftest import micro_cfg

SHAPES = {
    # NF4 quantizes blocks of 64 in-features: the latent and value widths are multiples of it
    "deepseek_v3": {**{k: v for k, v in MLA.items() if k.startswith("model.")}, "model.mla_q_rank": 64,
                    "model.mla_kv_rank": 64, "model.mla_v_dim": 16, "model.moe_hidden": 64, "model.mtp_depth": 1},
    "gpt_oss": {"model.position": "rope", "model.norm": "rmsnorm", "model.activation": "swiglu_clamped",
                "model.attn_sinks": True, "model.bias": True, "model.moe_experts": 4, "model.moe_top_k": 2,
                "model.moe_bias": True, "model.moe_renorm": True, "model.sliding_window": 8, "model.global_every": 2,
                "model.tie_embeddings": False},
    "llama4_text": {"model.position": "rope", "model.norm": "rmsnorm", "model.activation": "swiglu",
                    "model.attn_chunk": 8, "model.global_every": 4, "model.nope_every": 4, "model.qk_l2_norm": True,
                    "model.moe_experts": 4, "model.moe_top_k": 1, "model.moe_score": "sigmoid",
                    "model.moe_shared_experts": 1, "model.moe_scale_input": True, "model.n_layers": 4,
                    "model.attn_temperature": 0.1, "model.attn_temperature_floor": 4},
    # Qwen3-Next: linear attention (Gated DeltaNet) beside gated full attention, a gated shared expert
    "qwen3_next": {**QWEN3NEXT, "model.linear_value_dim": 16, "model.moe_hidden": 64, "model.moe_shared_hidden": 64,
                   "model.init_std": 0.02},
}
ADAPTED = {"deepseek_v3": ("attn.wq_a", "attn.wq_b", "attn.wkv_a", "attn.wkv_b", "attn.wo"),
           "gpt_oss": ("attn.wq", "attn.wk", "attn.wv", "attn.wo"),
           "llama4_text": ("attn.wq", "attn.wo", "moe.shared.w1"),
           "qwen3_next": ("attn.in_qkvz", "attn.in_ba", "attn.out", "attn.wq", "attn.wo", "moe.shared.w1")}


@pytest.mark.parametrize("family", SHAPES)
def test_qlora_trains_the_new_families(tmp_path, family):
    def cfg(where, **extra):
        return micro_cfg(where, **{**SHAPES[family], "train.steps": 4, "adapter.kind": "lora",
                                   "optim.warmup_steps": 1, **extra})

    trainer = Trainer(cfg(tmp_path / "nf4", **{"adapter.base_dtype": "nf4"}))
    adapted = [n for n, m in trainer.model.named_modules() if isinstance(m, LoRALinear)]
    for part in ADAPTED[family]:  # the family's own projections are among those adapted
        assert any(part in n for n in adapted), (part, adapted)
    params = dict(trainer.pm.dp.named_params)
    assert all(type(params[f"{n}.weight"]).__name__ == "NF4Tensor" for n in adapted)
    dense = Trainer(cfg(tmp_path / "dense"))  # the same adapters over the dequantized bases
    with torch.no_grad():
        for name in adapted:
            dense.model.get_submodule(name).weight.copy_(dequantized(params[f"{name}.weight"]))
        x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))
        trainer.model.eval(), dense.model.eval()
        assert torch.equal(trainer.model(x), dense.model(x))
        trainer.model.train()
    losses = trainer.fit()["losses"]
    assert losses[-1] < losses[0] - 0.05, losses
    assert sorted(n for n, _ in trainer.pm.optim_params) == sorted(f"{a}.{leaf}" for a in adapted
                                                                for leaf in ("lora_a", "lora_b"))
