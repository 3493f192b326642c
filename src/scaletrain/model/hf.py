"""Hugging Face in and out: the weights of GPT-2, Llama, Mistral, Qwen2, Qwen3, OLMo 2, GPT-NeoX,
Phi-3, Gemma 2 and 3 and the mixtures of experts Mixtral, Qwen3-MoE, OLMoE, DeepSeek-V3, gpt-oss and Llama 4
(their configs: scaletrain.model.hf_config; GPT-NeoX's and Phi-3's fused tensors: scaletrain.model.hf_fused;
gpt-oss's packed experts: scaletrain.model.hf_packed). What differs per family (its tensor names, its fused
tensors) is in its file under scaletrain.model.families; this module does the converting that is alike for all
of them.

Three things differ between a Hugging Face checkpoint and ours; each is converted here, both ways:

* config.json fields <-> ModelConfig fields (`model_config_from_hf`, `hf_config_from_model`).
  A field that changes what the model computes and that scaletrain does not implement (another
  RoPE scaling, a bias on the output projection alone, partial rotary, ...) is refused with one
  line naming it, never dropped: a model that loads and silently computes something else is the
  failure this module exists to prevent. So is a field we do not know.
* tensor names: `model.layers.3.self_attn.q_proj.weight` <-> `layers.3.attn.wq.weight`. GPT-2
  keeps q, k and v in one fused `c_attn` and stores its linear layers transposed (its Conv1D
  weight is (in, out), ours (out, in)).
* the rows of the query and key projections. Both rotate pairs of each head's coordinates by the
  same angles but pair them differently: Hugging Face (`rotate_half`) pairs (x[i], x[i + d/2]),
  we pair (x[2i], x[2i+1]) (see `apply_rope`). Reordering each head's rows of wq and wk (and of
  their biases and of the Qwen3 q/k norm weights) maps one onto the other; the scores q.k do not
  change because q and k are reordered alike, and v and wo are untouched. Without it a model
  loads without complaint and computes nonsense.
* experts. Ours are stacked, one (experts, out, in) tensor per matrix (`layers.1.moe.w1`); the
  files hold one matrix per expert: Mixtral's `block_sparse_moe.experts.3.w1.weight`, Qwen3-MoE's
  and OLMoE's `mlp.experts.3.gate_proj.weight`, as transformers 5 still saves them. Its modules
  keep them fused in memory (`mlp.experts.gate_up_proj` (experts, 2 * hidden, dim), gate rows
  first, and `down_proj` (experts, dim, hidden)); a file of those names is read too. The router is
  the family's `gate`. Each expert is an nn.Linear (out, in) on both sides: nothing is transposed.

Weights come back as fp32 tensors under our canonical names (a tied head appears once, as
`tok_emb.weight`, as `named_parameters` lists it), ready to be distributed like initial values.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from scaletrain.errors import CheckpointError, ConfigError
from scaletrain.model.config import ModelConfig
from scaletrain.model.families import Family, family_of_model, layout_of, naming
from scaletrain.model.hf_config import CONFIG_FILE, model_config_from_hf
from scaletrain.model.hf_fused import FamilyView, Lazy
from scaletrain.model.hf_fused import read_part as _read
from scaletrain.model.hf_fused import shape_of as _shape_of
from scaletrain.model.hf_packed import PackedExperts, pack, packed_key

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


# --------------------------------------------------------------------------------------------
# Tensor names and layouts

# (each family's names, ours -> theirs, are the `block` and `top` of its file in scaletrain.model.families)
_NAME = re.compile(r"^layers\.(\d+)\.(.+)\.(weight|bias)$")
_EXPERTS = re.compile(r"^layers\.(\d+)\.moe\.(w1|w2|w3|b1|b2|b3)$")  # our stacked expert matrices (and biases)
_LEAFLESS = re.compile(r"^layers\.(\d+)\.(.+)$")  # a parameter of a block's module itself (attn.sinks)
# each expert's matrix in a file, by the module that holds the experts: ours -> Mixtral's
# (block_sparse_moe), ours -> Qwen3-MoE's and OLMoE's (mlp)
_EXPERT_LEAF = {"block_sparse_moe": {"w1": "w1", "w2": "w2", "w3": "w3"},
                "mlp": {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}}
# buffers some checkpoints carry that are no weights: GPT-2's causal mask, old Llamas' frequencies
_BUFFERS = re.compile(r"(\.attn\.bias|\.attn\.masked_bias|rotary_emb\.inv_freq)$")
_MTP = re.compile(r"^mtp\.(\d+)\.(block\.)?(.+)$")  # a multi-token prediction module's parameter (model/mtp.py)
# what each prediction module's layer holds besides ours: copies of the shared embedding and head (DeepSeek-V3)
_MTP_SHARED = {"embed_tokens.weight": "tok_emb.weight", "shared_head.head.weight": "output.weight"}


def _as_layer(name: str, cfg: ModelConfig) -> str:
    """Our parameter `name` as the files number it: a multi-token prediction module's (`mtp.0.eh_proj.weight`,
    `mtp.0.block.attn.wo.weight`) as the layer after the last (`layers.{n_layers}.eh_proj.weight`,
    `layers.{n_layers}.attn.wo.weight`); any other as it is."""
    m = _MTP.match(name)
    return name if m is None else f"layers.{cfg.n_layers + int(m.group(1))}.{m.group(3)}"


def _mtp_layers(cfg: ModelConfig, family: Family) -> list[str]:
    """The files' prefixes of the multi-token prediction modules (`model.layers.{n_layers + j}`), refused in
    one line for a family whose checkpoints have no place for them."""
    if cfg.mtp_depth and "eh_proj" not in family.block:
        raise CheckpointError(f"model.mtp_depth={cfg.mtp_depth}: {family.model_type} checkpoints have no place for "
                              "multi-token prediction modules (deepseek_v3's do); export with model.mtp_depth=0 "
                              "to leave them out")
    return [f"{family.layers}.{cfg.n_layers + j}" for j in range(cfg.mtp_depth)]


def rows_hf_to_ours(t: torch.Tensor, heads: int, rotary: int = 0) -> torch.Tensor:
    """Reorder each head's rows (dim 0) from Hugging Face's rotate-half pairing (x[i], x[i+r/2])
    to ours (x[2i], x[2i+1]): ours[2i + c] = hf[c * r/2 + i], over the first `rotary` rows of each
    head (r; 0 = all of them), the rest (partial rotary: never turned) left in place."""
    d = t.shape[0] // heads
    r, rest = rotary or d, t.shape[1:]
    h = t.reshape(heads, d, *rest)
    turned = h[:, :r].reshape(heads, 2, r // 2, *rest).transpose(1, 2).reshape(heads, r, *rest)
    return torch.cat((turned, h[:, r:]), 1).reshape(t.shape)


def rows_ours_to_hf(t: torch.Tensor, heads: int, rotary: int = 0) -> torch.Tensor:
    """The inverse of rows_hf_to_ours."""
    d = t.shape[0] // heads
    r, rest = rotary or d, t.shape[1:]
    h = t.reshape(heads, d, *rest)
    turned = h[:, :r].reshape(heads, r // 2, 2, *rest).transpose(1, 2).reshape(heads, r, *rest)
    return torch.cat((turned, h[:, r:]), 1).reshape(t.shape)


def _rope_heads(name: str, cfg: ModelConfig) -> int:
    """How many heads' rows to reorder in our parameter `name` (0: none)."""
    if cfg.position != "rope" or cfg.mla_kv_rank:  # (latent attention: its rotated rows are stored as ours)
        return 0
    if ".attn.wq." in name:
        return cfg.n_heads
    if ".attn.wk." in name:
        return cfg.kv_heads
    if ".attn.q_norm." in name or ".attn.k_norm." in name:  # OLMoE's span every head's rows
        return 1 if cfg.qk_norm_scope == "head" else (cfg.n_heads if ".q_norm." in name else cfg.kv_heads)
    return 0


