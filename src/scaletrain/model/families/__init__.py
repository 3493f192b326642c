"""The Hugging Face families scaletrain reads and writes, one file each, in one table keyed by
config.json's `model_type`. A family file holds what differs in that family: its config keys and
their defaults, its reader (config.json -> ModelConfig fields), its writer (ModelConfig ->
config.json), its weight names and its fused tensors; `_common` holds what the Llama-likes share,
`_moe` what the mixtures of experts share, `_choose` which family computes a given model. Adding a
family that scaletrain reads and writes is a file and a line in FAMILIES; for the export to pick it
for a model no other family computes, `_choose` says where it stands among them.

scaletrain.model.hf_config and scaletrain.model.hf are the callers: they ask the family and never
name one."""

from __future__ import annotations

from types import MappingProxyType

from scaletrain.model.config import ModelConfig
from scaletrain.model.families import (
    deepseek_v3,
    gemma2,
    gemma3_text,
    gpt2,
    gpt_neox,
    gpt_oss,
    llama,
    llama4_text,
    mistral,
    mixtral,
    olmo2,
    olmoe,
    phi3,
    qwen2,
    qwen3,
    qwen3_moe,
    qwen3_next,
)
from scaletrain.model.families._choose import choose
from scaletrain.model.families._common import CONFIG_FILE, HARMLESS, Family, Reader, short

FAMILIES = MappingProxyType({f.model_type: f for f in (
    gpt2.FAMILY, llama.FAMILY, mistral.FAMILY, qwen2.FAMILY, qwen3.FAMILY, olmo2.FAMILY, gpt_neox.FAMILY,
    phi3.FAMILY, gemma2.FAMILY, gemma3_text.FAMILY, mixtral.FAMILY, qwen3_moe.FAMILY, olmoe.FAMILY,
    deepseek_v3.FAMILY, gpt_oss.FAMILY, llama4_text.FAMILY, qwen3_next.FAMILY)})

__all__ = ["CONFIG_FILE", "FAMILIES", "HARMLESS", "Family", "Reader", "family_of_config", "family_of_model",
           "layout_of", "naming", "short"]


def family_of_config(hf: dict) -> Family:
    """The family that reads a config.json: its model_type's, else (a decoder of another type, read
    for its shape only) GPT-2's where its keys are GPT-2's, Llama's otherwise."""
    kind = hf.get("model_type", "")
    if kind in FAMILIES:
        return FAMILIES[kind]
    return gpt2.FAMILY if "n_embd" in hf else llama.FAMILY


def family_of_model(cfg: ModelConfig) -> Family:
    """The family that computes what `cfg` computes (ConfigError says why none does)."""
    return FAMILIES[choose(cfg)]


def layout_of(keys) -> Family | None:
    """The family whose own layout a checkpoint's tensor names are (GPT-2's, or a fused one), or
    None for Llama's names, which every Llama-like shares."""
    return next((f for f in FAMILIES.values() if f.recognises(keys)), None)


def naming(cfg: ModelConfig) -> Family:
    """The Llama-like family whose block names fit where `cfg`'s norms sit (model.norm_placement)
    and its attention (latent, linear or neither)."""
    return next(f for f in FAMILIES.values() if not f.conv1d and f.norm_placement == cfg.norm_placement
                and f.latent_attention == bool(cfg.mla_kv_rank)
                and f.hybrid == bool(cfg.linear_heads or cfg.moe_shared_gate))
