"""Adapters after training: with their base, merged into it, or as a PEFT adapter folder.

An adapter checkpoint (adapter.kind = lora | dora) holds the adapters alone; its trainer.json
names the base they were trained on and its sha256 (scaletrain.parallel.adapters). Everything
that reads a whole model (export, eval, generate, quantize) rebuilds the base from where it came
(model.init_from, or (train.seed, name)), refuses a base whose checksum differs, puts the
adapters on it (`adapted_from_checkpoint`) and merges them (`merge_adapters`): each adapted
linear becomes a plain one whose weight is W + s·B A (DoRA: its rows rescaled to the magnitudes),
so what follows is the code path of a whole model.

`export_peft` writes what Hugging Face's PEFT loads onto the base (`PeftModel.from_pretrained`):
adapter_config.json (written by peft's own LoraConfig, so its fields are those of the installed
version) and adapter_model.safetensors under PEFT's names
(`base_model.model.<module>.lora_A.weight`, `lora_B.weight`, `lora_magnitude_vector`). The
module names are the family's (`scaletrain.model.hf.hf_linear`), and because our query and key
rows are in another order than Hugging Face's (the rotary pairing), the rows of lora_B and of
DoRA's magnitude on wq and wk are reordered as the base's rows are: B A's rows follow B's.
`load_peft` reads such a folder (ours, or PEFT's own) back onto a base.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

from scaletrain import atomic
from scaletrain.config import from_dict
from scaletrain.errors import CheckpointError, ConfigError
from scaletrain.model.lora import AdapterSpec, LoRALinear, apply_adapters, is_adapter_param
from scaletrain.model.transformer import Transformer

PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"
PEFT_PIN = "peft==0.21.2"  # the version the export is tested against
_PREFIX = "base_model.model."  # PeftModel's own prefix before the base model's module names
# adapter_config.json fields that change what the adapters compute beyond one rank and alpha on plain linears
_UNSUPPORTED = ("rank_pattern", "alpha_pattern", "modules_to_save", "layers_to_transform", "layer_replication",
                "target_parameters", "lora_bias", "fan_in_fan_out", "trainable_token_indices")
# the MLP leaves PEFT maps to a mixture of experts' fused parameters (its v4 -> v5 conversion)
_EXPERT_LEAVES = (".gate_proj", ".up_proj", ".down_proj", ".w1", ".w2", ".w3")
_LEAVES = {"lora_a": "lora_A.weight", "lora_b": "lora_B.weight", "lora_magnitude": "lora_magnitude_vector"}


def is_peft_folder(path: str | Path) -> bool:
    return (Path(path) / PEFT_CONFIG).is_file()


def base_model(cfg, source: str | None, seed: int) -> Transformer:
    """The frozen base as training built it, in fp32 on the CPU: `source`'s weights (a Hugging
    Face folder, a .safetensors file or a scaletrain export), or (seed, name) when None."""
    from scaletrain.model.hf import load_hf_weights
    from scaletrain.parallel.init import init_weights, load_weights

    model = Transformer(cfg)
    model.init_buffers("cpu")
    if source:
        load_weights(model, load_hf_weights(source, cfg), source)  # routing biases too (DeepSeek-V3)
    else:
        init_weights(model, seed)
    return model


def _base_of(path: Path, state: dict, cfg, base: str | Path | None) -> str | None:
    """Where the checkpoint's base is: `base` (--base), else where training read it; checked
    against the fingerprint the checkpoint saved."""
    from scaletrain.parallel.adapters import base_fingerprint

    saved = state["adapter"]["base"]
    if not cfg.model.init_from:
        if "given to the Trainer" in saved["name"]:
            raise CheckpointError(f"{path} holds adapters of {saved['name']}, a module of your own: build it, "
                                  "load the checkpoint into it and merge there (scaletrain.model.lora.LoRALinear."
                                  "merged_weight)")
        if base is not None:
            raise CheckpointError(f"--base {base}: the adapters of {path} were trained on a base {saved['name']} "
                                  "(rebuilt from the run's config); drop --base")
        source = None
    else:
        source = str(base) if base is not None else saved["name"]
        if not Path(source).exists():
            raise CheckpointError(f"the base of {path}'s adapters, {source}, is not there; give --base FOLDER, "
                                  f"the base they were trained on (sha256 {saved['sha256'][:12]})")
    here = base_fingerprint(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, init_from=source or "")))
    if here["sha256"] != saved["sha256"]:
        raise CheckpointError(f"{path}'s adapters were trained on the base {saved['name']} (sha256 "
                              f"{saved['sha256'][:12]}), but {here['name']} has sha256 {here['sha256'][:12]}; "
                              "give --base FOLDER, the base they were trained on")
    return source


def adapted_from_checkpoint(path: str | Path, base: str | Path | None = None):
    """(model, cfg): adapter checkpoint `path`'s adapters on their base (`base`: where the base
    is now, if it moved), unmerged, fp32 on the CPU."""
    from scaletrain.train import checkpoint as ckpt

    path = Path(path)
    state = ckpt.read_trainer_state(path)
    cfg = from_dict(state["config"])
    source = _base_of(path, state, cfg, base)
    model = base_model(cfg.model, source, cfg.train.seed)
    apply_adapters(model, AdapterSpec.of(cfg.adapter))
    with torch.no_grad():
        ckpt.load_tensors(path, {"model": {n: p for n, p in model.named_parameters() if is_adapter_param(n)}})
    return model, cfg


@torch.no_grad()
def merge_adapters(model: nn.Module) -> nn.Module:
    """Each LoRALinear of `model` replaced (in place) by a plain nn.Linear that computes what it
    did without dropout; returns `model`. A head tied to the embedding and adapted is refused:
    merged, the two would no longer be one tensor."""
    tied = getattr(getattr(model, "cfg", None), "tie_embeddings", False)
    for name, m in list(model.named_modules()):
        if not isinstance(m, LoRALinear):
            continue
        if tied and name == "output":
            raise CheckpointError("the output head is adapted but shares its weight with the embedding "
                                  "(model.tie_embeddings=true): merged, they would differ; keep the adapters "
                                  "apart (export --format peft)")
        plain = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None, device="meta")  # no init work
        plain.weight = nn.Parameter(m.merged_weight(), requires_grad=False)
        plain.bias = m.bias
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, plain)
    for p in model.parameters():
        p.requires_grad_(True)
    return model


# --------------------------------------------------------------------------------------------
# PEFT folders


def _hf_linears(cfg, names: list[str], where: str) -> dict[str, tuple[str, int]]:
    """Our linear name -> (Hugging Face module name, heads to reorder), or one line why not."""
    from scaletrain.model.hf import hf_linear

    try:
        return {n: hf_linear(n, cfg) for n in names}
    except ConfigError as e:
        raise CheckpointError(f"{where}: its adapters cannot be written as a PEFT folder: {e.lines[0]}; "
                              "export them merged instead (--format hf)") from None


def _import_peft():
    try:
        import peft
    except ImportError:
        raise ConfigError(f"export --format peft needs the peft package: pip install {PEFT_PIN}") from None
    return peft


def export_peft(checkpoint: str | Path, out: str | Path, *, base: str | Path | None = None,
                overwrite: bool = False) -> Path:
    """Write adapter checkpoint `checkpoint` as a PEFT adapter folder `out` (see the module's
    docstring); its base must be a Hugging Face folder (base_model_name_or_path names it)."""
    from safetensors.torch import save_file

    from scaletrain.model.hf import rows_ours_to_hf
    from scaletrain.train import checkpoint as ckpt

    peft = _import_peft()
    path, out = Path(checkpoint), Path(out)
    if out.exists() and not overwrite:
        raise CheckpointError(f"{out} already exists; choose another --out, or add --overwrite to replace it "
                              "(nothing was overwritten)")
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"--out {out} is a file; --format peft writes a folder: choose another --out")
    state = ckpt.read_trainer_state(path)
    adapter = state.get("adapter")
    if not isinstance(adapter, dict):
        raise CheckpointError(f"{path} holds a whole model, not adapters; --format peft writes adapters: "
                              "use --format hf or safetensors")
    def not_hf() -> CheckpointError:
        return CheckpointError(f"{path}: its adapters' base is {adapter['base']['name']}, not a Hugging Face model "
                               "folder, which PEFT loads them onto; train from one (model.init_from), or export "
                               "them merged (--format hf)")

    if not from_dict(state["config"]).model.init_from:
        raise not_hf()
    model, cfg = adapted_from_checkpoint(path, base)  # the base there, and the one they were trained on
    folder = Path(base) if base is not None else Path(adapter["base"]["name"])
    if not (folder / "config.json").is_file():
        raise not_hf()
    adapted = {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}
    names = _hf_linears(cfg.model, list(adapted), str(path))
    mlp = sorted(hf for hf, _ in names.values() if cfg.model.moe_experts and hf.endswith(_EXPERT_LEAVES))
    if mlp:
        raise CheckpointError(f"{path}: {mlp[0]} is adapted, but PEFT reads gate_proj, up_proj and down_proj of a "
                              "mixture of experts as its fused experts' parameters (transformers 5), so it would put "
                              "these adapters there; export them merged (--format hf), or train adapters on the "
                              "attention alone (adapter.targets=attention)")
    tensors = {}
    for name, m in adapted.items():
        hf, heads = names[name]
        for leaf, theirs in _LEAVES.items():
            t = getattr(m, leaf)
            if t is None:
                continue
            t = t.detach().float()
            if heads and leaf != "lora_a":  # the output rows follow the base's q/k rows
                t = rows_ours_to_hf(t, heads, cfg.model.rotary_dim)  # (partial rotary: its turned rows only)
            tensors[f"{_PREFIX}{hf}.{theirs}"] = t.contiguous()
    spec = AdapterSpec.of(cfg.adapter)
    config = peft.LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=spec.dropout,
                             target_modules=_target_modules(cfg.model, [hf for hf, _ in names.values()]),
                             use_rslora=spec.rslora, use_dora=spec.kind == "dora", bias="none",
                             task_type="CAUSAL_LM", base_model_name_or_path=str(folder.resolve()))
    config.inference_mode = True
    meta = {"format": "pt", "scaletrain.base": json.dumps(adapter["base"]),
            "scaletrain.config": json.dumps(state["config"])}
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic.replacing(out, sweep=True) as tmp:
        tmp.mkdir(parents=True)
        config.save_pretrained(str(tmp))
        save_file(tensors, str(tmp / PEFT_WEIGHTS), metadata=meta)
        atomic.usual_mode(tmp)
    return out


def _target_modules(cfg, adapted: list[str]) -> list[str]:
    """PEFT's target_modules: the modules' last names (q_proj, ...) where those choose exactly the
    adapted modules among the model's linears (PEFT matches a name or a `.name` suffix), else the
    full names."""
    from scaletrain.model.hf import hf_linear

    with torch.device("meta"):
        linears = [n for n, m in Transformer(cfg).named_modules() if isinstance(m, nn.Linear)]
    every = []
    for n in linears:
        try:
            every.append(hf_linear(n, cfg)[0])
        except ConfigError:
            continue
    leaves = sorted({a.rsplit(".", 1)[-1] for a in adapted})
    chosen = [h for h in every if h.rsplit(".", 1)[-1] in leaves]
    return leaves if sorted(chosen) == sorted(adapted) else sorted(adapted)


def _peft_config(folder: Path) -> dict:
    f = folder / PEFT_CONFIG
    try:
        config = json.loads(f.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{f}: not a JSON adapter config ({type(e).__name__}); re-export the adapters") from None
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        kind = config.get("peft_type") if isinstance(config, dict) else None
        raise CheckpointError(f"{f}: peft_type {kind!r}; scaletrain reads LORA adapters (LoRA, DoRA) only")
    unsupported = [(k, config.get(k)) for k in _UNSUPPORTED if config.get(k)]
    if config.get("bias", "none") != "none":
        unsupported.append(("bias", config["bias"]))
    if unsupported:
        key, value = unsupported[0]
        raise CheckpointError(f"{f}: {key}={json.dumps(value)} is not supported (scaletrain's adapters have one rank "
                              "and alpha, on plain linears, and train nothing else)")
    for key, kind in (("r", int), ("lora_alpha", (int, float))):
        if not isinstance(config.get(key), kind) or isinstance(config.get(key), bool) or config[key] <= 0:
            raise CheckpointError(f"{f}: {key}={json.dumps(config.get(key))} must be a positive number")
    return config


def peft_base(folder: str | Path, base: str | Path | None) -> Path:
    """The base a PEFT folder goes on: `base` (--base), else its base_model_name_or_path."""
    folder = Path(folder)
    config = _peft_config(folder)
    named = base if base is not None else config.get("base_model_name_or_path")
    if not named:
        raise CheckpointError(f"{folder / PEFT_CONFIG} names no base (base_model_name_or_path); give --base FOLDER, "
                              "the Hugging Face model the adapters were trained on")
    where = "--base" if base is not None else f"{folder / PEFT_CONFIG}'s base_model_name_or_path"
    if not (Path(named) / "config.json").is_file():
        raise CheckpointError(f"{where} {named} is not a Hugging Face model folder (no config.json); give --base "
                              "FOLDER, the model the adapters were trained on")
    return Path(named)


def load_peft(folder: str | Path, base: str | Path | None = None):
    """(model, meta): PEFT adapter folder `folder` on its Hugging Face base (`base`, else the
    folder's base_model_name_or_path), unmerged, fp32 on the CPU; `meta`: what a scaletrain export
    adds (the base's fingerprint "scaletrain.base", the run's config "scaletrain.config"), or {}.
    A base whose checksum differs from the fingerprint is refused."""
    from safetensors import SafetensorError, safe_open

    from scaletrain.model.config import model_config
    from scaletrain.model.hf import _weight_files, hf_linear, rows_hf_to_ours
    from scaletrain.model.hf_config import model_config_from_hf
    from scaletrain.parallel.adapters import base_fingerprint

    folder = Path(folder)
    config = _peft_config(folder)
    base_dir = peft_base(folder, base)
    weights_file = folder / PEFT_WEIGHTS
    try:
        with safe_open(str(weights_file), framework="pt") as sf:
            meta = sf.metadata() or {}
            tensors = {k: sf.get_tensor(k) for k in sf.keys()}
    except (OSError, SafetensorError) as e:
        raise CheckpointError(f"{weights_file}: cannot be read as safetensors ({e}); re-export the adapters") from None
    if "scaletrain.base" in meta:
        saved = json.loads(meta["scaletrain.base"])
        _weight_files(base_dir)  # a folder without weights: one line of its own
        here = base_fingerprint(SimpleNamespace(model=SimpleNamespace(init_from=str(base_dir))))  # files only
        if here["sha256"] != saved["sha256"]:
            raise CheckpointError(f"{folder}'s adapters were trained on the base {saved['name']} (sha256 "
                                  f"{saved['sha256'][:12]}), but {here['name']} has sha256 {here['sha256'][:12]}; "
                                  "give --base FOLDER, the base they were trained on")
    model_cfg = model_config(model_config_from_hf(base_dir))
    model = base_model(model_cfg, str(base_dir), 0)
    with torch.device("meta"):
        linears = [n for n, m in Transformer(model_cfg).named_modules() if isinstance(m, nn.Linear)]
    ours = {}
    for n in linears:
        try:
            hf, heads = hf_linear(n, model_cfg)
        except ConfigError as e:
            raise CheckpointError(f"{folder}: adapters on {base_dir} cannot be read: {e.lines[0]}") from None
        ours[hf] = (n, heads)
    found: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        module, leaf = _split_key(key)
        if module not in ours or leaf is None:
            raise CheckpointError(f"{weights_file}: tensor {key} is no LoRA weight of a linear of {base_dir}")
        found.setdefault(ours[module][0], {})[leaf] = t
    if not found:
        raise CheckpointError(f"{weights_file}: no LoRA weights in it")
    dora = bool(config.get("use_dora"))
    spec = AdapterSpec("dora" if dora else "lora", int(config["r"]), float(config["lora_alpha"]),
                       targets=",".join(n for n in linears if n in found), rslora=bool(config.get("use_rslora")))
    apply_adapters(model, spec)
    heads_of = dict(ours.values())
    with torch.no_grad():
        for name, leaves in found.items():
            m = model.get_submodule(name)
            for leaf in ("lora_a", "lora_b", "lora_magnitude") if dora else ("lora_a", "lora_b"):
                p = getattr(m, leaf)
                if leaf not in leaves or tuple(leaves[leaf].shape) != tuple(p.shape):
                    got = tuple(leaves[leaf].shape) if leaf in leaves else "missing"
                    raise CheckpointError(f"{weights_file}: {name}'s {_LEAVES[leaf]} is {got}, the base and r="
                                          f"{spec.rank} want {tuple(p.shape)}")
                t = leaves[leaf].float()
                if heads_of[name] and leaf != "lora_a":
                    t = rows_hf_to_ours(t, heads_of[name], model_cfg.rotary_dim)
                p.copy_(t)
    return model, meta


def _split_key(key: str) -> tuple[str, str | None]:
    """`base_model.model.<module>.lora_A.weight` -> (<module>, "lora_a"); PEFT may keep the
    adapter's name (`lora_A.default.weight`) in files it did not save itself."""
    body = key.removeprefix(_PREFIX)
    for ours, theirs in _LEAVES.items():
        for form in (theirs, theirs.replace(".weight", ".default.weight"), theirs + ".weight"):
            if body.endswith("." + form):
                return body[:-len(form) - 1], ours
    return body, None


def adapted_model(source: str | Path, base: str | Path | None = None):
    """(merged plain model, cfg or None) of an adapter checkpoint or a PEFT folder."""
    if is_peft_folder(source):
        model, meta = load_peft(source, base)
        cfg = from_dict(json.loads(meta["scaletrain.config"])) if "scaletrain.config" in meta else None
        return merge_adapters(model), cfg
    model, cfg = adapted_from_checkpoint(source, base)
    return merge_adapters(model), cfg
