"""`scaletrain quantize SOURCE --scheme S --out DIR`: a checkpoint (or a `scaletrain export`
file) quantized after training, written as a folder `scaletrain eval` and `load_quantized` read.

A checkpoint trained with train.qat holds weights that learned to live with the scheme's
rounding: quantizing it is QAT's convert step (torchao's `QATConfig(step="convert")` does the same:
back to plain linears, then the scheme's own quantization).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from scaletrain.config import DataConfig, from_dict
from scaletrain.errors import CheckpointError
from scaletrain.model.config import model_config
from scaletrain.model.transformer import Transformer
from scaletrain.quant.layers import describe
from scaletrain.quant.ptq import is_quantized_folder, quantize_model, save_quantized
from scaletrain.vocab import QUANT_SCHEMES, unknown


def quantize_source(source: str | Path, scheme: str, out: str | Path, *, overwrite: bool = False,
                    report=print) -> Path:
    """Quantize checkpoint or export `source` by `scheme` into folder `out`; the layer rule's
    lines go to `report`."""
    if scheme not in QUANT_SCHEMES:
        raise CheckpointError(f"--scheme: {unknown('quantization scheme', scheme, QUANT_SCHEMES)}")
    source = Path(source)
    if Path(out).exists() and not overwrite:  # before anything is read (save_quantized checks again)
        raise CheckpointError(f"--out {out} already exists; choose another --out, or add --overwrite to replace it "
                              "(nothing was overwritten)")
    model, config, origin = load_source(source)
    qat = config.get("train", {}).get("qat", "none")
    if qat not in ("none", scheme):
        raise CheckpointError(f"{source} was trained with train.qat={qat}: its weights learned that scheme's "
                              f"rounding; quantize it with --scheme {qat} (or train with train.qat={scheme})")
    plan = quantize_model(model, scheme)
    for line in describe(plan, scheme):
        report(line)
    return save_quantized(model, plan, scheme, out, {"config": config, **origin}, overwrite=overwrite)


def load_source(source: Path) -> tuple[Transformer, dict, dict]:
    """(plain fp32 model, the run's config as a dict, where it came from) of a checkpoint folder
    or an exported safetensors file; anything else is refused in one line."""
    if source.is_dir() and is_quantized_folder(source):
        raise CheckpointError(f"{source} is already quantized; quantize the checkpoint or export it came from")
    if source.is_file():
        return _from_export(source)
    from scaletrain.train import checkpoint as ckpt
    from scaletrain.trained.export import load_model_from_checkpoint

    state = ckpt.read_trainer_state(source)  # one line if it is not a checkpoint
    model = load_model_from_checkpoint(source)
    # the data folders found, if the run folder moved with them: eval of the quantized folder reads them
    return model, ckpt.saved_config(source, state), {"source": str(source), "step": int(state["step"]),
                                    "global_batch": int(state["data"]["global_batch"])}


def _from_export(path: Path) -> tuple[Transformer, dict, dict]:
    """A `scaletrain export` file: its weights and the model config in its metadata. The data
    config is the default one (eval takes --data)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta, names = f.metadata() or {}, list(f.keys())
            tensors = {n: f.get_tensor(n) for n in names}
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{path} is not a model: neither a checkpoint folder nor a safetensors file written "
                              f"by scaletrain export ({type(e).__name__}); give one of those") from None
    if "scaletrain.model" not in meta:
        raise CheckpointError(f"{path} is not a scaletrain model: its safetensors metadata has no scaletrain.model "
                              "(written by scaletrain export); give a checkpoint folder or such a file")
    try:
        model_values = json.loads(meta["scaletrain.model"])
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: its scaletrain.model metadata is not valid JSON ({e.msg}); export the "
                              "checkpoint again") from None
    if not isinstance(model_values, dict):
        raise CheckpointError(f"{path}: its scaletrain.model metadata is not a table of model keys; export the "
                              "checkpoint again")
    model = model_config(model_values, source=str(path))
    # the file holds no data config: the default one, its windows no longer than the model reads
    fits = min(DataConfig.seq_len, model.max_seq_len)
    config = from_dict({"model": model_values, "data": {"seq_len": fits}}, source=str(path)).to_dict()
    model = Transformer(from_dict(config).model)
    model.init_buffers("cpu")
    params = dict(model.named_parameters())
    if set(tensors) != set(params) or any(tensors[n].shape != p.shape for n, p in params.items()):
        raise CheckpointError(f"{path}: its tensors do not match the model its metadata describes; export the "
                              "checkpoint again")
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(tensors[n])
    return model, config, {"source": str(path), "step": None, "global_batch": config["train"]["global_batch"] or 32}
