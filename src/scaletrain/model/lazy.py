"""Tensors by name that are read when asked for, a part at a time: the protocol the Hugging Face
import reads its sources through (a safetensors file, a family's view of one), in a module of its
own so that a family file (scaletrain.model.families) can offer such a view without importing
the import's modules."""

from __future__ import annotations

from collections.abc import Mapping

import torch


class Lazy(Mapping):
    """Tensors by name that are read when asked for, a part at a time (`read`) if need be."""

    def read(self, key: str, index: tuple) -> torch.Tensor:
        raise NotImplementedError

    def shape(self, key: str) -> tuple[int, ...]:
        raise NotImplementedError


def read_part(tensors: Mapping[str, torch.Tensor], key: str, index: tuple) -> torch.Tensor:
    """tensors[key][index], reading only that part where the source is a file (or a view of one)."""
    return tensors.read(key, index) if isinstance(tensors, Lazy) else tensors[key][index]


def shape_of(tensors: Mapping[str, torch.Tensor], key: str) -> tuple[int, ...]:
    return tensors.shape(key) if isinstance(tensors, Lazy) else tuple(tensors[key].shape)
