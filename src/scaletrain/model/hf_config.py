"""Hugging Face configs in and out: config.json <-> ModelConfig for the families of
scaletrain.model.families (GPT-2, Llama, Mistral, Qwen2, Qwen3, OLMo 2, GPT-NeoX / Pythia, Phi-3 /
Phi-4, Gemma 2 and Gemma 3 (text), and the mixtures of experts Mixtral, Qwen3-MoE and OLMoE), each
in a file of its own; this module finds the family and hands it the work.

A field that changes what the model computes and that scaletrain does not implement (another
RoPE scaling, a bias on the output projection alone, partial rotary, ...) is refused with one
line naming it, never dropped: a model that loads and silently computes something else is the
failure this module exists to prevent. So is a field we do not know. The weights' names and
layouts: scaletrain.model.hf.

Mixtures of experts (scaletrain.model.families._moe): all three route by a softmax over experts,
keep the top k and run every token (dropless), as ours does with moe_score=softmax and no
capacity. `router_aux_loss_coef` is not carried over: transformers' load-balancing loss pools the
whole batch and all layers into one product, ours (model.moe_aux_loss) is the Switch loss of each
layer and each sequence, so the same coefficient would weigh another quantity; set moe_aux_loss
(or keep the bias) for fine-tuning. DeepSeek-V3 is a family of its own (latent attention,
scaletrain.model.mla); DeepSeek-V2, whose router differs, is refused.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from scaletrain.errors import ConfigError
from scaletrain.model.config import ModelConfig
from scaletrain.model.families import CONFIG_FILE, HARMLESS, Reader, family_of_config, family_of_model, short
from scaletrain.model.families import FAMILIES as _REGISTRY

FAMILIES = tuple(_REGISTRY)  # the model_types scaletrain imports, in the order its messages list them
# mixtures of experts whose attention scaletrain lacks: refused with what to do instead
_MLA = ("deepseek_v2",)

__all__ = ["CONFIG_FILE", "FAMILIES", "hf_config_from_model", "hf_family", "model_config_from_hf", "read_hf_config"]


def read_hf_config(source: str | Path) -> tuple[dict, str]:
    """The parsed config.json of a Hugging Face model folder (or the file itself), and its path."""
    path = Path(source)
    try:
        if path.is_dir():
            path = path / CONFIG_FILE
        found = path.is_file()
    except (OSError, ValueError):  # a name too long for the file system, or with a NUL byte
        found = False
    if not found:
        raise ConfigError(f"{str(path)!r}: not found; give a Hugging Face model folder (holding {CONFIG_FILE}) "
                          f"or a {CONFIG_FILE}")
    try:
        hf = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not valid JSON ({getattr(e, 'msg', e)}); "
                          f"give a Hugging Face {CONFIG_FILE}") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot be read ({e.strerror})") from None
    if not isinstance(hf, dict):
        raise ConfigError(f"{path}: expected a JSON object (a Hugging Face config.json), got {type(hf).__name__}")
    return hf, str(path)


def model_config_from_hf(source: str | Path | Mapping[str, Any], *, strict: bool = True,
                         where: str | None = None) -> dict[str, Any]:
    """The ModelConfig fields (a dict) of a Hugging Face config: a model folder, a config.json
    path, or the parsed dict. Raises ConfigError, one line per problem, for a field scaletrain
    does not implement or does not know (`strict`); the planner passes strict=False to read the
    shape of any decoder and ignore what does not change its size."""
    if isinstance(source, Mapping):
        hf, where = dict(source), where or CONFIG_FILE
    else:
        hf, path = read_hf_config(source)
        where = where or path
    if not isinstance(hf, dict):
        raise ConfigError(f"{where}: expected a JSON object (a Hugging Face config.json), got {type(hf).__name__}")
    kind = hf.get("model_type", "")
    family = family_of_config(hf)
    errors: list[str] = []
    if strict and kind in _MLA:
        raise ConfigError(f"{where}: model_type={kind!r} attends by multi-head latent attention (compressed keys and "
                          "values) with DeepSeek-V2's router (softmax, group-limited by the max), which scaletrain "
                          "does not import; import a DeepSeek-V3 model")
    if strict and kind not in FAMILIES:
        raise ConfigError(f"{where}: model_type={kind!r} is not one scaletrain imports; "
                          f"supported: {', '.join(FAMILIES)}")
    if strict:
        for key in sorted(set(hf) - HARMLESS - family.known):
            errors.append(f"{where}: field {key}={short(hf[key])} is unknown to scaletrain's {family.model_type} "
                          f"import and may change the model; remove it from {CONFIG_FILE} if it does not")
    get = Reader(hf, family.defaults, where)

    def refuse(key: str, why: str) -> None:
        if strict:
            errors.append(f"{where}: {key}={short(hf.get(key, family.defaults.get(key)))} {why}")

    try:
        out = family.fields(get, refuse, strict)
    except KeyError as e:
        raise ConfigError(f"{where}: no {e.args[0]!r}; expected a decoder config with hidden_size, "
                          "num_hidden_layers, num_attention_heads, intermediate_size, vocab_size") from None
    if hf.get("is_encoder_decoder"):
        refuse("is_encoder_decoder", "is not a decoder-only language model, which is what scaletrain imports")
    if hf.get("pruned_heads"):
        refuse("pruned_heads", "removes heads from some layers; scaletrain's layers all have n_heads")
    if errors:
        raise ConfigError(*errors)
    return out


# --------------------------------------------------------------------------------------------
# ModelConfig -> config.json


def hf_family(cfg: ModelConfig) -> str:
    """The Hugging Face model_type that computes what `cfg` computes, or ConfigError."""
    return family_of_model(cfg).model_type


def hf_config_from_model(cfg: ModelConfig, **extra: Any) -> dict[str, Any]:
    """The config.json of `cfg` (`extra` adds keys such as bos_token_id / eos_token_id)."""
    return {**family_of_model(cfg).to_hf(cfg), **extra}