def hf_linear(name: str, cfg: ModelConfig) -> tuple[str, int]:
    """Our linear `name` (a module: `layers.0.attn.wq`) as a Hugging Face module name
    (`model.layers.0.self_attn.q_proj`) and the heads whose rows the rotary reordering moves in
    its output (0: none): what an adapter on it (PEFT's lora_B rows) must follow. A Llama-like
    family only (GPT-2 fuses q, k and v into one Conv1D): ConfigError otherwise, or for a linear
    the family has no module of."""
    family = family_of_model(cfg)
    if family.adapter_refusal:
        raise ConfigError(family.adapter_refusal)
    try:
        hf = _hf_name(f"{name}.weight", naming(cfg), family.expert_style)
    except KeyError:
        raise ConfigError(f"{name} has no {family.model_type} module of its own") from None
    return hf.removesuffix(".weight"), _rope_heads(f"{name}.weight", cfg)


def _moe_style(keys) -> str:
    """How a checkpoint names its experts: "block_sparse_moe" (Mixtral's block_sparse_moe.experts.E.w1),
    "mlp" (mlp.experts.E.gate_proj) or "fused" (mlp.experts.gate_up_proj, transformers 5's modules)."""
    if any(".block_sparse_moe." in k for k in keys):
        return "block_sparse_moe"
    if any(k.endswith(".experts.gate_up_proj_bias") or ".mlp.router." in k for k in keys):
        return "packed"  # (scaletrain.model.hf_packed)
    return "fused" if any(k.endswith(".experts.gate_up_proj") for k in keys) else "mlp"


