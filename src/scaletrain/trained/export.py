"""`scaletrain export`: a checkpoint's model weights as one safetensors file.

The weights are gathered on the CPU in fp32 (bf16-true runs export their fp32 master copy);
the model config travels in the file's metadata under "scaletrain.model".
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch

from scaletrain import atomic
from scaletrain.config import from_dict
from scaletrain.data.tokenizer import identity_of_data
from scaletrain.errors import CheckpointError, UserError, user_error_from_os
from scaletrain.model.transformer import Transformer
from scaletrain.train import checkpoint as ckpt


def load_model_from_checkpoint(path: str | Path, base: str | Path | None = None) -> Transformer:
    """A plain fp32 CPU model with the weights of checkpoint `path`; an adapter checkpoint's
    adapters merged into their base (`base`: where it is now, if not where training read it)."""
    path = Path(path)
    state = ckpt.read_trainer_state(path)
    if isinstance(state.get("adapter"), dict):  # adapters alone: on their base, merged
        from scaletrain.trained.adapters import adapted_model

        return adapted_model(path, base)[0]
    if base is not None:
        raise CheckpointError(f"--base {base}: {path} holds a whole model, not adapters; drop --base")
    cfg = from_dict(state["config"])
    model = Transformer(cfg.model)
    model.init_buffers("cpu")
    tensors = {"model": {name: p for name, p in model.named_parameters()}}
    with torch.no_grad():
        ckpt.load_tensors(path, tensors)
    return model


def export_safetensors(path: str | Path, out: str | Path, *, overwrite: bool = False,
                       base: str | Path | None = None) -> Path:
    """Write checkpoint `path`'s weights to the file `out` (its folder created if need be), whole
    or not at all: they go to a hidden file beside it, renamed when complete and removed on any
    failure; an existing `out` is replaced only with `overwrite`. The file's mode is the umask's."""
    try:
        from safetensors.torch import save_file
    except ImportError:
        raise CheckpointError("export needs the safetensors package: pip install safetensors") from None
    out = Path(out)
    _check_target(out, overwrite)  # before the checkpoint is read
    model = load_model_from_checkpoint(path, base)
    # named_parameters lists a tied weight once, under its first name (tok_emb.weight)
    weights = {name: p.detach().contiguous() for name, p in model.named_parameters()}
    cfg = from_dict(ckpt.saved_config(path, ckpt.read_trainer_state(path)))  # the data, found if it moved
    meta = {"scaletrain.model": json.dumps(cfg.to_dict()["model"]), "format": "pt"}
    tokenizer = identity_of_data(cfg.data.path)
    if tokenizer is not None:  # which tokenizer the ids mean (model.init_from checks it against its data)
        meta["scaletrain.tokenizer"] = tokenizer
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with atomic.replacing(out, sweep=True) as tmp:
            save_file(weights, str(tmp), metadata=meta)
            atomic.usual_mode(tmp)
    except BaseException as e:
        code = e.errno if isinstance(e, OSError) else _os_error_code(e)
        if code is not None and (error := user_error_from_os(OSError(code, os.strerror(code), str(out)),
                                                             {"--out": out})) is not None:
            raise error from None
        raise
    return out


def _os_error_code(e: BaseException) -> int | None:
    """The errno inside safetensors' own error type ("I/O error: ... (os error 28)")."""
    found = re.search(r"\(os error (\d+)\)", str(e)) if type(e).__name__ == "SafetensorError" else None
    return int(found.group(1)) if found else None


def _check_target(out: Path, overwrite: bool = False) -> None:
    if out.is_dir():
        raise UserError(f"--out {out} is a folder; give a file name, e.g. {out / 'model.safetensors'}")
    if (out.exists() or out.is_symlink()) and not overwrite:
        raise UserError(f"--out {out} already exists; choose another --out, or add --overwrite to replace it "
                        "(nothing was overwritten)")
    folder = out.parent
    while not folder.exists() and folder.parent != folder:  # created when writing: check where it will be
        folder = folder.parent
    if not folder.is_dir():
        raise UserError(f"--out {out}: {folder} is a file, not a folder; choose another --out")
    if not os.access(folder, os.W_OK):  # read-only disk or no permission (root passes the latter)
        reason = "is on a read-only file system" if _read_only(folder) else "is not writable (permission denied)"
        raise UserError(f"--out {out}: the folder {folder} {reason}; choose another --out")


def _read_only(folder: Path) -> bool:
    try:
        return bool(os.statvfs(folder).f_flag & os.ST_RDONLY)
    except OSError:
        return False
