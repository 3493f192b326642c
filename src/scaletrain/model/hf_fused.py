"""Hugging Face families that fuse projections into one tensor (GPT-NeoX's `query_key_value`,
Phi-3's `qkv_proj` and `gate_up_proj`), seen through Llama's names: where each part lives is the
family's `fused_key` (scaletrain.model.families). Import reads each part from its rows of the
fused tensor (`FamilyView`, only those rows where a rank reads a slice); export puts the parts
back (the family's `saved`). scaletrain.model.hf does the rest.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from scaletrain.model.config import ModelConfig
from scaletrain.model.families import Family
from scaletrain.model.lazy import Lazy, read_part, shape_of

__all__ = ["FamilyView", "Lazy", "read_part", "shape_of"]  # (the protocol lives in scaletrain.model.lazy)


class FamilyView(Lazy):
    """A GPT-NeoX or Phi-3 checkpoint under Llama's names (`fused_key`): a fused tensor appears
    as the parts it holds, each read from its rows alone. Tensors no Llama name points at keep
    their own names, so that the import still refuses one with no place in the model."""

    def __init__(self, source: Mapping[str, torch.Tensor], llama_keys: list[str], cfg: ModelConfig,
                 family: Family):
        """`llama_keys`: the Llama names of every tensor the model has."""
        self.source = source
        self.parts = {k: family.fused_key(k, cfg) for k in llama_keys}
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