def _expert_keys(i: str, matrix: str, experts: int, style: str) -> list[str]:
    """The file's tensor names for our `layers.{i}.moe.{matrix}`: one per expert, or the fused one."""
    if style == "fused":
        return [f"model.layers.{i}.mlp.experts.{'down_proj' if matrix == 'w2' else 'gate_up_proj'}"]
    if style == "packed":
        return [packed_key(i, matrix)]
    return [f"model.layers.{i}.{style}.experts.{e}.{_EXPERT_LEAF[style][matrix]}.weight" for e in range(experts)]


def _hf_name(name: str, family: Family, style: str = "mlp") -> str:
    """Our tensor `name` as `family` names it (`style`: how its experts are named, _moe_style)."""
    if ".moe.router." in name:  # the family's gate, beside its experts (packed experts': its router)
        i, leaf = name.split(".")[1], name.rsplit(".", 1)[1]
        if style == "packed":
            return f"model.layers.{i}.mlp.router.{leaf}"
        return f"model.layers.{i}.{'mlp' if style == 'fused' else style}.gate.{leaf}"
    m = _NAME.match(name)
    if m is None and _LEAFLESS.match(name):
        i, module = _LEAFLESS.match(name).groups()
        return f"{family.layers}.{i}.{family.block[module]}"
    if m is None:
        module, leaf = name.rsplit(".", 1)
        return f"{family.top[module]}.{leaf}"
    i, module, leaf = m.groups()
    return f"{family.layers}.{i}.{family.block[module]}.{leaf}"


def _llama_keys(cfg: ModelConfig) -> list[str]:
    """The Llama names of every tensor a model of `cfg` has (its head too, tied or not)."""
    names = [_hf_name(n, naming(cfg)) for n in _expected(cfg) if not _EXPERTS.match(n)]  # (experts: own names)
    return names + ([] if "lm_head.weight" in names else ["lm_head.weight"])


def _expected(cfg: ModelConfig) -> dict[str, torch.Size]:
    """Our parameter names and shapes for cfg (a tied head listed once, as tok_emb.weight)."""
    from scaletrain.model.transformer import Transformer

    with torch.device("meta"):
        model = Transformer(cfg)
    return {name: p.shape for name, p in model.named_parameters()}


def _routing_biases(cfg: ModelConfig, family: Family) -> dict[str, str]:
    """Our routing biases (the MoE blocks' expert_bias buffers) -> the family's tensor names, for a
    family that stores them (DeepSeek-V3's e_score_correction_bias); {} otherwise."""
    if not family.routing_bias:
        return {}
    out = {f"layers.{i}.moe.expert_bias": f"{family.layers}.{i}.{family.routing_bias}"
           for i in range(cfg.n_layers) if cfg.is_moe_block(i)}
    out.update({f"mtp.{j}.block.moe.expert_bias": f"{family.layers}.{cfg.n_layers + j}.{family.routing_bias}"
                for j in range(cfg.mtp_depth) if cfg.is_moe_block(cfg.n_layers + j)})
    return out


