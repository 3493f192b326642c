"""Hugging Face families that fuse projections into one tensor, seen through Llama's names:
GPT-NeoX (q, k and v per head in `query_key_value`) and Phi-3 (`qkv_proj`, `gate_up_proj`).
Import reads each part from its rows of the fused tensor (`FamilyView`, only those rows where
a rank reads a slice); export puts the parts back (`fuse`). scaletrain.model.hf does the rest.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from scaletrain.model.config import ModelConfig

_NEOX_BLOCK = {"input_layernorm": "input_layernorm", "post_attention_layernorm": "post_attention_layernorm",
               "self_attn.o_proj": "attention.dense", "mlp.gate_proj": "mlp.dense_h_to_4h",
               "mlp.down_proj": "mlp.dense_4h_to_h"}
# (the head: transformers 5 saves lm_head, older checkpoints such as Pythia's embed_out; both are read)
_NEOX_TOP = {"model.embed_tokens.": "gpt_neox.embed_in.", "model.norm.": "gpt_neox.final_layer_norm."}
_LLAMA_KEY = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")


def fused_family(keys) -> str | None:
    """"gpt_neox" or "phi3" when a checkpoint's names are theirs, else None."""
    if any(k.startswith("gpt_neox.") for k in keys):
        return "gpt_neox"
    return "phi3" if any(k.endswith(("self_attn.qkv_proj.weight", "mlp.gate_up_proj.weight")) for k in keys) else None


def family_key(key: str, family: str, cfg: ModelConfig) -> tuple[str, list[tuple[int, int]] | None]:
    """Where the tensor Llama calls `key` lives in `family`'s checkpoint: (its name, the row ranges
    of it that make `key`, concatenated; None = all of it).

    GPT-NeoX fuses q, k and v per head: the rows of head h are [q_h; k_h; v_h] (it views the output
    as (heads, 3 * head_size) and chunks each), so q is every head's first head_size rows. Phi-3
    stacks them whole ([q; k; v]) and its MLP's gate and up projections alike ([gate; up])."""
    d, q, kv = cfg.head_size, cfg.n_heads * cfg.head_size, cfg.kv_heads * cfg.head_size
    m = _LLAMA_KEY.match(key)
    if family == "gpt_neox":
        if m is None:
            top = next((t for t in _NEOX_TOP if key.startswith(t)), None)
            return (_NEOX_TOP[top] + key[len(top):], None) if top else (key, None)
        i, module, leaf = m.groups()
        parts = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
        if module in parts:
            j = parts.index(module)
            return (f"gpt_neox.layers.{i}.attention.query_key_value.{leaf}",
                    [(h * 3 * d + j * d, h * 3 * d + (j + 1) * d) for h in range(cfg.n_heads)])
        return f"gpt_neox.layers.{i}.{_NEOX_BLOCK.get(module, module)}.{leaf}", None
    if m is None:
        return key, None
    i, module, leaf = m.groups()
    f = cfg.hidden_dim
    fused = {"self_attn.q_proj": ("self_attn.qkv_proj", (0, q)),
             "self_attn.k_proj": ("self_attn.qkv_proj", (q, q + kv)),
             "self_attn.v_proj": ("self_attn.qkv_proj", (q + kv, q + 2 * kv)),
             "mlp.gate_proj": ("mlp.gate_up_proj", (0, f)), "mlp.up_proj": ("mlp.gate_up_proj", (f, 2 * f))}
    if module in fused:
        name, rows = fused[module]
        return f"model.layers.{i}.{name}.{leaf}", [rows]
    return key, None


class Lazy(Mapping):
    """Tensors by name that are read when asked for, a part at a time (`read`) if need be."""

    def read(self, key: str, index: tuple) -> torch.Tensor:
        raise NotImplementedError

    def shape(self, key: str) -> tuple[int, ...]:
        raise NotImplementedError


class FamilyView(Lazy):
    """A GPT-NeoX or Phi-3 checkpoint under Llama's names (`family_key`): a fused tensor appears
    as the parts it holds, each read from its rows alone. Tensors no Llama name points at keep
    their own names, so that the import still refuses one with no place in the model."""

    def __init__(self, source: Mapping[str, torch.Tensor], llama_keys: list[str], cfg: ModelConfig, family: str):
        """`llama_keys`: the Llama names of every tensor the model has."""
        self.source = source
        self.parts = {k: family_key(k, family, cfg) for k in llama_keys}
        if "lm_head.weight" not in source and "embed_out.weight" in source:  # GPT-NeoX's older name
            self.parts["lm_head.weight"] = ("embed_out.weight", None)
        self.parts = {k: v for k, v in self.parts.items() if v[0] in source}
        used = {v[0] for v in self.parts.values()}
        self.parts.update({k: (k, None) for k in source if k not in used})

    @property
    def bytesread_part(self) -> int:
        return getattr(self.source, "bytes_read", 0)

    @property
    def total_bytes(self) -> int:
        return getattr(self.source, "total_bytes", 0)

    def shape(self, key: str) -> tuple[int, ...]:
        source, ranges = self.parts[key]
        shape = shape_of(self.source, source)
        return shape if ranges is None else (sum(b - a for a, b in ranges), *shape[1:])

    def read(self, key: str, index: tuple) -> torch.Tensor:
        source, ranges = self.parts[key]
        if ranges is None:
            return read_part(self.source, source, index)
        rows, rest = index[0], tuple(index[1:])
        start, stop = rows.indices(self.shape(key)[0])[:2]
        pieces, at = [], 0  # `at`: where each range begins among our rows
        for a, b in ranges:
            lo, hi = max(start, at), min(stop, at + b - a)
            if lo < hi:
                pieces.append(read_part(self.source, source, (slice(a + lo - at, a + hi - at), *rest)))
            at += b - a
        if not pieces:
            return read_part(self.source, source, (slice(0, 0), *rest))
        return torch.cat(pieces, 0)

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.read(key, tuple(slice(0, n) for n in self.shape(key)))

    def __iter__(self):
        return iter(self.parts)

    def __len__(self) -> int:
        return len(self.parts)


def fuse(tensors: Mapping[str, torch.Tensor], cfg: ModelConfig, family: str) -> dict[str, torch.Tensor]:
    """Llama-named tensors as `family` saves them: the parts of a fused tensor put back in its rows."""
    out: dict[str, torch.Tensor] = {}
    fused: dict[str, list[tuple[list[tuple[int, int]], torch.Tensor]]] = {}
    for key, t in tensors.items():
        name, ranges = family_key(key, family, cfg)
        if ranges is None:
            out[name] = t
        else:
            fused.setdefault(name, []).append((ranges, t))
    for name, parts in fused.items():
        rows = max(b for ranges, _ in parts for _, b in ranges)
        whole = parts[0][1].new_empty(rows, *parts[0][1].shape[1:])
        for ranges, t in parts:
            at = 0
            for a, b in ranges:
                whole[a:b] = t[at:at + b - a]
                at += b - a
        out[name] = whole
    return out


def read_part(tensors: Mapping[str, torch.Tensor], key: str, index: tuple) -> torch.Tensor:
    """tensors[key][index], reading only that part where the source is a file (or a view of one)."""
    return tensors.read(key, index) if isinstance(tensors, Lazy) else tensors[key][index]


def shape_of(tensors: Mapping[str, torch.Tensor], key: str) -> tuple[int, ...]:
    return tensors.shape(key) if isinstance(tensors, Lazy) else tuple(tensors[key].shape)
