"""`scaletrain export`: a checkpoint's model weights as one safetensors file.

The weights are gathered on the CPU in fp32 (bf16-true runs export their fp32 master copy);
the model config travels in the file's metadata under "scaletrain.model".
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from scaletrain.config import from_dict
from scaletrain.errors import CheckpointError
from scaletrain.model.transformer import Transformer
from scaletrain.train import checkpoint as ckpt


def load_model_from_checkpoint(path: str | Path) -> Transformer:
    """A plain fp32 CPU model with the weights of checkpoint `path`."""
    path = Path(path)
    state = ckpt.read_trainer_state(path)
    cfg = from_dict(state["config"])
    model = Transformer(cfg.model)
    model.init_buffers("cpu")
    tensors = {"model": {name: p for name, p in model.named_parameters()}}
    with torch.no_grad():
        ckpt.load_tensors(path, tensors)
    return model


def export_safetensors(path: str | Path, out: str | Path) -> Path:
    try:
        from safetensors.torch import save_file
    except ImportError:
        raise CheckpointError("export needs the safetensors package: pip install safetensors") from None
    out = Path(out)
    if out.exists():
        raise CheckpointError(f"{out} already exists; choose another --out (nothing was overwritten)")
    model = load_model_from_checkpoint(path)
    # named_parameters lists a tied weight once, under its first name (tok_emb.weight)
    weights = {name: p.detach().contiguous() for name, p in model.named_parameters()}
    meta = {"scaletrain.model": json.dumps(from_dict(ckpt.read_trainer_state(path)["config"]).to_dict()["model"]),
            "format": "pt"}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.partial-{os.getpid()}")
    save_file(weights, str(tmp), metadata=meta)
    os.replace(tmp, out)
    return out
