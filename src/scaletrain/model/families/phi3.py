"""Phi-3 and Phi-4: a Llama that may turn only part of each head (partial_rotary_factor), whose
every layer attends within sliding_window (when set), and whose checkpoints fuse q, k and v into
`qkv_proj` ([q; k; v] stacked whole) and the MLP's gate and up projections into `gate_up_proj`
([gate; up]). A model computes the same as a Llama whenever it rotates whole heads, so the export
writes Phi-3 only where model.export_as=phi3 or a partial rotary asks for it."""

from __future__ import annotations

from typing import Any

from scaletrain.model.config import ModelConfig
from scaletrain.model.families._common import LLAMA_KEY, ROTARY, Reader, Refuse, RotaryFamily, every_layer_window


class Phi3(RotaryFamily):
    model_type = "phi3"
    architecture = "Phi3ForCausalLM"
    known = ROTARY | {"original_max_position_embeddings", "sliding_window"}
    defaults = dict(num_key_value_heads=None, head_dim=None, hidden_act="silu", max_position_embeddings=4096,
                    rms_norm_eps=1e-5, tie_word_embeddings=False, sliding_window=None)
    export_as = "phi3"
    partial_rotary = True
    fused = True

    def fields(self, get: Reader, refuse: Refuse, strict: bool) -> dict[str, Any]:
        key = "rope_scaling" if get.raw("rope_scaling") else "rope_parameters"
        params = get.raw(key)
        if isinstance(params, dict) and params.get("rope_type", params.get("type")) == "yarn":
            refuse(key, "has rope_type 'yarn', Phi-3's older name of longrope, which scaletrain lacks")
            return {}
        return super().fields(get, refuse, strict)

    def window(self, get: Reader, n_layers: int, refuse: Refuse) -> int:
        return every_layer_window(get)

    def hf_extra(self, cfg: ModelConfig, out: dict[str, Any]) -> None:
        out["rope_parameters"]["partial_rotary_factor"] = cfg.rotary_fraction
        # (Phi-3's default padding id, 32000, lies outside a smaller vocabulary: transformers warns of it)
        out.update(rope_scaling=None, sliding_window=cfg.sliding_window or None,
                   original_max_position_embeddings=cfg.max_seq_len, pad_token_id=None,
                   resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout)  # (model.dropout's places, as GPT-2's)
        del out["head_dim"]

    def chosen(self, cfg: ModelConfig, no) -> str:
        """This family, if it computes what `cfg` computes (a Llama with its projections fused),
        else `no`'s ConfigError. `cfg` asks for it by model.export_as=phi3 or by a partial rotary
        (norms before the sub-blocks and none of Gemma's or GPT-NeoX's options: _choose sees to both)."""
        unlike = [why for why, differs in (
            ("is rope, rmsnorm, swiglu",
             not (cfg.position == "rope" and cfg.norm == "rmsnorm" and cfg.activation == "swiglu")),
            ("has no biases, q/k norms nor experts", cfg.bias or cfg.qkv_bias or cfg.qk_norm or cfg.moe_experts),
            ("has no head_dim apart from dim / n_heads", cfg.head_size * cfg.n_heads != cfg.dim),
            ("scales rope by longrope only, which scaletrain lacks (model.rope_scaling=none)",
             cfg.rope_scaling != "none")) if differs]
        if unlike and cfg.export_as == self.export_as:
            raise no(f"model.export_as=phi3, but Phi-3 {unlike[0]}")
        if unlike:
            raise no(f"a share of each head rotated (model.rotary_fraction={cfg.rotary_fraction}) is Phi-3's, which "
                     f"{unlike[0]}")
        return self.model_type

    def recognises(self, keys) -> bool:
        return any(k.endswith(("self_attn.qkv_proj.weight", "mlp.gate_up_proj.weight")) for k in keys)

    def fused_key(self, key: str, cfg: ModelConfig) -> tuple[str, list[tuple[int, int]] | None]:
        """q, k and v stacked whole in qkv_proj, the MLP's gate and up in gate_up_proj."""
        m = LLAMA_KEY.match(key)
        if m is None:
            return key, None
        i, module, leaf = m.groups()
        q, kv, f = cfg.n_heads * cfg.head_size, cfg.kv_heads * cfg.head_size, cfg.hidden_dim
        fused = {"self_attn.q_proj": ("self_attn.qkv_proj", (0, q)),
                 "self_attn.k_proj": ("self_attn.qkv_proj", (q, q + kv)),
                 "self_attn.v_proj": ("self_attn.qkv_proj", (q + kv, q + 2 * kv)),
                 "mlp.gate_proj": ("mlp.gate_up_proj", (0, f)), "mlp.up_proj": ("mlp.gate_up_proj", (f, 2 * f))}
        if module in fused:
            name, rows = fused[module]
            return f"model.layers.{i}.{name}.{leaf}", [rows]
        return key, None


FAMILY = Phi3()