def hf_state_dict(weights: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our parameters (named as named_parameters or state_dict names them) as the tensors of
    `hf_family(cfg)`, named as transformers saves them. GPT-2 gets zero biases where ours has
    none (the same function); a tied head is left out (transformers ties it back)."""
    family = family_of_model(cfg)
    gpt2, style = family.conv1d, family.expert_style
    out: dict[str, torch.Tensor] = {}
    packed: dict[str, dict[str, torch.Tensor]] = {}  # layer -> its expert tensors (the packed style)
    mtp_layers = _mtp_layers(cfg, family)
    for ours in _expected(cfg):
        if ours not in weights:
            raise CheckpointError(f"no tensor {ours} among the weights to export")
        t, name = weights[ours].detach(), _as_layer(ours, cfg)
        if cfg.tie_embeddings and name == "output.weight":
            continue
        experts = _EXPERTS.match(name)
        if experts and style == "packed":  # put together once the layer's are all here
            packed.setdefault(experts.group(1), {})[experts.group(2)] = t
            continue
        if experts:  # one matrix per expert, as transformers saves them
            keys = _expert_keys(experts.group(1), experts.group(2), cfg.moe_experts, style)
            out.update({key: part.contiguous() for key, part in zip(keys, t.unbind(0), strict=True)})
            continue
        heads = _rope_heads(name, cfg)
        if heads:
            t = rows_ours_to_hf(t, heads, cfg.rotary_dim)
        m = _NAME.match(name)
        if gpt2 and m and m.group(2) in ("attn.wq", "attn.wk", "attn.wv"):
            continue  # fused by the family (c_attn)
        if gpt2 and m and m.group(3) == "weight" and "norm" not in m.group(2):
            t = t.t()  # Conv1D keeps (in, out)
        out[_hf_name(name, family, style)] = t.contiguous()
    for layer, tensors in packed.items():
        out.update(pack(layer, tensors))
    for name, key in _routing_biases(cfg, family).items():  # zeros where the weights come without them
        out[key] = weights[name].detach().float().contiguous() if name in weights else torch.zeros(cfg.moe_experts)
    for layer in mtp_layers:  # each prediction module's copies of the shared embedding and head, as the files keep
        for leaf, ours in _MTP_SHARED.items():
            # (a copy of its own: safetensors refuses two names of one storage)
            out[f"{layer}.{leaf}"] = weights["tok_emb.weight" if cfg.tie_embeddings else ours].detach().clone()
    return family.saved(out, weights, cfg)  # its fused tensors put together


def from_hf_state_dict(hf: Mapping[str, torch.Tensor], cfg: ModelConfig, where: str = "the weights",
                       dtype: torch.dtype = torch.float32) -> Mapping[str, torch.Tensor]:
    """Hugging Face tensors (GPT-2 or Llama-like names, with or without the `transformer.` /
    `model.` prefix) as our parameters for `cfg`, each checked for its shape. A tensor the model
    has no place for is refused unless it is all zeros (a bias the model leaves out)."""
    layout = layout_of(hf)
    if layout is not None and layout.fused:  # GPT-NeoX, Phi-3: their fused tensors seen as Llama's (Llama 4: more)
        view = layout.llama_view(hf, cfg)
        hf = view if view is not None else FamilyView(hf, _llama_keys(cfg), cfg, layout)
    names = layout if layout is not None and layout.conv1d else naming(cfg)
    gpt2 = names.conv1d  # GPT-2's Conv1D layout: q, k, v fused in c_attn, weights transposed
    style = _moe_style(hf) if cfg.moe_experts else "mlp"
    prefix = names.prefix
    left = {k if k.startswith((prefix, "lm_head.")) else prefix + k: k  # a base model saved without its prefix
            for k in hf if not _BUFFERS.search(k)}
    used: set[str] = set()

    def take(key: str, name: str) -> str:
        if key not in left:
            raise CheckpointError(f"{where}: no tensor {key} (for {name}); does the model's config describe this "
                                  "checkpoint? (take it with model.from_hf)")
        used.add(key)
        return left[key]

    def convert(name: str, key: str, fused: int | None, transpose: bool) -> torch.Tensor:
        t = hf[key]  # read here, when this parameter is loaded
        if fused is not None:
            if t.shape[-1] != 3 * cfg.dim:
                raise CheckpointError(f"{where}: {key} has shape {tuple(t.shape)}, the model expects "
                                      f"{3 * cfg.dim} q/k/v columns")
            t = (t.t() if transpose else t).chunk(3, dim=0)[fused]
        elif transpose:
            t = t.t()  # Conv1D keeps (in, out)
        heads = _rope_heads(name, cfg)
        return (rows_hf_to_ours(t, heads, cfg.rotary_dim) if heads else t).to(dtype).contiguous()

    recipes: dict[str, tuple] = {}
    experts: dict[str, _Experts] = {}
    _check_mtp_shared(hf, left, cfg, names, where, used)
    for ours in _expected(cfg):
        name = _as_layer(ours, cfg)  # (what the files call it: a prediction module's as the layer after the last)
        m = _NAME.match(name)
        block, leaf = (m.group(2), m.group(3)) if m else (None, None)
        if _EXPERTS.match(name):
            i, matrix = _EXPERTS.match(name).groups()
            keys = [take(k, ours) for k in _expert_keys(i, matrix, cfg.moe_experts, style)]
            if style == "packed":
                experts[ours] = PackedExperts(hf, keys[0], matrix, dtype)
                continue
            experts[ours] = _Experts(hf, keys, cfg.expert_hidden if matrix == "w3" and style == "fused" else 0,
                                     cfg.expert_hidden if matrix != "w2" and style == "fused" else 0, dtype)
            continue
        if gpt2 and block in ("attn.wq", "attn.wk", "attn.wv"):
            key = take(f"{names.layers}.{m.group(1)}.{names.fused_qkv}.{leaf}", ours)
            recipes[ours] = (key, ("attn.wq", "attn.wk", "attn.wv").index(block), leaf == "weight")
        elif name == "output.weight" and _hf_name(name, names) not in left:
            recipes[ours] = (take(_hf_name("tok_emb.weight", names), ours), None, False)  # the source ties its head
        else:
            recipes[ours] = (take(_hf_name(name, names, style), ours), None,
                             bool(gpt2 and leaf == "weight" and "norm" not in block))
    shapes = _expected(cfg)
    for name, source in experts.items():  # from the headers: no tensor is read yet
        if source.shape() != tuple(shapes[name]):
            raise CheckpointError(f"{where}: the experts' tensors for {name} ({source.keys[0]}, ...) have shape "
                                  f"{source.shape()}, the model expects {tuple(shapes[name])}; take the model's shape "
                                  "from the checkpoint (model.from_hf)")
    for name, (key, fused, transpose) in recipes.items():  # from the headers: no tensor is read yet
        shape = _shape_of(hf, key)
        if fused is not None:
            if shape[-1] != 3 * cfg.dim:
                raise CheckpointError(f"{where}: {key} has shape {shape}, "
                                      f"the model expects {3 * cfg.dim} q/k/v columns")
            shape = (shape[1] // 3, shape[0]) if transpose else (shape[0] // 3, *shape[1:])
        elif transpose:
            shape = shape[::-1]
        if tuple(shape) != tuple(shapes[name]):
            raise CheckpointError(f"{where}: the tensor for {name} has shape {tuple(shape)}, the model expects "
                                  f"{tuple(shapes[name])}; take the model's shape from the checkpoint (model.from_hf)")
    def convert_part(name: str, key: str, fused: int | None, transpose: bool, index: tuple) -> torch.Tensor:
        """convert(...)[index], reading only the source elements it needs: rows of whole heads
        where the rotary permutation moves rows within a head, columns and rows swapped for
        Conv1D, an offset into the fused q/k/v columns."""
        rows, rest = index[0], index[1:]
        if rows.stop <= rows.start or any(r.stop <= r.start for r in rest):  # an empty shard (uneven sharding)
            return torch.empty([r.stop - r.start for r in index], dtype=dtype)
        heads = _rope_heads(name, cfg)
        d = shapes[name][0] // heads if heads else 1
        lo, hi = (rows.start // d) * d, -(-rows.stop // d) * d  # whole heads (d = 1: the rows themselves)
        if fused is not None:
            lo_f, hi_f = fused * cfg.dim + lo, fused * cfg.dim + hi
            t = _read(hf, key, (rest[0], slice(lo_f, hi_f))).t() if transpose else _read(hf, key, (slice(lo_f, hi_f),))
        elif transpose:
            t = _read(hf, key, (rest[0], slice(lo, hi))).t()
        else:
            t = _read(hf, key, (slice(lo, hi), *rest))
        if heads:
            t = rows_hf_to_ours(t, (hi - lo) // d, cfg.rotary_dim)
        return t[rows.start - lo:rows.stop - lo].to(dtype).contiguous()

    makers = {n: (lambda n=n, r=r: convert(n, *r)) for n, r in recipes.items()}
    part_makers = {n: (lambda index, n=n, r=r: convert_part(n, *r, index)) for n, r in recipes.items()}
    for n, source in experts.items():
        makers[n], part_makers[n] = source.full, source.part
    for n, key in _routing_biases(cfg, names).items():  # buffers, beside the parameters
        if key in left:
            source = take(key, n)
            makers[n], shapes[n] = (lambda source=source: hf[source].to(dtype).contiguous()), (cfg.moe_experts,)
    out = _Converted({n: shapes[n] for n in makers}, makers, where, part_makers, hf)
    if cfg.tie_embeddings and "lm_head.weight" in left:
        head, emb = hf[left["lm_head.weight"]], hf[left[_hf_name("tok_emb.weight", names)]]
        if head.shape != emb.shape or not torch.equal(head, emb):
            raise CheckpointError(f"{where}: lm_head.weight differs from the embedding, but model.tie_embeddings=true "
                                  "shares one; set model.tie_embeddings=false")
        used.add("lm_head.weight")
    for key in sorted(set(left) - used):
        if torch.count_nonzero(hf[left[key]]) and not names.beside_the_model(key, cfg):
            raise CheckpointError(f"{where}: tensor {key} has no place in the model; do model.bias, qkv_bias, "
                                  "qk_norm and n_layers match the checkpoint? (take them with model.from_hf)")
    return out


def _check_mtp_shared(hf: Mapping[str, torch.Tensor], left: dict[str, str], cfg: ModelConfig, names: Family,
                      where: str, used: set[str]) -> None:
    """A multi-token prediction module's layer keeps copies of the shared embedding and head (DeepSeek-V3):
    each must equal the model's own (ours are shared, not copies), else the import is refused in one line."""
    if cfg.mtp_depth and f"{names.layers}.{cfg.n_layers}.eh_proj.weight" not in left:
        raise CheckpointError(f"{where}: model.mtp_depth={cfg.mtp_depth}, but it holds no multi-token prediction "
                              f"modules ({names.layers}.{cfg.n_layers}.eh_proj.weight, ...); set model.mtp_depth=0 "
                              "(or as its config's num_nextn_predict_layers)")
    for layer in _mtp_layers(cfg, names):
        for leaf, ours in _MTP_SHARED.items():
            key, main = f"{layer}.{leaf}", _hf_name("tok_emb.weight" if cfg.tie_embeddings else ours, names)
            if key not in left:
                continue  # (a file may leave the copies out)
            if main not in left or not torch.equal(hf[left[key]], hf[left[main]]):
                raise CheckpointError(f"{where}: {key} differs from {main}; scaletrain's prediction modules share "
                                      "the model's embedding and head, so it cannot take its own")
            used.add(key)


class _Experts:
    """One of our stacked expert matrices (experts, rows, cols), from a file's tensors: one per
    expert, or transformers' fused tensor, whose rows [offset, offset + rows) it is (rows 0: all)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], keys: list[str], offset: int, rows: int,
                 dtype: torch.dtype):
        self.tensors, self.keys, self.offset, self.rows, self.dtype = tensors, keys, offset, rows, dtype

    def shape(self) -> tuple[int, ...]:
        shapes = {_shape_of(self.tensors, k) for k in self.keys}
        if len(self.keys) > 1:  # one 2-D tensor per expert, all alike
            return (len(self.keys), *shapes.pop()) if len(shapes) == 1 else (len(self.keys), -1)
        shape = shapes.pop()
        return (shape[0], self.rows or shape[1], *shape[2:]) if len(shape) == 3 else shape

    def part(self, index: tuple) -> torch.Tensor:
        """self.full()[index] (a slice per dimension), reading only those elements."""
        experts, rows, cols = index
        if len(self.keys) > 1:
            parts = [_read(self.tensors, self.keys[e], (rows, cols)) for e in range(*experts.indices(len(self.keys)))]
            t = torch.stack(parts) if parts else torch.empty(0, rows.stop - rows.start, cols.stop - cols.start)
        else:
            span = slice(self.offset + rows.start, self.offset + rows.stop)
            t = _read(self.tensors, self.keys[0], (experts, span, cols))
        return t.to(self.dtype).contiguous()

    def full(self) -> torch.Tensor:
        return self.part(tuple(slice(0, n) for n in self.shape()))


class _Converted(Mapping):
    """Our parameters by name, each converted from the source when it is asked for (and checked
    against the model's shape then): loading a model holds one tensor at a time, and a rank that
    holds some pipeline stages reads only theirs."""

    def __init__(self, shapes: Mapping[str, torch.Size], makers: Mapping[str, Any], where: str,
                 part_makers: Mapping[str, Any] | None = None, source: Mapping | None = None):
        self._shapes, self._makers, self._where = shapes, makers, where
        self._part_makers, self._source = part_makers or {}, source

    @property
    def bytes_read(self) -> int:
        """Bytes read from the files so far (0 for tensors already in memory)."""
        return getattr(self._source, "bytes_read", 0)

    @property
    def total_bytes(self) -> int:
        return getattr(self._source, "total_bytes", 0)

    def describe(self, source: str, rank: int) -> str:
        """The run log's line of what this rank read."""
        return (f"weights from {source}: rank {rank} read {self.bytes_read / 2**20:.2f} MiB of "
                f"{self.total_bytes / 2**20:.2f} MiB (its own shards of its own stages' tensors)")

    def read(self, name: str, index: tuple) -> torch.Tensor:
        """self[name][index] (index: one slice per dimension), reading only what it needs."""
        if name not in self._part_makers:
            return self[name][index]
        return self._part_makers[name](tuple(index))

    def __getitem__(self, name: str) -> torch.Tensor:
        t = self._makers[name]()
        if tuple(t.shape) != tuple(self._shapes[name]):
            raise CheckpointError(f"{self._where}: the tensor for {name} has shape {tuple(t.shape)}, the model "
                                  f"expects {tuple(self._shapes[name])}; take the model's shape from the checkpoint "
                                  "(model.from_hf)")
        return t

    def __iter__(self):
        return iter(self._makers)

    def __len__(self) -> int:
        return len(self._makers)


class _SafetensorsFiles(Lazy):
    """The tensors of some safetensors files by name; only the headers are read up front, each
    tensor when it is asked for (through the files' memory maps)."""

    def __init__(self, files: list[Path]):
        from safetensors import SafetensorError, safe_open

        self._file: dict[str, Path] = {}
        self.metadata: dict[str, str] = {}
        self.bytes_read = 0
        for f in files:
            try:
                with safe_open(str(f), framework="pt") as sf:
                    self.metadata.update(sf.metadata() or {})
                    self._file.update(dict.fromkeys(sf.keys(), f))
            except (OSError, SafetensorError) as e:
                raise CheckpointError(f"{f}: cannot be read as safetensors ({e})") from None

    @property
    def total_bytes(self) -> int:
        return sum(f.stat().st_size for f in set(self._file.values()))

    def read(self, key: str, index: tuple) -> torch.Tensor:
        """tensors[key][index] for slices with step 1: only those elements are read."""
        from safetensors import SafetensorError, safe_open

        f = self._file[key]
        try:
            with safe_open(str(f), framework="pt") as sf:
                t = sf.get_slice(key)[tuple(index)]
        except (OSError, SafetensorError) as e:
            raise CheckpointError(f"{f}: tensor {key} cannot be read ({e})") from None
        self.bytes_read += t.numel() * t.element_size()
        return t

    def shape(self, key: str) -> tuple[int, ...]:
        from safetensors import safe_open

        with safe_open(str(self._file[key]), framework="pt") as sf:
            return tuple(sf.get_slice(key).get_shape())

    def __getitem__(self, key: str) -> torch.Tensor:
        from safetensors import SafetensorError, safe_open

        f = self._file[key]
        try:
            with safe_open(str(f), framework="pt") as sf:
                t = sf.get_tensor(key)
        except (OSError, SafetensorError) as e:
            raise CheckpointError(f"{f}: tensor {key} cannot be read ({e})") from None
        self.bytes_read += t.numel() * t.element_size()
        return t

    def __iter__(self):
        return iter(self._file)

    def __len__(self) -> int:
        return len(self._file)


# --------------------------------------------------------------------------------------------
# Reading weights from disk

# config fields whose difference changes the math of weights loaded unchanged; the shape is
# checked tensor by tensor, and rope_scaling / sliding_window / max_seq_len may change on purpose
# (context extension)
_SAME_MATH = ("norm", "norm_eps", "activation", "position", "rope_theta", "qk_norm", "qk_norm_scope", "head_dim",
              "moe_top_k", "moe_score", "moe_renorm", "moe_route_scale", "norm_placement", "norm_unit_offset",
              "parallel_residual", "embed_scale", "rotary_fraction", "attn_scale_dim", "attn_softcap", "logit_softcap",
              "rope_local_theta", "global_every", "attn_sinks", "swiglu_alpha", "swiglu_limit", "moe_bias",
              "attn_chunk", "nope_every", "qk_l2_norm", "attn_temperature", "attn_temperature_floor", "moe_scale_input")


def load_hf_weights(source: str | Path, model_cfg: ModelConfig,
                    dtype: torch.dtype = torch.float32) -> Mapping[str, torch.Tensor]:
    """The full tensors of `source` under our parameter names, for a model of `model_cfg`.

    `source` is a Hugging Face model folder (model.safetensors, or shards listed in
    model.safetensors.index.json), one .safetensors file (Hugging Face names, or a `scaletrain
    export`), or a folder written by `export_hf`. Only safetensors are read (no pickles). When the
    source carries its config (config.json beside it, or a scaletrain export's metadata), fields
    that change the math must agree with model_cfg: ConfigError names the first that does not."""
    try:
        import safetensors  # noqa: F401
    except ImportError:
        raise CheckpointError("reading weights needs the safetensors package: pip install safetensors") from None
    path = Path(source)
    files, where = _weight_files(path)
    tensors = _SafetensorsFiles(files)
    meta = tensors.metadata
    if "scaletrain.model" in meta or "tok_emb.weight" in tensors:  # our own names
        if "scaletrain.model" in meta:
            try:
                theirs = json.loads(meta["scaletrain.model"])
            except json.JSONDecodeError:
                theirs = None
            if not isinstance(theirs, dict):
                raise CheckpointError(f"{where}: its scaletrain.model metadata is not a JSON object; re-export it")
            _check_same_math(model_cfg, theirs, where)
        return _ours_checked(tensors, model_cfg, where, dtype)
    config = path / CONFIG_FILE if path.is_dir() else path.parent / CONFIG_FILE
    if config.is_file():
        _check_same_math(model_cfg, model_config_from_hf(config, strict=False), str(config))
    return from_hf_state_dict(tensors, model_cfg, where, dtype)


def _weight_files(path: Path) -> tuple[list[Path], str]:
    try:
        is_dir, is_file = path.is_dir(), path.is_file()
    except (OSError, ValueError):  # a name too long for the file system, or with a NUL byte
        is_dir = is_file = False
    if is_dir:
        index, single = path / INDEX_FILE, path / WEIGHTS_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                names = sorted(set(weight_map.values()))
            except (json.JSONDecodeError, KeyError, TypeError, AttributeError, UnicodeDecodeError):
                raise CheckpointError(f"{index}: not a safetensors index (a JSON object with a weight_map)") from None
            for name in names:
                if not isinstance(name, str) or Path(name).name != name:
                    raise CheckpointError(f"{index}: shard {name!r} is not a file name in this folder")
                if not (path / name).is_file():
                    raise CheckpointError(f"{path / name}: shard listed in {INDEX_FILE} is missing")
            return [path / n for n in names], str(path)
        if single.is_file():
            return [single], str(path)
        hint = " (pickled .bin weights are not read: save them as safetensors)" if any(path.glob("*.bin")) else ""
        raise CheckpointError(f"{path}: no {WEIGHTS_FILE} nor {INDEX_FILE}{hint}")
    if is_file and path.name.endswith(".safetensors"):
        return [path], str(path)
    if is_file and path.name.endswith(INDEX_FILE):
        return _weight_files(path.parent)
    raise CheckpointError(f"{str(path)!r}: not found; give a Hugging Face model folder, a .safetensors file or "
                          "a scaletrain export")


def _check_same_math(cfg: ModelConfig, theirs: Mapping[str, Any], where: str) -> None:
    for key in _SAME_MATH + ("bias", "qkv_bias"):
        mine, other = getattr(cfg, key), theirs.get(key, getattr(ModelConfig, key))
        if key == "head_dim":  # compare the widths in use
            mine = cfg.head_size
            other = other or theirs.get("dim", cfg.dim) // max(1, theirs.get("n_heads", cfg.n_heads))
        if mine != other:
            raise ConfigError(f"model.{key}={_option(mine)} differs from {where} ({_option(other)}), whose weights "
                              f"would compute something else; set --model.{key}={_option(other)} or take the shape "
                              "with model.from_hf")


def _option(value: Any) -> str:
    """A value as the command line writes it (true, not True)."""
    return json.dumps(value) if isinstance(value, bool) else str(value)


def _ours_checked(tensors: Mapping[str, torch.Tensor], cfg: ModelConfig, where: str,
                  dtype: torch.dtype) -> Mapping[str, torch.Tensor]:
    shapes = _expected(cfg)
    for name in shapes:
        if name not in tensors:
            raise CheckpointError(f"{where}: no tensor {name}; does model.* describe this export?")
        if tuple(_shape_of(tensors, name)) != tuple(shapes[name]):
            raise CheckpointError(f"{where}: tensor {name} has shape {tuple(_shape_of(tensors, name))}, the model "
                                  f"expects {tuple(shapes[name])}")
    out = _Converted(shapes, {n: (lambda n=n: tensors[n].to(dtype).contiguous()) for n in shapes}, where,
                     {n: (lambda index, n=n: _read(tensors, n, index).to(dtype).contiguous()) for n in shapes}, tensors)
    extra = sorted(set(tensors) - set(out) - ({"output.weight"} if cfg.tie_embeddings else set()))
    if extra:
        raise CheckpointError(f"{where}: tensor {extra[0]} has no place in the model; does model.* describe "
                              "this export?")
    return out
